"""`distserve up`'s actuator: applies the planner's placements to the local mesh of processes
(distserve/local_mesh.py), and serves itself as the `Actuator` gRPC service the planner calls
(through `services.planner.actuator.RemoteActuator`).

`LocalActuator` starts workers and stops them by drain (SIGTERM: deregistered at once, then
in-flight work finishes or moves, services/worker/announcer.py). A worker changes role by drain
and restart: `apply` drains first, so a budget of devices is never exceeded while a placement
changes. It runs in the launcher's process, never in the planner's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent import futures

import grpc

from services.common import mesh_tls
from services.common.errors import DistServeError, FailedPrecondition, InvalidRequest
from services.common.gen.distserve.v1 import planner_pb2, planner_pb2_grpc
from services.common.server import status_code
from services.planner.actuator import ActuatorStatus, Instance

log = logging.getLogger("distserve.actuator")

ROLES = ("prefill", "decode", "colocated")


class LocalActuator:
    """Applies placements to a local mesh (a `distserve.local_mesh.Mesh`, started). `apply`
    blocks until the mesh is as asked (`apply_in_background` does not); one change at a time."""

    POOL = "default"  # a local mesh serves one model: one pool

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self._change = threading.Lock()  # held while a change is applied
        self._lock = threading.Lock()  # guards the fields below
        self._starting: dict[str, str] = {}  # name -> role of the workers starting
        self._draining: set[str] = set()
        self._last_error = ""
        self._changes = 0
        self._closed = False

    def scale(self, pool: str, role: str, count: int) -> None:
        self.apply(pool, {role: count})

    def close(self, timeout_s: float = 60.0) -> None:
        """Take no more changes; wait (up to `timeout_s`) for the one being applied."""
        self._closed = True
        if self._change.acquire(timeout=timeout_s):
            self._change.release()

    def apply(self, pool: str, counts: Mapping[str, int], reason: str = "") -> None:
        """Make the pool's instance counts `counts` (roles not named keep theirs): drain the
        surplus first, then start what is missing. Waits for a change being applied first."""
        self._check(pool, counts)
        self._change.acquire()
        self._changes += 1
        self._apply_locked(dict(counts), reason)

    def apply_in_background(self, pool: str, counts: Mapping[str, int], reason: str = "") -> None:
        """`apply` on a thread of its own; refused while a change is being applied. Once this
        returns, `status()` shows the change (changing, and counted in `changes`)."""
        self._check(pool, counts)
        if not self._change.acquire(blocking=False):
            raise FailedPrecondition("a change is being applied: wait until status says done")
        self._changes += 1
        thread = threading.Thread(target=self._apply_locked, args=(dict(counts), reason))
        thread.daemon = True
        thread.start()

    def _apply_locked(self, counts: dict[str, int], reason: str) -> None:
        """The change, with `_change` held by the caller; releases it."""
        try:
            log.info("applying %s: %s", counts, reason or "asked")
            surplus = []
            for role, count in counts.items():
                have = self._serving(role)
                surplus += self._least_busy(have)[: max(0, len(have) - count)]
            self._drain_all(surplus)
            for role, count in counts.items():
                for _ in range(count - len(self._serving(role))):
                    self._start(role)
            self._last_error = ""
            log.info("applied %s", counts)
        except Exception as e:
            self._last_error = f"{type(e).__name__}: {e}"
            log.exception("applying %s failed", counts)
            raise
        finally:
            self._change.release()

    def _check(self, pool: str, counts: Mapping[str, int]) -> None:
        if self._closed:
            raise FailedPrecondition("the mesh is stopping")
        if pool != self.POOL:
            raise InvalidRequest(f"no pool {pool!r} here: a local mesh has one, {self.POOL!r}")
        for role, count in counts.items():
            if role not in ROLES:
                raise InvalidRequest(f"no role {role!r}: one of {', '.join(ROLES)}")
            if count < 0:
                raise InvalidRequest(f"{role}: a count of instances is >= 0, got {count}")

    def drain(self, worker: str) -> None:
        with self._change:
            if worker not in {p.name for p in self.mesh.workers}:
                raise InvalidRequest(f"no worker named {worker!r}")
            self._drain_all([worker])

    def status(self) -> ActuatorStatus:
        with self._lock:
            draining, starting = set(self._draining), dict(self._starting)
        try:
            loads = self.mesh.worker_loads()
        except grpc.RpcError as e:  # the gateway away: the status without loads
            log.warning("no worker loads from the gateway: %s", e.code().name)
            loads = {}
        instances = [
            Instance(
                p.name,
                _role(p.name),
                "draining" if p.name in draining else "serving",
                loads.get(p.name),
            )
            for p in self._live()
            if p.name not in starting
        ]
        instances += [Instance(name, role, "starting") for name, role in starting.items()]
        return ActuatorStatus(
            tuple(sorted(instances, key=lambda i: i.name)),
            changing=self._change.locked(),
            last_error=self._last_error,
            changes=self._changes,
        )

    def _live(self) -> list:
        """The mesh's workers whose process runs (one that exited unasked serves nothing)."""
        return [p for p in list(self.mesh.workers) if p.popen.poll() is None]

    def _serving(self, role: str) -> list[str]:
        return [p.name for p in self._live() if _role(p.name) == role]

    def _least_busy(self, names: list[str]) -> list[str]:
        """`names` by the work they hold now (the gateway's view), least first; ties: the
        newest first (the lowest-numbered instances stay)."""
        load = self.mesh.worker_loads()
        return sorted(names, key=lambda n: (_busy(load.get(n)), -int(n.rsplit("-", 1)[1])))

    def _drain_all(self, names: list[str]) -> None:
        with self._lock:
            self._draining |= set(names)
        stoppers = [threading.Thread(target=self.mesh.stop_worker, args=(n,)) for n in names]
        try:
            for t in stoppers:
                t.start()
            for t in stoppers:
                t.join()
        finally:
            with self._lock:
                self._draining -= set(names)
        left = [n for n in names if n in {p.name for p in self.mesh.workers}]
        if left:
            raise FailedPrecondition(f"{', '.join(left)} did not stop")

    def _start(self, role: str) -> None:
        name = self.mesh.free_name(role)
        with self._lock:
            self._starting[name] = role
        try:
            self.mesh.add_worker(role, name)
        finally:
            with self._lock:
                del self._starting[name]


