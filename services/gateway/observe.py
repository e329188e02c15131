"""What the gateway sees of each request: its root span and the client-facing latencies.

The gateway is where a request's tokens reach the client, so TTFT, the first inter-token gap
(the handoff bubble of a disaggregated request: the pull of its KV sits between its first and
second token) and TPOT are measured here, on the span and in the metrics, and SLO attainment is
kept over a sliding window (the metrics themselves: gateway/metrics.py).
"""

from __future__ import annotations

from services.common import clock, telemetry
from services.gateway.admission import Verdict
from services.gateway.metrics import GatewayMetrics
from services.gateway.request import Request


class RequestObserver:
    """One request at the gateway: opens its root span, notes when tokens reach the client,
    and on `finish` sets the span's attributes and feeds the metrics."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        req: Request,
        model: str,
        operation: str,
        parent: telemetry.Context | None,
        received: float | None = None,
    ) -> None:
        """`received`: when the request arrived (monotonic s; default now): TTFT and the
        span count from there, validation and tokenization included."""
        self.metrics = metrics
        self.model = model
        self.operation = operation
        self.mode = "none"  # no serving path yet
        self.prompt_tokens = len(req.prompt_ids)
        self.start = clock.monotonic() if received is None else received
        self.arrival_unix_s = clock.time_s() - (clock.monotonic() - self.start)
        self.first: float | None = None  # first token out
        self.second: float | None = None  # the message with the second token
        self.last: float | None = None
        self.tokens = 0
        self.ttft_s: float | None = None  # set by finish
        self.tpot_s = 0.0
        self.span = telemetry.start(
            f"{operation} {model}",
            parent,
            {
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": model,
                "gen_ai.request.max_tokens": req.params.max_tokens,
                "gen_ai.request.temperature": req.params.temperature,
                "gen_ai.request.top_p": req.params.top_p,
                "gen_ai.usage.input_tokens": len(req.prompt_ids),
                "distserve.request_id": req.request_id,
            },
            self.start,
        )
        self.context = telemetry.context_of(self.span) if telemetry.enabled() else None
        metrics.in_flight.inc()

    def set_mode(self, mode: str) -> None:
        """How the request is served: disaggregated or colocated."""
        self.mode = mode
        self.span.set_attribute("distserve.mode", mode)

    def admitted(self, verdict: Verdict | None) -> None:
        """Admission let the request in: its prediction, for comparing with what happened."""
        if verdict is None or verdict.predicted_ttft_ms is None:
            return
        self.span.set_attributes(
            {
                "distserve.admission.predicted_ttft_ms": round(verdict.predicted_ttft_ms, 1),
                "distserve.admission.queued_tokens": verdict.queued_tokens,
                "distserve.admission.waited_ms": round(verdict.waited_ms, 1),
            }
        )
        if verdict.predicted_tpot_ms is not None:
            self.span.set_attribute(
                "distserve.admission.predicted_tpot_ms", round(verdict.predicted_tpot_ms, 1)
            )

    def tokens_out(self, n: int) -> None:
        if n <= 0:
            return
        now = clock.monotonic()
        if self.first is None:
            self.first = now
            if n > 1:
                self.second = now
        elif self.second is None:
            self.second = now
        self.tokens += n
        self.last = now

    def bubble_steps(self) -> float | None:
        """The first inter-token gap in steady inter-token gaps (None under three tokens)."""
        if self.tokens <= 2 or self.second is None or self.last is None:
            return None
        steady = (self.last - self.second) / (self.tokens - 2)
        return (self.second - self.first) / steady if steady > 0 else None

    def finish(self, reason: str | None, error: BaseException | None = None) -> None:
        """The request ended: with a finish reason, or an error (None: the client left)."""
        m = self.metrics
        m.in_flight.dec()
        end = clock.monotonic()
        genai = (self.operation, self.model)
        outcome = reason or _error_type(error)
        m.requests.labels(outcome).inc()
        m.duration.labels(*genai, "" if reason else outcome).observe(end - self.start)
        attrs: dict = {"gen_ai.usage.output_tokens": self.tokens}
        if reason:
            attrs["gen_ai.response.finish_reasons"] = [reason]
        ttft = tpot = None
        if self.first is not None:
            ttft = self.first - self.start
            m.ttft.labels(*genai).observe(ttft)
            attrs["distserve.ttft_ms"] = ttft * 1000
        if self.second is not None:
            gap = self.second - self.first
            m.first_gap.labels(self.mode).observe(gap)
            attrs["distserve.first_itl_ms"] = gap * 1000
        if self.tokens > 1:
            tpot = (self.last - self.first) / (self.tokens - 1)
            m.tpot.labels(*genai).observe(tpot)
        self.ttft_s, self.tpot_s = ttft, tpot or 0.0
        if self.tokens > 2 and self.second is not None:
            attrs["distserve.tpot_ms"] = (self.last - self.second) / (self.tokens - 2) * 1000
        if reason:
            ok = ttft is not None and m.slo.met(ttft, tpot or 0.0)
            m.window.add(ok, end)
            attrs["distserve.slo_met"] = ok
        elif error is not None:
            m.window.add(False, end)
            telemetry.fail(self.span, error)
            attrs["error.type"] = outcome
        else:
            telemetry.fail(self.span, "cancelled by the client")
            attrs["error.type"] = outcome
        self.span.set_attributes(attrs)
        self.span.end()


def _error_type(error: BaseException | None) -> str:
    if error is None:
        return "CANCELLED"
    return getattr(error, "status", None) or type(error).__name__
