"""What the chaos bench does to a mesh, and how it tells what that cost: the mesh with one
prefill instance failing KV chunks, the driver that signals and restarts workers, the malformed
HTTP bodies, and the ledger of worker counters (leases lapsed, chunks retried, ...) read until
every worker is back."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import aiohttp
import grpc

from bench.chaos.load import ChaosSpec
from distserve.loadgen.scrape import by_label, gateway
from distserve.local_mesh import Mesh, MeshSpec
from services.common import mesh_tls
from services.common.gen.distserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    prefill_pb2_grpc,
)

WORKER_ARGS = ("--kv-cache-gib", "0.015625", "--max-num-seqs", "16")
# A dead KV source is given up on fast: short chunk tries (a dropped chunk costs 1 s).
DECODE_ARGS = ("--chunk-timeout-s", "1", "--chunk-attempts", "3")
TRANSFER_FAULTS = ("drop", "corrupt", "delay", "close")
FAULTED_PREFILL = "prefill-1"


def mesh_spec(model: Path, spec: ChaosSpec, logs: Path, transfer_faults: bool) -> MeshSpec:
    names = ["gateway"] + [f"prefill-{i}" for i in range(spec.prefill)]
    names += [f"decode-{i}" for i in range(spec.decode)]
    per_worker = {}
    if transfer_faults:
        per_worker[FAULTED_PREFILL] = ("--kv-faults", fault_spec(spec.transfer_fault_every))
    return MeshSpec(
        model=model,
        prefill=spec.prefill,
        decode=spec.decode,
        gateway_port=0,
        worker_args=WORKER_ARGS,
        prefill_args=("--lease-s", str(spec.lease_s)),
        decode_args=DECODE_ARGS,
        per_worker_args=per_worker,
        drain_timeout_s=spec.drain_timeout_s,
        # Each process's log (stderr) to its own file: the gateway's says which request moved.
        command_prefix={
            n: ("sh", "-c", 'exec "$@" 2>>"$0"', str(logs / f"{n}.log")) for n in names
        },
    )


def fault_spec(every: int, last_chunk: int = 20_000) -> str:
    """`--kv-faults`: every `every`-th chunk hit by the next of TRANSFER_FAULTS, in turn."""
    faults = []
    for i, at in enumerate(range(every, last_chunk, every)):
        kind = TRANSFER_FAULTS[i % len(TRANSFER_FAULTS)]
        faults.append(f"delay@{at}:0.3" if kind == "delay" else f"{kind}@{at}")
    return ",".join(faults)


async def stats(address: str, role: str) -> common_pb2.WorkerStats:
    async with mesh_tls.aio_channel(address) as channel:
        stub_type = (
            prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
        )
        return await stub_type(channel).Stats(common_pb2.StatsRequest(), timeout=5)


def role_of(name: str) -> str:
    return name.split("-")[0]


def live(mesh: Mesh) -> list:
    return [p for p in mesh.workers if p.popen.poll() is None and p.ready is not None]


# Worker counters summed over every incarnation of every worker (a restarted one counts anew).
COUNTERS = (
    "leases_expired",
    "blocks_reclaimed",
    "requests_aborted",
    "pulls_failed",
    "chunks_retried",
    "checksum_failures",
    "reconnects",
)


class Ledger:
    """Worker counters per incarnation (name, pid): the highest value each reported. Polled
    every second and just before a worker is signalled (a dead worker's counters are gone)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], dict[str, int]] = {}

    async def poll(self, proc) -> common_pb2.WorkerStats | None:
        try:
            s = await stats(proc.ready["address"], role_of(proc.name))
        except grpc.aio.AioRpcError:
            return None  # dying or draining: its last poll stands
        old = self.seen.setdefault((proc.name, proc.popen.pid), dict.fromkeys(COUNTERS, 0))
        for k in COUNTERS:
            old[k] = max(old[k], getattr(s, k))
        return s

    async def watch(self, mesh: Mesh, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.gather(*(self.poll(p) for p in live(mesh)))
            await asyncio.sleep(1.0)

    def totals(self) -> dict[str, int]:
        return {k: sum(v[k] for v in self.seen.values()) for k in COUNTERS}


def busy(role: str, s: common_pb2.WorkerStats | None, streams: int = 1) -> bool:
    """Decode: `streams` or more running; prefill: prompts queued or KV held for a pull."""
    if s is None:
        return False
    if role == "decode":
        return s.load.running_seqs >= streams
    return bool(s.load.queued_prompt_tokens or s.load.held_kv_handles)


class Chaos:
    """Signals random workers at random times, restarts them; never leaves a role empty."""

    def __init__(self, mesh: Mesh, spec: ChaosSpec, ledger: Ledger, t0: float) -> None:
        self.mesh, self.spec, self.ledger, self.t0 = mesh, spec, ledger, t0
        self.rng = random.Random(spec.seed + 1)
        self.down: set[str] = set()
        self.events: list[dict] = []
        self.restarts: list[asyncio.Task] = []

    async def run(self, until_s: float) -> None:
        # The first fault early (a quarter into a short run), then at random.
        first_s = min(until_s / 4, self.spec.fault_interval_s)
        await asyncio.sleep(max(0.0, self.t0 + first_s - time.monotonic()))
        while True:
            if self.events:
                await asyncio.sleep(self.rng.expovariate(1 / self.spec.fault_interval_s))
            if time.monotonic() - self.t0 >= until_s:
                break
            first = not self.events
            role = "decode" if first else self.rng.choice(("prefill", "decode"))
            sig = signal.SIGKILL
            if not first and self.rng.random() >= self.spec.sigkill_fraction:
                sig = signal.SIGTERM
            # The first waits (up to 10 s) for two streams on one instance, so that it most
            # likely cuts off a request the client does not cancel itself.
            await self.fault(
                role, sig, wait_busy_s=10.0 if first else 1.0, streams=2 if first else 1
            )
        await asyncio.gather(*self.restarts)

    async def fault(
        self, role: str, sig: signal.Signals, wait_busy_s: float, streams: int = 1
    ) -> None:
        up = [p for p in live(self.mesh) if role_of(p.name) == role and p.name not in self.down]
        if len(up) < 2:
            return  # the role would be left empty
        deadline = time.monotonic() + wait_busy_s
        while True:  # prefer an instance with work in flight
            polls = await asyncio.gather(*(self.ledger.poll(p) for p in up))
            hot = [p for p, s in zip(up, polls, strict=True) if busy(role, s, streams)]
            if hot or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        victim = self.rng.choice(hot or up)
        self.down.add(victim.name)
        victim.popen.send_signal(sig)
        self.events.append(
            {
                "t_s": round(time.monotonic() - self.t0, 3),
                "worker": victim.name,
                "signal": sig.name,
                "busy": bool(hot),
            }
        )
        self.restarts.append(asyncio.create_task(self.restart(victim)))

    async def restart(self, proc) -> None:
        await asyncio.to_thread(proc.popen.wait, self.spec.drain_timeout_s + 30)
        await asyncio.sleep(self.spec.restart_delay_s)
        await asyncio.to_thread(self.mesh.restart, proc.name)
        self.down.discard(proc.name)


def malformed_bodies(rng: random.Random, n: int) -> list[bytes]:
    """`n` request bodies the API must refuse with a 4xx (or, at worst, serve): not JSON, not
    an object, wrong types, values past every limit, hostile strings, deep nesting."""
    makers = [
        lambda: rng.randbytes(rng.randint(1, 64)),
        lambda: b'{"prompt": "Hello", "max_tokens": 4'[: rng.randint(1, 34)],
        lambda: rng.choice([b"[]", b'"prompt"', b"1", b"null", b"", b"{}"]),
        lambda: b'{"prompt": ' + rng.choice([b"5", b"null", b"[[1]]", b"{}", b"true"]) + b"}",
        lambda: (
            b'{"prompt": "x", "max_tokens": '
            + rng.choice([b"-1", b"0", b'"many"', b"1e400", b"1" + b"0" * 40, b"NaN", b"4.5"])
            + b"}"
        ),
        lambda: (
            b'{"prompt": "x", "max_tokens": 4, "temperature": '
            + rng.choice([b"-1", b"NaN", b"Infinity", b'"hot"', b"1e309"])
            + b"}"
        ),
        lambda: b'{"prompt": "\\ud800\\udfff\\ud800", "max_tokens": 4, "stop": {"a": 1}}',
        lambda: b'{"prompt": "\xff\xfe\xfd", "max_tokens": 4}',
        lambda: b"[" * rng.randint(1_000, 100_000),
        lambda: b'{"prompt": "x", "max_tokens": 4, "stop_token_ids": [-5, 99999999999]}',
        lambda: b'{"prompt": [1, -2, 1e99], "max_tokens": 4}',
        lambda: b'{"messages": [{"role": "wizard", "content": 7}], "max_tokens": 4}',
    ]
    return [rng.choice(makers)() for _ in range(n)]


async def fuzz_burst(http_address: str, bodies: list[bytes]) -> dict:
    """POST each body to the completions endpoints; count 5xx answers and no answers."""
    out = {"sent": len(bodies), "5xx": 0, "no_answer": 0, "statuses": {}}
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for i, body in enumerate(bodies):
            path = "/v1/chat/completions" if i % 2 else "/v1/completions"
            headers = {"Content-Type": "application/json"}
            try:
                async with session.post(
                    f"http://{http_address}{path}", data=body, headers=headers
                ) as r:
                    await r.read()
                    out["statuses"][str(r.status)] = out["statuses"].get(str(r.status), 0) + 1
                    out["5xx"] += r.status >= 500
            except (aiohttp.ClientError, TimeoutError):
                out["no_answer"] += 1
    return out


def migrations(mesh: Mesh) -> dict[str, float]:
    """The gateway's `distserve_migrations_total`, by reason."""
    return by_label(gateway(mesh).metrics(), "distserve_migrations_total", "reason")


async def settle(mesh: Mesh, spec: ChaosSpec, ledger: Ledger) -> dict:
    """Once the load stopped: wait for a lease to lapse, then for the KV to be free (at most
    10 s more); what is still held, and what lapsed during the run."""
    await asyncio.sleep(spec.lease_s + 1.0)
    deadline = time.monotonic() + 10.0
    while True:
        polls = await asyncio.gather(*(ledger.poll(p) for p in live(mesh)))
        loads = [s.load for s in polls if s is not None]
        in_use = sum(x.total_kv_blocks - x.free_kv_blocks for x in loads)
        held = sum(x.held_kv_handles for x in loads)
        if (in_use == 0 and held == 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    counters = ledger.totals()
    return {
        "live_workers": len(loads),
        "blocks_in_use": in_use,
        "held_handles": held,
        "leases_lapsed": counters["leases_expired"],
        "blocks_lapsed": counters["blocks_reclaimed"],
        "leaked_blocks": in_use + held + counters["blocks_reclaimed"],
        "counters": counters,
    }
