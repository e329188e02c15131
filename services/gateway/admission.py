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
* **Decode watermarks and seats.** When every decode instance is past a watermark (pending KV
  pulls, KV use, or decode steps slower than `tpot_watermark` x the TPOT SLO while it has
  sequences running), or the pool's seats are taken (each sequence an instance takes in makes
  every step slower: a line through its reported step time over its batch size gives the batch
  at which steps reach that limit, and the prompts on their way, queued or prefilling, take
  their seats before they get there; the fewer tokens a request asks for, the more the
  handoff bubble weighs in its TPOT and the shorter its steps must be: `step_limit`), new
  prompts wait at the gateway before prefill (prefilled KV would only pile up on the prefill
  instances) for as long as their TTFT budget allows, then are refused the same way. A
  waiting prompt's TTFT is predicted again at every poll, with the time it waited: the
  prompts let go together see each other in the queue.

The queue on an instance is the larger of what its last load report showed and what this
gateway sent there and has not had answered (`Worker.queued_tokens`): a report is a snapshot
the worker took between two engine steps, which under a burst missed seconds of work.

Why one file (~340 lines): the three rules read one view of the pool (its queues, its seats, the
prompts waiting here) and refuse through one path (`Admission.admit`); the cost line they price
a queue with is gateway/cost_line.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import statistics
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from services.common import clock
from services.common.errors import Overloaded
from services.common.stats import percentile
from services.gateway.cost_line import CostLine
from services.gateway.registry import Registry, Worker

WATERMARK_POLL_S = 0.02
BUBBLE_SAMPLES = 64  # requests whose handoff bubble the decode seat rule reckons with
# The TTFT prediction and the decode step limit are scaled by this quantile of actual /
# predicted over the latest CALIBRATION_SAMPLES requests, once there are CALIBRATION_MIN_SAMPLES:
# a request must meet both SLOs, so each is held for 95% of requests for 90% to meet both.
CALIBRATION_QUANTILE = 0.95
CALIBRATION_SAMPLES = 64
CALIBRATION_MIN_SAMPLES = 16


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


