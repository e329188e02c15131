"""Work the gateway sent a worker between its heartbeats: counted while the call is open, gone
when it ends or when a heartbeat's load shows it. Finished calls never count, so a client that
sends short requests one after another is never held back or refused on an idle mesh."""

from __future__ import annotations

import asyncio

from services.gateway.admission import Admission, AdmissionConfig
from services.gateway.registry import Load, Registry


def test_a_call_counts_until_it_ends_or_a_heartbeat_shows_it():
    r = Registry(lease_s=60)
    r.register("d", "decode", "d:1", Load(total_kv_blocks=100, free_kv_blocks=100))
    [w] = r.live("decode")
    first, second = w.send(40), w.send(2)
    assert (w.inflight_requests, w.inflight_tokens) == (2, 42)
    w.settle(first)
    w.settle(first)  # idempotent
    assert (w.inflight_requests, w.inflight_tokens) == (1, 2)
    r.heartbeat("d", Load(running_seqs=1, total_kv_blocks=100, free_kv_blocks=99))
    assert w.inflight_requests == 0  # the reported load shows the open call now
    w.settle(second)  # its end after the heartbeat changes nothing
    assert w.inflight_requests == 0


def test_finished_requests_between_heartbeats_never_saturate_decode_or_queue_prefill():
    """Many more short requests than the pull watermark, one after another, between two
    heartbeats: none is refused, none waits, and the prefill queue ahead stays empty."""
    r = Registry(lease_s=60)
    r.register("p", "prefill", "p:1", Load())
    r.register("d", "decode", "d:1", Load(total_kv_blocks=100, free_kv_blocks=100))
    config = AdmissionConfig(pull_watermark=4)
    admission = Admission(r, ttft_slo_s=1.0, config=config)
    for tokens in range(100, 1100, 100):  # a cost line, so the TTFT rule is live
        admission.observe_prefill(5.0 + 0.1 * tokens, tokens)
    [p], [d] = r.live("prefill"), r.live("decode")

    async def one_request() -> None:
        async with admission.admit(16):
            ticket = p.send(16)
            p.settle(ticket)  # prefill done
            ticket = d.send()
            d.settle(ticket)  # decode done

    async def sequential() -> None:
        for _ in range(10 * config.pull_watermark):
            await asyncio.wait_for(one_request(), 0.05)  # never waits for a watermark

    asyncio.run(sequential())
    assert admission.predicted_ttft_ms(16)[1] == 0  # nothing queued ahead
