"""The gRPC API's chat: a conversation (and tools) rendered and read back as the HTTP API does,
through a real 1 prefill + 1 decode mesh whose gateway has `--tool-call-parser hermes`.

The answers are checked against the HTTP API's answer to the same request (same seed: same
tokens, same text, same calls) and against transformers on the same folder (the rendered
prompt and greedy tokens). A tiny random model writes no tool call of its own: a regex
constraint (structured output, through the real grammar engine) makes its answer a Hermes call,
which the real parser then reads, as it would read a trained model's.
"""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
import requests

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.conftest import start_mesh, stop_now
from tests.gateway.test_tools import BOUNDED, TEMPLATE, TOOLS

# A conversation with everything the template renders: a system turn, an assistant's call and
# the tool's answer, then the user's question.
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "user", "content": "And tomorrow?"},
]
# One Hermes call after some content, the city left to the model.
CALL_RE = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'  # noqa: E501


def pb_chat(messages: list[dict], tools: list[dict], **fields) -> gateway_pb2.Chat:
    """The gRPC `Chat` of an HTTP chat body's messages and tools."""
    pb_messages = []
    for m in messages:
        calls = [
            gateway_pb2.ToolCall(id=c["id"], name=c["function"]["name"],
                                 arguments=c["function"]["arguments"])
            for c in m.get("tool_calls", [])
        ]  # fmt: skip
        pb_messages.append(
            gateway_pb2.ChatMessage(
                role=m["role"],
                content=m["content"],
                tool_calls=calls,
                tool_call_id=m.get("tool_call_id", ""),
            )
        )
    pb_tools = [
        gateway_pb2.Tool(
            name=t["function"]["name"],
            description=t["function"].get("description", ""),
            parameters=json.dumps(t["function"]["parameters"]),
        )
        for t in tools
    ]
    return gateway_pb2.Chat(messages=pb_messages, tools=pb_tools, **fields)


