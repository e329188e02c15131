"""Fuzzing the internal RPCs (every method of Prefill, Decode, KvTransfer, Planner, Actuator,
WorkerLoadFeed and WorkerRegistry) against the real processes of the fuzz mesh (conftest.py:
1 prefill + 1 decode over UCX, the gateway, etcd), a planner process started here and the
launcher's Actuator service served here as `distserve up` serves it, with hypothesis (a fixed
seed, derandomized, no example database). Mesh mTLS is off so that the fuzzer reaches every
port; one test starts a prefill worker with it on and shows a client without a certificate
refused at the TLS handshake.

What is sent: valid requests with up to three fields given hostile values (ids past the
vocabulary, huge counts, offsets and lengths, negative, NaN and infinite numbers, empty and
over-long strings, unknown enum values), messages of hostile fields only, raw random bytes and
mutated valid messages (through a generic call that passes bytes as they are), messages over
the servers' receive limit; to KvTransfer, each method with the right, a wrong, a truncated,
an altered, an empty, another request's and a released handle's token; Abandon of another
request's id.

Judged: no process dies; every answer is a documented status (INVALID_ARGUMENT, NOT_FOUND,
PERMISSION_DENIED, FAILED_PRECONDITION, RESOURCE_EXHAUSTED; UNAVAILABLE for a Decode whose KV
source cannot be reached), never INTERNAL or UNKNOWN and never a hang (every call has a client
deadline); no KV leaves a source without its handle's token (FetchChunk's data, and the
source's own count of bytes served, over UCX too); a released handle's token never works again;
afterwards every worker's KV blocks are free and no lease lapsed (all of it was released). The
last test prints the counts as `internal_fuzz {json}`.
"""

from __future__ import annotations

import secrets
import ssl
import sys

import grpc
import hypothesis
import pytest
from hypothesis import strategies as st

from distserve.local_actuator import LocalActuator
from distserve.local_actuator import serve as serve_actuator
from services.common import mesh_tls
from services.common.gen.distserve.v1 import (
    common_pb2,
    decode_pb2,
    kvtransfer_pb2,
    planner_pb2,
    prefill_pb2,
)
from services.common.server import MAX_MESSAGE_BYTES
from tests.certs import mesh_pki
from tests.fuzz import internal
from tests.fuzz.conftest import LEASE_S, fuzz_settings, leases_expired
from tests.fuzz.internal import Tally, call, mutated, raw_bytes
from tests.fuzz.internal_mesh import (
    FUZZED,
    KV_METHODS,
    METHODS,
    OK,
    PRECISE,
    TOKENS,
    WORKERS,
    Handles,
    Mesh,
    channel_for,
    judge,
    kv_request,
    ready_line,
    refused_at,
    request_id,
    sampling,
    spawn,
    target_for,
    token_of,
    valid_request,
    would_act,
)
from tests.test_mesh import addresses, kv_all_free, stats, wait_until

SEED = 20240612
MAX_EXAMPLES = 40


def _settings(max_examples: int) -> hypothesis.settings:
    """conftest's (a fixed seed, derandomized), without shrinking: a failing call may cost
    its whole deadline, and the failing message is printed as it was sent."""
    return hypothesis.settings(
        fuzz_settings(max_examples),
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        report_multiple_bugs=False,
    )


@pytest.fixture(scope="module")
def tally() -> Tally:
    return Tally()


@pytest.fixture(scope="module")
def actuator(fuzz_mesh):
    """The launcher's Actuator service on the fuzz mesh, served as `distserve up` serves it."""
    server, address = serve_actuator(LocalActuator(fuzz_mesh))
    yield address
    server.stop(0)


