"""Parsing OpenAI request bodies: what is accepted, what each field becomes, what is refused."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidRequest
from services.gateway.chat_template import ChatPrompt
from services.gateway.openai_protocol import CHAT, COMPLETIONS, Reply, parse


def render(messages):
    return ChatPrompt("|".join(f"{m['role']}:{m['content']}" for m in messages), (3,), ("END",))


def test_defaults_follow_openai():
    call = parse(COMPLETIONS, {"prompt": "hi"})
    assert call.params.max_tokens == 16 and call.params.temperature == 1.0
    assert call.params.top_p == 1.0 and call.params.seed is None
    assert not call.fill_context and call.add_special_tokens
    assert not call.stream and not call.include_usage and call.model is None
    chat = parse(CHAT, {"messages": [{"role": "user", "content": "hi"}]}, render)
    assert chat.fill_context and not chat.add_special_tokens  # the template writes specials


def test_fields_become_sampling_parameters():
    call = parse(
        COMPLETIONS,
        {
            "model": "m",
            "prompt": ["only one"],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "seed": 3,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u1",
            "ignore_eos": True,
            "stop_token_ids": [9],
            "unknown_field": {"ignored": True},
        },
    )
    p = call.params
    assert call.prompt == "only one" and call.model == "m" and call.user == "u1"
    assert p.max_tokens == 7  # max_completion_tokens wins
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0, 0.5, 0, 3)
    assert p.stop == ("\n",) and p.stop_token_ids == (9,) and p.ignore_eos
    assert call.stream and call.include_usage
    assert parse(COMPLETIONS, {"prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]
    assert parse(COMPLETIONS, {"prompt": [1, 2, 3]}).prompt == [1, 2, 3]


def test_penalties_min_p_min_tokens_and_logit_bias_become_sampling_parameters():
    body = {
        "prompt": "x",
        "max_tokens": 30,
        "presence_penalty": -0.5,
        "frequency_penalty": 2,
        "repetition_penalty": 1.2,
        "min_p": 0.05,
        "min_tokens": 30,
        "logit_bias": {"50256": -100, "7": 3.5},
    }
    p = parse(COMPLETIONS, body).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-0.5, 2, 1.2)
    assert (p.min_p, p.min_tokens) == (0.05, 30)
    assert p.logit_bias == ((7, 3.5), (50256, -100))  # integer ids, in id order
    off = parse(COMPLETIONS, {"prompt": "x"}).params
    assert not off.processed and off.logit_bias == () and off.repetition_penalty == 1.0
    # Chat without max_tokens fills the context later: min_tokens above 16 is no error here.
    chat = parse(CHAT, {"messages": [{"role": "user", "content": "x"}], "min_tokens": 40}, render)
    assert chat.fill_context and chat.params.min_tokens == 40


def test_chat_messages_are_flattened_and_the_template_adds_its_end_of_turn():
    call = parse(
        CHAT,
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "c"},
            ],
            "stop": ["x"],
        },
        render,
    )  # fmt: skip
    assert call.prompt == "developer:a\nb|assistant:|user:c"
    assert call.params.stop == ("x", "END") and call.params.stop_token_ids == (3,)


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (COMPLETIONS, {"prompt": "x", "n": 2}, "n"),
        (COMPLETIONS, {"prompt": "x", "echo": True}, "echo"),
        (COMPLETIONS, {"prompt": "x", "best_of": 3}, "best_of"),
        (COMPLETIONS, {"prompt": "x", "suffix": "s"}, "suffix"),
        (COMPLETIONS, {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        (COMPLETIONS, {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        (COMPLETIONS, {"prompt": "x", "min_p": 1.5}, "min_p"),
        (COMPLETIONS, {"prompt": "x", "min_tokens": -1}, "min_tokens"),
        (COMPLETIONS, {"prompt": "x", "min_tokens": 17}, "min_tokens"),  # > max_tokens 16
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"-5": 1}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": "1"}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": [5, 1]}, "logit_bias"),
        (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": True}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "seed": 1.5}, "seed"),
        (COMPLETIONS, {"prompt": "x", "temperature": float("nan")}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
        (COMPLETIONS, {"prompt": [True]}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
         "tool_choice"),
        (CHAT, {"messages": [{"content": "x"}]}, "messages"),
    ],
)  # fmt: skip
def test_invalid_or_unsupported_fields_are_refused_by_name(endpoint, body, param):
    with pytest.raises(InvalidRequest) as err:
        parse(endpoint, body, render)
    assert err.value.param == param


def test_replies_have_openais_shape():
    call = parse(
        COMPLETIONS, {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    )
    reply = Reply(call, "cmpl-1", 10, "m")
    chunk = reply.chunk("hi", None)
    assert chunk["object"] == "text_completion" and chunk["usage"] is None
    assert chunk["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]
    last = reply.usage_chunk({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3})
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 3
    chat = Reply(parse(CHAT, {"messages": [{"role": "user", "content": "x"}]}, render), "c", 1, "m")
    assert chat.chunk("a", None, first=True)["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "a",
    }
    assert chat.chunk("", "stop")["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
    }  # fmt: skip
    assert "usage" not in chat.chunk("b", None)  # only with include_usage
