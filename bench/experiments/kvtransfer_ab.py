"""Paired A/B of KV pulls between two checkouts (or two settings of one), in one run.

On a shared, noisy host two runs of `bench/kvtransfer/kvtransfer.py` minutes apart differ by more
than most changes to the transfer path do. Here each side is a source process and a puller process
of its own checkout (`PYTHONPATH`), started side by side and pulled alternately (A, B, B, A, ...):
every pair of pulls sees the same machine, and the ratio B/A of each pair is what is reported
(median), beside each side's median pull time. Half the pairs run with A's processes started first,
half with B's (a fresh start each): with the same code on both sides, the side started second read
5-10% faster, run after run. An idle side costs nothing (UCX runs on the event loop, which sleeps).
Each pull is the bench's: a real ChunkSource serving one layer's K and V from a KV cache allocated
as the checkout's engine does, into another, and a real KvPuller, CRC-32C checked on both ends, over
UCX shared memory with the workers' settings; a side waits idle between its pulls, so a pull here
includes waking two processes (small pulls read slower than in bench/kvtransfer/kvtransfer.py).

    python bench/experiments/kvtransfer_ab.py --a /path/to/old/checkout --b . --size-mib 64 \
        --chunk-kb 8192

`--a-env`/`--b-env NAME=VALUE` set a variable for one side only; `--block-kb 16` serves blocks of
the `small` preset's size (default 512 KiB, bench/kvtransfer/kvtransfer.py's). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
KVTRANSFER = HERE.parents[1] / "kvtransfer" / "kvtransfer.py"  # the KV transfer bench


async def puller_side(size: int, chunk_bytes: int) -> None:
    """One side's puller: the handles on stdin's first line, then a pull per line, its
    milliseconds printed."""
    from google.protobuf.json_format import ParseDict

    # this checkout's KV transfer bench, by path: its `cache` allocates a KV cache with the
    # checkout's engine (PYTHONPATH), as the source does
    spec = importlib.util.spec_from_file_location("kvtransfer_bench", KVTRANSFER)
    kvtransfer_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kvtransfer_bench)
    cache = kvtransfer_bench.cache

    from services.common.gen.distserve.v1 import common_pb2
    from services.common.kv_handle import KvHandle
    from services.kvtransfer.layout import KvDestination
    from services.kvtransfer.puller import KvPuller, PullPolicy

    loop = asyncio.get_running_loop()
    served = json.loads(sys.stdin.readline())
    handle = KvHandle.from_pb(ParseDict(served["handles"][str(size)], common_pb2.KvHandle()))
    puller = KvPuller(PullPolicy(chunk_bytes=chunk_bytes), "ucx")
    blocks = handle.num_blocks
    dst = KvDestination(cache(blocks).data, range(1))
    await puller.pull(handle, list(range(blocks)), dst)  # connects
    print("ready", flush=True)
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip():
        t = time.perf_counter()
        await puller.pull(handle, list(range(blocks)), dst)
        print(f"{(time.perf_counter() - t) * 1e3:.3f}", flush=True)
    await puller.close()


def start_side(root: str, extra_env: list[str], size: int, chunk_kb: int) -> tuple:
    from services.kvtransfer.ucx_setup import UCX_DEFAULTS

    root = os.path.abspath(root)
    env = {**UCX_DEFAULTS, **os.environ, "UCX_TLS": "tcp,sm,cma,self", "PYTHONPATH": root}
    env.update(kv.split("=", 1) for kv in extra_env)
    # the side's KV transfer bench: bench/kvtransfer/ since the suites' folders, bench/ before
    bench = os.path.join(root, "bench", "kvtransfer", "kvtransfer.py")
    if not os.path.exists(bench):
        bench = os.path.join(root, "bench", "kvtransfer.py")
    source = subprocess.Popen(
        [sys.executable, bench, "--serve", str(size)],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    puller = subprocess.Popen(
        [sys.executable, str(HERE), "--puller", str(size), "--chunk-kb", str(chunk_kb)],
        cwd=root,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    puller.stdin.write(source.stdout.readline())
    puller.stdin.flush()
    if puller.stdout.readline().strip() != "ready":
        raise SystemExit(f"the puller of {root} did not start")
    return source, puller


def pull_once(puller) -> float:
    puller.stdin.write("go\n")
    puller.stdin.flush()
    return float(puller.stdout.readline())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--puller", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--a", default=".", help="checkout A (default: this one)")
    ap.add_argument("--b", default=".", help="checkout B (default: this one)")
    ap.add_argument("--a-env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--size-mib", type=int, default=64, help="KV per pull (K and V, one layer)")
    ap.add_argument("--chunk-kb", type=int, default=8192)
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument(
        "--block-kb", type=int, help="KiB a block of K or V (bench/kvtransfer/kvtransfer.py's)"
    )
    args = ap.parse_args()
    # both sides' processes read it at import (bench/kvtransfer/kvtransfer.py's BLOCK)
    if args.block_kb:
        os.environ["KV_BENCH_BLOCK_KB"] = str(args.block_kb)
    if args.puller:
        asyncio.run(puller_side(args.puller, args.chunk_kb * 1024))
        return
    sys.path.insert(0, str(HERE.parents[2]))
    size = args.size_mib * 2**20
    times: list[list[float]] = [[], []]
    for first in (0, 1):  # each side started first once: the one started second ran faster
        sides: list = [None, None]
        try:
            for k in (first, 1 - first):
                sides[k] = start_side(
                    *((args.a, args.a_env), (args.b, args.b_env))[k], size, args.chunk_kb
                )
            for i in range(args.pairs // 2):
                for k in (0, 1) if i % 2 == 0 else (1, 0):
                    times[k].append(pull_once(sides[k][1]))
        finally:
            for side in sides:
                if side is not None:
                    for process in side:
                        process.kill()
    a, b = (statistics.median(t) for t in times)
    result = {
        "bench": "kvtransfer_ab",
        "a": args.a,
        "b": args.b,
        "a_env": args.a_env,
        "b_env": args.b_env,
        "size_mib": args.size_mib,
        "chunk_kb": args.chunk_kb,
        "block_kb": int(os.environ.get("KV_BENCH_BLOCK_KB", "512")),
        "pairs": args.pairs,
        "cpu_count": os.cpu_count(),
        "median_ms": {"a": round(a, 2), "b": round(b, 2)},
        "gb_s": {"a": round(size / a / 1e6, 2), "b": round(size / b / 1e6, 2)},
        "b_over_a_median": round(statistics.median(y / x for x, y in zip(*times, strict=True)), 3),
    }
    print(
        f"{args.size_mib} MiB in {args.chunk_kb} KiB chunks, {args.pairs} pairs: A {a:.2f} ms "
        f"({result['gb_s']['a']} GB/s), B {b:.2f} ms ({result['gb_s']['b']} GB/s), B/A "
        f"{result['b_over_a_median']}",
        file=sys.stderr,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
