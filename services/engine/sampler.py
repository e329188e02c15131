"""Sampling of the next token for a batch: logits processors, then greedy or seeded sampling.

The order is vLLM's (v1 `Sampler`), so that a request gets what it would get there:

1. min_tokens: EOS and stop token ids to -inf while a row has fewer outputs than min_tokens;
2. logit_bias: added to the named ids;
3. penalties, on every row that has one: repetition (a seen token's logit divided by the
   penalty when positive, multiplied when not; seen = in the prompt or the output), then
   frequency (minus penalty * count in the output), then presence (minus penalty once for a
   token the output holds);
4. greedy rows take the argmax here;
5. temperature;
6. min_p: tokens with a probability below min_p * the largest to -inf;
7. top-k, then top-p;
8. one draw per row: inverse-CDF sampling with a uniform number from the request's own stream.

All rows are handled by the same tensor ops, and each processor runs only when a row of the batch
uses it (a batch without any goes straight to the argmax or the draw). A row's token depends only
on its logits, its parameters and its stream, never on the other rows of the batch, so a seed
reproduces across batch compositions.

`TokenCounts` holds what the penalties read, per sequence of the decode batch: the counts of its
output tokens and a mask of its prompt's, rows of device tensors filled once when the sequence
joins and incremented with each token sampled for it, so a step reads them without rebuilding
anything from token lists.

Log-probabilities (`score`, `Scores`, `prompt_logprobs`) are a separate step, not a processor:
they are read from the raw logits before any of the above changes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.common.logprobs import TokenLogprobs

if TYPE_CHECKING:
    from services.engine.sequence import Sequence


@dataclass
class Penalties:
    """The penalties of the rows `rows` of a batch: (P,) parameters, (P, V) token state."""

    rows: torch.Tensor  # int64 (P,) rows of the batch
    presence: torch.Tensor  # float32 (P,)
    frequency: torch.Tensor  # float32 (P,)
    repetition: torch.Tensor  # float32 (P,)
    output_counts: torch.Tensor  # int32 (P, V) times each token is in the output
    prompt_mask: torch.Tensor  # bool (P, V) whether each token is in the prompt


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, (B,) tensors, and the logits processors some rows use."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = off
    top_p: torch.Tensor  # float32; 1 = off
    uniform: torch.Tensor  # float32 in (0, 1], one draw per row
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    min_p: torch.Tensor | None = None  # float32 (B,); None: no row uses it
    # (rows, ids) to mask (min_tokens), and (rows, ids, biases) to add (logit_bias).
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits (B, V) float32 -> token ids (B,) int64. May change `logits` in place."""
    if batch.banned is not None:
        logits.index_put_(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    if batch.bias is not None:
        rows, ids, values = batch.bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if batch.penalties is not None:
        pen = batch.penalties
        logits[pen.rows] = apply_penalties(
            logits[pen.rows],
            pen.output_counts,
            pen.prompt_mask,
            presence=pen.presence,
            frequency=pen.frequency,
            repetition=pen.repetition,
        )
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    temp = batch.temperature.clamp(min=1e-5)[:, None]  # (B, 1)
    logits = logits / temp
    if batch.min_p is not None:
        logits = apply_min_p(logits, batch.min_p)
    if batch.any_top_k:
        logits = _top_k(logits, batch.top_k)
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    if batch.any_top_p:
        probs = _top_p(probs, batch.top_p)
    # Inverse-CDF sampling in vocabulary order; u in (0, 1] never lands on a zero-probability id.
    cdf = probs.cumsum(dim=-1)  # (B, V)
    target = batch.uniform[:, None] * cdf[:, -1:]
    sampled = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    return torch.where(batch.temperature == 0, greedy, sampled)


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties: logits (P, V), counts (P, V) int, mask
    (P, V) bool, penalties (P,) -> new logits (P, V)."""
    seen = prompt_mask | (output_counts > 0)  # (P, V)
    rep = torch.where(seen, repetition[:, None], 1.0)  # (P, V)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tokens less likely than min_p (B,) times the row's most likely one to -inf (min_p 0
    keeps every token); logits (B, V) after temperature."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # (B, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
    kmax = int(k.max())
    top = logits.topk(kmax, dim=-1).values  # (B, kmax), descending
    threshold = top.gather(1, (k - 1)[:, None])  # (B, 1) the k-th largest
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_p(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    sorted_probs, _ = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly before each entry
    keep = before < p[:, None]  # the smallest prefix reaching p (always >= 1 entry)
    # The smallest kept probability of each row is its threshold in vocabulary order.
    threshold = sorted_probs.masked_fill(~keep, float("inf")).min(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < threshold, 0.0)


class TokenCounts:
    """Per penalized sequence of the decode batch, a row of (rows, V) device tensors: how many
    times each token is in its output, and whether it is in its prompt.

    `add` fills a row from the sequence's tokens when it joins the batch (once per join);
    `record` adds each step's sampled tokens to their rows (one scatter for the batch);
    `remove` frees the row when it leaves. Rows grow by doubling, so a mesh that never sees a
    penalty holds none. Its tensors are inference tensors, changed only in inference mode.
    """

    @torch.inference_mode()
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._free: list[int] = []

    @property
    def rows_in_use(self) -> int:
        return self.output.shape[0] - len(self._free)

    @torch.inference_mode()
    def add(self, seq: Sequence) -> None:
        """Give `seq` a row holding its tokens so far."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        counts, mask = token_state([seq], self.vocab_size, self.device)
        self.output[row] = counts[0]
        self.prompt[row] = mask[0]
        seq.counts_row = row

    def remove(self, seq: Sequence) -> None:
        if seq.counts_row is not None:
            self._free.append(seq.counts_row)
            seq.counts_row = None

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts, prompt mask) of rows (P,) -> (P, V) each."""
        return self.output[rows], self.prompt[rows]

    @torch.inference_mode()
    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count token tokens[i] once more in row rows[i] (rows distinct)."""
        self.output.index_put_((rows, tokens), torch.ones_like(rows, dtype=torch.int32), True)

    def _grow(self) -> None:
        old = self.output.shape[0]
        new = max(8, 2 * old)
        v, dev = self.vocab_size, self.device
        output = torch.zeros(new, v, dtype=torch.int32, device=dev)
        prompt = torch.zeros(new, v, dtype=torch.bool, device=dev)
        output[:old] = self.output
        prompt[:old] = self.prompt
        self.output, self.prompt = output, prompt
        self._free.extend(range(new - 1, old - 1, -1))


