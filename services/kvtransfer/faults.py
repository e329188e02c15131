"""Fault injection for the data plane, off unless configured (tests and drills only).

A spec lists faults by the index of the chunk the server sends (1-based, counted per process):
`drop@3` never answers the 3rd chunk; `delay@2:1.5` answers the 2nd 1.5 s late; `corrupt@1`
flips a byte of the 1st chunk's data after its checksum; `close@4` closes the connection instead
of answering the 4th; `exit@2` kills the whole process instead of sending the 2nd (a crashed
source). Several faults are comma-separated: `corrupt@1,drop@3`. `strike` is what a fault does
to a chunk, for both transports (the UCX chunk server and the gRPC fallback).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from services.common.errors import InvalidRequest

KINDS = ("drop", "delay", "corrupt", "close", "exit")


@dataclass(frozen=True)
class Fault:
    kind: str
    at: int  # the chunk it hits, 1-based
    seconds: float = 0.0  # delay only


class FaultInjector:
    """Says which fault, if any, hits the next chunk served."""

    def __init__(self, spec: str) -> None:
        self.faults = parse(spec)
        self.served = 0

    def next_chunk(self) -> Fault | None:
        self.served += 1
        return next((f for f in self.faults if f.at == self.served), None)


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, rest = item.partition("@")
        at, _, seconds = rest.partition(":")
        if kind not in KINDS or not at.isdigit() or int(at) < 1:
            raise InvalidRequest(
                f"bad fault {item!r}: want KIND@N[:SECONDS] with KIND one of {', '.join(KINDS)}"
            )
        faults.append(Fault(kind, int(at), float(seconds) if seconds else 0.0))
    return faults


async def strike(
    fault: Fault,
    data: np.ndarray,
    *,
    close: Callable[[], Awaitable[None]],
    drop: Callable[[], Awaitable[None]],
) -> np.ndarray | None:
    """What a chunk about to be sent (its checksum taken) sends instead of `data` when `fault`
    hits it: `delay` the same bytes, late; `corrupt` a copy with a byte flipped; None for `close`
    and `drop`, after the transport's `close` (ends the connection instead of answering) or
    `drop` (the answer does not come in the puller's time); `exit` never returns."""
    if fault.kind == "exit":
        os._exit(17)  # a crashed source: no cleanup, no goodbye
    if fault.kind == "close":
        await close()
        return None
    if fault.kind == "drop":
        await drop()
        return None
    if fault.kind == "delay":
        await asyncio.sleep(fault.seconds)
    if fault.kind == "corrupt":
        return corrupted(data)  # the checksum sent is the original's
    return data


def corrupted(data: np.ndarray) -> np.ndarray:
    """A copy of the data with one byte flipped (the `corrupt` fault)."""
    out = np.array(data, copy=True)
    out[len(out) // 2] ^= 0xFF
    return out
