"""The profiler: measure the engine on this machine and fit DistServe's latency model to it.

It runs the real engine (services.engine.LLMEngine) through its public step functions:

* prefill: batches of chosen compositions (one long prompt, many short ones, mixes), so that
  sum(L) and sum(L^2) vary independently; each timed `reps` times, the median kept;
* L_m: batches of 64-token prompts of T = 32, 64, ... tokens; L_m is the smallest T after which
  doubling the batch gains under 10% throughput (tokens per second);
* decode: B requests of context c, for B over batch sizes and c over contexts, each step timed.

Then it fits prefill `a + b*sum(L) + c*sum(L^2)` and decode `a + b*sum(ctx) + c*B` (two batch
regimes) with non-negative least squares on relative error, and reports the fit error.
It times whole engine steps, so the engine's per-iteration overhead beyond the model (scheduling,
sampling, bookkeeping) is inside the fits' `a`: the profile's `iteration_overhead_ms` is 0, where
DistServe's published fits, which time the model alone, carry the 2 ms their simulator adds.
The profile covers tp = 1 (the engine runs one device per instance).
"""

from __future__ import annotations

import dataclasses
import itertools
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.errors import InvalidRequest
from services.common.latency import FitError, LatencyModel, fit_decode, fit_prefill, with_prefill

GAIN = 1.1  # L_m: doubling the batch must gain at least this factor in throughput


@dataclass(frozen=True)
class ProfileGrid:
    """What to measure: prefill batch compositions, L_m sweep, decode batch sizes x contexts."""

    prefill_batches: tuple[tuple[int, ...], ...]
    lm_tokens: tuple[int, ...]  # batch token counts of the L_m sweep (prompts of 64)
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int = 4
    reps: int = 3

    def within(self, context: int) -> ProfileGrid:
        """The shapes a model with this context can run (a prompt must leave room for a token,
        a decode context for the steps)."""
        grid = dataclasses.replace(
            self,
            prefill_batches=tuple(b for b in self.prefill_batches if max(b) < context),
            lm_tokens=tuple(t for t in self.lm_tokens if min(64, t) < context),
            decode_contexts=tuple(
                c for c in self.decode_contexts if c + self.decode_steps + 2 <= context
            ),
        )
        if not (grid.prefill_batches and grid.lm_tokens and grid.decode_contexts):
            raise InvalidRequest(f"a context of {context} tokens is too short to profile")
        return grid


