"""Named client errors, each carrying the gRPC status code that caused it."""

from __future__ import annotations

import grpc


class EdgeRLError(Exception):
    """Base of every error raised by the edgerl clients."""


class RpcError(EdgeRLError):
    """A call ended with a non-OK gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.details = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class ServerUnavailableError(RpcError):
    """The server cannot be reached or is shutting down; retry with backoff."""

    code = grpc.StatusCode.UNAVAILABLE


class InvalidArgumentError(RpcError):
    """The server refused a message as malformed; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPreconditionError(RpcError):
    """A message came out of protocol order (e.g. a step before the hello)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(RpcError):
    """The server's queue is full or a message is too large."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class AbortedError(RpcError):
    """The server ended the stream on a conflict: a newer stream took its session over."""

    code = grpc.StatusCode.ABORTED


class DeadlineExceededError(RpcError):
    """No answer within the call's deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


BROKEN_STREAM = (ServerUnavailableError, DeadlineExceededError)
"""The failures after which a client opens a new stream, on a new connection, with backoff: the
server is unreachable or going away, or an answer is overdue (a link that died without closing
its connection delivers nothing and reports nothing; a server that stalls looks the same)."""


class UnauthenticatedError(RpcError):
    """Missing or wrong credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(RpcError):
    """Valid credentials without the right to call this method."""

    code = grpc.StatusCode.PERMISSION_DENIED


class PolicyMismatchError(EdgeRLError):
    """The server serves a policy for other observations or actions than the client's, or for
    another env; retrying does not help (the message names both sides)."""


class ProtocolError(EdgeRLError):
    """The server answered something the contract does not allow (e.g. out of order)."""


_BY_CODE: dict[grpc.StatusCode, type[RpcError]] = {
    cls.code: cls
    for cls in (
        ServerUnavailableError,
        InvalidArgumentError,
        FailedPreconditionError,
        ResourceExhaustedError,
        AbortedError,
        DeadlineExceededError,
        UnauthenticatedError,
        PermissionDeniedError,
    )
}


def from_grpc(exc: grpc.RpcError) -> RpcError:
    """The named error for a gRPC failure."""
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    cls = _BY_CODE.get(code, RpcError)
    return cls(details or code.name, code)


_NOT_RPC: dict[str, type[EdgeRLError]] = {cls.__name__: cls for cls in (PolicyMismatchError, ProtocolError)}


def code_of(error: EdgeRLError) -> str:
    """What names ``error``'s kind across processes (:func:`from_code` makes it again): its gRPC
    status name, the class name of an error that has none, or empty for a plain EdgeRLError."""
    if isinstance(error, RpcError):
        name: str = error.code.name
        return name
    return type(error).__name__ if type(error).__name__ in _NOT_RPC else ""


def from_code(code_name: str, details: str) -> EdgeRLError:
    """The named error for a status code given by name (as a network process reports it).

    An empty name gives a plain :class:`EdgeRLError` (a failure with no gRPC status), the name of
    an error class without a status (:func:`code_of`) that class."""
    if not code_name:
        return EdgeRLError(details)
    if code_name in _NOT_RPC:
        return _NOT_RPC[code_name](details)
    code = grpc.StatusCode[code_name] if code_name in grpc.StatusCode.__members__ else grpc.StatusCode.UNKNOWN
    return _BY_CODE.get(code, RpcError)(details, code)


def first_line(exc: BaseException, default: str = "") -> str:
    """The first line of ``exc``'s message, for a one-line error that names it; ``default`` (else
    the exception's class name) when the message is empty."""
    return (str(exc).strip().splitlines() or [default or type(exc).__name__])[0]
