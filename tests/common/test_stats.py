"""Percentiles: linear interpolation (numpy's) for figures, the observed value below for the
gateway's calibration, NaN for no values."""

import math
import sys

import numpy as np

from services.common.stats import percentile


def test_linear_is_numpys_default_and_takes_any_iterable():
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == float(np.percentile(values, q))
    assert percentile((x for x in values), 50) == 3.5


def test_lower_is_an_observed_value_at_or_below_the_rank():
    values = list(range(20))[::-1]
    assert percentile(values, 95, method="lower") == 18  # int(0.95 * 19) = 18
    assert percentile([7.0], 95, method="lower") == 7.0


def test_no_values_have_no_percentile():
    assert math.isnan(percentile([], 50)) and math.isnan(percentile([], 50, method="lower"))


def test_the_lower_percentile_does_not_load_numpy():
    import subprocess

    code = (
        "import sys; from services.common.stats import percentile; "
        "percentile([1.0, 2.0], 95, method='lower'); print('numpy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
