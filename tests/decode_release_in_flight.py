"""A decode instance whose releases of pulled KV never reach the source: they stay in flight.

A stand-in for the few milliseconds between a real instance telling the gateway it has the KV
and its release reaching the prefill instance: a SIGKILL in that window leaves the source's
lease with nobody to release it, and a test cannot hit so short a window on purpose. Everything
else is the real decode service. Run as a command prefix (`MeshSpec.command_prefix`):

    python tests/decode_release_in_flight.py python -m services.decode [options]
"""

from __future__ import annotations

import asyncio
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.decode.pull import SourceReleases


async def _in_flight(self, handle, trace=None) -> None:
    await asyncio.Event().wait()  # sent, never answered: the process dies first


SourceReleases._release = _in_flight
_, dash_m, module, *args = sys.argv[1:]
assert dash_m == "-m", sys.argv
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__", alter_sys=True)
