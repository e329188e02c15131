"""A request continued elsewhere (migration) after some of its tokens reached the client."""

from __future__ import annotations

from services.common.sampling import SamplingParams
from services.gateway.request import Request


def test_a_continued_request_asks_for_the_prompts_logprobs_only_if_none_were_sent():
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=3), None)
    before_first = req.continued([])  # lost before its first token: the prompt's are still due
    assert before_first.params.prompt_logprobs == 3 and before_first.prompt_ids == [1, 2, 3]
    after = req.continued([7, 8])  # they came with the first token
    assert after.params.prompt_logprobs is None and after.prompt_ids == [1, 2, 3, 7, 8]
    assert after.params.logprobs == 2 and after.params.max_tokens == 3
    assert after.worker_request_id != req.worker_request_id
