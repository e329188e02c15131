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
from services.gateway.admission import Admission, AdmissionConfig, Verdict
from services.gateway.cost_line import CostLine
from services.gateway.registry import Load, Registry
from tests.conftest import start_mesh, stop_now

ROOM = {"free_kv_blocks": 100, "total_kv_blocks": 100}


def registry(prefill_queued: int = 0, decode_pulls: int = 0, decode_free: int = 100) -> Registry:
    r = Registry(lease_s=60)
    r.register("p", "prefill", "p:1", Load(queued_prompt_tokens=prefill_queued))
    load = Load(pending_pulls=decode_pulls, free_kv_blocks=decode_free, total_kv_blocks=100)
    r.register("d", "decode", "d:1", load)
    return r


def observe_line(admission: Admission, a: float = 5.0, b: float = 0.1) -> None:
    for tokens in range(100, 1100, 100):
        admission.observe_prefill(a + b * tokens, tokens)


async def admit(admission: Admission, prompt_tokens: int = 100, max_tokens: int = 0) -> None:
    async with admission.admit(prompt_tokens, max_tokens):
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
    line, window, slope = CostLine(size=32), [], None
    for i in range(400):
        tokens = 64 if 100 <= i < 200 else rng.randint(16, 2048)  # and a stretch of one size
        slower = 20.0 if 150 <= i < 200 else 0.0  # the host slows down during the stretch
        ms = 3.0 + slower + 0.05 * tokens + rng.uniform(-1.0, 1.0)
        line.add(tokens, ms)
        window = [*window, (tokens, ms)][-32:]
        fit = line.fit()
        sizes, times = [t for t, _ in window], [m for _, m in window]
        if len(window) < 8:  # too few: no line
            assert fit is None
            continue
        if max(sizes) >= 2 * min(sizes):
            slope, _ = np.polyfit(sizes, times, 1)
        # One size: the slope found last, the line through the window's mean.
        b = min(slope, min(m / t for t, m in window))  # no batch was cheaper per token
        a = min(max(0.0, np.mean(times) - b * np.mean(sizes)), min(times))
        assert fit == pytest.approx((a, b), rel=1e-6, abs=1e-9)
        if 190 <= i < 200:
            assert a + b * 64 == pytest.approx(3.0 + 20.0 + 0.05 * 64, abs=1.0)  # it shows


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


def test_the_ttft_prediction_is_scaled_by_how_far_off_it_has_been():
    """TTFTs that came out longer than predicted (a loaded host; prompts joining the batch
    from behind) scale later predictions by the 95th percentile of actual / predicted: a
    request the bare line would let in is refused; shorter ones scale them down."""
    admission = Admission(registry(prefill_queued=500), ttft_slo_s=1.0)
    observe_line(admission, a=0.0, b=1.0)  # 1 ms a token: 500 queued + 100 = 600 ms
    assert admission.predicted_ttft_ms(100) == (pytest.approx(600.0), 500)
    verdict = Verdict(600.0, 500, waited_ms=0.0)
    for ratio in [1.0] * 4 + [2.0] * 12:  # 95th percentile: 2
        admission.observe_ttft(verdict, 600.0 * ratio)
    assert admission.ttft_scale == pytest.approx(2.0)
    with pytest.raises(Overloaded, match="predicted TTFT 1200 ms"):
        asyncio.run(admit(admission))
    # What it was admitted on counts, at the scale of the time: waiting included, and requests
    # with nothing queued ahead (admitted whatever their prediction) left out.
    scaled = Verdict(1200.0, 500, waited_ms=100.0, scale=2.0)
    for _ in range(64):
        admission.observe_ttft(scaled, 350.0)  # half of 100 + 600 ms
        admission.observe_ttft(Verdict(600.0, 0), 6000.0)
    assert admission.ttft_scale == pytest.approx(0.5)
    asyncio.run(admit(admission))


