"""Assembling and running the edge server (grpc.aio, one process)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from edgerl.edge_server.auth import TokenAuthInterceptor, load_tokens, server_credentials
from edgerl.edge_server.backend import PolicyBackend, publish_limit, weights_limit
from edgerl.edge_server.batcher import DynamicBatcher
from edgerl.edge_server.learner import LearnerServicer
from edgerl.edge_server.local import LocalActServer
from edgerl.edge_server.metrics import MetricsBindError, MetricsServer, exposition, host_port
from edgerl.edge_server.parsing import add_servicer
from edgerl.edge_server.service import EdgePolicyServicer
from edgerl.edge_server.transitions import TransitionConfig, TransitionStore
from edgerl.proto.keepalive import check_keepalive, keepalive_options
from edgerl.proto.settings import (
    UINT64_MAX,
    check_finite,
    check_message_bytes,
    check_socket_path,
    check_wire_int,
)
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.proto.v1 import edge_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EdgePolicy"].full_name
LEARNER_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Learner"].full_name
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True)
class ServerConfig:
    """Edge server settings."""

    host: str = "127.0.0.1"
    """Address to bind. Loopback by default; use 0.0.0.0 to accept remote clients."""
    port: int = 50051
    """TCP port; 0 picks a free one (read it back from ``EdgeServer.port``)."""
    max_batch_size: int = 256
    """Most observation rows in one forward pass."""
    max_delay_us: int = 1000
    """Longest the oldest queued request waits for a fuller batch (microseconds)."""
    max_queue_rows: int = 4096
    """Most observation rows waiting at once; a request beyond it gets RESOURCE_EXHAUSTED."""
    max_message_bytes: int = 4 * 1024 * 1024
    """Largest message accepted or sent (bytes); beyond it RESOURCE_EXHAUSTED. A trainer's
    ``PublishWeights`` may be larger: it takes the served weights as FLOAT64
    (:func:`~edgerl.edge_server.backend.publish_limit`), and in parts
    (``PublishWeightsStream``) past gRPC's 2 GiB."""
    max_envs_per_stream: int = 1024
    """Most envs one stream may declare."""
    max_streams: int = 1024
    """Most Act streams open at once, over gRPC and the local socket together, counted from a
    stream's hello to its end. Each holds its envs' state (with the learner, ~1 MB for 256 envs
    three steps in), so a client that opens streams without end (a reconnect loop that never
    closes the old ones, say) would otherwise grow the server until the system kills it, and
    every client with it. A hello beyond the limit gets UNAVAILABLE, which every edgerl client
    retries with backoff, unless it takes over a session that has one stream open: a client that
    reconnects before the server saw its old stream end is let in. As many gRPC Act streams that
    have sent no message yet may wait at once (~26 KB each); one beyond them gets UNAVAILABLE at
    its start."""
    hello_timeout_s: float = 10.0
    """How long an Act stream may go without its hello, from its start (seconds); then it is
    refused with DEADLINE_EXCEEDED. edgerl's clients send the hello as they open a stream; a
    call that never sends one is not among the open streams ``max_streams`` counts (it is among
    those waiting, which it also bounds) and would hold its handler for good. 0: no limit."""
    grace_s: float = 5.0
    """On shutdown, how long the batches in flight may take, and then how long the streams may
    take to write their last answers before they are cancelled (seconds). Requests that no batch
    took by the first end get UNAVAILABLE (see ``EdgeServer.stop``)."""
    keepalive_s: float = 30.0
    """Ping a connection with a call open that has sent nothing for this long (seconds); 0: off.
    A client whose link died without closing it (power cut, cable pulled, out of Wi-Fi range)
    sends nothing and answers no ping: its connection is closed ``keepalive_timeout_s`` later and
    its streams end, where the system's TCP timeout would take hours. A robot that comes back
    opens a new stream, which takes over its session either way."""
    keepalive_timeout_s: float = 10.0
    """How long a keepalive ping may go unanswered before the connection is closed (seconds)."""
    learner: TransitionConfig | None = None
    """Serve the Learner service (transitions out, weights in) with these settings; None: off."""
    tls_cert: str = ""
    """PEM certificate chain of the server; with tls_key, serve TLS instead of plaintext."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    tls_client_ca: str = ""
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."""
    tokens: str = ""
    """TOML file of caller tokens (see edgerl.edge_server.auth); when set, every call needs one."""
    local_socket: str = ""
    """Path of a Unix socket that serves the Act stream without gRPC to clients on this machine
    (see edgerl.edge_server.local); empty: none."""
    metrics_port: int | None = None
    """Port on ``metrics_host`` where ``GET /metrics`` gives the ``Stats`` counters in
    Prometheus's text format (see edgerl.edge_server.metrics); 0 picks a free one (read it back
    from ``EdgeServer.metrics_port``); None: none."""
    metrics_host: str = ""
    """Address the metrics port binds; empty: ``host``. The gRPC port may face the robots' network
    (with TLS) while the counters stay on loopback, or the other way round."""

    def __post_init__(self) -> None:
        check_finite(self)
        for name in ("max_batch_size", "max_envs_per_stream", "max_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_batch_size", "max_queue_rows", "max_envs_per_stream", "max_streams"):
            check_wire_int(name, getattr(self, name))  # ServerLimits carries them
        check_wire_int("max_delay_us", self.max_delay_us, UINT64_MAX)
        for name in ("port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if self.metrics_port == self.port != 0:
            raise ValueError(
                f"metrics_port and port are both {self.port}: the metrics need a port of their own"
            )
        if self.metrics_host and self.metrics_port is None:
            raise ValueError(
                f"metrics_host is {self.metrics_host!r} but metrics_port is None: no metrics to bind"
            )
        if self.max_delay_us < 0:
            raise ValueError(f"max_delay_us must be >= 0, got {self.max_delay_us}")
        if self.max_queue_rows < self.max_batch_size:
            raise ValueError(
                f"max_queue_rows ({self.max_queue_rows}) must be >= max_batch_size ({self.max_batch_size})"
            )
        check_message_bytes(self.max_message_bytes)
        if self.hello_timeout_s < 0:
            raise ValueError(f"hello_timeout_s must be >= 0, got {self.hello_timeout_s}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        check_keepalive(self.keepalive_s, self.keepalive_timeout_s, off=True)
        if bool(self.tls_cert) != bool(self.tls_key):
            given = "tls_cert" if self.tls_cert else "tls_key"
            raise ValueError(f"tls_cert and tls_key go together (--tls-cert, --tls-key), got only {given}")
        check_socket_path("local_socket", self.local_socket)
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)


def package_version() -> str:
    try:
        return metadata.version("edgerl")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class BindError(OSError):
    """The edge server could not bind its port or its local Act socket; nothing was served."""


class EdgeServer:
    """A running edge server: EdgePolicy, health and reflection on one port."""

    def __init__(
        self,
        backend: PolicyBackend,
        config: ServerConfig | None = None,
        *,
        env_name: str = "",
        obs_low: np.ndarray | None = None,
        obs_high: np.ndarray | None = None,
    ) -> None:
        self.config = cfg = config or ServerConfig()
        if cfg.learner is not None and backend.chunk > 1:
            raise ValueError("learner: the trainer takes one action per transition; serve chunk=1 to train")
        self.backend = backend
        self.batcher = DynamicBatcher(
            backend,
            max_batch_size=cfg.max_batch_size,
            max_delay_us=cfg.max_delay_us,
            max_queue_rows=cfg.max_queue_rows,
        )
        limits = pb.ServerLimits(
            max_batch_size=cfg.max_batch_size,
            max_delay_us=cfg.max_delay_us,
            max_queue_rows=cfg.max_queue_rows,
            max_message_bytes=cfg.max_message_bytes,
            max_envs_per_stream=cfg.max_envs_per_stream,
            max_streams=cfg.max_streams,
            sync_env_steps=cfg.learner.sync_env_steps if cfg.learner else 0,
        )
        self.store = TransitionStore(cfg.learner, backend.obs_shape) if cfg.learner else None
        self.learner = (
            LearnerServicer(self.store, self.batcher, backend, max_message_bytes=cfg.max_message_bytes)
            if self.store is not None
            else None
        )
        self.servicer = EdgePolicyServicer(
            self.batcher,
            backend,
            env_name=env_name,
            limits=limits,
            obs_low=obs_low,
            obs_high=obs_high,
            server_version=package_version(),
            store=self.store,
            hello_timeout_s=cfg.hello_timeout_s,
        )
        self.auth = TokenAuthInterceptor(load_tokens(cfg.tokens)) if cfg.tokens else None
        self.health = health.aio.HealthServicer()
        self.local = (
            LocalActServer(self.servicer, cfg.local_socket, cfg.max_message_bytes)
            if cfg.local_socket
            else None
        )
        self.metrics = (
            MetricsServer(
                self.metrics_text,
                cfg.metrics_host or cfg.host,
                cfg.metrics_port,
                "--metrics-host" if cfg.metrics_host else "--host",
            )
            if cfg.metrics_port is not None
            else None
        )
        self._server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return host_port(self.config.host, self.port)

    @property
    def metrics_port(self) -> int:
        """The bound port of ``GET /metrics``; 0 where there is none or it is not bound yet."""
        return self.metrics.port if self.metrics is not None else 0

    @property
    def metrics_url(self) -> str:
        """``http://HOST:PORT/metrics``; empty where there is no metrics endpoint."""
        return self.metrics.url if self.metrics is not None else ""

    def metrics_text(self) -> str:
        """The ``Stats`` counters in Prometheus's text format, as ``GET /metrics`` gives them."""
        info = {
            "version": self.servicer.server_version,
            "env": self.servicer.env_name,
            "backend": self.backend.name,
        }
        return exposition(self.servicer.stats(), learner=self.store is not None, info=info)

    async def start(self) -> int:
        """Bind, start serving, return the bound port.

        Raises:
            BindError: the port or the local Act socket could not be bound; the server then
                holds neither and its inference threads are stopped.
        """
        cfg = self.config
        if cfg.host not in LOOPBACK_HOSTS and not cfg.tls:
            log.warning(
                "binding %s without TLS: anyone who can reach this address can %s",
                cfg.host,
                "read the traffic" if self.auth else "drive the policy",
            )
        await self.batcher.run_between_batches(self.backend.warmup)  # on the inference thread
        self.batcher.start()
        receive = cfg.max_message_bytes
        if self.learner:  # (a replicated backend knows its weights once its replicas started)
            receive = publish_limit(self.backend.weights_values, cfg.max_message_bytes)
            self.servicer.limits.max_weights_bytes = weights_limit(self.backend.weights_values)
        # every method but PublishWeights checks max_message_bytes as it parses, where gRPC's
        # limit is raised for weights (else gRPC's own check is the same, and costs nothing more)
        limit = (cfg.max_message_bytes, "max_message_bytes") if receive > cfg.max_message_bytes else None
        options = [
            ("grpc.max_receive_message_length", receive),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # Clients may ping as often as twice a second while neither side sends data (a
            # trainer's channel does, to learn of a dead link): gRPC's default, 5 minutes,
            # would end such a connection with GOAWAY ("too_many_pings") after three pings.
            ("grpc.http2.min_ping_interval_without_data_ms", 500),
        ]
        if cfg.keepalive_s > 0:
            options += keepalive_options(cfg.keepalive_s, cfg.keepalive_timeout_s)
        server = grpc.aio.server(options=options, interceptors=[self.auth] if self.auth else None)
        add_servicer(
            server,
            pb_grpc.add_EdgePolicyServicer_to_server,
            self.servicer,
            self.servicer.count_invalid,
            limit=limit,
        )
        services = [SERVICE_NAME]
        if self.learner is not None:
            add_servicer(
                server,
                pb_grpc.add_LearnerServicer_to_server,
                self.learner,
                limit=limit,
                # gRPC's, the largest of them (and a publish in parts counts its layout's bytes)
                limit_of={"PublishWeights": None, "PublishWeightsStream": None},
            )
            services.append(LEARNER_SERVICE_NAME)
        add_servicer(
            server,
            health_pb2_grpc.add_HealthServicer_to_server,
            self.health,
            refused_on_read=True,
            limit=limit,
        )
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        add_servicer(  # as reflection.enable_server_reflection does, with requests that do not parse refused
            server,
            reflection_pb2_grpc.add_ServerReflectionServicer_to_server,
            reflection.aio.ReflectionServicer([*services, health_name, reflection.SERVICE_NAME]),
            refused_on_read=True,
            limit=limit,
        )
        try:
            if self.local is not None:
                try:  # before the port: a gRPC server that never started cannot release its port
                    await self.local.start()
                except OSError as exc:
                    raise BindError(
                        f"could not bind the local Act socket {self.local.path}: {exc.strerror or exc}"
                    ) from exc
            if self.metrics is not None:
                try:
                    await self.metrics.start()
                except MetricsBindError as exc:
                    raise BindError(str(exc)) from exc
            self.port = self._bind(server)
        except BaseException:  # nothing is served: release the sockets and the inference threads
            if self.local is not None:
                await self.local.close()
            if self.metrics is not None:
                await self.metrics.close()
            await self.batcher.close()
            raise
        await server.start()
        self._server = server
        for name in ("", *services):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "edge server on %s (backend %s, version %d)",
            self.address,
            self.backend.name,
            self.backend.version,
        )
        return self.port

    def _bind(self, server: grpc.aio.Server) -> int:
        """Bind ``server`` to the configured host and port; returns the port.

        Raises:
            BindError: the port is taken, or the host is not an address of this machine.
        """
        cfg = self.config
        bind = host_port(cfg.host, cfg.port)
        creds = server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls else None
        try:
            port = int(server.add_secure_port(bind, creds) if creds else server.add_insecure_port(bind))
        except RuntimeError:  # how grpcio reports an address it could not bind
            port = 0
        if port == 0:
            raise BindError(
                f"could not bind {bind}: the port is in use (--port 0 picks a free one), "
                f"or {cfg.host} is not an address of this machine (--host)"
            )
        return port

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful shutdown: in-flight batches finish, new requests get UNAVAILABLE.

        ``grace_s`` (``config.grace_s`` by default) bounds each of its two waits: for the batches
        (where they take longer, a forward pass that hangs, the requests that no batch took get
        UNAVAILABLE and the running ones are left unanswered), then for the streams to write
        their last answers, after which they are cancelled."""
        if self._server is None:
            return
        server, self._server = self._server, None
        grace = self.config.grace_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        if self.local is not None:
            self.local.stop_accepting()
        await self.batcher.close(timeout_s=grace)
        await server.stop(grace)
        if self.local is not None:
            await self.local.close()
        if self.metrics is not None:
            await self.metrics.close()
        log.info("edge server on %s stopped", self.address)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


@dataclass(frozen=True)
class Activity:
    """What a server has done since it started: the counters an activity line compares."""

    time_s: float
    streams: int
    rows: int
    batches: int
    refused_full: int
    refused_invalid: int
    refused_streams: int
    failed: int
    version: int
    queue_wait_us_p99: int
    inference_us_p50: int

    @classmethod
    def of(cls, server: EdgeServer, time_s: float) -> Activity:
        """The server's counters now, as its ``Stats`` RPC gives them."""
        r = server.servicer.stats()
        return cls(
            time_s,
            r.active_streams,
            r.rows,
            r.batches,
            r.rejected_queue_full,
            r.rejected_invalid,
            r.rejected_streams,
            r.failed_requests,
            r.policy_version,
            r.queue_wait_us_p99,
            r.inference_us_p50,
        )


