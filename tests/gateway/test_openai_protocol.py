"""Parsing OpenAI request bodies: what is accepted, what each field becomes, what is refused."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidRequest
from services.common.logprobs import TokenLogprobs
from services.gateway.chat_template import ChatPrompt
from services.gateway.openai_protocol import (
    CHAT,
    COMPLETIONS,
    Answer,
    Reply,
    parse,
    parse_tokenize,
)

HI = [{"role": "user", "content": "hi"}]


def render(messages, variables):
    """A stand-in template that shows what it was given: messages, then its variables."""
    text = "|".join(f"{m['role']}:{m['content']}" for m in messages)
    return ChatPrompt(f"{text}#{sorted(variables.items())}", (3,), ("END",))


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
            "presence_penalty": 0.0,  # a refused field at its default changes nothing
            "unknown_field": None,  # null is unset, for any field
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
    assert call.prompt == "developer:a\nb|assistant:|user:c#[('add_generation_prompt', True)]"
    assert call.params.stop == ("x", "END") and call.params.stop_token_ids == (3,)


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (COMPLETIONS, {"prompt": "x", "n": 17}, "n"),
        (COMPLETIONS, {"prompt": "x", "echo": 1}, "echo"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options"),
        (COMPLETIONS, {"prompt": "x", "stream": True, "stream_options": {"usage": True}},
         "stream_options"),
        (COMPLETIONS, {"prompt": "x", "stream": True,
                       "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
        (COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        (COMPLETIONS, {"prompt": "x", "messages": HI}, "messages"),
        (CHAT, {"messages": HI, "suffix": "s"}, "suffix"),
        (CHAT, {"messages": HI, "echo": True}, "echo"),
        (CHAT, {"messages": HI, "chat_template_kwargs": {"messages": []}},
         "chat_template_kwargs"),
        (CHAT, {"messages": HI, "chat_template_kwargs": {"add_generation_prompt": False}},
         "chat_template_kwargs"),
        (CHAT, {"messages": HI, "chat_template_kwargs": ["enable_thinking"]},
         "chat_template_kwargs"),
        (CHAT, {"messages": HI, "continue_final_message": True, "add_generation_prompt": True},
         "continue_final_message"),
        (CHAT, {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]},
         "messages"),
        (COMPLETIONS, {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        (COMPLETIONS, {"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
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
        (COMPLETIONS, {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
         "stream_options"),
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


def test_unknown_fields_are_refused_naming_the_field_meant():
    with pytest.raises(InvalidRequest) as err:
        parse(CHAT, {"messages": HI, "temprature": 0.5}, render)
    assert err.value.param == "temprature" and "did you mean 'temperature'?" in str(err.value)
    with pytest.raises(InvalidRequest) as err:
        parse(COMPLETIONS, {"prompt": "x", "frobnicate": {"a": 1}})
    assert err.value.param == "frobnicate" and "refuses fields it does not know" in str(err.value)


def test_a_refused_field_says_why_and_what_to_send_instead():
    with pytest.raises(InvalidRequest) as err:
        parse(COMPLETIONS, {"prompt": "x", "length_penalty": 2})
    assert str(err.value) == (
        "'length_penalty' = 2 is not supported: it applies to beam search, which is not "
        "supported (leave it unset or send 1)"
    )
    # JSON equality: 0.0 is the default 0, but true is not 1 and false is not 0.
    assert parse(COMPLETIONS, {"prompt": "x", "length_penalty": 1.0, "frequency_penalty": 0.0})
    for body in ({"length_penalty": True}, {"use_beam_search": 0}):
        with pytest.raises(InvalidRequest):
            parse(COMPLETIONS, {"prompt": "x", **body})


def test_chat_fields_become_template_variables():
    call = parse(
        CHAT,
        {
            "messages": HI,
            "add_generation_prompt": False,
            "documents": [{"title": "t", "text": "d"}],
            "chat_template_kwargs": {"enable_thinking": False},
        },
        render,
    )
    assert call.prompt == (
        "user:hi#[('add_generation_prompt', False), ('documents', [{'title': 't', 'text': 'd'}]), "
        "('enable_thinking', False)]"
    )


def test_continue_final_message_ends_the_prompt_at_the_last_message_and_echo_repeats_it():
    messages = [*HI, {"role": "assistant", "content": "The answer is "}]
    call = parse(CHAT, {"messages": messages, "continue_final_message": True, "echo": True}, render)
    assert call.prompt == "user:hi|assistant:The answer is"  # the template's tail is cut
    assert call.echo and call.continued == "The answer is "
    with pytest.raises(InvalidRequest) as err:  # nothing to continue
        parse(CHAT, {"messages": [*HI, {"role": "assistant", "content": " "}],
                     "continue_final_message": True}, render)  # fmt: skip
    assert err.value.param == "continue_final_message"


def test_tokenize_takes_a_prompt_or_messages():
    call = parse_tokenize({"prompt": "hi", "return_token_strs": True}, render)
    assert (call.prompt, call.add_special_tokens, call.return_token_strs) == ("hi", True, True)
    call = parse_tokenize({"messages": HI, "add_generation_prompt": False}, render)
    assert call.prompt == "user:hi#[('add_generation_prompt', False)]"
    assert not call.add_special_tokens
    for body in ({"prompt": [1, 2]}, {"prompt": "x", "max_tokens": 3}, {}):
        with pytest.raises(InvalidRequest):
            parse_tokenize(body, render)


def test_replies_have_openais_shape():
    call = parse(
        COMPLETIONS, {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    )
    reply = Reply(call, "cmpl-1", 10, "m", [1, 2])
    used = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    chunk = reply.chunk("hi", None, [5], used)
    assert chunk["object"] == "text_completion" and chunk["usage"] is None
    assert chunk["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]
    last = reply.usage_chunk(used)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 3
    chat = Reply(parse(CHAT, {"messages": HI}, render), "c", 1, "m", [1])
    assert chat.chunk("a", None, [5], used, first=True)["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "a",
    }
    assert chat.chunk("", "stop", [], used)["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
    }  # fmt: skip
    assert "usage" not in chat.chunk("b", None, [6], used)  # only with include_usage


def test_return_token_ids_and_continuous_usage_add_to_the_replies():
    body = {"stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    used = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    text = Reply(parse(COMPLETIONS, {"prompt": "x", **body}), "cmpl-1", 1, "m", [1, 2])
    first = text.chunk("a", None, [7], used, first=True)
    assert first["choices"][0]["token_ids"] == [7] and first["usage"] == used
    assert first["choices"][0]["prompt_token_ids"] == [1, 2]
    assert "prompt_token_ids" not in text.chunk("b", None, [8], used)["choices"][0]
    whole = text.whole([Answer(0, "ab", "stop", [7, 8])], used)["choices"][0]
    assert (whole["token_ids"], whole["prompt_token_ids"]) == ([7, 8], [1, 2])
    chat = Reply(parse(CHAT, {"messages": HI, **body}, render), "c", 1, "m", [1, 2])
    first = chat.chunk("a", None, [7], used, first=True)
    assert first["prompt_token_ids"] == [1, 2] and first["choices"][0]["token_ids"] == [7]
    whole = chat.whole([Answer(0, "ab", "stop", [7, 8])], used)
    assert whole["prompt_token_ids"] == [1, 2] and whole["choices"][0]["token_ids"] == [7, 8]


@pytest.mark.parametrize(
    ("endpoint", "body", "want"),
    [
        (COMPLETIONS, {"logprobs": 3}, (3, None)),
        (COMPLETIONS, {"logprobs": 0}, (0, None)),
        (COMPLETIONS, {"logprobs": False}, (None, None)),
        (COMPLETIONS, {"logprobs": 2, "echo": True}, (2, 2)),  # the echoed prompt's too
        (COMPLETIONS, {"logprobs": 2, "echo": True, "prompt_logprobs": 5}, (2, 5)),
        (COMPLETIONS, {"prompt_logprobs": 0}, (None, 0)),
        (CHAT, {"logprobs": True}, (0, None)),
        (CHAT, {"logprobs": True, "top_logprobs": 20}, (20, None)),
        (CHAT, {"logprobs": False, "top_logprobs": 0}, (None, None)),
        (CHAT, {"prompt_logprobs": 4}, (None, 4)),
    ],
)
def test_logprobs_fields_become_sampling_parameters(endpoint, body, want):
    prompt = {"prompt": "x"} if endpoint == COMPLETIONS else {"messages": HI}
    params = parse(endpoint, {**prompt, **body}, render).params
    assert (params.logprobs, params.prompt_logprobs) == want


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (COMPLETIONS, {"logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"logprobs": -1}, "logprobs"),
        (COMPLETIONS, {"logprobs": True}, "logprobs"),
        (COMPLETIONS, {"prompt_logprobs": 21}, "prompt_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        (CHAT, {"logprobs": 3}, "logprobs"),
        (CHAT, {"prompt_logprobs": 99}, "prompt_logprobs"),
    ],
)  # fmt: skip
def test_bad_logprobs_fields_are_refused_by_name(endpoint, body, param):
    prompt = {"prompt": "x"} if endpoint == COMPLETIONS else {"messages": HI}
    with pytest.raises(InvalidRequest) as err:
        parse(endpoint, {**prompt, **body}, render)
    assert err.value.param == param


def texts(ids):
    return [f"<{t}>" for t in ids]


LP = [
    TokenLogprobs(7, -0.5, 1, (7, 9, 3), (-0.5, -1.5, -2.0)),
    TokenLogprobs(3, -2.0, 3, (7, 9, 3), (-0.25, -1.0, -2.0)),
]
PROMPT_LP = [TokenLogprobs(2, float("-inf"), 90, (4, 5), (-0.1, -2.5))]


def test_completion_logprobs_have_vllms_shape_and_offsets_run_on_across_chunks():
    call = parse(COMPLETIONS, {"prompt": "x", "logprobs": 1, "echo": True, "stream": True})
    reply = Reply(call, "cmpl-1", 1, "m", [1, 2], texts)
    first = reply.chunk("x<7>", None, [7], {}, first=True, logprobs=LP[:1], prompt=PROMPT_LP)
    assert first["choices"][0]["logprobs"] == {
        "tokens": ["<1>", "<2>", "<7>"],
        "token_logprobs": [None, -9999.0, -0.5],  # nothing predicts the first; -inf floored
        "top_logprobs": [None, {"<2>": -9999.0, "<4>": -0.1}, {"<7>": -0.5}],
        "text_offset": [0, 3, 6],
    }
    assert first["choices"][0]["prompt_logprobs"] == [
        None,
        {"2": {"logprob": -9999.0, "rank": 90, "decoded_token": "<2>"},
         "4": {"logprob": -0.1, "rank": 1, "decoded_token": "<4>"},
         "5": {"logprob": -2.5, "rank": 2, "decoded_token": "<5>"}},
    ]  # fmt: skip
    second = reply.chunk("<3>", "length", [3], {}, logprobs=LP[1:])["choices"][0]
    assert second["logprobs"] == {
        "tokens": ["<3>"],
        "token_logprobs": [-2.0],
        "top_logprobs": [{"<3>": -2.0, "<7>": -0.25}],  # the chosen one, and the top 1
        "text_offset": [9],
    }
    assert "prompt_logprobs" not in second


def test_chat_logprobs_have_openais_shape_and_tokens_may_be_ids():
    body = {"messages": HI, "logprobs": True, "top_logprobs": 2}
    reply = Reply(parse(CHAT, body, render), "c", 1, "m", [1], texts)
    whole = reply.whole([Answer(0, "<7><3>", "stop", [7, 3], LP)], {})
    content = whole["choices"][0]["logprobs"]["content"]
    assert content[1] == {
        "token": "<3>", "logprob": -2.0, "bytes": list(b"<3>"),
        "top_logprobs": [{"token": "<7>", "logprob": -0.25, "bytes": list(b"<7>")},
                         {"token": "<9>", "logprob": -1.0, "bytes": list(b"<9>")}],
    }  # fmt: skip
    assert "prompt_logprobs" not in whole
    ids = Reply(parse(CHAT, {**body, "return_tokens_as_token_ids": True}, render), "c", 1, "m",
                [1], texts)  # fmt: skip
    assert (
        ids.whole([Answer(0, "", "stop", [7], LP[:1])], {})["choices"][0]["logprobs"]["content"][0][
            "token"
        ]
        == "token_id:7"
    )
    plain = Reply(parse(CHAT, {"messages": HI}, render), "c", 1, "m", [1], texts)
    assert plain.whole([Answer(0, "", "stop", [7])], {})["choices"][0]["logprobs"] is None
