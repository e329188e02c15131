"""A self-signed certificate for localhost / 127.0.0.1, made in the test (cryptography)."""

from __future__ import annotations

import datetime
import ipaddress


def self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def mesh_pki(tmp_path, name: str = "mesh") -> tuple:
    """A CA and one certificate it signed for the mesh's own services (subjectAltName
    distserve.internal, services.common.mesh_tls.SERVER_NAME); (cert, key, CA) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def build(subject, issuer, public_key, signer, extensions):
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for ext, critical in extensions:
            b = b.add_extension(ext, critical=critical)
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca = build(
        ca_name, ca_name, ca_key.public_key(), ca_key,
        [(x509.BasicConstraints(ca=True, path_length=0), True)],
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = build(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} service")]),
        ca_name,
        key.public_key(),
        ca_key,
        [
            (x509.SubjectAlternativeName([x509.DNSName("distserve.internal")]), False),
            (x509.BasicConstraints(ca=False, path_length=None), True),
        ],
    )
    folder = tmp_path / name
    folder.mkdir()
    paths = folder / "cert.pem", folder / "key.pem", folder / "ca.pem"
    paths[0].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    paths[2].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return paths
