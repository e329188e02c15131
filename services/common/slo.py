"""The service-level objective (SLO): the TTFT and TPOT a request is held to, both at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.errors import InvalidRequest

if TYPE_CHECKING:  # the gateway judges one request at a time and need not load numpy
    import numpy as np


@dataclass(frozen=True)
class Slo:
    """Latency objectives in seconds (a request meets the SLO when both hold), and the window
    over which a running service reports attainment (the gateway's; the planner, the simulator
    and the load generator judge a whole run and ignore it)."""

    ttft_s: float = 1.0
    tpot_s: float = 0.1
    window_s: float = 60.0

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`TTFT_MS,TPOT_MS`, e.g. `200,100`."""
        try:
            ttft, tpot = (float(x) / 1000 for x in text.split(","))
        except ValueError:
            raise InvalidRequest(f"slo {text!r}: expected TTFT_MS,TPOT_MS", param="slo") from None
        if ttft <= 0 or tpot <= 0:
            raise InvalidRequest("SLO latencies must be positive", param="slo")
        return cls(ttft, tpot)

    def met(self, ttft_s: float | np.ndarray, tpot_s: float | np.ndarray) -> bool | np.ndarray:
        """Whether a request with this TTFT and TPOT (seconds) met both objectives; element-wise
        over arrays (a NaN, a failed request's latency, misses)."""
        return (ttft_s <= self.ttft_s) & (tpot_s <= self.tpot_s)