def test_tpots_over_what_requests_were_admitted_for_tighten_the_step_limit():
    """Batches fill up to the seats, so requests decode at about the step limit; the slower
    ones' excess (the 95th percentile of actual / admitted-for) is taken off the limit, and
    faster ones never loosen it past the configured one."""
    admission = Admission(registry(), ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert admission.step_limit(0) == 100.0
    verdict = Verdict(predicted_tpot_ms=100.0)
    for ratio in [0.8] * 10 + [1.25] * 10:
        admission.observe_tpot(verdict, 100.0 * ratio)
    assert admission.step_limit(0) == pytest.approx(80.0)
    for _ in range(64):
        admission.observe_tpot(Verdict(predicted_tpot_ms=80.0), 40.0)  # half: a light load
    assert admission.step_limit(0) == 100.0
    admission.observe_tpot(Verdict(), 500.0)  # admitted with no step limit: no sample
    assert admission.step_limit(0) == 100.0


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
            reg.report("d", Load(pending_pulls=1, free_kv_blocks=100, total_kv_blocks=100))

        relief = asyncio.create_task(relieve())
        loop = asyncio.get_running_loop()
        start = loop.time()
        await admit(admission)
        await relief
        return loop.time() - start

    assert asyncio.run(drains_soon()) >= 0.05  # it waited for the decode pool
    reg.report("d", Load(pending_pulls=0, free_kv_blocks=3, total_kv_blocks=100))  # 97% used
    with pytest.raises(Overloaded, match="past its watermark"):
        asyncio.run(admit(admission))


def test_prompts_let_go_together_when_decode_drains_are_predicted_again():
    """Prompts held at the decode watermark are predicted again when it clears, each seeing the
    ones let go before it (queued from the moment they are sent) and the time it waited: those
    that would now miss the TTFT limit are refused instead of all joining one prefill queue."""
    reg = registry(decode_pulls=4)
    admission = Admission(reg, ttft_slo_s=1.0, config=AdmissionConfig(pull_watermark=4))
    observe_line(admission, a=0.0, b=1.0)  # 1 ms a prompt token: 400 ms a prompt
    [p] = reg.live("prefill")

    async def one():
        async with admission.admit(400) as verdict:
            p.send(400)  # what the router does next, before anything else runs
            return verdict

    async def scenario():
        held = [asyncio.create_task(one()) for _ in range(6)]
        await asyncio.sleep(0.1)
        assert not any(t.done() for t in held)  # all wait for the decode pool
        reg.report("d", Load(pending_pulls=0, free_kv_blocks=100, total_kv_blocks=100))
        return await asyncio.gather(*held, return_exceptions=True)

    results = asyncio.run(scenario())
    verdicts = [r for r in results if not isinstance(r, BaseException)]
    # 100 ms waited + 400 ms, then + 800 ms; a third would be 100 + 1 200 > 1 000 ms.
    assert [v.queued_tokens for v in verdicts] == [0, 400]
    assert all(v.waited_ms >= 100 for v in verdicts)
    assert [v.predicted_ttft_ms for v in verdicts] == pytest.approx([400, 800], abs=1)
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(refused) == 4 and all(isinstance(r, Overloaded) for r in refused)
    assert all("past its watermark" in str(r) for r in refused)


def test_decode_steps_slower_than_the_tpot_slo_hold_new_prompts_back():
    """Each sequence a decode instance takes in makes every step slower: while its steps are
    past the TPOT SLO it takes no new prompt; idle, its last step time does not count."""
    reg = registry()
    slow = Load(running_seqs=8, decode_step_ms=150.0, free_kv_blocks=100, total_kv_blocks=100)
    reg.report("d", slow)
    admission = Admission(reg, ttft_slo_s=0.1, tpot_slo_s=0.1)
    with pytest.raises(Overloaded, match="decode steps >= 100 ms"):
        asyncio.run(admit(admission))
    idle = Load(running_seqs=0, decode_step_ms=150.0, free_kv_blocks=100, total_kv_blocks=100)
    reg.report("d", idle)
    asyncio.run(admit(admission))
    reg.report("d", slow)
    off = Admission(reg, 0.1, AdmissionConfig(tpot_watermark=0), tpot_slo_s=0.1)
    asyncio.run(admit(off))


def test_decode_takes_as_many_sequences_as_keep_its_steps_within_the_tpot_slo():
    """A line through the decode step time the heartbeats report over the batch size gives the
    seats within the TPOT SLO; prompts on their way to decode (queued or prefilling) take
    their seats before they get there, so the pool is not overfilled from behind."""
    reg = registry()
    admission = Admission(reg, ttft_slo_s=0.05, tpot_slo_s=0.1)  # steps of 100 ms at most
    [p], [d] = reg.live("prefill"), reg.live("decode")

    def decode_reports(running: int) -> None:
        step = 20.0 + 10.0 * running  # 10 ms a sequence
        reg.report("d", Load(running_seqs=running, decode_step_ms=step, **ROOM))
        admission.seats(d)

    assert admission.seats(d) is None  # no line yet: no seat rule
    for running in [2, 4, 6, 8, 3, 5, 7, 9]:
        decode_reports(running)
    assert admission.seats(d) == 8  # (100 - 20) / 10
    decode_reports(5)
    p.send(100), p.send(100)
    assert admission.pool_seats() == (8, 7)
    asyncio.run(admit(admission))  # 5 running + 2 coming: 7 of 8 seats
    p.send(100)
    with pytest.raises(Overloaded, match="seats"):
        asyncio.run(admit(admission))  # 8 of 8: it waited its TTFT budget, then refused
    asyncio.run(admit(admission, max_tokens=1))  # ends at prefill: no decode seat needed
    decode_reports(4)
    asyncio.run(admit(admission))  # one sequence finished: a seat again
    # The client's TPOT counts the handoff bubble among few gaps when the output is short: a
    # bubble of 3 steps in a 3-token answer leaves 2 gaps, so steps of 100 * 2 / 4 = 50 ms
    # at most, 3 seats.
    for _ in range(5):
        admission.observe_bubble(3.0)
    assert admission.step_limit(3) == pytest.approx(50.0)
    assert admission.step_limit(0) == admission.step_limit(1) == 100.0  # unknown: long
    assert admission.seats(d, admission.step_limit(3)) == 3
    with pytest.raises(Overloaded, match="seats"):
        asyncio.run(admit(admission, max_tokens=3))
    decode_reports(3)  # 3 running + 3 coming, of 7 seats at steps of 100 * 199 / 201 ms
    asyncio.run(admit(admission, max_tokens=200))
    # The host gets busy: 3 sequences now step in 95 ms, not 50. The seats count from there,
    # at the line's ~10 ms a sequence: 3 + (99 - 95) / 10 = 3, and 6 are taken.
    reg.report("d", Load(running_seqs=3, decode_step_ms=95.0, **ROOM))
    assert admission.seats(d, admission.step_limit(200)) == 3
    with pytest.raises(Overloaded, match="seats"):
        asyncio.run(admit(admission, max_tokens=200))
    off = Admission(reg, 0.05, AdmissionConfig(tpot_watermark=0), tpot_slo_s=0.1)
    p.send(100), p.send(100)
    asyncio.run(admit(off))  # no step limit, no seat rule


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
