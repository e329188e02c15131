"""How the engine bench (`bench/engine/engine.py`) times the engine and its baseline: a prefill and
a decode step, ours and Hugging Face transformers' on the same weights, and the floor memory
bandwidth puts under a decode step."""

from __future__ import annotations

import itertools
import statistics
import time

import torch

from services.common.sampling import SamplingParams
from services.engine.engine import LLMEngine
from services.engine.sequence import Sequence


def memcpy_bandwidth(nbytes: int = 512 * 2**20, reps: int = 5) -> float:
    """Bytes copied per second (each byte counted once) for a buffer far larger than caches."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def random_prompt(n: int, gen: torch.Generator, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=gen).tolist()


def admitted_prompt(engine: LLMEngine, prompt: list[int]) -> Sequence:
    """A one-token request for `prompt`, admitted (its blocks allocated), ready to prefill."""
    seq = Sequence(
        "bench",
        prompt,
        SamplingParams(max_tokens=1),
        eos_token_ids=(),
        max_context=engine.model_config.max_position_embeddings,
        tokenizer=None,
        default_seed=0,
    )
    assert engine._admit(seq, hold=False)
    return seq


def ours_prefill_seconds(engine: LLMEngine, prompt: list[int], reps: int) -> float:
    times = []
    for _ in range(reps):
        seq = admitted_prompt(engine, prompt)
        t = time.perf_counter()
        engine.runner.prefill([seq])
        times.append(time.perf_counter() - t)
        engine._free(seq)
    return statistics.median(times)


@torch.inference_mode()
def hf_prefill_seconds(hf, prompt: list[int], reps: int) -> float:
    ids = torch.tensor([prompt])
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        hf(ids, use_cache=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ours_decode(engine: LLMEngine, prompts: list[list[int]], new: int) -> list[float]:
    """Times of the decode steps (every sequence running) after all prompts are prefilled."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while engine.waiting:
        engine.step()  # prefill batches (each also samples its first token)
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return steps[:-1]  # the last step also retires every sequence


class _StepClock:
    """A transformers streamer that only notes when each generated token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        self.times.append(time.perf_counter())


@torch.inference_mode()
def hf_decode(hf, prompts: list[list[int]], new: int) -> list[float]:
    """transformers generate on the left-padded batch: times of its decode steps."""
    width = max(len(p) for p in prompts)
    ids = torch.ones(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    clock = _StepClock()
    hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=1,
        streamer=clock,
    )
    # put() receives the prompt, then each generated token; the first one ends prefill.
    tokens = clock.times[1:-1]
    return [b - a for a, b in itertools.pairwise(tokens)]


def weight_bytes_read_per_token(engine: LLMEngine) -> int:
    """Bytes of parameters a decode step reads: all but the embedding table (one row read)."""
    model = engine.runner.model
    emb = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.config.tie_word_embeddings:
        return total  # the table is read whole as the LM head
    return total - emb.numel() * emb.element_size()
