"""One request's state inside the engine: its tokens, KV blocks, sampling state and finish."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from services.common.sampling import SamplingParams
from services.common.tokenizer import IncrementalDetokenizer, Tokenizer
from services.engine.block_pool import BlockTable


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for prefill (or re-prefill after preemption)
    RUNNING = "running"  # has KV and takes part in decode steps
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    LENGTH = "length"  # max_tokens reached, or the model's context is full
    STOP = "stop"  # EOS, a stop token id, or a stop string
    ABORT = "abort"  # cancelled by the caller


@dataclass
class StepOutput:
    """What one engine step produced for one sequence."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None


class Sequence:
    """A request in the engine: prompt + generated ids, block table, and how it stops."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...],
        max_context: int,
        tokenizer: Tokenizer | None,
        default_seed: int,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table = BlockTable()
        self.max_context = max_context
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        self.stop_token_ids = frozenset(stop_ids)
        # One uniform draw per sampled token, from the request's own stream: reproducible for a
        # seed whatever else shares the batch.
        self.rng = random.Random(params.seed if params.seed is not None else default_seed)
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        )
        self.max_stop_chars = max((len(s) for s in params.stop), default=0)
        self._emitted = 0  # characters of text handed out as deltas
        self._searched = 0  # characters of text already searched for stop strings
        self._text_end: int | None = None  # where a stop string cut the text

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def text(self) -> str:
        """The generated text so far, without a stop string that ended it."""
        if self.detokenizer is None:
            return ""
        return self.detokenizer.text[: self._text_end]

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Blocks to add so that KV for `num_tokens` tokens fits."""
        return max(0, -(-num_tokens // block_size) - len(self.block_table))

    def append(self, token_id: int) -> str:
        """Add a sampled token, decide whether the sequence is finished; return new text.

        While stop strings are set, the last (longest stop string - 1) characters are held back,
        so that a stop string split across tokens is never partly streamed.
        """
        self.token_ids.append(token_id)
        detok = self.detokenizer
        if detok is not None:
            detok.add((token_id,))
        if token_id in self.stop_token_ids:
            self.finish_reason = FinishReason.STOP
        elif (
            self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= self.max_context
        ):
            self.finish_reason = FinishReason.LENGTH
        if detok is None:
            return ""
        if self.finish_reason is not None:
            detok.flush()
        if self.params.stop:
            cut = self._find_stop(detok.text)
            if cut is not None:
                self.finish_reason = FinishReason.STOP
                self._text_end = cut
        end = len(detok.text) if self._text_end is None else self._text_end
        if self.finish_reason is None and self.params.stop:
            end -= self.max_stop_chars - 1
        delta = detok.text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def _find_stop(self, text: str) -> int | None:
        """Index of the first stop string in the text not yet searched, if any."""
        start = max(0, self._searched - self.max_stop_chars + 1)
        self._searched = len(text)
        hits = [i for s in self.params.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None
