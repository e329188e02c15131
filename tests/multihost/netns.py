"""Three "hosts" on one machine: network namespaces joined by veth pairs (see test_netns.py).

    root ns (the test)  bridge dsb<pid> 10.231.N.1 ── front network 10.231.N.0/24
        ├─ veth ── ns gateway  eth0 10.231.N.2
        ├─ veth ── ns prefill  eth0 10.231.N.3   kv0 10.232.N.3 ─┐ kv link 10.232.N.0/24
        └─ veth ── ns decode   eth0 10.231.N.4   kv0 10.232.N.4 ─┘ (a veth pair, nothing else)

The prefill instance serves (gRPC control and UCX) on its kv-link address; the gateway and the
root namespace reach that address through a route via the prefill's front address, the decode
instance reaches it only over the kv link, so cutting kv0 cuts prefill <-> decode and nothing else.
"""

from __future__ import annotations

import os
import shutil
import subprocess


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"dsprobe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _free_subnet() -> int:
    """N such that no address or route of the root namespace mentions 10.231.N or 10.232.N."""
    taken = _run("ip", "-4", "addr").stdout + _run("ip", "-4", "route").stdout
    start = os.getpid() % 200
    for i in range(250):
        n = (start + i) % 250 + 1
        if f"10.231.{n}." not in taken and f"10.232.{n}." not in taken:
            return n
    raise RuntimeError("no free 10.231.N.0/24 subnet")


class Topology:
    """The namespaces and links; `close()` removes every one of them (idempotent)."""

    ROLES = ("gateway", "prefill", "decode")

    def __init__(self) -> None:
        tag = str(os.getpid())
        self.ns = {role: f"ds{role[0]}{tag}" for role in self.ROLES}
        self.bridge = f"dsb{tag}"
        self.uplinks = [f"ds{role[0]}v{tag}" for role in self.ROLES]  # root-side veth ends
        n = _free_subnet()
        self.root = f"10.231.{n}.1"
        self.front = {"gateway": f"10.231.{n}.2", "prefill": f"10.231.{n}.3"}
        self.front["decode"] = f"10.231.{n}.4"
        self.kv = {"prefill": f"10.232.{n}.3", "decode": f"10.232.{n}.4"}

    def create(self) -> Topology:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.root}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for role, uplink in zip(self.ROLES, self.uplinks, strict=True):
            ns = self.ns[role]
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "add", uplink, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", uplink, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.front[role]}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
        p, d = self.ns["prefill"], self.ns["decode"]
        _run("ip", "-n", p, "link", "add", "kv0", "type", "veth", "peer", "name", "kv0", "netns", d)
        for role in ("prefill", "decode"):
            _run("ip", "-n", self.ns[role], "addr", "add", f"{self.kv[role]}/24", "dev", "kv0")
            _run("ip", "-n", self.ns[role], "link", "set", "kv0", "up")
        # The prefill instance's kv-link address, for those not on the kv link.
        via = ("via", self.front["prefill"])
        _run("ip", "route", "add", self.kv["prefill"], *via, "dev", self.bridge)
        _run("ip", "-n", self.ns["gateway"], "route", "add", self.kv["prefill"], *via)

    def exec_prefix(self, role: str, **env: str) -> tuple[str, ...]:
        """Run a command in `role`'s namespace (with `env` set)."""
        extra = ("env", *(f"{k}={v}" for k, v in env.items())) if env else ()
        return ("ip", "netns", "exec", self.ns[role], *extra)

    def cut_kv_link(self) -> None:
        """The decode host's kv0 goes down: it loses its route to the prefill instance, and
        what the prefill instance sends it over the link (now without carrier) is lost."""
        _run("ip", "-n", self.ns["decode"], "link", "set", "kv0", "down")

    def restore_kv_link(self) -> None:
        _run("ip", "-n", self.ns["decode"], "link", "set", "kv0", "up")

    def kv_link_up(self) -> bool:
        out = _run("ip", "-n", self.ns["decode"], "-o", "link", "show", "kv0").stdout
        return ",UP" in out or "<UP" in out

    def leftovers(self) -> list[str]:
        """Anything of this topology still present in the root namespace."""
        names = {line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines()}
        for line in _run("ip", "-o", "link").stdout.splitlines():
            names.add(line.split(":")[1].strip().split("@")[0])
        return sorted(names & {*self.ns.values(), self.bridge, *self.uplinks})

    def close(self) -> None:
        for ns in self.ns.values():
            # Deleting a namespace destroys its veth ends, and with them their peers.
            _run("ip", "netns", "del", ns, check=False)
        for link in (*self.uplinks, self.bridge):
            _run("ip", "link", "del", link, check=False)
