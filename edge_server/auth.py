"""Who may call the edge server: TLS credentials and per-caller tokens.

Tokens come from a TOML file, one table per caller::

    [[token]]
    name = "robot-1"      # shows up in logs
    role = "robot"        # robot: EdgePolicy only; trainer: EdgePolicy and Learner
    token = "..."         # the secret, at least 16 characters (edgerl certs makes some)

Callers send ``authorization: Bearer <token>`` in the call metadata. The
server interceptor answers a missing or unknown token with UNAUTHENTICATED
and a robot calling the Learner service (reading transitions, publishing
weights) with PERMISSION_DENIED. The health and reflection services stay
open, so that load balancers and tools can probe a server they cannot drive.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import tomllib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from edgerl.proto.pem import read_pem_files

log = logging.getLogger(__name__)

ROLES = ("robot", "trainer")
TRAINER_ONLY = ("/edgerl.v1.Learner/",)
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class Caller:
    name: str
    role: str


def load_tokens(path: str | Path) -> dict[str, Caller]:
    """Read a tokens file; returns token -> caller.

    Raises:
        ValueError: the file is missing, not TOML, or an entry is incomplete or duplicated;
            the message names the entry and field.
    """
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"tokens: no file {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"tokens: {path} is not TOML: {exc}") from None
    entries = data.get("token", [])
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"tokens: {path} has no [[token]] entries")
    out: dict[str, Caller] = {}
    names: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"tokens: {path} token[{i}]"
        name, role, token = entry.get("name"), entry.get("role"), entry.get("token")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name: missing")
        if role not in ROLES:
            raise ValueError(f"{where}.role: expected one of {ROLES}, got {role!r}")
        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{where}.token: needs at least {MIN_TOKEN_CHARS} characters")
        if name in names or token in out:
            raise ValueError(f"{where}: duplicate name or token ({name!r})")
        names.add(name)
        out[token] = Caller(name, role)
    return out


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS credentials from PEM files; with ``client_ca`` clients must present a certificate it signed.

    Raises:
        ValueError: a file is missing (the message names the option).
    """
    pems = read_pem_files({"tls_cert": cert, "tls_key": key, "tls_client_ca": client_ca})
    return grpc.ssl_server_credentials(
        [(pems["tls_key"], pems["tls_cert"])],
        root_certificates=pems.get("tls_client_ca"),
        require_client_auth="tls_client_ca" in pems,
    )


def _bearer(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def _denied(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with ``code``."""

    async def abort(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(code, message)

    async def drain_then_abort(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        # Ending a client-streaming call while its first message is still being written
        # makes gRPC report INTERNAL to the client instead of this status: take it first.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await anext(aiter(requests), None)
        await context.abort(code, message)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(drain_then_abort, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(drain_then_abort, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort, **kwargs)
    return grpc.unary_unary_rpc_method_handler(abort, **kwargs)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token of every call but health and reflection (see the module doc)."""

    def __init__(self, tokens: dict[str, Caller], warn_interval_s: float = 10.0) -> None:
        if not tokens:
            raise ValueError("tokens: at least one is needed")
        self._tokens = [(t.encode(), c) for t, c in tokens.items()]
        self.rejected_unauthenticated = 0
        self.rejected_permission = 0
        self._warn_interval_s = warn_interval_s
        self._last_warning = -float("inf")

    def _lookup(self, token: str) -> Caller | None:
        given = token.encode()
        found = None
        for known, caller in self._tokens:  # compare with every token: time does not tell which matched
            if hmac.compare_digest(given, known):
                found = caller
        return found

    def _warn(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_warning >= self._warn_interval_s:
            self._last_warning = now
            log.warning(message, *args)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_METHODS):
            return handler
        token = _bearer(handler_call_details.invocation_metadata)
        caller = self._lookup(token) if token else None
        if caller is None:
            self.rejected_unauthenticated += 1
            self._warn("rejected %s: %s token", method, "unknown" if token else "no")
            return _denied(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method}: {'unknown' if token else 'missing'} token; "
                "send metadata 'authorization: Bearer <token>'",
            )
        if method.startswith(TRAINER_ONLY) and caller.role != "trainer":
            self.rejected_permission += 1
            self._warn("rejected %s from %s (role %s)", method, caller.name, caller.role)
            return _denied(
                handler,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method}: caller {caller.name!r} has role {caller.role!r}; only a trainer may call it",
            )
        return handler
