"""`--max-n`: a gateway's limit on the choices (n, best_of) one request may ask for."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import InvalidRequest
from services.common.model_config import ModelConfig
from services.common.sampling import MAX_N, SamplingParams
from services.common.tokenizer import Tokenizer
from services.gateway.__main__ import parse
from services.gateway.request import Limits, build_request


def _build(model, params: SamplingParams, max_n: int):
    limits = Limits.for_model(ModelConfig.from_dir(model), max_n=max_n)
    prompt = [1, 2, 3]
    return asyncio.run(build_request(prompt, params, Tokenizer.from_dir(model), limits))


def test_choices_up_to_the_limit_pass_and_above_it_are_refused_naming_the_field(tiny_model):
    assert _build(tiny_model, SamplingParams(max_tokens=2, n=2, temperature=1.0), 2)
    with pytest.raises(InvalidRequest, match=r"n is 3; .* at most 2 choices .*--max-n") as e:
        _build(tiny_model, SamplingParams(max_tokens=2, n=3, temperature=1.0), 2)
    assert e.value.param == "n"
    with pytest.raises(InvalidRequest, match=r"best_of is 3; .* at most 2") as e:
        _build(tiny_model, SamplingParams(max_tokens=2, n=1, best_of=3, temperature=1.0), 2)
    assert e.value.param == "best_of"


def test_the_flag_takes_1_to_the_engine_limit(tiny_model):
    assert parse(["--model", str(tiny_model), "--max-n", "4"]).max_n == 4
    assert parse(["--model", str(tiny_model)]).max_n == MAX_N
    for bad in ("0", str(MAX_N + 1)):
        with pytest.raises(SystemExit):
            parse(["--model", str(tiny_model), "--max-n", bad])
