"""A tensor-parallel engine behind one endpoint: rank 0 serves, ranks 1..tp-1 follow.

Rank 0 is the service's own process. `start_engine` starts the other ranks as child processes
(`python -m services.worker.tp_group`, each under the orphan guard, so they die with rank 0 even
if it is killed), joins the torch.distributed group with them, builds its engine and waits at a
barrier until every rank has built its own. A follower then reads commands (services.engine.
commands, one JSON line each) from its stdin, which is a pipe from rank 0, and applies them to
its engine in order; end of input (rank 0 closed the pipe or died) ends it.

Each follower also moves its own heads of the KV (services.worker.rank_kv): two more pipes
join it to rank 0, a control pipe (rank 0 announces the KV handles it makes, which a prefill
follower serves its share of) and an events pipe (the follower's UCX port once it is up, the
bytes it served for each lease that ended, and how each pull of a decode follower went). Both
carry JSON lines.

A group with a dead rank cannot make progress (its collectives would wait forever), so rank 0
exits at once when a follower dies; its gateway then moves the requests elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
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
from typing import TYPE_CHECKING

from services.common import orphan_guard
from services.common.errors import RemoteError
from services.engine import commands
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine

if TYPE_CHECKING:
    from services.engine.parallel import TensorParallel
    from services.worker.rank_kv import RankKv

log = logging.getLogger("distserve.engine")

FOLLOWER_EXIT_S = 10.0  # how long a closing group waits for its followers before killing them


class Follower:
    """Rank 0's handle on one follower: its process and the pipes to and from it."""

    def __init__(self, rank: int, process: subprocess.Popen, control, events) -> None:
        self.rank = rank
        self.process = process
        self.control = control  # rank 0 writes (KV handles to serve)
        self.events = events  # rank 0 reads (ready, pulled)
        self.ucx_port = 0
        self.bytes_served = 0  # KV it served, counted as each of its leases ends


