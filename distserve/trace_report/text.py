"""The report as text (rows, percentiles, summary) and as one JSON object."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from distserve.trace_report.breakdown import (
    COLUMNS,
    Breakdown,
    BubbleRule,
    Summary,
    percentiles,
)
from distserve.trace_report.spans import SpanFile

ERROR_KINDS = 5  # the most frequent kinds of error the summary names


def cell(v: object) -> str:
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
            *(cell(getattr(r, c)) for c, _ in COLUMNS),
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
        [heading, *(cell(table[c][k]) for k in ("p50", "p90", "p99", "max", "count"))]
        for c, heading in COLUMNS
    ]
    return _grid(header, body, left=(0,))


def _share(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def format_summary(s: Summary, rule: BubbleRule) -> list[str]:
    errors = f"errors: {s.errors}"
    if s.error_messages:
        kinds = [f"{n} x {m}" for m, n in list(s.error_messages.items())[:ERROR_KINDS]]
        if len(s.error_messages) > ERROR_KINDS:
            kinds.append(f"{len(s.error_messages) - ERROR_KINDS} more kinds")
        errors += " (" + "; ".join(kinds) + ")"
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
    if span_file.emulated:
        head += "\nengine: emulated (times are modelled, in emulated time; docs/engine.md)"
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
        "engine": "emulated" if span_file.emulated else "torch",
        "bubble_rule": asdict(rule),
        "requests": [asdict(r) for r in rows],
        "percentiles": percentiles(rows),
        "summary": asdict(summary),
    }
