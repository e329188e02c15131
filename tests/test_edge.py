"""The edge end to end: the real Envoy in front of a real mesh, the official openai client,
gRPC clients on the same port, API keys, TLS, limits, and a client that walks away."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import ssl

import grpc
import openai
import pytest

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.tokenizer import Tokenizer
from services.edge.config import EdgeConfig, Upstream
from services.edge.envoy import Envoy
from services.gateway import openai_fields
from services.gateway.chat_template import ChatTemplate
from tests.certs import self_signed
from tests.conftest import start_mesh
from tests.test_mesh import addresses, generate, kv_all_free, stats, wait_until

PROMPT = "The edge forwards every request to the gateway"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What does prefill do?"},
]


@pytest.fixture(scope="module")
def mesh(shared_mesh):
    """1 prefill + 1 decode behind an Envoy with the default edge config on a free port: the
    session's shared mesh (the tests using it leave it as they found it)."""
    return shared_mesh


def client(address: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{address}/v1",
        api_key=kwargs.pop("api_key", "none"),
        max_retries=0,
        **kwargs,
    )


def request(address: str, method: str, path: str, body: bytes | None = None, headers=None):
    """One plain HTTP/1.1 request: (status, headers, parsed JSON or text)."""
    conn = http.client.HTTPConnection(address, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    try:
        return r.status, r.headers, json.loads(data)
    except ValueError:
        return r.status, r.headers, data.decode(errors="replace")


def model_name(mesh) -> str:
    return mesh.spec.model.resolve().name


def grpc_reference(mesh, prompt: str | list[int], max_tokens: int, **sampling):
    """Token ids, text and last response of the same request sent straight to the gateway."""
    if isinstance(prompt, str):
        return asyncio.run(generate(mesh.gateway_address, prompt, max_tokens, **sampling))

    async def by_ids():
        async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
            req = gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=params
            )
            ids, text, last = [], [], None
            async for r in stub.Generate(req):
                ids += r.token_ids
                text.append(r.text)
                last = r
            return ids, "".join(text), last

    return asyncio.run(by_ids())


