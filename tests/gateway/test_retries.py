"""One retry budget per request, whatever failed (gateway/retries.py)."""

import pytest

from services.gateway.retries import Failover, RetryPolicy


def test_every_kind_draws_on_one_budget():
    counted: list[Failover] = []
    retries = RetryPolicy(budget=4, per_kind=2).start(counted.append)
    assert retries.allow(Failover.PREFILL_UNAVAILABLE, "prefill p0 down")
    assert retries.allow(Failover.PREFILL_UNAVAILABLE, "prefill p1 down")
    assert not retries.allow(Failover.PREFILL_UNAVAILABLE, "prefill p2 down")  # its kind's limit
    assert retries.allow(Failover.KV_HANDOFF, "source died")
    assert retries.allow(Failover.DECODE_UNAVAILABLE, "decode d0 lost")
    # four retries granted: the budget is spent for every kind, even one never used up
    assert not retries.allow(Failover.DECODE_UNAVAILABLE, "decode d1 lost")
    assert not retries.allow(Failover.KV_HANDOFF, "chunk ran out of retries")
    assert retries.used == 4
    assert counted == [
        Failover.PREFILL_UNAVAILABLE,
        Failover.PREFILL_UNAVAILABLE,
        Failover.KV_HANDOFF,
        Failover.DECODE_UNAVAILABLE,
    ]
    assert retries.failures[0] == "prefill p0 down" and len(retries.failures) == 7


def test_nested_failures_never_prefill_more_than_the_budget_allows():
    """The three loops of the old router multiplied (3 x 3 x 3 = 27 prefills for one request):
    a request failing at every step now stops after budget + 1 tries."""
    policy = RetryPolicy(budget=4, per_kind=4)
    retries = policy.start()
    tries = 1
    kinds = [Failover.DECODE_UNAVAILABLE, Failover.KV_HANDOFF, Failover.PREFILL_UNAVAILABLE]
    while retries.allow(kinds[tries % 3], f"try {tries} failed"):
        tries += 1
    assert tries == policy.budget + 1


def test_a_budget_of_zero_never_retries():
    retries = RetryPolicy(budget=0).start()
    assert not retries.allow(Failover.KV_HANDOFF, "x")
    assert retries.count(Failover.KV_HANDOFF) == 0


def test_negative_limits_are_refused():
    with pytest.raises(ValueError, match="retry limits"):
        RetryPolicy(budget=-1)
