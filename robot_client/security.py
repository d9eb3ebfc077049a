"""Client credentials: TLS (server verification, optional client certificate) and a bearer token.

Every edgerl client (robots, sim workers, the trainer) opens its channel with
:func:`open_channel` and sends :meth:`ClientSecurity.metadata` with each call.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import grpc

from edgerl.proto.pem import read_pem_files

log = logging.getLogger(__name__)

TOKEN_ENV = "EDGERL_TOKEN"
"""Environment variable the command line reads a token from when none is given."""

_LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")
"""gRPC's target schemes: an address with one goes to gRPC as it is."""


def check_target(target: str, name: str = "server") -> None:
    """Refuse a server address that no server can have: an empty one, a URL
    (``http://host:port``), or a ``host:port`` whose port is not a number in [1, 65535]. A client
    would otherwise retry it for good, as if the server were down. An address without a port
    (gRPC's default, 443), a bare IPv6 address, or one with a gRPC scheme (``dns:``, ``unix:``,
    ``ipv4:`` ...) goes to gRPC as it is.

    Raises:
        ValueError: naming the setting ``name``.
    """
    if not target:
        raise ValueError(f"{name}: no address; expected host:port")
    host, colon, port = target.rpartition(":")
    ipv6_without_port = (":" in host and not host.startswith("[")) or target.endswith("]")
    if target.startswith(_SCHEMES):
        return
    scheme, slashes, _ = target.partition("://")
    if slashes:  # gRPC would resolve the whole URL as a host name, and retry it for good
        raise ValueError(
            f"{name}: {target!r} is a URL; expected host:port (gRPC takes no {scheme}:// scheme)"
        )
    if not colon or ipv6_without_port:
        return
    if not host:
        raise ValueError(f"{name}: {target!r} has no host; expected host:port")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{name}: the port of {target!r} is not a number in [1, 65535]")


@dataclass(frozen=True)
class ClientSecurity:
    """How a client proves who it is and checks who the server is."""

    ca: str = ""
    """PEM CA bundle that signed the server's certificate; set it to use TLS."""
    cert: str = ""
    """PEM client certificate chain, for servers that require mutual TLS."""
    key: str = ""
    """PEM private key of ``cert``."""
    token: str = ""
    """Bearer token sent as ``authorization`` metadata with every call."""
    server_name: str = ""
    """Name to check the server certificate against, when it differs from the address host."""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            given = "cert" if self.cert else "key"
            raise ValueError(f"tls cert and key go together (--tls-cert, --tls-key), got only the {given}")
        if self.cert and not self.ca:
            raise ValueError("a client certificate (mutual TLS) needs the server's CA (ca, --tls-ca) as well")

    @property
    def tls(self) -> bool:
        return bool(self.ca)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials from the PEM files.

        Raises:
            ValueError: a file is missing (the message names the field).
        """
        pems = read_pem_files({"ca": self.ca, "cert": self.cert, "key": self.key}, label="tls {}")
        return grpc.ssl_channel_credentials(
            root_certificates=pems.get("ca"), private_key=pems.get("key"), certificate_chain=pems.get("cert")
        )


def with_env_token(security: ClientSecurity | None) -> ClientSecurity | None:
    """``security`` with the token from ``$EDGERL_TOKEN`` when it has none."""
    token = os.environ.get(TOKEN_ENV, "")
    if not token or (security is not None and security.token):
        return security
    base = security or ClientSecurity()
    return ClientSecurity(base.ca, base.cert, base.key, token, base.server_name)


def open_channel(
    target: str, security: ClientSecurity | None, options: list[tuple[str, Any]], *, aio: bool
) -> Any:
    """A plaintext or TLS channel to ``target`` (``grpc.aio`` when ``aio``).

    Raises:
        ValueError: ``target`` is no address a server can have (:func:`check_target`).
    """
    check_target(target)
    sec = security or ClientSecurity()
    if not sec.tls:
        if sec.token and not target.startswith(_LOOPBACK):
            log.warning("sending a token to %s without TLS: anyone on the path can read it", target)
        return (
            grpc.aio.insecure_channel(target, options=options)
            if aio
            else grpc.insecure_channel(target, options)
        )
    opts = list(options)
    if sec.server_name:
        opts.append(("grpc.ssl_target_name_override", sec.server_name))
    creds = sec.channel_credentials()
    return (
        grpc.aio.secure_channel(target, creds, options=opts)
        if aio
        else grpc.secure_channel(target, creds, opts)
    )
