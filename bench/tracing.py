"""Tracing overhead benchmark: the same load with tracing off and on, in one run.

Three meshes of 1 prefill + 1 decode (tiny model, each worker pinned to its own core with
`--pin`; only one mesh is busy at a time), identical but for tracing:
  * off: no exporter configured (no span is created);
  * file: every span appended to a JSON-lines file (`DISTSERVE_TRACE_FILE`);
  * otlp: every span exported over OTLP/gRPC to a receiver in a process of its own that counts
    them (tests/otlp_receiver.py, `count_only`): a collector runs elsewhere in production, here it
    shares the two cores, so it does the least a collector does (decode each export and count);
    in the load generator's process it would slow the client, not the mesh.
Load per round: `--requests` streamed requests of `--new-tokens` tokens, `--concurrency` in
flight all the time (a new one starts as one ends), straight to the gateway over gRPC; the
gateway's admission is off (see GATEWAY_ARGS). Each round runs every mesh once, in a shuffled
order (seeded), so that all see the same machine and none always goes first; the overhead is 1 -
the median over rounds of (traced / off in the same round): paired, so a round the whole machine
was slow in counts for nothing; beside it a 90% interval (bootstrap over rounds). The meshes are
started afresh `--restarts` times, each mesh first, second and third in turn (in
bench/kvtransfer_ab.py the processes started second ran 5-10% faster, same code: a fixed start
order could pass for a cost or hide one). `--control` runs the same bench with no mesh traced:
how far apart identical meshes come out here. Also the TTFT p50 of sequential 2-token requests
on each mesh, and where the cost lands: CPU time per request of each process (gateway, prefill,
decode; from /proc), median over rounds; and how requests shared decode steps: decode steps per
request and the mean decode batch (the decode worker's `distserve_engine_step_*` metrics),
median over rounds, since a traced mesh could lose throughput by batching worse rather than by
its spans' work (on 2 cores the same load has run between ~900 and ~6,000 decode steps a round,
either way).
Traced meshes export every second (`--export-delay-s`; the SDK's default is 5 s, which rounds of
~10 s could not hold) and each round ends with a pause of three of those, so that a mesh's
exports (and, for OTLP, the receiver's decoding) fall in its own round, never in the next
mesh's. `--concurrency 1` holds the batching fixed (every request decodes alone). Prints a
table and one JSON line (`tracing_overhead_fraction`: the worse of file and otlp).
Run: `python bench/tracing.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from bench.mesh import mesh_ttft_and_gap, pct
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.engine.presets import default_model
from services.launcher import Mesh, MeshSpec

WORKER_ARGS = ("--kv-cache-mb", "64", "--max-num-seqs", "64")
# Exports every second. At 0.1 s (this bench's default until 2026-12-02) OTLP cost 8.5-10.6% of
# throughput and its workers +10-12% CPU per request, over gRPC and HTTP alike; at 1 s, the same
# day, within the noise (two runs pooled: file +1.6%, otlp -3.2%; docs/benchmarks.md): frequent
# exports cost a deployment too, but a deployment batches as the SDK does (5 s).
EXPORT_DELAY_S = 1.0
# Admission off: the bench compares throughput, and a refusal (the cost line is noisy when two
# cores are shared by everything) would end a round early.
GATEWAY_ARGS = ("--admission-ttft-factor", "0")


def decode_steps(mesh: Mesh) -> tuple[float, float]:
    """(decode steps, sequences over those steps) the mesh's decode worker has run so far."""
    proc = next(p for p in mesh.workers if p.name.startswith("decode"))
    found = {s.name: s.value for s in proc.metrics() if s.labels.get("kind") == "decode"}
    steps = found.get("distserve_engine_step_seconds_count", 0.0)
    return steps, found.get("distserve_engine_step_batch_size_sum", 0.0)