@dataclass(frozen=True)
class Verdict:
    """Why a request was let in: its predicted TTFT from the moment it was let go (None: the
    rule is off, or there is nothing to predict from yet), the prompt tokens queued ahead of
    it, and how long it waited at the decode watermark before."""

    predicted_ttft_ms: float | None = None
    queued_tokens: int = 0
    waited_ms: float = 0.0
    scale: float = 1.0  # the calibration the prediction was scaled by
    predicted_tpot_ms: float | None = None  # the TPOT it was admitted for (None: no step limit)


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
        # Per decode instance: the load report sampled last, and a line of its decode step time
        # over its batch size.
        self._steps: dict[str, tuple[float | None, CostLine]] = {}
        # The handoff bubble in decode steps: the median over the latest requests.
        self._bubbles: deque[float] = deque(maxlen=BUBBLE_SAMPLES)
        self.bubble = 1.0
        self.cost: tuple[float, float] | None = None  # (a ms, b ms per token)
        # Actual TTFT over predicted, for the latest requests admitted behind a queue; the
        # prediction is scaled by a high quantile of it.
        self._ttft_errors: deque[float] = deque(maxlen=CALIBRATION_SAMPLES)
        self.ttft_scale = 1.0
        # Actual TPOT over the TPOT admitted for; the step limit is divided by a high quantile.
        self._tpot_errors: deque[float] = deque(maxlen=CALIBRATION_SAMPLES)
        self.tpot_scale = 1.0
        self.inflight = 0
        self.on_refuse = on_refuse  # a refusal's rule, for the metrics

    def observe_prefill(self, compute_ms: float, batch_tokens: int) -> None:
        """A prefill batch's compute time, as the prefill instance reported it."""
        if batch_tokens <= 0 or compute_ms <= 0:
            return
        self._line.add(batch_tokens, compute_ms)
        self.cost = self._line.fit()

    @contextlib.asynccontextmanager
    async def admit(self, prompt_tokens: int, max_tokens: int = 0) -> AsyncIterator[Verdict]:
        """Hold a place for a request (the verdict says on what grounds), or raise Overloaded
        (RESOURCE_EXHAUSTED) at once. `max_tokens` 1: the request ends at prefill, no decode
        rule applies; 0: unknown."""
        if self.inflight >= self.config.max_inflight:
            self._refuse(
                "inflight",
                f"the gateway has {self.inflight} requests in flight, its limit "
                f"(--max-inflight {self.config.max_inflight})",
                1.0,
            )
        self.inflight += 1
        try:
            yield await self._check(prompt_tokens, max_tokens) if self.limit_ms > 0 else Verdict()
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
        queued = min(w.queued_tokens for w in workers)
        a, b = self.cost
        return self.ttft_scale * (a + b * (queued + prompt_tokens)), queued

    def observe(
        self, verdict: Verdict, ttft_s: float | None, bubble_steps: float | None, tpot_s: float
    ) -> None:
        """What happened to an admitted request, against what admission predicted: its TTFT
        (None: no first token), and, disaggregated, its handoff bubble in steady steps (None
        under three tokens) and its TPOT."""
        if ttft_s is not None:
            self.observe_ttft(verdict, ttft_s * 1000)
        if bubble_steps:
            self.observe_bubble(bubble_steps)
            self.observe_tpot(verdict, tpot_s * 1000)

    def observe_ttft(self, verdict: Verdict, ttft_ms: float) -> None:
        """An admitted request's TTFT as the gateway served it, against its prediction. The
        line prices the prefill batches as they were computed; it misses what a loaded host
        adds (contention from the other processes, the prompts behind that join the batch,
        the hops), so predictions are scaled by the CALIBRATION_QUANTILE of actual / predicted
        over the latest requests that had a queue ahead (with none, a request is admitted
        whatever it is predicted), within [1/4, 4]."""
        if verdict.predicted_ttft_ms is None or verdict.queued_tokens <= 0:
            return
        predicted = verdict.waited_ms + verdict.predicted_ttft_ms / verdict.scale
        if predicted <= 0:
            return
        self._ttft_errors.append(ttft_ms / predicted)
        self.ttft_scale = min(4.0, max(0.25, _quantile(self._ttft_errors) or 1.0))

    async def _check(self, prompt_tokens: int, max_tokens: int) -> Verdict:
        """Admit (the verdict) or refuse. While the decode pool is past its watermarks the
        request waits here, and its prediction is made again at every poll: the requests let go
        together when the watermark clears join one prefill queue, so each sees the ones let go
        before it (they count from the moment they are sent) and the time it already waited."""
        start = clock.monotonic()
        for poll in itertools.count():
            waited_ms = (clock.monotonic() - start) * 1000 if poll else 0.0
            predicted = self.predicted_ttft_ms(prompt_tokens)
            ms, queued = predicted if predicted is not None else (0.0, 0)
            saturated = max_tokens != 1 and self._decode_saturated(max_tokens)
            # Only a queue ahead (or a full decode pool) refuses: a prompt that alone takes
            # longer is served on an idle mesh (refusing it would refuse it for ever).
            if waited_ms + ms > self.limit_ms and (queued > 0 or saturated):
                if not poll and queued > 0:
                    self._refuse(
                        "ttft",
                        f"it cannot meet the TTFT SLO now: {queued} prompt tokens are queued "
                        f"ahead, predicted TTFT {ms:.0f} ms against a limit of "
                        f"{self.limit_ms:.0f} ms ({self.config.ttft_factor:g} x the TTFT SLO)",
                        (ms - self.limit_ms) / 1000,
                    )
                self._refuse(
                    "decode_watermark",
                    "every decode instance is past its watermark (pending KV pulls "
                    f">= {self.config.pull_watermark}, KV use >= "
                    f"{self.config.kv_watermark:.0%} or decode steps >= "
                    f"{self.step_limit_ms:.0f} ms), or the decode seats within that step "
                    "time are taken, for longer than the TTFT budget",
                    (waited_ms + ms - self.limit_ms) / 1000,
                )
            if not saturated:
                decodes = self.step_limit_ms > 0 and max_tokens != 1
                return Verdict(
                    None if predicted is None else ms,
                    queued,
                    waited_ms,
                    self.ttft_scale,
                    self.step_limit_ms / self.tpot_scale if decodes else None,
                )
            await asyncio.sleep(WATERMARK_POLL_S)

    def observe_bubble(self, steps: float) -> None:
        """A disaggregated request's first inter-token gap (the handoff bubble), in its steady
        inter-token gaps, as its client saw them."""
        self._bubbles.append(steps)
        self.bubble = max(1.0, statistics.median(self._bubbles))

    def step_limit(self, max_tokens: int) -> float:
        """The decode step time (ms) within which a request of `max_tokens` output tokens
        meets the step limit on average: its client's TPOT counts the handoff bubble, `bubble`
        steps long, among its `max_tokens - 1` gaps, so the fewer tokens, the shorter its steps
        must be (0: unknown, taken as long)."""
        limit = self.step_limit_ms / self.tpot_scale
        if max_tokens < 2:
            return limit
        return limit * (max_tokens - 1) / (self.bubble + max_tokens - 2)

    def observe_tpot(self, verdict: Verdict, tpot_ms: float) -> None:
        """A disaggregated request's TPOT as its client saw it, against the TPOT it was admitted
        for (its steps at the step limit, the bubble included). Batches fill up to the seats,
        so a request decodes at about the limit; how far above it the slower ones came out
        (steps vary, the seats count from a step time averaged over the latest steps) is what
        the limit must leave room for: it is divided by the CALIBRATION_QUANTILE of actual /
        admitted-for over the latest requests, within [1, 2] (never looser than configured)."""
        if verdict.predicted_tpot_ms is None or tpot_ms <= 0:
            return
        self._tpot_errors.append(tpot_ms / verdict.predicted_tpot_ms)
        self.tpot_scale = min(2.0, max(1.0, _quantile(self._tpot_errors) or 1.0))

    def _decode_saturated(self, max_tokens: int = 0) -> bool:
        workers = self.registry.live("decode")
        if not workers:
            return False
        if all(self._past_watermark(w) for w in workers):
            return True
        return self._seats_taken(workers, self.step_limit(max_tokens))

    def _seats_taken(self, decode: list[Worker], step_ms: float) -> bool:
        """Every sequence a decode instance runs makes each of its steps slower: past the batch
        size where its steps reach `step_ms` (`seats`), the pool takes no new prompt. A prompt
        on its way (queued or prefilling) holds a seat already: it decodes next."""
        seats, taken = self.pool_seats(decode, step_ms)
        return seats is not None and taken >= seats

    def pool_seats(
        self, decode: list[Worker] | None = None, step_ms: float | None = None
    ) -> tuple[int | None, int]:
        """(seats of the decode pool within `step_ms`, default the step limit for a long
        answer: None without a step limit or before every instance has a line; seats taken:
        sequences on decode and prompts on their way there)."""
        decode = self.registry.live("decode") if decode is None else decode
        coming = sum(w.open_requests for w in self.registry.live("prefill"))
        taken = sum(w.open_requests for w in decode) + coming
        if not self.step_limit_ms or not decode:
            return None, taken
        seats = [self.seats(w, step_ms or self.step_limit(0)) for w in decode]
        return (None if None in seats else sum(seats)), taken

    def seats(self, w: Worker, step_ms: float | None = None) -> int | None:
        """How many sequences decode instance `w` runs with steps within `step_ms` (default the
        step limit): from its latest reported step time and batch size, each sequence more or
        less costing the slope of a line through its reported step times over its batch sizes
        (a sample a load report); None until there is a line. At least one: a request is never
        held back by a decode instance that has nothing to do."""
        seen, line = self._steps.get(w.worker_id, (None, None))
        if line is None:
            line = CostLine()
        load = w.load
        if seen != w.last_seen and load.running_seqs and load.decode_step_ms > 0:
            line.add(load.running_seqs, load.decode_step_ms)
            seen = w.last_seen
        self._steps[w.worker_id] = (seen, line)
        fit = line.fit()
        if fit is None:
            return None
        a, b = fit
        limit = step_ms or self.step_limit_ms
        if load.running_seqs and load.decode_step_ms > 0:
            # The line's slope through where the instance is now: its level is the latest
            # steps', contention from the rest of the host included (the line's own level is
            # held to the fastest steps it has seen, an idle host's).
            seats = load.running_seqs + math.floor((limit - load.decode_step_ms) / b + 1e-9)
        else:
            seats = math.floor((limit - a) / b + 1e-9)
        return max(1, seats)

    def _past_watermark(self, w: Worker) -> bool:
        load = w.load
        if w.waiting_requests >= self.config.pull_watermark:
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


def _quantile(values: deque[float]) -> float | None:
    """CALIBRATION_QUANTILE of the values; None under CALIBRATION_MIN_SAMPLES of them."""
    if len(values) < CALIBRATION_MIN_SAMPLES:
        return None
    return percentile(values, 100 * CALIBRATION_QUANTILE, method="lower")
