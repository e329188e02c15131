"""Tracing and metrics of a real mesh: every process exports OTLP to a test receiver, Envoy
included; every service serves Prometheus metrics."""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.edge.config import EdgeConfig
from tests.otlp_receiver import OtlpReceiver

TRACE_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # export within 50 ms (default 5 s)
REQUEST_SPANS = {"prefill.queue", "prefill.compute", "kv.handoff", "decode.queue", "decode"}


def traceparent(trace_id: str, span_id: str = "00f067aa0ba902b7") -> str:
    return f"00-{trace_id}-{span_id}-01"


@dataclass
class Streamed:
    """What the client saw of one streamed request: its tokens, and when the messages carrying
    the first, the second and the last token arrived (s after the request left), and when it
    left (Unix time, ns: the spans' clock)."""

    ids: list[int]
    first: float
    second: float
    last: float
    sent_unix_nano: int

    @property
    def first_itl_ms(self) -> float:
        return (self.second - self.first) * 1000

    @property
    def tpot_ms(self) -> float:
        """The steady TPOT, as the gateway defines it: after the second token."""
        return (self.last - self.second) * 1000 / (len(self.ids) - 2)


def generate_timed(
    address: str, prompt: str, max_tokens: int, trace_id: str, channel: grpc.Channel | None = None
) -> Streamed:
    """One streamed request with the client's own trace context; on `channel` when given (its
    connection already made: the times are then the request's alone), else on a new one."""
    if channel is None:
        with grpc.insecure_channel(address) as channel:
            return generate_timed(address, prompt, max_tokens, trace_id, channel)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sent_unix_nano = time.time_ns()
    start = time.monotonic()
    ids: list[int] = []
    arrived: list[tuple[int, float]] = []  # (tokens so far, when) per message with tokens
    for r in stub.Generate(
        gateway_pb2.GenerateRequest(text=prompt, sampling=params),
        metadata=(("traceparent", traceparent(trace_id)),),
        timeout=60,
    ):
        if r.token_ids:
            ids += r.token_ids
            arrived.append((len(ids), time.monotonic() - start))
    second = next((t for n, t in arrived if n >= 2), arrived[-1][1])
    return Streamed(ids, arrived[0][1], second, arrived[-1][1], sent_unix_nano)


def duration_ms(spans: list[dict], *names: str) -> float:
    """How long the spans named `names` took together, in ms."""
    return sum(
        (s["end_unix_nano"] - s["start_unix_nano"]) / 1e6 for s in spans if s["name"] in names
    )


