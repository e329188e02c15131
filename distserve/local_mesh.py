"""`distserve up`: the mesh's processes on this host, started, watched and stopped together.

Each service runs as its own process and prints one JSON "ready" line when it serves. The
launcher starts etcd first (the mesh's membership: services/common/discovery.py; or uses the
spec's existing one), then the gateway and the workers, which join through etcd; it waits for all
of them and for every worker to appear in the gateway's view, then starts Envoy in front of the
gateway (when the spec has an edge) and waits until it is ready. Under mesh TLS (DISTSERVE_TLS_*
in the launcher's environment) the mesh's own etcd serves TLS with the mesh's certificate too
(distserve/etcd.py). With several planners (`planners`), each campaigns in an election on the
mesh's etcd and one leads (services/common/election.py); every gateway feeds them all. Stopping
sends SIGTERM (Envoy
first, then the workers, then the gateway, then etcd), and SIGKILL to any that outlive the grace
period. Children die with the launcher even if it is killed
(PR_SET_PDEATHSIG).

A running mesh also grows and shrinks one worker at a time (`add_worker`, `stop_worker`: a
drain), which the planner's actuator uses (`--budget`, distserve/local_actuator.py); that is
why this file is over ~450 lines: starting, watching and resizing one set of processes is one
idea.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from distserve.etcd import Etcd
from services.common import mesh_tls, orphan_guard
from services.common.errors import InvalidRequest
from services.common.etcd_client import EtcdConfig
from services.common.gen.distserve.v1 import gateway_pb2, gateway_pb2_grpc
from services.edge.config import EdgeConfig, Upstream
from services.edge.envoy import Envoy


@dataclass(frozen=True)
class MeshSpec:
    """What to start: the model, how many instances of each role, where the gateway listens."""

    model: Path
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    host: str = "127.0.0.1"
    gateway_port: int = 50051  # 0 picks a free port
    gateway_http_port: int = 0  # the gateway's own HTTP API (Envoy's upstream); 0: any free port
    pin: bool = False  # one CPU core and one torch thread per worker
    # Extra options for every worker (engine options), then for each role's (these win where
    # both give an option: they come after the launcher's own, last but `per_worker_args`).
    worker_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    colocated_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    # Extra options for single workers by name ("prefill-0", "decode-1", ...).
    per_worker_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    ready_timeout_s: float = 180.0
    # On stop, how long workers may drain (finish or hand off in-flight work, see KV released);
    # stop() waits that long and 10 s more before it kills.
    drain_timeout_s: float = 5.0
    env: dict[str, str] = field(default_factory=dict)
    edge: EdgeConfig | None = None  # Envoy in front of the gateway; None: no edge
    planner: bool = False  # a planner, fed the live workload by the gateway
    # Planner processes ("planner", "planner-1", ...): with more than one they elect a leader on
    # the mesh's etcd, under one election key, and the others stand by.
    planners: int = 1
    planner_args: tuple[str, ...] = ()
    # > 0: the planner resizes the running mesh within this many devices, through the
    # launcher's actuator (distserve/local_actuator.py); planner_args must name the model
    # spec and the SLO it plans for.
    budget: int = 0
    # A command to run single processes under, by name ("etcd", "gateway", "prefill-0", ...), e.g.
    # ("ip", "netns", "exec", "NS") to place one in a network namespace; it must exec the rest.
    command_prefix: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The tensor degree of each role's instances (an emulated engine models it in one process).
    tp: dict[str, int] = field(default_factory=dict)
    engine: str = "torch"  # or "emulated": `model` is an emulated folder (docs/engine.md)
    emulation_args: tuple[str, ...] = ()  # the emulated workers' device options
    time_scale: float = 1.0  # an emulated mesh's wall seconds per emulated second
    etcd: EtcdConfig | None = None  # an existing etcd (its members, TLS); None: the mesh's own
    # Gateway processes, each seeing every worker through etcd; Envoy balances over all of
    # them. The first is "gateway" on gateway_port, the others "gateway-1", ... on free ports.
    gateways: int = 1


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    ready: dict | None = None
    tp: int = 1  # a worker's tensor degree
    ready_event: threading.Event = field(default_factory=threading.Event)

    def metrics(self, timeout_s: float = 5.0) -> list:
        """Every sample its /metrics serves now (prometheus_client `Sample`s: name, labels,
        value); empty for a process that serves none."""
        from prometheus_client.parser import text_string_to_metric_families

        address = (self.ready or {}).get("metrics_address")
        if not address:
            return []
        url = f"http://{address}/metrics"
        body = urllib.request.urlopen(url, timeout=timeout_s).read().decode()
        return [s for family in text_string_to_metric_families(body) for s in family.samples]


class Mesh:
    """A running mesh; use as a context manager, or start() and stop()."""

    def __init__(self, spec: MeshSpec) -> None:
        self.spec = spec
        self.processes: list[Process] = []
        self.gateway_address = ""  # the first gateway's
        self.gateway_http_address = ""
        self.gateway_addresses: list[str] = []  # every gateway's gRPC address
        self.envoy: Envoy | None = None
        self.edge_address = ""  # Envoy's listener, when the spec has an edge
        self._clock_args: tuple[str, ...] = ()  # every process's --time-scale and --time-epoch
        self.actuator = None  # a LocalActuator when the planner resizes the mesh (spec.budget)
        self._actuator_server = None
        self._registry = None  # a channel to the gateway's registry, kept (the planner polls)
        self.etcd: Etcd | None = None  # the mesh's own etcd (none when the spec names one)
        self.etcd_config: EtcdConfig | None = None  # how every process reaches the mesh's etcd

    def __enter__(self) -> Mesh:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def workers(self) -> list[Process]:
        return [p for p in self.processes if not _is_planner(p.name) and not _is_gateway(p.name)]

    @property
    def gateways(self) -> list[Process]:
        return [p for p in self.processes if _is_gateway(p.name)]

    def start(self) -> None:
        spec = self.spec
        # Every process of an emulated mesh keeps the same clock (services/common/clock.py).
        self._clock_args = ()
        if spec.time_scale != 1.0:
            self._clock_args = (
                "--time-scale",
                repr(spec.time_scale),
                "--time-epoch",
                repr(time.time()),
            )
        try:
            self.etcd_config = spec.etcd
            if self.etcd_config is None:
                prefix = spec.command_prefix.get("etcd", ())
                tls = mesh_tls.mesh_tls()
                self.etcd = Etcd(spec.host, die_with_parent=True, command_prefix=prefix, tls=tls)
                self.etcd.start(timeout_s=spec.ready_timeout_s)
                self.etcd_config = self.etcd.config
            gateway_args = [*spec.gateway_args, *self._clock_args, *self.etcd_config.args()]
            if spec.planner:
                gateway_args += ["--planner", ",".join(self._start_planners())]
            gateways = [
                self._spawn(
                    "gateway" if i == 0 else f"gateway-{i}",
                    [
                        "services.gateway",
                        "--model",
                        str(spec.model),
                        "--host",
                        spec.host,
                        "--port",
                        str(spec.gateway_port if i == 0 else 0),
                        "--http-port",
                        str(spec.gateway_http_port if i == 0 else 0),
                        *gateway_args,
                    ],
                )
                for i in range(spec.gateways)
            ]
            self._wait_ready(gateways)
            self.gateway_addresses = [g.ready["address"] for g in gateways]
            self.gateway_address = gateways[0].ready["address"]
            self.gateway_http_address = gateways[0].ready.get("http_address", "")
            started = [
                self._spawn_worker(role, i)
                for role, count in (
                    ("prefill", spec.prefill),
                    ("decode", spec.decode),
                    ("colocated", spec.colocated),
                )
                for i in range(count)
            ]
            self._wait_ready(started)
            self._wait_listed(lambda ws: len(ws) >= len(started))
            if spec.edge is not None:
                upstreams = [
                    Upstream(grpc=g.ready["address"], http=g.ready.get("http_address", ""))
                    for g in gateways
                ]
                edge = spec.edge
                if edge.upstream_tls is None and (tls := mesh_tls.mesh_tls()) is not None:
                    edge = dataclasses.replace(edge, upstream_tls=tls.paths)
                self.envoy = Envoy(edge, upstreams, die_with_parent=True)
                self.envoy.start(timeout_s=spec.ready_timeout_s)
                self.edge_address = self.envoy.address
        except BaseException:
            self.stop()
            raise

    def _spawn_worker(self, role: str, i: int, tp: int | None = None) -> Process:
        """Start the worker `{role}-{i}` of tensor degree `tp` (default: the spec's for the
        role), not waiting for it."""
        spec = self.spec
        tp = tp or spec.tp.get(role, 1)
        args = [
            "services.prefill" if role == "prefill" else "services.decode",
            "--model",
            str(spec.model),
            *self.etcd_config.args(),
            "--host",
            spec.host,
            "--worker-id",
            f"{role}-{i}",
            "--drain-timeout-s",
            str(spec.drain_timeout_s),
            *self._clock_args,
        ]
        if spec.engine != "torch":
            args += ["--engine", spec.engine, *spec.emulation_args]
        if tp > 1:
            args += ["--tensor-parallel-size", str(tp)]
        args += [*spec.worker_args, *getattr(spec, f"{role}_args")]
        args += spec.per_worker_args.get(f"{role}-{i}", ())
        if role != "prefill":
            args += ["--role", role]
        if spec.pin:
            cores = sorted(os.sched_getaffinity(0))
            args += ["--cpu", str(cores[len(self.workers) % len(cores)]), "--threads", "1"]
        proc = self._spawn(f"{role}-{i}", args)
        proc.tp = tp
        return proc

    def free_name(self, role: str) -> str:
        """The name a new `role` worker gets: the lowest index no running worker has."""
        taken = {p.name for p in self.processes}
        return next(f"{role}-{i}" for i in range(len(taken) + 1) if f"{role}-{i}" not in taken)

    def add_worker(self, role: str, name: str | None = None, tp: int | None = None) -> Process:
        """Start one more `role` worker (named `name`, default `free_name(role)`; of tensor
        degree `tp`, default the spec's for the role); return once it is ready and registered
        with the gateway."""
        if role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"no worker role {role!r}")
        name = name or self.free_name(role)
        if not name.startswith(f"{role}-") or name in {p.name for p in self.processes}:
            raise ValueError(f"{name!r} is not a free name for a {role} worker")
        proc = self._spawn_worker(role, int(name.rsplit("-", 1)[1]), tp)
        try:
            self._wait_ready([proc])
            self._wait_listed(lambda ws: any(w.address == proc.ready["address"] for w in ws))
        except BaseException:
            self.stop_worker(proc.name, grace_s=0)
            raise
        return proc

    def stop_worker(self, name: str, grace_s: float | None = None) -> None:
        """Drain the worker `name` and wait until it exits: it leaves the gateway's registry at
        once (nothing new is routed to it), its requests in flight finish or move to another
        instance, its held KV is released; SIGKILL if it outlives the drain timeout and 10 s."""
        proc = next((p for p in self.workers if p.name == name), None)
        if proc is None:
            raise ValueError(f"no worker named {name!r}")
        grace_s = self.spec.drain_timeout_s + 10.0 if grace_s is None else grace_s
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()
        if proc in self.processes:  # `distserve up`'s watch may have seen it exit first
            self.processes.remove(proc)

    def worker_loads(self) -> dict:
        """Each registered worker's last reported load (`WorkerLoad`), by name; none before the
        gateway is up (the planner starts first and asks at once: a channel to no address would
        be kept, and fail every later call)."""
        if not self.gateway_address:
            return {}
        if self._registry is None:
            self._registry = mesh_tls.channel(self.gateway_address)
        stub = gateway_pb2_grpc.WorkerRegistryStub(self._registry)
        workers = stub.ListWorkers(gateway_pb2.ListWorkersRequest(), timeout=5).workers
        return {w.worker_id: w.load for w in workers}

    def _start_planners(self) -> list[str]:
        """The planner processes' addresses; on this single host a planner splits the
        disaggregated workers, or, with a budget, resizes the mesh through the launcher's
        actuator (only the elected one acts when there are several)."""
        spec = self.spec
        if spec.planners < 1:
            raise InvalidRequest("planners: at least 1")
        args = ["services.planner", "--host", spec.host, *self._clock_args]
        if spec.budget:
            args += self._serve_actuator()
        elif spec.prefill + spec.decode >= 2:
            args += ["--workers", str(spec.prefill + spec.decode)]
        if spec.planners > 1:
            args += self.etcd_config.args()
        planners = [
            self._spawn("planner" if i == 0 else f"planner-{i}", [*args, *spec.planner_args])
            for i in range(spec.planners)
        ]
        self._wait_ready(planners)
        return [p.ready["address"] for p in planners]

    @property
    def planners(self) -> list[Process]:
        return [p for p in self.processes if _is_planner(p.name)]

    def _serve_actuator(self) -> list[str]:
        """Serve a LocalActuator for the planner; its command-line options for it."""
        from distserve.local_actuator import LocalActuator, serve

        spec = self.spec
        roles = {"prefill": spec.prefill, "decode": spec.decode, "colocated": spec.colocated}
        roles = {r: n for r, n in roles.items() if n}
        devices = sum(n * spec.tp.get(r, 1) for r, n in roles.items())
        if devices > spec.budget:
            raise InvalidRequest(f"the mesh starts with {devices} devices, over its budget")
        self.actuator = LocalActuator(self)
        self._actuator_server, address = serve(self.actuator, spec.host)
        tp = ",".join(f"{r}={spec.tp.get(r, 1)}" for r in roles)
        return ["--actuator", address, "--budget", str(spec.budget), "--tp", tp]

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the planner that resizes the mesh (so it asks nothing more), Envoy, the
        workers, then the gateway, then the mesh's own etcd; SIGKILL what outlives the grace
        period (default: the workers' drain timeout and 10 s)."""
        grace_s = self.spec.drain_timeout_s + 10.0 if grace_s is None else grace_s
        if self._actuator_server is not None:
            _terminate(self.planners, grace_s)
            self._actuator_server.stop(0)
            self._actuator_server = None
            self.actuator.close(timeout_s=grace_s + self.spec.ready_timeout_s)
        if self.envoy is not None:
            self.envoy.stop(grace_s)
            self.envoy = None
        _terminate(self.workers, grace_s)
        _terminate(
            [p for p in self.processes if _is_planner(p.name) or _is_gateway(p.name)], grace_s
        )
        self.processes = []
        if self._registry is not None:
            self._registry.close()
            self._registry = None
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None

    def restart(self, name: str) -> Process:
        """Start the worker `name`, which stopped or died, again under its name and with the
        same command line; return once it is ready and registered with the gateway (its new
        address in the registry)."""
        i, old = next(((i, p) for i, p in enumerate(self.processes) if p.name == name), (-1, None))
        if old is None or _is_planner(old.name) or _is_gateway(old.name):
            raise ValueError(f"no worker named {name!r}")
        if old.popen.poll() is None:
            raise RuntimeError(f"{name} is still running (pid {old.popen.pid})")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env}
        popen = orphan_guard.popen(
            old.popen.args, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env
        )
        proc = Process(name, popen)
        self.processes[i] = proc
        threading.Thread(target=_watch_stdout, args=(proc,), daemon=True).start()
        self._wait_ready([proc])
        address = proc.ready["address"]
        self._wait_listed(lambda ws: any(w.worker_id == name and w.address == address for w in ws))
        return proc

    def _spawn(self, name: str, module_args: list[str]) -> Process:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env}
        popen = orphan_guard.popen(
            orphan_guard.command(
                [*self.spec.command_prefix.get(name, ()), sys.executable, "-m", *module_args]
            ),
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        proc = Process(name, popen)
        self.processes.append(proc)
        threading.Thread(target=_watch_stdout, args=(proc,), daemon=True).start()
        return proc

    def _wait_ready(self, procs: list[Process]) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout_s
        for p in procs:
            while not p.ready_event.wait(timeout=0.2):
                if p.popen.poll() is not None:
                    raise RuntimeError(
                        f"{p.name} exited with code {p.popen.returncode} before ready"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{p.name} was not ready within {self.spec.ready_timeout_s} s"
                    )

    def _wait_listed(self, done, timeout_s: float = 30.0) -> None:
        """Wait until `done(workers)` holds for every gateway's view (its WorkerInfo list)."""
        deadline = time.monotonic() + timeout_s
        for address in self.gateway_addresses:
            with mesh_tls.channel(address) as channel:
                stub = gateway_pb2_grpc.WorkerRegistryStub(channel)
                while True:
                    workers = stub.ListWorkers(gateway_pb2.ListWorkersRequest(), timeout=5).workers
                    if done(workers):
                        break
                    if time.monotonic() > deadline:
                        names = sorted(w.worker_id for w in workers)
                        raise TimeoutError(
                            f"the gateway at {address} did not settle: it lists {names}"
                        )
                    time.sleep(0.1)


def _is_gateway(name: str) -> bool:
    return name == "gateway" or name.startswith("gateway-")


def _is_planner(name: str) -> bool:
    return name == "planner" or name.startswith("planner-")


def _terminate(group: list[Process], grace_s: float) -> None:
    """SIGTERM every process of `group` still running; SIGKILL those alive after `grace_s`."""
    for p in group:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in group:
        try:
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()


def _watch_stdout(proc: Process) -> None:
    """Find the ready line; pass everything else through to our stdout."""
    for line in proc.popen.stdout:
        if proc.ready is None and line.startswith("{"):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = {}
            if event.get("event") == "ready":
                proc.ready = event
                proc.ready_event.set()
                continue
        sys.stdout.write(f"[{proc.name}] {line}")
        sys.stdout.flush()


def run_until_signal(spec: MeshSpec) -> int:
    """`distserve up`: start the mesh, print its endpoints, stop it on SIGINT or SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Mesh(spec) as mesh:
        own = " (its own; data removed at exit)" if mesh.etcd is not None else ""
        print(f"distserve: etcd on {mesh.etcd_config.url}{own}", flush=True)
        for g in mesh.gateways:
            print(f"distserve: {g.name} (gRPC) on {g.ready['address']}", flush=True)
            print(f"distserve: {g.name} (HTTP) on {g.ready.get('http_address', '')}", flush=True)
        for p in [*mesh.workers, *mesh.planners]:
            print(f"distserve: {p.name} on {p.ready['address']}", flush=True)
        for p in mesh.processes:
            if p.ready.get("metrics_address"):
                print(f"distserve: {p.name} metrics on http://{p.ready['metrics_address']}/metrics")
        if mesh.envoy is not None:
            scheme = "https" if spec.edge.tls else "http"
            keys = "API keys required" if spec.edge.api_keys else "no API keys"
            print(
                f"distserve: edge (Envoy; OpenAI HTTP API and gRPC) on "
                f"{scheme}://{mesh.edge_address} ({keys}); admin on {mesh.envoy.admin_address}",
                flush=True,
            )
        print("distserve: serving; Ctrl-C stops", flush=True)
        while not stop.wait(timeout=0.5):
            dead = [p for p in mesh.processes if p.popen.poll() is not None]
            for p in dead:
                print(f"distserve: {p.name} exited with code {p.popen.returncode}", flush=True)
                mesh.processes.remove(p)
            if mesh.envoy is not None and mesh.envoy.popen.poll() is not None:
                print(f"distserve: envoy exited with code {mesh.envoy.popen.returncode}")
                mesh.envoy.stop()
                mesh.envoy = None
        print("distserve: stopping", flush=True)
    return 0


def add_emulation_options(p: argparse.ArgumentParser) -> None:
    """The options of an emulated mesh, for `distserve up` and `distserve bench goodput`."""
    g = p.add_argument_group(
        "emulated engine",
        "the real mesh with each worker's forward pass replaced by its modelled time on the "
        "emulated device (docs/engine.md); never a claim about a model's output or speed",
    )
    g.add_argument(
        "--engine",
        choices=("torch", "emulated"),
        default="torch",
        help="torch: run the model (default); emulated: model each step from a latency profile",
    )
    g.add_argument(
        "--model-spec",
        help="the model an emulated mesh models: opt-13b, opt-66b, opt-175b or a model folder "
        "(its emulated folder, named <spec>-emulated, is made in the cache)",
    )
    g.add_argument("--profile", help="latency profile (default: DistServe's published A100)")
    g.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one device")
    g.add_argument(
        "--link-gbs",
        type=float,
        default=300.0,
        help="KV link bandwidth, GB/s (300 NVLink, 25 PCIe, 3.1 between nodes)",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per emulated second; every latency reported is in emulated time",
    )


def emulated_mesh(args: argparse.Namespace) -> dict:
    """MeshSpec fields for `add_emulation_options`' options ({} for the real engine); sets
    `args.model` to the emulated folder of --model-spec."""
    if args.engine == "torch":
        if args.model_spec or args.time_scale != 1.0:
            raise InvalidRequest("--model-spec and --time-scale are for --engine emulated")
        return {}
    from services.common.model_spec import model_spec
    from services.engine.presets import emulated_model

    if args.model_spec:
        args.model = emulated_model(model_spec(args.model_spec))
    elif args.model is None:
        raise InvalidRequest("--engine emulated needs --model-spec (e.g. opt-13b)")
    if args.time_scale <= 0:
        raise InvalidRequest("--time-scale must be positive (wall seconds per emulated second)")
    worker_args = ["--gpu-memory-gib", str(args.gpu_memory_gib), "--link-gbs", str(args.link_gbs)]
    if args.profile:
        worker_args += ["--profile", str(args.profile)]
    return {
        "engine": "emulated",
        "time_scale": args.time_scale,
        "emulation_args": tuple(worker_args),
    }
