"""Goodput on the real mesh: the highest request rate at which a fraction alpha of requests meet
both SLOs (TTFT and TPOT, jointly), found by bisection over the rate with the load generator.

    slo = slo_from_unloaded(unloaded(target, base, vocab))        # or an explicit Slo
    search = search_goodput(lambda r: measure(target, base, r, slo, vocab), alpha=0.9,
                            rate_lo=0.2, rate_hi=2.0, max_probes=6)

Every probe sends the same seeded requests (sampled once at rate 1 and rescaled with
`Requests.at_rate`), so rates are comparable: attainment changes with the rate, not with the
lengths. Each probe's prompts are its own tokens (of those lengths): a prompt sent again would
find its KV in the workers' prefix caches. The first probe is the geometric middle of
[rate_lo, rate_hi]; then the range's ends until the answer is bracketed (halving below
rate_lo, doubling above rate_hi if needed), then bisection, never more than `max_probes` probes.

SLO rule (`slo_from_unloaded`): the unloaded TTFT and TPOT of the workload's median request
(median prompt, median output) on the endpoint, measured with one warm-up and three sequential
requests (medians), times `TTFT_SLO_FACTOR` = 5 and `TPOT_SLO_FACTOR` = 3. TTFT gets the larger
factor because queueing for prefill is what a serving system trades for throughput; TPOT is
held tighter because a decode step that is 3x slower than alone already means heavy batching or
prefill interference.

CPU-scaled workloads (`SCALED`): the planner's presets are shaped after ShareGPT, HumanEval and
LongBench at their full lengths, which on one CPU core per worker would take minutes per request
(the `small` model prefills about 400 tokens/s on one core). These keep the shapes (which phase
dominates, prompt/output ratio order) at lengths that fit the 4096 context and a benchmark of
minutes; all lognormal, clipped, in tokens:

| name          | like      | prompt: mean, std, clip | output: mean, std, clip | scale  |
|---------------|-----------|-------------------------|-------------------------|--------|
| chat          | ShareGPT  | 256, 200, [16, 768]     | 48, 40, [4, 128]        | ~0.3   |
| code          | HumanEval | 96, 40, [16, 384]       | 48, 24, [4, 128]        | ~0.5   |
| summarization | LongBench | 512, 96, [192, 768]     | 24, 12, [4, 48]         | ~0.3   |

(scale: of the planner presets' mean prompt and output lengths.)

Prompts of >= 16 tokens keep prefill compute-bound; decode of a 105M-parameter fp32 model reads
420 MB of weights per step, memory-bound at any batch these rates reach.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from distserve.loadgen.requests import load_requests
from distserve.loadgen.results import LoadResult
from distserve.loadgen.runner import run_load
from distserve.loadgen.targets import Target
from services.common.errors import InvalidRequest
from services.common.slo import Slo
from services.planner.workload import (
    LengthDist,
    Requests,
    TraceWorkload,
    Workload,
    parse_workload,
)

ALPHA = 0.9
TTFT_SLO_FACTOR = 5.0
TPOT_SLO_FACTOR = 3.0
REL_TOL = 0.05  # bisection stops when the bracket is within 5% of its upper end
UNLOADED_REQUESTS = 3  # sequential requests (after one warm-up) for the unloaded latency

SCALED: dict[str, Workload] = {
    "chat": Workload(
        "chat", LengthDist("lognormal", 256, 200, 16, 768), LengthDist("lognormal", 48, 40, 4, 128)
    ),
    "code": Workload(
        "code", LengthDist("lognormal", 96, 40, 16, 384), LengthDist("lognormal", 48, 24, 4, 128)
    ),
    "summarization": Workload(
        "summarization",
        LengthDist("lognormal", 512, 96, 192, 768),
        LengthDist("lognormal", 24, 12, 4, 48),
    ),
}


def resolve_workload(
    text: str, arrivals: str = "poisson", tokenizer_dir: Path | None = None, scaled: bool = True
) -> Workload | TraceWorkload:
    """`chat`, `code`, `summarization` (the CPU-scaled `SCALED` presets; `scaled=False`: the
    planner's, at full length), `trace:FILE`, or `prompt=DIST,output=DIST` (as the planner
    parses it); `arrivals` is `poisson` or `gamma:CV` (CV > 1 is burstier than Poisson; a trace
    keeps its own arrivals)."""
    if text.startswith("trace:"):
        if arrivals != "poisson":
            raise InvalidRequest("a trace keeps its own arrivals: drop --arrivals")
        return load_trace(Path(text.removeprefix("trace:")), tokenizer_dir)
    workload = (SCALED.get(text) if scaled else None) or parse_workload(text)
    cv = parse_arrivals(arrivals)
    if cv == 1.0:
        return workload
    return replace(workload, name=f"{workload.name}:gamma={cv:g}", cv=cv)


def parse_arrivals(text: str) -> float:
    """The coefficient of variation of inter-arrival times: `poisson` is 1, `gamma:CV` is CV."""
    if text == "poisson":
        return 1.0
    kind, _, cv = text.partition(":")
    try:
        value = float(cv)
    except ValueError:
        value = -1.0
    if kind != "gamma" or value <= 0:
        raise InvalidRequest(f"arrivals {text!r}: expected poisson or gamma:CV with CV > 0")
    return value


def load_trace(path: Path, tokenizer_dir: Path | None = None) -> TraceWorkload:
    """A JSON-lines trace: `arrival_s`, `output_tokens`, and `prompt_tokens` or `prompt` (text,
    counted with the model's tokenizer; the load generator then sends that many random ids)."""
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidRequest(f"trace {path}: {e!r}") from e
    if all("prompt_tokens" in r for r in rows if isinstance(r, dict)):
        return TraceWorkload.load(path)  # it validates and reports the request at fault
    if tokenizer_dir is None:
        raise InvalidRequest(f"trace {path}: text prompts need the model folder (its tokenizer)")
    from services.common.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    try:
        a = np.array(
            [
                (
                    float(r["arrival_s"]),
                    int(r["prompt_tokens"])
                    if "prompt_tokens" in r
                    else len(tokenizer.encode(str(r["prompt"]))),
                    int(r["output_tokens"]),
                )
                for r in rows
            ],
            dtype=float,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidRequest(f"trace {path}: {e!r}") from e
    if len(a) < 2 or np.any(np.diff(a[:, 0]) < 0) or np.any(a[:, 1:] < 1):
        raise InvalidRequest(
            f"trace {path}: needs >= 2 requests, non-decreasing arrivals, token counts >= 1"
        )
    return TraceWorkload(
        path.name, a[:, 0] - a[0, 0], a[:, 1].astype(np.int64), a[:, 2].astype(np.int64)
    )


# -- one probe ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """One rate's measurement: attainment and percentiles (ms) over all its requests."""

    rate: float
    attainment: float
    ttft_ms: dict[str, float | None]  # p50, p90, p99; None where no request succeeded
    tpot_ms: dict[str, float | None]
    latency_ms: dict[str, float | None]
    errors: int
    send_lag_max_ms: float | None
    duration_s: float
    ttft_s: np.ndarray = field(repr=False, compare=False)  # per request, NaN where failed
    tpot_s: np.ndarray = field(repr=False, compare=False)

    @classmethod
    def of(cls, rate: float, result: LoadResult, slo: Slo) -> Probe:
        def pct(values: np.ndarray) -> dict[str, float]:
            return {
                k: round3(v * 1000) for k, v in result.percentiles(values, (50, 90, 99)).items()
            }

        lag = result.send_lag_s[~np.isnan(result.sent_s)]
        return cls(
            rate=rate,
            attainment=result.attainment(slo),
            ttft_ms=pct(result.ttft_s),
            tpot_ms=pct(result.tpot_s),
            latency_ms=pct(result.latency_s),
            errors=int((~result.ok).sum()),
            send_lag_max_ms=round3(float(lag.max()) * 1000) if len(lag) else 0.0,
            duration_s=round(result.duration_s, 3),
            ttft_s=result.ttft_s,
            tpot_s=result.tpot_s,
        )

    def to_json(self) -> dict:
        return {
            "rate_rps": round(self.rate, 4),
            "attainment": round(self.attainment, 4),
            "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms,
            "latency_ms": self.latency_ms,
            "errors": self.errors,
            "send_lag_max_ms": self.send_lag_max_ms,
            "duration_s": self.duration_s,
        }


def run(
    target: Target, requests: Requests, vocab_size: int, seed: int | tuple[int, ...] = 0
) -> LoadResult:
    """`requests` through `target`, open loop, prompts seeded by `seed`."""
    return asyncio.run(run_load(target, load_requests(requests, vocab_size, seed)))


def measure(
    target: Target, base: Requests, rate: float, slo: Slo, vocab_size: int, seed: int = 0
) -> Probe:
    """Attainment at `rate`: the base requests (sampled at rate 1) rescaled to it, with prompts
    of this probe's own (no probe finds another's in the prefix caches)."""
    probe_seed = (seed, round(rate * 1e6))
    return Probe.of(rate, run(target, base.at_rate(rate), vocab_size, probe_seed), slo)


# -- the SLO rule ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unloaded:
    """The median request's latency alone on the endpoint (seconds)."""

    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float

    def to_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_ms": round3(self.ttft_s * 1000),
            "tpot_ms": round3(self.tpot_s * 1000),
        }


def unloaded(
    target: Target, base: Requests, vocab_size: int, repeats: int = UNLOADED_REQUESTS
) -> Unloaded:
    """TTFT and TPOT of the workload's median request (median prompt, median output, at least 2
    output tokens so that it has a TPOT), sent alone `repeats` times after one warm-up."""
    prompt = int(np.median(base.prompt))
    output = max(2, int(np.median(base.output)))
    one = Requests(np.zeros(1), np.array([prompt]), np.array([output]))
    results = [run(target, one, vocab_size, seed=1000 + i) for i in range(repeats + 1)][1:]
    for r in results:
        if not r.ok.all():
            raise RuntimeError(f"unloaded request failed: {r.error[0]}: {r.error_message[0]}")
    ttft = float(np.median([r.ttft_s[0] for r in results]))
    tpot = float(np.median([r.tpot_s[0] for r in results]))
    return Unloaded(prompt, output, ttft, tpot)


def slo_from_unloaded(*measured: Unloaded) -> Slo:
    """TTFT_SLO_FACTOR x TTFT and TPOT_SLO_FACTOR x TPOT of the unloaded median request; given
    several endpoints (the modes of one comparison), the smallest of each, so that one mode's
    own overheads never loosen the SLO both are judged by."""
    ttft = min(u.ttft_s for u in measured)
    tpot = min(u.tpot_s for u in measured)
    return Slo(TTFT_SLO_FACTOR * ttft, TPOT_SLO_FACTOR * tpot)


def rate_range(u: Unloaded, cores: int) -> tuple[float, float]:
    """A starting bracket: `cores` serving the median request one at a time, back to back, is
    `est` req/s; batching raises the real figure and interference lowers it: [est/2, 3 est]."""
    est = cores / (u.ttft_s + u.tpot_s * (u.output_tokens - 1))
    return est / 2, 3 * est


# -- the search --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GoodputSearch:
    """Every probe in the order made, and the highest rate that met `alpha` (0: none did)."""

    alpha: float
    probes: tuple[Probe, ...]

    @property
    def goodput(self) -> float:
        return max((p.rate for p in self.probes if p.attainment >= self.alpha), default=0.0)

    def at(self, rate: float) -> Probe | None:
        return next((p for p in self.probes if math.isclose(p.rate, rate, rel_tol=1e-9)), None)

    def to_json(self) -> dict:
        probes = sorted(self.probes, key=lambda p: p.rate)
        return {
            "alpha": self.alpha,
            "goodput_rps": round(self.goodput, 4),
            "probes": [p.to_json() for p in probes],
        }


def search_goodput(
    measure_at: Callable[[float], Probe],
    *,
    alpha: float = ALPHA,
    rate_lo: float,
    rate_hi: float,
    max_probes: int = 6,
    rel_tol: float = REL_TOL,
    on_probe: Callable[[Probe], None] | None = None,
) -> GoodputSearch:
    """Bisection for the highest rate with attainment >= alpha, in at most `max_probes` calls of
    `measure_at`: the geometric middle of [rate_lo, rate_hi] first, then the ends (and beyond,
    halving or doubling) until a passing rate lies below a failing one, then the middle of the
    bracket until it is within `rel_tol` of its upper end. Goodput is the highest passing rate
    probed; a failing rate above it is among the probes unless the probes ran out first."""
    if not 0 < rate_lo <= rate_hi or max_probes < 1 or not 0 < alpha <= 1:
        raise InvalidRequest("search needs 0 < rate_lo <= rate_hi, max_probes >= 1, alpha in (0,1]")
    passed: float | None = None  # highest rate that met alpha
    failed: float | None = None  # lowest rate above `passed` that did not
    probes: list[Probe] = []
    rate = math.sqrt(rate_lo * rate_hi)
    while len(probes) < max_probes:
        probe = measure_at(rate)
        probes.append(probe)
        if on_probe is not None:
            on_probe(probe)
        if probe.attainment >= alpha:
            passed = rate if passed is None else max(passed, rate)
            if failed is not None and failed <= passed:
                failed = None  # noise: a lower rate failed; look above this one again
        else:
            failed = rate if failed is None else min(failed, rate)
        if failed is None:
            rate = rate_hi if passed < rate_hi else 2 * passed
        elif passed is None:
            rate = rate_lo if failed > rate_lo else failed / 2
        elif failed - passed <= rel_tol * failed:
            break
        else:
            rate = (passed + failed) / 2
    return GoodputSearch(alpha, tuple(probes))


def step_search(
    measure: Callable[[float], Probe], start: float, probes: int, alpha: float, step: float = 0.04
) -> GoodputSearch:
    """The highest rate near `start` (a prediction of the goodput) that meets `alpha`: from 0.97
    x start, up or down by `step` until a pass and a fail are adjacent, then halfway between
    them with what probes are left. (`search_goodput`'s bisection halves a failing range, too
    coarse where the answer is known to within ~10%.)"""
    done: list[Probe] = []
    rate = 0.97 * start
    while len(done) < probes:
        done.append(measure(rate))
        passed = [p.rate for p in done if p.attainment >= alpha]
        top = max(passed, default=0.0)
        above = [p.rate for p in done if p.attainment < alpha and p.rate > top]
        if passed and above:  # bracketed: halfway
            rate = (top + min(above)) / 2
        elif passed:  # every probe passed: up
            rate = top * (1 + step)
        else:  # every probe failed: down
            rate = min(p.rate for p in done) * (1 - step)
    return GoodputSearch(alpha, tuple(done))


def equal_load_rate(*searches: GoodputSearch) -> float | None:
    """The largest rate every search probed (their first probes share it when they share the
    range), where their latency distributions compare at equal load; None if there is none."""
    rates = [p.rate for p in searches[0].probes]
    common = [r for r in rates if all(s.at(r) is not None for s in searches[1:])]
    return max(common) if common else None


def round3(x: float) -> float | None:
    """Rounded to 3 decimals; None for NaN."""
    return None if x != x else round(float(x), 3)  # None: JSON has no NaN
