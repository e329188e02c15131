"""The mesh's clock: real time, or emulated time that runs `scale` times slower than the wall.

An emulated mesh (`--engine emulated`, docs/engine.md) models a device's step times; run at
`--time-scale K`, an emulated second lasts K wall seconds, so that the mesh's own CPU work (Python,
gRPC, UCX) is small beside an emulated step (K < 1 runs faster than the wall: for models whose
steps are long beside that work). Every latency the mesh reports (metrics, traces,
TTFT and TPOT, `client --json`, benchmark JSON) is read from this clock, so it is in emulated
time; with scale 1 (the default, every real engine) it is the real clock.

Timeouts and leases stay on the real clock: they guard against lost processes and messages,
which the emulation does not slow down.

`setup` is called once at start by every process of an emulated mesh with the same scale and
epoch (the launcher passes both): emulated wall time is `epoch + (wall - epoch) / scale`, so the
spans of every process line up in one trace. Emulated monotonic time is `monotonic / scale`.
"""

from __future__ import annotations

import argparse
import asyncio
import time

_scale = 1.0
_epoch = 0.0  # unix seconds where emulated and real wall time meet


def setup(scale: float = 1.0, epoch_unix_s: float | None = None) -> None:
    """Run this process's clock `scale` times slower than the wall from `epoch_unix_s` (default:
    now). Call before anything reads it (telemetry takes its offset from it)."""
    global _scale, _epoch
    if not scale > 0:
        raise ValueError(f"time scale must be positive, got {scale}")
    _scale = float(scale)
    _epoch = time.time() if epoch_unix_s is None else float(epoch_unix_s)


def scale() -> float:
    """Wall seconds per emulated second (1.0: real time)."""
    return _scale


def monotonic() -> float:
    """Monotonic seconds on this clock: `time.monotonic()` when real."""
    return time.monotonic() / _scale


def time_s() -> float:
    """Unix seconds on this clock: `time.time()` when real."""
    now = time.time()
    return now if _scale == 1.0 else _epoch + (now - _epoch) / _scale


def time_ns() -> int:
    """`time_s()` in integer nanoseconds: `time.time_ns()` when real."""
    return time.time_ns() if _scale == 1.0 else round(time_s() * 1e9)


def wall_seconds(seconds: float) -> float:
    """How long `seconds` on this clock last on the wall."""
    return seconds * _scale


def sleep_until(monotonic_s: float) -> None:
    """Block this thread until `monotonic()` reaches `monotonic_s` (an emulated step's end)."""
    left = monotonic_s - monotonic()
    if left > 0:
        time.sleep(left * _scale)


async def sleep(seconds: float) -> None:
    """asyncio.sleep for `seconds` of this clock."""
    await asyncio.sleep(seconds * _scale)


def add_args(p: argparse.ArgumentParser) -> None:
    """`--time-scale` and `--time-epoch`, which every process of an emulated mesh takes."""
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="emulated engine: wall seconds per emulated second; every latency reported is in "
        "emulated time (default 1: real time)",
    )
    p.add_argument(
        "--time-epoch",
        type=float,
        help="unix time where emulated and real wall time meet, the same for every process of "
        "a mesh so that their spans line up (default: this process's start)",
    )


def setup_from_args(args: argparse.Namespace) -> None:
    setup(args.time_scale, args.time_epoch)
