"""A waterfall PNG of the slowest requests (matplotlib, imported when drawing)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from distserve.trace_report.breakdown import Breakdown, RequestTrace, is_request_span
from distserve.trace_report.spans import (
    DECODE,
    DECODE_QUEUE,
    NS_PER_MS,
    PREFILL_COMPUTE,
    PREFILL_QUEUE,
    Span,
    TraceReportError,
)
from distserve.trace_report.text import cell

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
            f"TTFT {cell(row.ttft_ms)}  first ITL {cell(row.first_itl_ms)}  "
            f"TPOT {cell(row.tpot_ms)}"
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
