"""KV-aware routing: the gateway knows which prompt prefixes each worker caches (from the KV
events on its load feed, and from what it routed there itself) and routes by them and by load.
The feed over real gRPC and etcd, seen by two gateways: tests/gateway/test_membership.py."""

from __future__ import annotations

from services.common.gen.distserve.v1 import common_pb2
from services.common.prefix_hash import block_hashes, cache_salt
from services.gateway import prefix_index
from services.gateway.prefix_index import CachedBlocks, PromptBlocks
from services.gateway.registry import Load, Registry
from services.gateway.routing import Routing
from services.worker.prefix_log import PrefixCacheLog

SALT = cache_salt("model-a", "float32")
BS = 4
SYSTEM = list(range(100, 132))  # 8 blocks shared by every conversation
PROMPT = [*SYSTEM, 7, 8, 9, 10, 11, 12]  # + one more full block and 2 tokens


def _registry(*workers: tuple[str, str]) -> Registry:
    r = Registry(lease_s=60)
    for worker_id, role in workers:
        load = Load(kv_block_size=BS, free_kv_blocks=1000, total_kv_blocks=1000)
        r.register(worker_id, role, f"{worker_id}:1", load, CachedBlocks(SALT, BS))
    return r


def _holds(r: Registry, worker_id: str, tokens: list[int]) -> None:
    r.report(worker_id, r._workers[worker_id].load, (False, block_hashes(tokens, BS, SALT), ()))


def test_a_prompt_goes_where_its_prefix_is_cached_when_queues_are_equal():
    r = _registry(("p0", "prefill"), ("p1", "prefill"), ("p2", "prefill"))
    _holds(r, "p1", SYSTEM)
    prompt = PromptBlocks(PROMPT)
    chosen = Routing(r).pick_prefill(prompt=prompt)
    assert chosen.worker_id == "p1"
    assert prompt.cached_tokens(chosen.cache) == len(SYSTEM)
    # Without the prompt (or with a cache nobody holds), the least-queued one, as before.
    assert Routing(r).pick_prefill().worker_id == "p0"
    assert Routing(r).pick_prefill(prompt=PromptBlocks([1, 2, 3, 4, 5] * 8)).worker_id == "p0"


def test_a_cached_prefix_is_worth_only_the_tokens_it_saves_against_a_longer_queue():
    """Predicted time to the first token = queued tokens + the uncached part: an instance
    holding 32 of 38 tokens but with 40 queued loses to an idle one (38 < 40 + 6), and wins
    with 31 queued (31 + 6 < 38)."""
    r = _registry(("p0", "prefill"), ("p1", "prefill"))
    _holds(r, "p1", SYSTEM)
    p1 = r._workers["p1"]
    ticket = p1.send(40)
    assert Routing(r).pick_prefill(prompt=PromptBlocks(PROMPT)).worker_id == "p0"
    p1.settle(ticket)
    p1.send(31)
    assert Routing(r).pick_prefill(prompt=PromptBlocks(PROMPT)).worker_id == "p1"


def test_the_last_prompt_token_is_never_counted_cached():
    r = _registry(("p0", "prefill"))
    _holds(r, "p0", SYSTEM)
    assert PromptBlocks(SYSTEM).cached_tokens(r._workers["p0"].cache) == len(SYSTEM) - 1


def test_blocks_of_another_model_never_match():
    """A worker's blocks are named under its own salt (model, dtype, weights): the same tokens'
    blocks under another salt are other blocks."""
    r = _registry(("p0", "prefill"))
    other = CachedBlocks(cache_salt("model-b", "float32"), BS)
    other.apply(True, block_hashes(SYSTEM, BS, SALT), ())  # model-a's names
    r.register("p1", "prefill", "p1:1", Load(kv_block_size=BS), other)
    _holds(r, "p0", SYSTEM[:8])
    prompt = PromptBlocks(PROMPT)
    assert prompt.cached_tokens(r._workers["p1"].cache) == 0
    assert Routing(r).pick_prefill(prompt=prompt).worker_id == "p0"


