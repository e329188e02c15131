"""Nothing silently ignored, as a rule: every request field of OpenAI's API and of vLLM's is
walked against a real gateway and worker, on both generation endpoints. Each field is honoured
(200, and its effect shows in the reply, checked against transformers on the same folder where
it is about the prompt) or refused (400 naming it); a field of the other endpoint or of neither
list is refused too, naming the field meant. Then the other endpoints: /tokenize, /detokenize,
/version, /v1/models' max_model_len, the 404 of what is not served, /metrics."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest
import requests

from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.gateway import openai_fields
from tests.conftest import start_mesh, stop_now
from tests.gateway.test_tools import BOUNDED

C, H = "completions", "chat"
BOTH = (C, H)
HONOURED, REFUSED = "honoured", "refused"
PATH = {C: "/v1/completions", H: "/v1/chat/completions"}

# Every field of vLLM's CompletionRequest and ChatCompletionRequest (vllm-project/vllm at
# d5dba2d7b0ab: vllm/entrypoints/openai/completion/protocol.py and chat_completion/protocol.py),
# the guided_* fields of its older versions, and every field OpenAI's API reference defines for
# POST /v1/completions and POST /v1/chat/completions: (name, endpoints, status, a value other
# than the default). Written out here, not read from the server's table: the test holds the
# server to the lists as their authors wrote them.
KNOWN = [
    # OpenAI, both endpoints
    ("model", BOTH, HONOURED, "SERVED"),
    ("max_tokens", BOTH, HONOURED, 3),
    ("temperature", BOTH, HONOURED, 5.0),
    ("top_p", BOTH, HONOURED, 1e-9),
    ("seed", BOTH, HONOURED, 7),
    ("stop", BOTH, HONOURED, "FROM_REFERENCE"),
    ("n", BOTH, HONOURED, 2),
    ("stream", BOTH, HONOURED, True),
    ("stream_options", BOTH, HONOURED, {"include_usage": True, "continuous_usage_stats": True}),
    ("user", BOTH, HONOURED, "walker"),
    ("frequency_penalty", BOTH, HONOURED, 2.0),
    ("presence_penalty", BOTH, HONOURED, 2.0),
    ("logit_bias", BOTH, HONOURED, {"5": 100}),
    ("logprobs", (C,), HONOURED, 2),
    ("logprobs", (H,), HONOURED, True),
    # OpenAI, completions
    ("prompt", (C,), HONOURED, "REQUIRED"),
    ("best_of", (C,), HONOURED, 2),
    ("echo", (C,), HONOURED, True),
    ("suffix", (C,), REFUSED, "def f():"),
    # OpenAI, chat
    ("messages", (H,), HONOURED, "REQUIRED"),
    ("max_completion_tokens", (H,), HONOURED, 3),
    ("top_logprobs", (H,), HONOURED, 2),
    (
        "response_format",
        BOTH,
        HONOURED,
        {
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": {"enum": ["red", "green", "blue"]}},
        },
    ),  # vLLM: completions too
    ("tools", (H,), HONOURED, [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", (H,), HONOURED, "none"),
    ("parallel_tool_calls", (H,), HONOURED, False),
    ("functions", (H,), REFUSED, [{"name": "f"}]),
    ("function_call", (H,), REFUSED, {"name": "f"}),
    ("reasoning_effort", (H,), REFUSED, "low"),
    ("verbosity", (H,), REFUSED, "low"),
    ("web_search_options", (H,), REFUSED, {}),
    ("prediction", (H,), REFUSED, {"type": "content", "content": "x"}),
    ("modalities", (H,), REFUSED, ["text", "audio"]),
    ("audio", (H,), REFUSED, {"voice": "alloy", "format": "wav"}),
    ("store", (H,), REFUSED, True),
    ("metadata", (H,), REFUSED, {"k": "v"}),
    ("service_tier", (H,), REFUSED, "flex"),
    ("prompt_cache_key", (H,), REFUSED, "k"),
    ("prompt_cache_retention", (H,), REFUSED, "24h"),
    ("safety_identifier", (H,), HONOURED, "walker"),
    # vLLM, both endpoints
    ("top_k", BOTH, HONOURED, 1),
    ("min_p", BOTH, HONOURED, 1.0),
    ("repetition_penalty", BOTH, HONOURED, 2.0),
    ("min_tokens", BOTH, HONOURED, 3),
    ("use_beam_search", BOTH, REFUSED, True),
    ("length_penalty", BOTH, REFUSED, 0.5),
    ("stop_token_ids", BOTH, HONOURED, "FROM_REFERENCE"),
    ("include_stop_str_in_output", BOTH, HONOURED, True),
    ("ignore_eos", BOTH, HONOURED, True),
    ("skip_special_tokens", BOTH, HONOURED, False),
    ("spaces_between_special_tokens", BOTH, REFUSED, False),
    ("truncate_prompt_tokens", BOTH, HONOURED, 2),
    ("prompt_logprobs", BOTH, HONOURED, 1),
    ("allowed_token_ids", BOTH, REFUSED, [5, 6]),
    ("add_special_tokens", BOTH, HONOURED, "FLIPPED"),
    ("structured_outputs", BOTH, HONOURED, {"regex": "[a-z]{2,4}-[0-9]"}),
    ("priority", BOTH, REFUSED, 1),
    ("request_id", BOTH, HONOURED, "walk-1"),
    ("logits_processors", BOTH, REFUSED, ["my.Processor"]),
    ("return_tokens_as_token_ids", BOTH, HONOURED, True),
    ("return_token_ids", BOTH, HONOURED, True),
    ("cache_salt", BOTH, REFUSED, "salt"),
    ("kv_transfer_params", BOTH, REFUSED, {"do_remote_prefill": True}),
    ("vllm_xargs", BOTH, REFUSED, {"a": 1}),
    ("max_repetition_pattern_size", BOTH, REFUSED, 4),
    ("min_repetition_pattern_size", BOTH, REFUSED, 2),
    ("repetition_min_count", BOTH, REFUSED, 3),
    # vLLM, completions
    ("prompt_embeds", (C,), REFUSED, "AAAA"),
    # vLLM, chat
    ("include_reasoning", (H,), REFUSED, False),
    ("bad_words", (H,), REFUSED, ["bad"]),
    ("echo", (H,), HONOURED, True),
    ("add_generation_prompt", (H,), HONOURED, False),
    ("continue_final_message", (H,), HONOURED, True),
    ("documents", (H,), HONOURED, [{"title": "Notes", "text": "Prefill computes the KV."}]),
    ("chat_template", (H,), REFUSED, "{{ messages }}"),
    ("chat_template_kwargs", (H,), HONOURED, {"enable_thinking": False}),
    ("mm_processor_kwargs", (H,), REFUSED, {"size": 1}),
    # vLLM before its structured_outputs field
    (
        "guided_json",
        BOTH,
        HONOURED,
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    ),
    ("guided_regex", BOTH, HONOURED, "[a-z]{2,4}-[0-9]"),
    ("guided_choice", BOTH, HONOURED, ["yes", "no"]),
    ("guided_grammar", BOTH, HONOURED, 'root ::= "x" [0-9] "y"'),
    ("guided_decoding_backend", BOTH, REFUSED, "xgrammar"),
    ("guided_whitespace_pattern", BOTH, REFUSED, " *"),
    ("structural_tag", (H,), REFUSED, "{}"),
    # This server's own: max_completion_tokens on completions too, as on chat
    ("max_completion_tokens", (C,), HONOURED, 3),
]
UNKNOWN = [("temprature", "temperature"), ("max_token", "max_tokens"), ("frobnicate", None)]

PROMPT = "The edge forwards every request to the gateway"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What does prefill do?"},
]
CONTINUED = [*MESSAGES, {"role": "assistant", "content": "Prefill runs"}]
EOS_PROMPT = "Stop right here"  # its greedy first tokens are made EOS ids of the test's model
# A chat template that reads what transformers' apply_chat_template passes (tools, documents,
# add_generation_prompt) and a kwarg of its own (enable_thinking, as Qwen3's does).
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}{% if documents %}<|im_start|>system\n"
    "{% for d in documents %}{{ d['title'] }}: {{ d['text'] }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def model(model_factory, tmp_path_factory):
    """The tiny model with TEMPLATE, and the greedy first tokens (transformers') of EOS_PROMPT,
    as a prompt and as a user's message, among its EOS ids: ignore_eos has something to
    ignore."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("fields") / "model"
    shutil.copytree(model_factory("tiny"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    tok = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    chat = [{"role": "user", "content": EOS_PROMPT}]
    prompts = [
        tok(EOS_PROMPT)["input_ids"],
        tok.apply_chat_template(chat, tokenize=True, return_dict=False, add_generation_prompt=True),
    ]
    with torch.no_grad():
        stops = {int(lm(torch.tensor([ids])).logits[0, -1].argmax()) for ids in prompts}
    generation = json.loads((path / "generation_config.json").read_text())
    given = generation["eos_token_id"]
    eos = sorted({*(given if isinstance(given, list) else [given]), *stops})
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": eos}))
    return path


@pytest.fixture(scope="module")
def server(model):
    """One colocated worker behind a gateway: (HTTP address, served name, transformers
    tokenizer of the same folder)."""
    from transformers import AutoTokenizer

    mesh = start_mesh(model, prefill=0, decode=0, colocated=1)
    try:
        yield mesh.gateway_http_address, model.name, AutoTokenizer.from_pretrained(model)
    finally:
        stop_now(mesh)


def post(address: str, path: str, body: dict) -> tuple[int, dict | list]:
    """(status, JSON body), or for a stream (status, its parsed chunks)."""
    r = requests.post(f"http://{address}{path}", json=body, timeout=60)
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = r.content.decode().split("\n")  # UTF-8, whatever the header says
        events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return r.status_code, [json.loads(e) for e in events[:-1]]
    return r.status_code, r.json()


def base(endpoint: str) -> dict:
    prompt = {"prompt": PROMPT} if endpoint == C else {"messages": MESSAGES}
    return {**prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def text(endpoint: str, reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["text"] if endpoint == C else choice["message"]["content"]


class Walk:
    """Sends requests to one endpoint and compares with its base request's reply."""

    def __init__(self, server, endpoint: str) -> None:
        self.address, self.served, self.hf = server
        self.endpoint = endpoint
        self.ref = self.ok(return_token_ids=True)

    def send(self, **fields) -> tuple[int, dict]:
        body = {k: v for k, v in {**base(self.endpoint), **fields}.items() if v is not None}
        return post(self.address, PATH[self.endpoint], body)

    def ok(self, **fields) -> dict:
        status, reply = self.send(**fields)
        assert status == 200, reply
        return reply

    @property
    def ref_ids(self) -> list[int]:
        return self.ref["choices"][0]["token_ids"]

    def prompt_ids(self, reply: dict) -> list[int]:
        return reply["choices"][0]["prompt_token_ids"] if self.endpoint == C else (
            reply["prompt_token_ids"]
        )  # fmt: skip

    def reference(self, ids: list[int]):
        """transformers' log_softmax at every position of `ids` (T, V), fp32: the logprobs'
        reference."""
        import torch
        from transformers import AutoModelForCausalLM

        if not hasattr(self, "lm"):
            self.lm = AutoModelForCausalLM.from_pretrained(
                self.hf.name_or_path, torch_dtype=torch.float32
            )
        with torch.no_grad():
            return torch.log_softmax(self.lm(torch.tensor([ids])).logits[0].float(), dim=-1)

    def template_ids(self, messages: list[dict], **kwargs) -> list[int]:
        """transformers' rendering and tokenization of a conversation (the reference)."""
        return self.hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


def _ids(walk: Walk, **fields) -> list[int]:
    return walk.ok(return_token_ids=True, **fields)["choices"][0]["token_ids"]


PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
STRUCTURED = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def effect_of(name: str, walk: Walk, value) -> None:
    """Asserts that the honoured field `name` does what it says."""
    e = walk.endpoint
    if name == "model":
        assert walk.ok(model=walk.served)["model"] == walk.served
        assert walk.send(model="gpt-17")[0] == 404
    elif name in ("prompt", "messages"):
        status, reply = walk.send(**{name: None})
        assert status == 400 and reply["error"]["param"] == name
    elif name in ("max_tokens", "max_completion_tokens"):
        assert walk.ok(**{name: value})["usage"]["completion_tokens"] == value
    elif name == "temperature":
        assert _ids(walk, temperature=value, seed=1) != walk.ref_ids
    elif name in ("top_p", "top_k"):  # keeping only the likeliest token is greedy
        assert _ids(walk, temperature=5.0, seed=1, **{name: value}) == walk.ref_ids
    elif name == "seed":
        runs = [_ids(walk, temperature=5.0, seed=s) for s in (value, value, value + 1)]
        assert runs[0] == runs[1] != runs[2]
    elif name == "n":  # choice i samples from seed + i: it is that seed's single answer
        reply = walk.ok(return_token_ids=True, temperature=5.0, seed=1, n=value)
        assert [c["index"] for c in reply["choices"]] == list(range(value))
        got = [c["token_ids"] for c in reply["choices"]]
        assert got == [_ids(walk, temperature=5.0, seed=1 + i) for i in range(value)]
        assert reply["usage"]["completion_tokens"] == sum(len(ids) for ids in got)
    elif name == "best_of":  # the choice of highest cumulative logprob among `value`
        sampled = dict(return_token_ids=True, temperature=5.0, seed=1, logprobs=0)
        every = walk.ok(**sampled, n=value)["choices"]
        best = max(every, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
        [choice] = walk.ok(**sampled, best_of=value)["choices"]
        assert choice["token_ids"] == best["token_ids"] and choice["index"] == 0
    elif name == "stop":
        full = text(e, walk.ref)
        stop = full[len(full) // 2 :][:2]
        reply = walk.ok(stop=stop)
        assert text(e, reply) == full[: full.index(stop)]
        assert reply["choices"][0]["finish_reason"] == "stop"
    elif name == "stop_token_ids":
        k = next(i for i, t in enumerate(walk.ref_ids) if t not in walk.ref_ids[:i] and i > 0)
        reply = walk.ok(stop_token_ids=[walk.ref_ids[k]])
        assert reply["usage"]["completion_tokens"] == k + 1
        assert reply["choices"][0]["finish_reason"] == "stop"
    elif name == "ignore_eos":
        chat = [{"role": "user", "content": EOS_PROMPT}]
        prompt = {"prompt": EOS_PROMPT} if e == C else {"messages": chat}
        stopped = walk.ok(**prompt, ignore_eos=None)  # the model's EOS ends it at once
        assert stopped["usage"]["completion_tokens"] == 1
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert walk.ok(**prompt, ignore_eos=value)["usage"]["completion_tokens"] == 6
    elif name == "stream":
        status, chunks = walk.send(stream=value)
        assert status == 200 and len(chunks) > 1
        deltas = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")
                  for c in chunks]  # fmt: skip
        assert "".join(d or "" for d in deltas) == text(e, walk.ref)
    elif name == "stream_options":
        status, chunks = walk.send(stream=True, stream_options=value)
        assert status == 200 and chunks[-1]["choices"] == []
        used = [c["usage"]["completion_tokens"] for c in chunks]
        assert used == sorted(used) and used[0] >= 1 and used[-1] == 6
    elif name in ("user", "safety_identifier"):
        # Written to the gateway's log, which no reply shows (and which goes to the stderr
        # the gateway process inherited, beyond pytest's per-test capture).
        assert text(e, walk.ok(**{name: value})) == text(e, walk.ref)  # an id, not a change
    elif name == "echo" and e == C:
        assert text(e, walk.ok(echo=value)) == PROMPT + text(e, walk.ref)
        status, chunks = walk.send(echo=value, stream=True)
        assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
        assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + text(e, walk.ref)
    elif name == "echo":
        reply = walk.ok(messages=CONTINUED, continue_final_message=True, echo=value)
        assert text(e, reply).startswith("Prefill runs")
        plain = walk.ok(messages=CONTINUED, continue_final_message=True)
        assert text(e, reply) == "Prefill runs" + text(e, plain)
    elif name == "return_token_ids":
        ids = walk.ref["choices"][0]["token_ids"]
        assert len(ids) == walk.ref["usage"]["completion_tokens"]
        assert walk.hf.decode(ids, skip_special_tokens=True) == text(e, walk.ref)
        if e == C:
            want = walk.hf(PROMPT)["input_ids"]
        else:
            want = walk.template_ids(MESSAGES, add_generation_prompt=True)
        assert walk.prompt_ids(walk.ref) == want
        status, chunks = walk.send(return_token_ids=value, stream=True)
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids
        assert walk.prompt_ids(chunks[0]) == want
    elif name == "include_stop_str_in_output":
        full = text(e, walk.ref)
        stop = full[len(full) // 2 :][:2]
        reply = walk.ok(stop=stop, include_stop_str_in_output=value)
        assert text(e, reply) == full[: full.index(stop) + len(stop)]
    elif name == "skip_special_tokens":  # token 2 is <|im_start|>, a special token
        forced = walk.ok(logit_bias={"2": 100}, skip_special_tokens=value)
        assert text(e, forced) == "<|im_start|>" * 6
        assert text(e, walk.ok(logit_bias={"2": 100})) == ""
    elif name == "logit_bias":
        assert set(_ids(walk, logit_bias=value)) == {5}
    elif name == "min_p":  # keeping only tokens as likely as the likeliest is greedy
        assert _ids(walk, temperature=5.0, seed=1, min_p=value) == walk.ref_ids
    elif name == "min_tokens":
        chat = [{"role": "user", "content": EOS_PROMPT}]
        prompt = {"prompt": EOS_PROMPT} if e == C else {"messages": chat}
        reply = walk.ok(**prompt, ignore_eos=None, min_tokens=value)  # EOS at once without
        assert reply["usage"]["completion_tokens"] >= value
    elif name in PENALTIES:
        # The engine's answer for the same prompt and parameters (the engine is exact against
        # transformers' processors: tests/engine/test_penalties_transformers.py), which is not
        # the answer without the penalty.
        prompt = walk.prompt_ids(walk.ref)
        [want] = walk.engine.generate(
            [prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **{name: value})
        )
        got = _ids(walk, max_tokens=24, **{name: value})
        assert got == want.token_ids and got != _ids(walk, max_tokens=24)
    elif name == "request_id":
        assert walk.ok(request_id=value)["id"] == ("cmpl-" if e == C else "chatcmpl-") + value
    elif name == "add_special_tokens":
        flipped = walk.ok(return_token_ids=True, add_special_tokens=e == H)
        ref = walk.prompt_ids(walk.ref)
        bos = walk.hf.bos_token_id
        want = ref[1:] if e == C else [bos, *ref]  # completions add BOS; chat's template does
        assert walk.prompt_ids(flipped) == want
    elif name == "truncate_prompt_tokens":
        reply = walk.ok(return_token_ids=True, truncate_prompt_tokens=value)
        assert walk.prompt_ids(reply) == walk.prompt_ids(walk.ref)[-value:]
    elif name in ("add_generation_prompt", "continue_final_message", "documents"):
        messages = CONTINUED if name == "continue_final_message" else MESSAGES
        reply = walk.ok(return_token_ids=True, messages=messages, **{name: value})
        # Continuing a message opens no new turn.
        kwargs = {"add_generation_prompt": name == "documents", name: value}
        want = walk.template_ids(messages, **kwargs)
        assert walk.prompt_ids(reply) == want != walk.prompt_ids(walk.ref)
    elif name in STRUCTURED:
        # The answer (free text without the field) is what the constraint allows, complete.
        reply = walk.ok(max_tokens=64, **{name: value})
        assert reply["choices"][0]["finish_reason"] == "stop", (name, reply)
        answer = text(e, reply)
        if name in ("response_format", "guided_json"):
            schema = value["json_schema"]["schema"] if name == "response_format" else value
            jsonschema.validate(json.loads(answer), schema)
        elif name == "guided_choice":
            assert answer in value
        else:
            pattern = {"guided_grammar": "x[0-9]y"}.get(name, "[a-z]{2,4}-[0-9]")
            assert re.fullmatch(pattern, answer), answer
    elif name == "chat_template_kwargs":
        reply = walk.ok(return_token_ids=True, chat_template_kwargs=value)
        want = walk.template_ids(MESSAGES, add_generation_prompt=True, **value)
        assert walk.prompt_ids(reply) == want != walk.prompt_ids(walk.ref)
        assert "<think>" in walk.hf.decode(want)
    elif name in ("tools", "tool_choice"):
        # This gateway has no --tool-call-parser (tests/gateway/test_tools.py has one): tools
        # under "auto" (the default) are refused naming the flag; under "none" they reach the
        # template as transformers passes them, and the answer is text.
        tools = [{"type": "function", "function": {"name": "f"}}]
        status, reply = walk.send(tools=tools)
        assert status == 400 and reply["error"]["param"] == "tools"
        assert "--tool-call-parser" in reply["error"]["message"]
        reply = walk.ok(return_token_ids=True, tools=tools, tool_choice="none")
        want = walk.template_ids(MESSAGES, tools=tools, add_generation_prompt=True)
        assert walk.prompt_ids(reply) == want != walk.prompt_ids(walk.ref)
        assert "tool_calls" not in reply["choices"][0]["message"]
        # Forced (no parser needed): one call (greedy, a random model may write calls until
        # max_tokens when more are allowed), its parameters the empty object its schema allows.
        empty = {"type": "object", "properties": {}, "additionalProperties": False}
        closed = [{"type": "function", "function": {"name": "f", "parameters": empty}}]
        reply = walk.ok(tools=closed, tool_choice="required", parallel_tool_calls=False,
                        max_tokens=40)  # fmt: skip
        [call] = reply["choices"][0]["message"]["tool_calls"]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("f", {})
    elif name == "parallel_tool_calls":
        # tool_choice "required" with false: exactly one call, whatever the seed draws;
        # without it, the constraint lets some seed's answer hold several.
        counts: dict[bool, list[int]] = {True: [], False: []}
        for parallel in (True, value):
            for seed in range(6):
                reply = walk.ok(
                    tools=BOUNDED, tool_choice="required", parallel_tool_calls=parallel,
                    temperature=1.0, seed=seed, max_tokens=120,
                )  # fmt: skip
                calls = reply["choices"][0]["message"].get("tool_calls") or []
                counts[parallel].append(len(calls))
        assert counts[False] == [1] * 6 and max(counts[True]) >= 2, counts
    elif name in ("logprobs", "top_logprobs"):
        _check_logprobs(walk, name, value)
    elif name == "prompt_logprobs":
        reply = walk.ok(return_token_ids=True, prompt_logprobs=value)
        prompt = walk.prompt_ids(reply)
        got = (reply["choices"][0] if e == C else reply)["prompt_logprobs"]
        ref = walk.reference(prompt)
        assert got[0] is None and len(got) == len(prompt)
        for i, position in enumerate(got[1:], start=1):
            assert len(position) <= value + 1
            entry = position[str(prompt[i])]
            assert abs(entry["logprob"] - float(ref[i - 1, prompt[i]])) < 1e-4
            assert entry["decoded_token"] == walk.hf.decode([prompt[i]])
        assert text(e, reply) == text(e, walk.ref)  # the answer is the same
    elif name == "return_tokens_as_token_ids":
        asked = {"logprobs": 1} if e == C else {"logprobs": True}
        reply = walk.ok(return_token_ids=True, return_tokens_as_token_ids=value, **asked)
        lp = reply["choices"][0]["logprobs"]
        tokens = lp["tokens"] if e == C else [c["token"] for c in lp["content"]]
        assert tokens == [f"token_id:{t}" for t in reply["choices"][0]["token_ids"]]
    else:
        raise AssertionError(f"no effect check for the honoured field {name!r}")


def _check_logprobs(walk: Walk, name: str, value) -> None:
    """Each generated token's logprob and its top-k are transformers' log_softmax over the
    prompt and the answer (teacher-forced), streamed or not; top_logprobs needs logprobs."""
    e = walk.endpoint
    k = value if name == "top_logprobs" else (value if e == C else 0)
    fields = {"logprobs": True, "top_logprobs": value} if name == "top_logprobs" else {name: value}
    reply = walk.ok(return_token_ids=True, **fields)
    ids = reply["choices"][0]["token_ids"]
    assert ids == walk.ref_ids  # logprobs change no token
    ref = walk.reference(walk.prompt_ids(reply) + ids)[len(walk.prompt_ids(reply)) - 1 :]
    lp = reply["choices"][0]["logprobs"]
    if e == C:
        assert lp["tokens"] == [walk.hf.decode([t]) for t in ids]
        rows = [(v, sorted(top.values(), reverse=True)) for v, top in
                zip(lp["token_logprobs"], lp["top_logprobs"], strict=True)]  # fmt: skip
    else:
        assert [c["token"] for c in lp["content"]] == [walk.hf.decode([t]) for t in ids]
        rows = [(c["logprob"], [t["logprob"] for t in c["top_logprobs"]]) for c in lp["content"]]
    assert len(rows) == len(ids)
    for (chosen, top), token, row in zip(rows, ids, ref, strict=False):
        assert abs(chosen - float(row[token])) < 1e-4
        want = row.topk(k).values.tolist()
        if e == C:  # greedy: the chosen token is among the k (keyed by text: two may merge)
            assert 1 <= len(top) <= max(k, 1)
            assert all(min(abs(v - w) for w in want or [chosen]) < 1e-4 for v in top)
        else:
            assert len(top) == k
            assert all(abs(a - b) < 1e-4 for a, b in zip(top, want, strict=True))
    status, chunks = walk.send(stream=True, **fields)
    if e == C:
        streamed = [v for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                    for v in c["choices"][0]["logprobs"]["token_logprobs"]]  # fmt: skip
        assert streamed == lp["token_logprobs"]
    else:
        streamed = [v for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                    for v in c["choices"][0]["logprobs"]["content"]]  # fmt: skip
        assert streamed == lp["content"]
    if name == "top_logprobs":
        status, reply = walk.send(top_logprobs=value)  # without logprobs: true
        assert status == 400 and reply["error"]["param"] == "top_logprobs"


@pytest.mark.parametrize("endpoint", BOTH)
def test_the_lists_are_the_servers_table(endpoint):
    listed = {(n, s) for n, ends, s, _ in KNOWN if endpoint in ends}
    table = {
        (f.name, HONOURED if f.honoured else REFUSED)
        for f in openai_fields.BY_ENDPOINT[endpoint].values()
    }
    assert listed == table


@pytest.mark.parametrize("endpoint", BOTH)
def test_every_known_field_is_honoured_with_effect_or_refused_by_name(server, model, endpoint):
    walk = Walk(server, endpoint)
    walk.engine = LLMEngine(model, EngineConfig(num_blocks=64))
    for name, ends, status, value in KNOWN:
        if endpoint not in ends:
            if any(endpoint in e for n, e, _, _ in KNOWN if n == name):
                continue  # listed again for this endpoint
            code, reply = walk.send(**{name: value if value != "REQUIRED" else "x"})
            assert code == 400 and reply["error"]["param"] == name, (name, reply)
            assert "is a field of" in reply["error"]["message"], reply
        elif status == REFUSED:
            code, reply = walk.send(**{name: value})
            assert code == 400, (name, reply)
            assert reply["error"]["param"] == name and f"'{name}'" in reply["error"]["message"]
            assert "not supported" in reply["error"]["message"], reply
        else:
            effect_of(name, walk, value)


@pytest.mark.parametrize("endpoint", BOTH)
def test_unknown_fields_are_refused_naming_the_field_meant(server, endpoint):
    walk = Walk(server, endpoint)
    for name, meant in UNKNOWN:
        code, reply = walk.send(**{name: 1})
        assert code == 400 and reply["error"]["param"] == name, reply
        hint = f"did you mean '{meant}'?" if meant else "refuses fields it does not know"
        assert hint in reply["error"]["message"], reply
        assert walk.send(**{name: None})[0] == 200  # null is unset


def test_refused_fields_at_their_default_change_nothing(server):
    walk = Walk(server, C)
    defaults = {
        "logprobs": False,
        "presence_penalty": 0.0,
        "suffix": "",
        "skip_special_tokens": True,
        "priority": 0,
        "response_format": {"type": "text"},
    }
    assert walk.ok(return_token_ids=True, **defaults)["choices"] == walk.ref["choices"]


def test_chat_template_kwargs_may_not_set_the_templates_own_variables(server):
    walk = Walk(server, H)
    for name in ("messages", "add_generation_prompt", "tools", "bos_token"):
        code, reply = walk.send(chat_template_kwargs={name: 1})
        assert code == 400 and reply["error"]["param"] == "chat_template_kwargs"
        assert f"may not set '{name}'" in reply["error"]["message"]


def test_tokenize_and_detokenize_as_vllm_does(server):
    address, served, hf = server
    status, out = post(address, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert status == 200 and out["tokens"] == hf(PROMPT)["input_ids"]
    context = json.loads((Path(hf.name_or_path) / "config.json").read_text())[
        "max_position_embeddings"
    ]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == context
    assert out["token_strs"] == hf.convert_ids_to_tokens(out["tokens"])
    status, chat = post(address, "/tokenize", {"model": served, "messages": MESSAGES})
    assert chat["tokens"] == hf.apply_chat_template(
        MESSAGES, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    status, text = post(address, "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and text == {"prompt": hf.decode(out["tokens"], skip_special_tokens=True)}
    for path, body, param in (
        ("/tokenize", {"prompt": "x", "max_tokens": 2}, "max_tokens"),
        ("/tokenize", {"prompt": "x", "model": "gpt-17"}, "model"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ):
        status, reply = post(address, path, body)
        assert status in (400, 404) and reply["error"]["param"] == param, reply


def test_version_models_and_what_is_not_served(server):
    address, served, _ = server
    from importlib.metadata import version

    assert requests.get(f"http://{address}/version", timeout=10).json() == {
        "version": version("distserve-mesh")
    }
    models = requests.get(f"http://{address}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(served, 1024)]  # tiny preset
    for method, path in (("POST", "/v1/embeddings"), ("POST", "/v1/audio/speech"),
                         ("POST", "/v1/images/generations"), ("GET", "/v1/responses")):  # fmt: skip
        r = requests.request(method, f"http://{address}{path}", json={}, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_served"
        assert "does not serve" in r.json()["error"]["message"]


def test_the_gateway_serves_its_prometheus_metrics_on_its_http_port(server):
    address, _, _ = server
    r = requests.get(f"http://{address}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "gen_ai_server_time_to_first_token_seconds" in r.text


def test_docs_api_md_holds_the_generated_table():
    docs = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    assert openai_fields.markdown_table() in docs