@pytest.fixture(scope="module")
def planner(fuzz_mesh, actuator):
    """A planner process: splits 2 workers, and decides (advises only) within a budget of 2."""
    args = ["--workers", "2", "--budget", "2", "--actuator", actuator, "--advise"]
    args += ["--model-spec", "opt-13b", "--slo", "1000,100", "--decide-every-s", "5"]
    proc = spawn([sys.executable, "-m", "services.planner", "--port", "0", *args])
    yield proc, ready_line(proc)["address"]
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def tls_prefill(fuzz_mesh, tmp_path_factory):
    """A prefill worker with the mesh's mutual TLS, and its (cert, key, CA): started with the
    module, not waited for (its start overlaps the fuzzing)."""
    pki = mesh_pki(tmp_path_factory.mktemp("pki"), "mesh")
    env = dict(
        zip((mesh_tls.ENV_CERT, mesh_tls.ENV_KEY, mesh_tls.ENV_CA), map(str, pki), strict=True)
    )
    argv = [sys.executable, "-m", "services.prefill", "--model", str(fuzz_mesh.spec.model)]
    argv += ["--no-ucx", "--worker-id", "prefill-tls", "--kv-cache-gib", "0.015625"]
    proc = spawn(argv, env)
    yield proc, pki
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def mesh(fuzz_mesh, planner, tls_prefill):
    """Where each service is served, and a channel to each."""
    prefill, decode = addresses(fuzz_mesh, "prefill")[0], addresses(fuzz_mesh, "decode")[0]
    where = {
        "Prefill": prefill,
        "KvTransfer": prefill,
        "Decode": decode,
        "Planner": planner[1],
        "WorkerRegistry": fuzz_mesh.gateway_address,
    }
    channels = {
        a: grpc.insecure_channel(a, options=[("grpc.max_send_message_length", -1)])
        for a in {*where.values(), *_feeds(fuzz_mesh)}
    }
    yield Mesh(fuzz_mesh, where, channels, prefill, decode)
    for c in channels.values():
        c.close()


def _feeds(fuzz_mesh) -> list[str]:
    return [*addresses(fuzz_mesh, "prefill"), *addresses(fuzz_mesh, "decode")]


def test_hostile_messages_to_every_method_get_a_precise_status(mesh, tally):
    handles = Handles(mesh, tally)

    @hypothesis.seed(SEED)
    @_settings(MAX_EXAMPLES * 2)
    @hypothesis.given(key=st.sampled_from(FUZZED), data=st.data())
    def fuzz(key, data):
        method, channel = channel_for(mesh, key)
        live = key == "Decode.Decode" and data.draw(st.booleans(), "live handle")
        base = valid_request(key.partition("@")[0], handles, live)
        how = data.draw(st.sampled_from(["mutated", "hostile"]), "how")
        if method.client_streaming:
            one = base[0]
            req = data.draw(
                st.lists(
                    mutated(one) if how == "mutated" else internal.messages(one.DESCRIPTOR),
                    min_size=1,
                    max_size=4,
                )
            )
        elif how == "mutated":
            req = data.draw(mutated(base))
        else:
            req = data.draw(internal.messages(method.request.DESCRIPTOR))
        before = mesh.bytes_served() if live else 0
        read = 1 if method.service == "WorkerLoadFeed" else internal.STREAM_REPLIES
        try:
            answer = handles.keep(call(channel, method, req, tally, read=read))
            allowed = PRECISE | ({grpc.StatusCode.UNAVAILABLE} if live else set())
            judge(method, answer, req, allowed)
            if live and (req.kv.handle_id, req.kv.access_token) != (
                base.kv.handle_id,
                base.kv.access_token,
            ):
                served = mesh.bytes_served() - before
                tally.unauthorised_kv_reads += served > 0
                assert served == 0, (
                    f"{served} KV bytes sent for a Decode without the token: {req!r:.500}"
                )
        finally:
            handles.release_all()

    fuzz()