def _role(name: str) -> str:
    return name.rsplit("-", 1)[0]


def _busy(load) -> int:
    """Requests an instance holds (a `WorkerLoad`; None: not registered, so none)."""
    if load is None:
        return 0
    return load.running_seqs + load.waiting_seqs + load.pending_pulls + load.held_kv_handles


def serve(actuator: LocalActuator, host: str = "127.0.0.1"):
    """Serve `actuator` as the `Actuator` gRPC service (a synchronous server on threads, as the
    launcher is); returns (server, address). Stop with `server.stop(grace)`."""

    class Servicer(planner_pb2_grpc.ActuatorServicer):
        def Apply(self, request, context):
            try:
                actuator.apply_in_background(request.pool, dict(request.counts), request.reason)
            except DistServeError as e:
                context.abort(status_code(e), str(e))
            return planner_pb2.ApplyResponse()

        def Drain(self, request, context):
            try:
                actuator.drain(request.worker_id)
            except DistServeError as e:
                context.abort(status_code(e), str(e))
            return planner_pb2.DrainResponse()

        def Status(self, request, context):
            s = actuator.status()
            return planner_pb2.ActuatorStatus(
                instances=[
                    planner_pb2.ActuatorInstance(
                        name=i.name, role=i.role, state=i.state, load=i.load
                    )
                    for i in s.instances
                ],
                changing=s.changing,
                last_error=s.last_error,
                changes=s.changes,
            )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    planner_pb2_grpc.add_ActuatorServicer_to_server(Servicer(), server)
    port = mesh_tls.add_port(server, f"{host}:0")
    server.start()
    return server, f"{host}:{port}"