def children(spans: list[dict], parent: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for s in spans:
        if s["parent_span_id"] == parent["span_id"]:
            out.setdefault(s["name"], []).append(s)
    return out


@pytest.fixture(scope="module")
def traced_mesh(tiny_model, tmp_path_factory):
    """One 1P1D mesh for the module: every process exports OTLP to `mesh.receiver` (Envoy in
    front, exporting too) and appends its spans to `mesh.trace_file`; a planner the gateway
    feeds."""
    from tests.conftest import start_mesh, stop_now

    trace_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    with OtlpReceiver() as receiver:
        env = {
            **TRACE_ENV,
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{receiver.endpoint}",
            "DISTSERVE_TRACE_FILE": str(trace_file),
        }
        edge = EdgeConfig(port=0, access_log="", otlp_endpoint=receiver.endpoint)
        mesh = start_mesh(
            tiny_model,
            prefill=1,
            decode=1,
            edge=edge,
            env=env,
            planner=True,
            gateway_args=("--layerwise-min-tokens", "0"),  # the short prompts stream their KV too
        )
        mesh.receiver, mesh.trace_file = receiver, trace_file
        try:
            yield mesh
        finally:
            stop_now(mesh)


def test_one_request_is_one_trace_from_the_client_through_envoy_to_decode(traced_mesh, tiny_model):
    mesh, receiver = traced_mesh, traced_mesh.receiver
    # The requests first, one after the other, then their traces: Envoy exports its spans in
    # batches (every 5 s, or once 5 are buffered), so waiting after each request would wait
    # 5 s each time.
    # One channel, connected by a first request (not checked): the client's TTFT is then the
    # request's hops, not a new connection's handshakes with Envoy.
    sent = []
    with grpc.insecure_channel(mesh.edge_address) as channel:
        generate_timed(mesh.edge_address, "Connect", 2, f"{99:032x}", channel)
        for i in range(5):
            trace_id = f"{i + 1:032x}"
            seen = generate_timed(mesh.edge_address, "Trace me", 6, trace_id, channel)
            assert len(seen.ids) == 6
            sent.append((trace_id, seen))
    gaps, itl_errors, tpot_errors = [], [], []
    for trace_id, seen in sent:
        # (Envoy names its span "ingress", after its role)
        # The gateway's root span ends last and may come in a later export than its children.
        root_name = f"text_completion {tiny_model.name}"
        spans = receiver.wait_for(trace_id, {"ingress", root_name, *REQUEST_SPANS, "kv.lease"}, 20)
        # Envoy continues the client's trace; the gateway's root span is its child.
        [envoy] = [s for s in spans if s["service"] == "envoy"]
        assert envoy["parent_span_id"] == "00f067aa0ba902b7"
        [root] = [s for s in spans if "gen_ai.operation.name" in s["attributes"]]
        assert root["service"] == "distserve-gateway"
        assert root["parent_span_id"] == envoy["span_id"]
        a = root["attributes"]
        assert a["gen_ai.operation.name"] == "text_completion"
        assert a["gen_ai.request.model"] == tiny_model.name
        assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"]) == (6, 0.0)
        assert a["gen_ai.usage.input_tokens"] > 0
        assert a["gen_ai.usage.output_tokens"] == len(seen.ids)
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["distserve.mode"] == "disaggregated"
        assert (a["distserve.prefill.instance"], a["distserve.decode.instance"]) == (
            "prefill-0",
            "decode-0",
        )
        # The tree: every phase of the request hangs off the root, in its own process.
        kids = children(spans, root)
        services = {n: {s["service"] for s in kids[n]} for n in kids}
        assert services == {
            "prefill.queue": {"distserve-prefill"},
            "prefill.compute": {"distserve-prefill"},
            "kv.lease": {"distserve-prefill"},
            "kv.handoff": {"distserve-decode"},
            "decode.queue": {"distserve-decode"},
            "decode": {"distserve-decode"},
        }
        [handoff] = kids["kv.handoff"]
        h = handoff["attributes"]
        assert h["kv.bytes"] > 0 and h["kv.chunks"] >= 2 and h["kv.chunks_retried"] == 0
        assert h["kv.transport"] == "ucx" and h["kv.bandwidth_bytes_per_s"] > 0
        # Layer-wise: the pull starts while prefill computes (how much of it hides
        # behind prefill depends on timing; tests/kvtransfer/test_layerwise.py checks it).
        assert h["kv.layerwise"] is True and 0.0 <= h["kv.overlap_fraction"] <= 1.0
        [compute] = kids["prefill.compute"]
        assert compute["attributes"]["prefill.batch_tokens"] >= a["gen_ai.usage.input_tokens"]
        assert compute["attributes"]["prefill.batch_size"] == 1  # one request at a time
        # The decode instance streamed all tokens but the first (the prefill instance's).
        [decode] = kids["decode"]
        assert decode["attributes"]["gen_ai.usage.output_tokens"] == len(seen.ids) - 1
        decode_ms = (decode["end_unix_nano"] - decode["start_unix_nano"]) / 1e6
        assert decode["attributes"]["decode.tpot_ms"] == pytest.approx(
            decode_ms / (len(seen.ids) - 1)
        )
        # Phases in order: the handoff starts once the prompt is scheduled (before its
        # compute ends), decode after the handoff (to within 1 ms: spans carry
        # wall-clock times, read from monotonic clocks).
        ms = 1_000_000
        assert compute["start_unix_nano"] <= handoff["start_unix_nano"] + ms
        assert handoff["end_unix_nano"] <= kids["decode"][0]["start_unix_nano"] + ms
        # The release reaches the source with the pull's context: its span is the
        # kvtransfer hop of the trace, under kv.handoff, in the prefill process.
        released = receiver.wait_for(trace_id, {"kv.release"}, 10)
        [release] = [s for s in released if s["name"] == "kv.release"]
        assert release["parent_span_id"] == handoff["span_id"]
        assert release["service"] == "distserve-prefill"
        [lease] = kids["kv.lease"]
        assert lease["attributes"]["kv.outcome"] == "released"
        # (a send whose bytes arrived may be cancelled by the release before it counts)
        assert 0 < lease["attributes"]["kv.bytes_sent"] <= h["kv.bytes"]
        # The span's TTFT is the client's, less the hops in between (Envoy, gRPC): the request
        # reached the gateway after it left the client, and the span's first token left the
        # gateway before the client had it (one host, one clock: to within 1 ms).
        sent_ms = seen.sent_unix_nano / 1e6
        root_ms = root["start_unix_nano"] / 1e6
        assert sent_ms <= root_ms + 1
        assert root_ms + a["distserve.ttft_ms"] <= sent_ms + seen.first * 1000 + 1
        gaps.append(seen.first * 1000 - a["distserve.ttft_ms"])
        # The gaps between tokens: the gateway's, seen one hop later by the client.
        itl_errors.append(seen.first_itl_ms - a["distserve.first_itl_ms"])
        tpot_errors.append(seen.tpot_ms - a["distserve.tpot_ms"])
    # The client's TTFT is the span's plus Envoy and the client's own gRPC: never less. (What
    # the hops add is a figure of bench/mesh/mesh.py, `ttft_added_ms_p50`, not a test's.)
    assert min(gaps) >= 0, gaps
    # A gap between two messages is measured at both ends of the same hops (gateway -> Envoy
    # -> client), so it differs only by how much those hops' delay varies between the two
    # messages: well under the hops' whole delay (the TTFT gap above), either way. The TPOT
    # spreads the variation over its n - 2 = 4 intervals.
    assert statistics.median(abs(e) for e in itl_errors) < 3, itl_errors
    assert statistics.median(abs(e) for e in tpot_errors) < 1, tpot_errors


def test_an_http_request_through_envoy_is_one_trace_too(traced_mesh, tiny_model):
    from tests.test_edge import request

    mesh, receiver = traced_mesh, traced_mesh.receiver
    trace_id = "5e" * 16
    body = {"model": tiny_model.name, "prompt": "Trace me over HTTP", "max_tokens": 4}
    status, _, reply = request(
        mesh.edge_address,
        "POST",
        "/v1/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json", "traceparent": traceparent(trace_id)},
    )
    assert status == 200, reply
    root_name = f"text_completion {tiny_model.name}"
    spans = receiver.wait_for(trace_id, {"ingress", root_name, *REQUEST_SPANS}, 20)
    [envoy] = [s for s in spans if s["service"] == "envoy"]
    assert envoy["parent_span_id"] == "00f067aa0ba902b7"
    [root] = [s for s in spans if s["name"] == root_name]
    assert root["service"] == "distserve-gateway" and root["parent_span_id"] == envoy["span_id"]
    a = root["attributes"]
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.usage.output_tokens"] == reply["usage"]["completion_tokens"] == 4
    assert set(children(spans, root)) >= REQUEST_SPANS


