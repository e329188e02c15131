"""Percentiles: the one definition every latency figure, report and calibration uses."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal


def percentile(
    values: Iterable[float], q: float, *, method: Literal["linear", "lower"] = "linear"
) -> float:
    """The `q`-th percentile (0 <= q <= 100) of `values`; NaN when there are none.

    `linear` interpolates between the two nearest ranks (numpy's default: every reported
    figure). `lower` is the nearest rank below, a value that was observed: the gateway's
    calibration, in pure Python, for the gateway process does not load numpy.
    """
    if method == "lower":
        ordered = sorted(values)
        return ordered[int(q / 100 * (len(ordered) - 1))] if ordered else math.nan
    import numpy as np  # here, not at the top: the gateway imports this module

    v = np.asarray(values if hasattr(values, "__len__") else list(values), dtype=float)
    return float(np.percentile(v, q)) if v.size else math.nan
