"""Prometheus metrics of every service: one registry per process, served on `/metrics`.

Counters and gauges a worker already keeps (its `WorkerStats`, the same numbers the `Stats` RPC
returns) are read at scrape time by `StatsCollector`, so nothing is counted twice; latencies
are histograms observed where they are measured.

Names follow Prometheus conventions (`_total`, `_seconds`, `_bytes`); the GenAI semantic
conventions' `gen_ai.server.*` histograms keep their names with dots as underscores.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.gen.distserve.v1 import common_pb2

# Bucket boundaries the GenAI semantic conventions recommend (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)  # fmt: skip
# Our own phases (queue waits, batches, KV transfers): from sub-millisecond up.
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 30.0)  # fmt: skip


# Sequences in one engine step.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def add_metrics_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus /metrics port; 0 any free, -1 off"
    )


def serve(registry: CollectorRegistry, host: str, port: int) -> str:
    """Serve `registry` on http://host:port/metrics (port 0: any free) from a daemon thread;
    returns host:port. A negative port serves nothing and returns ""."""
    if port < 0:
        return ""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return f"{host}:{server.server_port}"


def phase_histogram(registry: CollectorRegistry, name: str, doc: str) -> Histogram:
    return Histogram(name, doc, buckets=PHASE_BUCKETS, registry=registry)


class PrefillPhases:
    """A prompt's wait for a prefill batch and the batch's pass: histograms and spans, the same
    on prefill and colocated instances."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue = phase_histogram(
            registry, "distserve_prefill_queue_seconds", "Time waiting for a prefill batch."
        )
        self.compute = phase_histogram(
            registry, "distserve_prefill_compute_seconds", "Time of the prefill batch's pass."
        )

    def record(self, trace, submitted: float, info, cached_tokens: int = 0) -> None:
        """`info`: the engine's StepInfo of the batch (monotonic `started`, `seconds`);
        `cached_tokens`: the request's prompt tokens whose KV came from the prefix cache."""
        from services.common import telemetry

        self.queue.observe(info.started - submitted)
        self.compute.observe(info.seconds)
        telemetry.record("prefill.queue", trace, submitted, info.started)
        telemetry.record(
            "prefill.compute",
            trace,
            info.started,
            info.started + info.seconds,
            {
                "prefill.batch_size": info.batch_size,
                "prefill.batch_tokens": info.batch_tokens,
                "prefill.cached_tokens": cached_tokens,
            },
        )


class EngineSteps:
    """The engine's steps by kind (prefill, decode): how many, how long, how many sequences and
    tokens. Decode steps per generated token show how well requests share steps (a decode step
    serves its whole batch), which latency figures alone do not."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Histogram(
            "distserve_engine_step_seconds",
            "Time of one engine step (its batch's forward pass and sampling).",
            ["kind"],
            buckets=PHASE_BUCKETS,
            registry=registry,
        )
        self.batch = Histogram(
            "distserve_engine_step_batch_size",
            "Sequences in one engine step.",
            ["kind"],
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "distserve_engine_step_tokens",
            "Tokens engine steps computed: prompt tokens (prefill), one per sequence (decode).",
            ["kind"],
            registry=registry,
        )

    def observe(self, info) -> None:
        """`info`: the engine's StepInfo of one step."""
        self.seconds.labels(info.kind).observe(info.seconds)
        self.batch.labels(info.kind).observe(info.batch_size)
        self.tokens.labels(info.kind).inc(info.batch_tokens)


# WorkerStats counters: field -> (metric name without _total, help)
_COUNTERS = {
    "requests_total": ("distserve_worker_requests", "Requests this worker accepted."),
    "requests_aborted": ("distserve_worker_requests_aborted", "Requests cancelled or failed."),
    "handles_released": ("distserve_kv_handles_released", "Held KV handles released."),
    "leases_expired": ("distserve_kv_leases_expired", "KV leases that lapsed unclaimed."),
    "blocks_reclaimed": ("distserve_kv_blocks_reclaimed", "KV blocks freed by lapsed leases."),
    "pulls_total": ("distserve_kv_pulls", "KV pulls completed."),
    "pull_bytes_total": ("distserve_kv_transfer_bytes", "Bytes of KV pulled."),
    "pulls_failed": ("distserve_kv_pulls_failed", "KV pulls that gave up."),
    "chunks_retried": ("distserve_kv_chunks_retried", "KV chunks fetched again."),
    "checksum_failures": ("distserve_kv_checksum_failures", "KV chunks that failed checksums."),
    "chunks_unverified": (
        "distserve_kv_chunks_unverified",
        "KV chunks used without a checksum check (received straight into device memory).",
    ),
    "reconnects": ("distserve_kv_reconnects", "UCX endpoints re-established."),
    "lease_renewals": ("distserve_kv_lease_renewals", "KV leases renewed while pulling."),
    "prompt_tokens_computed": (
        "distserve_prompt_tokens_computed",
        "Prompt tokens whose KV was computed here.",
    ),
    "prompt_tokens_cached": (
        "distserve_prompt_tokens_cached",
        "Prompt tokens whose KV was reused from the prefix cache (decode: pulled blocks it had).",
    ),
    "kv_blocks_evicted": ("distserve_kv_blocks_evicted", "Cached KV blocks evicted for room."),
}
# WorkerLoad gauges: field -> (metric name, help)
_GAUGES = {
    "queued_prompt_tokens": ("distserve_queued_prompt_tokens", "Prompt tokens waiting."),
    "waiting_seqs": ("distserve_waiting_seqs", "Sequences waiting to be scheduled."),
    "running_seqs": ("distserve_running_seqs", "Sequences in the running batch."),
    "free_kv_blocks": ("distserve_kv_blocks_free", "Free KV blocks."),
    "total_kv_blocks": ("distserve_kv_blocks_total", "KV blocks in the pool."),
    "max_model_len": ("distserve_max_model_len", "Longest prompt + output served, tokens."),
    "pending_pulls": ("distserve_kv_pulls_pending", "Requests waiting for or pulling KV."),
    "held_kv_handles": ("distserve_kv_handles_held", "KV handles held for decode instances."),
}


class StatsCollector(Collector):
    """Reads a worker's `WorkerStats` at each scrape and exposes it as metrics."""

    def __init__(self, stats: Callable[[], common_pb2.WorkerStats]) -> None:
        self.stats = stats

    def collect(self):
        stats = self.stats()
        labels = ["worker"]
        values = [stats.worker_id]
        for field, (name, doc) in _COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, getattr(stats, field))
            yield c
        load = stats.load
        for field, (name, doc) in _GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, getattr(load, field))
            yield g
        capacity = GaugeMetricFamily(
            "distserve_kv_capacity_tokens", "Tokens the KV pool holds.", labels=labels
        )
        capacity.add_metric(values, load.total_kv_blocks * load.kv_block_size)
        yield capacity
        used = GaugeMetricFamily("distserve_kv_blocks_used", "KV blocks in use.", labels=labels)
        used.add_metric(values, load.total_kv_blocks - load.free_kv_blocks)
        yield used
        cached = GaugeMetricFamily(
            "distserve_prefix_cache_blocks",
            "KV blocks the prefix cache holds (in use or evictable).",
            labels=labels,
        )
        cached.add_metric(values, stats.prefix_cache_blocks)
        yield cached


def worker_registry() -> CollectorRegistry:
    """A registry with the process's own metrics (CPU, memory, open files, GC); a worker adds
    its `StatsCollector` and histograms."""
    from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR

    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry
