"""A prompt on a prefill instance, from its submission until its KV is freed: one object with
one explicit state, and every transition of it here.

The prefill side frees a prompt's KV on exactly one path, each a transition of its
`HeldPrompt`: decode released the handle (it holds the KV now), the lease lapsed, the caller
abandoned it, the instance drained, the request ended at its first token (nothing to decode),
or the request was cancelled or failed. Every one of them goes through `HeldPrompt._free`,
which also ends the prompt's lease (if it had one) with the lease's span and histogram; the
outcome they carry is the state's value.

A prompt with a layer-wise handle (its KV moved layer by layer while prefill still computes)
has its lease from the moment its batch has blocks (SCHEDULED); if that lease ends before the
prompt is computed (UNCLAIMED), the prompt's blocks are freed once it is.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable
from typing import Protocol

from services.common import clock
from services.common.errors import FailedPrecondition
from services.common.kv_handle import KvHandle
from services.engine.commands import Abort, Release
from services.kvtransfer.leases import Lease, LeaseTable


class PromptState(enum.Enum):
    """Where a prompt is. A terminal state's value is the `kv.outcome` of its lease's span and
    the label of `distserve_kv_lease_seconds` (docs/observability.md)."""

    QUEUED = "queued"  # in the engine, no handle out yet
    SCHEDULED = "scheduled"  # computing; its layer-wise handle is out, layers published as done
    UNCLAIMED = "unclaimed"  # computing; its layer-wise lease ended: its blocks go when computed
    HELD = "held"  # computed; its KV held under its lease until decode releases it
    RELEASED = "released"  # decode released the handle: it holds the KV now
    EXPIRED = "expired"  # the lease lapsed (the reaper)
    ABANDONED = "abandoned"  # its caller left without the result
    DRAINED = "drained"  # the instance drained out of time
    FINISHED = "finished"  # computed, KV not kept: ended at its first token, or discard_kv
    ABORTED = "aborted"  # cancelled, or failed


S = PromptState
# The ends of a lease decided outside the prompt (the lease is out of the table already).
LEASE_ENDS = frozenset({S.RELEASED, S.EXPIRED, S.ABANDONED, S.DRAINED})
LEGAL: dict[PromptState, frozenset[PromptState]] = {
    S.QUEUED: frozenset({S.SCHEDULED, S.HELD, S.FINISHED, S.ABORTED}),
    S.SCHEDULED: frozenset({S.UNCLAIMED, S.HELD, S.FINISHED, S.ABORTED}),
    S.UNCLAIMED: LEASE_ENDS | {S.ABORTED},
    S.HELD: LEASE_ENDS,
}
TERMINAL = frozenset(PromptState) - LEGAL.keys()


class IllegalTransition(RuntimeError):
    """A transition the state machine does not have: a bug in the caller."""


class PromptHost(Protocol):
    """The instance a prompt runs on (the prefill worker): its engine, its table of leases."""

    leases: LeaseTable

    async def engine_call(self, command: Release | Abort) -> int | bool:
        """Run an engine command (Release: the blocks freed; Abort: whether it was there)."""

    def lease(self, prompt: HeldPrompt, runs: list[tuple[int, int]], layerwise: bool) -> Lease:
        """A new lease, in the table, on the prompt's blocks `runs`."""

    def lease_ended(self, lease: Lease, outcome: PromptState, blocks: int) -> None:
        """Record the life of a lease that ended with `blocks` blocks freed."""

    def prompt_ended(self, prompt: HeldPrompt) -> None:
        """The prompt reached a terminal state: nothing of it is held any more."""