@pytest.fixture(scope="module")
def model(model_factory, tmp_path_factory):
    path = tmp_path_factory.mktemp("grpc_chat") / "model"
    shutil.copytree(model_factory("tiny"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def mesh(model):
    mesh = start_mesh(model, prefill=1, decode=1, gateway_args=("--tool-call-parser", "hermes"))
    try:
        yield mesh
    finally:
        stop_now(mesh)


def generate(
    address: str, chat: gateway_pb2.Chat, **sampling
) -> list[gateway_pb2.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(
            chat=chat, sampling=common_pb2.SamplingParams(**sampling)
        )
        return list(stub.Generate(request, timeout=120))


def http_chat(mesh, **body) -> dict:
    r = requests.post(
        f"http://{mesh.gateway_http_address}/v1/chat/completions", json=body, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_a_grpc_chat_is_the_http_chats_answer_and_transformers_prompt(mesh, model):
    """Seeded sampling: the same tokens and text as the HTTP API's answer to the same request;
    greedy: transformers' rendering of the conversation (tools and calls included) and its
    greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chat = pb_chat(MESSAGES, TOOLS, chat_template_kwargs='{"unused": 1}')
    replies = generate(
        mesh.gateway_address, chat, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True
    )
    ids = [t for r in replies for t in r.token_ids]
    text = "".join(r.text for r in replies)
    assert not any(r.tool_calls for r in replies)
    http = http_chat(
        mesh, messages=MESSAGES, tools=TOOLS, chat_template_kwargs={"unused": 1},
        max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, return_token_ids=True,
    )  # fmt: skip
    assert ids == http["choices"][0]["token_ids"] and len(ids) == 12
    assert text == http["choices"][0]["message"]["content"]

    tok = AutoTokenizer.from_pretrained(model)
    hf_messages = json.loads(json.dumps(MESSAGES))
    hf_messages[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    prompt = tok.apply_chat_template(
        hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert http["prompt_token_ids"] == prompt
    replies = generate(mesh.gateway_address, chat, max_tokens=8, ignore_eos=True)
    assert replies[-1].usage.prompt_tokens == len(prompt)
    lm = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    want, seq = [], list(prompt)
    with torch.no_grad():
        for _ in range(8):
            want.append(int(lm(torch.tensor([seq])).logits[0, -1].argmax()))
            seq.append(want[-1])
    assert [t for r in replies for t in r.token_ids] == want


def test_a_hermes_call_comes_back_whole_on_the_response_that_closed_it(mesh, model):
    """tool_choice auto: the model's text (here held to a Hermes call by a regex) is read by
    the gateway's hermes parser: `text` carries the content only, the call arrives once, whole,
    on the response whose tokens closed its JSON object; the HTTP API reads the same call."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    regex = common_pb2.StructuredOutput(regex=CALL_RE)
    sampling = dict(max_tokens=80, temperature=1.0, seed=3)
    replies = generate(
        mesh.gateway_address, pb_chat(messages, TOOLS), structured_output=regex, **sampling
    )
    assert "".join(r.text for r in replies) == "Checking."
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    [(at, reply)] = [(i, r) for i, r in enumerate(replies) if r.tool_calls]
    [call] = reply.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    through = [t for r in replies[: at + 1] for t in r.token_ids]
    before = [t for r in replies[:at] for t in r.token_ids]
    assert '"}}' in tok.decode(through) and '"}}' not in tok.decode(before)

    http = http_chat(
        mesh, messages=messages, tools=TOOLS, structured_outputs={"regex": CALL_RE}, **sampling
    )
    message = http["choices"][0]["message"]
    assert message["content"] == "Checking."
    [http_call] = message["tool_calls"]
    assert (http_call["function"]["name"], http_call["function"]["arguments"]) == (
        call.name,
        call.arguments,
    )


# Seeds whose forced answers on the tiny model hold 2-3 calls (~35 tokens each) when allowed.
SEEDS = (1, 2, 4)


def test_parallel_tool_calls_false_keeps_one_call(mesh):
    """auto: the first of the model's two calls; required: the constraint allows exactly one
    (several with parallel_tool_calls unset, as these seeds draw); a named function: one call
    of it."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    one = CALL_RE.removeprefix(r"Checking\.\n")
    two = common_pb2.StructuredOutput(regex=f"{one}\n{one}")
    both = generate(mesh.gateway_address, pb_chat(messages, TOOLS), structured_output=two,
                    max_tokens=120)  # fmt: skip
    first = generate(
        mesh.gateway_address,
        pb_chat(messages, TOOLS, parallel_tool_calls=False),
        structured_output=two,
        max_tokens=120,
    )
    assert len([c for r in both for c in r.tool_calls]) == 2
    [call] = [c for r in first for c in r.tool_calls]
    assert call.arguments == next(c for r in both for c in r.tool_calls).arguments

    counts = {}
    for parallel in (None, False):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        chat = pb_chat(messages, BOUNDED, tool_choice_mode="required", **extra)
        counts[parallel] = []
        for seed in SEEDS:
            replies = generate(
                mesh.gateway_address, chat, max_tokens=200, temperature=1.0, seed=seed
            )
            calls = [c for r in replies for c in r.tool_calls]
            assert all(json.loads(c.arguments)["city"] in ("Paris", "Rome") for c in calls)
            counts[parallel].append(len(calls))
    assert counts[False] == [1, 1, 1]
    assert min(counts[None]) >= 2, counts
    chat = pb_chat(messages, BOUNDED, tool_choice_function="get_time")
    [call] = [c for r in generate(mesh.gateway_address, chat, max_tokens=60) for c in r.tool_calls]
    assert call.name == "get_time"


@pytest.fixture(scope="module")
def bare_gateway(model):
    """A gateway without --tool-call-parser and without workers: a refusal comes before any
    routing."""
    mesh = start_mesh(model, prefill=0, decode=0, colocated=0)
    try:
        yield mesh.gateway_address
    finally:
        stop_now(mesh)


USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "chat, sampling, words",
    [
        (pb_chat(USER, TOOLS), {}, "--tool-call-parser"),
        (pb_chat(USER, TOOLS, tool_choice_function="nope"), {}, "not among the tools"),
        (pb_chat(USER, TOOLS, tool_choice_mode="sometimes"), {}, "chat.tool_choice_mode"),
        (
            gateway_pb2.Chat(
                messages=[gateway_pb2.ChatMessage(role="user", content="Hi")],
                tools=[gateway_pb2.Tool(name="f", parameters="{bad")],
            ),
            {},
            "chat.tools[0].parameters is not valid JSON",
        ),
        (pb_chat(USER, [], chat_template_kwargs="[1]"), {}, "must be a JSON object"),
        (pb_chat(USER, [], chat_template_kwargs='{"tools": 1}'), {}, "may not set 'tools'"),
        (
            pb_chat(USER, TOOLS, tool_choice_mode="required"),
            {"structured_output": common_pb2.StructuredOutput(json_object=True)},
            "cannot also follow",
        ),
        (gateway_pb2.Chat(), {}, "'messages' is empty"),
        (pb_chat([{"role": "robot", "content": "x"}], []), {}, "messages[0]"),
    ],
)
def test_chat_refusals_are_invalid_argument_naming_the_field(bare_gateway, chat, sampling, words):
    with pytest.raises(grpc.RpcError) as err:
        generate(bare_gateway, chat, **sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert words in err.value.details()
