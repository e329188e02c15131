"""The mesh's Secrets: the edge's API keys and TLS certificate, the mesh's mutual TLS, HF_TOKEN.

Each is either rendered from files given to `deploy render` (a Secret object in `secrets.yaml`,
its values base64-encoded: that file holds the secrets themselves and must not be committed), or
a Secret that already exists in the namespace, referenced by name (`--api-key-secret NAME` ...),
which the manifests then only mount. Either way a secret's value appears in no other object: the
processes read it from a mounted file or an environment variable set from the Secret, as they
read the same files and variables on one machine (`distserve up --api-key-file`, `--tls-cert`,
`--tls-key`; DISTSERVE_TLS_CERT/KEY/CA; HF_TOKEN).

The keys inside each Secret (what a Secret referenced by name must hold):

| Secret | keys | read by |
|---|---|---|
| API keys | `api-keys` (one key a line) | the Envoy pod's config step (`--api-key-file`) |
| edge TLS | `tls.crt`, `tls.key` (`kubectl create secret tls`) | Envoy's listener |
| mesh TLS | `tls.crt`, `tls.key`, `ca.crt` | every process of the mesh (services.common.mesh_tls) |

Mesh TLS given neither way is generated, a certificate per component (mesh_certs.py).
| HF_TOKEN | `token` | the model staging step (huggingface_hub reads HF_TOKEN) |
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from pathlib import Path

from services.common.errors import InvalidRequest
from services.common.mesh_tls import ENV_CA, ENV_CERT, ENV_KEY
from services.edge.config import read_api_keys

SECRET_DIR = "/etc/distserve"
API_KEYS_KEY, HF_TOKEN_KEY = "api-keys", "token"
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


@dataclass(frozen=True)
class SecretFiles:
    """What `deploy render` was told about the secrets: files to render, or Secrets' names."""

    api_key_file: Path | None = None
    api_key_secret: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_secret: str | None = None
    mesh_tls_cert: Path | None = None
    mesh_tls_key: Path | None = None
    mesh_tls_ca: Path | None = None
    mesh_tls_secret: str | None = None
    hf_token_file: Path | None = None
    hf_token_secret: str | None = None


@dataclass(frozen=True)
class MeshSecrets:
    """The Secrets the pods mount, by name (None: that secret is not used), and the Secret
    objects rendered from files."""

    api_keys: str | None = None
    edge_tls: str | None = None
    mesh_tls: str | None = None
    hf_token: str | None = None
    objects: list[dict] = field(default_factory=list)
    # mesh TLS: one Secret per component, `<mesh_tls>-<component>` (mesh_certs.py), instead of
    # `mesh_tls` for every process
    mesh_tls_by_component: bool = False

    def mesh_tls_env(self) -> list[dict]:
        """DISTSERVE_TLS_CERT/KEY/CA pointing into the mounted mesh TLS Secret."""
        if self.mesh_tls is None:
            return []
        folder = f"{SECRET_DIR}/mesh-tls"
        paths = ((ENV_CERT, "tls.crt"), (ENV_KEY, "tls.key"), (ENV_CA, "ca.crt"))
        return [{"name": env, "value": f"{folder}/{key}"} for env, key in paths]

    def mesh_tls_volumes(self, component: str) -> tuple[list[dict], list[dict]]:
        """(volumes, mounts) of a component's mesh TLS Secret; empty without mesh TLS."""
        if self.mesh_tls is not None and self.mesh_tls_by_component:
            return _mounted("mesh-tls", f"{self.mesh_tls}-{component}")
        return _mounted("mesh-tls", self.mesh_tls)

    def edge_tls_volumes(self) -> tuple[list[dict], list[dict]]:
        return _mounted("edge-tls", self.edge_tls)

    def api_keys_volumes(self) -> tuple[list[dict], list[dict]]:
        return _mounted("api-keys", self.api_keys)

    def hf_token_env(self) -> list[dict]:
        if self.hf_token is None:
            return []
        ref = {"secretKeyRef": {"name": self.hf_token, "key": HF_TOKEN_KEY}}
        return [{"name": "HF_TOKEN", "valueFrom": ref}]


