"""Tracing for every service: one OpenTelemetry trace per request, across processes.

Configured by the standard environment variables, read once at start by `setup`:

- `OTEL_SDK_DISABLED=true` switches tracing off (so does having no exporter configured: then
  no span is even created).
- `OTEL_TRACES_EXPORTER`: a comma-separated list of `otlp`, `console`, `none`. Without it,
  tracing is on when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set, exporting
  over OTLP; the OTLP exporters read their own `OTEL_EXPORTER_OTLP_*` variables, and
  `OTEL_EXPORTER_OTLP_PROTOCOL` (or `..._TRACES_PROTOCOL`) picks `grpc` (default) or
  `http/protobuf`.
- `DISTSERVE_TRACE_FILE=PATH`: also append every span to PATH as one JSON line (see
  `span_json`), for local use and `distserve trace-report`. Processes of one mesh may share it.
- `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`: sampling (the SDK's standard samplers, e.g.
  `parentbased_traceidratio` and `0.1`); `OTEL_BSP_*` tune the batching of exports.

Context crosses processes as W3C trace context (`traceparent`, `tracestate`) in gRPC metadata:
callers pass `metadata=outgoing(ctx)`, servers read `incoming(context)`. With the default
propagators (`OTEL_PROPAGATORS` unset or `tracecontext,baggage`) these two read and write the
W3C headers themselves (`_W3c`), as the SDK's TraceContext propagator does, and hand a request
carrying `baggage` to the SDK's propagators; other propagators always go through the SDK. The
SDK's composite propagator takes 2-4x as long per call (7.2 us against 1.8 to read, 4.0
against 2.0 to write, in a hot loop), on every RPC of every request, ~10 a request.

Spans of work already timed by a worker (a queue wait, a batch) are recorded after the fact
with their real start and end (`record`), so the hot paths carry no span objects. Such a span,
and one that `start` opens (a request's root, a KV handoff), is built and handed to the export
queue directly (`_Recorder`) when the sampler is parent-based (the default): the SDK's
`start_span` validates, samples and wraps every span, about 50 us each in a hot loop and
86-127 us for a request's root span in a loaded mesh, ~2% of a short request's whole CPU over
its 7 spans.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

from opentelemetry import baggage, propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

log = logging.getLogger("distserve.telemetry")

# wall-clock ns = monotonic s * 1e9 + this offset (spans carry wall-clock times)
_MONO_TO_WALL_NS = time.time_ns() - time.monotonic_ns()

_provider = None  # the SDK's TracerProvider once `setup` turned tracing on
_tracer: trace.Tracer = trace.NoOpTracer()
_recorder = None  # the fast path of `record`, when the sampler lets children follow the parent
_w3c = None  # the fast path of `incoming`/`outgoing`, with the default propagators


def wall_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as wall-clock nanoseconds since the epoch."""
    return int(monotonic_s * 1e9) + _MONO_TO_WALL_NS


def enabled() -> bool:
    return _provider is not None


def tracer() -> trace.Tracer:
    return _tracer


def setup(service: str, instance: str = "") -> bool:
    """Turn tracing on for this process as the environment says; returns whether it is on.

    `service` names the process in every span (`distserve-<service>`), `instance` tells
    instances of one service apart (`service.instance.id`).
    """
    global _provider, _tracer, _recorder, _w3c
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = _exporters()
    if not exporters:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": f"distserve-{service}"}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    processors = [BatchSpanProcessor(exporter) for exporter in exporters]
    for processor in processors:
        provider.add_span_processor(processor)
    _provider, _tracer = provider, provider.get_tracer("distserve")
    _recorder = _Recorder.for_provider(provider, processors)
    _w3c = _W3c.for_propagators(os.environ.get("OTEL_PROPAGATORS"))
    return True


def shutdown() -> None:
    """Export what is left; call before the process exits."""
    global _provider, _tracer, _recorder, _w3c
    if _provider is not None:
        _provider.shutdown()
    _provider, _tracer, _recorder, _w3c = None, trace.NoOpTracer(), None, None


def _exporters() -> list:
    names = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    if not wanted and (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        wanted = {"otlp"}
    out: list = []
    if "otlp" in wanted:
        protocol = os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
        )
        if protocol.startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        out.append(OTLPSpanExporter())
    if "console" in wanted:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        out.append(ConsoleSpanExporter())
    unknown = wanted - {"otlp", "console", "none"}
    if unknown:
        log.warning("OTEL_TRACES_EXPORTER: unknown exporters %s ignored", sorted(unknown))
    path = os.environ.get("DISTSERVE_TRACE_FILE")
    if path:
        out.append(JsonLinesExporter(path))
    return out


