"""Prefix caching and KV-aware routing: a conversation's earlier turns are never computed or
moved twice.

Two parts (`--parts`, default both):

* `chat` (engine: **real**, the `small` preset, 12 layers, 105M parameters, fp32, CPU; a mesh
  of 2 prefill + 1 decode, each worker pinned to a core): CONVERSATIONS conversations of TURNS
  turns sharing one SYSTEM-token system prompt; each turn adds a USER-token user message to the
  conversation so far (system prompt, earlier messages and answers) and asks for ANSWER tokens,
  greedy. The conversations run turn by turn (every conversation's turn k, at once, then turn
  k+1), on two meshes identical but for the workers' prefix cache (`--no-prefix-cache` on the
  second). Reported: `prefix_ttft_p50_ratio` (TTFT p50 over turns 2..TURNS, cache on / off;
  target <= 0.33), `prefix_prefill_tokens_fraction` (prompt tokens the prefill instances
  computed / prompt tokens, turns 2..TURNS, cache on), `prefix_kv_bytes_pulled_fraction` (KV
  bytes the decode instance pulled in turns 2..TURNS, with its cache / without: decode-side
  reuse), and `prefix_greedy_identical` (every turn's tokens equal on and off).
* `routing` (engine: **emulated**, OPT-13B on A100 profiles, `--time-scale K`: every latency in
  emulated time): 8 prefill + 2 decode instances, CONVERSATIONS_AT_SCALE conversations starting
  at Poisson times, each TURNS turns with a think time between an answer and the next turn,
  sharing the system prompt. The same conversations through three meshes, identical but for the
  gateway's `--routing`: prefix (by cached prefix and load), load (least queued), round-robin.
  Reported per mode: `prefix_hit_fraction_vs_oracle` (prompt tokens the prefill instances
  reused / the most that any prefill instance held for each prompt when it was routed, the
  gateway's `distserve_gateway_prefix_tokens_total{kind="best"}`; target >= 0.9 for prefix),
  SLO attainment, goodput (requests meeting both SLOs per second per GPU) and its gain over
  least-loaded routing.

Prints a table per part and one JSON line. About 12 minutes on 2 cores by default.

    .venv/bin/python bench/prefix/prefix.py [--parts chat,routing] [--time-scale 6]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.comparison import ADMISSION_OFF, WORKER_ARGS
from distserve.loadgen.conversations import (
    ANSWER_AT_SCALE,
    CONVERSATIONS_AT_SCALE,
    RATE,
    SEED,
    SYSTEM,
    TURNS,
    USER,
    Conversations,
    Turn,
    ask,
    converse,
    prefix_tokens,
)
from distserve.loadgen.emulated import EmulatedCluster, Shape
from distserve.loadgen.report import host, log
from distserve.loadgen.scrape import role_total
from distserve.local_mesh import Mesh, MeshSpec
from services.common import mesh_tls
from services.common.gen.distserve.v1 import gateway_pb2_grpc
from services.common.model_config import ModelConfig
from services.common.slo import Slo
from services.common.stats import percentile
from services.engine.presets import default_model, emulated_model

ANSWER = 16
CONVERSATIONS = 4  # chat part: at once, turn by turn
ROUTING_SHAPE = Shape(prefill=(8, 1), decode=(2, 1))
ROUTING_SLO = Slo(0.4, 0.1)  # OPT-13B chat-like SLO (emulated s)
MODES = ("prefix", "load", "round-robin")


# -- chat: the real engine, cache on and off ------------------------------------------------------


def chat_mesh(model: Path, cache: bool) -> Mesh:
    worker_args = (*WORKER_ARGS, *(() if cache else ("--no-prefix-cache",)))
    mesh = Mesh(
        MeshSpec(
            model=model,
            gateway_port=0,
            pin=True,
            worker_args=worker_args,
            gateway_args=ADMISSION_OFF,
            prefill=2,
            decode=1,
        )
    )
    mesh.start()
    return mesh


async def chat_run(mesh: Mesh, vocab: int) -> tuple[list[Turn], dict[str, float]]:
    """Every conversation's turn k at once, then k + 1; counters at the end of turn 1 and of
    the last turn (prompt tokens computed / cached on prefill, KV bytes pulled by decode)."""
    talks = Conversations(CONVERSATIONS, vocab)
    turns: list[Turn] = []
    marks: dict[str, float] = {}
    async with mesh_tls.aio_channel(mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for k in range(TURNS):
            batch = []
            for c in range(CONVERSATIONS):
                prompt = talks.prompt(c, k)
                batch.append(ask(stub, Turn(c, k, len(prompt)), prompt, ANSWER, 1.0))
            done = await asyncio.gather(*batch)
            for t in done:
                talks.answered(t.conversation, t.tokens)
            turns += done
            if k == 0:
                marks.update(counters(mesh, "turn1"))
    marks.update(counters(mesh, "end"))
    return turns, marks


def counters(mesh: Mesh, tag: str) -> dict[str, float]:
    prompt = "distserve_prompt_tokens_{}_total"
    return {
        f"{tag}.computed": role_total(mesh, "prefill", prompt.format("computed")),
        f"{tag}.cached": role_total(mesh, "prefill", prompt.format("cached")),
        f"{tag}.pulled": role_total(mesh, "decode", "distserve_kv_transfer_bytes_total"),
    }


def chat_part() -> dict:
    model = default_model("small")
    vocab = ModelConfig.from_dir(model).vocab_size
    runs: dict[str, tuple[list[Turn], dict[str, float]]] = {}
    for mode, cache in (("on", True), ("off", False)):
        log(f"chat: prefix cache {mode}: starting 2 prefill + 1 decode (small, real engine)")
        mesh = chat_mesh(model, cache)
        try:
            runs[mode] = asyncio.run(chat_run(mesh, vocab))
        finally:
            mesh.stop()
    later: dict[str, list[float]] = {}
    for mode, (turns, _) in runs.items():
        failed = [t.error for t in turns if t.error]
        if failed:
            raise SystemExit(f"chat, cache {mode}: {len(failed)} turns failed: {failed[0]}")
        later[mode] = [t.ttft_s for t in turns if t.turn > 0]
    identical = all(
        a.tokens == b.tokens for a, b in zip(runs["on"][0], runs["off"][0], strict=True)
    )
    on, off = runs["on"][1], runs["off"][1]
    computed = on["end.computed"] - on["turn1.computed"]
    cached = on["end.cached"] - on["turn1.cached"]
    pulled_on = on["end.pulled"] - on["turn1.pulled"]
    pulled_off = off["end.pulled"] - off["turn1.pulled"]
    p50 = {m: percentile(np.array(v), 50) for m, v in later.items()}
    out = {
        "prefix_ttft_p50_ratio": round(p50["on"] / p50["off"], 3),
        "prefix_ttft_p50_ms": {m: round(v * 1000, 1) for m, v in p50.items()},
        "prefix_prefill_tokens_fraction": round(computed / max(1.0, computed + cached), 3),
        "prefix_kv_bytes_pulled_fraction": round(pulled_on / max(1.0, pulled_off), 3),
        "prefix_greedy_identical": identical,
    }
    print(
        f"\nchat (real engine, small 105M fp32, 2P1D, {CONVERSATIONS} conversations x {TURNS} "
        f"turns, system {SYSTEM} + {USER}/turn, answers {ANSWER}):\n"
        f"  TTFT p50, turns 2-{TURNS}: cache on {p50['on'] * 1000:.0f} ms, off "
        f"{p50['off'] * 1000:.0f} ms: ratio {out['prefix_ttft_p50_ratio']} (target <= 0.33)\n"
        f"  prompt tokens computed on prefill, turns 2-{TURNS}: "
        f"{out['prefix_prefill_tokens_fraction']:.1%}\n"
        f"  KV bytes pulled by decode, turns 2-{TURNS}, with / without its cache: "
        f"{pulled_on / 2**20:.1f} / {pulled_off / 2**20:.1f} MiB "
        f"({out['prefix_kv_bytes_pulled_fraction']:.1%})\n"
        f"  greedy tokens identical on and off: {identical}",
        flush=True,
    )
    return out


# -- routing: the emulated engine at scale ---------------------------------------------------------


def routing_part(scale: float, rate: float) -> dict:
    cluster = EmulatedCluster.of("opt-13b")
    model = emulated_model(cluster.model)
    vocab = cluster.model.vocab_size
    results: dict[str, dict] = {}
    for mode in MODES:
        spec = cluster.mesh_spec(ROUTING_SHAPE, model, scale, ready_timeout_s=600)
        spec = dataclasses.replace(spec, gateway_args=(*spec.gateway_args, "--routing", mode))
        log(f"routing {mode}: {ROUTING_SHAPE} emulated OPT-13B, time scale {scale}")
        with Mesh(spec) as mesh:
            started = time.monotonic()
            talks = Conversations(CONVERSATIONS_AT_SCALE, vocab, SEED)
            turns = asyncio.run(
                converse(mesh.gateway_address, talks, rate, scale, ANSWER_AT_SCALE, SEED)
            )
            elapsed = (time.monotonic() - started) / scale
            counted = prefix_tokens(mesh)
            cached, best, chosen = counted["cached"], counted["best"], counted["chosen"]
        ok = [t for t in turns if not t.error]
        met = [t for t in ok if ROUTING_SLO.met(t.ttft_s, t.tpot_s)]
        results[mode] = {
            "turns": len(turns),
            "failed": len(turns) - len(ok),
            "hit_fraction_vs_oracle": round(cached / best, 3) if best else float("nan"),
            "gateway_choice_vs_best": round(chosen / best, 3) if best else float("nan"),
            "attainment": round(len(met) / max(1, len(turns)), 3),
            "ttft_p50_ms": round(percentile(np.array([t.ttft_s for t in ok]), 50) * 1000, 1),
            "goodput_per_gpu": round(len(met) / elapsed / ROUTING_SHAPE.devices, 3),
        }
    base = results["load"]["goodput_per_gpu"]
    print(
        f"\nrouting (emulated OPT-13B on A100 profiles, {ROUTING_SHAPE}, time scale {scale}; "
        f"{CONVERSATIONS_AT_SCALE} conversations x {TURNS} turns at {rate} conversations/s, "
        f"SLO {ROUTING_SLO.ttft_s * 1000:.0f}/{ROUTING_SLO.tpot_s * 1000:.0f} ms):"
    )
    print(f"  {'mode':12} hit/oracle  choice/best  attainment  TTFT p50  goodput/GPU")
    for mode, r in results.items():
        print(
            f"  {mode:12} {r['hit_fraction_vs_oracle']:10} {r['gateway_choice_vs_best']:12} "
            f"{r['attainment']:11} {r['ttft_p50_ms']:7.0f}ms {r['goodput_per_gpu']:9}"
        )
    return {
        "prefix_hit_fraction_vs_oracle": results["prefix"]["hit_fraction_vs_oracle"],
        "prefix_goodput_gain_over_least_loaded": round(
            results["prefix"]["goodput_per_gpu"] / base, 3
        )
        if base
        else None,
        "prefix_routing": results,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="chat,routing")
    ap.add_argument("--time-scale", type=float, default=6.0, help="routing part's time scale")
    ap.add_argument(
        "--rate", type=float, default=RATE, help="routing part: conversations started per s"
    )
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    started = time.monotonic()
    out: dict = {"host": host(torch=True)}
    if "chat" in parts:
        out.update(chat_part())
    if "routing" in parts:
        out.update(routing_part(args.time_scale, args.rate))
    out["seconds"] = round(time.monotonic() - started)
    print(f"\nhost: {out['host']}; {out['seconds']} s")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
