"""`distserve trace-report FILE`: where each request's time went, read from recorded spans.

The services export their OpenTelemetry spans, for local use, to one JSON-lines file (one span per
line, several processes appending, lines in any order, the last line possibly cut short). This
module groups the spans into requests (one gateway span per request, the one carrying
`gen_ai.operation.name`), breaks each request into queueing, prefill, KV handoff and the handoff
bubble (the gap between the first and the second token), flags requests whose bubble is large, and
prints per-request rows, percentiles and a summary (or one JSON object), and optionally draws a
waterfall PNG of the slowest requests.

numpy and matplotlib are imported when they are used, so that `distserve --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.common.errors import DistServeError

GATEWAY_SERVICE = "distserve-gateway"
REQUEST_MARKER = "gen_ai.operation.name"  # the attribute that marks a request's gateway span
PREFILL_QUEUE, DECODE_QUEUE = "prefill.queue", "decode.queue"
PREFILL_COMPUTE, KV_HANDOFF, DECODE = "prefill.compute", "kv.handoff", "decode"
NS_PER_MS = 1_000_000
DESCRIPTION = (
    "Per-request latency breakdown (queueing, prefill, KV handoff, handoff bubble, TPOT) "
    "from a JSON-lines span file, with percentiles, a summary and an optional waterfall PNG."
)

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


class TraceReportError(DistServeError):
    """The span file cannot be read, or holds nothing to report on."""

    status = "INVALID_ARGUMENT"


# --- spans -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpanEvent:
    name: str
    time_ns: int


@dataclass(frozen=True)
class Span:
    """One finished span as a service exported it; times in ns since the Unix epoch."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: str = "UNSET"
    status_message: str = ""
    events: tuple[SpanEvent, ...] = ()

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / NS_PER_MS


