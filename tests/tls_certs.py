"""Throwaway certificates for the TLS tests: a CA, a server certificate for loopback, client ones.

Made with ``cryptography`` in a temporary folder, EC P-256 (fast to generate): nothing is
kept or shared between tests. ``TestPki.tls(...)`` gives the ``TlsSettings`` a service or a
client would read from ``CACHET_TLS_*``, ``env(...)`` the variables themselves.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cachet.tls import TlsSettings


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(folder: Path, stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    (folder / f"{stem}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


@dataclass(frozen=True)
class TestPki:
    """``ca.pem``; ``server.pem`` (loopback names, server and client use), ``client.pem``; and
    ``stranger.pem``, a client certificate signed by another CA. ``identities``: one more
    ``<name>.pem`` like ``server.pem`` each, named ``cachet <name>`` (a service's own)."""

    __test__ = False  # a helper, not a test class, despite its name
    folder: Path

    @classmethod
    def create(cls, folder: Path, identities: Sequence[str] = ()) -> TestPki:
        folder.mkdir(parents=True, exist_ok=True)
        ca_key, ca_cert = _authority("Cachet test CA")
        _write(folder, "ca", ca_key, ca_cert)
        names = [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
        ]
        both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        _write(folder, "server", *_leaf("cachet service", names, both, ca_key, ca_cert))
        for identity in identities:
            _write(folder, identity, *_leaf(f"cachet {identity}", names, both, ca_key, ca_cert))
        _write(
            folder, "client", *_leaf("cachet client", [], [ExtendedKeyUsageOID.CLIENT_AUTH], ca_key, ca_cert)
        )
        other_key, other_cert = _authority("Someone else's CA")
        _write(
            folder,
            "stranger",
            *_leaf("stranger", [], [ExtendedKeyUsageOID.CLIENT_AUTH], other_key, other_cert),
        )
        return cls(folder)

    def path(self, stem: str, suffix: str = "pem") -> Path:
        return self.folder / f"{stem}.{suffix}"

    def server(self, *, client_auth: bool = False, stem: str = "server") -> TlsSettings:
        """A service's: serves with ``stem``'s pair, calls with the CA (and the same pair)."""
        return TlsSettings(
            cert_file=self.path(stem),
            key_file=self.path(stem, "key"),
            ca_file=self.path("ca"),
            client_auth=client_auth,
        )

    def client(self, stem: str | None = "client") -> TlsSettings:
        """A caller's: verifies with the CA; presents ``stem``'s certificate (None: none)."""
        if stem is None:
            return TlsSettings(ca_file=self.path("ca"))
        return TlsSettings(
            ca_file=self.path("ca"),
            client_cert_file=self.path(stem),
            client_key_file=self.path(stem, "key"),
        )

    def env(self, *, client_auth: bool = False) -> dict[str, str]:
        """The ``CACHET_TLS_*`` variables of ``server()``."""
        return {
            "CACHET_TLS_CERT_FILE": str(self.path("server")),
            "CACHET_TLS_KEY_FILE": str(self.path("server", "key")),
            "CACHET_TLS_CA_FILE": str(self.path("ca")),
            "CACHET_TLS_CLIENT_AUTH": str(client_auth).lower(),
        }


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1)
    )


def _authority(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    return key, _validity(builder).sign(key, hashes.SHA256())


def _leaf(
    common_name: str,
    names: list[x509.GeneralName],
    usages: list[x509.ObjectIdentifier],
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, _validity(builder).sign(ca_key, hashes.SHA256())