def token_state(
    seqs: list[Sequence], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output counts (P, V) int32 and prompt mask (P, V) bool built from the sequences' token
    lists: for a sequence outside the decode batch (its first token, sampled on prefill) or one
    joining it."""
    counts = torch.zeros(len(seqs), vocab_size, dtype=torch.int32, device=device)
    mask = torch.zeros(len(seqs), vocab_size, dtype=torch.bool, device=device)
    for i, seq in enumerate(seqs):
        ids = torch.tensor(seq.token_ids, dtype=torch.int64).to(device, non_blocking=True)
        n = seq.num_prompt_tokens
        mask[i, ids[:n]] = True
        out = ids[n:]
        counts[i].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
    return counts, mask


# -- log-probabilities ---------------------------------------------------------------------------
# A step of their own beside sampling: `score` takes the raw logits of the rows that asked
# before the processors change them (vLLM's raw_logprobs), `Scores.of` adds the sampled tokens.
# Rows that did not ask cost nothing: no log_softmax, no top-k.


@dataclass
class Scores:
    """log_softmax of the rows `rows` of a batch's raw logits, and each row's k."""

    rows: list[int]
    logprobs: torch.Tensor  # float32 (R, V)
    ks: list[int]

    def of(self, tokens: list[int], batch_size: int) -> list[TokenLogprobs | None]:
        """Per row of the batch: the logprobs of its sampled token (None: it did not ask)."""
        device = self.logprobs.device
        chosen = torch.tensor([tokens[r] for r in self.rows], dtype=torch.int64, device=device)
        found = token_logprobs(self.logprobs, chosen, self.ks)
        out: list[TokenLogprobs | None] = [None] * batch_size
        for row, lp in zip(self.rows, found, strict=True):
            out[row] = lp
        return out


def score(logits: torch.Tensor, rows: list[int], ks: list[int]) -> Scores:
    """The raw log-probabilities of `rows` of logits (B, V); call before sampling."""
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    return Scores(rows, torch.log_softmax(logits[index].float(), dim=-1), ks)


def token_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, ks: list[int]
) -> list[TokenLogprobs]:
    """logprobs (R, V) and a token per row (R,) -> each row's token's logprob and rank, and
    its ks[i] most likely tokens (one top-k for the rows, cut per row)."""
    chosen = logprobs.gather(1, tokens[:, None])  # (R, 1)
    rank = (logprobs > chosen).sum(dim=-1) + 1  # (R,)
    kmax = min(max(ks), logprobs.shape[-1])
    top = logprobs.topk(kmax, dim=-1)  # (R, kmax), most likely first
    ids, values = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprobs(t, lp, r, tuple(i[:k]), tuple(v[:k]))
        for t, lp, r, i, v, k in zip(
            tokens.tolist(), chosen[:, 0].tolist(), rank.tolist(), ids, values, ks, strict=True
        )
    ]


# Bytes of float32 logits (and their log_softmax) one chunk of prompt positions may take.
PROMPT_LOGPROBS_CHUNK_BYTES = 256 * 2**20


def prompt_logprobs(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    k: int,
    vocab_size: int,
) -> list[TokenLogprobs]:
    """The logprobs of each prompt token given the ones before it: hidden (T, H) of positions
    0..T-1 and targets (T,), the tokens at positions 1..T. The LM head (`logits_of`) runs over
    chunks of positions, so a long prompt never holds all its (T, V) logits at once."""
    rows = max(1, PROMPT_LOGPROBS_CHUNK_BYTES // (8 * vocab_size))  # logits + log_softmax
    target = torch.tensor(targets, dtype=torch.int64).to(hidden.device, non_blocking=True)
    out: list[TokenLogprobs] = []
    for start in range(0, hidden.shape[0], rows):
        logprobs = torch.log_softmax(logits_of(hidden[start : start + rows]).float(), dim=-1)
        n = logprobs.shape[0]
        out += token_logprobs(logprobs, target[start : start + n], [k] * n)
    return out
