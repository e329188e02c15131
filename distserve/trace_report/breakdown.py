"""Requests from spans (one gateway span each) and where each one's time went: queueing, prefill,
KV handoff, the handoff bubble, TPOT; percentiles and a summary over them."""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from distserve.trace_report.spans import (
    DECODE_QUEUE,
    GATEWAY_SERVICE,
    KV_HANDOFF,
    NS_PER_MS,
    PREFILL_COMPUTE,
    PREFILL_QUEUE,
    REQUEST_MARKER,
    Span,
)
from services.common.stats import percentile

# Per-request columns that get percentiles: (Breakdown field, text heading).
COLUMNS = (
    ("input_tokens", "in"),
    ("output_tokens", "out"),
    ("ttft_ms", "ttft"),
    ("queue_ms", "queue"),
    ("prefill_ms", "prefill"),
    ("handoff_ms", "handoff"),
    ("first_itl_ms", "itl1"),
    ("tpot_ms", "tpot"),
    ("total_ms", "total"),
)


@dataclass(frozen=True)
class RequestTrace:
    """One request: its gateway span, the spans below it, and the spans above it (Envoy)."""

    root: Span
    spans: tuple[Span, ...]  # descendants at any depth, by start time
    ancestors: tuple[Span, ...]  # in the file, outermost first

    def named(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.name == name]


def is_request_span(span: Span) -> bool:
    # A client library may also set gen_ai.operation.name on its own span: the service decides.
    return span.service == GATEWAY_SERVICE and REQUEST_MARKER in span.attributes


def _chain_up(span: Span, trace: dict[str, Span]) -> list[Span]:
    """The ancestors of `span` present in the file, nearest first (stops at a cycle)."""
    chain: list[Span] = []
    seen = {span.span_id}
    parent = span.parent_span_id
    while parent in trace and parent not in seen:
        seen.add(parent)
        chain.append(trace[parent])
        parent = trace[parent].parent_span_id
    return chain


def requests(spans: Iterable[Span]) -> list[RequestTrace]:
    """Group spans into requests, sorted by start time; spans of no request are left out.

    A span belongs to the nearest request span above it. A span whose parent is missing from the
    file (sampled out, or its process crashed) belongs to its trace's request if the trace has
    exactly one.
    """
    by_trace: dict[str, dict[str, Span]] = defaultdict(dict)
    for s in spans:
        by_trace[s.trace_id].setdefault(s.span_id, s)  # an exporter may write a span twice
    out: list[RequestTrace] = []
    for trace in by_trace.values():
        roots = [s for s in trace.values() if is_request_span(s)]
        if not roots:
            continue
        root_ids = {r.span_id for r in roots}
        above = {r.span_id: _chain_up(r, trace) for r in roots}
        above_ids = {a.span_id for chain in above.values() for a in chain}
        members: dict[str, list[Span]] = defaultdict(list)
        for s in trace.values():
            if s.span_id in root_ids or s.span_id in above_ids:
                continue
            owner = next((a.span_id for a in _chain_up(s, trace) if a.span_id in root_ids), None)
            if owner is None and len(roots) == 1:
                owner = roots[0].span_id
            if owner is not None:
                members[owner].append(s)
        for r in roots:
            below = sorted(members[r.span_id], key=lambda s: (s.start_ns, s.span_id))
            out.append(RequestTrace(r, tuple(below), tuple(reversed(above[r.span_id]))))
    return sorted(out, key=lambda r: (r.root.start_ns, r.root.span_id))


@dataclass(frozen=True)
class BubbleRule:
    """When a request's first inter-token latency (the handoff bubble) counts as too large."""

    ms: float | None = None  # an absolute threshold; when set, `factor` is not used
    factor: float = 3.0  # times the request's steady TPOT

    def threshold_ms(self, tpot_ms: float | None) -> float | None:
        if self.ms is not None:
            return self.ms
        return None if tpot_ms is None else self.factor * tpot_ms

    def describe(self) -> str:
        if self.ms is not None:
            return f"first ITL > {self.ms:g} ms"
        return f"first ITL > {self.factor:g} x TPOT"


