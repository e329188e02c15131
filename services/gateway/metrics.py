"""The gateway's Prometheus metrics: request latencies against the SLO over a sliding window,
admission's view, live workers, the prompt tokens routed and what the prefix caches held of
them. gateway/observe.py feeds them, one request at a time."""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from services.common import clock
from services.common.metrics import DURATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from services.common.slo import Slo
from services.gateway.admission import Admission

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


def _or(value: int | None, default: int) -> int:
    return default if value is None else value
