"""The asyncio client of the edge server.

:class:`EdgeClient` wraps one channel: ``describe``, ``stats``, unary ``act``
and :meth:`EdgeClient.open_stream`, which returns an :class:`ActStream` that
reads and writes the bidirectional Act stream directly (no generator, no
queue: measured faster than feeding the sync API from a queue). Every call
has a deadline; every failure is a named :mod:`edgerl.robot_client.errors`
exception carrying its gRPC code.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgerl.proto import tensors
from edgerl.proto.settings import GRPC_MAX_S, check_message_bytes
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.proto.v1 import edge_pb2_grpc as pb_grpc
from edgerl.robot_client import errors
from edgerl.robot_client.security import ClientSecurity, open_channel

DEFAULT_TIMEOUT_S = 10.0
STREAM_DEADLINE_S = 7 * 24 * 3600.0
"""Deadline of the Act stream as a whole; each answer has its own, shorter one."""
_STOP_POLL_S = 0.25
"""Longest health check of a :meth:`EdgeClient.wait_ready` that asks ``should_stop`` between them."""
_WRITE_RACE = (grpc.StatusCode.INTERNAL, "Internal error from Core")
"""The status gRPC's asyncio client puts over the one the server ended a stream with, when a
write of the client's was in flight as the stream ended (grpc/grpc#36066): the server's own
refusal (a bad hello, a step, its shutdown) would read as this bare INTERNAL."""


_OPERATION_FAILURES = (grpc.aio.AioRpcError, asyncio.InvalidStateError, asyncio.CancelledError)
"""What a read or write of a stream's call raises when the call fails or has ended:
``InvalidStateError`` for an operation on a call that ended, ``CancelledError`` also for one on
a call cancelled on this side (see :func:`_being_cancelled`)."""


def _status_now(call: grpc.aio.Call) -> tuple[grpc.StatusCode, str] | None:
    """The status of ``call`` as it stands, read without waiting; None if it has not ended.
    (``code()`` and ``details()`` are coroutines that return at once once the call has ended.)"""
    got: list[Any] = []
    for coro in (call.code(), call.details()):
        try:
            coro.send(None)
        except StopIteration as done:
            got.append(done.value)
        finally:
            coro.close()
    return (got[0], got[1]) if len(got) == 2 else None


def _stream_error(code: grpc.StatusCode, details: str) -> errors.EdgeRLError:
    """The named error of a stream that ended with ``code`` and ``details``. :data:`_WRITE_RACE`
    that the call ended with from the start (a server stopped with a write of the client's in
    flight) holds no status of the server's: the stream broke, and the caller may retry it, as
    it retries a server that went away. A refusal that the race hid comes again on the next
    stream, where the race is rare: edgerl's server ends a refused stream once its client has
    gone quiet."""
    if (code, details) == _WRITE_RACE:
        return errors.ServerUnavailableError(
            "the stream broke with a write in flight, and gRPC kept no status of the server's "
            f"({details}, grpc/grpc#36066)"
        )
    return errors.from_grpc(_StatusOnly(code, details))


@dataclass(frozen=True)
class ServerInfo:
    """What ``Describe`` reports, decoded."""

    obs_shape: tuple[int, ...]
    act_shape: tuple[int, ...]
    obs_low: np.ndarray
    """float32 ``obs_shape``, the observation space's lower bounds (``-inf`` where unbounded)."""
    obs_high: np.ndarray
    """float32 ``obs_shape``, its upper bounds (``+inf`` where unbounded)."""
    act_low: np.ndarray
    act_high: np.ndarray
    policy_version: int
    backend: str
    env_name: str
    max_batch_size: int
    max_delay_us: int
    max_queue_rows: int
    max_message_bytes: int
    max_envs_per_stream: int
    server_version: str
    action_chunk: int
    """Actions per observation (K of ``[n, K, *act_shape]`` answers); 1 for a plain policy."""
    sync_env_steps: int = 0
    """Synchronous mode's actions per env per version (``ServerLimits.sync_env_steps``); 0: none."""
    max_streams: int = 0
    """Most streams the server keeps open at once (``ServerLimits.max_streams``); 0: not said."""
    max_weights_bytes: int = 0
    """Most bytes of tensor data a publish may carry (``ServerLimits.max_weights_bytes``); 0: a
    server without a learner (or one that does not say)."""


