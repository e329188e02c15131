"""Spans read back from a JSON-lines trace file: parsed leniently (processes append in any order,
the last line may be cut short), with the names the report looks for."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import DistServeError

GATEWAY_SERVICE = "distserve-gateway"
REQUEST_MARKER = "gen_ai.operation.name"  # the attribute that marks a request's gateway span
PREFILL_QUEUE, DECODE_QUEUE = "prefill.queue", "decode.queue"
PREFILL_COMPUTE, KV_HANDOFF, DECODE = "prefill.compute", "kv.handoff", "decode"
NS_PER_MS = 1_000_000


class TraceReportError(DistServeError):
    """The span file cannot be read, or holds nothing to report on."""

    status = "INVALID_ARGUMENT"


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
    emulated: bool = False  # from an emulated mesh: its times are modelled (docs/engine.md)

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

    @property
    def emulated(self) -> bool:
        """Whether the spans come from an emulated mesh."""
        return any(s.emulated for s in self.spans)


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
        emulated=obj.get("engine") == "emulated",
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