@dataclass(frozen=True)
class Breakdown:
    """Where one request's time went, in ms; None where its spans or attributes are missing."""

    request_id: str
    trace_id: str
    mode: str | None
    status: str
    status_message: str
    model: str | None
    start_unix_nano: int
    input_tokens: int | None
    output_tokens: int | None
    ttft_ms: float | None
    queue_ms: float | None  # prefill.queue + decode.queue
    prefill_queue_ms: float | None
    decode_queue_ms: float | None
    prefill_ms: float | None  # prefill.compute, all attempts
    prefill_attempts: int
    handoff_ms: float | None  # kv.handoff, all attempts
    handoff_attempts: int
    first_itl_ms: float | None  # the handoff bubble
    tpot_ms: float | None
    total_ms: float
    bubble_threshold_ms: float | None
    flagged: bool
    kv_bytes: int | None
    kv_chunks_retried: int | None
    kv_bandwidth_bytes_per_s: float | None  # mean over the handoffs that did not fail
    kv_transport: str | None
    kv_overlap_fraction: float | None  # of the last handoff
    # TTFT split by what the spans show happening before the first token:
    ttft_queue_ms: float | None
    ttft_compute_ms: float | None
    ttft_other_ms: float | None  # gateway, network, anything no span covers

    @property
    def retries(self) -> int:
        return max(self.prefill_attempts, self.handoff_attempts, 1) - 1


def _number(attrs: dict[str, Any], key: str) -> float | None:
    v = attrs.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _integer(attrs: dict[str, Any], key: str) -> int | None:
    v = _number(attrs, key)
    return None if v is None else int(v)


def _text(attrs: dict[str, Any], key: str) -> str | None:
    v = attrs.get(key)
    return None if v is None else str(v)


def _sum_ms(spans: list[Span]) -> float | None:
    return sum(s.duration_ms for s in spans) if spans else None


def _add(a: float | None, b: float | None) -> float | None:
    return None if a is None and b is None else (a or 0.0) + (b or 0.0)


def _covered_ms(spans: Iterable[Span], lo_ns: int, hi_ns: int) -> float:
    """How much of [lo, hi) the spans cover together, in ms (overlaps counted once)."""
    parts = sorted((max(s.start_ns, lo_ns), min(s.end_ns, hi_ns)) for s in spans)
    covered, reach = 0, lo_ns
    for start, end in parts:
        start = max(start, reach)
        if end > start:
            covered += end - start
            reach = end
    return covered / NS_PER_MS


def breakdown(req: RequestTrace, rule: BubbleRule) -> Breakdown:
    root, attrs = req.root, req.root.attributes
    pq, dq = _sum_ms(req.named(PREFILL_QUEUE)), _sum_ms(req.named(DECODE_QUEUE))
    computes, handoffs = req.named(PREFILL_COMPUTE), req.named(KV_HANDOFF)
    good = [h for h in handoffs if h.status != "ERROR"]
    bandwidths = [
        b for h in good if (b := _number(h.attributes, "kv.bandwidth_bytes_per_s")) is not None
    ]
    kv_bytes = [b for h in good if (b := _integer(h.attributes, "kv.bytes")) is not None]
    retried = [
        r for h in handoffs if (r := _integer(h.attributes, "kv.chunks_retried")) is not None
    ]
    ttft, tpot = _number(attrs, "distserve.ttft_ms"), _number(attrs, "distserve.tpot_ms")
    first_itl = _number(attrs, "distserve.first_itl_ms")
    threshold = rule.threshold_ms(tpot)
    ttft_split: tuple[float | None, float | None, float | None] = (None, None, None)
    if ttft is not None:
        first_token_ns = root.start_ns + round(ttft * NS_PER_MS)
        queues = req.named(PREFILL_QUEUE) + req.named(DECODE_QUEUE)
        compute = _covered_ms(computes, root.start_ns, first_token_ns)
        queue = _covered_ms(queues + computes, root.start_ns, first_token_ns) - compute
        ttft_split = (queue, compute, max(ttft - queue - compute, 0.0))
    last = handoffs[-1].attributes if handoffs else {}
    return Breakdown(
        request_id=str(attrs.get("distserve.request_id") or root.span_id),
        trace_id=root.trace_id,
        mode=_text(attrs, "distserve.mode"),
        status=root.status,
        status_message=root.status_message,
        model=_text(attrs, "gen_ai.request.model"),
        start_unix_nano=root.start_ns,
        input_tokens=_integer(attrs, "gen_ai.usage.input_tokens"),
        output_tokens=_integer(attrs, "gen_ai.usage.output_tokens"),
        ttft_ms=ttft,
        queue_ms=_add(pq, dq),
        prefill_queue_ms=pq,
        decode_queue_ms=dq,
        prefill_ms=_sum_ms(computes),
        prefill_attempts=len(computes),
        handoff_ms=_sum_ms(handoffs),
        handoff_attempts=len(handoffs),
        first_itl_ms=first_itl,
        tpot_ms=tpot,
        total_ms=root.duration_ms,
        bubble_threshold_ms=threshold,
        flagged=first_itl is not None and threshold is not None and first_itl > threshold,
        kv_bytes=sum(kv_bytes) if kv_bytes else None,
        kv_chunks_retried=sum(retried) if retried else None,
        kv_bandwidth_bytes_per_s=sum(bandwidths) / len(bandwidths) if bandwidths else None,
        kv_transport=_text(last, "kv.transport"),
        kv_overlap_fraction=_number(last, "kv.overlap_fraction"),
        ttft_queue_ms=ttft_split[0],
        ttft_compute_ms=ttft_split[1],
        ttft_other_ms=ttft_split[2],
    )


