"""Decode's small GEMMs on CPU: for each weight shape and row count, the faster of two forms.

A decode step multiplies one row per running sequence by every weight matrix, and on a CPU it is
bound by reading the weights from memory. The BLAS does not always read them once: on the bench
host (MKL, AVX-512; `python bench/experiments/decode_gemm.py` measures it), `x @ W^T` (`F.linear`)
with 2 or 3 rows takes about as long as 2 or 3 single-row products for some shapes (the `small`
model's decode step: 37 ms for one sequence, 67 for two, 87 for three, 56 for four), while the same
product as `(W @ x^T)^T` reads them once for a few rows. Which form wins depends on the shape, the
row count, the BLAS and the CPU, so the engine measures instead of guessing: `tune` times both forms
for each weight shape of the model and each row count up to `MAX_ROWS`, and a layer uses the
transposed form for the row counts where it was clearly faster (`MARGIN`), padded with zero rows to
a larger count where that count is clearly faster still (on that host one row is: two rows the
transposed way take 0.6x the time of one row through `F.linear`). Larger batches (and every prefill)
use `F.linear`. The forms compute the same sums in a different order: results agree to float
rounding, not bit for bit.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("distserve.engine")

MAX_ROWS = 8  # row counts tuned: 1..MAX_ROWS
MARGIN = 0.9  # the transposed form must take under 90% of F.linear's time to be used
# A shape whose product over all its layers takes less than this with F.linear keeps F.linear:
# its weights sit in cache, the choice gains next to nothing, and timings that short are noise.
MIN_SECONDS = 1e-4
REPS = 2  # timings per form and row count (the fastest kept: other work only adds time)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, plan: dict[int, int]) -> torch.Tensor:
    """x (T, in) @ weight (out, in)^T, in the form tuned for T rows: `plan[T]` is the row count
    to compute (weight @ x^T)^T with (x padded with zero rows to it); F.linear for T not in it."""
    rows = x.shape[0]
    padded = plan.get(rows)
    if padded is None:
        return F.linear(x, weight)
    if padded > rows:
        x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
    return torch.mm(weight, x.t())[:, :rows].t().contiguous()


class Linear(nn.Linear):
    """nn.Linear over packed tokens (T, in) that takes the tuned form for T rows."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gemm_plan: dict[int, int] = {}  # `tune` sets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rows_linear(x, self.weight, self.gemm_plan)
        return y if self.bias is None else y + self.bias


def tune(model: nn.Module, max_rows: int = MAX_ROWS) -> dict[tuple[int, int], dict[int, int]]:
    """Time both forms for every weight shape of `model`'s tunable layers (those with a
    `gemm_plan` attribute) and row counts 1..max_rows, and set each layer's `gemm_plan`.
    Returns, per weight shape (out, in), the plan: row count -> the row count it is computed
    with in the transposed form (itself, or more when padding pays).

    Each timing runs the product over every weight of that shape in turn, and the shapes one after
    another, so a model larger than the caches streams its weights from memory as a decode step
    does."""
    groups: dict[tuple, list[nn.Module]] = defaultdict(list)
    for module in model.modules():
        if hasattr(module, "gemm_plan") and module.weight.device.type == "cpu":
            groups[(*module.weight.shape, module.weight.dtype)].append(module)
    if not groups:
        return {}
    forms = (  # exactly what rows_linear runs: F.linear, and the transposed form unpadded
        lambda x, w: rows_linear(x, w, {}),
        lambda x, w: rows_linear(x, w, {x.shape[0]: x.shape[0]}),
    )
    best: dict[tuple, list[float]] = defaultdict(lambda: [float("inf")] * 2)
    start = time.perf_counter()
    with torch.inference_mode():
        for rows in range(1, max_rows + 1):
            gen = torch.Generator().manual_seed(rows)  # not the global stream: callers seed it
            inputs = {key: torch.randn(rows, key[1], dtype=key[2], generator=gen) for key in groups}
            for rep in range(REPS + (rows == 1)):  # one more round first, to warm up
                for f, form in enumerate(forms):
                    for key, modules in groups.items():
                        x = inputs[key]
                        t = time.perf_counter()
                        for m in modules:
                            form(x, m.weight)
                        elapsed = time.perf_counter() - t
                        if rows > 1 or rep:
                            best[(key, rows)][f] = min(best[(key, rows)][f], elapsed)
    chosen = {}
    for key, modules in groups.items():
        plan = {}
        for r in range(1, max_rows + 1):
            linear, transposed = best[(key, r)]
            if linear < MIN_SECONDS:
                continue
            # Pad to a larger count only where it is clearly faster than r rows transposed.
            padded = min(range(r, max_rows + 1), key=lambda n: best[(key, n)][1])
            if best[(key, padded)][1] >= MARGIN * transposed:
                padded = r
            if best[(key, padded)][1] < MARGIN * linear:
                plan[r] = padded
        for m in modules:
            m.gemm_plan = plan
        chosen[(int(key[0]), int(key[1]))] = plan
    log.info(
        "small-batch GEMM forms tuned in %.1f s: transposed for %s",
        time.perf_counter() - start,
        "; ".join(f"{o}x{i} rows {plan_text(p)}" for (o, i), p in chosen.items() if p)
        or "no shape",
    )
    return chosen


def plan_text(plan: dict[int, int]) -> str:
    """The plan's row counts, each with the count it is padded to where it is: `1->2, 2, 3`."""
    return ", ".join(f"{r}->{p}" if p != r else str(r) for r, p in plan.items())
