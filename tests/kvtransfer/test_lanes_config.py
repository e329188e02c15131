"""How many UCX lanes a decode instance pulls over: --kv-lanes, or two where it has the cores."""

from __future__ import annotations

import pytest

from services.decode.__main__ import parse
from services.kvtransfer import puller as puller_module
from services.kvtransfer.puller import KvPuller, PullPolicy


def test_kv_lanes_is_a_decode_option():
    config, _ = parse(["--kv-lanes", "1"])
    assert config.pull.lanes == 1
    assert parse([])[0].pull.lanes == 0  # automatic
    with pytest.raises(ValueError, match="KV lanes"):
        parse(["--kv-lanes", "-1"])


@pytest.mark.parametrize(("cores", "asked", "lanes"), [(1, 0, 1), (2, 0, 2), (8, 0, 2), (1, 3, 3)])
def test_automatic_lanes_follow_the_cores_this_process_may_use(monkeypatch, cores, asked, lanes):
    """A process pinned to one core pulls over one lane: a lane's thread could only take turns
    with the event loop there."""
    monkeypatch.setattr(puller_module.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert KvPuller(PullPolicy(lanes=asked), "ucx")._ucx.lanes == lanes
