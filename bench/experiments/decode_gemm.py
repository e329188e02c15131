"""Decode step time by batch size with the small-batch GEMM forms tuned (services/engine/gemm.py)
against F.linear everywhere (`--no-tune-gemm`), in one run.

Two engines on the same weights in this process (`small` preset by default: 12 layers, 105M
parameters, fp32, 420 MB of weights read per decode step: memory-bound), pinned to one core with
one torch thread as a `--pin` worker runs. For each batch size, both engines take turns: a
round is `--steps` decode steps of each at context `--context`, and the median step over
`--rounds` rounds is kept, so that both see the same machine. Prints a table and one JSON line
(`decode_step_ms`, `speedup_by_batch`, `tune_seconds`).

    .venv/bin/python bench/experiments/decode_gemm.py [--model small] [--batches 1,2,3,4,6,8,16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.report import cpu_model
from services.engine.config import EngineConfig, configure_process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="a preset name or a model folder")
    parser.add_argument("--batches", default="1,2,3,4,5,6,8,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cpu = sorted(os.sched_getaffinity(0))[-1]
    configure_process(argparse.Namespace(cpu=cpu, threads=1, engine="torch"))

    from services.engine.engine import LLMEngine
    from services.engine.gemm import plan_text
    from services.engine.presets import PRESETS, default_model
    from services.planner.profiler import _kv_bytes, _Runner

    model = default_model(args.model) if args.model in PRESETS else Path(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    tokens = max(batches) * (args.context + args.steps * args.rounds + 4)
    runners, tune_s = {}, None
    for name, tune in (("linear", False), ("tuned", True)):
        start = time.perf_counter()
        config = EngineConfig(
            max_batch_tokens=tokens,
            max_num_seqs=max(batches),
            kv_cache_bytes=_kv_bytes(model, tokens),
            tune_gemm=tune,
        )
        engine = LLMEngine(model, config, detokenize=False)
        if tune:
            tune_s = round(time.perf_counter() - start, 2)
            forms = engine.gemm_forms
        runners[name] = _Runner(engine)
        runners[name].prefill_ms([16], 2)  # warm-up
    ms: dict[str, dict[int, float]] = {name: {} for name in runners}
    for b in batches:
        samples: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, runner in runners.items():
                samples[name] += [s for _, _, s in runner.decode_steps(b, args.context, args.steps)]
        for name in runners:
            ms[name][b] = round(statistics.median(samples[name]), 2)
    print(f"model {model.name}, context {args.context}, one pinned core ({cpu_model()})")
    print(
        f"tuned in {tune_s} s: transposed form for "
        + "; ".join(f"{o}x{i} rows {plan_text(r)}" for (o, i), r in forms.items() if r)
    )
    print(f"{'batch':>5} {'F.linear ms':>12} {'tuned ms':>9} {'speedup':>8}")
    for b in batches:
        print(
            f"{b:>5} {ms['linear'][b]:>12.1f} {ms['tuned'][b]:>9.1f} "
            f"{ms['linear'][b] / ms['tuned'][b]:>7.2f}x"
        )
    print(
        json.dumps(
            {
                "bench": "decode_gemm",
                "model": model.name,
                "cpu": cpu_model(),
                "cpu_count": os.cpu_count(),
                "context": args.context,
                "rounds": args.rounds,
                "tune_seconds": tune_s,
                "transposed_rows": {f"{o}x{i}": r for (o, i), r in forms.items()},
                "decode_step_ms": ms,
                "speedup_by_batch": {
                    b: round(ms["linear"][b] / ms["tuned"][b], 3) for b in batches
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
