"""Optional mutual TLS between the mesh's own services, configured by the environment.

With DISTSERVE_TLS_CERT, DISTSERVE_TLS_KEY and DISTSERVE_TLS_CA set (PEM files: this process's
certificate chain, its private key, and the mesh's CA), every gRPC server of the mesh serves TLS
and every channel between the mesh's processes presents the certificate and checks its peer's
against the CA: every server requires a client certificate of the mesh's CA of every caller.
The gateway's ports included: the public entry is then Envoy (which holds a mesh certificate
toward the gateway: EdgeConfig.upstream_tls), and only the mesh's processes reach the workers,
their KV and the worker registry. Every mesh
certificate carries the name SERVER_NAME (a subjectAltName DNS entry), which channels check
instead of the address they dial, so one certificate per process works whatever its address.
Unset: plaintext, as before.

Not covered: the KV bytes on UCX (UCX has no TLS). The per-handle 32-byte access token still
gates them; on an untrusted network move KV over gRPC (`--kv-transport grpc`), which is TLS.
"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.errors import DistServeError

ENV_CERT, ENV_KEY, ENV_CA = "DISTSERVE_TLS_CERT", "DISTSERVE_TLS_KEY", "DISTSERVE_TLS_CA"
SERVER_NAME = "distserve.internal"


class TlsConfigError(DistServeError):
    status = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class MeshTls:
    cert_chain: bytes
    private_key: bytes
    ca: bytes
    paths: tuple[str, str, str]  # cert, key, CA (for Envoy, which reads files)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> MeshTls | None:
        paths = tuple(env.get(k, "") for k in (ENV_CERT, ENV_KEY, ENV_CA))
        if not any(paths):
            return None
        if not all(paths):
            names = (ENV_CERT, ENV_KEY, ENV_CA)
            given = ", ".join(k for k, p in zip(names, paths, strict=True) if p)
            raise TlsConfigError(
                f"mesh TLS needs all of {', '.join(names)} (PEM files); set: {given}"
            )
        try:
            cert, key, ca = (Path(p).read_bytes() for p in paths)
        except OSError as e:
            raise TlsConfigError(f"cannot read a mesh TLS file: {e}") from e
        return cls(cert, key, ca, paths)  # type: ignore[arg-type]

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.ca,
            require_client_auth=True,
        )

    def server_ssl_context(self) -> ssl.SSLContext:
        """For an HTTP port (the gateway's HTTP API): mutual TLS with the mesh's CA."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.paths[2])
        cert, key, _ = self.paths
        context.load_cert_chain(cert, key)
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca,
            private_key=self.private_key,
            certificate_chain=self.cert_chain,
        )


@functools.cache
def mesh_tls() -> MeshTls | None:
    """This process's mesh TLS (read once from the environment), or None."""
    return MeshTls.from_env()


def _options(options: Sequence[tuple], tls: MeshTls | None) -> list[tuple]:
    return [*options, ("grpc.ssl_target_name_override", SERVER_NAME)] if tls else list(options)


def aio_channel(address: str, options: Sequence[tuple] = ()) -> grpc.aio.Channel:
    """A channel to another process of the mesh: mutual TLS when configured."""
    tls = mesh_tls()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=_options(options, tls)
    )


def channel(address: str, options: Sequence[tuple] = ()) -> grpc.Channel:
    """The same, blocking (the launcher, the command line)."""
    tls = mesh_tls()
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(), options=_options(options, tls))


def add_port(server, address: str) -> int:
    """Listen on `address`: mutual TLS when configured (callers must present a certificate of
    the mesh's CA), else plaintext. Returns the bound port (0: failed)."""
    tls = mesh_tls()
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())
