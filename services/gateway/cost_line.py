"""`CostLine`: the cost of a prefill batch (or a decode step) as a line through the latest
ones, the estimate admission prices a queue with (gateway/admission.py)."""

from __future__ import annotations

from collections import deque

# Prefill batches the cost line is fitted to (the latest), and how many it needs, spanning at
# least a factor of two in batch tokens.
FIT_SAMPLES = 128
FIT_MIN_SAMPLES = 8


class CostLine:
    """`ms = a + b * tokens` over the latest `size` prefill batches (or decode steps over their
    batch size in sequences): least squares, bounded by what the batches allow, kept as running
    sums and sliding extremes so that a batch costs O(1) (it is observed on the first token's
    path, where a numpy fit cost ~0.15 ms).

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
        self._slope: float | None = None  # the least-squares slope of the latest spread window

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
        price its fixed cost per token). When the latest batches stop spanning sizes (a steady
        load makes batches of one size) the slope found last is kept and the line goes through
        their mean: a slower host still shows, as a higher line."""
        n = len(self._window)
        if n < FIT_MIN_SAMPLES:
            return None
        st, sm, stt, stm = self._sums
        b = None
        if -self._tokens_hi.least >= 2 * self._tokens_lo.least:
            b = (stm - st * sm / n) / (stt - st * st / n)
        if b is not None and b > 0:
            self._slope = b
        b = self._slope
        if b is None:
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
