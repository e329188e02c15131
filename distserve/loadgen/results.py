"""What a load run measured, per request and in summary.

Timing rules (times in seconds from the start of the run, one monotonic clock):

* `sent_s`: just before the request is handed to the channel; TTFT and latency count from it
  (`send_lag_s = sent_s - arrival_s` is the generator's own lateness, reported apart).
* Every token is stamped with the arrival of the message that carried it: a gRPC response with
  three token ids stamps three tokens at once, so the inter-token gaps are the gap to that message
  for its first token and 0 for the others. An SSE event carries text, not a token count, so over
  HTTP the gaps are between events, and the token count is the server's usage figure.
* TTFT: first message - sent; latency: last message carrying tokens - sent;
  TPOT = (latency - TTFT) / (output_tokens - 1), 0 for a one-token output.
* A failed request has NaN times and its status (`error`); it never meets an SLO.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.common.slo import Slo
from services.common.stats import percentile

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as it happened, filled in by the runner."""

    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    sent_s: float = float("nan")
    message_s: list[float] = field(default_factory=list)  # messages that carried tokens
    message_tokens: list[int | None] = field(default_factory=list)  # None: not said (SSE)
    server_tokens: int | None = None  # the server's own count (usage), when given
    error: str | None = None  # status, e.g. INVALID_ARGUMENT or HTTP 400
    error_message: str = ""

    @property
    def output_tokens(self) -> int:
        if self.server_tokens is not None:
            return self.server_tokens
        return sum(n if n is not None else 1 for n in self.message_tokens)

    def token_gaps(self) -> np.ndarray:
        """Seconds between consecutive tokens (between SSE events when counts are unknown)."""
        times = np.asarray(self.message_s)
        if self.message_tokens and all(n is not None for n in self.message_tokens):
            times = np.repeat(times, np.asarray(self.message_tokens, dtype=np.int64))
        return np.diff(times)


@dataclass(frozen=True)
class LoadResult:
    """Per request, in the order given: arrays of equal length (NaN where a request failed)."""

    target: str
    arrival_s: np.ndarray
    sent_s: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    latency_s: np.ndarray
    prompt_tokens: np.ndarray
    expected_tokens: np.ndarray  # max_tokens asked for
    output_tokens: np.ndarray  # received
    error: tuple[str | None, ...]
    error_message: tuple[str, ...]
    token_gaps_s: tuple[np.ndarray, ...]  # per request
    duration_s: float  # first send to last reply

    @classmethod
    def from_records(cls, target: str, records: list[RequestRecord], duration_s: float):
        n = len(records)
        ttft, latency, tpot = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
        out = np.array([r.output_tokens for r in records], dtype=np.int64)
        for i, r in enumerate(records):
            if r.error is None and r.message_s:
                ttft[i] = r.message_s[0] - r.sent_s
                latency[i] = r.message_s[-1] - r.sent_s
                tpot[i] = (latency[i] - ttft[i]) / (out[i] - 1) if out[i] > 1 else 0.0
        return cls(
            target=target,
            arrival_s=np.array([r.arrival_s for r in records]),
            sent_s=np.array([r.sent_s for r in records]),
            ttft_s=ttft,
            tpot_s=tpot,
            latency_s=latency,
            prompt_tokens=np.array([r.prompt_tokens for r in records], dtype=np.int64),
            expected_tokens=np.array([r.max_tokens for r in records], dtype=np.int64),
            output_tokens=out,
            error=tuple(r.error for r in records),
            error_message=tuple(r.error_message for r in records),
            token_gaps_s=tuple(r.token_gaps() for r in records),
            duration_s=duration_s,
        )

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def ok(self) -> np.ndarray:
        """Requests that succeeded: no error and a first token."""
        return np.array([e is None for e in self.error]) & ~np.isnan(self.ttft_s)

    @property
    def send_lag_s(self) -> np.ndarray:
        """How late each request left the generator, against its arrival time."""
        return self.sent_s - self.arrival_s

    def met(self, slo: Slo) -> np.ndarray:
        """Per request: succeeded, TTFT <= slo.ttft_s and TPOT <= slo.tpot_s (jointly)."""
        with np.errstate(invalid="ignore"):
            return self.ok & slo.met(self.ttft_s, self.tpot_s)

    def attainment(self, slo: Slo, first: int = 0) -> float:
        """Fraction of requests (from the `first`) meeting both SLOs; failures count as misses."""
        met = self.met(slo)[first:]
        return float(np.mean(met)) if len(met) else float("nan")

    def percentiles(self, values: np.ndarray, qs: tuple[int, ...] = PERCENTILES) -> dict:
        """`{"p50": ..}` over the successful requests' values (NaN when none succeeded)."""
        v = values[self.ok]
        return {f"p{q}": percentile(v, q) for q in qs}

    def summary(self, slo: Slo | None = None) -> dict:
        """A JSON-serialisable summary; times in ms."""
        ms = 1000.0
        ok = self.ok
        gaps = np.concatenate(self.token_gaps_s) if self.token_gaps_s else np.zeros(0)
        errors: dict[str, int] = {}
        for e in self.error:
            if e is not None:
                errors[e] = errors.get(e, 0) + 1
        out = {
            "target": self.target,
            "requests": len(self),
            "succeeded": int(ok.sum()),
            "errors": errors,
            "duration_s": round(self.duration_s, 3),
            "offered_rate_rps": _rate(self.arrival_s),
            "throughput_rps": round(int(ok.sum()) / self.duration_s, 3) if self.duration_s else 0,
            "output_tokens": int(self.output_tokens[ok].sum()),
            "exact_lengths": int((self.output_tokens[ok] == self.expected_tokens[ok]).sum()),
        }
        for name, v in (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("latency", self.latency_s)):
            out[f"{name}_ms"] = {k: _round(x * ms) for k, x in self.percentiles(v).items()}
        out["token_gap_ms"] = {
            f"p{q}": _round(percentile(gaps, q) * ms) if len(gaps) else None for q in PERCENTILES
        }
        lag = self.send_lag_s[~np.isnan(self.sent_s)]
        out["send_lag_ms"] = {
            "p50": _round(float(np.median(lag)) * ms) if len(lag) else None,
            "max": _round(float(lag.max()) * ms) if len(lag) else None,
        }
        if slo is not None:
            out["slo"] = {"ttft_ms": slo.ttft_s * ms, "tpot_ms": slo.tpot_s * ms}
            out["attainment"] = round(self.attainment(slo), 4)
        return out


def _rate(arrival_s: np.ndarray) -> float | None:
    if len(arrival_s) < 2 or arrival_s[-1] <= arrival_s[0]:
        return None
    return round((len(arrival_s) - 1) / float(arrival_s[-1] - arrival_s[0]), 3)


def _round(x: float) -> float | None:
    return None if x != x else round(x, 3)
