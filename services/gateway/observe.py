"""What the gateway sees of each request: its root span and the client-facing latencies.

The gateway is where a request's tokens reach the client, so TTFT, the first inter-token gap
(the handoff bubble of a disaggregated request: the pull of its KV sits between its first and
second token) and TPOT are measured here, on the span and in the metrics, and SLO attainment is
kept over a sliding window.
"""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from services.common import clock, telemetry
from services.common.metrics import DURATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from services.common.slo import Slo
from services.gateway.admission import Admission, Verdict
from services.gateway.request import Request

_GENAI = ["gen_ai_operation_name", "gen_ai_request_model"]


class SloWindow:
    """Joint SLO attainment of the requests that finished in the last `window_s` seconds."""

    def __init__(self, slo: Slo) -> None:
        self.slo = slo
        self._done: collections.deque[tuple[float, bool]] = collections.deque()

    def add(self, ok: bool, now: float | None = None) -> None:
        self._done.append((clock.monotonic() if now is None else now, ok))

    def attainment(self, now: float | None = None) -> tuple[float, int]:
        """(share of requests that met both SLOs, how many requests); (1.0, 0) when idle."""
        cutoff = (clock.monotonic() if now is None else now) - self.slo.window_s
        while self._done and self._done[0][0] < cutoff:
            self._done.popleft()
        n = len(self._done)
        return (sum(ok for _, ok in self._done) / n if n else 1.0), n


class GatewayMetrics:
    """The gateway's Prometheus metrics."""

    def __init__(self, registry: CollectorRegistry, slo: Slo) -> None:
        self.registry = registry
        self.slo = slo
        self.window = SloWindow(slo)
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Time to generate the first token (gen_ai.server.time_to_first_token).",
            _GENAI,
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Time per output token after the first (gen_ai.server.time_per_output_token).",
            _GENAI,
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "Request duration, first byte in to last token out (gen_ai.server.request.duration).",
            [*_GENAI, "error_type"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.first_gap = Histogram(
            "distserve_first_token_gap_seconds",
            "Gap between the first and second token: the handoff bubble when disaggregated.",
            ["mode"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "distserve_gateway_requests",
            "Requests that ended, by outcome (a finish reason or an error status).",
            ["outcome"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "distserve_gateway_requests_in_flight", "Requests being served.", registry=registry
        )
        self.routes = Counter(
            "distserve_routes",
            "Requests by path: disaggregated, local-prefill (conditional disaggregation: a short "
            "prompt prefilled on a decode instance), colocated.",
            ["route"],
            registry=registry,
        )
        self.refusals = Counter(
            "distserve_admission_refusals",
            "Requests refused at admission (RESOURCE_EXHAUSTED / HTTP 429), by rule: inflight, "
            "ttft (predicted to miss the TTFT SLO), decode_watermark.",
            ["reason"],
            registry=registry,
        )
        self.migrations = Counter(
            "distserve_migrations",
            "Requests moved to another instance mid-flight, by reason.",
            ["reason"],
            registry=registry,
        )
        attainment = Gauge(
            "distserve_slo_attainment",
            "Share of requests finished in the window that met both the TTFT and TPOT SLO.",
            ["ttft_slo_seconds", "tpot_slo_seconds", "window_seconds"],
            registry=registry,
        )
        attainment.labels(slo.ttft_s, slo.tpot_s, slo.window_s).set_function(
            lambda: self.window.attainment()[0]
        )
        Gauge(
            "distserve_slo_window_requests",
            "Requests finished in the SLO window.",
            registry=registry,
        ).set_function(lambda: self.window.attainment()[1])

    def watch_admission(self, admission: Admission) -> None:
        """What admission works from, at each scrape: its calibrations and the decode seats."""
        gauges = [
            (
                "distserve_admission_ttft_scale",
                "The factor admission's TTFT predictions are scaled by (95th percentile of "
                "actual / predicted over the latest requests).",
                lambda: admission.ttft_scale,
            ),
            (
                "distserve_admission_step_limit_seconds",
                "The decode step time admission fills the decode pool up to, for a long answer "
                "(the TPOT SLO, calibrated).",
                lambda: admission.step_limit(0) / 1000,
            ),
            (
                "distserve_admission_bubble_steps",
                "The handoff bubble (first inter-token gap) in steady decode steps, median.",
                lambda: admission.bubble,
            ),
            (
                "distserve_admission_decode_seats",
                "Sequences the decode pool runs within the step limit (-1: not known yet).",
                lambda: _or(admission.pool_seats()[0], -1),
            ),
            (
                "distserve_admission_decode_seats_taken",
                "Sequences on decode instances and prompts on their way there.",
                lambda: admission.pool_seats()[1],
            ),
        ]
        for name, doc, read in gauges:
            Gauge(name, doc, registry=self.registry).set_function(read)

    def watch(self, routing) -> None:
        """Live workers per role, from the worker registry, and the prompt tokens routed, at
        each scrape."""
        registry = routing.registry
        workers = Gauge(
            "distserve_workers", "Live workers by role.", ["role"], registry=self.registry
        )
        for role in ("prefill", "decode", "colocated"):
            workers.labels(role).set_function(lambda role=role: len(registry.live(role)))
        self.registry.register(_PrefixTokens(routing))


class _PrefixTokens:
    """Prompt tokens routed, and how many of them the chosen worker's prefix cache held (the
    routing's hit rate is cached / prompt; its quality against the best choice, cached /
    best)."""

    def __init__(self, routing) -> None:
        self._routing = routing

    def collect(self):
        family = CounterMetricFamily(
            "distserve_gateway_prefix_tokens",
            "Prompt tokens routed, by the role of the worker chosen and kind: prompt (all), "
            "cached (held in that worker's prefix cache), best (held by the worker of that role "
            "holding the most of each prompt).",
            labels=["role", "kind"],
        )
        for (role, kind), n in sorted(self._routing.prefix_tokens.items()):
            family.add_metric([role, kind], n)
        yield family


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


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _error_type(error: BaseException | None) -> str:
    if error is None:
        return "CANCELLED"
    return getattr(error, "status", None) or type(error).__name__
