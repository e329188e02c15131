"""`distserve trace-report FILE`: where each request's time went, read from recorded spans.

The services export their OpenTelemetry spans, for local use, to one JSON-lines file (one span per
line, several processes appending, lines in any order, the last line possibly cut short). This
package groups the spans into requests (one gateway span per request, the one carrying
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
from pathlib import Path

from distserve.plots import require_matplotlib
from distserve.trace_report.breakdown import (
    BubbleRule,
    breakdown,
    percentiles,
    requests,
    summarize,
)
from distserve.trace_report.spans import (
    GATEWAY_SERVICE,
    REQUEST_MARKER,
    TraceReportError,
    load_spans,
)
from distserve.trace_report.text import format_report, report_json
from distserve.trace_report.waterfall import draw_waterfall, slowest
from services.common.errors import DistServeError

DESCRIPTION = (
    "Per-request latency breakdown (queueing, prefill, KV handoff, handoff bubble, TPOT) "
    "from a JSON-lines span file, with percentiles, a summary and an optional waterfall PNG."
)

__all__ = [
    "BubbleRule",
    "TraceReportError",
    "breakdown",
    "draw_waterfall",
    "load_spans",
    "main",
    "percentiles",
    "register",
    "requests",
    "run",
    "slowest",
]


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
    if args.png is not None:
        require_matplotlib("trace-report --png")
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


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `trace-report` to the `distserve` command line."""
    p = subparsers.add_parser(
        "trace-report",
        help="per-request latency breakdown from a recorded span file",
        description=DESCRIPTION,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distserve trace-report", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except DistServeError as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 2
