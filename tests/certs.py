"""Make a throwaway certificate authority and node certificates for TLS tests."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class CertificateAuthority:
    """A CA that signs certificates valid for 127.0.0.1 and localhost."""

    def __init__(self, directory: Path, name: str = "ckptd-test-ca") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca_path = directory / f"{name}.pem"
        self.ca_path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, node: str, dns_names: tuple[str, ...] = (), expired: bool = False) -> tuple[Path, Path]:
        """Return (certificate, key) files for a node, good as TLS server and client.

        The certificate names localhost and 127.0.0.1, or only dns_names when given; expired: it
        was valid for a day that ended an hour ago.
        """
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC) - (
            datetime.timedelta(days=1, hours=1) if expired else datetime.timedelta()
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(node))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName(n) for n in dns_names]
                    or [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        cert_path, key_path = self.directory / f"{node}.pem", self.directory / f"{node}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(_pem_key(key))
        key_path.chmod(0o600)
        return cert_path, key_path