def outgoing(ctx: Context | None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying `ctx` (its current span) to the callee; None when not tracing."""
    if _provider is None or ctx is None:
        return None
    if _w3c is not None and not baggage.get_all(ctx):
        return _w3c.inject(ctx)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return tuple(carrier.items()) or None


def incoming(grpc_context) -> Context | None:
    """The caller's trace context from a grpc.aio servicer context (None when not tracing)."""
    if _provider is None:
        return None
    return from_headers(dict(grpc_context.invocation_metadata() or ()))


def from_headers(headers: Mapping[str, str]) -> Context | None:
    """The trace context in HTTP headers or gRPC metadata (`traceparent`, `tracestate`)."""
    if _provider is None:
        return None
    if _w3c is not None and "baggage" not in headers:
        return _w3c.extract(headers)
    return propagate.extract(headers)


def start(
    name: str,
    parent: Context | None,
    attributes: Mapping | None = None,
    start_s: float | None = None,
) -> Span:
    """Start a span under `parent` (a no-op span when not tracing), now or at monotonic
    `start_s`. End it with `span.end()`."""
    when = None if start_s is None else wall_ns(start_s)
    if _recorder is not None:
        return _recorder.start(name, parent, attributes, when)
    return _tracer.start_span(name, context=parent, attributes=attributes, start_time=when)


def context_of(span: Span) -> Context:
    return trace.set_span_in_context(span)


def record(
    name: str,
    parent: Context | None,
    start_s: float,
    end_s: float,
    attributes: Mapping | None = None,
    error: str | None = None,
) -> Context | None:
    """A span of work already done, from monotonic `start_s` to `end_s`; returns its context
    (for children), or None when not tracing."""
    if _provider is None:
        return None
    if _recorder is not None:
        parent_span = trace.get_current_span(parent).get_span_context() if parent else None
        if parent_span is not None and parent_span.is_valid:
            return _recorder.record(name, parent_span, start_s, end_s, attributes, error)
    span = _tracer.start_span(
        name, context=parent, attributes=attributes, start_time=wall_ns(start_s)
    )
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=wall_ns(end_s))
    return trace.set_span_in_context(span)


class _W3c:
    """W3C trace context in and out, as the SDK's `TraceContextTextMapPropagator` reads and
    writes it (its header pattern, the same invalid values refused), without the propagator
    API's layers: a context from `traceparent` and `tracestate`, and back."""

    # The SDK's pattern; version 00 takes exactly four fields, a later version may add more.
    _TRACEPARENT = re.compile(
        r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$"
    )

    @classmethod
    def for_propagators(cls, names: str | None) -> _W3c | None:
        """An instance when `OTEL_PROPAGATORS` (`names`) asks for no more than the default."""
        wanted = {n.strip().lower() for n in (names or "tracecontext,baggage").split(",")}
        return (
            cls()
            if wanted - {""} <= {"tracecontext", "baggage"} and "tracecontext" in wanted
            else None
        )

    def extract(self, headers: Mapping[str, str]) -> Context | None:
        header = headers.get("traceparent")
        if not header or len(header) > 512:
            return None
        match = self._TRACEPARENT.match(header)
        if match is None:
            return None
        version, trace_id, span_id, flags, rest = match.groups()
        if version == "ff" or (version == "00" and rest):
            return None
        trace_id, span_id = int(trace_id, 16), int(span_id, 16)
        if not trace_id or not span_id:
            return None
        state = headers.get("tracestate")
        span = NonRecordingSpan(
            SpanContext(
                trace_id,
                span_id,
                is_remote=True,
                trace_flags=TraceFlags(int(flags, 16)),
                trace_state=TraceState.from_header([state])
                if state and len(state) <= 8192
                else None,
            )
        )
        return trace.set_span_in_context(span, _EMPTY)

    def inject(self, ctx: Context) -> tuple[tuple[str, str], ...] | None:
        sc = trace.get_current_span(ctx).get_span_context()
        if not sc.is_valid:
            return None
        parent = ("traceparent", f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}")
        if sc.trace_state:
            return (parent, ("tracestate", sc.trace_state.to_header()))
        return (parent,)


_EMPTY = Context()
_UNSET = Status(StatusCode.UNSET)