def test_kv_is_never_served_without_its_handles_token(mesh, tally):
    """Each KvTransfer method with the right, a wrong, truncated, altered, empty, hostile,
    another request's and a released handle's token, of the live handle or another id: only
    the right token of a live handle is answered, and no chunk's bytes go out without it."""
    handles = Handles(mesh, tally)

    @hypothesis.seed(SEED)
    @_settings(MAX_EXAMPLES)
    @hypothesis.given(
        name=st.sampled_from(KV_METHODS),
        how=st.sampled_from(TOKENS),
        layerwise=st.booleans(),
        hostile=internal.HOSTILE_TEXT,
        which=st.sampled_from(["own", "own", "other's", "unknown", "hostile"]),
        data=st.data(),
    )
    def fuzz(name, how, layerwise, hostile, which, data):
        method = METHODS[f"KvTransfer.{name}"]
        try:
            kv = handles.prefill(layerwise)[1].kv
            other = handles.prefill()[1].kv
            channel = mesh.channel("KvTransfer")
            if how == "released":
                access = kvtransfer_pb2.KvAccess(
                    handle_id=kv.handle_id, access_token=kv.access_token
                )
                assert call(channel, METHODS["KvTransfer.Release"], access, tally).code == OK
            handle_id = {
                "own": kv.handle_id,
                "other's": other.handle_id,
                "unknown": secrets.token_hex(16),
                "hostile": hostile,
            }[which]
            req = kv_request(name, handle_id, token_of(how, kv, other, hostile), data)
            before = mesh.bytes_served()
            answer = call(channel, method, req, tally)
            judge(method, answer, req)
            # The right token of the live handle it names: that is the only one allowed in.
            allowed = how == "right" and which == "own"
            served = mesh.bytes_served() - before
            got_kv = name == "FetchChunk" and answer.code == OK and answer.replies[0].status.ok
            if not allowed:
                tally.unauthorised_kv_reads += bool(served or got_kv)
                tally.unauthorised_calls += answer.code == OK and (name != "FetchChunk" or got_kv)
                assert not served and not got_kv, f"KV sent without its token: {req!r:.300}"
                if name == "FetchChunk":
                    assert answer.code == OK and not answer.replies[0].status.ok, answer
                    assert answer.replies[0].status.refusal != 0, answer
                    assert not answer.replies[0].data, answer
                else:
                    assert answer.code != OK, (
                        f"{method.key} answered without the token: {req!r:.300}"
                    )
                tally.replays_refused += how == "released"
            elif name in ("Describe", "RenewLease"):
                assert answer.code == OK and answer.replies[0].handle_id == kv.handle_id, answer
                assert (
                    not answer.replies[0].access_token
                    or answer.replies[0].access_token == kv.access_token
                )
            elif name == "AwaitFirstToken":
                want = OK if layerwise else grpc.StatusCode.FAILED_PRECONDITION
                assert answer.code == want, answer
            elif name == "Release":
                assert answer.code == OK and answer.replies[0].blocks_freed > 0, answer
                # ... and the token it was released with never works again.
                for again in KV_METHODS:
                    replay = kv_request(again, kv.handle_id, kv.access_token, data)
                    late = call(channel, METHODS[f"KvTransfer.{again}"], replay, tally)
                    refused = late.code == grpc.StatusCode.NOT_FOUND or (
                        again == "FetchChunk" and late.code == OK and not late.replies[0].status.ok
                    )
                    assert refused, f"{again} after Release: {late}"
                    tally.replays_refused += 1
        finally:
            handles.release_all()

    fuzz()


def test_a_decode_given_a_handle_with_a_wrong_token_pulls_nothing(mesh, tally):
    """The UCX data plane checks the token too: a decode instance handed a live handle with a
    wrong, truncated or another request's token pulls no byte of it; with the right one it
    pulls and serves."""
    handles = Handles(mesh, tally)
    decode = METHODS["Decode.Decode"]
    try:
        for how in ["wrong", "truncated", "altered", "empty", "other's", "right"]:
            prompt, done = handles.prefill()
            other = handles.prefill()[1].kv
            kv = common_pb2.KvHandle()
            kv.CopyFrom(done.kv)
            kv.access_token = token_of(how, done.kv, other, "")
            req = decode_pb2.DecodeRequest(
                request_id=request_id(),
                prompt_token_ids=prompt,
                sampling=sampling(),
                first_token_id=done.first_token_id,
                kv=kv,
            )
            before = mesh.bytes_served()
            answer = call(mesh.channel("Decode"), decode, req, tally, read=10)
            served = mesh.bytes_served() - before
            if how == "right":
                assert answer.code == OK and served > 0, answer
                continue
            tally.unauthorised_kv_reads += served > 0
            assert served == 0, f"{served} bytes pulled with a {how} token"
            assert answer.code == grpc.StatusCode.PERMISSION_DENIED, (how, answer)
    finally:
        handles.release_all()


def test_abandon_of_another_requests_id_reads_nothing(mesh, tally):
    """Abandon names a request, not a handle, and carries no token (docs/api.md): of an id
    nobody holds KV for it frees nothing; of a live request's id it frees that KV, and the
    handle is gone for its holder too. No KV is served either way."""
    handles = Handles(mesh, tally)
    abandon = METHODS["Prefill.Abandon"]
    try:
        _, done = handles.prefill()
        for rid in ["", "fuzz-nobody", "x" * 10_000, "\x00", done.request_id + "-0"]:
            answer = call(
                mesh.channel("Prefill"), abandon, prefill_pb2.AbandonRequest(request_id=rid), tally
            )
            judge(abandon, answer, rid)
            assert answer.code != OK or not answer.replies[0].freed, (rid, answer)
        before = mesh.bytes_served()
        req = prefill_pb2.AbandonRequest(request_id=done.request_id)
        answer = call(mesh.channel("Prefill"), abandon, req, tally)
        assert answer.code == OK and answer.replies[0].freed
        fetch = kvtransfer_pb2.KvChunkRequest(
            handle_id=done.kv.handle_id, access_token=done.kv.access_token, num_blocks=1
        )
        reply = call(mesh.channel("KvTransfer"), METHODS["KvTransfer.FetchChunk"], fetch, tally)
        assert (
            reply.code == OK
            and reply.replies[0].status.refusal == kvtransfer_pb2.KvChunkStatus.REFUSAL_NOT_FOUND
        )
        assert mesh.bytes_served() == before
    finally:
        handles.release_all()


