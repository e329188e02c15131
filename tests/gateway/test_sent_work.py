"""Work the gateway sent a worker: counted from the moment it is sent, as queued prompt tokens
until the worker answers and as an open request until the call ends. A heartbeat's load is a
snapshot the worker took a moment ago, so it cannot hide calls the gateway knows are open; it
counts when it shows more (other gateways' calls). Finished calls never count, so a client that
sends short requests one after another is never held back or refused on an idle mesh."""

from __future__ import annotations

import asyncio

from services.gateway.admission import Admission, AdmissionConfig
from services.gateway.registry import Load, Registry
from services.gateway.routing import Routing


def test_a_call_counts_until_it_is_answered_and_ends_whatever_heartbeats_say():
    r = Registry(lease_s=60)
    r.register("p", "prefill", "p:1", Load())
    [w] = r.live("prefill")
    first, second = w.send(40), w.send(2)
    assert (w.queued_tokens, w.waiting_requests, w.open_requests) == (42, 2, 2)
    r.report("p", Load())  # taken before the calls reached the worker's engine
    assert (w.queued_tokens, w.waiting_requests, w.open_requests) == (42, 2, 2)
    r.report("p", Load(queued_prompt_tokens=500, pending_pulls=3, running_seqs=4))
    assert (w.queued_tokens, w.waiting_requests, w.open_requests) == (500, 3, 7)
    r.report("p", Load())
    w.answered(first)  # its first token came: prefilled, no longer waiting, still open
    assert (w.queued_tokens, w.waiting_requests, w.open_requests) == (2, 1, 2)
    w.settle(first)
    w.settle(first)  # idempotent
    w.answered(first)  # a no-op once it ended
    assert (w.queued_tokens, w.waiting_requests, w.open_requests) == (2, 1, 1)
    w.settle(second)
    assert (w.queued_tokens, w.waiting_requests, w.open_requests) == (0, 0, 0)


def test_a_heartbeat_counts_other_gateways_work_but_not_calls_ended_since():
    """The heartbeat's snapshot still shows this gateway's call that ended since: that call is
    not counted on (the next request would avoid an instance that just freed up), while what
    the snapshot shows beyond this gateway's own calls (another gateway's) is."""
    r = Registry(lease_s=60)
    r.register("a", "colocated", "a:1", Load())
    r.register("b", "colocated", "b:1", Load())
    a, b = r.live("colocated")
    ours = [a.send(10) for _ in range(3)]
    r.report("a", Load(running_seqs=3))  # our 3 calls
    r.report("b", Load(running_seqs=2))  # 2 calls of another gateway
    assert (a.open_requests, b.open_requests) == (3, 2)
    for ticket in ours[:2]:
        a.settle(ticket)  # ended; a's next heartbeat has not come yet
    assert (a.open_requests, b.open_requests) == (1, 2)
    assert Routing(r).pick_decode(role="colocated") is a
    b.send(5)
    assert b.open_requests == 3 and b.queued_tokens == 5


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


def test_instances_tied_on_open_requests_are_told_apart_by_kv_their_requests_may_grow_to():
    """Two instances with one request each: the one whose request may hold less KV (a shorter
    prompt + max_tokens) is chosen, whatever a heartbeat's snapshot of free blocks says (a
    snapshot of a moment ago made two runs of one workload route differently). A request not
    yet answered holds nothing yet; capacity is the worker's own."""
    r = Registry(lease_s=60)
    for name in ("a", "b"):
        r.register(name, "colocated", f"{name}:1", Load(total_kv_blocks=100, free_kv_blocks=100))
    a, b = r.live("colocated")
    a.answered(a.send(512, kv_tokens=512 + 64))
    b.answered(b.send(128, kv_tokens=128 + 64))
    assert (a.kv_headroom_tokens, b.kv_headroom_tokens) == (1600 - 576, 1600 - 192)
    r.report("b", Load(total_kv_blocks=100, free_kv_blocks=10))  # stale: b looked fuller
    assert Routing(r).pick_decode(role="colocated") is b
    waiting = a.send(16, kv_tokens=4096)  # not answered: its prompt is not in place yet
    assert a.kv_headroom_tokens == 1600 - 576 and a.open_requests == 2
    a.settle(waiting)
    r.report("a", Load(total_kv_blocks=1000, free_kv_blocks=1000))  # a larger instance
    assert Routing(r).pick_decode(role="colocated") is a