class _Recorder:
    """Spans without the SDK's per-span machinery: built as the SDK would build them (the
    parent's trace and sampling decision, a fresh span id, the resource and scope) and handed
    to the span processors' `on_end` once they end. Only when the sampler is parent-based (the
    default, and every `parentbased_*` of OTEL_TRACES_SAMPLER): then a child is sampled exactly
    when its parent is, and a root span as the sampler says."""

    def __init__(self, provider, processors: list) -> None:
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.ids = provider.id_generator
        self.sampler = provider.sampler
        self.resource = provider.resource
        self.processors = processors
        self.scope = InstrumentationScope("distserve")
        # W3C level 2's random-trace-id flag, set on new traces as the SDK sets it (its
        # versions before 1.40 have no such flag)
        random = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)
        self.random_flag = random if getattr(self.ids, "is_trace_id_random", bool)() else 0

    @classmethod
    def for_provider(cls, provider, processors: list) -> _Recorder | None:
        from opentelemetry.sdk.trace.sampling import ParentBased

        return cls(provider, processors) if isinstance(provider.sampler, ParentBased) else None

    def record(
        self,
        name: str,
        parent: SpanContext,
        start_s: float,
        end_s: float,
        attributes: Mapping | None,
        error: str | None,
    ) -> Context:
        from opentelemetry.sdk.trace import ReadableSpan

        ctx = SpanContext(
            parent.trace_id,
            self.ids.generate_span_id(),
            is_remote=False,
            trace_flags=parent.trace_flags,
            trace_state=parent.trace_state,
        )
        if parent.trace_flags.sampled:
            span = ReadableSpan(
                name,
                context=ctx,
                parent=parent,
                resource=self.resource,
                # None is not an attribute value (the SDK drops it with a warning)
                attributes={k: v for k, v in (attributes or {}).items() if v is not None},
                status=_UNSET if error is None else Status(StatusCode.ERROR, error),
                start_time=wall_ns(start_s),
                end_time=wall_ns(end_s),
                instrumentation_scope=self.scope,
            )
            self.emit(span)
        return trace.set_span_in_context(NonRecordingSpan(ctx), _EMPTY)

    def start(
        self, name: str, parent: Context | None, attributes: Mapping | None, when: int | None
    ) -> Span:
        """A span begun at wall-clock ns `when` (None: now), as `Tracer.start_span` begins one."""
        parent_span = trace.get_current_span(parent).get_span_context() if parent else None
        if parent_span is not None and parent_span.is_valid:
            trace_id, flags = parent_span.trace_id, parent_span.trace_flags
            state, sampled = parent_span.trace_state, flags.sampled
        else:
            from opentelemetry.trace import SpanKind

            parent_span, trace_id = None, self.ids.generate_trace_id()
            result = self.sampler.should_sample(
                parent, trace_id, name, SpanKind.INTERNAL, attributes
            )
            sampled, state, attributes = (
                result.decision.is_sampled(),
                result.trace_state,
                result.attributes,
            )
            flags = TraceFlags((TraceFlags.SAMPLED if sampled else 0) | self.random_flag)
        ctx = SpanContext(
            trace_id,
            self.ids.generate_span_id(),
            is_remote=False,
            trace_flags=flags,
            trace_state=state,
        )
        if not sampled:
            return NonRecordingSpan(ctx)
        return _Open(self, name, ctx, parent_span, attributes, when or time.time_ns())

    def emit(self, span) -> None:
        for processor in self.processors:
            processor.on_end(span)


class _Open(Span):
    """A sampled span in progress, built into the SDK's ReadableSpan only when it ends."""

    def __init__(
        self,
        recorder: _Recorder,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        attributes: Mapping | None,
        start_ns: int,
    ) -> None:
        self._recorder, self._name, self._context, self._parent = recorder, name, context, parent
        self._attributes = {k: v for k, v in (attributes or {}).items() if v is not None}
        self._events: list = []
        self._status = _UNSET
        self._start_ns = start_ns
        self._ended = False

    def get_span_context(self) -> SpanContext:
        return self._context

    @property
    def parent(self) -> SpanContext | None:
        return self._parent

    def is_recording(self) -> bool:
        return not self._ended

    def set_attribute(self, key: str, value) -> None:
        if value is not None and not self._ended:
            self._attributes[key] = value

    def set_attributes(self, attributes: Mapping) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(self, name: str, attributes=None, timestamp: int | None = None) -> None:
        from opentelemetry.sdk.trace import Event

        if not self._ended:
            self._events.append(Event(name, attributes, timestamp or time.time_ns()))

    def record_exception(self, exception, attributes=None, timestamp=None, escaped=False):
        self.add_event(
            "exception",
            {
                "exception.type": type(exception).__name__,
                "exception.message": str(exception),
                "exception.escaped": escaped,
                **(attributes or {}),
            },
            timestamp,
        )

    def update_name(self, name: str) -> None:
        self._name = name

    def set_status(self, status, description: str | None = None) -> None:
        if not self._ended:
            self._status = status if isinstance(status, Status) else Status(status, description)

    def end(self, end_time: int | None = None) -> None:
        from opentelemetry.sdk.trace import ReadableSpan

        if self._ended:
            return
        self._ended = True
        r = self._recorder
        r.emit(
            ReadableSpan(
                self._name,
                context=self._context,
                parent=self._parent,
                resource=r.resource,
                attributes=self._attributes,
                events=self._events,
                status=self._status,
                start_time=self._start_ns,
                end_time=end_time or time.time_ns(),
                instrumentation_scope=r.scope,
            )
        )


def fail(span: Span, error: BaseException | str) -> None:
    span.set_status(Status(StatusCode.ERROR, str(error)))


# -- JSON lines ----------------------------------------------------------------------------------


def span_json(span) -> dict:
    """One finished SDK span as the dict written per line of a trace file:

    `trace_id` (32 hex), `span_id` (16 hex), `parent_span_id` (16 hex or null), `name`,
    `service` (`service.name`), `start_unix_nano`, `end_unix_nano`, `attributes`, `status`
    (`UNSET`, `OK`, `ERROR`), `status_message`, `events` (`name`, `time_unix_nano`, `attributes`).
    """
    ctx = span.get_span_context()
    return {
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
