"""Runs the model for a batch of sequences: builds the step's tensors, forwards, samples.

The hot paths are `prefill` and `decode`. Per step, Python touches each sequence once to gather
its token, position and cache slot (into buffers allocated once); everything per layer or per
token of context is tensor work.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from services.common.logprobs import MAX_LOGPROBS
from services.common.sampling import SamplingParams
from services.engine.attention import AttentionContext, AttentionMetadata, TorchAttention
from services.engine.kv_cache import KvCache
from services.engine.models.base import CausalLM
from services.engine.sampler import (
    Penalties,
    SamplingBatch,
    Scores,
    TokenCounts,
    prompt_logprobs,
    sample,
    score,
    token_state,
)
from services.engine.sequence import Sequence
from services.engine.structured import GrammarMask


class ModelRunner:
    """The model, its KV cache and attention backend, and the per-step input buffers."""

    def __init__(
        self, model: CausalLM, cache: KvCache, backend: TorchAttention, max_num_seqs: int
    ) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend
        self.block_size = cache.block_size
        self.device = cache.data.device
        self.vocab_size = model.config.vocab_size
        # Token counts of the decode batch's penalized sequences (DecodeBatch keeps them).
        self.token_counts = TokenCounts(self.vocab_size, self.device)
        # Structured output: the bitmask of the batch's constrained sequences, each step.
        self.grammar_mask = GrammarMask(max_num_seqs, self.vocab_size)
        # Decode inputs, reused every step: numpy arrays sharing memory with CPU tensors.
        self._ids = np.zeros(max_num_seqs, dtype=np.int64)
        self._pos = np.zeros(max_num_seqs, dtype=np.int64)
        self._slots = np.zeros(max_num_seqs, dtype=np.int64)
        self._ctx = np.zeros(max_num_seqs, dtype=np.int32)

    @torch.inference_mode()
    def prefill(
        self, seqs: list[Sequence], on_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Run prompts (packed) -> logits of each prompt's last token (N, vocab). A sequence's
        first `num_cached_tokens` tokens have their KV in the cache already (a cached prefix):
        only the rest is run, attending over the whole context. `on_layer(i)`: layer i's KV is
        in the cache (on a GPU, once the device got there). A sequence that asked for its
        prompt's logprobs (it has no cached prefix then) gets them in `seq.prompt_logprobs`:
        the LM head runs over its every position, the others' last only."""
        bs = self.block_size
        ids: list[int] = []
        slots: list[int] = []
        positions: list[np.ndarray] = []
        cu = [0]
        # With a cached prefix, attention reads every sequence's whole context from the cache.
        with_context = any(s.num_cached_tokens for s in seqs)
        kv_slots: list[int] = []
        cu_k = [0]
        for seq in seqs:
            c, n = seq.num_cached_tokens, seq.num_tokens
            runs = seq.block_table.runs
            ids.extend(seq.token_ids[c:])
            slots.extend(_slots(runs, c, n, bs))
            positions.append(np.arange(c, n))
            cu.append(len(ids))
            if with_context:
                kv_slots.extend(_slots(runs, 0, n, bs))
                cu_k.append(len(kv_slots))
        meta = AttentionMetadata(
            slots=self._to_device(np.asarray(slots, dtype=np.int64)),
            is_prefill=True,
            cu_seqlens=cu,
            max_seqlen=max(b - a for a, b in itertools.pairwise(cu)),
        )
        if with_context:
            meta.kv_slots = self._to_device(np.asarray(kv_slots, dtype=np.int64))
            meta.cu_seqlens_k = cu_k
            meta.max_seqlen_k = max(b - a for a, b in itertools.pairwise(cu_k))
        if self.backend.name == "flash":
            meta.cu_seqlens_t = torch.tensor(cu, dtype=torch.int32, device=self.device)
            if with_context:
                meta.cu_seqlens_k_t = torch.tensor(cu_k, dtype=torch.int32, device=self.device)
        if on_layer is not None and self.device.type == "cuda":
            user = on_layer

            def on_layer(i: int) -> None:  # the KV must be written before anyone reads it
                torch.cuda.current_stream(self.device).synchronize()
                user(i)

        hidden = self.model(
            self._to_device(np.asarray(ids, dtype=np.int64)),
            self._to_device(np.concatenate(positions)),
            AttentionContext(self.cache, meta, self.backend, self.model.attention_specs),
            on_layer,
        )
        for seq, start, end in zip(seqs, cu, cu[1:], strict=False):
            if seq.needs_prompt_logprobs and seq.num_cached_tokens == 0:
                seq.prompt_logprobs = prompt_logprobs(
                    self.model.logits,
                    hidden[start : end - 1],
                    seq.token_ids[1 : seq.num_prompt_tokens],
                    seq.params.prompt_logprobs,
                    self.vocab_size,
                )
        last = torch.tensor([b - 1 for b in cu[1:]], device=self.device)
        return self.model.logits(hidden[last])

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token for every sequence -> logits (B, vocab).

        Each sequence's last token has no KV yet: it is written at position num_tokens - 1,
        whose block the scheduler has allocated.
        """
        bs = self.block_size
        B = len(seqs)
        spans: list[list[tuple[int, int]]] = []
        for i, seq in enumerate(seqs):
            n = seq.num_tokens
            pos = n - 1
            self._ids[i] = seq.token_ids[-1]
            self._pos[i] = pos
            self._slots[i] = seq.block_table.blocks[pos // bs] * bs + pos % bs
            self._ctx[i] = n
            runs = seq.block_table.runs
            if len(runs) == 1:
                spans.append([(runs[0][0] * bs, n)])
            else:
                spans.append(_spans(runs, n, bs))
        meta = AttentionMetadata(
            slots=self._to_device(self._slots[:B]), is_prefill=False, spans=spans
        )
        if self.backend.needs_block_tables:
            width = max(len(s.block_table) for s in seqs)
            table = np.zeros((B, width), dtype=np.int32)
            for i, seq in enumerate(seqs):
                table[i, : len(seq.block_table)] = seq.block_table.blocks
            meta.block_tables = self._to_device(table)
            meta.context_lens = self._to_device(self._ctx[:B])
        hidden = self.model(
            self._to_device(self._ids[:B]),
            self._to_device(self._pos[:B]),
            AttentionContext(self.cache, meta, self.backend, self.model.attention_specs),
        )
        return self.model.logits(hidden)

    def profile(self, prefill_tokens: int) -> None:
        """Run the engine's largest batches once, for the caller to measure their activation
        peak (services/engine/kv_sizing.py): a prefill of `prefill_tokens` tokens and a decode
        step of max_num_seqs sequences, each sampled with top-k and top-p and asking for the
        most logprobs (the prompt's too: the LM head's chunks over every position). Every block
        id is 0 (the KV written is garbage, and the cache may be one block)."""
        params = SamplingParams(
            temperature=1.0,
            top_k=50,
            top_p=0.9,
            logprobs=MAX_LOGPROBS,
            prompt_logprobs=MAX_LOGPROBS,
        )

        def seq(tokens: int) -> Sequence:
            s = Sequence(
                "profile",
                [0] * tokens,
                params,
                eos_token_ids=(),
                max_context=tokens + 1,
                tokenizer=None,
                default_seed=0,
            )
            s.block_table.extend([0] * -(-tokens // self.block_size))
            return s

        prompt = [seq(prefill_tokens)]
        logits = self.prefill(prompt)
        self.score(logits, prompt).of(self.sample(logits, prompt), 1)
        batch = [seq(1) for _ in range(len(self._ids))]
        logits = self.decode(batch)
        self.score(logits, batch).of(self.sample(logits, batch), len(batch))

    def idle(self) -> None:
        """The engine waits for work (nothing to do here: a real step takes what it takes)."""

    @torch.inference_mode()
    def score(self, logits: torch.Tensor, seqs: list[Sequence]) -> Scores | None:
        """The raw log-probabilities of the sequences that asked for them (None: none did);
        call before `sample`, which changes the logits."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return None
        return score(logits, rows, [seqs[i].params.logprobs for i in rows])

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Pick the next token of each sequence (uses one draw of its stream if not greedy).
        A batch where every sequence is greedy and none uses a logits processor is one argmax;
        the processors' inputs are built only for the rows that use them.

        Structured output comes first, as in vLLM (its bitmask is applied to the logits before
        its sampler computes logprobs or applies a processor): the tokens a constrained
        sequence's grammar does not allow next are set to -inf; other rows pay nothing."""
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained:
            self._mask(logits, constrained, seqs)
        temps = [s.params.temperature for s in seqs]
        processed = [i for i, s in enumerate(seqs) if s.processed]
        if not processed and not any(temps):
            return logits.argmax(dim=-1).tolist()
        return self._sample(logits, seqs, temps, processed)

    @torch.inference_mode()  # the mask changes the (inference) logits in place
    def _mask(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
        self.grammar_mask.apply(logits, rows, [seqs[i].matcher for i in rows])

    @torch.inference_mode()  # the processors change the (inference) logits in place
    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], temps: list[float], processed: list[int]
    ) -> list[int]:
        batch, counted = self._sampling_batch(seqs, temps, processed)
        tokens = sample(logits, batch)
        if counted is not None:  # the decode batch's rows: count what was sampled
            self.token_counts.record(counted, tokens[batch.penalties.rows])
        return tokens.tolist()

    def _sampling_batch(
        self, seqs: list[Sequence], temps: list[float], processed: list[int]
    ) -> tuple[SamplingBatch, torch.Tensor | None]:
        """The batch's sampling tensors, and the TokenCounts rows of its penalized sequences
        when they come from there (None when built from token lists: a prefill's first token)."""
        dev = self.device
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        # Draws lie in (0, 1]: inverse-CDF sampling never picks a zero-probability id.
        uniform = [s.draw() if t > 0 else 1.0 for s, t in zip(seqs, temps, strict=True)]
        batch = SamplingBatch(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=dev),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=dev),
            uniform=torch.tensor(uniform, dtype=torch.float32, device=dev),
            all_greedy=not any(temps),
            any_top_k=any(top_k),
            any_top_p=any(p < 1.0 for p in top_p),
        )
        if not processed:
            return batch, None
        used = [seqs[i] for i in processed]
        if any(s.params.min_p > 0 and s.params.temperature > 0 for s in used):
            min_p = [s.params.min_p for s in seqs]
            batch.min_p = torch.tensor(min_p, dtype=torch.float32, device=dev)
        rows: list[int] = []
        ids: list[int] = []
        for i, s in zip(processed, used, strict=True):
            if s.num_output_tokens < s.params.min_tokens:
                rows += [i] * len(s.stop_token_ids)
                ids += s.stop_token_ids
        if rows:
            batch.banned = (self._tensor(rows), self._tensor(ids))
        rows, ids, values = [], [], []
        for i, s in zip(processed, used, strict=True):
            if s.params.logit_bias:
                rows += [i] * len(s.bias_ids)
                ids += s.bias_ids
                values += s.bias_values
        if rows:
            biases = torch.tensor(values, dtype=torch.float32, device=dev)
            batch.bias = (self._tensor(rows), self._tensor(ids), biases)
        return batch, self._penalties(batch, seqs, processed)

    def _penalties(
        self, batch: SamplingBatch, seqs: list[Sequence], processed: list[int]
    ) -> torch.Tensor | None:
        """Set batch.penalties for the penalized rows; return their TokenCounts rows, if any."""
        pen = [i for i in processed if seqs[i].params.penalized]
        if not pen:
            return None
        params = [seqs[i].params for i in pen]
        table_rows = [seqs[i].counts_row for i in pen]
        counted = None
        if all(r is not None for r in table_rows):
            counted = self._tensor(table_rows)
            counts, mask = self.token_counts.gather(counted)
        else:
            counts, mask = token_state([seqs[i] for i in pen], self.vocab_size, self.device)
        batch.penalties = Penalties(
            rows=self._tensor(pen),
            presence=self._floats([p.presence_penalty for p in params]),
            frequency=self._floats([p.frequency_penalty for p in params]),
            repetition=self._floats([p.repetition_penalty for p in params]),
            output_counts=counts,
            prompt_mask=mask,
        )
        return counted

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def _floats(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32).to(self.device, non_blocking=True)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)


def _slots(runs: list[list[int]], start: int, end: int, bs: int) -> list[int]:
    """Cache slots of positions [start, end) of a sequence whose blocks are `runs`."""
    out: list[int] = []
    base = 0  # the position of the run's first slot
    for first, count in runs:
        lo, hi = max(start, base), min(end, base + count * bs)
        if lo < hi:
            out.extend(range(first * bs - base + lo, first * bs - base + hi))
        base += count * bs
        if base >= end:
            break
    return out


def _spans(runs: list[list[int]], n: int, bs: int) -> list[tuple[int, int]]:
    """(first slot, length) of each run of blocks holding the first n tokens."""
    out = []
    for first, count in runs:
        take = min(count * bs, n)
        out.append((first * bs, take))
        n -= take
        if n <= 0:
            break
    return out
