"""RankKv is the engine's KvHooks: the worker layer implements what the engine's commands call."""

from __future__ import annotations

import inspect

from services.engine.kv_hooks import KvHooks
from services.worker.rank_kv import RankKv


def test_rank_kv_has_every_kv_hook_with_its_signature():
    hooks = [n for n, f in vars(KvHooks).items() if inspect.isfunction(f) and n[0] != "_"]
    assert hooks, "KvHooks declares no hooks"
    for name in hooks:
        assert inspect.signature(getattr(RankKv, name)) == inspect.signature(
            getattr(KvHooks, name)
        ), f"RankKv.{name} differs from KvHooks.{name}"