# Bytes ------------------------------------------------------------------------------------

RAW_TARGETS = sorted(k for k in METHODS if not k.startswith("WorkerLoadFeed.")) + FUZZED[-2:]


def test_raw_bytes_to_every_method_get_a_precise_status(mesh, actuator, tally):
    handles = Handles(mesh, tally)

    @hypothesis.seed(SEED)
    @_settings(MAX_EXAMPLES * 2)
    @hypothesis.given(key=st.sampled_from(RAW_TARGETS), data=st.data())
    def fuzz(key, data):
        method, channel = target_for(mesh, actuator, key)
        name = key.partition("@")[0]
        base = None if name.startswith("Actuator.") else valid_request(name, handles, live=False)
        if method.client_streaming:
            req = data.draw(st.lists(raw_bytes(base[0]), min_size=1, max_size=3))
        else:
            req = data.draw(raw_bytes(base))
        if name in ("Actuator.Drain", "Actuator.Apply"):
            hypothesis.assume(not would_act(method, req))
        try:
            answer = handles.keep(call(channel, method, req, tally, read=1))
            judge(method, answer, req)
        finally:
            handles.release_all()

    fuzz()


def test_messages_over_the_receive_limit_are_resource_exhausted(mesh, actuator, tally):
    big = b"x" * (MAX_MESSAGE_BYTES + 1)  # refused by its size, before it is parsed
    for key in [
        "Prefill.Prefill",
        "KvTransfer.FetchChunk",
        "Decode.Decode",
        "Planner.Plan",
        "WorkerRegistry.ListWorkers",
        "WorkerLoadFeed.Watch@decode",
        "Actuator.Apply",
    ]:
        method, channel = target_for(mesh, actuator, key)
        answer = call(channel, method, big, tally, read=1)
        assert answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (key, answer.code, answer.details)


# The launcher's Actuator ------------------------------------------------------------------


def test_hostile_actuator_calls_get_a_precise_status(mesh, actuator, tally):
    """Apply, Drain and Status of the launcher's Actuator with hostile messages. An Apply it
    would carry out is sent with the mesh's own counts (a change of no step: the fuzz mesh
    keeps its workers); a Drain of one of its workers is not sent."""
    channel = mesh.channels.setdefault(actuator, grpc.insecure_channel(actuator))
    bases = {
        "Apply": planner_pb2.ApplyRequest(pool="default", counts=WORKERS, reason="fuzz"),
        "Drain": planner_pb2.DrainRequest(worker_id="decode-9"),
        "Status": planner_pb2.ActuatorStatusRequest(),
    }

    @hypothesis.seed(SEED)
    @_settings(MAX_EXAMPLES // 2)
    @hypothesis.given(name=st.sampled_from(sorted(bases)), data=st.data())
    def fuzz(name, data):
        method = METHODS[f"Actuator.{name}"]
        req = data.draw(
            st.one_of(mutated(bases[name]), internal.messages(method.request.DESCRIPTOR))
        )
        if would_act(method, req):
            if name == "Drain":
                req.worker_id = "x" + req.worker_id
            else:
                req.counts.clear()
                req.counts.update(WORKERS)
                req.tp.clear()
        answer = call(channel, method, req, tally)
        judge(method, answer, req)
        if answer.code == grpc.StatusCode.OK and name == "Apply":
            wait_until(
                lambda: (
                    not call(channel, METHODS["Actuator.Status"], bases["Status"])
                    .replies[0]
                    .changing
                ),
                what="the change to end",
            )

    fuzz()


# Each hostile message that found a bug, as a case of its own ------------------------------

NAN, INF = float("nan"), float("inf")
FOUND = {
    # The engine named the request itself: the caller waited for ever, its KV held for good.
    "prefill without request_id": ("Prefill.Prefill", prefill_pb2.PrefillRequest(
        prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_tokens=2))),
    "decode without request_id": ("Decode.Decode", decode_pb2.DecodeRequest(
        prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_tokens=2))),
    # INTERNAL (OSError: a file name too long).
    "plan of a long model name": ("Planner.Plan", planner_pb2.PlanRequest(
        model_spec="\U0001f642" * 300, ttft_slo_ms=1000, tpot_slo_ms=100)),
    # Planned, with a NaN objective.
    "plan for a NaN TTFT": ("Planner.Plan", planner_pb2.PlanRequest(
        model_spec="opt-13b", ttft_slo_ms=NAN, tpot_slo_ms=100)),
    # The goodput search stepped the rate up for ever, holding the planner's plan lock.
    "plan for an infinite TPOT": ("Planner.Plan", planner_pb2.PlanRequest(
        model_spec="opt-13b", ttft_slo_ms=1000, tpot_slo_ms=INF)),
    "plan for a TPOT no rate misses": ("Planner.Plan", planner_pb2.PlanRequest(
        model_spec="opt-13b", ttft_slo_ms=1000, tpot_slo_ms=1e300)),
    "plan for a NaN rate": ("Planner.Plan", planner_pb2.PlanRequest(
        model_spec="opt-13b", ttft_slo_ms=1000, tpot_slo_ms=100, rate=NAN)),
    # UNKNOWN: a client stream's undecodable message escaped the handler.
    "corrupt workload sample": ("Planner.ReportWorkload", [b"\xff\xff"]),
    # INTERNAL: the launcher's synchronous server answered undecodable bytes so.
    "corrupt actuator request": ("Actuator.Status", b"a\x7f"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(FOUND))
