"""The prefill side's state machine of a prompt's KV (HeldPrompt): its legal transitions, an
illegal one refused, and every terminal state freeing the prompt's blocks exactly once and
ending its lease (when it had one) exactly once, with the outcome its span reports."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace

import pytest

from services.common.errors import FailedPrecondition, NotFound
from services.common.kv_handle import KvHandle
from services.engine.commands import Abort, Release
from services.kvtransfer.leases import Lease, LeaseTable
from services.prefill.held_prompt import (
    LEASE_ENDS,
    LEGAL,
    TERMINAL,
    HeldPrompt,
    IllegalTransition,
    PromptState,
)

S = PromptState
RUNS = [(3, 4)]  # blocks 3..6
TEMPLATE = KvHandle(
    handle_id="",
    source_instance="prefill-test",
    control_address="",
    ucx_host="127.0.0.1",
    ucx_port=0,
    num_tokens=60,
    block_size=16,
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    dtype="float32",
    runs=(),
    block_bytes=1024,
    lease_expiry_unix_ms=0,
    access_token="",
)


class Host:
    """A PromptHost whose engine holds each prompt's blocks until Release (once computed) or
    Abort frees them; it counts every block freed and every lease ended."""

    def __init__(self) -> None:
        self.leases = LeaseTable(30.0, 300.0)
        self.blocks: dict[str, int] = {}  # request id -> blocks the engine holds for it
        self.computed: set[str] = set()  # its KV is held (Release frees it only then)
        self.freed: dict[str, int] = {}  # request id -> blocks freed, every path together
        self.ended: list[tuple[str, PromptState, int]] = []  # the leases' spans
        self.prompts_ended: list[HeldPrompt] = []

    def add(self, request_id: str) -> None:
        self.blocks[request_id] = sum(n for _, n in RUNS)

    def finish(self, request_id: str) -> None:
        """The request ended at its first token: the engine frees its blocks itself."""
        self.freed[request_id] = self.freed.get(request_id, 0) + self.blocks.pop(request_id)

    async def engine_call(self, command: Release | Abort) -> int | bool:
        rid = command.request_id
        if isinstance(command, Release) and rid not in self.computed:
            return 0
        n = self.blocks.pop(rid, None)
        if n is not None:
            self.freed[rid] = self.freed.get(rid, 0) + n
        return (n or 0) if isinstance(command, Release) else n is not None

    def lease(self, prompt: HeldPrompt, runs: list[tuple[int, int]], layerwise: bool) -> Lease:
        template = replace(TEMPLATE, runs=tuple(runs), layerwise=layerwise)
        handle = self.leases.create(prompt.request_id, template, prompt.trace)
        return self.leases.get(handle.handle_id, handle.access_token)

    def lease_ended(self, lease: Lease, outcome: PromptState, blocks: int) -> None:
        self.ended.append((lease.request_id, outcome, blocks))

    def prompt_ended(self, prompt: HeldPrompt) -> None:
        self.prompts_ended.append(prompt)


_ids = itertools.count()


def new_prompt(host: Host, layerwise: bool = False, keep_kv: bool = True) -> HeldPrompt:
    request_id = f"r{next(_ids)}"
    host.add(request_id)
    future = asyncio.get_running_loop().create_future() if layerwise else None
    return HeldPrompt(request_id, 60, host, keep_kv=keep_kv, layerwise=future)


async def compute(host: Host, prompt: HeldPrompt, finished: bool = False) -> KvHandle | None:
    if finished:
        host.finish(prompt.request_id)
    else:
        host.computed.add(prompt.request_id)
    return await prompt.computed(7, finished, None if finished else tuple(RUNS))


def test_the_legal_transitions_are_these():
    assert {
        S.QUEUED: {S.SCHEDULED, S.HELD, S.FINISHED, S.ABORTED},
        S.SCHEDULED: {S.UNCLAIMED, S.HELD, S.FINISHED, S.ABORTED},
        S.UNCLAIMED: {S.RELEASED, S.EXPIRED, S.ABANDONED, S.DRAINED, S.ABORTED},
        S.HELD: {S.RELEASED, S.EXPIRED, S.ABANDONED, S.DRAINED},
    } == LEGAL
    assert set(LEASE_ENDS) | {S.FINISHED, S.ABORTED} == TERMINAL
    # The terminal states' values are the lease span's documented outcomes.
    assert {s.value for s in TERMINAL} == {
        "released",
        "expired",
        "abandoned",
        "drained",
        "finished",
        "aborted",
    }


def test_an_illegal_transition_is_refused_and_changes_nothing():
    async def scenario() -> None:
        host = Host()
        prompt = new_prompt(host)
        with pytest.raises(IllegalTransition):
            prompt.scheduled(RUNS)  # nobody asked for a layer-wise handle
        assert prompt.state is S.QUEUED
        await compute(host, prompt)
        assert prompt.state is S.HELD
        with pytest.raises(IllegalTransition):
            prompt.abort()  # computed: only its lease can end it now
        with pytest.raises(IllegalTransition):
            prompt.close(prompt.lease, S.FINISHED)  # not an end decided outside
        other = host.leases.create("other", TEMPLATE)
        with pytest.raises(IllegalTransition):
            prompt.close(host.leases.get(other.handle_id, other.access_token), S.RELEASED)
        assert prompt.state is S.HELD and host.freed == {} and host.ended == []
        await prompt.close(host.leases.pop_request(prompt.request_id), S.RELEASED)
        with pytest.raises(IllegalTransition):
            prompt.abort()  # terminal: nothing leaves it
        assert prompt.state is S.RELEASED

    asyncio.run(scenario())


async def _held(host: Host, layerwise: bool) -> HeldPrompt:
    prompt = new_prompt(host, layerwise)
    if layerwise:
        prompt.scheduled(RUNS)
        assert prompt.state is S.SCHEDULED
    handle = await compute(host, prompt)
    assert prompt.state is S.HELD and handle is prompt.lease.handle
    return prompt


async def _unclaimed(host: Host, outcome: PromptState) -> HeldPrompt:
    prompt = new_prompt(host, layerwise=True)
    prompt.scheduled(RUNS)
    await prompt.close(host.leases.pop_request(prompt.request_id), outcome)
    assert prompt.state is S.UNCLAIMED
    return prompt


# Each path to a terminal state: (name, how, the state it ends in, the lease's outcome or None).
async def released_after_prefill(host):
    prompt = await _held(host, layerwise=False)
    await prompt.close(host.leases.pop_request(prompt.request_id), S.RELEASED)
    return prompt


async def expired_layerwise(host):
    prompt = await _held(host, layerwise=True)
    [lease] = host.leases.expired() or [host.leases.pop_request(prompt.request_id)]
    await prompt.close(lease, S.EXPIRED)
    return prompt


async def abandoned_held(host):
    prompt = await _held(host, layerwise=False)
    await prompt.close(host.leases.pop_request(prompt.request_id), S.ABANDONED)
    return prompt


async def drained_held(host):
    prompt = await _held(host, layerwise=True)
    [lease] = host.leases.pop_all()
    await prompt.close(lease, S.DRAINED)
    return prompt


async def released_while_computing(host):
    prompt = await _unclaimed(host, S.RELEASED)
    assert await compute(host, prompt) is None
    return prompt


async def drained_while_computing(host):
    prompt = await _unclaimed(host, S.DRAINED)
    assert await compute(host, prompt) is None
    return prompt


async def aborted_unclaimed(host):
    prompt = await _unclaimed(host, S.ABANDONED)
    await prompt.abort()
    return prompt


async def finished_at_first_token(host):
    prompt = new_prompt(host)
    assert await compute(host, prompt, finished=True) is None
    return prompt


async def finished_layerwise(host):
    prompt = new_prompt(host, layerwise=True)
    prompt.scheduled(RUNS)
    lease = prompt.lease
    assert await compute(host, prompt, finished=True) is None
    with pytest.raises(FailedPrecondition):  # a decode instance waiting is told
        lease.first_token.result()
    return prompt


async def discarded(host):
    prompt = new_prompt(host, keep_kv=False)
    assert await compute(host, prompt) is None
    return prompt


async def aborted_queued(host):
    prompt = new_prompt(host)
    await prompt.abort()
    return prompt


async def aborted_scheduled(host):
    prompt = new_prompt(host, layerwise=True)
    prompt.scheduled(RUNS)
    lease = prompt.lease
    await prompt.abort()
    assert lease.closed and not host.leases
    with pytest.raises(NotFound):  # a decode instance waiting is told
        lease.first_token.result()
    return prompt


PATHS = [
    (released_after_prefill, S.RELEASED, S.RELEASED),
    (expired_layerwise, S.EXPIRED, S.EXPIRED),
    (abandoned_held, S.ABANDONED, S.ABANDONED),
    (drained_held, S.DRAINED, S.DRAINED),
    (released_while_computing, S.RELEASED, S.RELEASED),
    (drained_while_computing, S.DRAINED, S.DRAINED),
    (aborted_unclaimed, S.ABORTED, S.ABANDONED),
    (finished_at_first_token, S.FINISHED, None),
    (finished_layerwise, S.FINISHED, S.FINISHED),
    (discarded, S.FINISHED, None),
    (aborted_queued, S.ABORTED, None),
    (aborted_scheduled, S.ABORTED, S.ABORTED),
]


@pytest.mark.parametrize(("path", "state", "outcome"), PATHS, ids=[p.__name__ for p, *_ in PATHS])
def test_every_terminal_state_frees_the_blocks_and_ends_the_lease_exactly_once(
    path, state, outcome
):
    async def scenario() -> tuple[Host, HeldPrompt]:
        host = Host()
        prompt = await path(host)
        await asyncio.sleep(0)  # nothing more runs after the path
        return host, prompt

    host, prompt = asyncio.run(scenario())
    assert prompt.state is state and prompt.done
    assert host.prompts_ended == [prompt]
    assert host.freed == {prompt.request_id: 4}  # every block, once
    assert host.blocks == {} and not host.leases and prompt.lease is None
    ended = [(rid, o) for rid, o, _ in host.ended]
    assert ended == ([(prompt.request_id, outcome)] if outcome is not None else [])


def test_every_terminal_state_has_a_path():
    assert {state for _, state, _ in PATHS} == set(TERMINAL)


def test_a_release_whose_caller_is_cancelled_still_frees_the_blocks():
    async def scenario() -> Host:
        host = Host()
        prompt = await _held(host, layerwise=False)
        lease = host.leases.pop_request(prompt.request_id)
        gate = asyncio.Event()

        async def send() -> None:  # a send that stops only once let go
            try:
                await asyncio.sleep(30)
            finally:
                await asyncio.shield(gate.wait())

        task = asyncio.create_task(send())
        lease.begin_send(task)
        task.add_done_callback(lease.end_send)
        await asyncio.sleep(0)
        caller = asyncio.ensure_future(prompt.close(lease, S.RELEASED))
        await asyncio.sleep(0)
        caller.cancel()
        assert prompt.state is S.RELEASED and host.freed == {}  # the sends are still stopping
        gate.set()
        for _ in range(5):
            await asyncio.sleep(0)
        return host

    host = asyncio.run(scenario())
    assert sum(host.freed.values()) == 4 and [o for _, o, _ in host.ended] == [S.RELEASED]
