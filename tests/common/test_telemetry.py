"""Tracing set-up from the environment, the JSON-lines exporter, context propagation."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from services.common import telemetry
from services.common.slo import Slo
from services.edge.config import otlp_grpc_endpoint
from services.gateway.metrics import SloWindow
from tests.otlp_receiver import OtlpReceiver


@pytest.fixture
def clean_env(monkeypatch):
    for name in (
        "OTEL_SDK_DISABLED",
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
        "DISTSERVE_TRACE_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    telemetry.shutdown()


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tracing_is_off_without_an_exporter(clean_env):
    assert telemetry.setup("gateway") is False
    span = telemetry.start("x", None)
    assert not span.is_recording()
    assert telemetry.outgoing(telemetry.context_of(span)) is None
    assert telemetry.record("y", None, 0.0, 1.0) is None


def test_spans_go_to_the_file_with_their_times_and_parents(clean_env, tmp_path):
    path = tmp_path / "spans.jsonl"
    clean_env.setenv("DISTSERVE_TRACE_FILE", str(path))
    assert telemetry.setup("prefill", "prefill-7")
    root = telemetry.start("root", None, {"a": 1})
    t0 = time.monotonic()
    telemetry.record("child", telemetry.context_of(root), t0, t0 + 0.25, {"b": [1, 2]})
    telemetry.fail(root, "it broke")
    root.end()
    telemetry.shutdown()  # flushes
    spans = {s["name"]: s for s in read(path)}
    child, parent = spans["child"], spans["root"]
    assert child["trace_id"] == parent["trace_id"]
    assert child["parent_span_id"] == parent["span_id"] and parent["parent_span_id"] is None
    assert child["end_unix_nano"] - child["start_unix_nano"] == pytest.approx(0.25e9, abs=1e3)
    assert abs(child["start_unix_nano"] - time.time_ns()) < 60e9  # wall clock, not monotonic
    assert child["attributes"] == {"b": [1, 2]} and parent["attributes"] == {"a": 1}
    assert (parent["status"], parent["status_message"]) == ("ERROR", "it broke")
    assert {s["service"] for s in spans.values()} == {"distserve-prefill"}


def test_a_span_block_ends_its_span_and_fails_it_when_the_block_raises(clean_env, tmp_path):
    path = tmp_path / "spans.jsonl"
    clean_env.setenv("DISTSERVE_TRACE_FILE", str(path))
    assert telemetry.setup("decode")
    with telemetry.span("ok", None, {"a": 1}) as span:
        span.set_attribute("b", 2)
    with pytest.raises(ValueError), telemetry.span("broke", None):
        raise ValueError("no room")
    with pytest.raises(asyncio.CancelledError), telemetry.span("left", None):
        raise asyncio.CancelledError
    telemetry.shutdown()  # flushes
    spans = {s["name"]: s for s in read(path)}
    assert spans["ok"]["attributes"] == {"a": 1, "b": 2} and spans["ok"]["status"] != "ERROR"
    assert (spans["broke"]["status"], spans["broke"]["status_message"]) == ("ERROR", "no room")
    assert (spans["left"]["status"], spans["left"]["status_message"]) == ("ERROR", "cancelled")


def test_context_crosses_processes_as_a_w3c_traceparent(clean_env, tmp_path):
    clean_env.setenv("DISTSERVE_TRACE_FILE", str(tmp_path / "s.jsonl"))
    telemetry.setup("gateway")
    span = telemetry.start("root", None)
    metadata = dict(telemetry.outgoing(telemetry.context_of(span)))
    ctx = span.get_span_context()
    version, trace_id, span_id, flags = metadata["traceparent"].split("-")
    assert (version, trace_id, span_id) == ("00", f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    assert int(flags, 16) & 1  # sampled
    # The receiving side continues the same trace under that span.
    child = telemetry.start("child", telemetry.from_headers(metadata))
    assert child.get_span_context().trace_id == ctx.trace_id
    assert child.parent.span_id == ctx.span_id
    child.end()
    span.end()


def test_sdk_disabled_wins_and_sampling_ratio_zero_records_nothing(clean_env, tmp_path):
    path = tmp_path / "s.jsonl"
    clean_env.setenv("DISTSERVE_TRACE_FILE", str(path))
    clean_env.setenv("OTEL_SDK_DISABLED", "true")
    assert telemetry.setup("decode") is False
    clean_env.delenv("OTEL_SDK_DISABLED")
    clean_env.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    clean_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    assert telemetry.setup("decode")
    for _ in range(20):
        telemetry.start("unsampled", None).end()
    telemetry.shutdown()
    assert not path.exists() or read(path) == []


def test_parent_based_sampling_follows_the_incoming_traceparent(clean_env, tmp_path):
    # Ratio 0 for new traces: only the caller's decision (the sampled flag) records a span,
    # and the decision travels on to the next hop.
    path = tmp_path / "s.jsonl"
    clean_env.setenv("DISTSERVE_TRACE_FILE", str(path))
    clean_env.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    clean_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    assert telemetry.setup("gateway")
    sampled, unsampled, caller = "ab" * 16, "cd" * 16, "00f067aa0ba902b7"
    for trace_id, flags in ((sampled, "01"), (unsampled, "00")):
        parent = telemetry.from_headers({"traceparent": f"00-{trace_id}-{caller}-{flags}"})
        span = telemetry.start("request", parent)
        assert span.is_recording() is (flags == "01")
        onward = dict(telemetry.outgoing(telemetry.context_of(span)))["traceparent"]
        assert onward.startswith(f"00-{trace_id}-") and onward.endswith(f"-{flags}")
        span.end()
    telemetry.start("no caller", None).end()  # a new trace: the ratio (0) decides
    telemetry.shutdown()
    assert [(s["name"], s["trace_id"], s["parent_span_id"]) for s in read(path)] == [
        ("request", sampled, caller)
    ]


def test_recorded_spans_follow_their_parents_sampling_decision(clean_env, tmp_path):
    # Spans of finished work are built without the SDK's start_span (the fast path): still the
    # parent's trace, a span id of their own, the parent's sampled flag, errors and attributes.
    path = tmp_path / "s.jsonl"
    clean_env.setenv("DISTSERVE_TRACE_FILE", str(path))
    assert telemetry.setup("prefill")
    sampled, unsampled, caller = "ab" * 16, "cd" * 16, "00f067aa0ba902b7"
    t0 = time.monotonic()
    parent = telemetry.from_headers({"traceparent": f"00-{sampled}-{caller}-01"})
    queue = telemetry.record("queue", parent, t0, t0 + 0.1, {"n": 3, "unset": None})
    telemetry.record("inner", queue, t0, t0 + 0.05, error="it broke")
    parent = telemetry.from_headers({"traceparent": f"00-{unsampled}-{caller}-00"})
    quiet = telemetry.record("quiet", parent, t0, t0 + 0.1)
    onward = dict(telemetry.outgoing(quiet))["traceparent"]
    assert onward.startswith(f"00-{unsampled}-") and onward.endswith("-00")
    assert onward.split("-")[2] != caller  # a span of its own, though not recorded
    telemetry.shutdown()
    spans = {s["name"]: s for s in read(path)}
    assert sorted(spans) == ["inner", "queue"]
    queue_span, inner = spans["queue"], spans["inner"]
    assert (queue_span["trace_id"], queue_span["parent_span_id"]) == (sampled, caller)
    assert (inner["trace_id"], inner["parent_span_id"]) == (sampled, queue_span["span_id"])
    assert queue_span["span_id"] not in (caller, inner["span_id"])
    assert queue_span["attributes"] == {"n": 3} and queue_span["status"] == "UNSET"
    assert (inner["status"], inner["status_message"]) == ("ERROR", "it broke")
    assert inner["end_unix_nano"] - inner["start_unix_nano"] == pytest.approx(0.05e9, abs=1e3)
    assert inner["service"] == "distserve-prefill"


def test_a_sampler_that_ignores_the_parent_decides_for_recorded_spans_too(clean_env, tmp_path):
    path = tmp_path / "s.jsonl"
    clean_env.setenv("DISTSERVE_TRACE_FILE", str(path))
    clean_env.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    clean_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    assert telemetry.setup("decode")
    parent = telemetry.from_headers({"traceparent": f"00-{'ab' * 16}-00f067aa0ba902b7-01"})
    t0 = time.monotonic()
    telemetry.record("dropped", parent, t0, t0 + 0.1)
    telemetry.shutdown()
    assert not path.exists() or read(path) == []


def test_spans_export_over_otlp_http_protobuf(clean_env):
    with OtlpReceiver() as receiver:
        clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.http_endpoint)
        assert telemetry.setup("decode", "decode-3")
        span = telemetry.start("root", None, {"a": 1})
        t0 = time.monotonic()
        telemetry.record("child", telemetry.context_of(span), t0, t0 + 0.25, {"b": [1, 2]})
        span.end()
        telemetry.shutdown()  # flushes: the POST is done when this returns
        assert sorted(s["name"] for s in receiver.spans) == ["child", "root"]
        spans = {s["name"]: s for s in receiver.spans}
        assert receiver.exports == {"grpc": 0, "http": 1}
    ctx = span.get_span_context()
    root, child = spans["root"], spans["child"]
    assert (root["trace_id"], root["span_id"]) == (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    assert child["trace_id"] == root["trace_id"] and child["parent_span_id"] == root["span_id"]
    assert child["end_unix_nano"] - child["start_unix_nano"] == pytest.approx(0.25e9, abs=1e3)
    assert (root["attributes"], child["attributes"]) == ({"a": 1}, {"b": [1, 2]})
    assert {s["service"] for s in spans.values()} == {"distserve-decode"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ""),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, "collector:4317"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "10.0.0.5:4317"}, "10.0.0.5:4317"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http"},
            "",
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, ""),
    ],
)
def test_envoy_exports_to_the_grpc_collector_the_environment_names(env, expected):
    assert otlp_grpc_endpoint(env) == expected


def test_slo_attainment_counts_only_the_window():
    window = SloWindow(Slo(ttft_s=1, tpot_s=0.1, window_s=10))
    assert window.attainment(now=0) == (1.0, 0)
    window.add(True, now=0)
    window.add(False, now=5)
    window.add(True, now=9)
    assert window.attainment(now=9.5) == (pytest.approx(2 / 3), 3)
    assert window.attainment(now=12) == (0.5, 2)  # the one at t=0 left the window
    assert window.attainment(now=30) == (1.0, 0)


TRACEPARENTS = [
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
    " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\t",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # 00 takes four fields
    "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # later versions more
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-ff",
    "garbage",
    "",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-" + "x" * 600,
]


@pytest.mark.parametrize("traceparent", TRACEPARENTS)
@pytest.mark.parametrize("tracestate", [None, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7", "bad"])
def test_trace_context_is_read_as_the_sdks_propagator_reads_it(
    clean_env, tmp_path, traceparent, tracestate
):
    # The fast path (`direct_spans.W3c`) against the SDK's TraceContext propagator, the reference.
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    clean_env.setenv("DISTSERVE_TRACE_FILE", str(tmp_path / "s.jsonl"))
    assert telemetry.setup("prefill")
    assert telemetry._w3c is not None  # the default propagators take the fast path
    headers = {"traceparent": traceparent, "user-agent": "grpc-python"}
    if tracestate is not None:
        headers["tracestate"] = tracestate
    ours = trace.get_current_span(telemetry.from_headers(headers)).get_span_context()
    sdk = trace.get_current_span(TraceContextTextMapPropagator().extract(headers))
    sdk = sdk.get_span_context()
    assert (ours.trace_id, ours.span_id, ours.trace_flags, ours.is_remote) == (
        sdk.trace_id,
        sdk.span_id,
        sdk.trace_flags,
        sdk.is_remote,
    )
    assert ours.trace_state == sdk.trace_state
    if sdk.is_valid:  # and written back as the SDK writes it
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(
            carrier, trace.set_span_in_context(trace.NonRecordingSpan(sdk))
        )
        assert dict(telemetry.outgoing(telemetry.from_headers(headers))) == carrier


def test_baggage_and_other_propagators_go_through_the_sdk(clean_env, tmp_path):
    from opentelemetry import baggage

    clean_env.setenv("DISTSERVE_TRACE_FILE", str(tmp_path / "s.jsonl"))
    assert telemetry.setup("gateway")
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    ctx = telemetry.from_headers({"traceparent": parent, "baggage": "tenant=acme"})
    assert baggage.get_baggage("tenant", ctx) == "acme"
    span = telemetry.start("request", ctx)
    onward = dict(
        telemetry.outgoing(baggage.set_baggage("tenant", "acme", telemetry.context_of(span)))
    )
    assert (
        onward["baggage"] == "tenant=acme"
        and onward["traceparent"].split("-")[1] == parent.split("-")[1]
    )
    span.end()
    telemetry.shutdown()
    clean_env.setenv("OTEL_PROPAGATORS", "tracecontext")
    assert telemetry.setup("gateway") and telemetry._w3c is not None
    telemetry.shutdown()
    clean_env.setenv("OTEL_PROPAGATORS", "tracecontext,b3")
    assert telemetry.setup("gateway") and telemetry._w3c is None


@pytest.mark.parametrize(
    "sampler", [(None, None), ("parentbased_traceidratio", "0"), ("parentbased_always_off", None)]
)
def test_started_spans_are_built_as_the_sdk_builds_them(clean_env, tmp_path, sampler):
    # `start`'s fast path (`direct_spans.Recorder.start`) against the SDK's `start_span`, the
    # reference: the same spans exported, with the same parents, attributes, events, status and
    # times, the same sampling decisions, and the same flags sent on.
    name, arg = sampler
    if name:
        clean_env.setenv("OTEL_TRACES_SAMPLER", name)
    if arg:
        clean_env.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    caller = "00f067aa0ba902b7"
    parents = [None, f"00-{'ab' * 16}-{caller}-01", f"00-{'cd' * 16}-{caller}-00"]

    t0 = time.monotonic()  # both runs' times from one reading: nanoseconds rounded alike

    def run(fast: bool) -> tuple[list, list]:
        path = tmp_path / f"{fast}.jsonl"
        clean_env.setenv("DISTSERVE_TRACE_FILE", str(path))
        assert telemetry.setup("gateway")
        assert telemetry._recorder is not None
        if not fast:
            telemetry._recorder = None  # the SDK's start_span (and record's SDK path)
        sent = []
        for traceparent in parents:
            parent = telemetry.from_headers({"traceparent": traceparent}) if traceparent else None
            span = telemetry.start("root", parent, {"a": 1, "gone": None}, t0)
            span.set_attribute("distserve.mode", "disaggregated")
            span.set_attributes({"reasons": ["stop"], "ms": 1.5, "unset": None})
            span.add_event("retry", {"n": 2}, timestamp=telemetry.wall_ns(t0) + 10_000_000)
            child = telemetry.record("child", telemetry.context_of(span), t0, t0 + 0.1)
            telemetry.fail(span, "it broke")
            onward = dict(telemetry.outgoing(telemetry.context_of(span)))["traceparent"]
            ids = span.get_span_context()
            sent.append(
                (onward.split("-")[3], traceparent is None or onward[3:35] == traceparent[3:35])
            )
            assert onward == f"00-{ids.trace_id:032x}-{ids.span_id:016x}-{onward.split('-')[3]}"
            assert telemetry.outgoing(child) is not None
            span.end(telemetry.wall_ns(t0) + 500_000_000)
            span.end(telemetry.wall_ns(t0) + 900_000_000)  # once only
        telemetry.shutdown()
        lines = read(path) if path.exists() else []
        own = {s["span_id"]: s["name"] for s in lines}
        spans = sorted(
            (
                s["name"],
                own.get(s["parent_span_id"], s["parent_span_id"]) or "",
                # None is no attribute value: this SDK keeps it (with a warning), we drop it
                {k: v for k, v in s["attributes"].items() if fast or v is not None},
                s["status"],
                s["status_message"],
                [
                    {**e, "time_unix_nano": e["time_unix_nano"] - s["start_unix_nano"]}
                    for e in s["events"]
                ],
                s["end_unix_nano"] - s["start_unix_nano"],
            )
            for s in lines
        )
        return spans, sent

    fast, sdk = run(True), run(False)
    assert fast == sdk
    spans, sent = fast
    # a new trace sampled as the sampler says; a caller's decision followed, and sent on
    assert (int(sent[0][0], 16) & 1 == 1) is (name is None) and sent[0][1]
    assert sent[1:] == [("01", True), ("00", True)]
    assert len(spans) == {None: 4, "parentbased_traceidratio": 2, "parentbased_always_off": 2}[name]
    assert any(s[0] == "root" and s[1] == caller and s[3] == "ERROR" for s in spans)
