"""Tracing overhead benchmark: the same load with tracing off and on, in one run.

Three meshes of 1 prefill + 1 decode (the `small` preset, each worker pinned to a core with
`--pin`: every mesh's prefill shares one core, every decode the other), identical but for
tracing:
  * off: no exporter configured (no span is created);
  * file: every span appended to a JSON-lines file (`DISTSERVE_TRACE_FILE`);
  * otlp: every span exported over OTLP/gRPC to a receiver in a process of its own that counts
    them (tests/otlp_receiver.py, `count_only`): a collector runs elsewhere in production, here it
    shares the two cores, so it does the least a collector does (decode each export and count);
    in the load generator's process it would slow the client, not the mesh.
The three are loaded at once, each with `--concurrency` streamed requests of `--new-tokens`
tokens in flight all the time (a new one starts as one ends), straight to its gateway over gRPC
(the gateway's admission off, see GATEWAY_ARGS), for `--seconds` a round; then a pause of three
export delays, so that a round's spans (and, for OTLP, the receiver's decoding) are exported
and paid for in that round. At once, because run one after the other (this bench until
2026-12-02) identical meshes came out 0.75-1.55x apart round by round: the host's speed and the
decode batching regime of the moment (1-4 decode steps per request) differ between two 10 s
stretches far more than 3%, while meshes sharing the same stretch share both. Per round and
mesh: tokens/s, and the CPU (user + system, all threads, from /proc) its gateway, prefill and
decode took per request; the overhead is 1 - the median over rounds of (traced / off in the same
round), with a 90% interval (bootstrap over rounds), for throughput and for CPU per request.
On a saturated host the two are one cost seen twice; the CPU pairing comes out the tighter.
The meshes are started afresh `--restarts` times, each first, second and third in turn (in
bench/experiments/kvtransfer_ab.py processes started second ran 5-10% faster, same code).
`--control` runs the same bench with no mesh traced: how far apart identical meshes come out here.
Also the TTFT p50 of sequential 2-token requests on each mesh (alone), and how requests shared
steps: decode steps per request, the mean decode and prefill batch (the workers'
`distserve_engine_step_*` metrics), and the mean TTFT under the load (the gateway's histogram),
medians over rounds: a traced mesh could lose throughput by batching worse rather than by its spans'
work. Traced meshes export every second (`--export-delay-s`; the SDK's default is 5 s, which rounds
of 10 s could not hold). The model is the `small` preset by default (105M parameters, 16 streams a
mesh, 12 rounds of 20 s): one whose prefill computes and whose decode reads its weights every step,
as a served model's do. `--model tiny` (64 streams, 18 rounds of 10 s) serves the tiny preset, where
a request costs only the mesh's own work (~35 ms of CPU, all of it RPCs, queues and Python): the
worst case for tracing's share, reported beside `small`. Prints a table and one JSON line
(`tracing_overhead_fraction`: the worse of file and otlp, throughput). Run: `python
bench/tracing/tracing.py` (about 8 minutes here; tiny about 6)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


from bench.tracing.load import Receiver, counters, cpu_by_process, load_together
from distserve.loadgen.probes import sequential_ttft_and_gap
from distserve.loadgen.report import host
from distserve.local_mesh import Mesh, MeshSpec
from services.common.stats import percentile
from services.engine.presets import default_model

# KV cache per worker, by preset: room for every stream's prompt and tokens.
KV_CACHE_MB = {"tiny": 64, "small": 256}
# Per model, the load's defaults: --concurrency, --seconds, --rounds (small: ~8 minutes, tiny ~6)
LOAD = {"small": (16, 20.0, 12), "tiny": (64, 10.0, 18)}
# Exports every second. At 0.1 s (this bench's default until 2026-12-02) OTLP cost 8.5-10.6% of
# throughput and its workers +10-12% CPU per request, over gRPC and HTTP alike; at 1 s, the same
# day, within the noise (two runs pooled: file +1.6%, otlp -3.2%; `--export-delay-s 0.1`
# measures the old setting): frequent exports cost a deployment too, but a deployment batches
# as the SDK does (5 s).
EXPORT_DELAY_S = 1.0
# Admission off: the bench compares throughput, and a refusal (the cost line is noisy when two
# cores are shared by everything) would end a round early.
GATEWAY_ARGS = ("--admission-ttft-factor", "0")
# Load on freshly started meshes before the first round: connections, UCX endpoints, allocations.
WARMUP_S = 3.0


def bootstrap(values: list[float], q: float = 0.05, n: int = 2000) -> tuple[float, float]:
    """The q and 1-q quantiles of the median of `values` resampled with replacement (seeded)."""
    rng = random.Random(1)
    medians = [statistics.median(rng.choices(values, k=len(values))) for _ in range(n)]
    return percentile(medians, 100 * q), percentile(medians, 100 * (1 - q))


def start(model: Path, env: dict[str, str], kv_cache_mb: int) -> Mesh:
    kv_gib = kv_cache_mb / 1024
    spec = MeshSpec(
        model=model,
        gateway_port=0,
        pin=True,
        worker_args=("--kv-cache-gib", str(kv_gib), "--max-num-seqs", "64"),
        gateway_args=GATEWAY_ARGS,
        env=env,
    )
    mesh = Mesh(spec)
    mesh.start()
    return mesh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        choices=sorted(KV_CACHE_MB),
        default="small",
        help="the embedded preset served (small, 105M: prefill and decode do real work; tiny: "
        "the mesh's own work is all a request costs, the worst case for tracing's share)",
    )
    ap.add_argument("--rounds", type=int, help="default: 12 on small, 18 on tiny")
    ap.add_argument(
        "--restarts",
        type=int,
        default=3,
        help="start the meshes this many times, in a rotated order (rounds split evenly)",
    )
    ap.add_argument(
        "--seconds", type=float, help="the length of a round (default: 20 on small, 10 on tiny)"
    )
    ap.add_argument(
        "--prompts", type=int, default=384, help="distinct prompts, taken in turn by each mesh"
    )
    ap.add_argument(
        "--concurrency", type=int, help="streams per mesh (default: 16 on small, 64 on tiny)"
    )
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
    for name, value in zip(("concurrency", "seconds", "rounds"), LOAD[args.model], strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    model, kv_mb = default_model(args.model), KV_CACHE_MB[args.model]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 900, (16,), generator=gen).tolist() for _ in range(args.prompts)]
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
            steps: dict[str, list[tuple[float, float, float, float]]] = {n: [] for n in names}
            ttft: dict[str, float] = {}

            def load(seconds: float) -> dict[str, int]:
                addresses = {name: m.gateway_address for name, m in meshes.items()}
                return asyncio.run(
                    load_together(addresses, prompts, args.new_tokens, args.concurrency, seconds)
                )

            for r in range(args.rounds):
                if r % per_start == 0:
                    for mesh in meshes.values():
                        mesh.stop()
                    k = (r // per_start) % len(names)
                    first = names[k:] + names[:k]
                    print(f"starting the meshes: {', '.join(first)}", flush=True)
                    meshes = {name: start(model, envs[name], kv_mb) for name in first}
                    load(WARMUP_S)  # connections, UCX endpoints, allocations
                    time.sleep(3 * args.export_delay_s)
                before = {name: (cpu_by_process(m), counters(m)) for name, m in meshes.items()}
                counts = load(args.seconds)
                time.sleep(3 * args.export_delay_s)  # the round's last spans go out
                for name, mesh in meshes.items():
                    cpu_before, counted_before = before[name]
                    tokens = max(1, counts[name])
                    rates[name].append(tokens / args.seconds)
                    d = {k: v - counted_before.get(k, 0.0) for k, v in counters(mesh).items()}
                    # decode steps per request of new_tokens tokens, mean batch of each kind,
                    # mean TTFT of the round's requests (ms)
                    steps[name].append(
                        (
                            d["decode_steps"] / tokens * args.new_tokens,
                            d["decode_seqs"] / max(1.0, d["decode_steps"]),
                            d["prefill_seqs"] / max(1.0, d["prefill_steps"]),
                            d.get("ttft_sum", 0.0) * 1000 / max(1.0, d.get("ttft_count", 0.0)),
                        )
                    )
                    for proc, seconds in cpu_by_process(mesh).items():
                        per_request = (seconds - cpu_before[proc]) / tokens * args.new_tokens
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
                    sequential_ttft_and_gap(mesh.gateway_address, prompt, args.ttft_requests)
                )
                ttft[name] = percentile(t, 50) * 1000
        finally:
            for mesh in meshes.values():
                mesh.stop()
    exported = receiver.spans
    traced_lines = sum(1 for _ in spans_file.open()) if spans_file.exists() else 0
    shutil.rmtree(tmp, ignore_errors=True)
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
    print(f"hardware: {host()}")
    print(
        f"model: {args.model} (embedded), requests of {args.new_tokens} tokens, "
        f"{args.concurrency} in flight on each mesh, all meshes at once, "
        f"{args.rounds} rounds of {args.seconds:g} s, meshes started {args.restarts} times"
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
            key: round(statistics.median(row[i] for row in v), 2)
            for i, key in enumerate(
                ("decode_steps_per_request", "mean_decode_batch", "mean_prefill_batch", "ttft_ms")
            )
        }
        for name, v in steps.items()
    }
    print("medians over rounds: decode steps per request, mean decode batch, mean prefill batch,")
    print("  mean TTFT under the load (ms):")
    for n, v in step_use.items():
        print(f"  {n:8} " + "  ".join(f"{x:.2f}" for x in v.values()))
    print("target: throughput cost <= 3%")
    result = {
        "bench": "tracing",
        "model": args.model,
        "cpu_count": os.cpu_count(),
        "rounds": args.rounds,
        "seconds_per_round": args.seconds,
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
        "batching": step_use,
        "decode_steps_per_request_by_round": {
            n: [round(row[0], 2) for row in v] for n, v in steps.items()
        },
        "ttft_ms_by_round": {n: [round(row[3], 1) for row in v] for n, v in steps.items()},
        "tracing_overhead_fraction": round(max(overhead.values()), 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
