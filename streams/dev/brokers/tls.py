"""Certificates for the security tests: a CA, a broker certificate for 127.0.0.1 and
localhost, client certificates (one current, one expired) and a second, unrelated CA —
all PEM files, made with the `cryptography` package (a dev dependency)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


@dataclass(frozen=True)
class TlsFiles:
    ca: Path  # the CA clients trust (and the broker trusts client certificates from)
    broker_keystore: Path  # the broker's key and certificate chain, one PEM file
    client: Pem  # a client certificate the broker accepts (CN=worker)
    expired: Pem  # the same CA, expired yesterday
    other_ca: Path  # a CA nobody uses: trusting it instead is the "wrong CA"
    key_password: str  # what encrypts the client key file


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llm-streams tests"),
        ]
    )


def _ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(
    cn: str,
    ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate],
    *,
    server: bool,
    days: tuple[int, int] = (-1, 30),
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca[1].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + dt.timedelta(days=days[0]))
        .not_valid_after(now + dt.timedelta(days=days[1]))
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )  # fmt: skip
    return key, builder.sign(ca[0], hashes.SHA256())


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: ec.EllipticCurvePrivateKey, password: str | None = None) -> bytes:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password.encode())
        if password
        else serialization.NoEncryption()
    )
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             encryption)  # fmt: skip


def make_tls_files(folder: Path, key_password: str = "client-key-secret") -> TlsFiles:
    """Write the test PKI into `folder` and say where each piece is."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = _ca("llm-streams test CA")
    broker_key, broker_cert = _leaf("broker", ca, server=True)
    client_key, client_cert = _leaf("worker", ca, server=False)
    old_key, old_cert = _leaf("worker", ca, server=False, days=(-30, -1))
    _, other = _ca("some other CA")

    def write(name: str, data: bytes) -> Path:
        path = folder / name
        path.write_bytes(data)
        path.chmod(0o600)
        return path

    return TlsFiles(
        ca=write("ca.pem", _pem_cert(ca[1])),
        broker_keystore=write(
            "broker.pem", _pem_key(broker_key) + _pem_cert(broker_cert) + _pem_cert(ca[1])
        ),
        client=Pem(
            write("client.pem", _pem_cert(client_cert)),
            write("client.key", _pem_key(client_key, key_password)),
        ),
        expired=Pem(
            write("expired.pem", _pem_cert(old_cert)), write("expired.key", _pem_key(old_key))
        ),
        other_ca=write("other-ca.pem", _pem_cert(other)),
        key_password=key_password,
    )


__all__ = ["Pem", "TlsFiles", "make_tls_files"]