def test_a_decode_the_gateway_cuts_short_is_still_a_span(traced_mesh):
    """A client that leaves mid-stream: the gateway cancels the decode call, and the decode
    instance still records its `decode` span, marked cancelled. (The span was once recorded
    only after the last token's `yield`, which a cancelled call never returns from; and the
    gateway cancels even a finished call once the last token is in, so a finished request's
    `decode` span went missing too whenever that cancel came first.)"""
    mesh, receiver = traced_mesh, traced_mesh.receiver
    trace_id = "6f" * 16
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        params = common_pb2.SamplingParams(max_tokens=1000, ignore_eos=True)
        call = stub.Generate(
            gateway_pb2.GenerateRequest(text="Leave me early", sampling=params),
            metadata=(("traceparent", traceparent(trace_id)),),
            timeout=60,
        )
        seen = 0
        for r in call:
            seen += len(r.token_ids)
            if seen >= 4:
                call.cancel()
                break
    spans = receiver.wait_for(trace_id, REQUEST_SPANS, 20)
    [decode] = [s for s in spans if s["name"] == "decode"]
    assert decode["attributes"]["decode.cancelled"] is True
    assert 2 <= decode["attributes"]["gen_ai.usage.output_tokens"] < 1000


def test_trace_report_breaks_down_the_requests_the_mesh_recorded(
    traced_mesh, tiny_model, tmp_path, capsys
):
    from distserve.trace_report import load_spans, main, requests

    mesh, receiver = traced_mesh, traced_mesh.receiver
    root_name = f"text_completion {tiny_model.name}"
    names = {root_name, *REQUEST_SPANS}
    sent = {}
    for i in range(3):
        trace_id = f"{0x100 + i:032x}"
        sent[trace_id] = generate_timed(mesh.gateway_address, f"Report me {i}", 6, trace_id)
    # Every process exports each span twice: over OTLP (to the receiver) and to the file.
    exported = {t: receiver.wait_for(t, names, 20) for t in sent}
    deadline = time.monotonic() + 10
    while True:
        in_file = {
            r.root.trace_id: {r.root.name, *(s.name for s in r.spans)}
            for r in requests(load_spans(mesh.trace_file).spans)
        }
        if all(names <= in_file.get(t, set()) for t in sent):
            break
        assert time.monotonic() < deadline, f"spans never reached the file: {in_file}"
        time.sleep(0.05)

    png = tmp_path / "waterfall.png"
    argv = [str(mesh.trace_file), "--json", "--limit", "0", "--png", str(png), "--slowest", "2"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = [r for r in json.loads(out)["requests"] if r["trace_id"] in sent]
    assert sorted(r["trace_id"] for r in rows) == sorted(sent)  # one row per request
    for r in rows:
        spans = exported[r["trace_id"]]
        [root] = [s for s in spans if s["name"] == root_name]
        a = root["attributes"]

        assert (r["request_id"], r["mode"]) == (a["distserve.request_id"], "disaggregated")
        assert r["output_tokens"] == len(sent[r["trace_id"]].ids)
        # The root span's latencies, as the gateway measured them.
        latencies = (r["ttft_ms"], r["first_itl_ms"], r["tpot_ms"])
        assert latencies == (
            a["distserve.ttft_ms"],
            a["distserve.first_itl_ms"],
            a["distserve.tpot_ms"],
        )
        assert r["total_ms"] == pytest.approx(duration_ms(spans, root_name))
        # The phases, from the spans of the prefill and the decode process.
        assert r["prefill_queue_ms"] == pytest.approx(duration_ms(spans, "prefill.queue"))
        assert r["decode_queue_ms"] == pytest.approx(duration_ms(spans, "decode.queue"))
        assert r["queue_ms"] == pytest.approx(duration_ms(spans, "prefill.queue", "decode.queue"))
        assert r["prefill_ms"] == pytest.approx(duration_ms(spans, "prefill.compute"))
        assert r["handoff_ms"] == pytest.approx(duration_ms(spans, "kv.handoff"))
        assert (r["kv_transport"], r["kv_chunks_retried"], r["handoff_attempts"]) == ("ucx", 0, 1)
        # ... and consistent with the latencies: the prompt waited and was computed before its
        # first token, and the KV waited for room and was pulled before the second (each span
        # inside its interval, on one monotonic clock: to within the ns rounding of wall times).
        assert r["prefill_queue_ms"] + r["prefill_ms"] <= r["ttft_ms"] + 1e-3
        assert r["decode_queue_ms"] + r["handoff_ms"] <= r["ttft_ms"] + r["first_itl_ms"] + 1e-3
        assert r["flagged"] == (r["first_itl_ms"] > 3 * r["tpot_ms"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "waterfall of the 2 slowest requests" in err


def test_colocated_request_spans_and_the_trace_file(tiny_model, tmp_path):
    from tests.conftest import start_mesh

    path = tmp_path / "spans.jsonl"
    env = {**TRACE_ENV, "DISTSERVE_TRACE_FILE": str(path)}
    mesh = start_mesh(tiny_model, prefill=0, decode=0, colocated=1, env=env)
    try:
        trace_id = "ab" * 16
        assert len(generate_timed(mesh.gateway_address, "Colocated", 4, trace_id).ids) == 4
    finally:
        mesh.stop()  # flushes what is left
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    mine = [s for s in spans if s["trace_id"] == trace_id]
    [root] = [s for s in mine if "gen_ai.operation.name" in s["attributes"]]
    assert root["parent_span_id"] == "00f067aa0ba902b7"  # the client's span
    assert root["attributes"]["distserve.mode"] == "colocated"
    assert root["attributes"]["distserve.decode.instance"] == "colocated-0"
    kids = children(mine, root)
    assert set(kids) == {"prefill.queue", "prefill.compute", "decode"}
    assert {s["service"] for k in kids.values() for s in k} == {"distserve-colocated"}


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name: str, **labels) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name and all((k, str(x)) in ls for k, x in labels.items())
    )


def buckets(samples, name: str) -> list[float]:
    """The finite upper bounds (`le`) of histogram `name`'s buckets."""
    les = {float(dict(ls)["le"]) for (n, ls) in samples if n == f"{name}_bucket"}
    return sorted(le for le in les if le != float("inf"))


def test_metrics_endpoints_scrape_and_move_with_requests(traced_mesh):
    mesh = traced_mesh
    by_name = {p.name: p.ready["metrics_address"] for p in mesh.workers}
    by_name["gateway"] = next(p for p in mesh.processes if p.name == "gateway").ready[
        "metrics_address"
    ]
    assert set(by_name) == {"gateway", "prefill-0", "decode-0"}
    before = {name: scrape(addr) for name, addr in by_name.items()}
    n = 3
    for i in range(n):
        generate_timed(mesh.gateway_address, f"Count me {i}", 5, f"{i + 7:032x}")
    # The client has its last token a moment before each service has settled the request (the
    # gateway's bookkeeping, decode freeing blocks): read once all are idle, within a second.
    idle_now = (
        ("gateway", "distserve_gateway_requests_in_flight"),
        ("gateway", "distserve_admission_decode_seats_taken"),
        ("decode-0", "distserve_kv_blocks_used"),
        ("decode-0", "distserve_running_seqs"),
        ("prefill-0", "distserve_kv_handles_held"),
    )
    deadline = time.monotonic() + 1.0
    while True:
        after = {name: scrape(addr) for name, addr in by_name.items()}
        settled = all(value(after[svc], gauge) == 0 for svc, gauge in idle_now)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    def moved(service, name, **labels):
        return value(after[service], name, **labels) - value(before[service], name, **labels)

    g = "gateway"
    assert moved(g, "gen_ai_server_time_to_first_token_seconds_count") == n
    assert moved(g, "gen_ai_server_time_per_output_token_seconds_count") == n
    assert moved(g, "gen_ai_server_request_duration_seconds_count", error_type="") == n
    assert moved(g, "distserve_first_token_gap_seconds_count", mode="disaggregated") == n
    assert moved(g, "distserve_gateway_requests_total", outcome="length") == n
    assert value(after[g], "distserve_workers", role="prefill") == 1
    assert value(after[g], "distserve_slo_window_requests") >= n
    assert 0 <= value(after[g], "distserve_slo_attainment") <= 1
    # Admission's inputs: the requests ended, so no decode seat is taken (no call the gateway
    # sent is still counted); calibrations within their bounds.
    assert value(after[g], "distserve_admission_decode_seats_taken") == 0
    assert (
        value(after[g], "distserve_admission_decode_seats") == -1
        or value(after[g], "distserve_admission_decode_seats") >= 1
    )
    assert 0 < value(after[g], "distserve_admission_step_limit_seconds") <= 0.1  # the TPOT SLO
    assert value(after[g], "distserve_admission_bubble_steps") >= 1
    assert 0.25 <= value(after[g], "distserve_admission_ttft_scale") <= 4
    # The buckets the GenAI semantic conventions recommend, exactly.
    assert buckets(after[g], "gen_ai_server_time_to_first_token_seconds") == [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    ]  # fmt: skip
    assert buckets(after[g], "gen_ai_server_time_per_output_token_seconds") == [
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    ]  # fmt: skip
    assert buckets(after[g], "gen_ai_server_request_duration_seconds") == [
        0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
    ]  # fmt: skip
    p, d = "prefill-0", "decode-0"
    assert moved(p, "distserve_worker_requests_total") == n
    assert moved(p, "distserve_prefill_compute_seconds_count") == n
    assert moved(p, "distserve_kv_lease_seconds_count") == n
    assert moved(d, "distserve_kv_pulls_total") == n
    assert moved(d, "distserve_kv_transfer_seconds_count") == n
    assert moved(d, "distserve_kv_transfer_bytes_total") > 0
    assert moved(d, "distserve_decode_queue_seconds_count") == n
    # Every engine step, by kind: each prompt prefilled alone (the requests ran one after
    # another), then one decode step of one sequence per further token.
    steps = "distserve_engine_step_seconds_count"
    assert moved(p, steps, kind="prefill") == n
    assert moved(p, "distserve_engine_step_tokens_total", kind="prefill") >= 2 * n
    assert moved(d, steps, kind="decode") == 4 * n
    assert moved(d, "distserve_engine_step_batch_size_sum", kind="decode") == 4 * n
    assert moved(d, "distserve_engine_step_tokens_total", kind="decode") == 4 * n
    assert value(after[p], steps, kind="decode") == value(after[d], steps, kind="prefill") == 0
    assert value(after[d], "distserve_kv_blocks_total") > 0
    assert value(after[d], "distserve_kv_blocks_used") == 0  # all finished, all freed
    assert value(after[p], "distserve_kv_handles_held") == 0
    # Idle again: the queue depths are there, and empty; every KV block is free.
    idle = {
        g: ["distserve_gateway_requests_in_flight"],
        p: [
            "distserve_queued_prompt_tokens",
            "distserve_waiting_seqs",
            "distserve_kv_handles_held",
        ],
        d: ["distserve_waiting_seqs", "distserve_running_seqs", "distserve_kv_pulls_pending"],
    }
    for service, gauges in idle.items():
        for gauge in gauges:
            assert any(n == gauge for n, _ in after[service]), (service, gauge)
            assert value(after[service], gauge) == 0, (service, gauge)
    for w in (p, d):
        total = value(after[w], "distserve_kv_blocks_total")
        assert value(after[w], "distserve_kv_blocks_free") == total > 0, w
    assert value(after[p], "process_resident_memory_bytes") > 0
    # The gateway streams each finished request to the planner.
    deadline = time.monotonic() + 10
    sent = lambda: value(scrape(by_name[g]), "distserve_planner_samples_total", outcome="sent")  # noqa: E731
    while sent() - value(before[g], "distserve_planner_samples_total", outcome="sent") < n:
        assert time.monotonic() < deadline, "samples never reached the planner's stream"
        time.sleep(0.1)
