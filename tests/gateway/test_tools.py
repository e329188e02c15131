"""Tool calling: the parsers on literal model outputs, and the official `openai` client's flow
against a real gateway (`--tool-call-parser hermes`) and a real worker.

A tiny model with random weights writes no tool call of its own, so the end-to-end tests put
the model's text in place honestly, without a stand-in for any part: the conversation ends
with an assistant message holding the call text, `continue_final_message` renders it open and
`echo` returns it as the answer's start, and `logit_bias` on an EOS id makes the model's own
next token end the turn. The answer the gateway parses is then exactly that text, through the
real worker, detokenizer and reply path. Arguments streamed in pieces by the model itself are
shown by forcing one token (`logit_bias` on "1") inside an open arguments object. The
parsers' streaming is also checked token by token on literal outputs split at the tiny
tokenizer's own token boundaries.
"""

from __future__ import annotations

import json
import shutil

import pytest
import requests

from services.gateway.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    ToolCallStream,
    tool_parser,
)
from tests.conftest import start_mesh, stop_now

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'
HERMES = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>"
# A Hermes-style template that renders what transformers' apply_chat_template passes: tools,
# assistant tool_calls (arguments as objects) and tool messages with their tool_call_id.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}"
    "{% endif %}{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}<tool_call>\n"
    '{"name": "{{ c["function"]["name"] }}", "arguments": {{ c["function"]["arguments"] '
    "| tojson }}}\n</tool_call>{% endfor %}{% endif %}{% if m['role'] == 'tool' %} "
    "(for {{ m['tool_call_id'] }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
USER = {"role": "user", "content": "What is the weather in Paris?"}


# The parsers on literal outputs ---------------------------------------------------------------


def test_hermes_reads_content_before_the_call_and_the_calls_arguments_as_written():
    parsed = HermesParser().parse(HERMES)
    assert parsed.content == "Let me check." and not parsed.malformed
    [call] = parsed.calls
    assert call.name == "get_weather"
    assert call.arguments == '{"city": "Paris", "unit": "°C"}'


def test_hermes_reads_several_calls_and_a_call_cut_before_its_end_tag():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"arguments": {"x": [1, "}"]}, "name": "b"}'
    )
    parsed = HermesParser().parse(text)
    assert parsed.content == ""
    assert [(c.name, c.arguments) for c in parsed.calls] == [("a", "{}"), ("b", '{"x": [1, "}"]}')]


def test_llama3_json_reads_calls_separated_by_semicolons_after_the_python_tag():
    text = '<|python_tag|>{"name": "a", "parameters": {"q": 1}}; {"name": "b", "arguments": {}}'
    parsed = Llama3JsonParser().parse(text)
    assert parsed.content == ""
    assert [(c.name, c.arguments) for c in parsed.calls] == [("a", '{"q": 1}'), ("b", "{}")]
    assert Llama3JsonParser().parse("It is sunny.").calls == ()


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", '<tool_call>{"name": "a", "arguments": {"q": 1</tool_call>'),  # bad JSON
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("hermes", '<tool_call>{"name": "a", "arguments": "q=1"}</tool_call>'),  # not an object
        ("hermes", '<tool_call>{"name": "a", "arguments": {}} trailing</tool_call>'),
        ("hermes", '<tool_call>{"name": "a", "argu'),  # cut off by max_tokens
        ("llama3_json", '{"name": "a", "parameters": {"q": 1}'),
        ("llama3_json", '{"name": "a", "parameters": {}} and then text'),
    ],
)
def test_an_unreadable_call_makes_the_whole_text_content(parser, text):
    parsed = tool_parser(parser).parse(text)
    assert parsed.malformed and parsed.calls == () and parsed.content == text


