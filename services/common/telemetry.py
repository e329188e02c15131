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
  `span_file.span_json`), for local use and `distserve trace-report`. Processes of one mesh may
  share it.
- `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`: sampling (the SDK's standard samplers, e.g.
  `parentbased_traceidratio` and `0.1`); `OTEL_BSP_*` tune the batching of exports.

Context crosses processes as W3C trace context (`traceparent`, `tracestate`) in gRPC metadata:
callers pass `metadata=outgoing(ctx)`, servers read `incoming(context)`. With the default
propagators (`OTEL_PROPAGATORS` unset or `tracecontext,baggage`) these two read and write the
W3C headers themselves (`direct_spans.W3c`), and hand a request carrying `baggage` to the SDK's
propagators; other propagators always go through the SDK.

Spans of work already timed by a worker (a queue wait, a batch) are recorded after the fact
with their real start and end (`record`), so the hot paths carry no span objects. Such a span,
and one that `start` opens (a request's root, a KV handoff), is built and handed to the export
queue directly (`direct_spans.Recorder`) when the sampler is parent-based (the default), not by
the SDK's `start_span`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import baggage, propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

from services.common import clock
from services.common.direct_spans import Recorder, W3c
from services.common.span_file import JsonLinesExporter

log = logging.getLogger("distserve.telemetry")


def _mono_to_wall_ns() -> int:
    """wall-clock ns = monotonic s * 1e9 + this offset, both on the mesh's clock."""
    return clock.time_ns() - round(clock.monotonic() * 1e9)


_MONO_TO_WALL_NS = _mono_to_wall_ns()  # taken again by `setup` (after the clock's setup)

_provider = None  # the SDK's TracerProvider once `setup` turned tracing on
_tracer: trace.Tracer = trace.NoOpTracer()
_recorder = None  # the fast path of `record` and `start`, with a parent-based sampler
_w3c = None  # the fast path of `incoming`/`outgoing`, with the default propagators


def wall_ns(monotonic_s: float) -> int:
    """A `clock.monotonic()` reading as wall-clock nanoseconds since the epoch (spans carry
    wall-clock times; an emulated mesh's are emulated)."""
    return round(monotonic_s * 1e9) + _MONO_TO_WALL_NS


def enabled() -> bool:
    return _provider is not None


def tracer() -> trace.Tracer:
    return _tracer


def setup(service: str, instance: str = "", engine: str = "") -> bool:
    """Turn tracing on for this process as the environment says; returns whether it is on.

    `service` names the process in every span (`distserve-<service>`), `instance` tells
    instances of one service apart (`service.instance.id`), `engine` says which engine serves
    (`distserve.engine`: `torch`, or `emulated`, whose times are modelled).
    """
    global _provider, _tracer, _recorder, _w3c, _MONO_TO_WALL_NS
    _MONO_TO_WALL_NS = _mono_to_wall_ns()
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
    if engine:
        attributes["distserve.engine"] = engine
    provider = TracerProvider(resource=Resource.create(attributes))
    processors = [BatchSpanProcessor(exporter) for exporter in exporters]
    for processor in processors:
        provider.add_span_processor(processor)
    _provider, _tracer = provider, provider.get_tracer("distserve")
    _recorder = Recorder.for_provider(provider, processors)
    _w3c = W3c.for_propagators(os.environ.get("OTEL_PROPAGATORS"))
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
    """Start a span under `parent` (a no-op span when not tracing), now or at `start_s` (on
    `clock.monotonic()`). End it with `span.end()`."""
    when = clock.time_ns() if start_s is None else wall_ns(start_s)
    if _recorder is not None:
        return _recorder.start(name, parent, attributes, when)
    return _tracer.start_span(name, context=parent, attributes=attributes, start_time=when)


@contextmanager
def span(name: str, parent: Context | None, attributes: Mapping | None = None) -> Iterator[Span]:
    """A span (`start`) open for the `with` block and ended when it exits; if the block
    raises, the span is failed with the error ("cancelled" for a cancellation)."""
    opened = start(name, parent, attributes)
    try:
        yield opened
    except BaseException as e:
        fail(opened, "cancelled" if isinstance(e, asyncio.CancelledError) else e)
        raise
    finally:
        opened.end()


def context_of(span: Span) -> Context:
    return trace.set_span_in_context(span)


def annotate(ctx: Context | None, attributes: Mapping) -> None:
    """Set attributes on the span of `ctx` (a request's root span, while it is open)."""
    if ctx is not None:
        trace.get_current_span(ctx).set_attributes(attributes)


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
            return _recorder.record(
                name, parent_span, wall_ns(start_s), wall_ns(end_s), attributes, error
            )
    span = _tracer.start_span(
        name, context=parent, attributes=attributes, start_time=wall_ns(start_s)
    )
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=wall_ns(end_s))
    return trace.set_span_in_context(span)


def fail(span: Span, error: BaseException | str) -> None:
    span.set_status(Status(StatusCode.ERROR, str(error)))