@dataclass(frozen=True)
class SpanFile:
    """The spans of one file, and how many non-blank lines could not be read as a span."""

    path: Path
    spans: list[Span]
    lines: int
    skipped: int


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_span(line: str) -> Span | None:
    """One line of the span file as a Span, or None if it is not valid JSON or not a span."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    ids = (obj.get("trace_id"), obj.get("span_id"), obj.get("name"))
    start, end = obj.get("start_unix_nano"), obj.get("end_unix_nano")
    parent = obj.get("parent_span_id") or None
    attributes = obj.get("attributes") or {}
    events = obj.get("events") or []
    if not all(isinstance(v, str) and v for v in ids):
        return None
    if not (_is_int(start) and _is_int(end)) or end < start:
        return None
    if not (parent is None or isinstance(parent, str)) or not isinstance(attributes, dict):
        return None
    if not isinstance(events, list):
        return None
    return Span(
        trace_id=obj["trace_id"],
        span_id=obj["span_id"],
        parent_span_id=parent,
        name=obj["name"],
        service=str(obj.get("service") or "?"),
        start_ns=start,
        end_ns=end,
        attributes=attributes,
        status=str(obj.get("status") or "UNSET").upper().removeprefix("STATUS_CODE_"),
        status_message=str(obj.get("status_message") or ""),
        events=tuple(
            SpanEvent(str(e.get("name", "")), e["time_unix_nano"])
            for e in events
            if isinstance(e, dict) and _is_int(e.get("time_unix_nano"))
        ),
    )


def load_spans(path: Path, progress: bool = False) -> SpanFile:
    """Read a span file, each span once; lines that are not spans (a cut-off last line) are
    counted, not fatal. `progress` shows a bar on stderr (large files take seconds)."""
    spans: dict[tuple[str, str], Span] = {}  # an exporter that retries may write a span twice
    lines = skipped = 0
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in _progress(f) if progress else f:
                if not line.strip():
                    continue
                lines += 1
                span = parse_span(line)
                if span is None:
                    skipped += 1
                else:
                    spans.setdefault((span.trace_id, span.span_id), span)
    except FileNotFoundError:
        raise TraceReportError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceReportError(f"{path}: is a directory, not a span file") from None
    except OSError as e:
        raise TraceReportError(f"{path}: cannot read: {e.strerror or e}") from None
    return SpanFile(Path(path), list(spans.values()), lines, skipped)


def _progress(lines: Iterable[str]) -> Iterable[str]:
    from tqdm import tqdm

    return tqdm(lines, desc="reading spans", unit=" lines", leave=False, mininterval=0.5)


# --- requests --------------------------------------------------------------------------------


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


# --- breakdown -------------------------------------------------------------------------------


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
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
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
    error_messages: dict[str, int]  # status message -> requests
    flagged: int
    ttft_ms: float  # summed over the requests that report a TTFT
    ttft_queue_share: float | None
    ttft_compute_share: float | None
    ttft_other_share: float | None
    kv_handoffs: int  # kv.handoff spans that did not fail
    kv_mean_bandwidth_bytes_per_s: float | None
    kv_chunks_retried: int
    requests_retried: int  # prefilled or handed off more than once


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
        error_messages=dict(Counter(r.status_message or "(no message)" for r in errors)),
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


# --- text ------------------------------------------------------------------------------------


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def _grid(header: Sequence[str], body: list[list[str]], left: Sequence[int]) -> list[str]:
    """Columns padded to their widest cell; numbers flush right, the `left` columns flush left."""
    widths = [max(len(row[i]) for row in [list(header), *body]) for i in range(len(header))]
    return [
        "  ".join(
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [list(header), *body]
    ]


def format_rows(rows: Sequence[Breakdown], limit: int) -> list[str]:
    shown = rows if limit == 0 else rows[:limit]
    header = ["request", "mode", "status", *(h for _, h in COLUMNS), "retry", "flag"]
    body = [
        [
            r.request_id,
            r.mode or "-",
            r.status,
            *(_cell(getattr(r, c)) for c, _ in COLUMNS),
            str(r.retries) if r.retries else "",
            "BUBBLE" if r.flagged else "",
        ]
        for r in shown
    ]
    lines = _grid(header, body, left=(0, 1, 2, len(header) - 1))
    if len(rows) > len(shown):
        lines.append(f"({len(rows) - len(shown)} more requests not shown; --limit 0 shows all)")
    return lines


def format_percentiles(table: dict[str, dict[str, float | int | None]]) -> list[str]:
    header = ["", "p50", "p90", "p99", "max", "count"]
    body = [
        [heading, *(_cell(table[c][k]) for k in ("p50", "p90", "p99", "max", "count"))]
        for c, heading in COLUMNS
    ]
    return _grid(header, body, left=(0,))


def _share(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def format_summary(s: Summary, rule: BubbleRule) -> list[str]:
    errors = f"errors: {s.errors}"
    if s.error_messages:
        errors += " (" + ", ".join(f"{m}: {n}" for m, n in s.error_messages.items()) + ")"
    bandwidth = s.kv_mean_bandwidth_bytes_per_s
    return [
        f"requests: {s.requests}, {errors}, flagged: {s.flagged} ({rule.describe()})",
        f"TTFT: {_share(s.ttft_queue_share)} queueing, {_share(s.ttft_compute_share)} prefill "
        f"compute, {_share(s.ttft_other_share)} other (gateway/network)",
        "KV handoff: mean bandwidth "
        + ("-" if bandwidth is None else f"{bandwidth / 1e9:.2f} GB/s")
        + f" over {s.kv_handoffs} handoffs, chunks retried: {s.kv_chunks_retried}, "
        f"requests prefilled or handed off again: {s.requests_retried}",
    ]


def format_report(
    span_file: SpanFile,
    rows: Sequence[Breakdown],
    summary: Summary,
    rule: BubbleRule,
    limit: int,
) -> str:
    head = f"{span_file.path}: {len(rows)} requests from {len(span_file.spans)} spans"
    if span_file.skipped:
        head += f", unparsable lines skipped: {span_file.skipped}"
    lines = [head, "", *format_rows(rows, limit), "", "ms (tokens for in/out)"]
    lines += [*format_percentiles(percentiles(rows)), "", *format_summary(summary, rule)]
    return "\n".join(lines)


def report_json(
    span_file: SpanFile, rows: Sequence[Breakdown], summary: Summary, rule: BubbleRule
) -> dict[str, Any]:
    return {
        "file": str(span_file.path),
        "spans": len(span_file.spans),
        "skipped_lines": span_file.skipped,
        "bubble_rule": asdict(rule),
        "requests": [asdict(r) for r in rows],
        "percentiles": percentiles(rows),
        "summary": asdict(summary),
    }


# --- waterfall -------------------------------------------------------------------------------

KIND_COLOURS = {
    "request": "#4c72b0",
    "edge": "#8c8c8c",
    "queue": "#f0b74a",
    "prefill": "#dd5a4f",
    "kv": "#8172b3",
    "decode": "#55a868",
    "other": "#bcbcbc",
}


def span_kind(span: Span) -> str:
    if is_request_span(span):
        return "request"
    if span.service == "envoy":
        return "edge"
    if span.name in (PREFILL_QUEUE, DECODE_QUEUE):
        return "queue"
    if span.name == PREFILL_COMPUTE:
        return "prefill"
    if span.name.startswith("kv."):
        return "kv"
    if span.name == DECODE:
        return "decode"
    return "other"


def _waterfall_order(req: RequestTrace) -> list[Span]:
    """Top to bottom: ancestors, the request span, then its tree depth-first by start time."""
    order = list(req.ancestors)
    ids = {s.span_id for s in req.spans}
    children: dict[str, list[Span]] = defaultdict(list)
    for s in req.spans:  # already by start time
        parent = s.parent_span_id if s.parent_span_id in ids else req.root.span_id
        children[parent].append(s)
    stack = [req.root]
    seen: set[str] = set()
    while stack:
        span = stack.pop()
        if span.span_id in seen:
            continue
        seen.add(span.span_id)
        order.append(span)
        stack += reversed(children[span.span_id])
    return order


def draw_waterfall(pairs: Sequence[tuple[RequestTrace, Breakdown]], path: Path) -> None:
    """One panel per request: a bar per span, x in ms since the request's gateway span began,
    the bubble (first token to second token) shaded."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    orders = [_waterfall_order(req) for req, _ in pairs]
    heights = [len(o) + 2 for o in orders]
    fig = Figure(figsize=(12, max(2.5, 0.3 * sum(heights))), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(pairs), 1, squeeze=False, gridspec_kw={"height_ratios": heights})
    kinds: set[str] = set()
    for ax, (req, row), order in zip(axes[:, 0], pairs, orders, strict=True):
        t0 = req.root.start_ns
        for y, span in enumerate(order):
            kind = span_kind(span)
            kinds.add(kind)
            left = (span.start_ns - t0) / NS_PER_MS
            ax.barh(
                y,
                max(span.duration_ms, 1e-3),
                left=left,
                height=0.6,
                color=KIND_COLOURS[kind],
                edgecolor="red" if span.status == "ERROR" else "none",
                linewidth=1.5,
            )
            ax.text(left + span.duration_ms, y, f" {span.duration_ms:.1f}", va="center", size=7)
            for event in span.events:
                ax.plot((event.time_ns - t0) / NS_PER_MS, y, "k|", markersize=8)
        labels = [f"{s.name} [{s.service}]" for s in order]
        ax.set_yticks(range(len(order)), labels, fontsize=8)
        ax.set_ylim(len(order) - 0.4, -0.6)
        if row.ttft_ms is not None and row.first_itl_ms is not None:
            first, second = row.ttft_ms, row.ttft_ms + row.first_itl_ms
            ax.axvspan(first, second, color="red", alpha=0.12, zorder=0)
            for x in (first, second):
                ax.axvline(x, color="red", linestyle="--", linewidth=0.8)
        title = (
            f"{row.request_id}  {row.mode or '-'}  {row.status}  total {row.total_ms:.1f} ms  "
            f"TTFT {_cell(row.ttft_ms)}  first ITL {_cell(row.first_itl_ms)}  "
            f"TPOT {_cell(row.tpot_ms)}"
        )
        ax.set_title(title + ("  BUBBLE" if row.flagged else ""), fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms since the request's gateway span started")
    handles = [Patch(color=KIND_COLOURS[k], label=k) for k in KIND_COLOURS if k in kinds]
    handles.append(Patch(color="red", alpha=0.12, label="bubble (first to second token)"))
    fig.legend(handles=handles, loc="outside upper center", ncols=len(handles), fontsize=8)
    try:
        fig.savefig(path, format="png", dpi=100)
    except OSError as e:
        raise TraceReportError(f"{path}: cannot write: {e.strerror or e}") from None


def slowest(
    pairs: Sequence[tuple[RequestTrace, Breakdown]], n: int
) -> list[tuple[RequestTrace, Breakdown]]:
    return sorted(pairs, key=lambda p: p[1].total_ms, reverse=True)[:n]


# --- command line ----------------------------------------------------------------------------


def _count(minimum: int):
    def parse(text: str) -> int:
        v = int(text)
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return v

    return parse


def _positive(text: str) -> float:
    v = float(text)
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError("must be a positive number")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=Path, help="JSON-lines span file (one span per line)")
    p.add_argument(
        "--limit",
        type=_count(0),
        metavar="N",
        default=50,
        help="request rows to print (default 50, 0: all); percentiles and summary cover all",
    )
    bubble = p.add_mutually_exclusive_group()
    bubble.add_argument(
        "--bubble-ms", type=_positive, metavar="MS", help="flag a first ITL above this many ms"
    )
    bubble.add_argument(
        "--bubble-factor",
        type=_positive,
        metavar="F",
        default=3.0,
        help="flag a first ITL above F times the request's steady TPOT (default 3)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (all requests)")
    p.add_argument(
        "--png", type=Path, metavar="PATH", help="write a waterfall of the slowest requests here"
    )
    p.add_argument(
        "--slowest",
        type=_count(1),
        default=5,
        metavar="N",
        help="requests in the waterfall (default 5)",
    )