def test_each_message_that_found_a_bug_is_invalid_argument(mesh, actuator, tally, case):
    key, req = FOUND[case]
    method, channel = target_for(mesh, actuator, key)
    answer = call(channel, method, req, tally, timeout=10)
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT and answer.details, answer


# Mesh mTLS on -----------------------------------------------------------------------------


def test_a_client_without_a_mesh_certificate_is_refused_at_the_handshake(tls_prefill, tally):
    """A prefill worker with the mesh's mutual TLS: a TLS client without a certificate is
    refused during the handshake (before any method is reached), and a gRPC client without
    one gets UNAVAILABLE from every method; the holder of a mesh certificate is served."""
    proc, (cert, key, ca) = tls_prefill
    address = ready_line(proc)["address"]
    assert refused_at(address, ca, ssl.TLSVersion.TLSv1_2) == "handshake"
    assert refused_at(address, ca, ssl.TLSVersion.TLSv1_3) == "first read"
    target = (("grpc.ssl_target_name_override", mesh_tls.SERVER_NAME),)
    no_cert = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    with grpc.secure_channel(address, no_cert, options=target) as channel:
        for name in [k for k in METHODS if k.startswith(("Prefill.", "KvTransfer."))]:
            answer = call(channel, METHODS[name], METHODS[name].request(), tally, timeout=10)
            assert answer.code == grpc.StatusCode.UNAVAILABLE, (name, answer)
    holder = grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes(), cert.read_bytes())
    with grpc.secure_channel(address, holder, options=target) as channel:
        answer = call(channel, METHODS["Prefill.Stats"], common_pb2.StatsRequest(), tally)
        assert answer.code == OK and answer.replies[0].worker_id == "prefill-tls"


# Afterwards -------------------------------------------------------------------------------


def test_every_internal_method_was_fuzzed_and_nothing_leaked(
    fuzz_mesh, planner, mesh, tally, lapsed_before
):
    """Runs last: every process alive, every method called, every KV block free on every
    worker, no lease left to lapse; prints the counts."""
    for proc in [*(p.popen for p in fuzz_mesh.processes), planner[0]]:
        tally.crashes += proc.poll() is not None
    try:
        wait_until(lambda: kv_all_free(fuzz_mesh), timeout=LEASE_S + 10, what="every KV block free")
    finally:
        for address, role in [(mesh.prefill, "prefill"), (mesh.decode, "decode")]:
            load = stats(address, role).load
            tally.leaked_blocks += load.total_kv_blocks - load.free_kv_blocks
            tally.leaked_leases += load.held_kv_handles
        tally.leaked_leases += leases_expired(fuzz_mesh) - lapsed_before
        print(tally.line())
    assert set(tally.calls) == set(METHODS), set(METHODS) - set(tally.calls)
    assert tally.crashes == 0 and tally.leaked_blocks == 0 and tally.leaked_leases == 0
    assert tally.unauthorised_kv_reads == 0 and tally.unauthorised_calls == 0
    assert not {"INTERNAL", "UNKNOWN"} & {c for seen in tally.statuses.values() for c in seen}