def _stream(parser, pieces: list[str]) -> tuple[str, list[dict], bool, int]:
    stream, content, deltas, sends = ToolCallStream(parser), "", [], 0
    for i, piece in enumerate(pieces):
        c, d, called = (
            stream.finish(piece) if i == len(pieces) - 1 else (*stream.feed(piece), False)
        )
        content += c
        deltas += d
        sends += bool(d)
    return content, deltas, called, sends


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", HERMES),
        ("hermes", f"<tool_call>{CALL}</tool_call>\n<tool_call>{CALL}</tool_call>"),
        ("hermes", "No tool is needed: <tool not a tag>"),
        ("llama3_json", f"{CALL}; {CALL}"),
        ("llama3_json", "Plain answer."),
    ],
)
def test_streamed_pieces_add_up_to_the_whole_parse(tiny_model, parser, text):
    """Fed at the tiny tokenizer's token boundaries, the deltas add up to the whole parse:
    each call's index, id, type and name once, then its arguments in several pieces."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok.encode(text, add_special_tokens=False)
    pieces, sent = [], 0
    for i in range(len(ids)):  # as a detokenizer streams: whole characters only
        so_far = tok.decode(ids[: i + 1])
        if not so_far.endswith("\ufffd"):
            pieces.append(so_far[sent:])
            sent = len(so_far)
    assert "".join(pieces) == text
    p = tool_parser(parser)
    content, deltas, called, sends = _stream(p, pieces)
    whole = p.parse(text)
    assert content == whole.content and called == bool(whole.calls)
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function"
            calls[d["index"]] = {"id": d["id"], **d["function"]}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    got = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert got == [(c.name, c.arguments) for c in whole.calls]
    assert len({c["id"] for c in calls.values()}) == len(calls)
    if whole.calls:
        assert sends > len(whole.calls)  # arguments came in pieces


def test_a_streamed_call_found_unreadable_after_its_start_ends_the_stream_with_an_error():
    from services.gateway.tool_parsers import MalformedToolCall

    stream = ToolCallStream(HermesParser())
    _, deltas = stream.feed('<tool_call>{"name": "a", "arguments": {"q": 1')
    assert deltas[0]["function"]["name"] == "a"
    with pytest.raises(MalformedToolCall, match="could not be read"):
        stream.finish("</tool_call>")


# End to end, with the openai client -------------------------------------------------------


@pytest.fixture(scope="module")
def model(model_factory, tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(model_factory("tiny"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def server(model):
    """(HTTP address, eos id) of a gateway with --tool-call-parser hermes, one colocated
    worker."""
    mesh = start_mesh(
        model, prefill=0, decode=0, colocated=1, gateway_args=("--tool-call-parser", "hermes")
    )
    eos = json.loads((model / "generation_config.json").read_text())["eos_token_id"]
    try:
        yield mesh.gateway_http_address, eos[0] if isinstance(eos, list) else eos
    finally:
        stop_now(mesh)


def _client(address: str):
    from openai import OpenAI

    return OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0)


def _answer_with(text: str, eos: int) -> dict:
    """Request fields that make the answer exactly `text`: the model continues an assistant
    message holding it, echoed, and its own first token is EOS (logit_bias)."""
    return {
        "messages": [USER, {"role": "assistant", "content": text}],
        "tools": TOOLS,
        "max_tokens": 4,
        "temperature": 0,
        "logit_bias": {str(eos): 100},
        "extra_body": {"continue_final_message": True, "add_generation_prompt": False,
                       "echo": True},
    }  # fmt: skip


def test_the_clients_tool_calling_flow_reaches_the_template_as_transformers_renders_it(
    server, model
):
    """tools -> message.tool_calls (finish_reason tool_calls) -> the client sends the call
    back with a tool message -> the next prompt is transformers' rendering of it."""
    from transformers import AutoTokenizer

    address, eos = server
    client = _client(address)
    reply = client.chat.completions.create(model=model.name, **_answer_with(HERMES, eos))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "°C"}

    messages = [
        USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 °C, sunny"},
    ]
    second = client.chat.completions.create(
        model=model.name, messages=messages, tools=TOOLS, max_tokens=2,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    hf_messages = [
        USER,
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Paris", "unit": "°C"},
                    },
                }
            ],
        },
        messages[2],
    ]
    want = AutoTokenizer.from_pretrained(model).apply_chat_template(
        hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert second.model_extra["prompt_token_ids"] == want
    assert "18 °C, sunny (for call_" in AutoTokenizer.from_pretrained(model).decode(want)


def test_streamed_tool_calls_accumulate_to_the_whole_reply(server, model):
    address, eos = server
    chunks = list(
        _client(address).chat.completions.create(
            model=model.name, stream=True, **_answer_with(HERMES, eos)
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert content == "Let me check."
    assert [d.index for d in deltas] == [0] and deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris", "unit": "°C"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_arguments_the_model_writes_stream_in_pieces_and_a_cut_call_is_content(server, model):
    """The model writes "1" four times (logit_bias) into an open arguments object: each token
    after the first chunk is its own `arguments` delta; max_tokens cuts the call, so streamed
    it ends with an error event, and whole it is returned as content with finish_reason
    length."""
    from transformers import AutoTokenizer

    address, _ = server
    one = AutoTokenizer.from_pretrained(model).encode("1", add_special_tokens=False)
    start = '<tool_call>\n{"name": "get_weather", "arguments": {"n": 1'
    body = {
        "model": model.name,
        "messages": [USER, {"role": "assistant", "content": start}],
        "tools": TOOLS, "max_tokens": 4, "temperature": 0, "logit_bias": {str(one[0]): 100},
        "continue_final_message": True, "add_generation_prompt": False, "echo": True,
    }  # fmt: skip
    url = f"http://{address}/v1/chat/completions"
    whole = requests.post(url, json=body, timeout=60).json()
    choice = whole["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": start + "1111"}
    assert choice["finish_reason"] == "length"
    r = requests.post(url, json={**body, "stream": True}, timeout=60)
    events = [e[6:] for e in r.text.split("\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [d for c in chunks if "choices" in c for d in c["choices"][0]["delta"].get(
        "tool_calls", [])]  # fmt: skip
    # The first chunk carries the echo and the first token; the last token comes with the
    # end, where the cut call is found unreadable: the two between are a delta each.
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": '{"n": 11'}
    assert [d["function"]["arguments"] for d in deltas[1:]] == ["1", "1"]
    assert "could not be read" in chunks[-1]["error"]["message"]


def test_tool_choice_none_renders_tools_and_returns_text(server, model):
    address, eos = server
    reply = _client(address).chat.completions.create(
        model=model.name, tool_choice="none", **_answer_with(HERMES, eos)
    )
    assert reply.choices[0].message.content == HERMES
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot also follow response_format or another",
        ),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        ({"tools": None, "tool_choice": "auto"}, "tool_choice", "needs 'tools'"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "only function tools"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(server, model, fields, param, words):
    address, _ = server
    body = {"model": model.name, "messages": [USER], "tools": TOOLS, **fields}
    r = requests.post(f"http://{address}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert words in r.json()["error"]["message"]


# A city among two and nothing else: a forced call's answer is short whatever the random model
# draws (an open string could run to max_tokens).
BOUNDED = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    for name in ("get_weather", "get_time")
]


# Seeds whose forced answers on the tiny model hold 2-3 calls (~35 tokens each) when allowed.
SEEDS = (1, 2, 4)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_calls_are_valid_against_their_tools_schema(server, model, choice, stream):
    """tool_choice "required" or a named function: generation is constrained (structured
    output) to calls of the tools (one call of the named one), their parameters valid against
    the tool's schema; the reply holds them as tool_calls whatever the model (here a random
    one)."""
    address, _ = server
    fields = dict(
        model=model.name, messages=[USER], tools=BOUNDED, tool_choice=choice, max_tokens=200,
        temperature=1.0, seed=SEEDS[0],
    )  # fmt: skip
    client = _client(address)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **fields))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        calls: dict[int, list[str]] = {}
        for d in deltas:
            calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
        got = [tuple(calls[i]) for i in sorted(calls)]
        reason = next(c.choices[0].finish_reason for c in chunks[::-1] if c.choices)
    else:
        reply = client.chat.completions.create(**fields)
        got = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls]
        reason = reply.choices[0].finish_reason
    assert reason == "tool_calls" and got
    names = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    for name, arguments in got:
        assert name in names and json.loads(arguments)["city"] in ("Paris", "Rome")
    if choice != "required":
        assert len(got) == 1