@dataclass(frozen=True, slots=True)
class Actions:
    """The server's answer to one step message."""

    seq: int
    env_ids: list[int]
    actions: np.ndarray
    """float32 ``[len(env_ids), *act_shape]``, raw policy samples (clip before applying)."""
    log_probs: np.ndarray
    policy_version: int
    queue_wait_us: int
    inference_us: int
    batch_rows: int


def _box_of(space: pb.BoxSpace, field: str) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """Shape and bounds of a ``BoxSpace``; bounds left empty (a server that does not state them)
    are unbounded.

    Raises:
        ProtocolError: a bound does not hold one value per element of the shape.
    """
    shape = tuple(int(d) for d in space.shape)
    bounds = []
    for name, values, fill in (("low", space.low, -np.inf), ("high", space.high, np.inf)):
        bound = tensors.box_bound(values or None, shape, fill)
        if bound is None:
            raise errors.ProtocolError(
                f"Describe: {field}.{name} holds {len(values)} values for shape {shape}"
            )
        bounds.append(bound)
    return shape, bounds[0], bounds[1]


def _decode_actions(resp: pb.ActResponse) -> Actions:
    try:
        actions = tensors.decode(resp.actions, "actions")
    except tensors.TensorError as exc:
        raise errors.ProtocolError(str(exc)) from None
    return Actions(
        seq=resp.seq,
        env_ids=list(resp.env_ids),
        actions=actions,
        log_probs=np.asarray(resp.log_probs, dtype=np.float32),
        policy_version=resp.policy_version,
        queue_wait_us=resp.queue_wait_us,
        inference_us=resp.inference_us,
        batch_rows=resp.batch_rows,
    )


