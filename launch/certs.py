"""``edgerl certs``: a private CA, server and client certificates and tokens for a test deployment.

Real deployments use their own PKI; this makes the files that ``edgerl serve
--tls-cert ... --tokens ...`` and the clients take, so TLS, mutual TLS and
tokens can be tried (and are tested) on one machine.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class DevPki:
    """Paths of the files :func:`make_dev_pki` wrote."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    tokens: Path
    robot_token: str
    trainer_token: str


def new_token() -> str:
    """A random caller token (32 URL-safe characters, ~192 bits) that never starts with "-": given on
    a command line (``--token TOKEN``), such a token would be read as an option (1 in 64 did)."""
    while True:
        token = secrets.token_urlsafe(24)
        if not token.startswith("-"):
            return token


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    hosts: tuple[str, ...] = (),
    usage: x509.ObjectIdentifier | None = None,
    days: int = 365,
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if hosts:
        sans: list[x509.GeneralName] = []
        for h in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_dev_pki(out: str | Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> DevPki:
    """Write ``ca.pem``, ``server.pem``/``.key``, ``client.pem``/``.key`` and ``tokens.toml`` into ``out``."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_cert = _cert("edgerl test CA", ca_key, None, ca_key, ca=True)
    paths = {}
    for role, usage, sans in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH, hosts),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH, ()),
    ):
        key = _key()
        cert = _cert(f"edgerl {role}", key, ca_cert.subject, ca_key, hosts=sans, usage=usage)
        (d / f"{role}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, d / f"{role}.key")
        paths[role] = (d / f"{role}.pem", d / f"{role}.key")
    (d / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    robot, trainer = new_token(), new_token()
    tokens = d / "tokens.toml"
    tokens.write_text(
        "# Caller tokens of the edge server (edgerl serve --tokens). Keep this file secret.\n"
        f'[[token]]\nname = "robot-1"\nrole = "robot"\ntoken = "{robot}"\n\n'
        f'[[token]]\nname = "trainer"\nrole = "trainer"\ntoken = "{trainer}"\n'
    )
    tokens.chmod(0o600)
    return DevPki(d / "ca.pem", *paths["server"], *paths["client"], tokens, robot, trainer)