def activity_line(before: Activity, now: Activity) -> str | None:
    """One line on what the server did between two snapshots, or None when it was idle and
    nothing changed (no rows, the same streams, version, refusals and failures). The percentiles are of
    the last 8,192 requests (queue wait) and batches (inference), as in ``Stats``."""
    rows, batches = now.rows - before.rows, now.batches - before.batches
    refused = (
        now.refused_full - before.refused_full,
        now.refused_invalid - before.refused_invalid,
        now.refused_streams - before.refused_streams,
    )
    failed = now.failed - before.failed
    changed = (now.streams, now.version) != (before.streams, before.version) or any(refused) or failed > 0
    if rows == 0 and not changed:
        return None
    seconds = max(now.time_s - before.time_s, 1e-9)
    line = f"{now.streams} stream(s), {rows / seconds:,.0f} rows/s in {batches / seconds:,.0f} batches/s"
    if batches:
        line += (
            f" ({rows / batches:.1f} rows each), queue wait p99 {now.queue_wait_us_p99 / 1e3:.1f} ms, "
            f"inference p50 {now.inference_us_p50 / 1e3:.1f} ms"
        )
    line += f", policy version {now.version}"
    if any(refused):
        line += "; refused {} (queue full), {} (invalid), {} (max_streams)".format(*refused)
    if failed:
        line += f"; {failed} failed (the policy's forward pass)"
    return line


async def serve_until_signal(
    server: EdgeServer,
    on_ready: asyncio.Future[int] | None = None,
    signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
    *,
    report_every_s: float = 0.0,
    report: Callable[[str], None] = print,
) -> None:
    """Start ``server``, run until one of ``signals`` arrives, then shut it down gracefully and
    close its backend (its engine threads or replica processes), which this process owns.
    With ``report_every_s``, ``report`` gets an :func:`activity_line` that often, unless the
    server was idle."""
    try:
        port = await server.start()
        if on_ready is not None:
            on_ready.set_result(port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in signals:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        before = Activity.of(server, loop.time())
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), report_every_s or None)
            if not stop.is_set():
                now = Activity.of(server, loop.time())
                line = activity_line(before, now)
                if line is not None:
                    report(line)
                before = now
        await server.stop()
    finally:
        server.backend.close()
