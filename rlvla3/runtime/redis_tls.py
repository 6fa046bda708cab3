"""The TLS identity of a multi-host run's Redis, derived from the run secret.

The head's redis-server serves TLS with a self-signed Ed25519 certificate whose private key is
``derive(secret, "rlvla3 redis tls")``. Ed25519 signs deterministically and every other field
of the certificate is fixed, so every holder of the secret builds the very same certificate:
a member pins it (it is the only CA its client trusts) without any file to share. The TLS
handshake then is the challenge only the head can answer: the server proves it holds the
certificate's private key, which only the secret gives, before the member sends AUTH or any
command. A squatter on the port, or a man in the middle, fails the handshake and gets
nothing but a ClientHello.

Made with the ``cryptography`` package (no ``openssl`` CLI run, no file left behind but the
head's 0600 key file).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import NameOID

from transport.derived_keys import derive

_LABEL = b"rlvla3 redis tls"
_NAME = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlvla3 run redis")])
_NOT_BEFORE = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)
_NOT_AFTER = datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC)  # the secret ends it, not a date


@dataclass(frozen=True, slots=True)
class RedisTlsIdentity:
    """The run Redis's certificate and key, PEM-encoded."""

    cert_pem: str
    """The self-signed certificate: the server presents it, clients trust only it."""
    key_pem: str
    """Its private key (PKCS#8): the head's redis-server alone reads it (a 0600 file)."""


def redis_tls_identity(secret: str) -> RedisTlsIdentity:
    """The certificate and key every holder of ``secret`` derives alike."""
    key = ed25519.Ed25519PrivateKey.from_private_bytes(derive(secret, _LABEL))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_NAME)
        .issuer_name(_NAME)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(_NOT_BEFORE)
        .not_valid_after(_NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, None)
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return RedisTlsIdentity(
        cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem.decode()
    )
