"""The latency model: how long a prefill batch and a decode step take, per parallel configuration.

DistServe's form (OSDI 2024, section 4; its simulator `simdistserve`), in milliseconds, for one
instance of tensor degree `tp` running the whole model:

    prefill(batch) = a + b * sum(L) + c * sum(L^2)      L: the prompt lengths in the batch
    decode(batch)  = a + b * sum(ctx) + c * B           B: batch size, ctx: context lengths

`b*sum(L)` is the GEMM work, `c*sum(L^2)` attention; in decode `b*sum(ctx)` is the KV read and
`a` mostly the weight read. Decode has two coefficient sets, one below `threshold` sequences and
one from it up. With pipeline degree `pp` each of the pp stages does 1/pp of that work; a prefill
stage also pays `stage_overhead_ms` for its hop (DistServe's simulator: `t / pp + pp`).

Every iteration (a prefill batch, a decode step) also pays the serving engine's own overhead
beyond the model's kernels, `iteration_overhead_ms + iteration_overhead_ms_per_token * tokens`
(tokens: the batch's prompt tokens, or a decode step's context). DistServe's published fits
time the model alone, and its simulator adds 2 ms + 0.0001 ms per token to every iteration
(`simdistserve/base/worker.py`, `add_ray_overhead`), so a published profile carries that term
(`PUBLISHED_ITERATION_OVERHEAD`); a profile of ours times whole engine steps, so the term is
inside its fit and the file says 0 unless it measured one.

Two file formats load into a `LatencyModel`:

* DistServe's published profile (`data/distserve-a100/profiler-a100-80g.*.json`):
  `{model: {tp: {"prefill": [a, b, c], "decoding_smallbs": [a, b, c],
  "decoding_largebs": [a, b, c], "decoding_large_small_bs_threshold": n}}}`.
* Ours, written by `distserve profile`: a JSON object with
  `"format": "distserve-mesh-profile/1"`, `"model"` (its name), `"device"` (what ran it),
  `"max_batch_tokens"` (L_m, the smallest batch that saturates the device), `"tp"` (the same
  per-tp objects as above), `"fit_error"` (per phase: `mean_rel`, `max_rel`, `samples`) and
  `"samples"` (the measurements: prefill `[[L1, L2, ...], ms]`, decode `[batch, sum_ctx, ms]`).

Models without a profile are scaled from one that has it (`scaled`), by the rule in its docstring.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from services.common.errors import InvalidRequest
from services.common.model_spec import ModelSpec

FORMAT = "distserve-mesh-profile/1"
DATA = Path(__file__).parent / "data" / "distserve-a100"
# DistServe's simulator's per-iteration overhead on its published fits: (ms, ms per token).
PUBLISHED_ITERATION_OVERHEAD = (2.0, 1e-4)
PUBLISHED = {
    "distserve": DATA / "profiler-a100-80g.distserve.json",
    "vllm": DATA / "profiler-a100-80g.vllm.json",
}


@dataclass(frozen=True)
class Coefficients:
    """`a + b*x + c*y` in milliseconds."""

    a: float
    b: float
    c: float

    def ms(self, x: float, y: float) -> float:
        return self.a + self.b * x + self.c * y

    def to_list(self) -> list[float]:
        return [self.a, self.b, self.c]


@dataclass(frozen=True)
class TpLatency:
    """The latency of one instance of tensor degree tp (whole model, pp = 1), in ms."""

    prefill: Coefficients
    decode_small: Coefficients
    decode_large: Coefficients
    threshold: int = 95  # decode batches of this size and more use decode_large

    def prefill_ms(self, sum_l: float, sum_l2: float) -> float:
        return self.prefill.ms(sum_l, sum_l2)

    def decode_ms(self, batch: int, sum_ctx: float) -> float:
        coeffs = self.decode_large if batch >= self.threshold else self.decode_small
        return coeffs.ms(sum_ctx, batch)

    def to_json(self) -> dict:
        return {
            "prefill": self.prefill.to_list(),
            "decoding_smallbs": self.decode_small.to_list(),
            "decoding_largebs": self.decode_large.to_list(),
            "decoding_large_small_bs_threshold": self.threshold,
        }

    @classmethod
    def from_json(cls, raw: dict) -> TpLatency:
        return cls(
            prefill=Coefficients(*raw["prefill"]),
            decode_small=Coefficients(*raw["decoding_smallbs"]),
            decode_large=Coefficients(*raw["decoding_largebs"]),
            threshold=int(raw.get("decoding_large_small_bs_threshold", 95)),
        )


@dataclass(frozen=True)
class LatencyModel:
    """Latency per tensor degree for one model on one kind of device (and one engine)."""

    model: str
    by_tp: dict[int, TpLatency]
    source: str  # where the numbers come from: a file, or how they were derived
    max_batch_tokens: int | None = None  # L_m measured by the profiler, if it was
    stage_overhead_ms: float = 1.0  # per pipeline stage of a prefill batch
    fit_error: dict = field(default_factory=dict)
    iteration_overhead_ms: float = 0.0  # per prefill batch or decode step, beyond the fit
    iteration_overhead_ms_per_token: float = 0.0  # per prompt token, or per context token

    def at(self, tp: int) -> TpLatency:
        if tp not in self.by_tp:
            raise InvalidRequest(
                f"the latency profile of {self.model} ({self.source}) has no tp={tp}; "
                f"it has tp in {sorted(self.by_tp)}"
            )
        return self.by_tp[tp]

    def prefill_stage_ms(self, tp: int, pp: int, sum_l: float, sum_l2: float) -> float:
        """One pipeline stage of a prefill batch (the whole batch when pp = 1)."""
        return self.at(tp).prefill_ms(sum_l, sum_l2) / pp + self.stage_overhead_ms

    def iteration_ms(self, tokens: float) -> float:
        """The engine's overhead of one iteration of `tokens` prompt (or context) tokens."""
        return self.iteration_overhead_ms + self.iteration_overhead_ms_per_token * tokens

    def without_iteration_overhead(self) -> LatencyModel:
        """The model's kernels alone: for an engine that pays its own overhead for real (the
        emulated runner's steps are the fit; its loop around them is real)."""
        return replace(self, iteration_overhead_ms=0.0, iteration_overhead_ms_per_token=0.0)

    def phases_scaled(self, prefill: float, decode: float, why: str) -> LatencyModel:
        """Prefill step times times `prefill`, decode step times times `decode` (every
        coefficient, so L_m, a ratio of them, is unchanged); `why` joins the source."""

        def times(c: Coefficients, k: float) -> Coefficients:
            return Coefficients(c.a * k, c.b * k, c.c * k)

        by_tp = {
            tp: TpLatency(
                times(t.prefill, prefill),
                times(t.decode_small, decode),
                times(t.decode_large, decode),
                t.threshold,
            )
            for tp, t in self.by_tp.items()
        }
        return replace(self, by_tp=by_tp, source=f"{self.source}, {why}")

    def saturation_tokens(self, tp: int) -> int:
        """L_m: the measured one if there is one, else the smallest power of two T past which
        doubling a batch of T prompt tokens gains under 10% throughput (4.5 a / b, from
        2(a + bT) / (a + 2bT) < 1.1)."""
        if self.max_batch_tokens:
            return self.max_batch_tokens
        p = self.at(tp).prefill
        if p.b <= 0:
            return 2048
        return 2 ** math.ceil(math.log2(max(1.0, 4.5 * max(p.a, 0.0) / p.b)))

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "model": self.model,
            "source": self.source,
            "max_batch_tokens": self.max_batch_tokens,
            "stage_overhead_ms": self.stage_overhead_ms,
            "iteration_overhead_ms": self.iteration_overhead_ms,
            "iteration_overhead_ms_per_token": self.iteration_overhead_ms_per_token,
            "tp": {str(tp): lat.to_json() for tp, lat in sorted(self.by_tp.items())},
            "fit_error": self.fit_error,
        }


