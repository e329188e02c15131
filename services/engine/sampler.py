"""Sampling of the next token for a batch: greedy, temperature, top-k, top-p, per-request seeds.

All rows are handled by the same tensor ops; what is per request is one uniform number drawn from
the request's own random stream. A row's token depends only on its logits, its parameters and its
stream, never on the other rows of the batch, so a seed reproduces across batch compositions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, (B,) tensors."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = off
    top_p: torch.Tensor  # float32; 1 = off
    uniform: torch.Tensor  # float32 in (0, 1], one draw per row
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits (B, V) float32 -> token ids (B,) int64."""
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    temp = batch.temperature.clamp(min=1e-5)[:, None]  # (B, 1)
    logits = logits / temp
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
