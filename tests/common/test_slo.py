"""The SLO: parsed from `TTFT_MS,TPOT_MS`, met only when both latencies are within it."""

import math

import numpy as np
import pytest

from services.common.errors import InvalidRequest
from services.common.slo import Slo


def test_parse_reads_milliseconds_and_refuses_what_is_not_two_positive_numbers():
    assert Slo.parse("200,100") == Slo(0.2, 0.1)
    for bad in ("200", "a,b", "0,100", "200,-1"):
        with pytest.raises(InvalidRequest):
            Slo.parse(bad)


def test_a_request_meets_the_slo_only_within_both_bounds_and_arrays_are_judged_per_request():
    slo = Slo(0.2, 0.05)
    assert slo.met(0.2, 0.05) and not slo.met(0.21, 0.01) and not slo.met(0.1, 0.06)
    ttft = np.array([0.1, 0.3, math.nan, 0.2])
    tpot = np.array([0.05, 0.01, 0.01, 0.06])
    assert slo.met(ttft, tpot).tolist() == [True, False, False, False]
