"""One request's state inside the engine: its tokens, KV blocks, sampling state and finish."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.logprobs import TokenLogprobs
from services.common.sampling import FinishReason, SamplingParams
from services.common.text_stream import TextStream
from services.common.tokenizer import Tokenizer
from services.engine.block_pool import BlockTable

if TYPE_CHECKING:
    from services.engine.structured import Matcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for prefill here (or re-prefill after preemption)
    HELD = "held"  # prefilled; its KV is held for a decode instance to pull
    PULL_WAITING = "pull_waiting"  # decode: its KV is elsewhere; waiting for room here
    PULLING = "pulling"  # decode: blocks allocated, KV being pulled into them
    RUNNING = "running"  # has KV and takes part in decode steps
    FINISHED = "finished"


@dataclass
class StepOutput:
    """What one engine step produced for one sequence."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    # A prefill instance's held sequence: its KV blocks as (first block, count) runs.
    held_runs: tuple[tuple[int, int], ...] | None = None
    # A prefill step's sequence: its leading tokens whose KV came from the prefix cache.
    num_cached_tokens: int = 0
    # With params.logprobs: one per new token. With params.prompt_logprobs, on the step that
    # prefilled the prompt: its positions 1.. (the first has nothing before it).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Which of the request's choices (n > 1, best_of) this sequence is.
    index: int = 0


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
        matcher: Matcher | None = None,
        index: int = 0,
    ) -> None:
        """matcher: the grammar state of a structured-output request (services/engine/
        structured.py), advanced over each appended token; None: free text. index: which of
        the request's choices this is (n > 1, best_of); its random stream is the request's
        seed + index."""
        self.request_id = request_id
        self.index = index
        # A request of several choices not yet prefilled here: its prefill forks it into
        # them (set by the engine); a pulled one: (index, first token) of each choice it
        # forks into once its KV is in place.
        self.fork_pending = False
        self.fork_choices: list[tuple[int, int]] = []
        # Blocks taken when the request was given its KV, for its choices' copies of the
        # prompt's last partial block (copy-on-write), until the fork uses them.
        self.fork_blocks: list[int] = []
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table = BlockTable()
        # Prefix cache: the leading tokens whose KV was reused when the sequence last got its
        # blocks (a multiple of the block size; prefill computes only the rest), the chained
        # hashes of its full blocks known so far, and how many of its blocks were offered to
        # the cache (their KV written).
        self.num_cached_tokens = 0
        self.block_hashes: list[int] = []
        self.num_committed_blocks = 0
        self.reuse_prefix = False  # a pulled sequence: may start from KV cached here
        self.max_context = max_context
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        self.stop_token_ids = frozenset(stop_ids)
        # One uniform draw per sampled token, from the request's own stream: reproducible for a
        # seed whatever else shares the batch.
        seed = params.seed if params.seed is not None else default_seed
        self.rng = random.Random((seed + index) % 2**63)
        # Text is tracked when a tokenizer is given (stop strings need one).
        self.text_stream = (
            TextStream(
                tokenizer,
                prompt_ids,
                params.stop,
                params.min_tokens,
                include_stop=params.include_stop_str_in_output,
                skip_special=params.skip_special_tokens,
            )
            if tokenizer is not None
            else None
        )
        # For the sampler: whether a logits processor is on (else the fast path serves it), the
        # logit_bias as parallel ids and values, and the sequence's row in the runner's
        # TokenCounts while it sits in the decode batch with a penalty.
        self.processed = params.processed
        self.bias_ids = [t for t, _ in params.logit_bias]
        self.bias_values = [b for _, b in params.logit_bias]
        self.counts_row: int | None = None
        self.matcher = matcher
        # The prompt's logprobs, set by the prefill that computed them, until they are reported.
        self.prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def width(self) -> int:
        """Decode seats the sequence takes once prefilled: its choices, if it forks into them."""
        if self.fork_choices:
            return len(self.fork_choices)
        return self.params.num_choices if self.fork_pending else 1

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the next prefill must score the prompt: asked, and not done (a sequence
        recomputed after preemption has output tokens and reported them already)."""
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0

    def draw(self) -> float:
        """The uniform draw in (0, 1] that samples this sequence's next token (one per sampled
        token, none when greedy)."""
        return 1.0 - self.rng.random()

    def skip_draw(self) -> None:
        """Move the stream past the draw of a token sampled elsewhere (prefill's first)."""
        if self.params.temperature > 0:
            self.rng.random()

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
    def text(self) -> str:
        """The generated text so far, without a stop string that ended it."""
        return self.text_stream.text if self.text_stream is not None else ""

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Blocks to add so that KV for `num_tokens` tokens fits."""
        return max(0, -(-num_tokens // block_size) - len(self.block_table))

    def append(self, token_id: int) -> str:
        """Add a sampled token, decide whether the sequence is finished; return new text.

        A structured-output answer stops once complete: when its grammar admits nothing more
        (at once: the only token left would be EOS), or when it could end and EOS came (even
        with ignore_eos, which never stretches an answer past its grammar)."""
        self.token_ids.append(token_id)
        stream = self.text_stream
        delta = stream.add((token_id,)) if stream is not None else ""
        complete = False
        if self.matcher is not None:
            self.matcher.consume(token_id)
            complete = self.matcher.done
        if (stream is not None and stream.stopped) or token_id in self.stop_token_ids or complete:
            self.finish_reason = FinishReason.STOP
        elif (
            self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= self.max_context
        ):
            self.finish_reason = FinishReason.LENGTH
        if self.finish_reason is not None and stream is not None:
            delta += stream.finish()
        return delta