class ActStream:
    """One open Act stream. Send step messages, receive their actions in order.

    Up to ``max_inflight`` messages may be outstanding (sent, not yet
    received); a double-buffered worker keeps two.
    """

    def __init__(self, call: Any, num_envs: int, max_inflight: int, timeout_s: float) -> None:
        self._call = call
        self.num_envs = num_envs
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        self._next_send = 0
        self._next_recv = 0
        self._write: asyncio.Future[None] | None = None
        self._first_status: tuple[grpc.StatusCode, str] | None = None
        call.add_done_callback(self._ended)

    def _ended(self, call: grpc.aio.Call) -> None:
        """Keep the call's first status (called as it is set): gRPC may put :data:`_WRITE_RACE`
        over it."""
        self._first_status = _status_now(call)

    @property
    def inflight(self) -> int:
        """Messages sent and not yet answered."""
        return self._next_send - self._next_recv

    async def send(
        self,
        env_ids: Sequence[int],
        obs: np.ndarray,
        rewards: np.ndarray | Sequence[float],
        terminated: np.ndarray | Sequence[bool],
        truncated: np.ndarray | Sequence[bool],
        *,
        fallback: np.ndarray | Sequence[bool] | None = None,
        obs_index: np.ndarray | Sequence[int] | None = None,
    ) -> int:
        """Send the observations of ``env_ids`` and what their previous actions earned.

        ``fallback`` marks envs whose previous applied action was not the policy's
        (e.g. a watchdog fallback); the trainer keeps those steps out of the policy loss.
        ``obs_index`` numbers each row among its env's requests (``StepObservation.obs_index``;
        a request sent again keeps its number): a stream that resumes
        (``open_stream(resumes=True)``) should send them.

        Returns:
            The message's sequence number.

        Raises:
            RpcError: the stream has ended (named by its status: a refused hello, say), whether
                or not a recv() has raised it already.
            EdgeRLError: too many messages in flight, or the stream failed.
        """
        if self._call.done():  # the server ended it: its status, not a write that goes nowhere
            raise await self._final_error()
        if self.inflight >= self.max_inflight:
            raise errors.EdgeRLError(
                f"{self.inflight} messages in flight, max_inflight is {self.max_inflight}"
            )
        obs = np.ascontiguousarray(obs, dtype=np.float32)
        seq = self._next_send
        req = pb.ActRequest(
            step=pb.StepObservation(
                seq=seq,
                env_ids=env_ids,
                obs=tensors.float32(obs),
                rewards=np.asarray(rewards, dtype=np.float32).tolist(),
                terminated=np.asarray(terminated, dtype=bool).tolist(),
                truncated=np.asarray(truncated, dtype=bool).tolist(),
                fallback=[] if fallback is None else np.asarray(fallback, dtype=bool).tolist(),
                obs_index=[] if obs_index is None else np.asarray(obs_index, dtype=np.uint64).tolist(),
            )
        )
        await self._flush()
        # The write completes in the background (gRPC allows one pending write per
        # stream): the caller steps its envs meanwhile instead of waiting ~0.3 ms
        # for the transport to take the message.
        self._write = asyncio.ensure_future(self._call.write(req))
        # If the stream dies, the caller learns it from recv() or the next send(); mark this
        # write's failure as seen so that asyncio does not also log it as unretrieved.
        self._write.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._next_send += 1
        return seq

    async def _flush(self) -> None:
        """Wait for the pending write, if any, and surface its failure."""
        write, self._write = self._write, None
        if write is None:
            return
        if write.done() and not write.cancelled() and write.exception() is None:
            return  # the usual case: the transport took the message while the caller worked
        try:
            async with asyncio.timeout(self.timeout_s):
                await write
        except TimeoutError:
            raise errors.DeadlineExceededError(f"a write took over {self.timeout_s}s") from None
        except _OPERATION_FAILURES as exc:
            raise await self._operation_error(exc) from None

    async def recv(self, timeout_s: float | None = None) -> Actions:
        """The actions answering the oldest unanswered message.

        Raises:
            DeadlineExceededError: no answer within ``timeout_s`` (default: the stream's).
            RpcError: the server ended the stream with a status (named subclass); ``CANCELLED``
                where the call was cancelled on this side (a read of it cancelled before, which
                gRPC takes for cancelling the call), ``ServerUnavailableError`` where the stream
                broke (gRPC's bare INTERNAL, see :func:`_stream_error`).
            EdgeRLError: no message in flight.
        """
        if self.inflight <= 0:
            raise errors.EdgeRLError("recv() with no message in flight")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(timeout):
                resp = await self._call.read()
        except TimeoutError:
            raise errors.DeadlineExceededError(
                f"no answer to step {self._next_recv} within {timeout}s"
            ) from None
        except _OPERATION_FAILURES as exc:
            raise await self._operation_error(exc) from None
        if resp is grpc.aio.EOF:
            raise await self._final_error()
        if resp.seq != self._next_recv:
            raise errors.ProtocolError(f"answer for step {resp.seq}, expected {self._next_recv}")
        self._next_recv += 1
        return _decode_actions(resp)

    async def _operation_error(self, exc: BaseException) -> errors.EdgeRLError:
        """The error of a read or write of the call that failed with ``exc``, one of
        :data:`_OPERATION_FAILURES`: gRPC's own (:meth:`_call_error`), or the call's status where
        the call had ended or was cancelled on this side. The ``CancelledError`` of a task that is
        being cancelled goes on."""
        if isinstance(exc, asyncio.CancelledError) and _being_cancelled():
            raise exc
        if isinstance(exc, grpc.aio.AioRpcError):
            return await self._call_error(exc)
        return await self._final_error()

    async def _call_error(self, exc: grpc.aio.AioRpcError) -> errors.EdgeRLError:
        """The error of a failed read or write: the stream's final status when the failure is
        the bare INTERNAL that gRPC reports for an operation on a call the server already ended."""
        if exc.code() != grpc.StatusCode.INTERNAL:
            return errors.from_grpc(exc)
        try:
            async with asyncio.timeout(0.2):
                return await self._final_error()
        except TimeoutError:
            return _stream_error(exc.code(), exc.details() or "")

    async def _final_error(self) -> errors.EdgeRLError:
        code, details = await self._call.code(), await self._call.details()
        if (code, details) == _WRITE_RACE and self._first_status is not None:
            code, details = self._first_status  # the server's, which gRPC's went over
        if code == grpc.StatusCode.OK:
            return errors.ProtocolError("server closed the stream with messages unanswered")
        return _stream_error(code, details)

    async def close(self) -> None:
        """Half-close, and cancel whatever is still unanswered."""
        try:
            await self._flush()
            await self._call.done_writing()
        except (errors.EdgeRLError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the stream already ended; cancelling below is all that is left
        self._call.cancel()


def _being_cancelled() -> bool:
    """Whether the running task is being cancelled. gRPC also raises asyncio.CancelledError
    out of a read or write of a call that was cancelled on this side (a cancelled read cancels
    its call, as a stopped worker's or an overdue answer's does): the stream ended then, and
    its caller gets the call's status as an error instead of its own task's end."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _StatusOnly(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class EdgeClient:
    """A channel to one edge server. Use as ``async with EdgeClient(addr) as c: ...``."""

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_message_bytes: int = 4 * 1024 * 1024,
        security: ClientSecurity | None = None,
        reconnect_backoff_max_s: float = 1.0,
    ) -> None:
        if not 0 < timeout_s < math.inf:  # an asyncio.timeout of NaN seconds expires at once
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s}")
        check_message_bytes(max_message_bytes)
        if not 0 < reconnect_backoff_max_s <= GRPC_MAX_S:
            raise ValueError(
                f"reconnect_backoff_max_s must be in (0, {GRPC_MAX_S}], got {reconnect_backoff_max_s}"
            )
        self.target = target
        self.timeout_s = timeout_s
        self.security = security or ClientSecurity()
        self._metadata = self.security.metadata()
        self._channel = open_channel(
            target,
            self.security,
            [
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                # gRPC's own reconnect backoff grows to 120 s by default, and calls fail
                # at once while it waits: a restarted server would stay unreachable.
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", max(100, int(reconnect_backoff_max_s * 1000))),
                # Connections of this channel's own: a new client after a link that died
                # without closing must not be handed the dead connection of an older one.
                ("grpc.use_local_subchannel_pool", 1),
            ],
            aio=True,
        )
        self._stub = pb_grpc.EdgePolicyStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def __aenter__(self) -> EdgeClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def wait_ready(
        self, timeout_s: float | None = None, *, should_stop: Callable[[], bool] | None = None
    ) -> bool:
        """Wait until the server answers its health check as serving.

        It asks the standard health service (open without a token) with ``wait_for_ready``, so a
        server not up yet is waited for; one that answers NOT_SERVING (shutting down) is asked
        again every 50 ms. Unlike a wait on the channel's connectivity (``channel_ready()``), a
        wait given up on leaves nothing pending in gRPC: such a watch completes later, into its
        event loop, and if that loop has closed the next loop using gRPC logs "Event loop is
        closed" (grpc/grpc#26887). A check cancelled in flight can do the same, so a caller that
        must be able to stop the wait passes ``should_stop``: each check then lasts at most
        0.25 s, and the wait returns False once ``should_stop()`` is true between two of them.

        Returns:
            True once the server serves; False when ``should_stop`` ended the wait.

        Raises:
            ServerUnavailableError: the server did not serve within the timeout.
            RpcError: any other failure of the health check (named by its gRPC code).
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (left := deadline - loop.time()) > 0:
            if should_stop is not None:
                if should_stop():
                    return False
                left = min(left, _STOP_POLL_S)
            try:
                answer = await self._health.Check(
                    health_pb2.HealthCheckRequest(), timeout=left, wait_for_ready=True
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise errors.from_grpc(exc) from None
                continue  # this check's deadline; the loop's condition tells if it was the wait's
            if answer.status == health_pb2.HealthCheckResponse.SERVING:
                return True
            await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))
        raise errors.ServerUnavailableError(f"no server at {self.target} within {timeout}s")

    async def _unary(self, method: Any, request: Any, timeout_s: float | None) -> Any:
        try:
            return await method(
                request, timeout=self.timeout_s if timeout_s is None else timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise errors.from_grpc(exc) from None

    async def describe(self, timeout_s: float | None = None) -> ServerInfo:
        """Spaces, policy version and limits of the server."""
        r = await self._unary(self._stub.Describe, pb.DescribeRequest(), timeout_s)
        obs_shape, obs_low, obs_high = _box_of(r.observation_space, "observation_space")
        act_shape, act_low, act_high = _box_of(r.action_space, "action_space")
        lim = r.limits
        return ServerInfo(
            obs_shape=obs_shape,
            act_shape=act_shape,
            obs_low=obs_low,
            obs_high=obs_high,
            act_low=act_low,
            act_high=act_high,
            policy_version=r.policy_version,
            backend=r.backend,
            env_name=r.env_name,
            max_batch_size=lim.max_batch_size,
            max_delay_us=lim.max_delay_us,
            max_queue_rows=lim.max_queue_rows,
            max_message_bytes=lim.max_message_bytes,
            max_envs_per_stream=lim.max_envs_per_stream,
            server_version=r.server_version,
            action_chunk=max(1, r.action_chunk),
            sync_env_steps=lim.sync_env_steps,
            max_streams=lim.max_streams,
            max_weights_bytes=lim.max_weights_bytes,
        )

    async def describe_for(
        self,
        obs_shape: Sequence[int],
        env_name: str = "",
        *,
        act_shape: Sequence[int] | None = None,
        owner: str = "the client",
    ) -> ServerInfo:
        """``describe``, checking that the server serves observations of ``obs_shape``, actions
        of ``act_shape`` (where given) and, where both the server and ``env_name`` name one, a
        policy for that env: two envs may share their shapes (HalfCheetah-v5 and Walker2d-v5 do),
        and one's policy would then drive the other's envs without a word.

        Raises:
            PolicyMismatchError: the shapes differ (the message names ``env_name``, or ``owner``
                where that is empty), or the env names do.
        """
        info = await self.describe()
        who = env_name or owner
        if info.obs_shape != tuple(obs_shape):
            raise errors.PolicyMismatchError(
                f"the server serves observations of shape {info.obs_shape}, {who} has {tuple(obs_shape)}"
            )
        if act_shape is not None and info.act_shape != tuple(act_shape):
            raise errors.PolicyMismatchError(
                f"the server answers actions of shape {info.act_shape}, {who} takes {tuple(act_shape)}"
            )
        if env_name and info.env_name and env_name != info.env_name:
            raise errors.PolicyMismatchError(
                f"the server serves a policy for {info.env_name}, not for {env_name} "
                f"(their observations share the shape {info.obs_shape})"
            )
        return info

    async def stats(self, timeout_s: float | None = None) -> pb.StatsResponse:
        """The server's counters."""
        resp: pb.StatsResponse = await self._unary(self._stub.Stats, pb.StatsRequest(), timeout_s)
        return resp

    async def act(self, obs: np.ndarray, timeout_s: float | None = None) -> Actions:
        """One unary call: actions for observations ``[n, *obs_shape]``."""
        obs = np.ascontiguousarray(obs, dtype=np.float32)
        req = pb.ActUnaryRequest(obs=tensors.float32(obs))
        return _decode_actions(await self._unary(self._stub.ActUnary, req, timeout_s))

    async def open_stream(
        self,
        *,
        session_id: str,
        num_envs: int,
        obs_shape: Sequence[int],
        env_name: str = "",
        max_inflight: int = 1,
        timeout_s: float | None = None,
        backfill: bool = False,
        mid_episode: bool = False,
        resumes: bool = False,
    ) -> ActStream:
        """Open an Act stream and send its StreamHello (``backfill``, ``mid_episode`` and
        ``resumes``: see ``StreamHello``; a client that reconnects says ``mid_episode``, so that a
        server which restarted in the meantime does not take its envs' episodes in progress for new
        ones, and one that sends its unanswered requests again says ``resumes``, so that a
        server which lived on loses none of its steps; it numbers them in :meth:`ActStream.send`'s
        ``obs_index``)."""
        call = self._stub.Act(timeout=STREAM_DEADLINE_S, metadata=self._metadata)
        stream = ActStream(call, num_envs, max_inflight, self.timeout_s if timeout_s is None else timeout_s)
        hello = pb.StreamHello(
            session_id=session_id,
            env_name=env_name,
            num_envs=num_envs,
            obs_shape=list(obs_shape),
            max_inflight=max_inflight,
            backfill=backfill,
            mid_episode=mid_episode,
            resumes=resumes,
        )
        try:
            async with asyncio.timeout(stream.timeout_s):
                await call.write(pb.ActRequest(hello=hello))
        except TimeoutError:
            call.cancel()
            raise errors.DeadlineExceededError(f"hello not sent within {stream.timeout_s}s") from None
        except _OPERATION_FAILURES as exc:
            raise await stream._operation_error(exc) from None
        return stream


def describe_server(
    server: str, security: ClientSecurity | None = None, timeout_s: float = 5.0, *, stats: bool = False
) -> dict[str, Any]:
    """What the server at ``server`` reports of itself, for ``edgerl describe``: its ``Describe``
    (:class:`ServerInfo`: observation and action shapes and bounds, env, policy version, batching
    limits, action chunk) and, with ``stats``, its ``Stats`` counters. The bounds are numpy arrays
    (:func:`edgerl.launch.jsonout.dumps` writes them as lists, an infinite bound as ``null``).

    Raises:
        ServerUnavailableError: the server did not serve within ``timeout_s``.
        RpcError: any other failure (named by its gRPC code), e.g. a token it refuses.
    """

    async def ask() -> dict[str, Any]:
        async with EdgeClient(server, timeout_s=timeout_s, security=security) as client:
            await client.wait_ready(timeout_s)
            info = await client.describe()
            out: dict[str, Any] = {"server": server, "describe": asdict(info)}
            if stats:
                counters = await client.stats()
                out["stats"] = {f.name: getattr(counters, f.name) for f in counters.DESCRIPTOR.fields}
            return out

    return asyncio.run(ask())
