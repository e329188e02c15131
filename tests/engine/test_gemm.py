"""The small-batch GEMM forms (services/engine/gemm.py): same products, and the tuner's choice."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from services.engine import gemm


def _model(layers: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[gemm.Linear(64, 96) for _ in range(layers)], gemm.Linear(96, 32))


def test_transposed_form_computes_the_same_product():
    torch.manual_seed(1)
    w, b = torch.randn(96, 64), torch.randn(96)
    layer = gemm.Linear(64, 96)
    layer.weight.data, layer.bias.data = w, b
    layer.gemm_plan = {1: 2, 2: 2, 3: 3, 4: 6}  # 1 and 4 padded with zero rows
    for rows in range(1, 7):
        x = torch.randn(rows, 64)
        y = layer(x)
        assert y.shape == (rows, 96) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def _slow(fn, seconds: float = 2e-3):
    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return slowed


def test_tune_takes_the_transposed_form_where_linear_is_slower(monkeypatch):
    model = _model()
    monkeypatch.setattr(gemm.F, "linear", _slow(F.linear))
    chosen = gemm.tune(model, max_rows=4)
    assert set(chosen) == {(96, 64), (32, 96)}
    for plan in chosen.values():  # every count transposed, some maybe padded to a faster one
        assert set(plan) == {1, 2, 3, 4} and all(r <= n <= 4 for r, n in plan.items())
    assert all(m.gemm_plan == chosen[tuple(m.weight.shape)] for m in model)


def test_tune_keeps_linear_where_the_transposed_form_is_slower(monkeypatch):
    model = _model()
    monkeypatch.setattr(gemm, "MIN_SECONDS", 0.0)
    monkeypatch.setattr(gemm.torch, "mm", _slow(torch.mm))
    assert gemm.tune(model, max_rows=4) == {(96, 64): {}, (32, 96): {}}
    assert all(m.gemm_plan == {} for m in model)


def test_tune_pads_to_a_row_count_that_is_faster(monkeypatch):
    """Where the transposed form with 2 rows beats it with 1, one row is computed as two."""
    model = _model()
    monkeypatch.setattr(gemm.F, "linear", _slow(F.linear))
    mm = torch.mm

    def one_row_slow(a, b):
        if b.shape[1] == 1:
            time.sleep(2e-3)
        return mm(a, b)

    monkeypatch.setattr(gemm.torch, "mm", one_row_slow)
    chosen = gemm.tune(model, max_rows=3)
    assert all(plan[1] in (2, 3) for plan in chosen.values())
    layer = model[0]
    x = torch.randn(1, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_tune_leaves_shapes_too_small_to_time(monkeypatch):
    """Weights that sit in cache take microseconds either way: no choice from such noise. (The
    fastest of 8 timings each: with 2, a busy host once held both over 0.1 ms.)"""
    monkeypatch.setattr(gemm, "REPS", 8)
    model = _model()
    assert gemm.tune(model, max_rows=4) == {(96, 64): {}, (32, 96): {}}