def percentiles(rows: Sequence[Breakdown]) -> dict[str, dict[str, float | int | None]]:
    """p50, p90, p99 (linear interpolation), max and count of each column, over the requests
    that have a value for it."""
    import numpy as np

    out: dict[str, dict[str, float | int | None]] = {}
    for column, _ in COLUMNS:
        values = np.array([v for r in rows if (v := getattr(r, column)) is not None], dtype=float)
        if values.size == 0:
            out[column] = {"p50": None, "p90": None, "p99": None, "max": None, "count": 0}
            continue
        p50, p90, p99 = (percentile(values, q) for q in (50, 90, 99))
        out[column] = {
            "p50": float(p50),
            "p90": float(p90),
            "p99": float(p99),
            "max": float(values.max()),
            "count": int(values.size),
        }
    return out


@dataclass(frozen=True)
class Summary:
    requests: int
    errors: int
    error_messages: dict[str, int]  # status message, its figures as N -> requests, most first
    flagged: int
    ttft_ms: float  # summed over the requests that report a TTFT
    ttft_queue_share: float | None
    ttft_compute_share: float | None
    ttft_other_share: float | None
    kv_handoffs: int  # kv.handoff spans that did not fail
    kv_mean_bandwidth_bytes_per_s: float | None
    kv_chunks_retried: int
    requests_retried: int  # prefilled or handed off more than once


def _kind(message: str) -> str:
    """A status message with its figures as N: refusals that differ only in the queue they saw
    are one kind of error."""
    return _FIGURE.sub("N", message) if message else "(no message)"


_FIGURE = re.compile(r"\d+(?:\.\d+)?")


def summarize(req_traces: Sequence[RequestTrace], rows: Sequence[Breakdown]) -> Summary:
    errors = [r for r in rows if r.status == "ERROR"]
    timed = [r for r in rows if r.ttft_ms is not None]
    ttft = sum(r.ttft_ms or 0.0 for r in timed)
    queue = sum(r.ttft_queue_ms or 0.0 for r in timed)
    compute = sum(r.ttft_compute_ms or 0.0 for r in timed)
    other = sum(r.ttft_other_ms or 0.0 for r in timed)
    good = [h for t in req_traces for h in t.named(KV_HANDOFF) if h.status != "ERROR"]
    bandwidths = [
        b for h in good if (b := _number(h.attributes, "kv.bandwidth_bytes_per_s")) is not None
    ]
    return Summary(
        requests=len(rows),
        errors=len(errors),
        error_messages=dict(Counter(_kind(r.status_message) for r in errors).most_common()),
        flagged=sum(r.flagged for r in rows),
        ttft_ms=ttft,
        ttft_queue_share=queue / ttft if ttft else None,
        ttft_compute_share=compute / ttft if ttft else None,
        ttft_other_share=other / ttft if ttft else None,
        kv_handoffs=len(good),
        kv_mean_bandwidth_bytes_per_s=sum(bandwidths) / len(bandwidths) if bandwidths else None,
        kv_chunks_retried=sum(r.kv_chunks_retried or 0 for r in rows),
        requests_retried=sum(r.retries > 0 for r in rows),
    )
