"""Throwaway PKIs for TLS tests: a CA, a server certificate for 127.0.0.1 and localhost, a client certificate, and a
second CA that signed neither (`cryptography`, the dev extra)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ONE_DAY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA that signed server and client
    server: Issued  # SANs 127.0.0.1, ::1 and localhost
    client: Issued  # clientAuth, signed by `ca`
    other_ca: Path  # a CA that signed nothing here
    other_client: Issued  # clientAuth, signed by `other_ca`


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - ONE_DAY).not_valid_after(now + ONE_DAY))


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@dataclass(frozen=True)
class Authority:
    name: x509.Name
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, common_name: str) -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (_builder(common_name, _name(common_name), key)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(_name(common_name), key, cert)

    def issue(self, folder: Path, stem: str, *, server: bool) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = _builder(stem, self.name, key).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("::1")),
                x509.DNSName("localhost"),
            ]), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return Issued(_write_cert(folder / f"{stem}.pem", cert), _write_key(folder / f"{stem}.key", key))


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca, other = Authority.create("genserve test CA"), Authority.create("another CA")
    return Pki(
        ca=_write_cert(folder / "ca.pem", ca.cert),
        server=ca.issue(folder, "server", server=True),
        client=ca.issue(folder, "client", server=False),
        other_ca=_write_cert(folder / "other-ca.pem", other.cert),
        other_client=other.issue(folder, "other-client", server=False),
    )
