"""The edge server's counters for Prometheus: ``GET /metrics`` over HTTP.

With ``ServerConfig.metrics_port`` (``edgerl serve --metrics-port PORT``)
the server also answers ``GET /metrics`` on that port
of ``metrics_host`` (its gRPC host by default), in
Prometheus's text format (version 0.0.4), for Prometheus, Grafana Agent,
the OpenTelemetry collector or ``curl`` to scrape. The values are those of
the ``Stats`` RPC (:meth:`EdgePolicyServicer.stats`), read when a scrape
comes, on the server's event loop: the step path does no work for them, and
the two cannot disagree. Each field of ``StatsResponse`` is a sample of a
family (:data:`FAMILIES`; a test fails where a field has none): counters
end in ``_total``, times are in seconds, and the queue wait and forward time
are summaries: the percentiles of the recent window (the last 8,192 requests
or batches) labelled ``quantile``, with the ``_sum`` and ``_count`` of all
since start, whose rates give the mean over any interval and add up across
servers. The learner's counters appear only where the server serves the
Learner service.
``edgerl_server_info`` carries the server's version, env and backend as
labels. ``edgerl train`` and ``rollout --metrics-port PORT`` answer their
scrapes in their own process: this exposition, fetched from their server's
endpoint on loopback, then their own figures (:mod:`edgerl.launch.run_metrics`).

The endpoint is plain HTTP (on loopback by default),
without TLS or tokens: counters only, no observations or weights. One
connection is one request (``Connection: close``); a request line and
headers over 8 KB get 431, a method other than GET or HEAD 405, a path other
than ``/metrics`` 404, each naming what to send instead, and the server
serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from edgerl.proto.v1 import edge_pb2 as pb

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus's text exposition format."""
MAX_HEAD_BYTES = 8192
"""Largest request line and headers read; beyond it the request gets 431."""
READ_TIMEOUT_S = 10.0
"""How long a connection may take to send its request line and headers (seconds)."""


class Sample(NamedTuple):
    """One line of a family: a ``StatsResponse`` field's value under the family's name."""

    field: str
    suffix: str = ""
    """After the family's name: ``_sum`` or ``_count`` of a summary, else nothing."""
    quantile: str = ""
    """The ``quantile`` label of a summary's percentile; "" for none."""

    @property
    def scale(self) -> float:
        """What the field's value is multiplied by: microseconds become seconds."""
        return 1e-6 if "_us_" in self.field or self.field.endswith("_us") else 1.0

    def value_in(self, stats: pb.StatsResponse) -> float:
        """The field's value in ``stats``, scaled (an integer where it is not)."""
        value = getattr(stats, self.field)
        return value * self.scale if self.scale != 1.0 else int(value)


@dataclass(frozen=True)
class Family:
    """One metric family and the ``StatsResponse`` fields it is made of."""

    name: str
    kind: str
    """``counter``, ``gauge`` or ``summary``."""
    help: str
    samples: tuple[Sample, ...]
    learner: bool = False
    """Only where the server serves the Learner service."""


def _one(name: str, kind: str, help: str, field: str, *, learner: bool = False) -> Family:
    return Family(name, kind, help, (Sample(field),), learner)


def _summary(name: str, help: str, times: str, count: str) -> Family:
    """A summary of the ``times`` fields (``_p50``, ``_p99``, ``_sum``, in us) over ``count``."""
    samples = (
        Sample(f"{times}_p50", quantile="0.5"),
        Sample(f"{times}_p99", quantile="0.99"),
        Sample(f"{times}_sum", "_sum"),
        Sample(count, "_count"),
    )
    return Family(name, "summary", help, samples)


