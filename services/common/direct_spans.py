"""Spans and W3C trace context built directly, as the OpenTelemetry SDK builds them, without its
per-call layers: the fast paths of `services.common.telemetry` (which decides when they apply).

- `W3c` reads and writes `traceparent` / `tracestate` as the SDK's TraceContext propagator does
  (its header pattern, the same invalid values refused). The SDK's composite propagator takes
  2-4x as long per call (7.2 us against 1.8 to read, 4.0 against 2.0 to write, in a hot loop),
  on every RPC of every request, ~10 a request.
- `Recorder` builds a span as the SDK would (the parent's trace and sampling decision or, for a
  new trace, the sampler's; a fresh span id; the resource and scope) and hands it to the span
  processors when it ends: a span of finished work at once (`record`), one in progress
  (`start`, an `OpenSpan`) at its `end`. The SDK's `start_span` validates, samples and wraps
  every span, about 50 us each in a hot loop and 86-127 us for a request's root span in a
  loaded mesh, ~2% of a short request's whole CPU over its 7 spans.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from services.common import clock


class W3c:
    """W3C trace context in and out, as the SDK's `TraceContextTextMapPropagator` reads and
    writes it (its header pattern, the same invalid values refused), without the propagator
    API's layers: a context from `traceparent` and `tracestate`, and back."""

    # The SDK's pattern; version 00 takes exactly four fields, a later version may add more.
    _TRACEPARENT = re.compile(
        r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$"
    )

    @classmethod
    def for_propagators(cls, names: str | None) -> W3c | None:
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


class Recorder:
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
    def for_provider(cls, provider, processors: list) -> Recorder | None:
        from opentelemetry.sdk.trace.sampling import ParentBased

        return cls(provider, processors) if isinstance(provider.sampler, ParentBased) else None

    def record(
        self,
        name: str,
        parent: SpanContext,
        start_ns: int,
        end_ns: int,
        attributes: Mapping | None,
        error: str | None,
    ) -> Context:
        """A span of finished work, from wall-clock ns `start_ns` to `end_ns`; its context."""
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
                # None is not an attribute value (the SDK warns of it)
                attributes={k: v for k, v in (attributes or {}).items() if v is not None},
                status=_UNSET if error is None else Status(StatusCode.ERROR, error),
                start_time=start_ns,
                end_time=end_ns,
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
        return OpenSpan(self, name, ctx, parent_span, attributes, when or clock.time_ns())

    def emit(self, span) -> None:
        for processor in self.processors:
            processor.on_end(span)


class OpenSpan(Span):
    """A sampled span in progress, built into the SDK's ReadableSpan only when it ends."""

    def __init__(
        self,
        recorder: Recorder,
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
            self._events.append(Event(name, attributes, timestamp or clock.time_ns()))

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
                end_time=end_time or clock.time_ns(),
                instrumentation_scope=r.scope,
            )
        )