def run(args: argparse.Namespace) -> int:
    """The `trace-report` subcommand; raises TraceReportError for an unusable file."""
    span_file = load_spans(args.file, progress=sys.stderr.isatty())
    if span_file.lines == 0:
        raise TraceReportError(f"{args.file}: the file is empty")
    if not span_file.spans:
        raise TraceReportError(f"{args.file}: no spans: all {span_file.lines} lines unparsable")
    traces = requests(span_file.spans)
    if not traces:
        raise TraceReportError(
            f"{args.file}: no request spans (service {GATEWAY_SERVICE} with {REQUEST_MARKER}) "
            f"among {len(span_file.spans)} spans"
        )
    rule = BubbleRule(ms=args.bubble_ms, factor=args.bubble_factor)
    rows = [breakdown(t, rule) for t in traces]
    summary = summarize(traces, rows)
    if args.json:
        print(json.dumps(report_json(span_file, rows, summary, rule)))
    else:
        print(format_report(span_file, rows, summary, rule, args.limit))
    if args.png is not None:
        chosen = slowest(list(zip(traces, rows, strict=True)), args.slowest)
        draw_waterfall(chosen, args.png)
        print(f"wrote {args.png}: waterfall of the {len(chosen)} slowest requests", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `trace-report` to the `distserve` command line."""
    p = subparsers.add_parser(
        "trace-report",
        help="per-request latency breakdown from a recorded span file",
        description=DESCRIPTION,
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distserve trace-report", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except DistServeError as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
