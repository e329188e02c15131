"""A tensor-parallel engine behind one endpoint: rank 0 serves, ranks 1..tp-1 follow.

Rank 0 is the service's own process. `start_engine` starts the other ranks as child processes
(`python -m services.engine.tp_group`, each under the orphan guard, so they die with rank 0 even
if it is killed), joins the torch.distributed group with them, builds its engine and waits at a
barrier until every rank has built its own. A follower then reads commands (services.engine.
commands, one JSON line each) from its stdin, which is a pipe from rank 0, and applies them to
its engine in order; end of input (rank 0 closed the pipe or died) ends it.

A group with a dead rank cannot make progress (its collectives would wait forever), so rank 0
exits at once when a follower dies; its gateway then moves the requests elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from services.common import orphan_guard
from services.engine import commands
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.parallel import TensorParallel, free_port

log = logging.getLogger("distserve.engine")

FOLLOWER_EXIT_S = 10.0  # how long a closing group waits for its followers before killing them


class RankGroup:
    """Rank 0's side of a group: the follower processes and the pipes commands go through."""

    def __init__(self, tp: TensorParallel, followers: list[subprocess.Popen]) -> None:
        self.tp = tp
        self._followers = followers
        self._closing = False
        for p in followers:
            threading.Thread(target=self._watch, args=(p,), daemon=True).start()

    def broadcast(self, command: commands.EngineCommand) -> None:
        """Send a command to every follower (before rank 0 applies it itself)."""
        line = commands.encode(command)
        for p in self._followers:
            p.stdin.write(line)
            p.stdin.flush()

    def close(self) -> None:
        """End the followers (end of input) and leave the group."""
        self._closing = True
        for p in self._followers:
            with contextlib.suppress(OSError):
                p.stdin.close()
        for p in self._followers:
            try:
                p.wait(timeout=FOLLOWER_EXIT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.tp.close()

    def _watch(self, p: subprocess.Popen) -> None:
        code = p.wait()
        if not self._closing:
            log.error(
                "tensor-parallel rank process %d exited with code %s: the group cannot go on",
                p.pid,
                code,
            )
            os._exit(1)


def start_engine(
    model: Path,
    config: EngineConfig,
    tp: int,
    *,
    detokenize: bool = True,
    threads: int | None = None,
) -> tuple[LLMEngine, RankGroup | None]:
    """This process's engine, as rank 0 of a group of `tp` ranks (the group is None for
    tp == 1: a plain engine, nothing started)."""
    if tp == 1:
        return LLMEngine(model, config, detokenize=detokenize), None
    init_method = f"tcp://127.0.0.1:{free_port()}"
    followers = []
    for rank in range(1, tp):
        argv = [
            sys.executable,
            "-m",
            "services.engine.tp_group",
            "--rank",
            str(rank),
            "--tp",
            str(tp),
            "--init-method",
            init_method,
            "--model",
            str(model),
            "--engine-config",
            json.dumps(asdict(config)),
        ]
        if not detokenize:
            argv.append("--no-detokenize")
        if threads:
            argv += ["--threads", str(threads)]
        followers.append(
            subprocess.Popen(orphan_guard.command(argv), stdin=subprocess.PIPE, stdout=None)
        )
    group = RankGroup(TensorParallel.init(tp, 0, init_method), followers)
    try:
        engine = LLMEngine(model, config, detokenize=detokenize, tp=group.tp)
        dist.barrier(group=group.tp.group)  # every rank has built its engine
    except BaseException:
        group.close()
        raise
    return engine, group


def follow(tp: TensorParallel, engine: LLMEngine) -> None:
    """A follower's life: apply rank 0's commands in order until its pipe closes. A command
    that raises here raised on rank 0 too (the same state, the same call): rank 0 reports it."""
    stdin = sys.stdin.buffer
    dist.barrier(group=tp.group)
    for line in stdin:
        command = commands.decode(line)
        try:
            command.apply(engine)
        except Exception as e:
            log.debug("rank %d: %s raised %s", tp.rank, type(command).__name__, e)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m services.engine.tp_group", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--engine-config", required=True, help="EngineConfig as JSON")
    p.add_argument("--no-detokenize", action="store_true")
    p.add_argument("--threads", type=int)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    # Rank 0 owns a follower's life (end of input, or SIGTERM when it dies): a Ctrl-C sent to
    # the terminal's process group must not take a rank from under a draining instance.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = EngineConfig(**json.loads(args.engine_config))
    tp = TensorParallel.init(args.tp, args.rank, args.init_method)
    try:
        engine = LLMEngine(args.model, config, detokenize=not args.no_detokenize, tp=tp)
        follow(tp, engine)
    finally:
        tp.close()


if __name__ == "__main__":
    main()
