"""Tracing and metrics of a real mesh: every process exports OTLP to a test receiver, Envoy
included; every service serves Prometheus metrics."""

from __future__ import annotations

import json
import statistics
import time
import urllib.request

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


def generate_timed(address: str, prompt: str, max_tokens: int, trace_id: str):
    """One streamed request with the client's own trace context; returns (TTFT s, tokens)."""
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        start = time.monotonic()
        ttft, ids = None, []
        for r in stub.Generate(
            gateway_pb2.GenerateRequest(text=prompt, sampling=params),
            metadata=(("traceparent", traceparent(trace_id)),),
            timeout=60,
        ):
            if ttft is None:
                ttft = time.monotonic() - start
            ids += r.token_ids
        return ttft, ids


def children(spans: list[dict], parent: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for s in spans:
        if s["parent_span_id"] == parent["span_id"]:
            out.setdefault(s["name"], []).append(s)
    return out


@pytest.fixture(scope="module")
def traced_mesh(tiny_model):
    """One 1P1D mesh for the module: every process exports OTLP to `mesh.receiver` (Envoy in
    front, exporting too), and a planner the gateway feeds."""
    from tests.conftest import start_mesh, stop_now

    with OtlpReceiver() as receiver:
        env = {**TRACE_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{receiver.endpoint}"}
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
        mesh.receiver = receiver
        try:
            yield mesh
        finally:
            stop_now(mesh)


def test_one_request_is_one_trace_from_the_client_through_envoy_to_decode(traced_mesh, tiny_model):
    mesh, receiver = traced_mesh, traced_mesh.receiver
    # The requests first, one after the other, then their traces: Envoy exports its spans in
    # batches (every 5 s, or once 5 are buffered), so waiting after each request would wait
    # 5 s each time.
    sent = []
    for i in range(5):
        trace_id = f"{i + 1:032x}"
        client_ttft, ids = generate_timed(mesh.edge_address, "Trace me", 6, trace_id)
        assert len(ids) == 6
        sent.append((trace_id, client_ttft))
    gaps = []
    for trace_id, client_ttft in sent:
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
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) > (0, 5)
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["distserve.mode"] == "disaggregated"
        assert 0 < a["distserve.tpot_ms"] < a["distserve.first_itl_ms"] + 1000
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
        assert h["kv.streaming"] is True and 0.0 <= h["kv.overlap_fraction"] <= 1.0
        [compute] = kids["prefill.compute"]
        assert compute["attributes"]["prefill.batch_tokens"] >= a["gen_ai.usage.input_tokens"]
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
        # The span's TTFT is the client's, less the hops in between (Envoy, gRPC).
        gaps.append(client_ttft * 1000 - a["distserve.ttft_ms"])
    # The client's TTFT is the span's plus Envoy and the client's own gRPC: never less,
    # a few ms more (more when the two cores are busy with other work: the median then).
    assert min(gaps) >= 0 and min(gaps) < 5 and statistics.median(gaps) < 10, gaps


def test_colocated_request_spans_and_the_trace_file(tiny_model, tmp_path):
    from tests.conftest import start_mesh

    path = tmp_path / "spans.jsonl"
    env = {**TRACE_ENV, "DISTSERVE_TRACE_FILE": str(path)}
    mesh = start_mesh(tiny_model, prefill=0, decode=0, colocated=1, env=env)
    try:
        trace_id = "ab" * 16
        _, ids = generate_timed(mesh.gateway_address, "Colocated", 4, trace_id)
        assert len(ids) == 4
    finally:
        mesh.stop()  # flushes what is left
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    mine = [s for s in spans if s["trace_id"] == trace_id]
    [root] = [s for s in mine if "gen_ai.operation.name" in s["attributes"]]
    assert root["parent_span_id"] == "00f067aa0ba902b7"  # the client's span
    assert root["attributes"]["distserve.mode"] == "colocated"
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
    after = {name: scrape(addr) for name, addr in by_name.items()}

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
    # The recommended buckets: TTFT from 1 ms to 10 s.
    les = {dict(ls)["le"] for (nm, ls) in after[g] if nm.endswith("first_token_seconds_bucket")}
    assert {"0.001", "10.0", "+Inf"} <= les
    p, d = "prefill-0", "decode-0"
    assert moved(p, "distserve_worker_requests_total") == n
    assert moved(p, "distserve_prefill_compute_seconds_count") == n
    assert moved(p, "distserve_kv_lease_seconds_count") == n
    assert moved(d, "distserve_kv_pulls_total") == n
    assert moved(d, "distserve_kv_transfer_seconds_count") == n
    assert moved(d, "distserve_kv_transfer_bytes_total") > 0
    assert moved(d, "distserve_decode_queue_seconds_count") == n
    assert value(after[d], "distserve_kv_blocks_total") > 0
    assert value(after[d], "distserve_kv_blocks_used") == 0  # all finished, all freed
    assert value(after[p], "distserve_kv_handles_held") == 0
    assert value(after[p], "process_resident_memory_bytes") > 0
    # The gateway streams each finished request to the planner.
    deadline = time.monotonic() + 10
    sent = lambda: value(scrape(by_name[g]), "distserve_planner_samples_total", outcome="sent")  # noqa: E731
    while sent() - value(before[g], "distserve_planner_samples_total", outcome="sent") < n:
        assert time.monotonic() < deadline, "samples never reached the planner's stream"
        time.sleep(0.1)
