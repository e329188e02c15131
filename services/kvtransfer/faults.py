"""Fault injection for the data plane, off unless configured (tests and drills only).

A spec lists faults by the index of the chunk the server sends (1-based, counted per process):
`drop@3` never answers the 3rd chunk; `delay@2:1.5` answers the 2nd 1.5 s late; `corrupt@1`
flips a byte of the 1st chunk's data after its checksum; `close@4` closes the endpoint instead of
answering the 4th; `exit@2` kills the whole process when asked for the 2nd (a crashed source).
Several faults are comma-separated: `corrupt@1,drop@3`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