def mesh_secrets(given: SecretFiles, namespace: str, labels: dict[str, str]) -> MeshSecrets:
    """The Secrets of `given`: files read and checked (InvalidRequest naming the flag and the
    file), names checked; a secret given both ways is refused."""
    g = given
    objects: list[dict] = []

    def one(name: str, kind: str, secret_flag: str, secret: str | None, files: dict) -> str | None:
        """files: the Secret's key -> (flag, path or None)."""
        flags = ", ".join(flag for flag, _ in files.values())
        paths = {key: (flag, path) for key, (flag, path) in files.items() if path is not None}
        if secret is not None and paths:
            raise InvalidRequest(f"give {flags} or {secret_flag}, not both")
        if secret is not None:
            if not _NAME.fullmatch(secret):
                raise InvalidRequest(f"{secret_flag} {secret!r} is not a Secret's name")
            return secret
        if not paths:
            return None
        if len(paths) != len(files):
            raise InvalidRequest(f"{flags}: give all of them (or {secret_flag})")
        data = {key: _read(path, flag) for key, (flag, path) in paths.items()}
        for key, value in data.items():
            if key.endswith((".crt", ".key")) and b"-----BEGIN" not in value:
                flag, path = paths[key]
                raise InvalidRequest(f"{flag} {path} is not PEM (no -----BEGIN line)")
        objects.append(_secret(name, kind, namespace, labels, data))
        return name

    if g.api_key_file is not None:
        _check_api_keys(g.api_key_file)
    api_keys = one(
        "distserve-api-keys", "Opaque", "--api-key-secret", g.api_key_secret,
        {API_KEYS_KEY: ("--api-key-file", g.api_key_file)},
    )  # fmt: skip
    edge_tls = one(
        "distserve-edge-tls", "kubernetes.io/tls", "--tls-secret", g.tls_secret,
        {"tls.crt": ("--tls-cert", g.tls_cert), "tls.key": ("--tls-key", g.tls_key)},
    )  # fmt: skip
    mesh_tls = one(
        "distserve-mesh-tls", "kubernetes.io/tls", "--mesh-tls-secret", g.mesh_tls_secret,
        {
            "tls.crt": ("--mesh-tls-cert", g.mesh_tls_cert),
            "tls.key": ("--mesh-tls-key", g.mesh_tls_key),
            "ca.crt": ("--mesh-tls-ca", g.mesh_tls_ca),
        },
    )  # fmt: skip
    hf_token = one(
        "distserve-hf-token", "Opaque", "--hf-token-secret", g.hf_token_secret,
        {HF_TOKEN_KEY: ("--hf-token-file", g.hf_token_file)},
    )  # fmt: skip
    return MeshSecrets(api_keys, edge_tls, mesh_tls, hf_token, objects)


def _check_api_keys(path: Path) -> None:
    """The rules Envoy's config applies (services/edge/config.py), at render time."""
    keys = read_api_keys(path)
    if not keys:
        raise InvalidRequest(f"--api-key-file {path} holds no key (one a line, # comments)")
    if any(not k.isprintable() or any(c.isspace() for c in k) for k in keys):
        raise InvalidRequest(f"--api-key-file {path}: keys are printable, without spaces")
    if len(set(keys)) != len(keys):
        raise InvalidRequest(f"--api-key-file {path}: a key is listed twice")


def _read(path: Path, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InvalidRequest(f"{flag}: cannot read the secret file {path}: {e}") from e
    if not data.strip():
        raise InvalidRequest(f"{flag}: the secret file {path} is empty")
    if flag == "--hf-token-file":
        return data.strip()  # an environment variable's value: no newline
    return data


def _secret(
    name: str, kind: str, namespace: str, labels: dict[str, str], data: dict[str, bytes]
) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "type": kind,
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }


def _mounted(volume: str, secret: str | None) -> tuple[list[dict], list[dict]]:
    if secret is None:
        return [], []
    mount = {"name": volume, "mountPath": f"{SECRET_DIR}/{volume}", "readOnly": True}
    return [{"name": volume, "secret": {"secretName": secret}}], [mount]
