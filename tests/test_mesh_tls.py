"""Mutual TLS between the mesh's services (DISTSERVE_TLS_CERT/KEY/CA): a real mesh behind Envoy
serves exact tokens over it, and the gateway and the workers answer only callers holding a
certificate of the mesh's CA (the public entry is Envoy)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import pytest

from services.common import mesh_tls
from services.common.gen.distserve.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2_grpc,
)
from services.edge.config import EdgeConfig
from tests.certs import mesh_pki
from tests.conftest import start_mesh, stop_now
from tests.test_mesh import PROMPTS, expected

TARGET = (("grpc.ssl_target_name_override", mesh_tls.SERVER_NAME),)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    return {"mesh": mesh_pki(root, "mesh"), "intruder": mesh_pki(root, "intruder")}


@pytest.fixture(scope="module")
def tls_mesh(tiny_model, pki):
    cert, key, ca = (str(p) for p in pki["mesh"])
    env = {mesh_tls.ENV_CERT: cert, mesh_tls.ENV_KEY: key, mesh_tls.ENV_CA: ca}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mesh_tls.mesh_tls.cache_clear()  # the launcher (this process) speaks TLS too
        mesh = start_mesh(
            tiny_model,
            prefill=1,
            decode=1,
            env=env,
            edge=EdgeConfig(port=0, access_log="", rate_limit_rps=0),
        )
        try:
            yield mesh
        finally:
            stop_now(mesh)
    mesh_tls.mesh_tls.cache_clear()


def _credentials(pki, who: str | None) -> grpc.ChannelCredentials:
    """TLS trusting the mesh CA; presenting `who`'s certificate (None: none)."""
    ca = pki["mesh"][2].read_bytes()
    if who is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    cert, key, _ = pki[who]
    return grpc.ssl_channel_credentials(ca, key.read_bytes(), cert.read_bytes())


def _tokens(channel, prompt: str) -> list[int]:
    params = common_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    out = []
    for r in stub.Generate(gateway_pb2.GenerateRequest(text=prompt, sampling=params), timeout=30):
        out += r.token_ids
    return out


def test_the_mesh_serves_exact_tokens_over_tls(tls_mesh, pki, tiny_model):
    want = expected(tiny_model, PROMPTS[:2], max_tokens=8)
    # The public entry, Envoy (plain here), speaks mesh TLS to the gateway: gRPC and HTTP.
    with grpc.insecure_channel(tls_mesh.edge_address) as channel:
        for prompt, (ids, _) in zip(PROMPTS[:2], want, strict=True):
            assert _tokens(channel, prompt) == ids
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    body = json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://{tls_mesh.edge_address}/v1/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert json.loads(r.read())["choices"][0]["text"] == want[0][1]
    # A holder of a mesh certificate may call the gateway directly.
    with grpc.secure_channel(
        tls_mesh.gateway_address, _credentials(pki, "mesh"), options=TARGET
    ) as channel:
        assert _tokens(channel, PROMPTS[1]) == want[1][0]


def _prefill_stats(address: str, credentials: grpc.ChannelCredentials | None):
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials, options=TARGET)
    )
    with channel:
        return prefill_pb2_grpc.PrefillStub(channel).Stats(common_pb2.StatsRequest(), timeout=5)


def test_only_holders_of_a_mesh_certificate_reach_the_mesh(tls_mesh, pki):
    prefill = next(p for p in tls_mesh.workers if p.name == "prefill-0").ready["address"]
    assert _prefill_stats(prefill, _credentials(pki, "mesh")).worker_id == "prefill-0"
    for credentials in (None, _credentials(pki, None), _credentials(pki, "intruder")):
        with pytest.raises(grpc.RpcError) as err:  # plaintext, no cert, another CA's cert
            _prefill_stats(prefill, credentials)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # A worker's load feed likewise: only the mesh's gateways hear its load and KV events.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(_watch_load(prefill, _credentials(pki, None)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def _watch_load(address: str, credentials) -> None:
    async with grpc.aio.secure_channel(address, credentials, options=TARGET) as channel:
        call = gateway_pb2_grpc.WorkerLoadFeedStub(channel).Watch(
            gateway_pb2.WatchLoadRequest(), timeout=5
        )
        await call.read()
