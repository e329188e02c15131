"""The mesh's etcd client: which members to reach (one or several), over TLS or not, and moving
on to another member when the one in use stops answering.

Every etcd client of the mesh (a worker's entry, a gateway's watch, the planner's election) takes
the same options (`add_etcd_args`): `--etcd`, the cluster's client URLs, comma-separated; with
https:// URLs `--etcd-ca` (the CA etcd's certificate must be signed by), `--etcd-cert` and
`--etcd-key` (this client's certificate, for an etcd that requires one: `--client-cert-auth`), and
`--etcd-server-name` (the name etcd's certificate must carry when it is not the URL's host: a
mesh certificate names services.common.mesh_tls.SERVER_NAME). An option that cannot take effect
(a CA for http://, a certificate without its key, https:// without a CA) is refused by name.

Failing over: aetcd's client speaks to one host, and Python's gRPC has no target naming several
hosts (its `ipv4:` list takes addresses, resolved once by us: a Kubernetes member restarted under
a new IP would be lost for good). So `EtcdClient` keeps one channel per member (each resolves
its own name, again after a disconnect) and uses one at a time, the first listed first. A call
that fails UNAVAILABLE (the member is gone, or has no leader) or DEADLINE_EXCEEDED (it is
unreachable) moves it to the next member; `call` retries a unary call there, once per member.
Leases and revisions belong to the cluster, not to a member, so a lease granted through one
member is renewed through another and a watch resumes from its revision on any. Watches ask for
a leader (etcd's `hasleader` metadata, clientv3's WithRequireLeader), so a member cut off from
its quorum ends them instead of leaving them silent.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import grpc

from services.common.errors import InvalidRequest

log = logging.getLogger("distserve.etcd")

FAILOVER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
REQUIRE_LEADER = (("hasleader", "true"),)  # etcd ends such a watch when its member has no leader

T = TypeVar("T")


def etcd_target(url: str) -> str:
    """The gRPC target (host:port) of one etcd client URL: http:// or https:// (none: http)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = parts.port or 2379
    except ValueError:
        port = 0
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        port = 0
    if not port:
        raise InvalidRequest(f"--etcd takes http(s)://HOST:PORT[,...], not {url!r}", "etcd")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"


DEFAULT_PREFIX = "/distserve/"  # of the keys of one mesh


