"""Admission: refuse early what the mesh cannot serve in time, rather than accept and fail late.

Three rules, checked before a request is routed (so a refusal is an HTTP status, not a broken
stream):

* **Bounded in flight.** At most `max_inflight` requests are in the gateway at once; memory stays
  bounded under any offered load.
* **Predicted TTFT.** A request's TTFT is predicted from the queue it would join: the prompt
  tokens queued on the least-loaded prefill (or colocated) instance and its own, priced by
  `a + b * tokens`, a least-squares line through the prefill batches the prefill instances
  reported lately (compute time against batch tokens; no prediction until those batches span a
  range of sizes), bounded by the cheapest of them (`CostLine`: on a loaded host big batches
  are slow batches, which least squares alone reads as cost per token). A request predicted
  to miss `ttft_factor` x the TTFT SLO because of the queue ahead of it is refused at once with
  RESOURCE_EXHAUSTED / HTTP 429 and a retry-after hint: the time that queue needs to drain
  below the limit. (With nothing queued it is served,
  however long its own prefill: refusing it would refuse it for ever.)
  The queue counts the batch being computed too: its prompts are not done.
* **Decode watermarks.** When every decode instance is past a watermark (pending KV pulls, KV
  use, or decode steps slower than `tpot_watermark` x the TPOT SLO while it has sequences
  running: each one it takes in makes every step slower), new prompts wait at the gateway
  before prefill (prefilled KV would only pile up on the prefill instances) for as long as their
  TTFT budget allows, then are refused the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from services.common.errors import Overloaded
from services.gateway.registry import Registry, Worker

# Prefill batches the cost line is fitted to (the latest), and how many it needs, spanning at
# least a factor of two in batch tokens.
FIT_SAMPLES = 128
FIT_MIN_SAMPLES = 8
WATERMARK_POLL_S = 0.02


@dataclass(frozen=True)
class AdmissionConfig:
    max_inflight: int = 1024  # requests in the gateway at once
    ttft_factor: float = 1.0  # refuse past this many times the TTFT SLO (predicted); 0: off
    pull_watermark: int = 16  # pending KV pulls per decode instance past which prefill waits
    kv_watermark: float = 0.95  # share of a decode instance's KV blocks in use, likewise
    tpot_watermark: float = 1.0  # decode steps slower than this many TPOT SLOs, likewise; 0: off

    def __post_init__(self) -> None:
        if self.max_inflight < 1 or self.pull_watermark < 1:
            raise ValueError("max_inflight and pull_watermark must be >= 1")
        if self.ttft_factor < 0 or self.tpot_watermark < 0:
            raise ValueError("ttft_factor and tpot_watermark must be >= 0")
        if not 0 < self.kv_watermark <= 1:
            raise ValueError("kv_watermark must be in (0, 1]")


class Admission:
    """The gateway's admission control; `admit(prompt_tokens)` wraps a request's whole life."""

    def __init__(
        self,
        registry: Registry,
        ttft_slo_s: float,
        config: AdmissionConfig | None = None,
        on_refuse: Callable[[str], None] | None = None,
        *,
        tpot_slo_s: float | None = None,
    ) -> None:
        """`tpot_slo_s` None: no decode-step watermark."""
        self.registry = registry
        self.config = config or AdmissionConfig()
        self.limit_ms = self.config.ttft_factor * ttft_slo_s * 1000
        self.step_limit_ms = self.config.tpot_watermark * (tpot_slo_s or 0.0) * 1000
        self._line = CostLine()  # through the latest prefill batches
        self.cost: tuple[float, float] | None = None  # (a ms, b ms per token)
        self.inflight = 0
        self.on_refuse = on_refuse  # a refusal's rule, for the metrics

    def observe_prefill(self, compute_ms: float, batch_tokens: int) -> None:
        """A prefill batch's compute time, as the prefill instance reported it."""
        if batch_tokens <= 0 or compute_ms <= 0:
            return
        self._line.add(batch_tokens, compute_ms)
        self.cost = self._line.fit()

    @contextlib.asynccontextmanager
    async def admit(self, prompt_tokens: int) -> AsyncIterator[None]:
        """Hold a place for a request, or raise Overloaded (RESOURCE_EXHAUSTED) at once."""
        if self.inflight >= self.config.max_inflight:
            self._refuse(
                "inflight",
                f"the gateway has {self.inflight} requests in flight, its limit "
                f"(--max-inflight {self.config.max_inflight})",
                1.0,
            )
        self.inflight += 1
        try:
            if self.limit_ms > 0:
                await self._check(prompt_tokens)
            yield
        finally:
            self.inflight -= 1

    def predicted_ttft_ms(self, prompt_tokens: int) -> tuple[float, int] | None:
        """(predicted TTFT ms, prompt tokens queued ahead) on the least-loaded prefill path;
        None when there is nothing to predict from yet."""
        if self.cost is None:
            return None
        workers = self.registry.live("prefill") or self.registry.live("colocated")
        if not workers:
            return None
        queued = min(w.load.queued_prompt_tokens + w.inflight_tokens for w in workers)
        a, b = self.cost
        return a + b * (queued + prompt_tokens), queued

    async def _check(self, prompt_tokens: int) -> None:
        start = time.monotonic()
        predicted = self.predicted_ttft_ms(prompt_tokens)
        # Only a queue ahead refuses: a prompt that alone takes longer is served on an idle
        # mesh (refusing it would refuse it for ever).
        if predicted is not None and predicted[0] > self.limit_ms and predicted[1] > 0:
            ms, queued = predicted
            self._refuse(
                "ttft",
                f"it cannot meet the TTFT SLO now: {queued} prompt tokens are queued ahead, "
                f"predicted TTFT {ms:.0f} ms against a limit of {self.limit_ms:.0f} ms "
                f"({self.config.ttft_factor:g} x the TTFT SLO)",
                (ms - self.limit_ms) / 1000,
            )
        budget_s = (self.limit_ms - (predicted[0] if predicted else 0.0)) / 1000
        while self._decode_saturated():
            if time.monotonic() - start >= budget_s:
                self._refuse(
                    "decode_watermark",
                    "every decode instance is past its watermark (pending KV pulls "
                    f">= {self.config.pull_watermark}, KV use >= "
                    f"{self.config.kv_watermark:.0%} or decode steps >= "
                    f"{self.step_limit_ms:.0f} ms) for longer than the TTFT budget",
                    budget_s or 1.0,
                )
            await asyncio.sleep(WATERMARK_POLL_S)

    def _decode_saturated(self) -> bool:
        workers = self.registry.live("decode")
        return bool(workers) and all(self._past_watermark(w) for w in workers)

    def _past_watermark(self, w: Worker) -> bool:
        load = w.load
        if load.pending_pulls + w.inflight_requests >= self.config.pull_watermark:
            return True
        if self.step_limit_ms and load.running_seqs and load.decode_step_ms >= self.step_limit_ms:
            return True
        used = 1 - load.free_kv_blocks / load.total_kv_blocks if load.total_kv_blocks else 0.0
        return used >= self.config.kv_watermark

    def _refuse(self, reason: str, why: str, retry_after_s: float) -> None:
        if self.on_refuse is not None:
            self.on_refuse(reason)
        retry = max(1, math.ceil(retry_after_s))
        raise Overloaded(f"the mesh is overloaded: {why}; retry after {retry} s", retry)