# -- loading -----------------------------------------------------------------------------------


def load(path: str | Path, model: str | None = None) -> LatencyModel:
    """A profile file of either format. DistServe's holds several models: `model` picks one."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidRequest(f"cannot read profile {path}: {e}", param="profile") from e
    if not isinstance(raw, dict):
        raise InvalidRequest(f"profile {path} is not a JSON object", param="profile")
    if raw.get("format") == FORMAT:
        return _ours(raw, path)
    return _published(raw, path, model)


def _ours(raw: dict, path: Path) -> LatencyModel:
    try:
        return LatencyModel(
            model=raw["model"],
            by_tp={int(tp): TpLatency.from_json(v) for tp, v in raw["tp"].items()},
            source=str(path),
            max_batch_tokens=raw.get("max_batch_tokens"),
            stage_overhead_ms=float(raw.get("stage_overhead_ms", 1.0)),
            fit_error=raw.get("fit_error", {}),
            iteration_overhead_ms=float(raw.get("iteration_overhead_ms", 0.0)),
            iteration_overhead_ms_per_token=float(raw.get("iteration_overhead_ms_per_token", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidRequest(f"profile {path} is malformed: {e!r}", param="profile") from e


def _published(raw: dict, path: Path, model: str | None) -> LatencyModel:
    names = list(raw)
    if model is None and len(names) == 1:
        model = names[0]
    match = next((n for n in names if model and n.lower().endswith(model.lower())), None)
    if match is None:
        raise InvalidRequest(
            f"profile {path} has models {names}; name one of them (got {model!r})", param="profile"
        )
    try:
        by_tp = {int(tp): TpLatency.from_json(v) for tp, v in raw[match].items()}
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidRequest(f"profile {path} is malformed: {e!r}", param="profile") from e
    fixed, per_token = PUBLISHED_ITERATION_OVERHEAD
    return LatencyModel(
        model=match,
        by_tp=by_tp,
        source=str(path),
        iteration_overhead_ms=fixed,
        iteration_overhead_ms_per_token=per_token,
    )


def for_model(spec: ModelSpec, path: str | Path | None, engine: str = "distserve") -> LatencyModel:
    """The latency of `spec` from a profile file (default: DistServe's published A100 one).

    Our own profiles are used as they are. From a published file: the model's own entry when it
    has one, else the largest published model scaled to `spec` (see `scaled`). `engine`: whose
    fit, DistServe's or vLLM's (`_fit_path`); the colocated baseline's: `colocated_for_model`.
    """
    path = _fit_path(path, engine)
    raw = json.loads(path.read_text()) if path.exists() else None
    if raw is not None and raw.get("format") == FORMAT:
        return _ours(raw, path)
    if raw is None:
        raise InvalidRequest(f"profile {path} does not exist", param="profile")
    if spec.published in raw:
        return _published(raw, path, spec.published)
    from services.common.model_spec import PRESETS

    known = [s for s in PRESETS.values() if s.published in raw]
    if not known:
        raise InvalidRequest(f"profile {path} has no model to scale {spec.name} from")
    base = max(known, key=lambda s: s.num_params)
    return scaled(_published(raw, path, base.published), base, spec)


def colocated_for_model(
    spec: ModelSpec, colocated: str | Path | None, profile: str | Path | None
) -> LatencyModel:
    """The latency the colocated baseline is timed with: the profile the user named for it
    (`colocated`), exactly as named; else, by default, the vLLM fit of `profile` (or of the
    published A100 profile): DistServe's paper measures its colocated baseline on vLLM, and its
    published profiles come in pairs (`*.distserve.json` beside `*.vllm.json`). A profile of our
    own has one fit, used for both. The default says so in the model's `source`."""
    if colocated is not None:
        return for_model(spec, colocated)
    model = for_model(spec, profile, "vllm")
    if _fit_path(profile, "vllm").name.endswith(".vllm.json"):
        why = "the vLLM fit, by default: DistServe's paper times its colocated baseline on vLLM"
        return replace(model, source=f"{model.source} ({why})")
    return model


def _fit_path(path: str | Path | None, engine: str) -> Path:
    """The file holding `engine`'s fit: `path` (default: the published A100 profile), or for
    vLLM's fit of a published DistServe profile, the `*.vllm.json` published beside it."""
    path = Path(path) if path else PUBLISHED[engine]
    if path.name.endswith(".distserve.json") and engine == "vllm":
        sibling = path.with_name(path.name.replace(".distserve.", ".vllm."))
        path = sibling if sibling.exists() else path
    return path


# -- scaling to an unprofiled model ---------------------------------------------------------------


def scaled(base: LatencyModel, base_spec: ModelSpec, spec: ModelSpec) -> LatencyModel:
    """Latency of `spec` derived from a profiled `base` on the same device, per coefficient.

    * prefill b (GEMM time per token) and decode c (per-sequence GEMMs): times the ratio of
      the parameters a token runs through (FLOPs per token are 2x those: a mixture of experts
      counts its routed experts only); decode a (weights read per step): times the ratio of
      parameters stored (a decode batch of any size reaches most experts);
    * prefill c (attention per token pair) and decode b (KV read per context token): times the
      ratio of layers x hidden (attention FLOPs and KV bytes per token both scale with it);
    * prefill a (fixed cost, mostly kernel launches per layer): times the ratio of layers.

    Tensor degrees the base lacks (e.g. 1 and 6 for OPT-175B from OPT-66B's 2, 3, 4, 8) come from
    fitting each coefficient as `alpha + beta / tp` over the base's degrees (least squares, the
    result floored at zero): work splits over tp, a part (communication, launches) does not.
    """
    stored = spec.num_params / base_spec.num_params
    active = spec.active_params / base_spec.active_params
    attn = (spec.num_layers * spec.hidden_size) / (base_spec.num_layers * base_spec.hidden_size)
    layers = spec.num_layers / base_spec.num_layers
    factors = {
        "prefill": (layers, active, attn),
        "decode_small": (stored, attn, active),
        "decode_large": (stored, attn, active),
    }
    by_tp = {}
    for tp, lat in base.by_tp.items():
        by_tp[tp] = TpLatency(
            **{
                name: Coefficients(
                    *(f * v for f, v in zip(fs, getattr(lat, name).to_list(), strict=True))
                )
                for name, fs in factors.items()
            },
            threshold=lat.threshold,
        )
    by_tp = _fill_tensor_degrees(by_tp, [d for d in range(1, 9) if spec.num_heads % d == 0])
    source = f"{base.source} scaled from {base.model} to {spec.name}"
    return replace(base, model=spec.name, by_tp=by_tp, source=source, fit_error={})


def _fill_tensor_degrees(by_tp: dict[int, TpLatency], wanted: list[int]) -> dict[int, TpLatency]:
    missing = [tp for tp in wanted if tp not in by_tp]
    if not missing or len(by_tp) < 2:
        return by_tp
    tps = sorted(by_tp)
    x = np.array([[1.0, 1.0 / tp] for tp in tps])
    out = dict(by_tp)
    names = ("prefill", "decode_small", "decode_large")
    for tp in missing:
        coeffs = {}
        for name in names:
            ys = np.array([getattr(by_tp[t], name).to_list() for t in tps])  # (n_tp, 3)
            sol, *_ = np.linalg.lstsq(x, ys, rcond=None)  # (2, 3)
            coeffs[name] = Coefficients(*np.maximum(sol[0] + sol[1] / tp, 0.0).tolist())
        out[tp] = TpLatency(**coeffs, threshold=by_tp[tps[0]].threshold)
    return dict(sorted(out.items()))


# -- fitting ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitError:
    """Relative error |model - measured| / measured over the samples of one fit."""

    mean_rel: float
    max_rel: float
    samples: int

    def to_json(self) -> dict:
        return {"mean_rel": self.mean_rel, "max_rel": self.max_rel, "samples": self.samples}


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x w - y|| subject to w >= 0, for a few columns: the best unconstrained solution
    over every subset of columns whose solution is non-negative (exact; 2^k solves)."""
    n = x.shape[1]
    best, best_res = np.zeros(n), float(np.sum(y**2))
    for mask in range(1, 2**n):
        cols = [i for i in range(n) if mask >> i & 1]
        w, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if np.any(w < 0):
            continue
        res = float(np.sum((x[:, cols] @ w - y) ** 2))
        if res < best_res:
            best_res, best = res, np.zeros(n)
            best[cols] = w
    return best


def fit_relative(features: np.ndarray, ms: np.ndarray) -> tuple[Coefficients, FitError]:
    """Fit `a + b*f0 + c*f1` to measured ms, minimising relative error, coefficients >= 0.

    Rows are divided by the measurement, so a 2 ms step and a 200 ms batch weigh the same.
    features: (n, 2); ms: (n,).
    """
    if len(ms) < 3:
        raise InvalidRequest(f"a fit needs at least 3 samples, got {len(ms)}")
    x = np.column_stack([np.ones(len(ms)), features])  # (n, 3)
    w = nonnegative_least_squares(x / ms[:, None], np.ones(len(ms)))
    rel = np.abs(x @ w - ms) / ms
    return Coefficients(*w.tolist()), FitError(float(rel.mean()), float(rel.max()), len(ms))


def fit_prefill(batches: list[list[int]], ms: list[float]) -> tuple[Coefficients, FitError]:
    """Prefill coefficients from batches (prompt lengths of each) and their measured times."""
    feats = np.array([[sum(b), sum(n * n for n in b)] for b in batches], dtype=float)
    return fit_relative(feats, np.asarray(ms, dtype=float))


def fit_decode(batch: list[int], sum_ctx: list[int], ms: list[float]) -> tuple[TpLatency, FitError]:
    """Decode coefficients with a small- and a large-batch regime.

    The threshold between them is the batch size that minimises the total squared relative
    error (each regime needs 3 samples); with too few batch sizes, one regime serves both.
    Returns a TpLatency whose prefill part is zero (the caller sets it).
    """
    b = np.asarray(batch, dtype=float)
    feats = np.column_stack([np.asarray(sum_ctx, dtype=float), b])  # (n, 2)
    y = np.asarray(ms, dtype=float)
    zero = Coefficients(0.0, 0.0, 0.0)
    one, err = fit_relative(feats, y)
    best = (_sq_rel(one, feats, y), TpLatency(zero, one, one, threshold=int(b.max()) + 1), err)
    for threshold in sorted(set(batch))[1:]:
        lo, hi = b < threshold, b >= threshold
        if lo.sum() < 3 or hi.sum() < 3:
            continue
        small, _ = fit_relative(feats[lo], y[lo])
        large, _ = fit_relative(feats[hi], y[hi])
        total = _sq_rel(small, feats[lo], y[lo]) + _sq_rel(large, feats[hi], y[hi])
        if total < best[0]:
            model = TpLatency(zero, small, large, threshold=threshold)
            pred = np.array(
                [model.decode_ms(int(n), s) for n, s in zip(b, feats[:, 0], strict=True)]
            )
            rel = np.abs(pred - y) / y
            best = (total, model, FitError(float(rel.mean()), float(rel.max()), len(y)))
    return best[1], best[2]


def _sq_rel(c: Coefficients, feats: np.ndarray, y: np.ndarray) -> float:
    pred = c.a + c.b * feats[:, 0] + c.c * feats[:, 1]
    return float(np.sum(((pred - y) / y) ** 2))


def with_prefill(lat: TpLatency, prefill: Coefficients) -> TpLatency:
    return replace(lat, prefill=prefill)
