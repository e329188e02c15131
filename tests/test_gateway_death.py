"""A gateway SIGKILLed under load drops nothing that can be saved (issue 49 item 4).

Two gateways behind a real Envoy, one prefill and one decode on the tiny model. While streams
run through Envoy on both gateways, one gateway is killed. Then:

* a stream the dead gateway had begun ends at once, not a hang, with the tokens it had sent
  exact: Envoy cannot splice a half-sent answer onto another gateway, and once the response
  headers are out it cannot send a gRPC status either, only reset the stream (RST_STREAM
  INTERNAL_ERROR, which gRPC clients report as INTERNAL "Received RST_STREAM"; no HTTP/2 reset
  code but REFUSED_STREAM, meaning "never processed", maps to UNAVAILABLE). docs/deployment.md
  says how a client tells this reset apart and retries;
* the streams on the surviving gateway finish with the engine's exact tokens;
* requests the dead gateway had accepted but not begun answering (held before their first token
  by a prefill instance stopped with SIGSTOP until the kill), and requests sent right after the
  kill, which Envoy still balances onto the dead gateway until its health check notices, are
  retried by Envoy on the survivor (nothing of their answer was sent), and the client sees a
  normal, exact answer;
* within a KV lease every block is free again on prefill and decode, and decode runs nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import grpc

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.edge.config import EdgeConfig
from tests.test_mesh import PROMPTS, addresses, expected, kv_all_free, stats, wait_until

LEASE_S = 5.0  # prefill's KV lease here: a leak must be gone within it
MAX_TOKENS = 600  # long enough that every stream is mid-answer when the gateway dies
FRESH_TOKENS = 24  # the requests sent after the kill


def _in_flight(process) -> float:
    samples = process.metrics()
    return sum(s.value for s in samples if s.name == "distserve_gateway_requests_in_flight")


def _envoy_counter(envoy, name: str) -> int:
    url = f"http://{envoy.admin_address}/stats?format=json&filter=^{name}$"
    with urllib.request.urlopen(url, timeout=5) as r:
        found = json.load(r)["stats"]
    return int(found[0]["value"]) if found else 0


def _pulled(mesh) -> bool:
    """No KV held on prefill and no pull in flight on decode."""
    held = [stats(a, "prefill").load.held_kv_handles for a in addresses(mesh, "prefill")]
    pulling = [stats(a, "decode").load.pending_pulls for a in addresses(mesh, "decode")]
    return not any(held) and not any(pulling)


async def _stream(stub, prompt: str, max_tokens: int, started: asyncio.Event | None = None):
    """(token ids, the status it ended with, its details, when it ended)."""
    params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids: list[int] = []
    try:
        call = stub.Generate(gateway_pb2.GenerateRequest(text=prompt, sampling=params))
        async for reply in call:
            ids += reply.token_ids
            if started is not None:
                started.set()
    except grpc.aio.AioRpcError as e:
        return ids, e.code(), e.details(), time.monotonic()
    return ids, grpc.StatusCode.OK, "", time.monotonic()


def test_a_gateways_death_drops_nothing_that_can_be_saved(mesh_factory, tiny_model):
    mesh = mesh_factory(
        prefill=1,
        decode=1,
        gateways=2,
        edge=EdgeConfig(port=0),
        prefill_args=("--lease-s", str(LEASE_S)),
    )
    victim = mesh.gateways[1]  # the second; the first survives
    prompts = PROMPTS * 2  # 8 concurrent streams: least-request spreads them over both gateways
    want = [ids for ids, _ in expected(tiny_model, prompts, MAX_TOKENS)]

    async def scenario():
        async with grpc.aio.insecure_channel(mesh.edge_address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            started = [asyncio.Event() for _ in prompts]
            running = [
                asyncio.create_task(_stream(stub, p, MAX_TOKENS, e))
                for p, e in zip(prompts, started, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            loads = await asyncio.to_thread(lambda: [_in_flight(g) for g in mesh.gateways])
            assert all(n > 0 for n in loads), f"both gateways must carry streams: {loads}"
            # Requests the victim has accepted but not begun answering: prefill is stopped (once
            # every stream's KV is pulled), so their first token, and with it the response
            # headers, cannot come. Sent one by one until the victim holds one (Envoy balances).
            await asyncio.to_thread(wait_until, lambda: _pulled(mesh), 30, "every KV pulled")
            prefill = next(p for p in mesh.workers if p.name.startswith("prefill"))
            os.kill(prefill.popen.pid, signal.SIGSTOP)
            try:
                waiting = []
                for p in PROMPTS * 4:
                    waiting.append(asyncio.create_task(_stream(stub, p, FRESH_TOKENS)))
                    await asyncio.sleep(0.2)
                    if await asyncio.to_thread(_in_flight, victim) > loads[1]:
                        break
                else:
                    raise AssertionError("no request waits on the victim")
                retries_before = _envoy_counter(
                    mesh.envoy, "cluster.gateway_grpc.upstream_rq_retry"
                )
                victim.popen.kill()
                killed = time.monotonic()
            finally:
                os.kill(prefill.popen.pid, signal.SIGCONT)
            # New requests at once: Envoy has not yet seen the victim's death.
            fresh = [asyncio.create_task(_stream(stub, p, FRESH_TOKENS)) for p in prompts]
            old = await asyncio.wait_for(asyncio.gather(*running), 120)
            new = await asyncio.wait_for(asyncio.gather(*waiting, *fresh), 120)
            return loads, retries_before, killed, old, new

    loads, retries_before, killed, old, new = asyncio.run(scenario())
    victim.popen.wait(5)

    broken = [(i, r) for i, r in enumerate(old) if r[1] != grpc.StatusCode.OK]
    finished = [(i, r) for i, r in enumerate(old) if r[1] == grpc.StatusCode.OK]
    # (b) every stream the victim carried was reset at once, having sent exact tokens.
    assert len(broken) == loads[1], (loads, [r[1:] for _, r in broken])
    for i, (ids, code, details, ended) in broken:
        assert (code, "RST_STREAM" in details) == (grpc.StatusCode.INTERNAL, True), details
        assert ended - killed < 2.0
        assert 0 < len(ids) < MAX_TOKENS and ids == want[i][: len(ids)]
    # (d) the survivor's streams are untouched: whole and exact.
    assert len(finished) == loads[0]
    for i, (ids, *_) in finished:
        assert ids == want[i]
    # (a) the requests waiting on the victim for their first token, and those sent after the
    # kill, all succeed, exact: Envoy retried on the survivor those the victim had.
    assert [r[1] for r in new] == [grpc.StatusCode.OK] * len(new), [r[1:] for r in new]
    short = [ids for ids, _ in expected(tiny_model, PROMPTS, FRESH_TOKENS)]
    assert [r[0] for r in new] == (short * 4)[: len(new) - len(prompts)] + short * 2
    retried = _envoy_counter(mesh.envoy, "cluster.gateway_grpc.upstream_rq_retry")
    assert retried > retries_before

    # (c) within a lease, no KV block is held for the dead gateway's requests, and decode runs
    # nothing for them.
    left = killed + LEASE_S + 5 - time.monotonic()
    wait_until(lambda: kv_all_free(mesh), timeout=max(left, 0.1), what="every KV block free")
    for address in addresses(mesh, "decode"):
        decode = stats(address, "decode")
        load = decode.load
        assert (load.running_seqs, load.waiting_seqs, load.pending_pulls) == (0, 0, 0)
        # Decode stopped the dead gateway's sequences (it did not run them to their end).
        assert decode.requests_aborted == len(broken), decode