def test_openai_completions_through_envoy_equal_the_grpc_path(mesh):
    want_ids, want_text, _ = grpc_reference(mesh, PROMPT, 24)
    c = client(mesh.edge_address)
    whole = c.completions.create(
        model=model_name(mesh),
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].text == want_text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == len(want_ids) == 24
    assert whole.usage.prompt_tokens == len(Tokenizer.from_dir(mesh.spec.model).encode(PROMPT))

    chunks = list(
        c.completions.create(
            model=model_name(mesh),
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want_text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(ch.usage is None for ch in chunks[:-1])


def test_openai_chat_through_envoy_equals_the_grpc_path_of_the_rendered_template(mesh):
    tokenizer = Tokenizer.from_dir(mesh.spec.model)
    chat = ChatTemplate(tokenizer).render(MESSAGES)
    assert chat.text.startswith("<|begin_of_text|><|im_start|>system\nYou are terse.<|im_end|>")
    assert chat.text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(chat.text, add_special_tokens=False)
    assert ids[:2] == [0, 2]  # BOS, <|im_start|>: special tokens, once each
    want_ids, want_text, last = grpc_reference(
        mesh, ids, 20, stop_token_ids=list(chat.stop_token_ids)
    )
    c = client(mesh.edge_address)
    whole = c.chat.completions.create(
        model=model_name(mesh),
        messages=MESSAGES,
        max_completion_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want_text
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.usage.completion_tokens == len(want_ids)
    reason = "length" if last.finish_reason == common_pb2.FINISH_REASON_LENGTH else "stop"
    assert whole.choices[0].finish_reason == reason

    stream = c.chat.completions.create(
        model=model_name(mesh),
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want_text
    assert chunks[-1].usage.completion_tokens == len(want_ids)


def test_a_grpc_client_through_envoy_gets_the_same_tokens_on_the_same_port(mesh):
    want = grpc_reference(mesh, PROMPT, 16)
    got = asyncio.run(generate(mesh.edge_address, PROMPT, 16))
    assert got[0] == want[0] and got[1] == want[1]
    assert got[2].usage.completion_tokens == 16


def test_sampling_with_a_seed_is_reproducible_and_stop_strings_cut_the_text(mesh):
    c = client(mesh.edge_address)
    runs = [
        c.completions.create(
            model=model_name(mesh), prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9,
            seed=7, extra_body={"top_k": 50, "ignore_eos": True},
        ).choices[0].text
        for _ in range(2)
    ]  # fmt: skip
    assert runs[0] == runs[1]
    full = c.completions.create(
        model=model_name(mesh), prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    at = next(
        i
        for i in range(1, len(full) - 1)
        if full[i : i + 2].isascii() and full[i : i + 2].isalnum()
    )
    stop = full[at : at + 2]
    cut = c.completions.create(
        model=model_name(mesh), prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


def test_models_health_and_the_openapi_document_describe_what_is_served(mesh):
    c = client(mesh.edge_address)
    assert [m.id for m in c.models.list().data] == [model_name(mesh)]
    assert c.models.retrieve(model_name(mesh)).id == model_name(mesh)
    status, _, health = request(mesh.edge_address, "GET", "/health")
    assert status == 200 and health["mode"] == "disaggregated"
    assert health["workers"] == {"prefill": 1, "decode": 1, "colocated": 0}
    status, _, doc = request(mesh.edge_address, "GET", "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")
    assert set(doc["paths"]) == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model}",
        "/health",
        "/openapi.json",
        "/tokenize",
        "/detokenize",
        "/version",
        "/metrics",
    }
    schemas = doc["components"]["schemas"]
    for endpoint, name in ((openai_fields.COMPLETIONS, "CompletionRequest"),
                           (openai_fields.CHAT, "ChatCompletionRequest")):  # fmt: skip
        documented = set(schemas[name]["properties"])
        assert documented == set(openai_fields.BY_ENDPOINT[endpoint])  # honoured and refused
    # Every documented GET path answers (the others are exercised by the tests around).
    for path in ("/v1/models", f"/v1/models/{model_name(mesh)}", "/health", "/openapi.json",
                 "/version", "/metrics"):  # fmt: skip
        assert request(mesh.edge_address, "GET", path)[0] == 200


BAD_BODIES = [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    (b'"text"', None, "JSON object"),
    (b"\xff\xfe{}", None, "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, None, "not valid JSON"),
    (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", None, "not valid JSON"),
    ({"prompt": 5}, "prompt", "must be a string"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens", "must be an integer"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "must be an integer"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
    ({"prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ({"prompt": "x", "stop": [1, 2]}, "stop", "array of strings"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "x", "max_tokens": 10**9}, "max_tokens", "at most"),
    ({"prompt": "x", "max_tokens": 1023}, "max_tokens", "exceeds max_model_len"),
    ({"prompt": "x", "temperature": -0.5}, "temperature", ">= 0"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "(0, 1]"),
    ({"prompt": "x", "top_k": -3}, "top_k", "in [0, 4294967295]"),
    ({"prompt": "x", "seed": -1}, "seed", "[0, 2**63)"),
    ({"prompt": "x", "seed": 2**64}, "seed", "[0, 2**63)"),
    ({"prompt": "x", "n": 17}, "n", "in [1, 16]"),
    ({"prompt": "x", "temprature": 0}, "temprature", "did you mean 'temperature'?"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of", "in [n, 16]"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "in [0, 20]"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop", "at most 16"),
    ({"prompt": ""}, "prompt", "prompt is empty"),
    ({"prompt": []}, "prompt", "prompt is empty"),
    ({"prompt": [5, 99999]}, "prompt", "outside the vocabulary"),
    ({"prompt": [-1]}, "prompt", "outside the vocabulary"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"prompt": "word " * 2000}, "prompt", "shorten the prompt"),
    ({}, "prompt", "required"),
]
BAD_CHAT_BODIES = [
    ({"messages": []}, "messages", "empty"),
    ({"messages": "hi"}, "messages", "array of message objects"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages",
        "only text parts",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n", "in [1, 16]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools", "function tools"),
    (
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "20",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
        "response_format",
        "must be one of",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [("/v1/completions", *case) for case in BAD_BODIES]
    + [("/v1/chat/completions", *case) for case in BAD_CHAT_BODIES],
)
def test_bad_input_gets_an_openai_shaped_400_naming_the_parameter(mesh, path, body, param, message):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, headers, reply = request(
        mesh.edge_address, "POST", path, raw, {"Content-Type": "application/json"}
    )
    assert status == 400, reply
    assert headers["content-type"].startswith("application/json")
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["param"] == param
    assert message in reply["error"]["message"]


def test_unknown_parameters_are_refused_and_refused_ones_pass_only_at_their_default(mesh):
    c = client(mesh.edge_address)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(
            model=model_name(mesh), prompt="x", max_tokens=3, extra_body={"frobnicate": {"a": 1}}
        )
    assert err.value.body["param"] == "frobnicate"
    out = c.completions.create(
        model=model_name(mesh), prompt="x", max_tokens=3,
        extra_body={"frobnicate": None, "presence_penalty": 0, "best_of": 1},
    )  # fmt: skip
    assert out.usage.completion_tokens <= 3


def test_an_unknown_model_or_path_is_404(mesh):
    c = client(mesh.edge_address)
    with pytest.raises(openai.NotFoundError) as err:
        c.completions.create(model="gpt-17", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-17", messages=MESSAGES)
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-17")
    status, _, reply = request(mesh.edge_address, "GET", "/v2/anything")
    assert status == 404 and reply["error"]["code"] == "not_found"
    status, _, reply = request(mesh.edge_address, "GET", "/v1/completions")
    assert status == 405 and "use POST" in reply["error"]["message"]


def test_a_body_over_the_limit_is_413(mesh):
    limit = mesh.spec.edge.max_request_bytes
    body = json.dumps({"prompt": "x" * limit}).encode()
    status, _, reply = request(
        mesh.edge_address, "POST", "/v1/completions", body, {"Content-Type": "application/json"}
    )
    assert status == 413
    assert reply["error"]["code"] == "request_too_large" and str(limit) in reply["error"]["message"]


def test_a_client_that_disconnects_mid_stream_stops_decode_and_frees_kv(mesh):
    decode = addresses(mesh, "decode")[0]
    before = stats(decode, "decode").requests_aborted
    c = client(mesh.edge_address)
    stream = c.completions.create(
        model=model_name(mesh), prompt="walk away", max_tokens=1000, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for got, _ in enumerate(stream, 1):
        if got == 3:
            s = stats(decode, "decode")
            assert s.load.running_seqs == 1  # still generating: it holds KV on decode
            assert s.load.free_kv_blocks < s.load.total_kv_blocks
            break
    stream.close()  # the connection to Envoy closes; Envoy resets its upstream request
    wait_until(lambda: stats(decode, "decode").requests_aborted > before, what="decode abort")
    wait_until(lambda: kv_all_free(mesh), what="KV blocks to be freed after the disconnect")
    assert stats(decode, "decode").load.running_seqs == 0


def test_rate_limit_answers_429_over_http_and_resource_exhausted_over_grpc(mesh):
    edge = EdgeConfig(port=0, rate_limit_rps=1, rate_limit_burst=3, access_log="")
    with Envoy(edge, [Upstream(mesh.gateway_address, mesh.gateway_http_address)]) as envoy:
        replies = [request(envoy.address, "GET", "/v1/models") for _ in range(8)]
        codes = [r[0] for r in replies]
        assert codes[:3] == [200] * 3 and 429 in codes, codes  # the burst, then refusals
        _, headers, reply = next(r for r in replies if r[0] == 429)
        assert headers["retry-after"] == "1"
        assert reply["error"]["type"] == "rate_limit_error"
        assert reply["error"]["code"] == "rate_limit_exceeded"
        assert request(envoy.address, "GET", "/health")[0] == 200  # probes are never limited

        async def until_refused():
            for _ in range(8):
                await generate(envoy.address, "x", 2)

        with pytest.raises(grpc.RpcError) as err:
            asyncio.run(until_refused())
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_with_api_keys_a_request_needs_a_valid_key(mesh):
    edge = EdgeConfig(port=0, api_keys=("sk-one", "sk-two"), access_log="")
    with Envoy(edge, [Upstream(mesh.gateway_address, mesh.gateway_http_address)]) as envoy:
        for key in ("sk-wrong", "Bearer sk-one"):
            with pytest.raises(openai.AuthenticationError) as err:
                client(envoy.address, api_key=key).models.list()
            assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        status, headers, _ = request(envoy.address, "POST", "/v1/completions", b"{}")
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        for key in ("sk-one", "sk-two"):
            out = client(envoy.address, api_key=key).completions.create(
                model=model_name(mesh), prompt="x", max_tokens=2
            )
            assert out.usage.completion_tokens <= 2
        assert request(envoy.address, "GET", "/health")[0] == 200  # probes need no key

        with pytest.raises(grpc.RpcError) as err:
            asyncio.run(generate(envoy.address, "x", 2))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(envoy.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            req = gateway_pb2.GenerateRequest(
                text="x", sampling=common_pb2.SamplingParams(max_tokens=2)
            )
            replies = list(
                stub.Generate(req, timeout=30, metadata=[("authorization", "Bearer sk-two")])
            )
        assert replies[-1].usage.completion_tokens <= 2


def test_metrics_through_the_edge_need_a_key_when_keys_are_on_unless_public(mesh):
    upstream = [Upstream(mesh.gateway_address, mesh.gateway_http_address)]
    status, headers, text = request(mesh.edge_address, "GET", "/metrics")  # no keys: open
    assert status == 200 and "gen_ai_server_time_to_first_token_seconds" in text
    assert headers["content-type"].startswith("text/plain")
    edge = EdgeConfig(port=0, api_keys=("sk-one",), access_log="")
    with Envoy(edge, upstream) as envoy:
        assert request(envoy.address, "GET", "/metrics")[0] == 401
        auth = {"Authorization": "Bearer sk-one"}
        assert request(envoy.address, "GET", "/metrics", headers=auth)[0] == 200
    edge = EdgeConfig(port=0, api_keys=("sk-one",), public_metrics=True, access_log="")
    with Envoy(edge, upstream) as envoy:
        status, _, text = request(envoy.address, "GET", "/metrics")
        assert status == 200 and "gen_ai_server_time_to_first_token_seconds" in text
        assert request(envoy.address, "GET", "/v1/models")[0] == 401  # the rest still needs one


def test_with_tls_a_tls_client_succeeds_and_plain_http_is_refused(mesh, tmp_path):
    cert, key = self_signed(tmp_path)
    edge = EdgeConfig(port=0, tls_cert=cert, tls_key=key, access_log="")
    with Envoy(edge, [Upstream(mesh.gateway_address, mesh.gateway_http_address)]) as envoy:
        trust = ssl.create_default_context(cafile=str(cert))
        c = openai.OpenAI(
            base_url=f"https://{envoy.address}/v1",
            api_key="none",
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=trust),
        )
        out = c.completions.create(model=model_name(mesh), prompt="x", max_tokens=3)
        assert out.usage.completion_tokens <= 3

        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(envoy.address, credentials) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            req = gateway_pb2.GenerateRequest(
                text="x", sampling=common_pb2.SamplingParams(max_tokens=2)
            )
            assert list(stub.Generate(req, timeout=30))[-1].usage.completion_tokens <= 2

        # Plain HTTP gets no HTTP answer: the TLS handshake fails and Envoy closes.
        with pytest.raises((http.client.HTTPException, ConnectionError, socket.timeout)):
            request(envoy.address, "GET", "/health")
        # A client that does not trust the certificate is refused too.
        with pytest.raises(openai.APIConnectionError):
            openai.OpenAI(
                base_url=f"https://{envoy.address}/v1", api_key="none", max_retries=0
            ).models.list()


def test_without_workers_requests_get_503_not_500(tiny_model):
    mesh = start_mesh(tiny_model, prefill=0, decode=0, edge=EdgeConfig(port=0, access_log=""))
    try:
        status, _, health = request(mesh.edge_address, "GET", "/health")
        assert status == 503 and "no complete serving path" in health["error"]["message"]
        with pytest.raises(openai.InternalServerError) as err:
            client(mesh.edge_address).completions.create(
                model=model_name(mesh), prompt="x", max_tokens=2
            )
        assert err.value.status_code == 503
        assert err.value.body["type"] == "service_unavailable_error"
        with pytest.raises(grpc.RpcError) as rpc:
            asyncio.run(generate(mesh.edge_address, "x", 2))
        assert rpc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        mesh.stop()


def test_the_request_id_is_envoys_x_request_id_on_both_apis(mesh):
    status, headers, reply = request(
        mesh.edge_address,
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "x", "max_tokens": 2}).encode(),
        {"Content-Type": "application/json", "x-request-id": "trace-42"},
    )
    assert status == 200 and reply["id"] == "cmpl-trace-42"
    assert headers["x-request-id"] == "trace-42"
    with grpc.insecure_channel(mesh.edge_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        req = gateway_pb2.GenerateRequest(
            text="x", sampling=common_pb2.SamplingParams(max_tokens=2)
        )
        replies = list(stub.Generate(req, timeout=30, metadata=[("x-request-id", "trace-43")]))
    assert {r.request_id for r in replies} == {"trace-43"}


def test_a_worker_lost_mid_stream_ends_the_stream_with_an_error_event(mesh_factory):
    mesh = mesh_factory(prefill=1, decode=1, edge=EdgeConfig(port=0, access_log=""))
    c = client(mesh.edge_address)
    stream = c.completions.create(
        model=model_name(mesh), prompt="x", max_tokens=1000, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    with pytest.raises(openai.APIError) as err:
        for got, _ in enumerate(stream, 1):
            if got == 3:
                next(p for p in mesh.workers if p.name == "decode-0").popen.kill()
    assert err.value.type == "service_unavailable_error"
    prefill = addresses(mesh, "prefill")[0]
    wait_until(
        lambda: (s := stats(prefill, "prefill")).load.free_kv_blocks == s.load.total_kv_blocks,
        what="the prefill instance to hold no KV",
    )
