"""Workloads: when requests arrive and how long their prompts and outputs are.

Arrivals are Poisson, or gamma with a coefficient of variation `cv` for burstiness (cv = 1 is
Poisson; DistServe sweeps it). Lengths come from a parameterised distribution or a trace file.
A workload samples requests at unit rate once and is rescaled to any rate by dividing arrival
times, so a goodput search compares rates on the same requests (common random numbers).

Presets are shaped after, not fitted to, the datasets DistServe evaluates (lengths in tokens):

| preset        | like      | prompt: mean, std, clip  | output: mean, std, clip |
|---------------|-----------|--------------------------|-------------------------|
| chat          | ShareGPT  | 750, 600, [4, 1536]      | 200, 200, [1, 512]      |
| code          | HumanEval | 170, 80, [8, 1024]       | 100, 60, [1, 512]       |
| summarization | LongBench | 1700, 250, [256, 1900]   | 90, 50, [1, 148]        |

(all lognormal, clipped).

A trace file is JSON lines, one request per line: `{"arrival_s": 0.12, "prompt_tokens": 512,
"output_tokens": 64}`, arrival times non-decreasing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.errors import InvalidRequest

LENGTH_KINDS = ("fixed", "uniform", "normal", "lognormal")


@dataclass(frozen=True)
class LengthDist:
    """Token counts: fixed (mean), uniform [low, high], normal or lognormal (mean, std), each
    clipped to [low, high]."""

    kind: str
    mean: float = 0.0
    std: float = 0.0
    low: int = 1
    high: int = 2048

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise InvalidRequest(f"length kind {self.kind!r}: choose one of {LENGTH_KINDS}")
        if not 1 <= self.low <= self.high:
            raise InvalidRequest(f"lengths need 1 <= low <= high, got [{self.low}, {self.high}]")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.mean)
        elif self.kind == "uniform":
            x = rng.integers(self.low, self.high + 1, n).astype(float)
        elif self.kind == "normal":
            x = rng.normal(self.mean, self.std, n)
        else:
            sigma2 = math.log(1 + (self.std / self.mean) ** 2)
            x = rng.lognormal(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2), n)
        return np.clip(np.rint(x), self.low, self.high).astype(np.int64)

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """`fixed:N`, `uniform:LO:HI`, `normal:MEAN:STD[:LO:HI]`, `lognormal:MEAN:STD[:LO:HI]`."""
        kind, *nums = text.split(":")
        try:
            v = [float(x) for x in nums]
            if kind == "fixed" and len(v) == 1:
                return cls("fixed", mean=v[0], low=int(v[0]), high=int(v[0]))
            if kind == "uniform" and len(v) == 2:
                return cls("uniform", low=int(v[0]), high=int(v[1]))
            if kind in ("normal", "lognormal") and len(v) in (2, 4):
                clip = {"low": int(v[2]), "high": int(v[3])} if len(v) == 4 else {}
                return cls(kind, mean=v[0], std=v[1], **clip)
        except ValueError:
            pass
        raise InvalidRequest(
            f"length {text!r}: expected fixed:N, uniform:LO:HI, normal:MEAN:STD[:LO:HI] or "
            "lognormal:MEAN:STD[:LO:HI]",
            param="workload",
        )


@dataclass(frozen=True)
class Requests:
    """n requests as arrays: arrival time (s), prompt tokens, output tokens (>= 1)."""

    arrival_s: np.ndarray
    prompt: np.ndarray
    output: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival_s)

    def at_rate(self, scale: float) -> Requests:
        """The same requests with arrival times divided by `scale` (rate multiplied by it)."""
        return Requests(self.arrival_s / scale, self.prompt, self.output)


@dataclass(frozen=True)
class Workload:
    """A synthetic workload: arrival process and length distributions."""

    name: str
    prompt: LengthDist
    output: LengthDist
    cv: float = 1.0  # coefficient of variation of inter-arrival times; 1 is Poisson

    def __post_init__(self) -> None:
        if self.cv <= 0:
            raise InvalidRequest("burstiness cv must be positive", param="workload")

    def sample(self, n: int, seed: int = 0) -> Requests:
        """n requests at rate 1 per second."""
        rng = np.random.default_rng(seed)
        if self.cv == 1.0:
            gaps = rng.exponential(1.0, n)
        else:
            shape = 1.0 / self.cv**2  # gamma: mean shape*scale = 1, cv = 1/sqrt(shape)
            gaps = rng.gamma(shape, 1.0 / shape, n)
        return Requests(np.cumsum(gaps), self.prompt.sample(rng, n), self.output.sample(rng, n))

    @property
    def max_tokens(self) -> int:
        return self.prompt.high + self.output.high


@dataclass(frozen=True)
class TraceWorkload:
    """Requests replayed from a trace; rescaled in time to any rate, repeated when too short."""

    name: str
    arrival_s: np.ndarray
    prompt: np.ndarray
    output: np.ndarray

    @classmethod
    def load(cls, path: str | Path) -> TraceWorkload:
        rows: list[tuple[float, int, int]] = []
        path = Path(path)
        try:
            for line in path.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    rows.append(
                        (float(r["arrival_s"]), int(r["prompt_tokens"]), int(r["output_tokens"]))
                    )
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            where = f"request {len(rows) + 1}"
            raise InvalidRequest(f"trace {path} ({where}): {e!r}", param="workload") from e
        if len(rows) < 2:
            raise InvalidRequest(f"trace {path} needs at least 2 requests", param="workload")
        a = np.array(rows, dtype=float)
        if np.any(np.diff(a[:, 0]) < 0) or np.any(a[:, 1:] < 1):
            raise InvalidRequest(
                f"trace {path}: arrivals must not decrease and token counts must be >= 1",
                param="workload",
            )
        return cls(path.name, a[:, 0] - a[0, 0], a[:, 1].astype(np.int64), a[:, 2].astype(np.int64))

    def sample(self, n: int, seed: int = 0) -> Requests:
        """The first n requests (the trace repeated as needed) at rate 1 per second."""
        m = len(self.arrival_s)
        span = self.arrival_s[-1] * m / (m - 1)  # one mean gap past the last arrival
        reps = -(-n // m)
        t = np.concatenate([self.arrival_s + k * span for k in range(reps)])[:n]
        rate = m / span
        return Requests(t * rate, np.tile(self.prompt, reps)[:n], np.tile(self.output, reps)[:n])

    @property
    def max_tokens(self) -> int:
        return int((self.prompt + self.output).max())


PRESETS: dict[str, Workload] = {
    "chat": Workload(
        "chat",
        LengthDist("lognormal", 750, 600, 4, 1536),
        LengthDist("lognormal", 200, 200, 1, 512),
    ),
    "code": Workload(
        "code",
        LengthDist("lognormal", 170, 80, 8, 1024),
        LengthDist("lognormal", 100, 60, 1, 512),
    ),
    "summarization": Workload(
        "summarization",
        LengthDist("lognormal", 1700, 250, 256, 1900),
        LengthDist("lognormal", 90, 50, 1, 148),
    ),
}


def parse_workload(text: str) -> Workload | TraceWorkload:
    """A preset (`chat`, `code`, `summarization`, optionally `:cv=2`), a trace (`trace:FILE`),
    or `prompt=DIST,output=DIST[,cv=X]` with DIST as `LengthDist.parse` takes it."""
    if text.startswith("trace:"):
        return TraceWorkload.load(text.removeprefix("trace:"))
    name, _, rest = text.partition(":")
    if name in PRESETS:
        fields = _key_values(rest, text) if rest else {}
        base = PRESETS[name]
        cv = float(fields.pop("cv", base.cv))
        if fields:
            raise InvalidRequest(f"workload {text!r}: unknown options {sorted(fields)}")
        return Workload(f"{name}:cv={cv:g}" if cv != 1 else name, base.prompt, base.output, cv)
    fields = _key_values(text, text) if "=" in text else {}
    try:
        prompt, output = fields.pop("prompt"), fields.pop("output")
    except KeyError:
        raise InvalidRequest(
            f"workload {text!r}: give a preset ({', '.join(PRESETS)}), trace:FILE, or "
            "prompt=DIST,output=DIST[,cv=X]",
            param="workload",
        ) from None
    cv = float(fields.pop("cv", 1.0))
    if fields:
        raise InvalidRequest(f"workload {text!r}: unknown options {sorted(fields)}")
    return Workload(text, LengthDist.parse(prompt), LengthDist.parse(output), cv)


def _key_values(text: str, whole: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if not eq:
            raise InvalidRequest(f"workload {whole!r}: expected key=value, got {part!r}")
        out[key.strip()] = value.strip()
    return out
