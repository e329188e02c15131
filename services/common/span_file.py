"""The trace file: finished spans appended as JSON lines (`DISTSERVE_TRACE_FILE`), the format
`distserve trace-report` reads."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger("distserve.telemetry")


def span_json(span) -> dict:
    """One finished SDK span as the dict written per line of a trace file:

    `trace_id` (32 hex), `span_id` (16 hex), `parent_span_id` (16 hex or null), `name`,
    `service` (`service.name`), `start_unix_nano`, `end_unix_nano`, `attributes`, `status`
    (`UNSET`, `OK`, `ERROR`), `status_message`, `events` (`name`, `time_unix_nano`, `attributes`),
    and `engine` (`emulated`) on the spans of an emulated mesh, whose times are modelled.
    """
    ctx = span.get_span_context()
    engine = span.resource.attributes.get("distserve.engine")
    out = {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "start_unix_nano": span.start_time,
        "end_unix_nano": span.end_time,
        "attributes": _plain(span.attributes),
        "status": span.status.status_code.name,
        "status_message": span.status.description or "",
        "events": [
            {"name": e.name, "time_unix_nano": e.timestamp, "attributes": _plain(e.attributes)}
            for e in span.events
        ],
    }
    if engine == "emulated":
        out["engine"] = engine
    return out


def _plain(attributes: Mapping | None) -> dict:
    return {
        k: list(v) if isinstance(v, Sequence) and not isinstance(v, str) else v
        for k, v in (attributes or {}).items()
    }


class JsonLinesExporter(SpanExporter):
    """Appends spans to a file, one JSON object per line. Each batch is one `write` on a file
    opened for appending, so processes sharing the file do not interleave within a line."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()

    def export(self, spans: Iterable) -> SpanExportResult:
        data = "".join(json.dumps(span_json(s), separators=(",", ":")) + "\n" for s in spans)
        try:
            with self._lock:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    view = memoryview(data.encode())
                    while view:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
        except OSError as e:
            log.warning("cannot write spans to %s: %s", self.path, e)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