def cpu_seconds(mesh: Mesh) -> dict[str, float]:
    """CPU time (user + system, all threads) each process of the mesh has used so far."""
    out = {}
    for p in mesh.processes:
        fields = Path(f"/proc/{p.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[p.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


async def steady_rate(address: str, prompts: list[list[int]], new: int, concurrency: int) -> float:
    """Streamed tokens/s with `concurrency` requests in flight until `prompts` run out."""
    todo = list(reversed(prompts))
    params = common_pb2.SamplingParams(max_tokens=new, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def client() -> int:
            n = 0
            while todo:
                ids = gateway_pb2.TokenIds(ids=todo.pop())
                async for r in stub.Generate(
                    gateway_pb2.GenerateRequest(token_ids=ids, sampling=params)
                ):
                    n += len(r.token_ids)
            return n

        t = time.perf_counter()
        counts = await asyncio.gather(*(client() for _ in range(concurrency)))
        return sum(counts) / (time.perf_counter() - t)


class Receiver:
    """The test OTLP receiver (tests/otlp_receiver.py), counting, in a process of its own."""

    def __enter__(self) -> Receiver:
        root = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.otlp_receiver"],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = json.loads(self.proc.stdout.readline())
        self.endpoint, self.http_endpoint = ready["endpoint"], ready["http_endpoint"]
        self.spans = 0
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self.proc.communicate(input="", timeout=60)
        self.spans = json.loads(out.strip().splitlines()[-1])["spans"] if out.strip() else 0


def bootstrap(values: list[float], q: float = 0.05, n: int = 2000) -> tuple[float, float]:
    """The q and 1-q quantiles of the median of `values` resampled with replacement (seeded)."""
    rng = random.Random(1)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return medians[int(q * n)], medians[int((1 - q) * n) - 1]


def start(model: Path, env: dict[str, str]) -> Mesh:
    spec = MeshSpec(
        model=model,
        gateway_port=0,
        pin=True,
        worker_args=WORKER_ARGS,
        gateway_args=GATEWAY_ARGS,
        env=env,
    )
    mesh = Mesh(spec)
    mesh.start()
    return mesh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=18)
    ap.add_argument(
        "--restarts",
        type=int,
        default=3,
        help="start the meshes this many times, in a rotated order (rounds split evenly)",
    )
    ap.add_argument("--requests", type=int, default=384, help="streamed requests per round")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ttft-requests", type=int, default=50)
    ap.add_argument(
        "--export-delay-s",
        type=float,
        default=EXPORT_DELAY_S,
        help="the traced meshes' OTEL_BSP_SCHEDULE_DELAY, in seconds",
    )
    ap.add_argument(
        "--otlp-protocol",
        choices=("grpc", "http/protobuf"),
        default="grpc",
        help="the otlp mesh's OTEL_EXPORTER_OTLP_PROTOCOL",
    )
    ap.add_argument(
        "--control",
        action="store_true",
        help="an A/A/A control: the same three meshes, none traced (the bench's own bias)",
    )
    args = ap.parse_args()
    model = default_model("tiny")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 900, (16,), generator=gen).tolist() for _ in range(args.requests)]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DISTSERVE_TRACE"))}
    os.environ.clear()
    os.environ.update(base)  # the meshes inherit this environment, plus their own
    tmp = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    spans_file = tmp / "spans.jsonl"
    with Receiver() as receiver:
        # Spans leave within the export delay, so that a round's exports run in that round and
        # the pause after it, not in the next mesh's round.
        export = {"OTEL_BSP_SCHEDULE_DELAY": str(int(args.export_delay_s * 1000))}
        envs = {
            "off": {},
            "file": {**export, "DISTSERVE_TRACE_FILE": str(spans_file)},
            "otlp": {
                **export,
                "OTEL_EXPORTER_OTLP_PROTOCOL": args.otlp_protocol,
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint
                if args.otlp_protocol.startswith("http")
                else f"http://{receiver.endpoint}",
            },
        }
        if args.control:
            envs = {name: {} for name in envs}
        names = list(envs)
        meshes: dict[str, Mesh] = {}
        per_start = -(-args.rounds // max(1, args.restarts))
        try:
            rates: dict[str, list[float]] = {name: [] for name in names}
            cpu: dict[str, dict[str, list[float]]] = {name: {} for name in names}
            steps: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
            ttft: dict[str, float] = {}

            def load(address: str) -> float:
                return asyncio.run(steady_rate(address, prompts, args.new_tokens, args.concurrency))

            order = random.Random(0)
            for r in range(args.rounds):
                if r % per_start == 0:
                    for mesh in meshes.values():
                        mesh.stop()
                    k = (r // per_start) % len(names)
                    first = names[k:] + names[:k]
                    print(f"starting the meshes: {', '.join(first)}", flush=True)
                    meshes = {name: start(model, envs[name]) for name in first}
                    for mesh in meshes.values():  # warm-up: connections, UCX endpoints
                        load(mesh.gateway_address)
                for name in order.sample(list(meshes), len(meshes)):
                    mesh = meshes[name]
                    before, steps_before = cpu_seconds(mesh), decode_steps(mesh)
                    rates[name].append(load(mesh.gateway_address))
                    time.sleep(3 * args.export_delay_s)  # its last spans go out
                    n, seqs = (a - b for a, b in zip(decode_steps(mesh), steps_before, strict=True))
                    steps[name].append((n / len(prompts), seqs / n if n else 0.0))
                    for proc, seconds in cpu_seconds(mesh).items():
                        per_request = (seconds - before[proc]) / len(prompts)
                        cpu[name].setdefault(proc, []).append(per_request)
                print(
                    f"round {r + 1}/{args.rounds}: "
                    + ", ".join(f"{n} {v[-1]:,.0f} tok/s" for n, v in rates.items()),
                    flush=True,
                )
            prompt = prompts[0]
            for name in names:
                mesh = meshes[name]
                t, _ = asyncio.run(
                    mesh_ttft_and_gap(mesh.gateway_address, prompt, args.ttft_requests)
                )
                ttft[name] = pct(t, 0.5) * 1000
        finally:
            for mesh in meshes.values():
                mesh.stop()
    exported = receiver.spans
    traced_lines = sum(1 for _ in spans_file.open()) if spans_file.exists() else 0
    median = {name: statistics.median(v) for name, v in rates.items()}
    paired = {
        name: [t / o for t, o in zip(rates[name], rates["off"], strict=True)]
        for name in ("file", "otlp")
    }
    overhead = {name: 1 - statistics.median(v) for name, v in paired.items()}
    # 90% interval of the paired overhead, resampling rounds
    interval = {name: [1 - x for x in reversed(bootstrap(v))] for name, v in paired.items()}

    def mesh_cpu(name: str, r: int) -> float:
        return sum(v[r] for v in cpu[name].values())

    # The same pairing for the CPU a request takes (all processes of the mesh): steadier than
    # throughput on a shared host (the scheduler's and the neighbours' noise is not counted).
    cpu_paired = {
        name: [mesh_cpu(name, r) / mesh_cpu("off", r) - 1 for r in range(args.rounds)]
        for name in ("file", "otlp")
    }
    cpu_overhead = {name: statistics.median(v) for name, v in cpu_paired.items()}
    cpu_interval = {name: bootstrap(v) for name, v in cpu_paired.items()}
    print()
    print(f"hardware: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}")
    print(
        f"model: tiny (embedded), {args.requests} requests x {args.new_tokens} tokens per round, "
        f"{args.concurrency} at once, {args.rounds} rounds, meshes started {args.restarts} times"
        + (" (CONTROL: no mesh traced)" if args.control else "")
    )
    print(
        f"{'tracing':8} {'tok/s (median)':>15} {'overhead':>9} {'90% interval':>17} "
        f"{'TTFT p50 ms':>12}"
    )
    for name in names:
        o = f"{overhead[name]:+.1%}" if name in overhead else "baseline"
        lo_hi = "[{:+.1%}, {:+.1%}]".format(*interval[name]) if name in interval else ""
        print(f"{name:8} {median[name]:15,.0f} {o:>9} {lo_hi:>17} {ttft[name]:12.2f}")
    print(f"spans exported: {traced_lines} to the file, {exported} over OTLP")
    cpu_ms = {
        name: {proc: round(statistics.median(v) * 1000, 3) for proc, v in procs.items()}
        for name, procs in cpu.items()
    }
    print(
        "CPU per request, paired by round: "
        + ", ".join(
            f"{name} {v:+.1%} [{cpu_interval[name][0]:+.1%}, {cpu_interval[name][1]:+.1%}]"
            for name, v in cpu_overhead.items()
        )
    )
    print("CPU ms per request (median over rounds):")
    for name, procs in cpu_ms.items():
        print(f"  {name:8} " + "  ".join(f"{proc} {ms:.2f}" for proc, ms in procs.items()))
    # Whether tracing changes how requests share decode steps (a knock-on, not a cost of its own).
    step_use = {
        name: {
            "per_request": round(statistics.median(x for x, _ in v), 2),
            "mean_batch": round(statistics.median(y for _, y in v), 2),
        }
        for name, v in steps.items()
    }
    print(
        "decode steps per request, mean decode batch (medians over rounds): "
        + ", ".join(
            f"{n} {v['per_request']:.1f}, {v['mean_batch']:.1f}" for n, v in step_use.items()
        )
    )
    print("target: throughput cost <= 3%")
    result = {
        "bench": "tracing",
        "model": "tiny",
        "cpu_count": os.cpu_count(),
        "rounds": args.rounds,
        "requests_per_round": args.requests,
        "new_tokens": args.new_tokens,
        "concurrency": args.concurrency,
        "export_delay_s": args.export_delay_s,
        "control": args.control,
        "restarts": args.restarts,
        "otlp_protocol": args.otlp_protocol,
        "tok_per_s_off": round(median["off"], 1),
        "tok_per_s_file": round(median["file"], 1),
        "tok_per_s_otlp": round(median["otlp"], 1),
        "overhead_file": round(overhead["file"], 4),
        "overhead_otlp": round(overhead["otlp"], 4),
        "overhead_interval_90": {k: [round(x, 4) for x in v] for k, v in interval.items()},
        "tok_per_s_by_round": {k: [round(x) for x in v] for k, v in rates.items()},
        "ttft_p50_ms": {k: round(v, 3) for k, v in ttft.items()},
        "spans_file": traced_lines,
        "spans_otlp": exported,
        "cpu_ms_per_request": cpu_ms,
        "cpu_overhead": {k: round(v, 4) for k, v in cpu_overhead.items()},
        "cpu_overhead_interval_90": {k: [round(x, 4) for x in v] for k, v in cpu_interval.items()},
        "decode_steps": step_use,
        "decode_steps_by_round": {
            n: [round(x * len(prompts)) for x, _ in v] for n, v in steps.items()
        },
        "tracing_overhead_fraction": round(max(overhead.values()), 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