def check_prefix(p: str) -> None:
    """InvalidRequest naming --etcd-prefix unless `p` is a key prefix between slashes."""
    if not (p.startswith("/") and p.endswith("/") and 2 < len(p) <= 128 and p.isprintable()):
        raise InvalidRequest(
            f"--etcd-prefix {p!r}: a key prefix between slashes, e.g. /distserve/chat/ "
            "(printable, at most 128 characters)",
            "etcd_prefix",
        )
    if " " in p or "//" in p:
        raise InvalidRequest(f"--etcd-prefix {p!r}: no spaces or empty segments", "etcd_prefix")


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach the mesh's etcd: its members' client URLs (all http:// or all https://) and,
    for https, the CA, this client's certificate and key, and the name etcd's certificate carries
    (None: each URL's host); `prefix`: where under etcd's keys this mesh keeps its membership
    and elections (meshes sharing one etcd each take their own)."""

    endpoints: tuple[str, ...]
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise InvalidRequest("--etcd: give at least one client URL", "etcd")
        check_prefix(self.prefix)
        for url in self.endpoints:
            etcd_target(url)
        schemes = {urlsplit(u).scheme if "://" in u else "http" for u in self.endpoints}
        if len(schemes) > 1:
            raise InvalidRequest("--etcd: every URL http://, or every URL https://", "etcd")
        tls_options = {
            "--etcd-ca": self.ca,
            "--etcd-cert": self.cert,
            "--etcd-key": self.key,
            "--etcd-server-name": self.server_name,
        }
        if not self.tls:
            given = [flag for flag, value in tls_options.items() if value is not None]
            if given:
                raise InvalidRequest(
                    f"{', '.join(given)}: for https:// etcd URLs; --etcd gives http://", "etcd"
                )
            return
        if self.ca is None:
            raise InvalidRequest(
                "--etcd https://...: give --etcd-ca (the CA that signed etcd's certificate)",
                "etcd_ca",
            )
        if self.cert is not None and self.key is None:
            raise InvalidRequest("--etcd-cert needs --etcd-key (its private key)", "etcd_key")
        if self.key is not None and self.cert is None:
            raise InvalidRequest("--etcd-key needs --etcd-cert (its certificate)", "etcd_cert")

    @classmethod
    def parse(
        cls,
        urls: str,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        server_name: str | None = None,
        prefix: str | None = None,
    ) -> EtcdConfig:
        """From `--etcd`'s text (URLs, comma-separated), the TLS options and `--etcd-prefix`."""
        endpoints = tuple(u.strip() for u in urls.split(",") if u.strip())
        return cls(endpoints, ca, cert, key, server_name, prefix or DEFAULT_PREFIX)

    @property
    def tls(self) -> bool:
        return self.endpoints[0].startswith("https://")

    @property
    def url(self) -> str:
        """The endpoints as `--etcd` takes them."""
        return ",".join(self.endpoints)

    def __str__(self) -> str:
        return self.url

    def args(self) -> list[str]:
        """This configuration as the command-line options of `add_etcd_args`."""
        out = ["--etcd", self.url]
        for flag, value in (
            ("--etcd-ca", self.ca),
            ("--etcd-cert", self.cert),
            ("--etcd-key", self.key),
            ("--etcd-server-name", self.server_name),
        ):
            if value is not None:
                out += [flag, str(value)]
        if self.prefix != DEFAULT_PREFIX:
            out += ["--etcd-prefix", self.prefix]
        return out

    def channel(self, url: str) -> grpc.aio.Channel:
        """A channel to the member at `url` (one of `endpoints`)."""
        target = etcd_target(url)
        if not self.tls:
            return grpc.aio.insecure_channel(target)
        files = {}
        given = (("--etcd-ca", self.ca), ("--etcd-cert", self.cert), ("--etcd-key", self.key))
        for flag, path in given:
            try:
                files[flag] = path.read_bytes() if path is not None else None
            except OSError as e:
                raise InvalidRequest(f"{flag} {path}: {e.strerror}", flag[2:]) from e
        credentials = grpc.ssl_channel_credentials(
            files["--etcd-ca"], files["--etcd-key"], files["--etcd-cert"]
        )
        options = []
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.aio.secure_channel(target, credentials, options=options)


def add_etcd_args(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, purpose: str, default: str | None = None
) -> None:
    """`--etcd` and its TLS options, the same in every process; `purpose`: what it is for."""
    p.add_argument(
        "--etcd",
        metavar="URL[,URL...]",
        default=default,
        help=f"the mesh's etcd: {purpose}; several members' client URLs, comma-separated: "
        "when the one in use stops answering, the next is used",
    )
    p.add_argument(
        "--etcd-ca",
        type=Path,
        metavar="FILE",
        help="with https:// URLs: the CA certificate (PEM) etcd's certificate is signed by",
    )
    p.add_argument(
        "--etcd-cert",
        type=Path,
        metavar="FILE",
        help="this client's certificate (PEM), for an etcd that requires one; with --etcd-key",
    )
    p.add_argument("--etcd-key", type=Path, metavar="FILE", help="its private key (PEM)")
    p.add_argument(
        "--etcd-prefix",
        metavar="/PREFIX/",
        help=f"where under etcd's keys the mesh keeps its membership and elections (default "
        f"{DEFAULT_PREFIX}): every process of one mesh the same, each mesh sharing an etcd its own",
    )
    p.add_argument(
        "--etcd-server-name",
        metavar="NAME",
        help="the name etcd's certificate carries, when not the URL's host (the mesh's "
        "certificates: distserve.internal)",
    )


def etcd_config(args: argparse.Namespace) -> EtcdConfig | None:
    """The `add_etcd_args` options as an EtcdConfig (None without --etcd); InvalidRequest names
    an option that cannot take effect."""
    if args.etcd is None:
        given = [
            f"--{name.replace('_', '-')}"
            for name in ("etcd_ca", "etcd_cert", "etcd_key", "etcd_server_name", "etcd_prefix")
            if getattr(args, name) is not None
        ]
        if given:
            raise InvalidRequest(f"{', '.join(given)}: options of --etcd, which is not given")
        return None
    return EtcdConfig.parse(
        args.etcd,
        args.etcd_ca,
        args.etcd_cert,
        args.etcd_key,
        args.etcd_server_name,
        args.etcd_prefix,
    )


class EtcdClient:
    """Stubs of etcd's KV, Lease and Watch services on one member at a time (the module's
    docstring: failing over)."""

    def __init__(self, config: EtcdConfig) -> None:
        from aetcd import rpc  # etcd's v3 API stubs

        self.rpc = rpc
        self.config = config
        self._channels = [config.channel(url) for url in config.endpoints]
        self._stubs = [(rpc.KVStub(c), rpc.LeaseStub(c), rpc.WatchStub(c)) for c in self._channels]
        self._current = 0

    @property
    def member(self) -> str:
        """The URL of the member in use."""
        return self.config.endpoints[self._current]

    @property
    def kv(self):
        return self._stubs[self._current][0]

    @property
    def lease(self):
        return self._stubs[self._current][1]

    @property
    def watch(self):
        return self._stubs[self._current][2]

    def failed(self, e: grpc.aio.AioRpcError, member: str | None = None) -> bool:
        """Move on to the next member when `e` says the one in use (or `member`, the one a call
        went to) is gone or unreachable; whether it moved."""
        if e.code() not in FAILOVER or len(self._channels) == 1:
            return False
        if member is not None and member != self.member:
            return True  # another call moved on already
        old = self.member
        self._current = (self._current + 1) % len(self._channels)
        log.warning("etcd member %s: %s; using %s", old, e.code().name, self.member)
        return True

    async def call(self, make: Callable[[], Awaitable[T]]) -> T:
        """`make()` (a call on the current member's stubs), again on the next member while the
        one it went to is gone, each member at most once."""
        for attempt in range(len(self._channels)):
            member = self.member
            try:
                return await make()
            except grpc.aio.AioRpcError as e:
                if not self.failed(e, member) or attempt == len(self._channels) - 1:
                    raise
        raise AssertionError("unreachable")

    def explain(self, e: grpc.aio.AioRpcError) -> str:
        """A failed call, for a person: the member, the status, what to check."""
        text = f"etcd at {self.member}: {e.code().name}: {e.details()}"
        if self.config.tls and self.config.cert is None:
            text += (
                " (this client presents no certificate: an etcd that requires client "
                "certificates refuses it; give --etcd-cert and --etcd-key)"
            )
        return text

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