def _compositions(lengths: tuple[int, ...], counts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    singles = tuple((n,) for n in lengths)
    batches = tuple((n,) * k for n in lengths[:3] for k in counts)
    mixes = tuple((lengths[0],) * k + (lengths[-1],) for k in counts)
    return singles + batches + mixes


QUICK = ProfileGrid(
    prefill_batches=_compositions((16, 64, 256, 512), (2, 4)),
    lm_tokens=(32, 64, 128, 256, 512, 1024),
    decode_batches=(1, 2, 4, 8, 16),
    decode_contexts=(32, 256),
)
FULL = ProfileGrid(
    prefill_batches=_compositions((16, 64, 128, 256, 512, 1024, 2048), (2, 4, 8)),
    lm_tokens=(32, 64, 128, 256, 512, 1024, 2048, 4096),
    decode_batches=(1, 2, 4, 8, 16, 32, 64, 128),
    decode_contexts=(32, 128, 512, 1024),
    decode_steps=8,
    reps=5,
)


@dataclass
class Measurements:
    prefill: list[tuple[list[int], float]]  # (prompt lengths, ms)
    decode: list[tuple[int, int, float]]  # (batch, sum of context, ms)
    lm: list[tuple[int, float]]  # (batch tokens, tokens per second)


def profile(model_dir: Path, grid: ProfileGrid, progress: bool = True) -> dict:
    """Measure, fit and return the profile as a JSON object (see latency's module docstring)."""
    from tqdm import tqdm

    from services.common.model_config import ModelConfig
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    grid = grid.within(ModelConfig.from_dir(model_dir).max_position_embeddings)
    longest = max(
        max(sum(b) for b in grid.prefill_batches),
        max(grid.lm_tokens),
        max(grid.decode_batches) * (max(grid.decode_contexts) + grid.decode_steps + 2),
    )
    seqs = max(max(grid.decode_batches), max(len(b) for b in grid.prefill_batches), 64)
    engine = LLMEngine(
        model_dir,
        EngineConfig(
            max_batch_tokens=longest,
            max_num_seqs=seqs,
            kv_cache_bytes=_kv_bytes(model_dir, longest),
            prefix_cache=False,  # every timed prompt is computed whole, however often it repeats
        ),
        detokenize=False,
    )
    runner = _Runner(engine)
    total = len(grid.prefill_batches) + len(grid.lm_tokens)
    total += len(grid.decode_batches) * len(grid.decode_contexts)
    bar = tqdm(total=total, desc="profile", unit="shape", file=sys.stderr, disable=not progress)
    m = Measurements(prefill=[], decode=[], lm=[])
    runner.prefill_ms([16], grid.reps)  # warm-up
    for batch in grid.prefill_batches:
        m.prefill.append((list(batch), runner.prefill_ms(list(batch), grid.reps)))
        bar.update()
    for tokens in grid.lm_tokens:
        batch = [min(64, tokens)] * max(1, tokens // 64)
        ms = runner.prefill_ms(batch, grid.reps)
        m.prefill.append((batch, ms))
        m.lm.append((sum(batch), 1000 * sum(batch) / ms))
        bar.update()
    for b in grid.decode_batches:
        for c in grid.decode_contexts:
            m.decode += runner.decode_steps(b, c, grid.decode_steps)
            bar.update()
    bar.close()
    return _fit(engine, model_dir, m)


def _kv_bytes(model_dir: Path, tokens: int) -> int:
    from services.common.model_config import ModelConfig

    mc = ModelConfig.from_dir(model_dir)
    return max(64 * 2**20, 2 * tokens * mc.kv_bytes_per_token(4))


def saturation(lm: list[tuple[int, float]]) -> int:
    """The smallest batch token count T after which doubling gains under GAIN in throughput."""
    lm = sorted(lm)
    for (tokens, rate), (_, next_rate) in itertools.pairwise(lm):
        if next_rate < GAIN * rate:
            return tokens
    return lm[-1][0]


class _Runner:
    """Times the engine's own prefill and decode steps on synthetic prompts."""

    def __init__(self, engine) -> None:
        from services.common.sampling import SamplingParams

        self.engine = engine
        self.params = SamplingParams
        self.rng = np.random.default_rng(0)
        self.vocab = engine.model_config.vocab_size
        self.ids = 0

    def _prompt(self, n: int) -> list[int]:
        return self.rng.integers(2, self.vocab, n).tolist()

    def _add(self, lengths: list[int], max_tokens: int) -> list[str]:
        params = self.params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        rids = []
        for n in lengths:
            self.ids += 1
            rids.append(self.engine.add_request(self._prompt(n), params, f"p{self.ids}"))
        return rids

    def prefill_ms(self, lengths: list[int], reps: int) -> float:
        """Ms of one prefill batch of exactly these prompts: the fastest of `reps` (other work
        on the machine only ever adds time)."""
        times = []
        for _ in range(reps):
            rids = self._add(lengths, max_tokens=2)
            start = time.perf_counter()
            self.engine.prefill_step(hold=True)
            times.append((time.perf_counter() - start) * 1000)
            kind, n, tokens = self.engine.last_step
            if (kind, n, tokens) != ("prefill", len(lengths), sum(lengths)):
                raise RuntimeError(f"profiler: batch {lengths} ran as {n} prompts, {tokens} tokens")
            for rid in rids:
                self.engine.release(rid)
        return min(times)

    def decode_steps(self, batch: int, context: int, steps: int) -> list[tuple[int, int, float]]:
        """(batch, sum of context, ms) of `steps` decode steps of `batch` requests."""
        rids = self._add([context] * batch, max_tokens=steps + 2)
        while self.engine.waiting:
            self.engine.prefill_step(hold=False)
        out = []
        for k in range(steps):
            start = time.perf_counter()
            self.engine.decode_step()
            ms = (time.perf_counter() - start) * 1000
            out.append((batch, batch * (context + 1 + k), ms))  # +1: the prefill's token
        for rid in rids:
            self.engine.abort(rid)
        return out


def _fit(engine, model_dir: Path, m: Measurements) -> dict:
    prefill, prefill_err = fit_prefill([b for b, _ in m.prefill], [ms for _, ms in m.prefill])
    decode, decode_err = fit_decode(*(list(x) for x in zip(*m.decode, strict=True)))
    model = LatencyModel(
        model=model_dir.name,
        by_tp={1: with_prefill(decode, prefill)},
        source=f"distserve profile on {platform.node()}",
        max_batch_tokens=saturation(m.lm),
        fit_error={"prefill": prefill_err.to_json(), "decode": decode_err.to_json()},
    )
    return {
        **model.to_json(),
        "device": f"{engine.device} ({platform.processor() or platform.machine()})",
        "samples": {
            "prefill": [[b, round(ms, 4)] for b, ms in m.prefill],
            "decode": [[b, s, round(ms, 4)] for b, s, ms in m.decode],
            "lm_tokens_per_s": [[t, round(r, 1)] for t, r in m.lm],
        },
    }


def describe(profile_json: dict) -> str:
    """A few lines for a person: coefficients, fit error and L_m."""
    lat = profile_json["tp"]["1"]
    err = profile_json["fit_error"]
    lines = [
        f"model {profile_json['model']} on {profile_json.get('device', '?')}",
        "prefill ms = {:.4g} + {:.4g}*sum(L) + {:.4g}*sum(L^2)".format(*lat["prefill"]),
        "decode ms  = {:.4g} + {:.4g}*sum(ctx) + {:.4g}*B   (B < {})".format(
            *lat["decoding_smallbs"], lat["decoding_large_small_bs_threshold"]
        ),
        "             {:.4g} + {:.4g}*sum(ctx) + {:.4g}*B   (from there up)".format(
            *lat["decoding_largebs"]
        ),
        f"L_m = {profile_json['max_batch_tokens']} tokens",
        "per-iteration overhead: inside the fits (whole engine steps timed)",
    ]
    for phase in ("prefill", "decode"):
        e = FitError(**err[phase])
        lines.append(
            f"fit error {phase}: mean {e.mean_rel:.1%}, max {e.max_rel:.1%} "
            f"over {e.samples} samples"
        )
    return "\n".join(lines)