def test_parallel_tool_calls_in_the_clients_flow(server, model):
    """tool_choice "required": one or more calls by default (these seeds draw several), exactly
    one with parallel_tool_calls false (the constraint allows no second); under "auto", false
    keeps the first of the calls the model wrote."""
    address, eos = server
    client = _client(address)
    counts: dict[bool, list[int]] = {True: [], False: []}
    for parallel in (True, False):
        for seed in SEEDS:
            reply = client.chat.completions.create(
                model=model.name, messages=[USER], tools=BOUNDED, tool_choice="required",
                parallel_tool_calls=parallel, max_tokens=200, temperature=1.0, seed=seed,
            )  # fmt: skip
            calls = reply.choices[0].message.tool_calls
            assert reply.choices[0].finish_reason == "tool_calls"
            assert all(json.loads(c.function.arguments)["city"] in ("Paris", "Rome") for c in calls)
            counts[parallel].append(len(calls))
    assert counts[False] == [1] * len(SEEDS) and min(counts[True]) >= 2, counts

    rome = CALL.replace("Paris", "Rome")
    two = f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{rome}\n</tool_call>"
    cities = []
    for parallel in (True, False):
        reply = client.chat.completions.create(
            model=model.name, parallel_tool_calls=parallel, **_answer_with(two, eos)
        )
        cities.append([json.loads(c.function.arguments)["city"] for c in
                       reply.choices[0].message.tool_calls])  # fmt: skip
    assert cities == [["Paris", "Rome"], ["Paris"]]
