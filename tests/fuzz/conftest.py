"""One mesh for the fuzz tests: 1 prefill + 1 decode on the tiny model, Envoy in front.

The gateway caps max_tokens at MAX_TOKENS so that a generated request that leaves it unset
(chat then fills the context) stays short: the fuzzers look for wrong answers, not long ones.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import hypothesis
import pytest
from hypothesis import HealthCheck

from services.edge.config import EdgeConfig
from tests.conftest import start_mesh, stop_now
from tests.test_mesh import addresses, generate, kv_all_free, stats, wait_until

MAX_TOKENS = 32
RESPONSE_TIME_S = 20.0  # the bound on every answer: a request that takes longer hangs
# Fixed (was: a decode instance died with SIGSEGV when requests ended at their first token while
# it pulled their KV over UCX): True would move the fuzz mesh's KV over the gRPC fallback.
UCX_FIRST_TOKEN_CRASH = False
# Short KV leases: KV a request leaked would be back (and counted as lapsed) within a test.
LEASE_S = 8.0


@pytest.fixture(scope="package")
def fuzz_mesh(tiny_model):
    mesh = start_mesh(
        tiny_model,
        prefill=1,
        decode=1,
        # The fuzzing is about input, not load: a long worker lease (a loaded host delays
        # heartbeats) and no admission rules (on a loaded host the decode steps of the short-
        # deadline test pass the TPOT watermark, and the gateway rightly sheds with a 429).
        gateway_args=(
            "--max-tokens",
            str(MAX_TOKENS),
            "--worker-lease-s",
            "30",
            "--admission-ttft-factor",
            "0",
        ),
        prefill_args=("--lease-s", str(LEASE_S)),
        decode_args=("--kv-transport", "grpc") if UCX_FIRST_TOKEN_CRASH else (),
        edge=EdgeConfig(port=0, access_log="", rate_limit_rps=0),  # fuzzing is no load test
    )
    try:
        yield mesh
    finally:
        stop_now(mesh)


@pytest.fixture(scope="module", autouse=True)
def lapsed_before(fuzz_mesh) -> int:
    """Leases lapsed on the mesh before this module's requests (once the KV an earlier module
    leaked, if any, has lapsed too)."""
    wait_until(lambda: kv_all_free(fuzz_mesh), timeout=LEASE_S + 10, what="every KV block free")
    return leases_expired(fuzz_mesh)


def leases_expired(mesh) -> int:
    """KV handles freed because nobody released them, over the mesh's prefill instances."""
    return sum(stats(a, "prefill").leases_expired for a in addresses(mesh, "prefill"))


def assert_still_serving_and_nothing_leaked(mesh, lapsed_before: int | None) -> None:
    """Every process is alive, both APIs answer a plain request on every port, every KV block
    on the workers is free again and, unless `lapsed_before` is None, all of it was released:
    no more leases lapsed than `lapsed_before` (leases_expired, taken before the fuzzing)."""
    for p in mesh.processes:
        assert p.popen.poll() is None, f"{p.name} exited with code {p.popen.returncode}"
    for address in filter(None, (mesh.gateway_http_address, mesh.edge_address)):
        body = json.dumps({"prompt": "still there?", "max_tokens": 4, "ignore_eos": True})
        req = urllib.request.Request(
            f"http://{address}/v1/completions",
            data=body.encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=RESPONSE_TIME_S) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4
    for address in filter(None, (mesh.gateway_address, mesh.edge_address)):
        ids, _, last = asyncio.run(generate(address, "still there?", max_tokens=4))
        assert len(ids) == 4 and last.usage.completion_tokens == 4
    wait = 10 if lapsed_before is not None else LEASE_S + 10
    wait_until(lambda: kv_all_free(mesh), timeout=wait, what="every KV block to be free")
    if lapsed_before is not None:
        lapsed = leases_expired(mesh) - lapsed_before
        assert lapsed == 0, (
            f"{lapsed} KV handles nobody released were held until their lease lapsed"
        )


def fuzz_settings(max_examples: int) -> hypothesis.settings:
    """Deterministic fuzzing: a fixed seed (set by each test), derandomized, no database."""
    return hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
        ],
    )
