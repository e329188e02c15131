"""What benchmarks share: the host's description and percentiles."""

from __future__ import annotations

import json
import os
import platform
import time
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


def report_and_exit_code(report: dict, summary: dict, out: Path | None, started: float) -> int:
    """Finish a bench's output: the engine-agnostic summary fields (hardware, wall time) into
    `summary`, the whole report to `out` (if given) and stdout, then the one JSON line."""
    summary.update(hardware=host(), wall_s=round(time.time() - started, 1))
    report["summary"] = summary
    if out:
        out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(json.dumps(summary))
    return 0