class RankGroup:
    """Rank 0's side of a group: the follower processes and the pipes to and from them."""

    def __init__(self, tp: TensorParallel, followers: list[Follower]) -> None:
        self.tp = tp
        self.followers = followers
        self._closing = False
        self._control_lock = threading.Lock()
        self._pulls: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        for f in followers:
            threading.Thread(target=self._watch, args=(f.process,), daemon=True).start()

    def await_ready(self) -> None:
        """Each follower's first event: its KV data plane is up (and where it listens)."""
        for f in self.followers:
            line = f.events.readline()
            if not line:
                raise RuntimeError(f"tensor-parallel rank {f.rank} exited while starting")
            f.ucx_port = json.loads(line)["ucx_port"]
            threading.Thread(target=self._read_events, args=(f,), daemon=True).start()

    def broadcast(self, command: commands.EngineCommand) -> None:
        """Send a command to every follower (before rank 0 applies it itself)."""
        line = commands.encode(command)
        for f in self.followers:
            f.process.stdin.write(line)
            f.process.stdin.flush()

    def adopt(self, request_id: str, handle: str) -> None:
        """Rank 0 made a KV handle (`KvHandle.encode()`): every follower serves its heads of it
        from now on."""
        line = json.dumps({"adopt": request_id, "handle": handle}).encode() + b"\n"
        with self._control_lock:
            for f in self.followers:
                with contextlib.suppress(OSError):  # a dead follower ends the group anyway
                    f.control.write(line)
                    f.control.flush()

    def expect_pulls(self, request_id: str) -> list[asyncio.Future]:
        """Futures of the followers' pulls for a request (register before sending PullKv):
        each resolves to the follower's PullReport fields, or fails with its error."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in self.followers]
        self._pulls[request_id] = [(loop, fut) for fut in futures]
        return futures

    def forget_pulls(self, request_id: str) -> None:
        self._pulls.pop(request_id, None)

    def close(self) -> None:
        """End the followers (end of input) and leave the group."""
        self._closing = True
        for f in self.followers:
            for pipe in (f.process.stdin, f.control):
                with contextlib.suppress(OSError):
                    pipe.close()
        for f in self.followers:
            try:
                f.process.wait(timeout=FOLLOWER_EXIT_S)
            except subprocess.TimeoutExpired:
                f.process.kill()
                f.process.wait()
        self.tp.close()

    def _read_events(self, f: Follower) -> None:
        for line in f.events:
            event = json.loads(line)
            if event.get("event") == "served":
                f.bytes_served += event["bytes"]
            if event.get("event") != "pulled":
                continue
            waiting = self._pulls.get(event["request_id"])
            if waiting is None:
                continue  # the request was given up
            loop, future = waiting[f.rank - 1]
            loop.call_soon_threadsafe(_settle_pull, future, event)

    def _watch(self, p: subprocess.Popen) -> None:
        code = p.wait()
        if not self._closing:
            log.error(
                "tensor-parallel rank process %d exited with code %s: the group cannot go on",
                p.pid,
                code,
            )
            os._exit(1)


def _settle_pull(future: asyncio.Future, event: dict) -> None:
    if future.done():
        return
    if "error" in event:
        future.set_exception(RemoteError(event["status"], event["error"]))
    else:
        future.set_result(event["report"])


def start_engine(
    model: Path,
    config: EngineConfig,
    tp: int,
    *,
    detokenize: bool = True,
    threads: int | None = None,
    kv: str = "pull",
    kv_options: dict | None = None,
) -> tuple[LLMEngine, RankGroup | None]:
    """This process's engine, as rank 0 of a group of `tp` ranks (the group is None for
    tp == 1: a plain engine, nothing started). `kv`: what the followers' KV data planes do,
    "serve" (prefill) or "pull" (decode); `kv_options`: {"policy": PullPolicy fields,
    "transport": "auto" | "ucx" | "grpc"} for pulling followers, "host": the address their
    UCX listeners listen on, "ucx_port": rank 0's fixed UCX port (0: any), rank r then listens
    on ucx_port + r, so a NetworkPolicy can name every KV port of a pod. torch (its distributed
    group) is imported only for tp > 1: an emulated instance is one process (tp 1), and never
    imports it."""
    if tp == 1:
        return LLMEngine(model, config, detokenize=detokenize), None
    import torch.distributed as dist

    from services.engine.parallel import TensorParallel, local_store

    store = local_store(tp, 0)
    followers = []
    for rank in range(1, tp):
        control_r, control_w = os.pipe()
        events_r, events_w = os.pipe()
        argv = [
            sys.executable,
            "-m",
            "services.worker.tp_group",
            "--rank",
            str(rank),
            "--tp",
            str(tp),
            "--store-port",
            str(store.port),
            "--model",
            str(model),
            "--engine-config",
            json.dumps(asdict(config)),
            "--kv",
            kv,
            "--kv-options",
            json.dumps(kv_options or {}),
            "--control-fd",
            str(control_r),
            "--events-fd",
            str(events_w),
        ]
        if not detokenize:
            argv.append("--no-detokenize")
        if threads:
            argv += ["--threads", str(threads)]
        process = orphan_guard.popen(
            orphan_guard.command(argv),
            stdin=subprocess.PIPE,
            stdout=None,
            pass_fds=(control_r, events_w),
        )
        os.close(control_r)
        os.close(events_w)
        followers.append(
            Follower(rank, process, os.fdopen(control_w, "wb"), os.fdopen(events_r, "rb"))
        )
    group = RankGroup(TensorParallel.init(tp, 0, store=store), followers)
    try:
        engine = LLMEngine(model, config, detokenize=detokenize, tp=group.tp)
        group.await_ready()
        dist.barrier(group=group.tp.group)  # every rank has built its engine
    except BaseException:
        group.close()
        raise
    return engine, group


def follow(tp: TensorParallel, engine: LLMEngine, kv: RankKv) -> None:
    """A follower's life: apply rank 0's commands in order until its pipe closes. A command
    that raises here raised on rank 0 too (the same state, the same call): rank 0 reports it."""
    import torch.distributed as dist

    stdin = sys.stdin.buffer
    dist.barrier(group=tp.group)
    for line in stdin:
        command = commands.decode(line)
        try:
            command.apply(engine, kv)
        except Exception as e:
            log.debug("rank %d: %s raised %s", tp.rank, type(command).__name__, e)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m services.worker.tp_group", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True, help="rank 0's rendezvous store")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--engine-config", required=True, help="EngineConfig as JSON")
    p.add_argument("--kv", choices=("serve", "pull"), default="pull")
    p.add_argument("--kv-options", default="{}", help="the pulling data plane's options, JSON")
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--events-fd", type=int, required=True)
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
    from services.engine.parallel import TensorParallel, local_store
    from services.kvtransfer.puller import PullPolicy  # the data plane: a follower's alone
    from services.worker.rank_kv import RankKv

    config = EngineConfig(**json.loads(args.engine_config))
    options = json.loads(args.kv_options)
    tp = TensorParallel.init(
        args.tp, args.rank, store=local_store(args.tp, args.rank, args.store_port)
    )
    kv = None
    try:
        engine = LLMEngine(args.model, config, detokenize=not args.no_detokenize, tp=tp)
        kv = RankKv(
            engine,
            tp,
            os.fdopen(args.events_fd, "wb"),
            args.control_fd,
            serve=args.kv == "serve",
            policy=PullPolicy(**options.get("policy", {})),
            transport=options.get("transport", "auto"),
            host=options.get("host", ""),
            port=options["ucx_port"] + args.rank if options.get("ucx_port") else 0,
        )
        kv.report({"event": "ready", "ucx_port": kv.port})
        follow(tp, engine, kv)
    finally:
        if kv is not None:
            kv.close()
        tp.close()


if __name__ == "__main__":
    main()