class HeldPrompt:
    """One prompt on a prefill instance until its KV is freed. Each transition is one method;
    one not in `LEGAL` raises IllegalTransition. A transition that frees changes the state at
    once and returns (or awaits) the freeing, which runs to its end even if its caller is
    cancelled meanwhile."""

    def __init__(
        self,
        request_id: str,
        num_tokens: int,
        host: PromptHost,
        *,
        keep_kv: bool = True,
        trace: object = None,
        layerwise: asyncio.Future | None = None,
    ) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.keep_kv = keep_kv
        self.trace = trace
        # Gets the layer-wise handle once the prompt's batch has blocks (before it runs).
        self.layerwise = layerwise if keep_kv else None
        self.state = PromptState.QUEUED
        self.lease: Lease | None = None
        self._lease_end: PromptState | None = None  # UNCLAIMED: how its lease ended
        self._host = host
        self._freeing: set[asyncio.Future] = set()

    def __repr__(self) -> str:
        return f"HeldPrompt({self.request_id!r}, {self.state.name})"

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @property
    def awaits_layerwise_handle(self) -> bool:
        """Whether its caller wants the layer-wise handle and has not got it (nor left)."""
        return (
            self.state is PromptState.QUEUED
            and self.layerwise is not None
            and not self.layerwise.done()
        )

    # -- transitions -------------------------------------------------------------------------

    def scheduled(self, runs: list[tuple[int, int]]) -> None:
        """QUEUED -> SCHEDULED: its batch has blocks `runs`; the layer-wise handle goes out
        (only to a caller still waiting for it)."""
        if not self.awaits_layerwise_handle:
            raise IllegalTransition(f"{self!r}: nobody awaits a layer-wise handle")
        self._to(PromptState.SCHEDULED)
        self.lease = self._host.lease(self, runs, layerwise=True)
        self.layerwise.set_result(self.lease.handle)

    def publish(self, layers: int) -> None:
        """Its first `layers` layers are computed (SCHEDULED: they may be sent now)."""
        if self.state is PromptState.SCHEDULED:
            self.lease.publish(layers)

    async def computed(
        self, first_token: int, finished: bool, runs: tuple[tuple[int, int], ...] | None
    ) -> KvHandle | None:
        """Prefill sampled its first token: hold the KV for decode (HELD; its handle), or free
        it (FINISHED: the request ended at its first token or its caller wants no KV; an
        UNCLAIMED prompt ends as its lease did). `finished`: the engine freed the blocks; `runs`:
        the blocks it holds otherwise."""
        release = None if finished else Release(self.request_id)
        if self.state is PromptState.UNCLAIMED:
            await self._free(self._lease_end, release)
            return None
        if finished or not self.keep_kv:
            lease = self.lease
            if lease is not None:  # a decode instance may be pulling: nothing to decode
                lease.first_token.set_exception(
                    FailedPrecondition(f"request {self.request_id} ended at its first token")
                )
                lease.first_token.exception()  # retrieved: nobody may be waiting
            await self._free(PromptState.FINISHED, release)
            return None
        if self.state is PromptState.SCHEDULED:
            self._to(PromptState.HELD)
            self.lease.publish(self.lease.handle.num_layers)
            self.lease.first_token.set_result((first_token, clock.time_s()))
            return self.lease.handle
        self._to(PromptState.HELD)
        self.lease = self._host.lease(self, list(runs), layerwise=False)
        return self.lease.handle

    def close(self, lease: Lease, outcome: PromptState) -> Awaitable[int]:
        """Its lease `lease`, taken out of the table already, ended: `outcome` is one of
        LEASE_ENDS. The sends reading its blocks stop, then the blocks are freed (a prompt
        still computing becomes UNCLAIMED: its blocks go once computed). Returns the blocks
        freed, once they are."""
        if outcome not in LEASE_ENDS or lease is not self.lease:
            raise IllegalTransition(f"{self!r}: its lease cannot end as {outcome.name}")
        if self.state is PromptState.SCHEDULED:
            self._lease_end = outcome
            return self._free(PromptState.UNCLAIMED, Release(self.request_id), outcome)
        return self._free(outcome, Release(self.request_id))

    def abort(self) -> Awaitable[int]:
        """The request was cancelled or failed before it was computed: the engine drops it
        wherever it is, its lease (if out) is ended and its waiters told."""
        return self._free(PromptState.ABORTED, Abort(self.request_id))

    # -- the one place a prompt's KV is freed ------------------------------------------------

    def _free(
        self,
        state: PromptState,
        command: Release | Abort | None,
        outcome: PromptState | None = None,
    ) -> Awaitable[int]:
        """Enter `state` and free: the lease (if any) is taken off the prompt (and out of the
        table if still there), the engine told `command` (None: it freed the blocks itself),
        the lease's end recorded as `outcome` (default: `state`). The state changes now; the
        rest runs on its own, shielded from the caller's cancellation."""
        self._to(state)
        lease, self.lease = self.lease, None
        outcome = outcome or state
        if lease is not None and outcome not in LEASE_ENDS:
            self._host.leases.pop_request(self.request_id)  # closes it: its waiters are told
        freeing = asyncio.ensure_future(self._run_free(lease, command, outcome))
        self._freeing.add(freeing)
        freeing.add_done_callback(self._freeing.discard)
        return asyncio.shield(freeing)

    async def _run_free(
        self, lease: Lease | None, command: Release | Abort | None, outcome: PromptState
    ) -> int:
        if lease is not None and outcome in LEASE_ENDS:
            await lease.stop_sends()  # nothing may read the blocks once they are freed
        if command is None:
            blocks = len(lease.blocks) if lease is not None else 0
        elif isinstance(command, Abort):
            aborted = await self._host.engine_call(command)
            blocks = len(lease.blocks) if lease is not None and aborted else 0
        else:
            blocks = await self._host.engine_call(command)
        if lease is not None:
            self._host.lease_ended(lease, outcome, blocks)
        return blocks

    def _to(self, state: PromptState) -> None:
        if state not in LEGAL.get(self.state, ()):
            raise IllegalTransition(f"{self!r} cannot become {state.name}")
        self.state = state
        if state in TERMINAL:
            self._host.prompt_ended(self)
