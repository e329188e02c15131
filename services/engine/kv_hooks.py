"""KvHooks: what an engine command tells a rank's KV data plane, as the engine sees it.

A follower rank of a tensor-parallel group moves its own heads of the KV (docs/engine.md,
"Tensor parallelism"); the commands that compute, start or end a transfer tell it too
(services.engine.commands). The engine defines only this protocol; the worker layer implements
it (services.worker.rank_kv.RankKv), so the engine imports no KV transfer code. Each method is
called on the engine thread.
"""

from __future__ import annotations

from typing import Protocol

from services.engine.sequence import Sequence, StepOutput


class KvHooks(Protocol):
    """A rank's KV data plane: told of each prefill batch and each request's end."""

    def scheduled(self, seqs: list[Sequence]) -> None:
        """A prefill batch has its blocks and is about to run."""

    def layer_done(self, layer: int) -> None:
        """The running prefill batch's layer `layer` is in the cache: it may be served."""

    def step_done(self, outputs: list[StepOutput]) -> None:
        """A prefill batch ended; its prompts that finished at their first token hold no KV."""

    def pull(self, request_id: str, handle: str, blocks: list[int], skip: int = 0) -> None:
        """Start pulling this rank's heads of `handle` (`KvHandle.encode()`) into `blocks`,
        from the handle's block `skip` on (the first `skip` are in place already)."""

    def forget(self, request_id: str) -> None:
        """Before a request's blocks are freed: stop its transfer and wait until it stopped."""
