"""Admission: the rules on a registry of reported loads, and the refusal as clients see it from a
real mesh (gRPC RESOURCE_EXHAUSTED with retry-after-ms, HTTP 429 with Retry-After)."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from services.common.errors import Overloaded
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.admission import Admission, AdmissionConfig, CostLine
from services.gateway.registry import Load, Registry
from tests.conftest import start_mesh, stop_now


def registry(prefill_queued: int = 0, decode_pulls: int = 0, decode_free: int = 100) -> Registry:
    r = Registry(lease_s=60)
    r.register("p", "prefill", "p:1", Load(queued_prompt_tokens=prefill_queued))
    load = Load(pending_pulls=decode_pulls, free_kv_blocks=decode_free, total_kv_blocks=100)
    r.register("d", "decode", "d:1", load)
    return r


def observe_line(admission: Admission, a: float = 5.0, b: float = 0.1) -> None:
    for tokens in range(100, 1100, 100):
        admission.observe_prefill(a + b * tokens, tokens)


async def admit(admission: Admission, prompt_tokens: int = 100) -> None:
    async with admission.admit(prompt_tokens):
        pass


def test_the_cost_line_is_fitted_once_batches_span_sizes():
    admission = Admission(registry(), ttft_slo_s=1.0)
    for _ in range(20):  # one batch size only: no line
        admission.observe_prefill(12.0, 2)
    assert admission.cost is None and admission.predicted_ttft_ms(100) is None
    observe_line(admission)
    a, b = admission.cost
    assert b == pytest.approx(0.1, rel=0.3) and a >= 0


def test_the_cost_line_is_least_squares_over_the_latest_batches_only():
    rng = random.Random(0)
    line, window = CostLine(size=32), []
    for i in range(400):
        tokens = 64 if 100 <= i < 200 else rng.randint(16, 2048)  # and a stretch of one size
        ms = 3.0 + 0.05 * tokens + rng.uniform(-1.0, 1.0)
        line.add(tokens, ms)
        window = [*window, (tokens, ms)][-32:]
        fit = line.fit()
        sizes = [t for t, _ in window]
        if len(window) < 8 or max(sizes) < 2 * min(sizes):  # too few, or one size: no line
            assert fit is None
            continue
        times = [m for _, m in window]
        b, _ = np.polyfit(sizes, times, 1)
        b = min(b, min(m / t for t, m in window))  # no batch was cheaper per token
        a = min(max(0.0, np.mean(times) - b * np.mean(sizes)), min(times))
        assert fit == pytest.approx((a, b), rel=1e-6, abs=1e-9)


def test_a_loaded_host_does_not_read_as_cost_per_token():
    """Big batches form when the instance is slow, and are slow: least squares alone fitted
    1.6 ms/token to the tiny model (0.02 really) and predicted 1 s for a short queue."""
    line = CostLine()
    rng = random.Random(0)
    for _ in range(128):
        tokens = rng.choice([16, 32, 48, 64])
        contention = 1 + (tokens / 16 - 1) * 8  # the bigger, the more it was slowed
        line.add(tokens, (1.0 + 0.02 * tokens) * contention)
    a, b = line.fit()
    assert b <= 1.32 / 16  # the 16-token batches' cost per token, uncontended
    assert a + b * 640 < 60  # not the ~700 ms of least squares alone


def test_a_request_predicted_to_miss_the_ttft_slo_is_refused_with_a_retry_hint():
    refused = []
    admission = Admission(registry(prefill_queued=30_000), ttft_slo_s=1.0, on_refuse=refused.append)
    asyncio.run(admit(admission))  # no line yet: nothing to predict from, admitted
    observe_line(admission, a=0.0, b=0.1)  # 0.1 ms a prompt token
    with pytest.raises(Overloaded) as err:
        asyncio.run(admit(admission))
    # 30 100 tokens ahead and its own at 0.1 ms: ~3 010 ms against 1 x 1 000 ms.
    assert err.value.status == "RESOURCE_EXHAUSTED"
    assert "30000 prompt tokens are queued ahead" in str(err.value)
    assert err.value.retry_after_s == 3  # ~2.01 s over the limit, rounded up
    assert refused == ["ttft"] and admission.inflight == 0
    # On an idle mesh it is admitted, even a prompt that alone takes longer than the limit;
    # the factor 0 switches the rule off.
    idle = Admission(registry(prefill_queued=0), 1.0)
    observe_line(idle, a=0.0, b=0.1)
    asyncio.run(admit(idle, prompt_tokens=50_000))
    off = Admission(registry(prefill_queued=30_000), 1.0, AdmissionConfig(ttft_factor=0))
    observe_line(off, a=0.0, b=0.1)
    asyncio.run(admit(off))


def test_in_flight_requests_are_bounded():
    admission = Admission(registry(), 1.0, AdmissionConfig(max_inflight=2))

    async def scenario() -> None:
        async with admission.admit(10), admission.admit(10):
            with pytest.raises(Overloaded, match="2 requests in flight"):
                await admit(admission)
        await admit(admission)  # room again

    asyncio.run(scenario())
    assert admission.inflight == 0


def test_saturated_decode_holds_prompts_until_it_drains_or_the_budget_ends():
    reg = registry(decode_pulls=4)
    config = AdmissionConfig(pull_watermark=4)
    admission = Admission(reg, ttft_slo_s=0.1, config=config)  # a 100 ms budget

    async def drains_soon() -> float:
        async def relieve() -> None:
            await asyncio.sleep(0.05)
            reg.heartbeat("d", Load(pending_pulls=1, free_kv_blocks=100, total_kv_blocks=100))

        relief = asyncio.create_task(relieve())
        loop = asyncio.get_running_loop()
        start = loop.time()
        await admit(admission)
        await relief
        return loop.time() - start

    assert asyncio.run(drains_soon()) >= 0.05  # it waited for the decode pool
    reg.heartbeat("d", Load(pending_pulls=0, free_kv_blocks=3, total_kv_blocks=100))  # 97% used
    with pytest.raises(Overloaded, match="past its watermark"):
        asyncio.run(admit(admission))


def test_decode_steps_slower_than_the_tpot_slo_hold_new_prompts_back():
    """Each sequence a decode instance takes in makes every step slower: while its steps are
    past the TPOT SLO it takes no new prompt; idle, its last step time does not count."""
    reg = registry()
    slow = Load(running_seqs=8, decode_step_ms=150.0, free_kv_blocks=100, total_kv_blocks=100)
    reg.heartbeat("d", slow)
    admission = Admission(reg, ttft_slo_s=0.1, tpot_slo_s=0.1)
    with pytest.raises(Overloaded, match="decode steps >= 100 ms"):
        asyncio.run(admit(admission))
    idle = Load(running_seqs=0, decode_step_ms=150.0, free_kv_blocks=100, total_kv_blocks=100)
    reg.heartbeat("d", idle)
    asyncio.run(admit(admission))
    reg.heartbeat("d", slow)
    off = Admission(reg, 0.1, AdmissionConfig(tpot_watermark=0), tpot_slo_s=0.1)
    asyncio.run(admit(off))


@pytest.fixture(scope="module")
def one_at_a_time(tiny_model):
    mesh = start_mesh(tiny_model, prefill=1, decode=1, gateway_args=("--max-inflight", "1"))
    yield mesh
    stop_now(mesh)


def test_clients_see_a_refusal_with_when_to_retry(one_at_a_time):
    mesh = one_at_a_time
    params = common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        busy = stub.Generate(gateway_pb2.GenerateRequest(text="Hi", sampling=params), timeout=60)
        next(busy)  # the first request is being served: the gateway is full
        second = stub.Generate(gateway_pb2.GenerateRequest(text="Hi", sampling=params))
        with pytest.raises(grpc.RpcError) as err:
            list(second)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-inflight 1" in err.value.details()
        assert dict(err.value.trailing_metadata())["retry-after-ms"] == "1000"
        body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
        req = urllib.request.Request(
            f"http://{mesh.gateway_http_address}/v1/completions",
            data=body,
            headers={"content-type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=10)
        assert http.value.code == 429 and http.value.headers["retry-after"] == "1"
        assert json.loads(http.value.read())["error"]["type"] == "rate_limit_error"
        assert len(list(busy)) > 0  # the admitted one is served to its end
    # Room again once it ended.
    with urllib.request.urlopen(req, timeout=30) as r:
        assert json.loads(r.read())["usage"]["completion_tokens"] == 2
