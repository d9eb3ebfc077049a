"""Requests that do not parse, refused as the client's fault.

gRPC turns a request whose bytes are not a message of the method's type (a client built from
another ``.proto``, a bug in a hand-written encoder, bytes cut short) into an exception of the
deserializer's: a unary call then ends with ``UNKNOWN`` and a stream's reader with the exception,
and both are logged as faults of the server's own, with a traceback. Here the deserializer gives
an :class:`Unparsed` in the message's place instead: a unary call is refused with
``INVALID_ARGUMENT`` before its method runs, and a streaming method refuses the stream when it
reads one (its reader goes on, so that what the client still sends is drained as for any other
refusal).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

_PARSE_ERROR = re.compile(r"^Error parsing message with type '([\w.]+)': (.*)$", re.DOTALL)


class Unparsed:
    """A request message that did not parse; :attr:`message` names it and why."""

    __slots__ = ("message",)

    def __init__(self, exc: DecodeError) -> None:
        text = str(exc)
        m = _PARSE_ERROR.match(text)
        self.message = f"request: not a valid {m[1]} message ({m[2]})" if m else f"request: {text}"


def parsing(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``deserializer`` giving an :class:`Unparsed` where it raises ``DecodeError``."""

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return Unparsed(exc)

    return parse


class _Captured:
    """Stands in for a server to a generated ``add_*Servicer_to_server``: keeps its handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # the same handlers come to add_registered_method_handlers

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.handlers[service] = handlers


def add_servicer(
    server: grpc.aio.Server,
    add_to_server: Callable[[Any, Any], None],
    servicer: object,
    on_unparsed: Callable[[], None] = lambda: None,
) -> None:
    """Add ``servicer`` to ``server`` as the generated ``add_to_server`` does, each method's
    requests parsed by :func:`parsing`: a unary method's call whose request does not parse ends
    with ``INVALID_ARGUMENT`` naming it (``on_unparsed`` is called first), and a streaming
    method's reader gets an :class:`Unparsed`, which it must refuse."""
    captured = _Captured()
    add_to_server(servicer, captured)
    for service, handlers in captured.handlers.items():
        wrapped = {name: _parsed(handler, on_unparsed) for name, handler in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
        server.add_registered_method_handlers(service, wrapped)


def _parsed(handler: grpc.RpcMethodHandler, on_unparsed: Callable[[], None]) -> grpc.RpcMethodHandler:
    kwargs = {
        "request_deserializer": parsing(handler.request_deserializer),
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(handler.stream_stream, **kwargs)
    if handler.request_streaming or handler.response_streaming:
        raise TypeError("only unary calls and bidirectional streams are wrapped (edgerl has no other)")
    return grpc.unary_unary_rpc_method_handler(_refusing(handler.unary_unary, on_unparsed), **kwargs)


def _refusing(
    behavior: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]],
    on_unparsed: Callable[[], None],
) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, Unparsed):
            on_unparsed()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return handle
