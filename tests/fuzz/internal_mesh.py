"""The fuzz mesh as the internal-RPC fuzzer (test_internal_fuzz.py) sees it: where each
service is served, the KV handles it holds for its prompts (released by it, as the gateway
releases them), a valid request of each method to mix hostile values into, the handle tokens
it tries, and how each answer is judged."""

from __future__ import annotations

import itertools
import json
import os
import secrets
import socket
import ssl
import subprocess
import time

import grpc
from hypothesis import strategies as st

from services.common.gen.distserve.v1 import (
    common_pb2,
    decode_pb2,
    kvtransfer_pb2,
    planner_pb2,
    prefill_pb2,
)
from tests.fuzz import internal
from tests.fuzz.internal import NEVER, Answer, Tally, call, mutated
from tests.test_mesh import stats

METHODS = internal.methods()
OK = grpc.StatusCode.OK
# What a hostile message may get (and CANCELLED: the fuzzer left a stream it had read enough of).
PRECISE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
VOCAB = 900  # under the tiny model's vocabulary: valid prompts
_ids = itertools.count()


def request_id() -> str:
    # fixed width: a valid message's length must not vary from one hypothesis example to the
    # next (the byte mutations of raw_bytes draw positions up to it; a replayed example that
    # drew from another range fails as FlakyStrategyDefinition)
    return f"fuzz-{next(_ids):08d}"


def spawn(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """A service process, started (`ready_line` waits for it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env
    )


def ready_line(proc: subprocess.Popen) -> dict:
    """The JSON line a service prints once it serves."""
    for line in proc.stdout:
        if '"ready"' in line:
            return json.loads(line)
    raise RuntimeError(f"{proc.args[2:4]} exited with code {proc.wait()} before ready")


class Mesh:
    """Where each fuzzed service is served (`where`: service -> address), a channel to every
    address, and the prefill and decode workers' addresses."""

    def __init__(self, fuzz_mesh, where, channels, prefill, decode) -> None:
        self.fuzz_mesh, self.where, self.channels = fuzz_mesh, where, channels
        self.prefill, self.decode = prefill, decode

    def channel(self, service: str) -> grpc.Channel:
        return self.channels[self.where[service]]

    def bytes_served(self) -> int:
        """KV bytes the prefill instance has sent, over UCX and gRPC, by its own count."""
        return sum(stats(self.prefill, "prefill").kv_bytes_served_by_rank)


class Handles:
    """KV held for the fuzzer's prompts: prefilled here, released by the fuzzer at the end of
    each example (it holds each handle's token, as the gateway does)."""

    def __init__(self, mesh: Mesh, tally: Tally) -> None:
        self.mesh, self.tally = mesh, tally
        self.held: dict[str, common_pb2.KvHandle] = {}

    def prefill(self, layerwise: bool = False) -> tuple[list[int], prefill_pb2.PrefillResponse]:
        """A fresh prompt (its own ids: no prefix cached at decode) prefilled; its KV held."""
        prompt = [5 + (next(_ids) * 7 + i * 13) % (VOCAB - 5) for i in range(24)]
        req = prefill_pb2.PrefillRequest(
            request_id=request_id(),
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True),
            layerwise=layerwise,
        )
        answer = self.send(METHODS["Prefill.Prefill"], req)
        assert answer.code == OK, answer
        return prompt, answer.replies[-1].done

    def send(self, method: internal.Method, request, **kw) -> Answer:
        """Call a Prefill method; keep the handles its replies carry."""
        return self.keep(call(self.mesh.channel(method.service), method, request, self.tally, **kw))

    def keep(self, answer: Answer) -> Answer:
        """Hold the KV handles an answer carries (a Prefill's events) until `release_all`."""
        for reply in answer.replies:
            for kv in (
                getattr(reply, "kv", None),
                getattr(getattr(reply, "done", None), "kv", None),
            ):
                if isinstance(kv, common_pb2.KvHandle) and kv.handle_id:
                    self.held[kv.handle_id] = kv
        return answer

    def release_all(self) -> None:
        release = METHODS["KvTransfer.Release"]
        for kv in self.held.values():
            access = kvtransfer_pb2.KvAccess(handle_id=kv.handle_id, access_token=kv.access_token)
            answer = call(self.mesh.channel("KvTransfer"), release, access, self.tally)
            assert answer.code in (OK, grpc.StatusCode.NOT_FOUND), answer
        self.held.clear()


def judge(method: internal.Method, answer: Answer, request, allowed=PRECISE) -> None:
    where = f"{method.key}: {answer.code.name} {answer.details!r} for {request!r:.500}"
    assert answer.code not in NEVER, where
    assert answer.code in allowed, where
    assert answer.code in (OK, grpc.StatusCode.CANCELLED) or answer.details, where


# Valid requests, each fuzzed with a few hostile values -------------------------------------


def sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)