class CostLine:
    """`ms = a + b * tokens` over the latest `size` prefill batches: least squares, bounded by
    what the batches allow, kept as running sums and sliding extremes so that a batch costs
    O(1) (it is observed on the first token's path, where a numpy fit cost ~0.15 ms).

    The bounds: with a, b >= 0 every batch took at least `b * tokens` and at least `a`, so b is
    at most the cheapest batch's ms per token and a at most the fastest batch's ms. They matter
    on a loaded host, where the batches are big exactly when the instance is slow (a slow
    stretch queues more prompts, and the slow stretch inflates their batch): least squares
    then reads contention as cost per token (measured: 1.6 ms/token on the tiny model, 80x its
    real cost, predicting 1 s for a queue one 40 ms batch would clear)."""

    def __init__(self, size: int = FIT_SAMPLES) -> None:
        self.size = size
        self._window: deque[tuple[int, float]] = deque()
        self._seq = 0  # batches seen
        self._tokens_lo = _SlidingMin(size)
        self._tokens_hi = _SlidingMin(size)  # of -tokens
        self._per_token = _SlidingMin(size)  # the least ms per token
        self._fastest = _SlidingMin(size)  # the least ms
        self._sums = [0.0, 0.0, 0.0, 0.0]  # tokens, ms, tokens^2, tokens * ms

    def add(self, tokens: int, ms: float) -> None:
        self._window.append((tokens, ms))
        self._accumulate(tokens, ms, 1)
        if len(self._window) > self.size:
            self._accumulate(*self._window.popleft(), -1)
        seq, self._seq = self._seq, self._seq + 1
        self._tokens_lo.add(seq, tokens)
        self._tokens_hi.add(seq, -tokens)
        self._per_token.add(seq, ms / tokens)
        self._fastest.add(seq, ms)
        if self._seq % self.size == 0:  # sums of differences drift: start them afresh
            self._sums = [0.0, 0.0, 0.0, 0.0]
            for t, m in self._window:
                self._accumulate(t, m, 1)

    def _accumulate(self, t: int, m: float, sign: int) -> None:
        s = self._sums
        s[0] += sign * t
        s[1] += sign * m
        s[2] += sign * t * t
        s[3] += sign * t * m

    def fit(self) -> tuple[float, float] | None:
        """(a ms, b ms per token) with a, b >= 0; None until there are FIT_MIN_SAMPLES
        batches spanning at least a factor of two in tokens (a line through one size would
        price its fixed cost per token)."""
        n = len(self._window)
        if n < FIT_MIN_SAMPLES or -self._tokens_hi.least < 2 * self._tokens_lo.least:
            return None
        st, sm, stt, stm = self._sums
        b = (stm - st * sm / n) / (stt - st * st / n)
        if b <= 0:
            return None
        b = min(b, self._per_token.least)
        return min(max(0.0, (sm - b * st) / n), self._fastest.least), b


class _SlidingMin:
    """The least of the latest `size` values added: candidates kept increasing from the left,
    each added value dropping the older ones it beats."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._queue: deque[tuple[int, float]] = deque()  # (seq, value)

    def add(self, seq: int, value: float) -> None:
        q = self._queue
        while q and q[-1][1] >= value:
            q.pop()
        q.append((seq, value))
        if q[0][0] <= seq - self.size:
            q.popleft()

    @property
    def least(self) -> float:
        return self._queue[0][1]
