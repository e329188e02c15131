"""What benchmarks share: the host's description and percentiles."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np


def host() -> str:
    """This machine in one line: cores and CPU model."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} x {cpu}"


def percentiles(values, qs=(50, 90, 99), scale: float = 1.0) -> dict[str, float | None]:
    """{"p50": ..., ...} of the finite values, times `scale`, rounded to 3 decimals (None for
    none)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    return {f"p{q}": round(float(np.percentile(v, q)) * scale, 3) if len(v) else None for q in qs}
