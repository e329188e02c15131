"""A decode instance that died but is still leased in the gateway's registry costs a request one
handoff attempt, not the request: the next attempt goes to another decode instance."""

from __future__ import annotations

import asyncio
import os
import signal

from tests.conftest import start_mesh
from tests.test_mesh import PROMPTS, expected, generate


def test_requests_right_after_a_decode_instance_dies_complete_on_another(tiny_model):
    # A long lease: the dead instance stays registered for the whole test.
    mesh = start_mesh(tiny_model, prefill=1, decode=2, gateway_args=("--worker-lease-s", "60"))
    try:
        victim = next(w for w in mesh.workers if w.name == "decode-0")  # first on ties
        os.kill(victim.popen.pid, signal.SIGKILL)
        victim.popen.wait()

        async def one_by_one():
            return [await generate(mesh.gateway_address, q) for q in PROMPTS]

        results = asyncio.run(one_by_one())
        assert [(ids, text) for ids, text, _ in results] == expected(tiny_model, PROMPTS)
    finally:
        mesh.stop()
