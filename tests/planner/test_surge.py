"""The surge test (services/planner/surge.py) on its own config: a tenfold rise is a surge
within two seconds, at its own rate; the threshold is the evidence it waits for; a config that
asks for no rise or no evidence is refused; and it depends on nothing of the autoscaler's."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from services.common.errors import InvalidRequest
from services.planner.surge import SurgeConfig, arrival_rate

STEADY = list(np.arange(0.5, 60.0, 1.0))  # 1 req/s for a minute
BURST = [*STEADY, *(60.0 + np.arange(0.05, 5.0, 0.1))]  # then 10 req/s from 60 s


def at(arrivals: list[float], now: float, config: SurgeConfig):
    return arrival_rate([t for t in arrivals if t <= now], now, 0.0, 60.0, config)


def test_a_tenfold_rise_is_a_surge_within_two_seconds_at_its_own_rate():
    assert at(STEADY, 60.0, SurgeConfig()) == (1.0, None)
    assert at(BURST, 61.0, SurgeConfig())[1] is None  # 10 arrivals: not yet 11 nats
    rate, surge = at(BURST, 62.0, SurgeConfig())
    assert rate == pytest.approx(1.3) and surge.arrivals == 20
    assert surge.rate == pytest.approx(20 / 1.95)
    # more evidence asked for: none yet after 5 s of it
    assert at(BURST, 65.0, SurgeConfig(threshold=30.0))[1] is None


def test_a_surge_config_that_asks_for_no_rise_or_no_evidence_is_refused():
    with pytest.raises(InvalidRequest, match="surge factor is > 1"):
        SurgeConfig(factor=1.0)
    with pytest.raises(InvalidRequest, match="surge threshold is > 0"):
        SurgeConfig(threshold=0.0)


def test_the_surge_test_imports_nothing_of_the_autoscalers():
    source = Path(__file__).parents[2] / "services" / "planner" / "surge.py"
    imported = {
        node.module
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.ImportFrom)
    }
    assert not {m for m in imported if m and m.startswith("services.planner")}, imported
