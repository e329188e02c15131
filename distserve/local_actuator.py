"""`distserve up`'s actuator: applies the planner's placements to the local mesh of processes
(distserve/local_mesh.py), and serves itself as the `Actuator` gRPC service the planner calls
(through `services.planner.actuator.RemoteActuator`).

`LocalActuator` starts workers and stops them by drain (SIGTERM: deregistered at once, then
in-flight work finishes or moves, services/worker/announcer.py). A worker changes role by drain
and restart: `apply` drains the surplus first, so a budget of devices is never exceeded while a
placement changes. A role given another tensor degree is re-sharded one instance at a time:
an instance of the new degree starts while the budget has room for it beside the old ones,
else an old one drains first to make the room (the role is then one instance short until the
new one is ready, never without one while it had two). It runs in the launcher's process,
never in the planner's.
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
from services.common.server import Undecodable, status_code
from services.planner.actuator import ActuatorStatus, Instance, common_degree
from services.planner.transition import transition

log = logging.getLogger("distserve.actuator")

ROLES = ("prefill", "decode", "colocated")


class LocalActuator:
    """Applies placements to a local mesh (a `distserve.local_mesh.Mesh`, started). `apply`
    blocks until the mesh is as asked (`apply_in_background` does not); one change at a time."""

    POOL = "default"  # a local mesh serves one model: one pool

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self._lock = threading.Lock()  # guards the fields below
        # A change is applied on the thread that begins it or on one of its own
        # (`apply_in_background`), so "a change is being applied" is a flag under `_lock`, not
        # a lock held across threads; `_idle` is notified when it is cleared.
        self._idle = threading.Condition(self._lock)
        self._changing = False
        self._starting: dict[str, tuple[str, int]] = {}  # name -> (role, tp) of those starting
        self._draining: set[str] = set()
        self._last_error = ""
        self._changes = 0
        self._closed = False

    def scale(self, pool: str, role: str, count: int) -> None:
        self.apply(pool, {role: count})

    def close(self, timeout_s: float = 60.0) -> None:
        """Take no more changes; wait (up to `timeout_s`) for the one being applied."""
        self._closed = True
        with self._idle:
            self._idle.wait_for(lambda: not self._changing, timeout_s)

    def apply(
        self,
        pool: str,
        counts: Mapping[str, int],
        reason: str = "",
        tp: Mapping[str, int] | None = None,
    ) -> None:
        """Make the pool's instance counts `counts` (roles not named keep theirs), each role's
        instances of tensor degree `tp[role]` (not named: the degree it has): drain the
        surplus first, then start what is missing, replacing instances of another degree
        (module docstring). Waits for a change being applied first."""
        self._check(pool, counts, tp)
        self._begin(wait=True)
        self._apply_steps(self._plan(counts, tp, reason), reason)

    def apply_in_background(
        self,
        pool: str,
        counts: Mapping[str, int],
        reason: str = "",
        tp: Mapping[str, int] | None = None,
    ) -> None:
        """`apply` on a thread of its own; refused while a change is being applied. Once this
        returns, `status()` shows the change (changing, and counted in `changes`)."""
        self._check(pool, counts, tp)
        if not self._begin(wait=False):
            raise FailedPrecondition("a change is being applied: wait until status says done")
        plan = self._plan(counts, tp, reason)
        thread = threading.Thread(target=self._apply_steps, args=(plan, reason))
        thread.daemon = True
        thread.start()

    def _begin(self, wait: bool) -> bool:
        """Mark a change as being applied: at once, or (`wait`) once the one being applied
        has ended. False: one is being applied (without `wait`). The caller ends it (`_end`)."""
        with self._idle:
            if wait:
                self._idle.wait_for(lambda: not self._changing)
            elif self._changing:
                return False
            self._changing = True
            return True

    def _end(self) -> None:
        """The change begun (`_begin`) has ended, applied or not: the next may begin."""
        with self._idle:
            self._changing = False
            self._idle.notify_all()

    def _plan(self, counts: Mapping[str, int], tp: Mapping[str, int] | None, reason: str):
        """The steps of the change (`transition`), the change begun by the caller; on a change
        that cannot be made, ends it and raises. The change is counted."""
        self._changes += 1
        try:
            want = {role: (tp or {}).get(role) or self._degree(role) for role in counts}
            degree = {p.name: p.tp for p in self._live()}
            live = [(n, _role(n), degree[n]) for n in self._least_busy(list(degree))]
            steps = transition(live, counts, want, self.mesh.spec.budget)
        except Exception as e:
            self._last_error = f"{type(e).__name__}: {e}"
            self._end()
            raise
        log.info("applying %s (tp %s): %s", dict(counts), want, reason or "asked")
        return steps

    def _apply_steps(self, steps: list, reason: str) -> None:
        """The steps of the change begun by the caller; ends it. Drains in a row run at
        once."""
        try:
            draining: list[str] = []
            for step in steps:
                if step.action == "drain":
                    draining.append(step.name)
                    continue
                self._drain_all(draining)
                draining = []
                self._start(step.role, step.tp)
            self._drain_all(draining)
            self._last_error = ""
            log.info("applied: %s", self.status().describe())
        except Exception as e:
            self._last_error = f"{type(e).__name__}: {e}"
            log.exception("applying the change failed (%s)", reason or "asked")
            raise
        finally:
            self._end()

    def _check(
        self, pool: str, counts: Mapping[str, int], tp: Mapping[str, int] | None = None
    ) -> None:
        if self._closed:
            raise FailedPrecondition("the mesh is stopping")
        if pool != self.POOL:
            raise InvalidRequest(f"no pool {pool!r} here: a local mesh has one, {self.POOL!r}")
        for role, count in counts.items():
            if role not in ROLES:
                raise InvalidRequest(f"no role {role!r}: one of {', '.join(ROLES)}")
            if count < 0:
                raise InvalidRequest(f"{role}: a count of instances is >= 0, got {count}")
        for role, degree in (tp or {}).items():
            if role not in counts:
                raise InvalidRequest(f"a tensor degree for {role}, whose count is not given")
            if degree < 0:
                raise InvalidRequest(f"{role}: a tensor degree is >= 1 (0: keep), got {degree}")

    def drain(self, worker: str) -> None:
        self._begin(wait=True)
        try:
            if worker not in {p.name for p in self.mesh.workers}:
                raise InvalidRequest(f"no worker named {worker!r}")
            self._drain_all([worker])
        finally:
            self._end()

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
                p.tp,
            )
            for p in self._live()
            if p.name not in starting
        ]
        instances += [
            Instance(name, role, "starting", tp=tp) for name, (role, tp) in starting.items()
        ]
        with self._lock:
            changing = self._changing
        return ActuatorStatus(
            tuple(sorted(instances, key=lambda i: i.name)),
            changing=changing,
            last_error=self._last_error,
            changes=self._changes,
        )

    def _live(self) -> list:
        """The mesh's workers whose process runs (one that exited unasked serves nothing)."""
        return [p for p in list(self.mesh.workers) if p.popen.poll() is None]

    def _degree(self, role: str) -> int:
        """The tensor degree `role`'s instances have (none: the spec's)."""
        usual = common_degree([p.tp for p in self._live() if _role(p.name) == role])
        return usual or self.mesh.spec.tp.get(role, 1)

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

    def _start(self, role: str, tp: int) -> None:
        name = self.mesh.free_name(role)
        with self._lock:
            self._starting[name] = (role, tp)
        try:
            self.mesh.add_worker(role, name, tp)
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


class _Lenient(grpc.ServerInterceptor):
    """A request that is no valid message gets INVALID_ARGUMENT, as on the mesh's own servers
    (services/common/server.py; grpc's answer would be INTERNAL)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        behavior, parse = handler.unary_unary, handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as e:  # protobuf's DecodeError, or anything a parser raises
                return Undecodable(e)

        def run(request, context):
            if isinstance(request, Undecodable):
                context.abort(*request.abort_args())
            return behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            run, request_deserializer=deserialize, response_serializer=handler.response_serializer
        )


def serve(actuator: LocalActuator, host: str = "127.0.0.1"):
    """Serve `actuator` as the `Actuator` gRPC service (a synchronous server on threads, as the
    launcher is); returns (server, address). Stop with `server.stop(grace)`."""

    class Servicer(planner_pb2_grpc.ActuatorServicer):
        def Apply(self, request, context):
            try:
                actuator.apply_in_background(
                    request.pool, dict(request.counts), request.reason, dict(request.tp)
                )
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
            return actuator.status().to_pb()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[_Lenient()])
    planner_pb2_grpc.add_ActuatorServicer_to_server(Servicer(), server)
    port = mesh_tls.add_port(server, f"{host}:0")
    server.start()
    return server, f"{host}:{port}"