def test_decode_prefers_the_instance_holding_the_conversation_within_a_few_requests():
    r = _registry(("d0", "decode"), ("d1", "decode"))
    _holds(r, "d1", PROMPT)
    d1 = r._workers["d1"]
    tickets = [d1.send() for _ in range(2)]  # 2 more open than d0: within the slack
    assert Routing(r).pick_decode(prompt=PromptBlocks(PROMPT)).worker_id == "d1"
    tickets.append(d1.send())  # 3 more: the load decides
    assert Routing(r).pick_decode(prompt=PromptBlocks(PROMPT)).worker_id == "d0"
    for t in tickets:
        d1.settle(t)
    # Nothing cached anywhere: exactly the least-loaded rule.
    r2 = _registry(("d0", "decode"), ("d1", "decode"))
    r2._workers["d0"].send()
    assert Routing(r2).pick_decode(prompt=PromptBlocks(PROMPT)).worker_id == "d1"


def test_a_routed_prompt_counts_as_cached_there_until_the_worker_says_otherwise():
    cache = CachedBlocks(SALT, BS)
    hashes = block_hashes(PROMPT, BS, SALT)
    cache.predict(hashes, now=100.0)
    assert cache.prefix_blocks(hashes, now=101.0) == len(hashes)
    assert cache.prefix_blocks(hashes, now=100.0 + prefix_index.PREDICTED_S + 1) == 0
    cache.apply(False, hashes[:3], ())  # confirmed: held for good
    assert cache.prefix_blocks(hashes, now=1e9) == 3
    cache.predict(hashes, now=200.0)
    cache.apply(False, (), hashes[1:2])  # evicted there: the prefix ends before it
    assert cache.prefix_blocks(hashes, now=201.0) == 1
    cache.apply(True, hashes[5:], ())  # a whole report replaces what was known
    assert cache.prefix_blocks(hashes, now=1e9) == 0


def test_the_worker_log_reports_changes_then_the_whole_set_after_an_overflow():
    log = PrefixCacheLog(SALT, max_events=4)
    log.record(False, [1, 2, 3], [])
    first = log.report()
    assert first.reset and set(first.stored) == {1, 2, 3}  # the first report is whole
    log.record(False, [4], [1])
    r = log.report()
    assert (r.reset, set(r.stored), set(r.removed)) == (False, {4}, {1})
    assert log.report() == common_pb2.PrefixCacheEvents()  # nothing new
    log.record(False, [5], [])
    whole = log.whole()  # a new subscriber: all held; the others still get the change
    assert whole.reset and set(whole.stored) == {2, 3, 4, 5}
    r = log.report()
    assert (r.reset, set(r.stored), set(r.removed)) == (False, {5}, set())
    log.record(False, [6, 7, 8], [2, 3])  # 5 changes > 4 kept: the next report is whole
    r = log.report()
    assert r.reset and set(r.stored) == {4, 5, 6, 7, 8}
    log.record(True, [9], [])  # the engine's own log overflowed: it sent all it holds
    r = log.report()
    assert r.reset and list(r.stored) == [9]


def test_load_and_round_robin_routing_ignore_the_cache_for_comparison():
    r = _registry(("p0", "prefill"), ("p1", "prefill"), ("p2", "prefill"))
    _holds(r, "p2", SYSTEM)
    assert Routing(r, "load").pick_prefill(PromptBlocks(PROMPT)).worker_id == "p0"
    turns = Routing(r, "round-robin")
    picks = [turns.pick_prefill(PromptBlocks(PROMPT)).worker_id for _ in range(4)]
    assert picks == ["p0", "p1", "p2", "p0"]


def test_routing_counts_cached_and_best_prefix_tokens_and_exports_them():
    from prometheus_client import CollectorRegistry, generate_latest

    from services.common.slo import Slo
    from services.gateway.metrics import GatewayMetrics

    r = _registry(("p0", "prefill"), ("p1", "prefill"))
    _holds(r, "p1", SYSTEM)
    metrics = GatewayMetrics(CollectorRegistry(), Slo())
    routing = Routing(r)
    metrics.watch(routing)
    routing.routed(None, r._workers["p0"], PromptBlocks(PROMPT))  # not the best choice: p1 has 32
    # What was routed to p0 counts as held there (its 9 full blocks), until p0's reports say
    # otherwise: the same prompt again goes to p0.
    prompt = PromptBlocks(PROMPT)
    chosen = routing.pick_prefill(prompt)
    assert chosen.worker_id == "p0"
    routing.routed(None, chosen, prompt)
    assert routing.prefix_tokens["prefill", "prompt"] == 2 * len(PROMPT)
    assert routing.prefix_tokens["prefill", "cached"] == 0 + 36
    assert routing.prefix_tokens["prefill", "best"] == 32 + 36
    text = generate_latest(metrics.registry).decode()
    assert 'distserve_gateway_prefix_tokens_total{kind="best",role="prefill"} 68.0' in text
