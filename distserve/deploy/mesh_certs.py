"""Mesh mTLS rendered by default: a certificate per component of the mesh, signed by one CA.

Unless `--mesh-tls-secret` or `--mesh-tls-cert/key/ca` name the mesh's certificate (one for
every process, as before) or `--no-mesh-tls` turns mesh TLS off, `deploy render` makes:

- by default, a CA and one certificate per component (gateway, planner, envoy, each worker
  role), generated here with `cryptography`, as `kubernetes.io/tls` Secrets
  `distserve-mesh-tls-<component>` (tls.crt, tls.key, ca.crt) in secrets.yaml (owner-only on
  disk). The CA's private key is used to sign and then dropped: nothing can issue another mesh
  certificate later, and rendering again makes a new CA and new certificates for every
  component at once (roll the pods to pick them up: a process reads its files at start);
- with `--cert-manager`, cert-manager resources instead (mesh-certificates.yaml): a self-signed
  Issuer, the CA's Certificate, an Issuer of that CA and one Certificate per component writing
  the same Secrets, which cert-manager keeps renewed.

Each certificate's subjectAltNames are SERVER_NAME (distserve.internal: what every channel of
the mesh checks, whatever address it dialled, services/common/mesh_tls.py) and its Service's DNS
names (`distserve-<component>`, `.<namespace>`, `.svc`, `.svc.<cluster domain>`), and the
planner's also each replica's own name (`distserve-planner-<i>.distserve-planner...`), so a
client checking the name it dialled also succeeds. Every server of the mesh requires a client
certificate of the CA, so a pod holding none (any other workload) is refused at the handshake.
"""

from __future__ import annotations

import datetime
from dataclasses import replace

from distserve.deploy import objects as k8s
from distserve.deploy.options import RenderOptions
from distserve.deploy.planner import replica_hosts
from distserve.deploy.secrets import MeshSecrets
from services.common.mesh_tls import SERVER_NAME

SECRET_PREFIX = "distserve-mesh-tls"  # + "-<component>"
CA_DAYS, CERT_DAYS = 3650, 365
CA_ISSUER = "distserve-mesh-ca"


def with_mesh_certs(
    secrets: MeshSecrets, o: RenderOptions, components: list[str]
) -> tuple[MeshSecrets, list[dict]]:
    """`secrets` with the mesh's certificates: unchanged where the mesh's certificate was given
    or mesh TLS is off; else the generated per-component Secrets added (secrets.yaml), or, with
    --cert-manager, the Secrets' names and the cert-manager objects writing them."""
    if secrets.mesh_tls is not None or not o.mesh_tls:
        return secrets, []
    mine = replace(secrets, mesh_tls=SECRET_PREFIX, mesh_tls_by_component=True)
    names = {component: dns_names(component, o) for component in components}
    if o.cert_manager:
        return mine, cert_manager_objects(names, o.namespace)
    generated = generated_secrets(names, o.namespace, k8s.labels("secrets"))
    return replace(mine, objects=[*secrets.objects, *generated]), []


def secret_name(component: str) -> str:
    return f"{SECRET_PREFIX}-{component}"


def dns_names(component: str, o: RenderOptions) -> list[str]:
    """The names a component's certificate carries: SERVER_NAME and its Service's; the
    planner's also each replica's own (planner.py), the addresses the gateways dial."""
    service, ns = f"distserve-{component}", o.namespace
    names = [
        SERVER_NAME, service, f"{service}.{ns}", f"{service}.{ns}.svc",
        f"{service}.{ns}.svc.{o.cluster_domain}",
    ]  # fmt: skip
    return names + (replica_hosts(o) if component == "planner" else [])


def generated_secrets(
    names: dict[str, list[str]], namespace: str, labels: dict[str, str]
) -> list[dict]:
    """A fresh CA and one certificate per component (`names`: component -> its DNS names), as
    Secret objects (data base64)."""
    import base64

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject: str, key, issuer: x509.Name, signer, days: int, extensions):
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks a little behind
            .not_valid_after(now + datetime.timedelta(days=days))
        )
        for extension, critical in extensions:  # (x509 extension, critical)
            b = b.add_extension(extension, critical=critical)
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = f"distserve mesh CA ({namespace})"
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_subject)])
    ca = certificate(
        ca_subject, ca_key, ca_name, ca_key, CA_DAYS,
        [
            (x509.BasicConstraints(ca=True, path_length=0), True),
            (x509.KeyUsage(False, False, False, False, False, True, True, False, False), True),
        ],
    )  # fmt: skip
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    secrets = []
    for component, dns in names.items():
        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        cert = certificate(
            f"distserve-{component}", key, ca.subject, ca_key, CERT_DAYS,
            [
                (x509.SubjectAlternativeName([x509.DNSName(n) for n in dns]), False),
                (x509.BasicConstraints(ca=False, path_length=None), True),
                (x509.ExtendedKeyUsage(usages), False),
            ],
        )  # fmt: skip
        data = {
            "tls.crt": cert.public_bytes(serialization.Encoding.PEM),
            "tls.key": key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            "ca.crt": ca_pem,
        }
        secrets.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": secret_name(component), "namespace": namespace}
                | {"labels": labels},
                "type": "kubernetes.io/tls",
                "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
            }
        )
    return secrets


def cert_manager_objects(names: dict[str, list[str]], namespace: str) -> list[dict]:
    """cert-manager (cert-manager.io/v1) resources writing the same Secrets: a self-signed
    Issuer that signs the CA, the CA's Certificate, an Issuer of that CA, one Certificate per
    component (`names`: component -> its DNS names). The CA's Secret holds its key:
    cert-manager signs renewals with it."""

    def obj(kind: str, name: str, spec: dict) -> dict:
        meta = k8s.meta(name, "mesh-tls", namespace)
        return {"apiVersion": "cert-manager.io/v1", "kind": kind, "metadata": meta, "spec": spec}

    key = {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"}
    out = [
        obj("Issuer", "distserve-selfsigned", {"selfSigned": {}}),
        obj(
            "Certificate", CA_ISSUER,
            {
                "isCA": True, "commonName": f"distserve mesh CA ({namespace})",
                "secretName": CA_ISSUER, "duration": f"{CA_DAYS * 24}h", "privateKey": key,
                "issuerRef": {"name": "distserve-selfsigned", "kind": "Issuer"},
            },
        ),
        obj("Issuer", CA_ISSUER, {"ca": {"secretName": CA_ISSUER}}),
    ]  # fmt: skip
    for component, dns in names.items():
        spec = {
            "secretName": secret_name(component),
            "commonName": f"distserve-{component}",
            "dnsNames": dns,
            "duration": f"{CERT_DAYS * 24}h",
            "renewBefore": "720h",
            "usages": ["server auth", "client auth"],
            "privateKey": key,
            "issuerRef": {"name": CA_ISSUER, "kind": "Issuer"},
        }
        out.append(obj("Certificate", secret_name(component), spec))
    return out
