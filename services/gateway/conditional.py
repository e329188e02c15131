"""Conditional disaggregation: which prompts a decode instance prefills itself.

Disaggregation pays a handoff for every request; for a short prompt that handoff (and the
prefill queue) can cost more than the prefill. A decode instance can prefill it in place, at the
price of stalling its running batch for that prefill. The rule: a prompt of L tokens is
prefilled locally when that stall fits in the TPOT SLO's slack,

    prefill_ms(L) <= tpot_slo_ms - decode_step_ms

with both from the latency profile `distserve profile` writes (DistServe's form, tp = 1:
prefill `a + b*L + c*L^2`, decode step `a + b*sum(ctx) + c*B` at a typical batch), and only on a
decode instance with headroom (nothing else waiting to be prefilled there, free KV).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidRequest


@dataclass(frozen=True)
class LocalPrefill:
    """Prompts of at most `max_tokens` tokens may be prefilled on a decode instance."""

    max_tokens: int
    rule: str  # how max_tokens was chosen, for logs and spans

    @classmethod
    def from_profile(
        cls,
        path: Path,
        tpot_slo_ms: float,
        decode_batch: int = 16,
        decode_context: int = 512,
        max_context: int = 1 << 20,
    ) -> LocalPrefill:
        """The largest L with prefill_ms(L) <= tpot_slo_ms - decode_step_ms(decode_batch
        sequences of decode_context tokens); 0 (never local) when nothing fits."""
        try:
            profile = json.loads(Path(path).read_text())
            tp1 = profile["tp"]["1"]
            a, b, c = tp1["prefill"]
            regime = (
                "decoding_largebs"
                if decode_batch >= tp1["decoding_large_small_bs_threshold"]
                else "decoding_smallbs"
            )
            da, db, dc = tp1[regime]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidRequest(f"cannot read the latency profile {path}: {e}") from e
        step = da + db * decode_batch * decode_context + dc * decode_batch
        slack = tpot_slo_ms - step
        lo, hi = 0, max_context
        while lo < hi:  # prefill time grows with L: the largest L within the slack
            mid = (lo + hi + 1) // 2
            if a + b * mid + c * mid * mid <= slack:
                lo = mid
            else:
                hi = mid - 1
        rule = (
            f"prefill_ms(L) <= TPOT SLO {tpot_slo_ms:g} ms - decode step {step:.2f} ms "
            f"(batch {decode_batch}, context {decode_context}; profile {Path(path).name})"
        )
        return cls(lo, rule)

    def allows(self, prompt_tokens: int) -> bool:
        return 0 < prompt_tokens <= self.max_tokens
