"""Tensor parallelism (Megatron-style): one rank's place in its group, its collectives, and
starting the ranks.

The layers built as one rank's share are services/engine/models/layers.py: two all-reduces
per layer, one for the embedding and one all-gather of the logits per step. With tp == 1 no
collective is called.
An engine with tp > 1 is driven SPMD: every rank runs the same LLMEngine with the same calls in
the same order (see docs/engine.md, "Tensor parallelism").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from services.engine.shards import check_rank

TIMEOUT = timedelta(minutes=10)  # longest a rank waits for the others (start-up, collectives)


class CommTimer:
    """Opt-in accounting of the wall time a rank spends inside its group's collectives.

    Off by default: a TensorParallel without one (comm_timer None) times nothing. To turn it on,
    give the group one before building the engine, e.g.
    `tp = dataclasses.replace(TensorParallel.init(...), comm_timer=CommTimer())`. The time counts
    everything inside the collective call, waiting for the slower rank included. On CUDA the
    device is synchronized before and after each call so only the collective is counted (which
    slows the run: use it to measure, not to serve).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.bytes = 0  # bytes of this rank's input to the collectives

    def reset(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0

    def run(self, fn: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """fn(*args, **kwargs), timed; `x` is the tensor this rank contributes."""
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        t = time.perf_counter()
        fn(*args, **kwargs)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        self.bytes += x.numel() * x.element_size()


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in a tensor-parallel group: rank, world size, torch.distributed group.

    The default, TensorParallel(), is tp == 1: no process group, and `all_reduce` / `all_gather`
    return at once without calling torch.distributed. `comm_timer` (None: off) accounts the time
    spent in collectives (see CommTimer); it is not part of the group's identity.
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group
    comm_timer: CommTimer | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_rank(self.rank, self.world_size)

    @classmethod
    def init(
        cls,
        tp: int,
        rank: int,
        init_method: str | None = None,
        backend: str | None = None,
        timeout: timedelta = TIMEOUT,
        store: dist.Store | None = None,
    ) -> TensorParallel:
        """Join a group of `tp` ranks meeting at `init_method` (e.g. "file:///tmp/x/rendezvous")
        or, instead, through `store` (see `local_store`).

        backend None: nccl when CUDA is available (each rank takes GPU rank % device count),
        else gloo. tp == 1 starts no process group.
        """
        group = cls(rank, tp)  # validates
        if tp == 1:
            return group
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=init_method,
            store=store,
            rank=rank,
            world_size=tp,
            timeout=timeout,
        )
        return cls(rank, tp, dist.group.WORLD)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; every rank gets the same bits."""
        if self.world_size > 1:
            if self.comm_timer is None:
                dist.all_reduce(x, group=self.group)
            else:
                self.comm_timer.run(dist.all_reduce, x, x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last axis, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        if self.comm_timer is None:
            dist.all_gather(parts, x.contiguous(), group=self.group)
        else:
            x = x.contiguous()
            self.comm_timer.run(dist.all_gather, x, parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


# -- starting ranks --------------------------------------------------------------------------------


def local_store(tp: int, rank: int, port: int = 0, timeout: timedelta = TIMEOUT) -> dist.TCPStore:
    """The rendezvous of a group of `tp` ranks on this host: rank 0 listens on a port the OS
    gives it (`port` 0), the others connect to that port. A port picked beforehand and passed
    on could be taken by another process in the seconds before rank 0 binds it; this one is held
    from the start, and nothing is left on disk whatever happens to the ranks."""
    return dist.TCPStore(
        "127.0.0.1", port, tp, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )


def spawn_ranks(
    target: Callable[..., None], tp: int, *args: object, backend: str | None = None
) -> None:
    """Run `target(TensorParallel, *args)` in `tp` fresh processes, ranks 0..tp-1. They meet at
    a store this process holds on a port the OS gave it (no port picked beforehand that another
    process could take, no rendezvous file whose clean-up races the ranks' exit). Returns when
    every rank has returned; if one raises, the others are stopped and the error (with the
    rank's traceback) is raised here. `target` must be a module-level function (processes are
    spawned, not forked)."""
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    mp.start_processes(
        _run_rank,
        args=(target, tp, store.port, backend, args),
        nprocs=tp,
        join=True,
        start_method="spawn",
    )


def _run_rank(
    rank: int,
    target: Callable[..., None],
    tp: int,
    port: int,
    backend: str | None,
    args: tuple,
) -> None:
    store = dist.TCPStore("127.0.0.1", port, tp, is_master=False, timeout=TIMEOUT)
    group = TensorParallel.init(tp, rank, backend=backend, store=store)
    try:
        target(group, *args)
        # Every rank past its last collective before any closes its connections: a peer that
        # sees a connection close while it still reads from it aborts (SIGABRT) in gloo.
        dist.barrier()
    finally:
        group.close()