FAMILIES: tuple[Family, ...] = (
    _one(
        "edgerl_requests_total",
        "counter",
        "Step requests answered (stream messages and unary calls).",
        "requests",
    ),
    _one("edgerl_batches_total", "counter", "Forward passes run.", "batches"),
    _one("edgerl_rows_total", "counter", "Observation rows served.", "rows"),
    _one("edgerl_max_batch_rows", "gauge", "Largest batch so far (rows).", "max_batch_rows"),
    _one(
        "edgerl_rejected_queue_full_total",
        "counter",
        "Requests refused with RESOURCE_EXHAUSTED because the queue was full.",
        "rejected_queue_full",
    ),
    _one(
        "edgerl_rejected_invalid_total",
        "counter",
        "Requests or streams refused as invalid.",
        "rejected_invalid",
    ),
    _one(
        "edgerl_rejected_streams_total",
        "counter",
        "Streams refused because max_streams streams were open, or had sent no message yet.",
        "rejected_streams",
    ),
    _one(
        "edgerl_failed_requests_total",
        "counter",
        "Step requests answered with INTERNAL: the forward pass raised, or gave NaN or Inf for them.",
        "failed_requests",
    ),
    _one("edgerl_active_streams", "gauge", "Act streams now open.", "active_streams"),
    _one(
        "edgerl_streams_awaiting_hello",
        "gauge",
        "Act streams open that have not sent their first message yet.",
        "streams_awaiting_hello",
    ),
    _summary(
        "edgerl_queue_wait_seconds",
        "Queue wait of the requests answered: quantiles of the last 8192, sum and count of all.",
        "queue_wait_us",
        "requests",
    ),
    _summary(
        "edgerl_inference_seconds",
        "Forward time of the batches run: quantiles of the last 8192, sum and count of all.",
        "inference_us",
        "batches",
    ),
    _one("edgerl_policy_version", "gauge", "Version of the weights now served.", "policy_version"),
    _one(
        "edgerl_transitions_total",
        "counter",
        "Transitions completed (env steps with their reward known).",
        "transitions",
        learner=True,
    ),
    _one(
        "edgerl_segments_acked_total",
        "counter",
        "Segments handed to the trainer and acknowledged by it.",
        "segments_acked",
        learner=True,
    ),
    _one(
        "edgerl_transitions_pending",
        "gauge",
        "Env steps not yet acknowledged by the trainer (queued or in flight).",
        "transitions_pending",
        learner=True,
    ),
    _one(
        "edgerl_transitions_dropped_overflow_total",
        "counter",
        "Transitions dropped because the outgoing buffer was full (overflow drop).",
        "transitions_dropped_overflow",
        learner=True,
    ),
    _one(
        "edgerl_transitions_dropped_disconnect_total",
        "counter",
        "Half-built transitions dropped because their stream ended before the reward arrived.",
        "transitions_dropped_disconnect",
        learner=True,
    ),
    _one(
        "edgerl_backpressure_wait_seconds_total",
        "counter",
        "Time step requests waited for room in the outgoing buffer.",
        "backpressure_wait_us",
        learner=True,
    ),
    _one(
        "edgerl_weight_publishes_total",
        "counter",
        "Weight publishes applied.",
        "weight_publishes",
        learner=True,
    ),
    _one(
        "edgerl_sessions_forgotten_total",
        "counter",
        "Closed sessions whose env counters were let go.",
        "sessions_forgotten",
        learner=True,
    ),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(value: float) -> str:
    if isinstance(value, bool | int):
        return str(int(value))
    return "NaN" if math.isnan(value) else repr(float(value))


def family_lines(
    name: str, kind: str, help: str, samples: Iterable[tuple[str, dict[str, str], float]]
) -> list[str]:
    """One family in Prometheus's text format: its HELP and TYPE, then a line for each sample of
    (suffix after ``name``, labels, value); a value of NaN is written as Prometheus reads it."""
    lines = [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
    for suffix, labels, value in samples:
        shown = "{" + ",".join(f'{k}="{_label(v)}"' for k, v in labels.items()) + "}" if labels else ""
        lines.append(f"{name}{suffix}{shown} {_value(value)}")
    return lines


def exposition(stats: pb.StatsResponse, *, learner: bool, info: dict[str, str]) -> str:
    """``stats`` in Prometheus's text format, with ``edgerl_server_info`` labelled by ``info``;
    the learner's families only with ``learner``."""
    lines = family_lines(
        "edgerl_server_info", "gauge", "The edge server: its version, env and backend.", [("", info, 1)]
    )
    for fam in FAMILIES:
        if not fam.learner or learner:
            lines += family_lines(
                fam.name,
                fam.kind,
                fam.help,
                [
                    (s.suffix, {"quantile": s.quantile} if s.quantile else {}, s.value_in(stats))
                    for s in fam.samples
                ],
            )
    return "\n".join(lines) + "\n"


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def url_of(host: str, port: int) -> str:
    """``http://HOST:PORT/metrics``, an IPv6 host in brackets."""
    return f"http://{host_port(host, port)}/metrics"


class MetricsBindError(OSError):
    """The metrics port could not be bound; the message says why, in words for the operator."""


class MetricsServer:
    """``GET /metrics`` on ``host:port`` (0: a free port) over HTTP, on the event loop it is started
    on; ``render`` makes the body. ``host_option`` is the option that sets ``host``, for errors."""

    def __init__(self, render: Callable[[], str], host: str, port: int, host_option: str = "--host") -> None:
        self.render = render
        self.host, self.asked, self.host_option = host, port, host_option
        self.port = 0
        """The bound port; 0 until :meth:`start`."""
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics``, once bound."""
        return url_of(self.host, self.port)

    async def start(self) -> int:
        """Bind (a free port on the first address ``host`` resolves to, where asked for 0) and
        start answering; returns the port.

        Raises:
            MetricsBindError: the port is in use, or ``host`` is not an address of this machine.
        """
        host = self.host.strip("[]")  # an IPv6 host as gRPC takes it
        try:
            if self.asked == 0:  # one socket, or each address of a name would get a port of its own
                info = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
                host = str(info[0][4][0])
            self._server = await asyncio.start_server(self._handle, host, self.asked, limit=MAX_HEAD_BYTES)
        except OSError as exc:
            why = {
                errno.EADDRINUSE: "the port is in use (--metrics-port 0 picks a free one)",
                errno.EADDRNOTAVAIL: f"{self.host} is not an address of this machine ({self.host_option})",
            }.get(exc.errno or 0, str(exc.strerror or exc))
            raise MetricsBindError(
                f"could not bind the metrics port {host_port(self.host, self.asked)}: {why}"
            ) from exc
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop accepting, end the connections being answered, and release the port."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            reply = await self._answer(reader)
            if reply is not None:
                data = reply.body.encode()
                head = f"HTTP/1.1 {reply.status} {_REASONS[reply.status]}\r\n" + "".join(
                    f"{k}: {v}\r\n" for k, v in reply.headers
                )
                head += f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                writer.write(head.encode() + (b"" if reply.head_only else data))
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> _Reply | None:
        """The reply to the request on ``reader``; None: send nothing (the client went away, or
        took longer than ``READ_TIMEOUT_S``)."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        except asyncio.LimitOverrunError:
            return _text(431, f"request line and headers over {MAX_HEAD_BYTES} bytes")
        except (asyncio.IncompleteReadError, TimeoutError):
            return None
        return self._route(head.split(b"\r\n", 1)[0].decode("latin-1"))

    def _route(self, request_line: str) -> _Reply:
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _text(400, "request line: expected 'GET /metrics HTTP/1.1'")
        method, target = parts[0], parts[1].split("?", 1)[0]
        head_only = method == "HEAD"
        if method not in ("GET", "HEAD"):
            return _text(405, f"method {method}: only GET and HEAD", allow="GET, HEAD")
        if target != "/metrics":
            return _text(404, f"no {target} here: the metrics are at /metrics", head_only)
        try:
            body = self.render()
        except Exception as exc:  # a fault of the server's own: this scrape fails, the server serves on
            log.exception("metrics: rendering failed")
            return _text(500, f"rendering the metrics failed: {type(exc).__name__}: {exc}", head_only)
        return _Reply(200, [("Content-Type", CONTENT_TYPE)], body, head_only)


class MetricsThread:
    """A :class:`MetricsServer` on an event loop of its own, in a thread: for a process whose own
    loop is not asyncio's (``edgerl robot``). ``render`` is called on that thread."""

    def __init__(self, server: MetricsServer) -> None:
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="edgerl-metrics", daemon=True)

    def start(self) -> int:
        """As :meth:`MetricsServer.start`; on an error the thread is stopped again."""
        self._thread.start()
        try:
            return asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(30)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the port and end the thread."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.close(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
        self._loop.close()


class _Reply(NamedTuple):
    status: int
    headers: list[tuple[str, str]]
    body: str
    head_only: bool
    """HEAD: the status and headers alone."""


def _text(status: int, message: str, head_only: bool = False, allow: str = "") -> _Reply:
    headers = [("Content-Type", "text/plain; charset=utf-8")] + ([("Allow", allow)] if allow else [])
    return _Reply(status, headers, message + "\n", head_only)
