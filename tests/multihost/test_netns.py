"""The mesh across three hosts on one machine: network namespaces joined by veth pairs.

How: `netns.Topology` makes three namespaces (names carry this process's pid, subnets are
picked free, so parallel runs and leftovers never clash). A bridge in the root namespace joins
their `eth0`s on a front network 10.231.N.0/24 (the test reaches the gateway that way); a veth
pair `kv0` joins only prefill and decode (10.232.N.0/24). The gateway, one prefill and one decode
instance run with `ip netns exec` (the launcher's per-process command prefix), each serving on
its namespace's address: the prefill instance on its kv-link address, so its KV (UCX restricted
to tcp on kv0) and its control plane reach the decode instance over kv0 only. The prefill
instance answers every KV chunk CHUNK_DELAY_S late (`--kv-faults delay@N`), so a pull is in
flight long enough to cut `kv0` under it (`ip link set kv0 down` in the decode namespace).

What it proves: greedy tokens through the gateway across hosts equal the in-process engine's,
and the KV moved over UCX across the kv link (decode counters, /metrics, the `kv.handoff` span's
`kv.transport`, the TCP connection on kv0); a kv link cut mid-pull and restored ends in a retry
(or re-prefill) that gives the same tokens; a cut that stays ends in UNAVAILABLE within the
bound the pull settings and the gateway's handoff attempts imply, never a hang; afterwards no KV
is held anywhere and the mesh serves again. Skipped only without root or `ip netns`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest

from services.gateway.retries import RetryPolicy
from services.kvtransfer.puller import PullPolicy
from services.kvtransfer.transports import DRAIN_S
from tests.conftest import MESH_WORKER_ARGS
from tests.multihost import netns
from tests.test_mesh import expected, generate, kv_all_free, stats, wait_until

PROMPTS = [
    "Hello",
    "The decode phase adds one token at a time",
    "A longer prompt: " + "prefill reads the whole prompt at once and writes the cache; " * 6,
]
MAX_TOKENS = 12
CHUNK_DELAY_S = 0.6  # every KV chunk is answered this late by the prefill instance
CHUNK_TIMEOUT_S = 1.5  # one try at one chunk (decode)
CHUNK_ATTEMPTS = 3  # tries per chunk (decode)
BACKOFF_S = PullPolicy().backoff_s  # the first retry waits up to 1.5x this, doubling
HANDOFFS = RetryPolicy().per_kind + 1  # the gateway hands a request off this often at most
# The longest a request whose KV can never be pulled may take: per handoff, every attempt at a
# chunk times out (and drains), the backoffs at their longest, and a slack for the prefill and
# the routing of each handoff on a busy machine (a failed pull's release of the KV at its source
# goes on in the background: it does not hold up the answer).
PULL_GIVES_UP_S = CHUNK_ATTEMPTS * (CHUNK_TIMEOUT_S + DRAIN_S) + sum(
    1.5 * BACKOFF_S * 2**i for i in range(CHUNK_ATTEMPTS - 1)
)
FAILURE_BOUND_S = HANDOFFS * (PULL_GIVES_UP_S + 3.0)


@pytest.fixture(scope="module")
def topology():
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    topo = netns.Topology().create()
    yield topo
    topo.close()
    left = topo.leftovers()
    assert not left, f"left behind: {left}"


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    return tmp_path_factory.mktemp("netns-traces") / "spans.jsonl"


@pytest.fixture(scope="module")
def mesh(topology, tiny_model, trace_file):
    from distserve.local_mesh import Mesh, MeshSpec

    delays = ",".join(f"delay@{i}:{CHUNK_DELAY_S}" for i in range(1, 401))
    ucx = {"UCX_NET_DEVICES": "kv0"}  # UCX's tcp lanes on the kv link, not the front network
    spec = MeshSpec(
        model=tiny_model,
        host=topology.front["gateway"],
        gateway_port=0,
        worker_args=(*MESH_WORKER_ARGS, "--ucx-tls", "tcp"),
        per_worker_args={
            "prefill-0": ("--host", topology.kv["prefill"], "--kv-faults", delays),
            "decode-0": (
                "--host",
                topology.front["decode"],
                "--kv-transport",
                "ucx",
                "--chunk-timeout-s",
                str(CHUNK_TIMEOUT_S),
                "--chunk-attempts",
                str(CHUNK_ATTEMPTS),
            ),
        },
        command_prefix={
            "etcd": topology.exec_prefix("gateway"),  # beside the gateway, on its address
            "gateway": topology.exec_prefix("gateway"),
            "prefill-0": topology.exec_prefix("prefill", **ucx),
            "decode-0": topology.exec_prefix("decode", **ucx),
        },
        env={"DISTSERVE_TRACE_FILE": str(trace_file), "OTEL_BSP_SCHEDULE_DELAY": "50"},
        ready_timeout_s=120,
    )
    running = Mesh(spec)
    try:
        running.start()  # stops what it started if it fails
        yield running
    finally:
        topology.restore_kv_link()
        running.stop()


def worker(mesh, name):
    return next(p for p in mesh.workers if p.name == name)


def decode_stats(mesh):
    return stats(worker(mesh, "decode-0").ready["address"], "decode")


def spans(trace_file, name):
    if not trace_file.exists():
        return []
    lines = trace_file.read_text().splitlines()
    return [s for s in map(json.loads, filter(None, lines)) if s["name"] == name]


def in_background(prompt, gateway, max_tokens=MAX_TOKENS):
    """A request through the gateway on another thread: (token ids, error code or None)."""

    def run():
        try:
            ids, _, _ = asyncio.run(generate(gateway, prompt, max_tokens))
            return ids, None
        except grpc.aio.AioRpcError as e:
            return e.details(), e.code()

    future: concurrent.futures.Future = concurrent.futures.Future()
    threading.Thread(target=lambda: future.set_result(run()), daemon=True).start()
    return future


def cut_mid_pull(mesh, topology, before):
    """Cut kv0 once the decode instance is pulling (the prefill instance answers each chunk
    CHUNK_DELAY_S late, so chunks are in flight); returns when it was cut."""
    wait_until(lambda: decode_stats(mesh).load.pending_pulls == 1, 20, "a pull to start")
    # A pull that starts here waits at least CHUNK_DELAY_S for its chunks.
    assert decode_stats(mesh).pulls_total == before.pulls_total, "the pull ended before the cut"
    topology.cut_kv_link()
    return time.monotonic()


def settle(mesh, tiny_model):
    """With the link back: nothing held anywhere, and the mesh serves the next request."""
    wait_until(lambda: kv_all_free(mesh), 15, "KV blocks and handles to be freed everywhere")
    ids, error = in_background(PROMPTS[1], mesh.gateway_address).result(timeout=60)
    assert error is None, ids
    assert ids == expected(tiny_model, [PROMPTS[1]], MAX_TOKENS)[0][0]


def test_greedy_tokens_across_hosts_equal_the_engine_and_kv_moves_over_ucx(
    mesh, topology, tiny_model, trace_file
):
    before = decode_stats(mesh)

    async def run_all():
        return await asyncio.gather(
            *(generate(mesh.gateway_address, q, MAX_TOKENS) for q in PROMPTS)
        )

    results = asyncio.run(asyncio.wait_for(run_all(), 60))
    want = expected(tiny_model, PROMPTS, MAX_TOKENS)
    assert [(ids, text) for ids, text, _ in results] == want

    after = decode_stats(mesh)
    assert after.pulls_total - before.pulls_total == len(PROMPTS)
    assert after.pulls_failed == before.pulls_failed
    assert after.pull_bytes_total > before.pull_bytes_total
    assert stats(worker(mesh, "prefill-0").ready["address"], "prefill").requests_total >= 3
    # The decode instance's /metrics say the same.
    metrics_url = f"http://{worker(mesh, 'decode-0').ready['metrics_address']}/metrics"
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    pulls = re.search(r"^distserve_kv_pulls_total\{[^}]*\} (\S+)$", text, re.M)
    assert pulls and float(pulls.group(1)) == after.pulls_total
    # Each pull was over UCX, from the prefill instance in the other namespace.
    prefill_id = worker(mesh, "prefill-0").ready["worker_id"]
    wait_until(lambda: len(spans(trace_file, "kv.handoff")) >= len(PROMPTS), 10, "kv.handoff spans")
    handoffs = [s["attributes"] for s in spans(trace_file, "kv.handoff")]
    assert [(h["kv.transport"], h["kv.source"]) for h in handoffs] == [("ucx", prefill_id)] * len(
        PROMPTS
    )
    # ... over TCP from the decode host's kv0 address to the prefill host's UCX listener (UCX's
    # own connections; the gRPC control connection to the same host is left out).
    control_port = worker(mesh, "prefill-0").ready["address"].rsplit(":", 1)[1]
    ss = subprocess.run(
        [*topology.exec_prefix("decode"), "ss", "-Htn", "state", "established"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    ucx_peers = [
        line.split()[-1]
        for line in ss.splitlines()
        if line.split()[-2].startswith(f"{topology.kv['decode']}:")
        and line.split()[-1].startswith(f"{topology.kv['prefill']}:")
        and not line.split()[-1].endswith(f":{control_port}")
    ]
    listener = f"{topology.kv['prefill']}:{worker(mesh, 'prefill-0').ready['ucx_port']}"
    assert listener in ucx_peers, f"no UCX connection to {listener} over kv0 in:\n{ss}"
    wait_until(lambda: kv_all_free(mesh), what="KV blocks to be freed everywhere")


def test_a_kv_link_cut_mid_pull_and_restored_ends_in_a_retry_that_succeeds(
    mesh, topology, tiny_model
):
    before = decode_stats(mesh)
    started = time.monotonic()
    request = in_background(PROMPTS[2], mesh.gateway_address)
    try:
        cut = cut_mid_pull(mesh, topology, before)
        # Down until a chunk, lost with the link, timed out and is being fetched again.
        wait_until(
            lambda: decode_stats(mesh).chunks_retried > before.chunks_retried,
            CHUNK_TIMEOUT_S + 5,
            "a chunk retry",
        )
    finally:
        topology.restore_kv_link()
    down_s = time.monotonic() - cut
    ids, error = request.result(timeout=FAILURE_BOUND_S)
    elapsed = time.monotonic() - started
    after = decode_stats(mesh)
    path = "retry" if after.pulls_failed == before.pulls_failed else "re-prefill"
    print(
        f"\nrestored: link down {down_s:.2f} s, request {elapsed:.2f} s, ended by {path}; "
        f"chunks retried {after.chunks_retried - before.chunks_retried}, reconnects "
        f"{after.reconnects - before.reconnects}, pulls failed "
        f"{after.pulls_failed - before.pulls_failed}"
    )
    assert error is None, f"{error}: {ids}"
    assert ids == expected(tiny_model, [PROMPTS[2]], MAX_TOKENS)[0][0]
    assert after.pulls_total > before.pulls_total
    # The endpoint that timed out was dropped and made anew once the link was back.
    assert after.reconnects > before.reconnects
    settle(mesh, tiny_model)


def test_a_kv_link_cut_mid_pull_for_good_ends_in_unavailable_not_a_hang(mesh, topology, tiny_model):
    before = decode_stats(mesh)
    prefill_before = stats(worker(mesh, "prefill-0").ready["address"], "prefill")
    request = in_background(PROMPTS[2], mesh.gateway_address)
    try:
        cut = cut_mid_pull(mesh, topology, before)
        try:
            details, code = request.result(timeout=FAILURE_BOUND_S)
        except concurrent.futures.TimeoutError:
            pytest.fail(f"the request hung: no answer {FAILURE_BOUND_S:.0f} s after the cut")
        elapsed = time.monotonic() - cut
        assert topology.kv_link_up() is False  # it stayed cut for the whole request
    finally:
        topology.restore_kv_link()
    after = decode_stats(mesh)
    print(
        f"\nnot restored: {code} {elapsed:.2f} s after the cut (bound {FAILURE_BOUND_S:.0f} s); "
        f"pulls failed {after.pulls_failed - before.pulls_failed}, chunks retried "
        f"{after.chunks_retried - before.chunks_retried}: {details}"
    )
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert "could not hand request" in details and "KV pull" in details
    assert after.pulls_failed - before.pulls_failed == HANDOFFS
    assert after.pulls_total == before.pulls_total
    settle(mesh, tiny_model)
    # Every handle was released, none left to its lease.
    prefill = stats(worker(mesh, "prefill-0").ready["address"], "prefill")
    assert prefill.leases_expired == prefill_before.leases_expired
    assert prefill.handles_released - prefill_before.handles_released >= HANDOFFS