def valid_request(key: str, handles: Handles, live: bool) -> object:
    """A valid request of method `key` (with `live`, a Decode with a freshly prefilled handle)."""
    # ids of two varint bytes each (128 and up), for the same reason as request_id's width
    prompt = [128 + (next(_ids) * 11 + i) % (VOCAB - 128) for i in range(12)]
    if key == "Prefill.Prefill":
        return prefill_pb2.PrefillRequest(
            request_id=request_id(), prompt_token_ids=prompt, sampling=sampling()
        )
    if key == "Prefill.Abandon":
        return prefill_pb2.AbandonRequest(request_id=request_id())
    if key == "Decode.Decode":
        req = decode_pb2.DecodeRequest(
            request_id=request_id(), prompt_token_ids=prompt, sampling=sampling()
        )
        if live:
            prompt, done = handles.prefill()
            req.prompt_token_ids[:] = prompt
            req.first_token_id = done.first_token_id
            req.kv.CopyFrom(done.kv)
        return req
    if key == "Planner.Plan":
        return planner_pb2.PlanRequest(
            model_spec="opt-13b", workload="chat", ttft_slo_ms=1000, tpot_slo_ms=100
        )
    if key == "Planner.ReportWorkload":
        sample = planner_pb2.WorkloadSample(
            arrival_unix_s=time.time(), prompt_tokens=100, output_tokens=20, ttft_ms=50, tpot_ms=9
        )
        return [sample, planner_pb2.WorkloadSample(arrival_unix_s=time.time(), arrival=True)]
    return METHODS[key].request()  # the empty requests: Stats, GetPlacement, Watch, ...


# Methods on the workers, the gateway and the planner; the Actuator and KvTransfer below.
FUZZED = [
    k for k in METHODS if not k.startswith(("Actuator.", "KvTransfer.", "WorkerLoadFeed."))
] + ["WorkerLoadFeed.Watch@prefill", "WorkerLoadFeed.Watch@decode"]


def channel_for(mesh: Mesh, key: str) -> tuple[internal.Method, grpc.Channel]:
    name, _, at = key.partition("@")
    method = METHODS[name]
    if at:
        return method, mesh.channels[mesh.prefill if at == "prefill" else mesh.decode]
    return method, mesh.channel(method.service)


# Handle tokens ----------------------------------------------------------------------------

TOKENS = ["right", "wrong", "truncated", "altered", "empty", "hostile", "other's", "released"]
KV_METHODS = ["Describe", "AwaitFirstToken", "Release", "RenewLease", "FetchChunk"]


def token_of(how: str, kv: common_pb2.KvHandle, other: common_pb2.KvHandle, hostile: str) -> str:
    right = kv.access_token
    return {
        "right": right,
        "released": right,
        "wrong": secrets.token_urlsafe(32),
        "truncated": right[: len(right) // 2],
        "altered": right[:-1] + ("A" if right[-1] != "A" else "B"),
        "empty": "",
        "hostile": hostile,
        "other's": other.access_token,
    }[how]


def kv_request(name: str, handle_id: str, token: str, data) -> object:
    access = kvtransfer_pb2.KvAccess(handle_id=handle_id, access_token=token)
    if name == "RenewLease":
        extend = data.draw(
            internal.value(kvtransfer_pb2.RenewLeaseRequest.DESCRIPTOR.fields_by_name["extend_ms"])
        )
        return kvtransfer_pb2.RenewLeaseRequest(access=access, extend_ms=extend)
    if name != "FetchChunk":
        return access
    req = kvtransfer_pb2.KvChunkRequest(handle_id=handle_id, access_token=token, num_blocks=1)
    # A valid chunk (layer 0, K, the first block), or one with hostile ranges, heads, chunks.
    return data.draw(st.one_of(st.just(req), mutated(req)), "chunk request")


def target_for(mesh: Mesh, actuator: str, key: str) -> tuple[internal.Method, grpc.Channel]:
    if key.startswith("Actuator."):
        return METHODS[key], mesh.channels.setdefault(actuator, grpc.insecure_channel(actuator))
    return channel_for(mesh, key)


# The launcher's Actuator: what the fuzzer does not send -------------------------------------

WORKERS = {"prefill": 1, "decode": 1}  # the fuzz mesh's


def would_act(method: internal.Method, req: object) -> bool:
    """Whether the actuator would resize or drain the fuzz mesh on `req` (message or bytes):
    an Apply of the one pool naming only known roles, a Drain of one of its workers."""
    if isinstance(req, bytes):
        try:
            req = method.request.FromString(req)
        except Exception:
            return False
    if method.name == "Drain":
        return req.worker_id in {f"{r}-0" for r in WORKERS}
    if method.name == "Apply":
        roles = set(req.counts)
        return (
            req.pool == "default"
            and roles <= {"prefill", "decode", "colocated"}
            and set(req.tp) <= roles
        )
    return False


def refused_at(address: str, ca, version: ssl.TLSVersion) -> str:
    """Where the server stops a TLS client that has no certificate: in the handshake, or (TLS
    1.3, where the client's side of the handshake ends before the server has checked it) at
    the first read, with an alert or the connection's end. Fails if it is served."""
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    context.minimum_version = context.maximum_version = version
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        try:
            tls = context.wrap_socket(raw)
        except ssl.SSLError:
            return "handshake"
        with tls:
            try:
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # HTTP/2's preface
                data = tls.recv(1024)
            except (ssl.SSLError, ConnectionResetError):
                return "first read"
            assert data == b"", f"served over {version.name} without a certificate: {data!r}"
            return "first read"
