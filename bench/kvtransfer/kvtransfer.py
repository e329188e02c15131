"""KV transfer benchmark: bandwidth of each transport, and the handoff on the small model.

In one run:
  * effective bandwidth of a pull between two processes (a real ChunkSource serving one
    layer's K and V from a KV cache allocated as the engine's is, into another: `cache`; a real
    KvPuller with the workers' default chunk size, window and lanes (two on this 2-core host,
    one with --pin), or --chunk-mib/--window; CRC-32C
    checked on both ends; blocks of 512 KiB, or --block-kb) for 1 MiB .. 1 GiB over UCX tcp
    (UCX_TLS=tcp), UCX shared memory (UCX_TLS=tcp,sm,cma,self: tcp only to connect) and the gRPC
    fallback, beside memcpy measured in the same run (512 MiB, before and after: the faster is
    the reference; and, for comparison, a memcpy of each size); medians of 3-100 pulls after a
    warm-up (`enough`). UCX
    runs with the workers' settings (services.kvtransfer.ucx_setup.UCX_DEFAULTS); the two
    processes are left to the scheduler, or with `--pin` pinned to a core each, as a mesh's
    `--pin` workers are (on 2 cores pinning costs the transport: each process's copying,
    hashing and event loop then share one core);
  * over each UCX transport, the transport alone: one UCX message of the whole size between
    the same two processes (no chunks, no checksums), so the pull's own cost shows;
  * the handoff on the `small` model (1 prefill + 1 decode, pinned, direct Prefill and Decode
    calls): prefill compute time and pull time (prefill finished -> KV resident on decode) for
    512-, 2048- and 4000-token prompts (the preset's context is 4096). Direct calls pull after
    prefill (the JSON says `overlap`: false); the layer-wise overlap is bench/handoff/handoff.py's.
Prints a table, then one JSON line. Run: `make bench-kvtransfer`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.kvtransfer.handoff import handoff
from distserve.loadgen.report import cpu_model, log
from services.kvtransfer.puller import PullPolicy

SIZES_MIB = [1, 4, 16, 64, 256, 1024]
# bytes of one block of the bench's one layer, K or V (--block-kb; children read it from the
# environment). 512 KiB by default; the `small` preset's blocks are 16 KiB a layer (16 tokens, 4
# KV heads of 64 float32): more blocks a chunk, whose CRCs the source combines.
BLOCK = int(os.environ.get("KV_BENCH_BLOCK_KB", "512")) * 2**10
TRANSPORTS = {
    "ucx_tcp": {"UCX_TLS": "tcp"},
    "ucx_sm": {"UCX_TLS": "tcp,sm,cma,self"},
    "grpc": {},
}


def memcpy_gb_s(nbytes: int = 512 * 2**20) -> float:
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def cache(blocks: int):
    """A KV cache as the engine allocates one (services.engine.kv_cache: on the host, memory
    the kernel may back with huge pages), of one layer whose blocks are BLOCK bytes each of K
    and V: data (1, 2, blocks, block_size 1, one head, BLOCK)."""
    from services.engine.kv_cache import KvCache

    return KvCache(
        num_layers=1,
        num_blocks=blocks,
        block_size=1,
        num_kv_heads=1,
        head_dim=BLOCK,
        dtype=torch.uint8,
        device=torch.device("cpu"),
    )


# -- the source process: serves every size from one buffer, each size its own block range -------


async def serve(sizes: list[int]) -> None:
    from google.protobuf.json_format import MessageToDict

    from services.common.gen.distserve.v1 import kvtransfer_pb2_grpc
    from services.common.kv_handle import KvHandle
    from services.common.server import start_server
    from services.kvtransfer.chunk_server import ChunkServer
    from services.kvtransfer.leases import LeaseTable
    from services.kvtransfer.servicer import KvTransferServicer
    from services.kvtransfer.source import ChunkSource

    kv = cache(sum(s // (2 * BLOCK) for s in sizes))
    rng = np.random.default_rng(0)
    kv.data.view(-1).numpy()[:] = rng.integers(0, 255, kv.data.numel(), dtype=np.uint8)
    leases = LeaseTable(default_s=3600, max_s=3600)
    source = ChunkSource(leases, kv.region, num_layers=1, heads=range(1))
    ucx = ChunkServer(source)
    ucx_port = ucx.start()
    raw_listener = raw_server(kv.data.view(-1).numpy())  # kept alive below

    async def free(lease) -> int:
        return 0

    def add(server) -> None:
        kvtransfer_pb2_grpc.add_KvTransferServicer_to_server(
            KvTransferServicer(leases, free, source), server
        )

    _server, _, port = await start_server("127.0.0.1", 0, add, [])  # kept alive below
    handles = {}
    first = 0
    for size in sizes:
        blocks = size // (2 * BLOCK)
        template = KvHandle(
            handle_id="",
            source_instance="bench-source",
            control_address=f"127.0.0.1:{port}",
            ucx_host="127.0.0.1",
            ucx_port=ucx_port,
            num_tokens=blocks,
            block_size=1,
            num_layers=1,
            num_kv_heads=1,
            head_dim=BLOCK // 4,
            dtype="float32",
            runs=((first, blocks),),
            block_bytes=BLOCK,
            lease_expiry_unix_ms=0,
            access_token="",
        )
        handles[size] = MessageToDict(leases.create(f"size-{size}", template).to_pb())
        first += blocks
    print(json.dumps({"raw_port": raw_listener.port, "handles": handles}), flush=True)
    await asyncio.Event().wait()  # until the parent kills us


def raw_server(data: np.ndarray):
    """The transport alone, for comparison: a plain UCX listener (the mesh's, on the event
    loop) that answers an 8-byte size with one message of that many bytes (no chunks, no
    checksums, no protocol)."""
    from services.kvtransfer import ucx_loop

    async def serve_endpoint(ep) -> None:
        ask = np.empty(1, dtype=np.int64)
        try:
            while True:
                await ep.recv(ask)
                await ep.send(data[: int(ask[0])], 1)
        except Exception:
            pass  # the puller closed its endpoint

    return ucx_loop.worker().listen(serve_endpoint)


def enough(times: list[float]) -> bool:
    """Whether a size has been timed enough: 3 times, and then up to 100 until 1.5 s is spent
    (a median of 3 swung by 40% between runs minutes apart on this shared host; with at most 15,
    the median of 64 MiB pulls was of 0.15 s of them, and read 46.8-57.7% of memcpy in five runs
    of one code, the 256 MiB and 1 GiB ones, of ~0.7 s and 1.5 s, 51.3-56.4%)."""
    return len(times) >= 3 and (len(times) >= 100 or sum(times) >= 1.5)


async def raw_pull(port: int, sizes: list[int]) -> dict[int, float]:
    from services.kvtransfer import ucx_loop

    ep = await ucx_loop.worker().connect("127.0.0.1", port)
    rates = {}
    for size in sizes:
        dst = cache(size // (2 * BLOCK)).data.view(-1).numpy()  # the source's kind of memory
        times = []
        while not enough(times[1:]):  # the first is a warm-up
            t = time.perf_counter()
            await ep.send(np.array([size], dtype=np.int64))
            await ep.recv(dst, 1)
            times.append(time.perf_counter() - t)
        rates[size] = size / statistics.median(times[1:]) / 1e9
    await ep.close()
    return rates


# -- the puller process ---------------------------------------------------------------------------


async def pull(transport: str, served: dict, policy: PullPolicy) -> dict[str, dict[int, float]]:
    from google.protobuf.json_format import ParseDict

    from services.common.gen.distserve.v1 import common_pb2
    from services.common.kv_handle import KvHandle
    from services.kvtransfer.layout import KvDestination
    from services.kvtransfer.puller import KvPuller
    from services.kvtransfer.ucx_setup import shutdown_ucx

    kind = "grpc" if transport == "grpc" else "ucx"
    puller = KvPuller(policy, kind)
    rates = {}
    for size_s, pb in served["handles"].items():
        size = int(size_s)
        handle = KvHandle.from_pb(ParseDict(pb, common_pb2.KvHandle()))
        blocks = handle.num_blocks
        dst = KvDestination(cache(blocks).data, range(1))
        await puller.pull(handle, list(range(blocks)), dst)  # warm-up; connects
        times = []
        while not enough(times):
            t = time.perf_counter()
            await puller.pull(handle, list(range(blocks)), dst)
            times.append(time.perf_counter() - t)
        rates[size] = size / statistics.median(times) / 1e9
        log(f"{transport:8} {size >> 20:5} MiB: {rates[size]:6.2f} GB/s")
    await puller.close()
    raw = await raw_pull(served["raw_port"], sorted(rates)) if kind == "ucx" else {}
    shutdown_ucx()
    return {"pull": rates, "raw": raw}


def _pinned(cpu: int | None):
    """A subprocess `preexec_fn` pinning it to `cpu` (None: no pinning)."""
    if cpu is None:
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


def bandwidth(
    transport: str, sizes: list[int], chunk_mib: int, window: int, pin: bool
) -> dict[str, dict[int, float]]:
    """GB/s by size of a pull ("pull") and, over UCX, of the transport alone ("raw")."""
    from services.kvtransfer.ucx_setup import UCX_DEFAULTS  # what the workers run with

    env = {**UCX_DEFAULTS, **os.environ, **TRANSPORTS[transport]}
    cmd = [sys.executable, os.path.abspath(__file__)]
    cpus = sorted(os.sched_getaffinity(0))
    source_cpu, puller_cpu = (cpus[0], cpus[-1]) if pin and len(cpus) > 1 else (None, None)
    source = subprocess.Popen(
        [*cmd, "--serve", ",".join(map(str, sizes))],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_pinned(source_cpu),
    )
    try:
        handles = source.stdout.readline()
        result = subprocess.run(
            [*cmd, "--pull", transport, "--chunk-mib", str(chunk_mib), "--window", str(window)],
            input=handles,
            capture_output=True,
            text=True,
            env=env,
            preexec_fn=_pinned(puller_cpu),
        )
        if result.returncode:
            sys.stderr.write(result.stderr[-3000:])
            raise SystemExit(f"the {transport} puller failed")
        measured = json.loads(result.stdout.splitlines()[-1])
        return {kind: {int(k): v for k, v in r.items()} for kind, r in measured.items()}
    finally:
        source.kill()
        source.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--pull", help=argparse.SUPPRESS)
    ap.add_argument("--sizes-mib", default=",".join(map(str, SIZES_MIB)))
    ap.add_argument("--handoff-lengths", default="512,2048,4000")
    ap.add_argument("--chunk-mib", type=int, default=PullPolicy.chunk_bytes >> 20)
    ap.add_argument("--window", type=int, default=PullPolicy.window)
    ap.add_argument("--block-kb", type=int, help="KiB a block of K or V (default 512)")
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="pin the source and the puller to one core each, as --pin workers are",
    )
    args = ap.parse_args()
    if args.block_kb:  # for the source and puller processes, which read it at import
        os.environ["KV_BENCH_BLOCK_KB"] = str(args.block_kb)
    if args.serve:
        asyncio.run(serve([int(s) for s in args.serve.split(",")]))
        return
    if args.pull:
        policy = PullPolicy(chunk_bytes=args.chunk_mib * 2**20, window=args.window)
        rates = asyncio.run(pull(args.pull, json.loads(sys.stdin.read()), policy))
        print(json.dumps(rates))
        return

    sizes = [int(s) * 2**20 for s in args.sizes_mib.split(",")]
    # memcpy before and after the transports: the fractions are of the faster of the two (the
    # host's speed swings by 20-30% within minutes here; one reading made them swing as much)
    memcpys = [memcpy_gb_s()]
    log(f"memcpy {memcpys[0]:.2f} GB/s")
    measured = {t: bandwidth(t, sizes, args.chunk_mib, args.window, args.pin) for t in TRANSPORTS}
    memcpys.append(memcpy_gb_s())
    log(f"memcpy {memcpys[1]:.2f} GB/s")
    memcpy = max(memcpys)
    # And memcpy of each size, for comparison only: glibc copies with ordinary stores below a
    # threshold it derives from the cache size it is told of, with non-temporal ones above it;
    # here a 64 MiB copy ran at 6.3 GB/s and a 256 MiB one at 11 (the kernel's copy between
    # processes, CMA, makes ordinary stores at any size).
    same_size = {s: memcpy_gb_s(s) for s in sizes}
    rates = {t: m["pull"] for t, m in measured.items()}
    raw = {t: m["raw"] for t, m in measured.items() if m["raw"]}

    from distserve.local_mesh import Mesh, MeshSpec
    from services.engine.presets import default_model

    lengths = [int(x) for x in args.handoff_lengths.split(",")]
    spec = MeshSpec(
        model=default_model("small"),
        prefill=1,
        decode=1,
        gateway_port=0,
        pin=True,
        worker_args=("--kv-cache-gib", "1", "--max-batch-tokens", "4096"),
    )
    with Mesh(spec) as mesh:
        p = next(w.ready["address"] for w in mesh.workers if w.name.startswith("prefill"))
        d = next(w.ready["address"] for w in mesh.workers if w.name.startswith("decode"))
        hand = asyncio.run(handoff(p, d, lengths))

    cpu = cpu_model()
    print(
        f"\nKV transfer benchmark: {cpu}, {os.cpu_count()} cpus; memcpy {memcpy:.2f} GB/s "
        f"(before / after the transports: {memcpys[0]:.2f} / {memcpys[1]:.2f})"
    )
    print(
        f"pulls ({args.chunk_mib} MiB chunks of {BLOCK >> 10} KiB blocks, window {args.window}, "
        "checksummed), and raw: one"
    )
    print("UCX message of the whole size, the transport alone; memcpy of each size in one process")
    columns = [(t, rates[t]) for t in TRANSPORTS] + [(f"{t}_raw", r) for t, r in raw.items()]
    columns.append(("memcpy", same_size))
    print(f"{'size':>10}" + "".join(f"{name:>12}" for name, _ in columns) + "   GB/s")
    for s in sizes:
        print(f"{s >> 20:>7} MiB" + "".join(f"{r[s]:>12.2f}" for _, r in columns))
    print("\nhandoff, small model (105M, float32), no layer-wise overlap:")
    for n, h in hand.items():
        frac = h["pull_ms"] / h["prefill_ms"]
        print(
            f"  {n:5} tokens: KV {h['kv_bytes'] / 2**20:6.1f} MiB, prefill {h['prefill_ms']:7.0f} "
            f"ms, pull after it {h['pull_ms']:7.1f} ms ({frac:.1%} of prefill)"
        )
    at = 64 * 2**20
    result = {
        "bench": "kvtransfer",
        "cpu": cpu,
        "memcpy_gb_s": round(memcpy, 2),
        "memcpy_gb_s_before_after": [round(m, 2) for m in memcpys],
        "memcpy_same_size_gb_s": {str(s >> 20): round(r, 3) for s, r in same_size.items()},
        "gb_s": {t: {str(s >> 20): round(r, 3) for s, r in rates[t].items()} for t in rates},
        "raw_gb_s": {t: {str(s >> 20): round(v, 3) for s, v in raw[t].items()} for t in raw},
        "pinned": args.pin,
        "chunk_mib": args.chunk_mib,
        "block_kb": BLOCK >> 10,
        "window": args.window,
        "ucx_sm_fraction_of_memcpy_64MiB": round(rates["ucx_sm"][at] / memcpy, 3)
        if at in sizes
        else None,
        "ucx_sm_raw_fraction_of_memcpy_64MiB": round(raw["ucx_sm"][at] / memcpy, 3)
        if at in sizes
        else None,
        "ucx_sm_fraction_of_same_size_memcpy_64MiB": round(rates["ucx_sm"][at] / same_size[at], 3)
        if at in sizes
        else None,
        "ucx_over_grpc_64MiB": round(
            max(rates["ucx_sm"][at], rates["ucx_tcp"][at]) / rates["grpc"][at], 2
        )
        if at in sizes
        else None,
        "handoff": {str(n): h for n, h in hand.items()},
        "overlap": False,
        "handoff_after_prefill_fraction_2048": round(
            hand[2048]["pull_ms"] / hand[2048]["prefill_ms"], 4
        )
        if 2048 in hand
        else None,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
