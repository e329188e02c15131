"""How a benchmark reports: the host's description, percentiles as a report writes them (on
`services.common.stats.percentile`), progress lines on stderr and the report's end (the whole
report, then one JSON line of its summary)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from services.common.stats import percentile


def log(msg: str) -> None:
    """A progress line on stderr (stdout is the bench's report)."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    """The CPU's model name, from /proc/cpuinfo (else what `platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host(torch: bool = False) -> str:
    """This machine in one line: cores and CPU model, and torch's version when `torch` (read
    from the installed package: the bench process need not load torch)."""
    line = f"{os.cpu_count()} x {cpu_model()}"
    return f"{line}, torch {metadata.version('torch')}" if torch else line


def percentiles(
    values, qs=(50, 90, 99), scale: float = 1.0, ndigits: int = 3
) -> dict[str, float | None]:
    """{"p50": ..., ...} of the finite values, times `scale`, rounded to `ndigits` decimals
    (None for none)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    return {f"p{q}": round(percentile(v, q) * scale, ndigits) if len(v) else None for q in qs}


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
