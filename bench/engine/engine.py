"""Engine benchmark: prefill and decode throughput beside Hugging Face transformers.

On the `small` preset (~100M parameters, float32, CPU) in one run:
  * prefill tokens/s for one prompt of 128, 512 and 2048 tokens (ours: one prefill batch;
    transformers: one forward with use_cache), medians of several runs;
  * decode tokens/s at batch 1, 8 and 32 with mixed context lengths, 32 new tokens each: ours
    with paged KV and continuous batching, transformers `generate` on the same left-padded batch
    (its usual batched use); rates from the median step. Two mixes: prompts uniform in
    [64, 1024] (the headline: KV read per step is as large as the weights, so decode stays
    memory-bound as it is on real hardware) and in [32, 512] (at batch 32 on two cores this mix is
    bound by the same GEMMs in both engines);
  * the decode step at batch 1 beside the memory-bandwidth floor: bytes of weights and KV read per
    step divided by memcpy bandwidth measured in the same run.
Prints a table, then one JSON line. Run: `make bench-engine` (or .venv/bin/python
bench/engine/engine.py).

`--tp-compare` measures instead tensor parallelism's prefill speed-up on CPU: the latency of one
prefill of a 2048-token prompt (`--tp-tokens`) at TP=1 (one process pinned to one core, one
torch thread) and at TP=2 (two processes over gloo, each pinned to its own core, one torch thread
each), after a warm-up, the two alternating (ABBA) for `--tp-reps` repetitions; medians and
spread. Each TP=2 rank also accounts the time spent inside its collectives (parallel.CommTimer):
the communication fraction is that time over the rank's prefill wall time. The collectives'
time includes waiting for the other rank; a loop of the same all-reduce with both ranks ready
gives the transfer cost alone. About 2 minutes on the `small` preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.engine.timing import (
    admitted_prompt,
    hf_decode,
    hf_prefill_seconds,
    memcpy_bandwidth,
    ours_decode,
    ours_prefill_seconds,
    random_prompt,
    weight_bytes_read_per_token,
)
from distserve.loadgen.report import cpu_model, log
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.parallel import CommTimer, TensorParallel
from services.engine.presets import default_model

# -- tensor parallelism: TP=2 vs TP=1 prefill --------------------------------------------------


def tp_worker(
    tp: int, rank: int, core: int, init_method: str, path: str, tokens: int, conn
) -> None:
    """One pinned process (TP=1, or one rank of TP=2): a prefill of `tokens` per "run" message,
    answered with (wall seconds, seconds in collectives, collective calls, CPU seconds of the
    process: what the prefill cost its core, time lost to other processes on it excluded)."""
    import torch.distributed as dist

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    timer = CommTimer()
    group = dataclasses.replace(
        TensorParallel.init(tp, rank, init_method, backend="gloo"), comm_timer=timer
    )
    try:
        engine = LLMEngine(path, EngineConfig(kv_cache_bytes=96 * 2**20, max_num_seqs=4), tp=group)
        prompt = random_prompt(
            tokens, torch.Generator().manual_seed(0), engine.model_config.vocab_size
        )
        conn.send("ready")
        while (msg := conn.recv()) != "stop":
            if msg == "allreduce":  # the transfer alone: both ranks ready, the prefill's shape
                x = torch.ones(tokens, engine.model_config.hidden_size)
                dist.barrier()
                timer.reset()
                for _ in range(20):
                    group.all_reduce(x)
                conn.send(timer.seconds / timer.calls)
                continue
            seq = admitted_prompt(engine, prompt)
            if tp > 1:
                dist.barrier()  # both ranks start together
            timer.reset()
            t, cpu = time.perf_counter(), time.process_time()
            engine.runner.prefill([seq])
            wall, cpu = time.perf_counter() - t, time.process_time() - cpu
            engine._free(seq)
            conn.send((wall, timer.seconds, timer.calls, cpu))
    finally:
        group.close()


def spread(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:,.0f}-{max(xs) * 1e3:,.0f}"


def tp_compare(args: argparse.Namespace) -> dict:
    import multiprocessing as mp

    from services.common.model_config import ModelConfig

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("--tp-compare needs two cores")
    path = default_model(args.preset)
    cfg = ModelConfig.from_dir(path)
    log(f"model {path}: {cfg.num_params / 1e6:.1f}M params; cores {cores[:2]}")
    ctx = mp.get_context("spawn")
    procs, conns = [], {}
    # TP=1 on the first core; TP=2 ranks on the first two. They never run at the same time.
    rendezvous = tempfile.mkdtemp(prefix="distserve-tp-")  # the TP=2 ranks meet on a file there
    init2 = f"file://{rendezvous}/rendezvous"
    for name, tp, rank, core, init in (
        ("tp1", 1, 0, cores[0], "tcp://127.0.0.1:0"),
        ("tp2r0", 2, 0, cores[0], init2),
        ("tp2r1", 2, 1, cores[1], init2),
    ):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(
            target=tp_worker,
            args=(tp, rank, core, init, str(path), args.tp_tokens, theirs),
            daemon=True,
        )
        p.start()
        procs.append(p)
        conns[name] = mine
    try:
        for c in conns.values():
            if c.recv() != "ready":
                raise RuntimeError("a worker failed to start")

        def run(mode: str) -> list[tuple[float, float, int, float]]:
            names = ["tp1"] if mode == "tp1" else ["tp2r0", "tp2r1"]
            for n in names:
                conns[n].send("run")
            return [conns[n].recv() for n in names]

        load_before = os.getloadavg()[0]
        for mode in ("tp1", "tp2"):  # warm-up
            run(mode)
        tp1, tp2, frac, cpu1, cpu2 = [], [], ([], []), [], []
        calls = 0
        for i in range(args.tp_reps):
            for mode in ("tp1", "tp2") if i % 2 == 0 else ("tp2", "tp1"):
                res = run(mode)
                if mode == "tp1":
                    tp1.append(res[0][0])
                    cpu1.append(res[0][3])
                else:
                    tp2.append(max(r[0] for r in res))  # latency: the slower rank
                    cpu2.append(max(r[3] for r in res))
                    for r, (wall, comm, n, _) in enumerate(res):
                        frac[r].append(comm / wall)
                        calls = n
                walls = " ".join(f"{r[0] * 1e3:.0f}" for r in res)
                cpus = " ".join(f"{r[3] * 1e3:.0f}" for r in res)
                log(f"rep {i} {mode}: wall {walls} ms, cpu {cpus} ms")
        for n in ("tp2r0", "tp2r1"):
            conns[n].send("allreduce")
        allreduce_s = statistics.median([conns[n].recv() for n in ("tp2r0", "tp2r1")])
        load_after = os.getloadavg()[0]
        for c in conns.values():
            c.send("stop")
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        shutil.rmtree(rendezvous, ignore_errors=True)

    t1, t2 = statistics.median(tp1), statistics.median(tp2)
    frac_rank = [statistics.median(f) for f in frac]
    comm_fraction = statistics.mean(frac_rank)
    transfer_fraction = calls * allreduce_s / t2
    # Noise on a shared host: the ratio within each adjacent pair, and the best of each.
    paired = statistics.median(a / b for a, b in zip(tp1, tp2, strict=True))
    best = min(tp1) / min(tp2)
    c1, c2 = statistics.median(cpu1), statistics.median(cpu2)
    print(
        f"\nTP=2 vs TP=1 prefill: {args.preset} preset ({cfg.num_params / 1e6:.1f}M params, "
        f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
        f"{cfg.num_kv_heads}, float32), {args.tp_tokens}-token prompt; {cpu_model()}, "
        f"{os.cpu_count()} cores; one torch thread per process, each pinned to a core; gloo; "
        f"torch {torch.__version__}; {args.tp_reps} reps after a warm-up, alternating; "
        f"load average {load_before:.1f} -> {load_after:.1f}"
    )
    print(f"{'config':<34}{'median ms':>12}{'min-max ms':>18}{'tok/s':>10}")
    print(
        f"{'TP=1 (1 process, 1 core)':<34}{t1 * 1e3:>12,.0f}{spread(tp1):>18}"
        f"{args.tp_tokens / t1:>10,.0f}"
    )
    print(
        f"{'TP=2 (2 processes, 2 cores)':<34}{t2 * 1e3:>12,.0f}{spread(tp2):>18}"
        f"{args.tp_tokens / t2:>10,.0f}"
    )
    print(
        f"speed-up {t1 / t2:.2f}x (ideal 2; median of paired ratios {paired:.2f}x, best of "
        f"each {best:.2f}x); time in collectives ({calls} a prefill): rank 0 "
        f"{frac_rank[0]:.1%}, rank 1 {frac_rank[1]:.1%} of the prefill; one all-reduce of "
        f"{args.tp_tokens}x{cfg.hidden_size} fp32 alone {allreduce_s * 1e3:.2f} ms "
        f"(x{calls} = {transfer_fraction:.1%} of the TP=2 prefill)"
    )
    print(
        f"CPU time a prefill (median; busiest rank for TP=2): TP=1 {c1 * 1e3:,.0f} ms, TP=2 "
        f"{c2 * 1e3:,.0f} ms, ratio {c1 / c2:.2f}x (wall / CPU: TP=1 {t1 / c1:.2f}, TP=2 "
        f"{t2 / c2:.2f}; above 1: time the process waited, for its core or for the other rank)"
    )
    return {
        "bench": "engine_tp",
        "preset": args.preset,
        "params": cfg.num_params,
        "prompt_tokens": args.tp_tokens,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "reps": args.tp_reps,
        "tp1_ms": round(t1 * 1e3, 1),
        "tp2_ms": round(t2 * 1e3, 1),
        "tp1_ms_all": [round(x * 1e3, 1) for x in tp1],
        "tp2_ms_all": [round(x * 1e3, 1) for x in tp2],
        "speedup": round(t1 / t2, 3),
        "speedup_paired": round(paired, 3),
        "speedup_best": round(best, 3),
        "tp1_cpu_ms": round(c1 * 1e3, 1),
        "tp2_cpu_ms": round(c2 * 1e3, 1),
        "speedup_cpu": round(c1 / c2, 3),
        "comm_fraction": round(comm_fraction, 4),
        "comm_fraction_by_rank": [round(f, 4) for f in frac_rank],
        "collectives_per_prefill": calls,
        "allreduce_ms": round(allreduce_s * 1e3, 3),
        "transfer_fraction": round(transfer_fraction, 4),
        "load_average": [round(load_before, 2), round(load_after, 2)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=("tiny", "small"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-lengths", default="128,512,2048")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument(
        "--context",
        default="64,1024;32,512",
        help="context mixes 'lo,hi;lo,hi': prompt lengths uniform in [lo, hi]; the first is "
        "the headline",
    )
    ap.add_argument("--json-out", type=Path, help="also write the JSON result here")
    ap.add_argument(
        "--tp-compare",
        action="store_true",
        help="only measure TP=2 vs TP=1 prefill latency on two pinned cores (see above)",
    )
    ap.add_argument("--tp-tokens", type=int, default=2048, help="prompt length of --tp-compare")
    ap.add_argument("--tp-reps", type=int, default=7, help="repetitions of --tp-compare")
    args = ap.parse_args()

    if args.tp_compare:
        result = tp_compare(args)
        if args.json_out:
            args.json_out.write_text(json.dumps(result) + "\n")
        print(json.dumps(result))
        return

    import transformers

    torch.manual_seed(0)
    path = default_model(args.preset)
    log(f"model {path}")
    engine = LLMEngine(path, EngineConfig(kv_cache_bytes=2 * 2**30, max_num_seqs=64))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = engine.model_config
    params = cfg.num_params
    gen = torch.Generator().manual_seed(0)
    bandwidth = memcpy_bandwidth()
    log(f"{params / 1e6:.1f}M params; memcpy {bandwidth / 1e9:.1f} GB/s")

    rows = []
    prefill_ratios = {}
    for n in (int(x) for x in args.prefill_lengths.split(",")):
        prompt = random_prompt(n, gen, cfg.vocab_size)
        ours_prefill_seconds(engine, prompt, 1)  # warm-up
        hf_prefill_seconds(hf, prompt, 1)
        ours = n / ours_prefill_seconds(engine, prompt, args.reps)
        ref = n / hf_prefill_seconds(hf, prompt, args.reps)
        prefill_ratios[n] = ours / ref
        rows.append((f"prefill {n} tokens", ours, ref))
        log(f"prefill {n}: ours {ours:.0f} tok/s, transformers {ref:.0f} tok/s")

    decode_ratios: dict[str, float] = {}
    step_b1 = ctx_b1 = None
    for mix in args.context.split(";"):
        lo, hi = (int(x) for x in mix.split(","))
        for b in (int(x) for x in args.batches.split(",")):
            lengths = torch.randint(lo, hi + 1, (b,), generator=gen).tolist()
            prompts = [random_prompt(k, gen, cfg.vocab_size) for k in lengths]
            # Rates from the median step: robust to a noisy neighbour on a shared machine.
            ours_steps = ours_decode(engine, prompts, args.new_tokens)
            ours = b / statistics.median(ours_steps)
            ref = b / statistics.median(hf_decode(hf, prompts, args.new_tokens))
            key = f"b{b}_ctx{lo}-{hi}"
            decode_ratios[key] = ours / ref
            rows.append((f"decode b{b} ctx {lo}-{hi}", ours, ref))
            log(f"decode {key}: ours {ours:.1f} tok/s, transformers {ref:.1f} tok/s")
            if b == 1 and step_b1 is None:
                step_b1 = statistics.median(ours_steps)
                ctx_b1 = lengths[0] + args.new_tokens // 2

    floor_b1 = None
    if step_b1 is not None:
        kv = ctx_b1 * cfg.kv_bytes_per_token(engine.runner.cache.data.element_size())
        floor_b1 = (weight_bytes_read_per_token(engine) + kv) / bandwidth

    print(
        f"\nengine benchmark: {args.preset} preset, {params / 1e6:.1f}M params, float32, "
        f"{cpu_model()}, torch {torch.__version__}, transformers {transformers.__version__}"
    )
    print(f"{'measure':<26}{'ours tok/s':>12}{'transformers':>14}{'ratio':>8}")
    for name, ours, ref in rows:
        print(f"{name:<26}{ours:>12.1f}{ref:>14.1f}{ours / ref:>8.2f}")
    if step_b1 is not None:
        print(
            f"decode step b1: {step_b1 * 1e3:.2f} ms; bandwidth floor {floor_b1 * 1e3:.2f} ms "
            f"(memcpy {bandwidth / 1e9:.1f} GB/s); ratio {step_b1 / floor_b1:.2f}"
        )
    result = {
        "bench": "engine",
        "preset": args.preset,
        "params": params,
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "memcpy_gb_s": round(bandwidth / 1e9, 2),
        "rows": [
            {"measure": name, "ours_tok_s": round(o, 1), "transformers_tok_s": round(r, 1)}
            for name, o, r in rows
        ],
        "prefill_ratio_by_length": {str(n): round(r, 3) for n, r in prefill_ratios.items()},
        "prefill_ratio_vs_transformers": round(min(prefill_ratios.values()), 3)
        if prefill_ratios
        else None,
        "decode_ratio_vs_transformers": {k: round(r, 3) for k, r in decode_ratios.items()},
        "decode_ratio_vs_transformers_b32": next(
            (round(r, 3) for k, r in decode_ratios.items() if k.startswith("b32_")), None
        ),
        "decode_step_ms_b1": round(step_b1 * 1e3, 3) if step_b1 else None,
        "bandwidth_floor_ms_b1": round(floor_b1 * 1e3, 3) if floor_b1 else None,
        "decode_step_over_floor_b1": round(step_b1 / floor_b1, 3) if step_b1 else None,
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
