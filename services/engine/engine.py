"""The in-process LLM engine: prefill batches, continuous-batching decode, sampling.

`step()` is schedule, run, postprocess, collect. Prefill has priority: when waiting prompts fit,
a step prefills them (one batch up to L_m tokens); otherwise it decodes one token for every
running sequence. The prefill and decode services use the same pieces on their own.

With the prefix cache (`EngineConfig.prefix_cache`, services/engine/prefix_cache.py) a prompt
starts from the longest cached prefix of its full blocks and computes only the rest (at least
one token, for the logits it samples from); a pulled request may too (`add_prefilled`).
`kv_events` reports what was cached and evicted.

A request of n choices (`SamplingParams.n`, `best_of`) is one sequence until its prompt is
prefilled (here, or pulled from a prefill instance); it then forks into a sequence per choice
(`_fork`): the prompt's full blocks are shared (one reference each), and each choice but the
first gets its own copy of the last partial block, which its next token writes into
(copy-on-write). Each block is freed when its last reference goes. Every first token is
sampled from the same prompt logits, each choice with its own random stream.

Why one file (~680 lines): `LLMEngine` is the one object every worker drives (its pool,
requests, the step, the fork of n choices, a prefill instance's held KV, a decode instance's
pulled KV, the prefix cache's reports), and each of those sections is a few short methods over
the same queues and pool.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.errors import InvalidRequest, ModelLoadError
from services.common.logprobs import TokenLogprobs
from services.common.model_config import ModelConfig
from services.common.prefix_hash import cache_salt
from services.common.sampling import FinishReason, SamplingParams
from services.common.tokenizer import Tokenizer
from services.engine import kv_sizing
from services.engine.block_pool import BlockPool, BlockTable
from services.engine.config import DEFAULT_MAX_BATCH_TOKENS, EngineConfig
from services.engine.decode_batch import DecodeBatch
from services.engine.emulated import EmulatedRunner
from services.engine.kv_events import KvEvents
from services.engine.prefill_batcher import PrefillBatcher
from services.engine.prefix_cache import PrefixCache, PrefixCacheStats
from services.engine.runner_build import build_runner, more_kv_option
from services.engine.sequence import Sequence, SequenceStatus, StepOutput
from services.engine.shards import check_tp
from services.engine.structured import GrammarCompiler

if TYPE_CHECKING:
    import torch

    from services.engine.parallel import TensorParallel


log = logging.getLogger("distserve.engine")


@dataclass
class Completion:
    """A finished request, as `generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    index: int = 0  # which choice of its request (n > 1, best_of)


class LLMEngine:
    """A model replica with a paged KV cache that serves many requests at once."""

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        detokenize: bool = True,
        tp: TensorParallel | None = None,
    ) -> None:
        """detokenize: track each request's text (workers that only return ids turn it off;
        requests with stop strings are detokenized regardless).

        tp: this process's rank in a tensor-parallel group (None: tp == 1). Every rank of the
        group must then make the same calls (add_request, abort, step...) in the same order.

        The real engine's modules (torch, the model, attention, weights) are imported when the
        first one is built: an emulated engine's process never loads torch.
        """
        config = config or EngineConfig()
        self.tp = tp
        self.detokenize = detokenize
        self.config = config
        self.model_dir = Path(model_dir)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        mc = self.model_config
        if self.tokenizer.vocab_size > mc.vocab_size:
            raise ModelLoadError(
                f"tokenizer.json has {self.tokenizer.vocab_size} ids but config.json's vocab_size "
                f"is {mc.vocab_size}: they do not belong to the same model"
            )
        check_tp(mc, tp.world_size if tp else 1)
        built = build_runner(self.model_dir, mc, config, self.tokenizer.vocab_size, tp)
        self.runner, num_blocks, self.tp = built.runner, built.num_blocks, built.tp
        self.device, self.dtype, self.gemm_forms = built.device, built.dtype, built.gemm_forms
        # The KV heads this rank computes and caches (all of them with tp == 1, or a latent).
        self.kv_geometry, self.kv_heads = built.kv_geometry, built.kv_heads
        self.capacity = kv_sizing.capacity(
            num_blocks,
            config.block_size,
            mc.max_position_embeddings,
            config.max_model_len,
            raise_with=more_kv_option(config, self.device),
        )
        self.max_model_len = self.capacity.max_model_len
        if tp is None or tp.rank == 0:
            log.info("%s: %s", self.model_dir.name, self.capacity.describe())
        self.pool = BlockPool(num_blocks)
        self.block_size = config.block_size
        # What a cached block's KV depends on besides its tokens (the same on every rank).
        self.cache_salt: bytes = cache_salt(
            built.weights, str(self.dtype).removeprefix("torch."), f"block_size={self.block_size}"
        )
        self.prefix = PrefixCache(self.pool, self.block_size, self.cache_salt, config.prefix_cache)
        self.max_batch_tokens = config.max_batch_tokens or (
            self.runner.times.latency.saturation_tokens(self.runner.times.tp)
            if self.emulated
            else DEFAULT_MAX_BATCH_TOKENS
        )
        self.batcher = PrefillBatcher(self.max_batch_tokens, config.max_num_seqs)
        self.running = DecodeBatch(
            self.pool, config.block_size, config.max_num_seqs, self.runner.token_counts
        )
        self.waiting: deque[Sequence] = deque()
        self.pull_waiting: deque[Sequence] = deque()
        # (kind, sequences, tokens) of the last step, for the services' timing and traces.
        self.last_step: tuple[str, int, int] = ("none", 0, 0)
        # Every request here: its sequence, or (forked into n choices) its choices' sequences.
        self._requests: dict[str, list[Sequence]] = {}
        self._ids = itertools.count()
        # Structured output: specs compiled against this model's tokenizer (on first use).
        self.grammars = GrammarCompiler(
            self.model_dir / "tokenizer.json", mc.vocab_size, mc.eos_token_ids
        )

    @property
    def emulated(self) -> bool:
        """Whether this engine models its steps instead of running a model."""
        return isinstance(self.runner, EmulatedRunner)

    # -- requests --------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Bad input raises InvalidRequest with the reason."""
        params = params or SamplingParams()
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequest("prompt is empty: give at least one character")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(ids, params)
        seq = self._new_sequence(ids, params, request_id or f"req-{next(self._ids)}")
        seq.fork_pending = params.num_choices > 1
        self.waiting.append(seq)
        return seq.request_id

    def _new_sequence(
        self, ids: list[int], params: SamplingParams, request_id: str, index: int = 0
    ) -> Sequence:
        """The sequence of a new request (`index`: the choice it starts as)."""
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        seq = self._sequence(ids, params, request_id, index)
        self._requests[request_id] = [seq]
        return seq

    def _sequence(
        self, ids: list[int], params: SamplingParams, request_id: str, index: int
    ) -> Sequence:
        spec = params.structured_output
        return Sequence(
            request_id,
            ids,
            params,
            eos_token_ids=self.model_config.eos_token_ids,
            max_context=self.max_model_len,
            tokenizer=self.tokenizer if (self.detokenize or params.stop) else None,
            default_seed=_stable_seed(self.config.seed, request_id),
            matcher=self.grammars.matcher(spec, ids) if spec is not None else None,
            index=index,
        )

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        max_len = self.max_model_len
        vocab = self.model_config.vocab_size
        if not ids:
            raise InvalidRequest("prompt is empty: give at least one token")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        params.check_vocabulary(vocab)
        if params.num_choices > self.config.max_num_seqs:
            raise InvalidRequest(
                f"the request asks for {params.num_choices} choices (n, best_of) and this "
                f"instance decodes at most {self.config.max_num_seqs} sequences at once "
                "(max_num_seqs); ask for fewer",
                param="best_of" if params.best_of is not None else "n",
            )
        if self.emulated and params.best_of is not None and params.best_of > params.n:
            raise InvalidRequest(
                "best_of > n returns the choices of highest cumulative log-probability, and the "
                "emulated engine has no log-probabilities; serve the model with --engine torch",
                param="best_of",
            )
        if self.emulated:
            for name in ("logprobs", "prompt_logprobs"):
                if getattr(params, name) is not None:
                    raise InvalidRequest(
                        f"{name} is not available on the emulated engine: it models step "
                        "times and has no logits to take log-probabilities from; serve the "
                        "model with --engine torch for them",
                        param=name,
                    )
        if len(ids) >= max_len:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens; this instance serves at most {max_len} tokens "
                "(max_model_len) of prompt and output, shorten the prompt"
            )
        if len(ids) + params.max_tokens > max_len:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({max_len} tokens); set max_tokens <= {max_len - len(ids)}"
            )

    def abort(self, request_id: str) -> bool:
        """Cancel a request (every choice of it) wherever it is; frees its blocks. False if
        it is not here."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING:
                self.running.leave(seq)
            elif seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
            elif seq.status is SequenceStatus.PULL_WAITING:
                self.pull_waiting.remove(seq)
            self._free(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ABORT
        return True

    def sequence(self, request_id: str, index: int = 0) -> Sequence | None:
        """The state of a request (its choice `index`, once forked) that is still queued,
        held, pulling or running."""
        return next((s for s in self._requests.get(request_id, ()) if s.index == index), None)

    def has_unfinished(self) -> bool:
        """Whether a step would do work (held and pulling requests wait on others)."""
        return bool(self.waiting or self.running.seqs)

    def idle(self) -> None:
        """The caller found no work and waits for some: the next step does not follow the last
        one back to back (an emulated runner then starts its time when the step is called)."""
        self.runner.idle()

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # -- the prefix cache ------------------------------------------------------------------------

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        """Prompt tokens computed and reused, blocks evicted, blocks cached (for metrics)."""
        return self.prefix.stats

    def kv_events(self, max_events: int = 4096) -> KvEvents:
        """The block hashes this engine cached and dropped since the last call (KvEvents: a
        reset, with the whole cached set, when more changed than the log or `max_events`
        holds)."""
        return self.prefix.events(max_events)

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One iteration: a prefill batch if prompts are waiting and fit, else a decode step."""
        return self.prefill_step(hold=False) or self.decode_step()

    def prefill_step(
        self,
        *,
        hold: bool,
        on_scheduled: Callable[[list[Sequence]], None] | None = None,
        on_layer: Callable[[int], None] | None = None,
    ) -> list[StepOutput]:
        """Prefill one batch of waiting prompts and sample their first tokens.

        hold=False: the sequences join the decode batch. hold=True (a prefill instance): their
        KV stays in place, untouched, until `release`. `on_scheduled(seqs)` is called once the
        batch has its blocks, before the model runs; `on_layer(i)` once each layer's KV is in
        place (a prefill instance publishes layers as they are computed).
        """
        seats = self.config.max_num_seqs if hold else self.running.free_seats
        seqs = self.batcher.next_batch(
            self.waiting, lambda seq: self._admit(seq, hold), seats, self.prefix.uncached_tokens
        )
        if not seqs:
            return []
        self.last_step = ("prefill", len(seqs), self.prefix.count(seqs))
        if on_scheduled is not None:
            on_scheduled(seqs)
        logits = self.runner.prefill(seqs, on_layer)
        choices, rows, held = self._fork(seqs, hold)
        if len(choices) > len(seqs) and logits is not None:
            logits = logits[rows]  # (choices, V): each choice samples from its prompt's row
        tokens, logprobs = self._sample(logits, choices)
        outputs = []
        for seq, token, lp in zip(choices, tokens, logprobs, strict=True):
            if seq.status is SequenceStatus.HELD:  # a choice of a prompt held here
                outputs.append(self._held_choice(seq, token, lp))
                continue
            out = self._postprocess(seq, token, lp)
            out.num_cached_tokens = seq.num_cached_tokens
            out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
            if not out.finished:
                if hold:
                    seq.status = SequenceStatus.HELD
                    out.held_runs = tuple((f, n) for f, n in seq.block_table.runs)
                else:
                    seq.status = SequenceStatus.RUNNING
                    self.running.join(seq)
            outputs.append(out)
        for seq, first in held:
            self._hold_forked(seq, outputs[first : first + seq.params.num_choices])
        return outputs

    # -- n choices: the fork -------------------------------------------------------------------

    def _fork(
        self, seqs: list[Sequence], hold: bool
    ) -> tuple[list[Sequence], list[int], list[tuple[Sequence, int]]]:
        """The sequences a prefill batch samples a first token for, the batch row of each, and
        the prompts held here that forked (with where their choices start among them).

        A prompt of n choices forks now that its KV is written. Decoding here, it is choice 0
        and the others share its blocks (`_share`). Held for a decode instance (`hold`), its
        KV stays one sequence's: its choices are only sampled here (HELD, in no queue, reading
        its blocks), the decode instance forks them once it has pulled the KV."""
        choices: list[Sequence] = []
        rows: list[int] = []
        held: list[tuple[Sequence, int]] = []
        for row, seq in enumerate(seqs):
            if not seq.fork_pending:
                choices.append(seq)
                rows.append(row)
                continue
            seq.fork_pending = False
            k = seq.params.num_choices
            if hold:
                held.append((seq, len(choices)))
                for i in range(k):
                    choice = self._sequence(seq.token_ids, seq.params, seq.request_id, i)
                    choice.block_table = seq.block_table  # read, never freed, by the choice
                    choice.status = SequenceStatus.HELD
                    choices.append(choice)
            else:
                choices += [seq] + [self._choice(seq, i) for i in range(1, k)]
            rows += [row] * k
        return choices, rows, held

    def _choice(self, seq: Sequence, index: int) -> Sequence:
        """Choice `index` of a request whose sequence `seq` has its prompt's KV in place (and
        no output yet): it shares the prompt's full blocks and writes into its own copy of the
        last partial one (taken with the request's blocks: `seq.fork_blocks`)."""
        choice = self._sequence(seq.token_ids, seq.params, seq.request_id, index)
        self._requests[seq.request_id].append(choice)
        blocks = seq.block_table.blocks
        full = seq.num_prompt_tokens // self.block_size
        self.pool.incref(blocks[:full])
        choice.block_table.extend(blocks[:full])
        if len(blocks) > full:
            copy = seq.fork_blocks.pop()
            self.runner.cache.copy_block(blocks[full], copy)
            choice.block_table.extend([copy])
        choice.num_cached_tokens = seq.num_cached_tokens
        choice.num_committed_blocks = min(seq.num_committed_blocks, full)
        choice.status = seq.status
        return choice

    def _copies(self, seq: Sequence, choices: int) -> int:
        """Blocks the other choices of a request forking into `choices` need at the fork: a
        copy each of its prompt's last block, when that one is partial."""
        return choices - 1 if seq.num_prompt_tokens % self.block_size else 0

    def _held_choice(self, choice: Sequence, token: int, lp: TokenLogprobs | None) -> StepOutput:
        """A held prompt's choice got its first token: it ends here, or on a decode instance."""
        delta = choice.append(token)
        out = StepOutput(
            choice.request_id,
            [token],
            delta,
            choice.finish_reason is not None,
            choice.finish_reason,
            index=choice.index,
        )
        if lp is not None:
            out.logprobs = [lp]
        return out

    def _hold_forked(self, seq: Sequence, outputs: list[StepOutput]) -> None:
        """A held prompt's choices are sampled: its KV stays held while one goes on."""
        self.prefix.commit(seq, seq.num_tokens)
        outputs[0].prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        for out in outputs:
            out.num_cached_tokens = seq.num_cached_tokens
        if all(out.finished for out in outputs):
            seq.status = SequenceStatus.FINISHED
            self._free(seq)
            self._requests.pop(seq.request_id, None)
            return
        seq.status = SequenceStatus.HELD
        runs = tuple((f, n) for f, n in seq.block_table.runs)
        for out in outputs:
            out.held_runs = runs

    def decode_step(self) -> list[StepOutput]:
        """One token for every running sequence."""
        for seq in self.running.reserve_next_slots():
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        seqs = list(self.running.seqs)
        if not seqs:
            return []
        self.last_step = ("decode", len(seqs), len(seqs))
        tokens, logprobs = self._sample(self.runner.decode(seqs), seqs)
        return [
            self._postprocess(seq, tok, lp)
            for seq, tok, lp in zip(seqs, tokens, logprobs, strict=True)
        ]

    def _sample(
        self, logits: torch.Tensor | None, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Each sequence's next token, and its logprobs (None where not asked): those are
        taken from the raw logits first, as sampling changes them."""
        scores = self.runner.score(logits, seqs)
        tokens = self.runner.sample(logits, seqs)
        if scores is None:
            return tokens, [None] * len(seqs)
        return tokens, scores.of(tokens, len(seqs))

    def _admit(self, seq: Sequence, hold: bool) -> bool:
        """Blocks for a waiting sequence (it has none): its cached prefix, then new ones, and
        (decoding here) its choices' copies of its last block."""
        # A prompt whose logprobs are asked for is computed whole: they need every position.
        hits = [] if seq.needs_prompt_logprobs else self.prefix.hits(seq, seq.num_tokens - 1)
        copies = self._copies(seq, seq.width) if not hold else 0
        return self._allocate(seq, seq.num_tokens, hits, copies=copies)

    def _allocate(
        self, seq: Sequence, num_tokens: int, hits: list[int], spare: int = 0, copies: int = 0
    ) -> bool:
        """Give a sequence without blocks the cached blocks `hits` and new ones up to
        `num_tokens` tokens, and `copies` blocks for its fork, if they fit with `spare` blocks
        left free."""
        bs = self.block_size
        need = -(-num_tokens // bs) - len(hits)
        if not self.pool.can_allocate(need + copies + spare, hits):
            return False
        self.pool.acquire(hits)
        seq.block_table.extend(hits)
        seq.num_cached_tokens = len(hits) * bs
        seq.num_committed_blocks = len(hits)
        growth = -(-(seq.params.max_tokens - seq.num_output_tokens) // bs)
        after = hits[-1] if hits else None
        seq.block_table.extend(self.pool.allocate(need, after=after, reserve=growth))
        seq.fork_blocks = self.pool.allocate(copies)
        return True

    def _postprocess(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> StepOutput:
        # The step wrote the KV of every token the sequence had: its full blocks can be cached.
        self.prefix.commit(seq, seq.num_tokens)
        delta = seq.append(token)
        finished = seq.finish_reason is not None
        if finished:
            if seq.status is SequenceStatus.RUNNING:
                self.running.leave(seq)
            seq.status = SequenceStatus.FINISHED
            self._free(seq)
            self._forget(seq)
        out = StepOutput(seq.request_id, [token], delta, finished, seq.finish_reason)
        out.index = seq.index
        if logprobs is not None:
            out.logprobs = [logprobs]
        return out

    def _free(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table.blocks)
        seq.block_table = BlockTable()
        if seq.fork_blocks:  # never forked (cancelled, or ended at its first token)
            self.pool.free(seq.fork_blocks)
            seq.fork_blocks = []

    def _forget(self, seq: Sequence) -> None:
        """A finished sequence leaves its request; the request goes with its last one."""
        seqs = self._requests.get(seq.request_id)
        if seqs is not None and seq in seqs:
            seqs.remove(seq)
            if not seqs:
                del self._requests[seq.request_id]

    # -- prefill instance: held KV -----------------------------------------------------------------

    def release(self, request_id: str) -> int:
        """Free the KV a prefill instance holds for a request; returns the blocks freed."""
        seq = self.sequence(request_id)
        if seq is None or seq.status is not SequenceStatus.HELD:
            return 0
        freed = len(seq.block_table)
        del self._requests[request_id]
        self._free(seq)
        seq.status = SequenceStatus.FINISHED
        return freed

    # -- decode instance: KV pulled from elsewhere -------------------------------------------------

    def add_prefilled(
        self,
        prompt_ids: list[int],
        first_token: int | None,
        params: SamplingParams,
        request_id: str,
        *,
        reuse_prefix: bool = False,
        choices: tuple[tuple[int, int], ...] = (),
    ) -> str:
        """Queue a request prefilled elsewhere; it waits until its KV fits (see admit_pulls).
        `first_token` None: prefill is still running; the token comes with `start_decoding`.

        choices: a request of n choices, (index, first token) of each one to decode (those
        that did not end at their first token; `first_token` is None then): once its KV is in
        place the request forks into them (`start_decoding`), sharing the pulled blocks.

        reuse_prefix: the caller pulls only the blocks this engine lacks: at admission the
        sequence starts from the longest cached prefix of its prompt's full blocks here, and
        its first `num_cached_tokens // block_size` blocks hold that KV already (shared with
        other sequences: never write into them). False: every block is new and pulled."""
        self._validate(prompt_ids, params)
        choices = tuple((int(i), int(t)) for i, t in choices)
        if choices and first_token is not None:
            raise InvalidRequest("give the first token, or the choices' first tokens, not both")
        seq = self._new_sequence(prompt_ids, params, request_id, choices[0][0] if choices else 0)
        seq.reuse_prefix = reuse_prefix
        if len(choices) == 1:
            first_token = choices[0][1]
        elif choices:
            seq.fork_choices = list(choices)
        if first_token is not None:
            self._append_first(seq, first_token)
        seq.status = SequenceStatus.PULL_WAITING
        self.pull_waiting.append(seq)
        return request_id

    def admit_pulls(self) -> list[Sequence]:
        """Give queued prefilled requests blocks for their prompt KV, in order, while they fit.

        Returns the sequences whose KV can now be pulled into `seq.block_table`: all of its
        blocks, or (added with reuse_prefix) those after its first `seq.num_cached_tokens //
        block_size`, which hold cached KV already.
        """
        admitted = []
        pulling = sum(
            s.width
            for seqs in self._requests.values()
            for s in seqs
            if s.status is SequenceStatus.PULLING
        )
        seats = self.running.free_seats - pulling
        while self.pull_waiting and self.pull_waiting[0].width <= seats:
            seq = self.pull_waiting[0]
            n = seq.num_prompt_tokens
            hits = self.prefix.hits(seq, n) if seq.reuse_prefix else []
            # Keep room for every running sequence's next block, so admission never preempts.
            copies = self._copies(seq, seq.width)
            if not self._allocate(seq, n, hits, spare=len(self.running), copies=copies):
                break
            seats -= seq.width
            self.pull_waiting.popleft()
            seq.status = SequenceStatus.PULLING
            admitted.append(seq)
        return admitted

    def start_decoding(self, request_id: str, first_token: int | None = None) -> bool:
        """The KV of a pulled request is in place: it joins the decode batch at the next step
        (with its first token, if it was queued without one). A request of several choices
        forks into them now (see `add_prefilled`)."""
        seqs = self._requests.get(request_id)
        seq = seqs[0] if seqs else None
        if seq is None or seq.status is not SequenceStatus.PULLING:
            return False
        if seq.fork_choices:
            self._start_choices(seq)
            return True
        if first_token is not None:
            self._append_first(seq, first_token)
        elif seq.num_output_tokens == 0:
            raise InvalidRequest(f"request {request_id} has no first token")
        seq.status = SequenceStatus.RUNNING
        self.running.join(seq)
        return True

    def _start_choices(self, seq: Sequence) -> None:
        """A pulled request forks into its choices, each with its first token, and they join
        the decode batch."""
        first, *others = seq.fork_choices
        seq.fork_choices = []
        choices = [seq] + [self._choice(seq, index) for index, _ in others]
        for choice, (_, token) in zip(choices, [first, *others], strict=True):
            choice.skip_draw()
            choice.append(token)
        if any(c.finish_reason is not None for c in choices):
            self.abort(seq.request_id)
            raise InvalidRequest(
                f"request {seq.request_id}: a choice sent to decode already ended at its first "
                "token"
            )
        for choice in choices:
            choice.status = SequenceStatus.RUNNING
            self.running.join(choice)

    def _append_first(self, seq: Sequence, token: int) -> None:
        """A pulled request's first token (sampled by prefill); it is in no queue here. Its
        random stream moves past the draw prefill made for it, so the next token gets the draw
        it gets on one instance: seeded sampling through the mesh is colocated's."""
        seq.skip_draw()
        seq.append(token)
        if seq.finish_reason is not None:
            self._requests.pop(seq.request_id, None)
            self._free(seq)
            seq.status = SequenceStatus.FINISHED
            raise InvalidRequest(f"request {seq.request_id} already ended at its first token")

    # -- convenience -----------------------------------------------------------------------------

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Completion]:
        """Run prompts together to completion; results in prompt order, a request's choices
        (n > 1, best_of) in index order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        prompt_ids = {rid: list(self._requests[rid][0].token_ids) for rid in ids}
        answers: dict[tuple[str, int], Completion] = {}
        while self.has_unfinished():
            for out in self.step():
                key = (out.request_id, out.index)
                done = answers.setdefault(
                    key, Completion(out.request_id, prompt_ids[out.request_id], [], "", None)
                )
                done.token_ids += out.new_token_ids
                done.text += out.text_delta
                done.finish_reason = out.finish_reason
                done.index = out.index
        return [answers[key] for key in sorted(answers, key=lambda k: (ids.index(k[0]), k[1]))]


def _stable_seed(seed: int, request_id: str) -> int:
    """A per-request seed that is the same in every process (unlike hash())."""
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
