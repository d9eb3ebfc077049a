"""The ``edgerl.v1.EdgePolicy`` servicer: streams in, batcher, actions out."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import numpy as np

from edgerl.edge_server.backend import PolicyBackend
from edgerl.edge_server.batcher import (
    BatcherClosedError,
    BatchResult,
    DynamicBatcher,
    QueueFullError,
    StreamSlots,
    TooManyInflightError,
    percentiles,
)
from edgerl.edge_server.parsing import Unparsed
from edgerl.edge_server.transitions import EnvBusyError, SessionTakenOverError, StreamHandle, TransitionStore
from edgerl.edge_server.validation import InvalidRequestError, StreamSpec, check_hello, check_obs, check_step
from edgerl.proto import tensors
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.proto.v1 import edge_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_FLOAT32 = pb.FLOAT32
_Servicer = TypeVar("_Servicer")
_Request = TypeVar("_Request")
_Reply = TypeVar("_Reply")


@dataclass(frozen=True, slots=True)
class _Pending:
    seq: int
    env_ids: list[int]
    future: asyncio.Future[BatchResult]
    handle: StreamHandle | None
    """The transition-store claim when transitions are collected, with the ids as an array."""
    ids: np.ndarray | None = None


#: A stream the server ends with a status other than OK is ended once its client has sent
#: nothing for ENDING_QUIET_S (and ENDING_MAX_S at most): what the client still wrote is read and
#: dropped first. Ended with writes of the client's in flight, gRPC's asyncio client reads
#: INTERNAL "Internal error from Core" in place of the status (grpc/grpc#36066): a refused hello
#: followed by two steps read that 94 times in 200.
ENDING_QUIET_S = 0.01
ENDING_MAX_S = 0.1

#: How long a server stream whose write failed waits for gRPC to cancel it (see write_message).
GONE_WAIT_S = 1.0


@dataclass(slots=True)
class _Reads:
    """``ending``: the stream is being ended, and its reader drops what comes, counting it in
    ``reads`` (:func:`_until_quiet` waits for the client to go quiet)."""

    reads: int = 0
    ending: bool = False


@dataclass(slots=True)
class _Opened(_Reads):
    """What the reader of an Act stream tells its handler: the session once its hello came, the
    transition-store claims to close and the batcher slots whose queued requests to drop when the
    stream ends (no slots: no hello let in yet)."""

    session_id: str = "?"
    handles: list[StreamHandle] = field(default_factory=list)
    slots: StreamSlots | None = None
    """The stream's batcher slots, once its hello came and was let in."""
    hello: HelloWait = field(kw_only=True)
    """The stream's count among those whose hello has not come."""


@dataclass(frozen=True, slots=True)
class _Abort:
    code: grpc.StatusCode
    message: str


_END = None


def _bound(values: np.ndarray | None, shape: tuple[int, ...], fill: float, name: str) -> np.ndarray:
    """The observation bound ``values`` as float32 of ``shape`` (``fill`` everywhere when None).

    Raises:
        ValueError: ``values`` does not hold one value per element of ``shape``.
    """
    bound = tensors.box_bound(values, shape, fill)
    if bound is None:  # only given values can be of the wrong size
        assert values is not None
        raise ValueError(f"{name} holds {np.asarray(values).size} values, the policy's observations {shape}")
    return bound


def _box(shape: tuple[int, ...], low: np.ndarray, high: np.ndarray) -> pb.BoxSpace:
    return pb.BoxSpace(shape=shape, dtype=_FLOAT32, low=low.ravel().tolist(), high=high.ravel().tolist())


def _response(seq: int, env_ids: list[int], res: BatchResult) -> pb.ActResponse:
    actions = res.actions
    return pb.ActResponse(
        seq=seq,
        env_ids=env_ids,
        actions=tensors.float32(actions),
        log_probs=res.log_probs.tolist(),
        policy_version=res.policy_version,
        queue_wait_us=res.queue_wait_us,
        inference_us=res.inference_us,
        batch_rows=res.batch_rows,
    )


class HelloWait:
    """An Act stream (over gRPC or the local socket) counted in
    :attr:`EdgePolicyServicer.streams_awaiting_hello` from its start until :meth:`came`, or one
    refused for ``max_streams`` (:attr:`refused`, the message of its UNAVAILABLE), never counted."""

    __slots__ = ("_servicer", "refused")

    def __init__(self, servicer: EdgePolicyServicer | None, refused: str | None = None) -> None:
        self._servicer = servicer
        self.refused = refused

    def came(self) -> None:
        """The stream sent its first message (its hello, or what is refused in its place), or
        ended: it no longer counts. Only the first call counts; the later ones do nothing."""
        if self._servicer is not None:
            self._servicer.streams_awaiting_hello -= 1
            self._servicer = None


class StreamLimitError(Exception):
    """A stream's hello came while ``ServerLimits.max_streams`` streams were open."""


#: What a stream's step can be refused with, before it reaches the batcher (see step_refusal).
STEP_REFUSALS = (
    StreamLimitError,
    InvalidRequestError,
    EnvBusyError,
    SessionTakenOverError,
    TooManyInflightError,
    QueueFullError,
    BatcherClosedError,
)


def step_refusal(exc: Exception) -> tuple[grpc.StatusCode, str, bool]:
    """How a refused step (one of :data:`STEP_REFUSALS`) ends its stream: the status, the
    message, and whether it counts as invalid input (``Stats.rejected_invalid``)."""
    if isinstance(exc, InvalidRequestError):
        return exc.code, exc.message, True
    if isinstance(exc, (EnvBusyError, TooManyInflightError)):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc), True
    if isinstance(exc, SessionTakenOverError):
        return grpc.StatusCode.ABORTED, str(exc), False
    if isinstance(exc, StreamLimitError):  # a stream that ends frees one: retried with backoff
        return grpc.StatusCode.UNAVAILABLE, str(exc), False
    code, message = answer_failure(exc)
    return code, message, False


def answer_failure(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message that end a stream whose request failed with ``exc``."""
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, BatcherClosedError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    return grpc.StatusCode.INTERNAL, f"policy forward pass failed: {exc}"


def own_fault(
    logger: logging.Logger, what: str, exc: BaseException, on: str = "stream"
) -> tuple[grpc.StatusCode, str]:
    """Log a fault of the server's own (not of the client's input or of the forward pass) as
    ``WHAT failed``, with its traceback, and return the status and message that end the stream
    (or the unary ``call``) it met: INTERNAL, naming the exception. Every place that meets one
    goes through here, so the caller and the log always read the same."""
    logger.error("%s failed", what, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"the server failed on this {on}: {type(exc).__name__}: {exc}"


async def _drop_the_rest(requests: AsyncIterator[Any], read: _Reads) -> None:
    """Read and drop what the client still sends on a stream being ended, until it half-closes
    or the stream ends (and this reader with it)."""
    read.ending = True
    with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.AbortError):
        async for _ in requests:
            read.reads += 1


async def _until_quiet(read: _Reads, reader: asyncio.Future[None]) -> None:
    """Wait until the client of a stream being ended has sent nothing for
    :data:`ENDING_QUIET_S`, or has half-closed (``reader`` ended), or :data:`ENDING_MAX_S`
    passed; meanwhile ``reader`` drops what comes."""
    read.ending = True
    loop = asyncio.get_running_loop()
    give_up = loop.time() + ENDING_MAX_S
    while not reader.done() and loop.time() < give_up:
        seen = read.reads
        await asyncio.sleep(ENDING_QUIET_S)
        if read.reads == seen:
            break


async def drop_until_quiet(requests: AsyncIterator[Any]) -> None:
    """Read and drop what a client still sends on a stream about to be refused, until it is
    quiet (:func:`_until_quiet`): for a stream whose reader is the one to refuse it (the
    trainer's, on a bad ack)."""
    read = _Reads()
    dropping = asyncio.ensure_future(_drop_the_rest(requests, read))
    await _until_quiet(read, dropping)
    dropping.cancel()
    await asyncio.wait([dropping])


async def write_message(context: grpc.aio.ServicerContext, message: Any) -> None:
    """Write one message of a server stream (``Act``'s answers, the trainer's segments).

    A write fails when the client went away (a crash, a kill, its call cancelled) before gRPC
    learned so. Raised from the handler then, gRPC would log it as the handler's fault, with
    its traceback ("ExecuteBatchError raised in core by servicer method"): it did so for 10 of
    10 ``Act`` clients that went away with answers unread and 5 of 5 trainers with segments
    unread. gRPC cancels the handler as soon as it learns, here 0.15-0.3 ms after the failed
    write, so the write waits for that (:data:`GONE_WAIT_S` at most) and raises only where no
    cancellation came.
    """
    try:
        await context.write(message)
    except Exception:
        await asyncio.sleep(GONE_WAIT_S)
        raise


async def _end(
    context: grpc.aio.ServicerContext,
    opened: _Opened,
    reader: asyncio.Task[None],
    code: grpc.StatusCode,
    message: str,
) -> None:
    """End an Act stream with ``code`` once its client is quiet (:func:`_until_quiet`); its
    reader drops what comes meanwhile."""
    await _until_quiet(opened, reader)
    await context.abort(code, message)


def answers_own_faults(
    handler: Callable[[_Servicer, _Request, grpc.aio.ServicerContext], Awaitable[_Reply]],
) -> Callable[[_Servicer, _Request, grpc.aio.ServicerContext], Awaitable[_Reply]]:
    """A unary RPC's handler whose own faults end the call with INTERNAL, naming the exception
    (:func:`own_fault`), and are logged with their traceback, as a stream's are. Left to
    gRPC, the caller would read UNKNOWN, ``Unexpected <class '...'>``, and the log would not say
    which call failed. A refusal the handler gives (``context.abort``) passes as it is."""
    logger = logging.getLogger(handler.__module__)

    @functools.wraps(handler)
    async def guarded(self: _Servicer, request: _Request, context: grpc.aio.ServicerContext) -> _Reply:
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await context.abort(*own_fault(logger, f"{handler.__name__} call", exc, on="call"))
            raise  # not reached: abort raises AbortError

    return guarded


class EdgePolicyServicer(pb_grpc.EdgePolicyServicer):
    """Validates client messages, feeds the batcher, answers in request order."""

    def __init__(
        self,
        batcher: DynamicBatcher,
        backend: PolicyBackend,
        *,
        env_name: str,
        limits: pb.ServerLimits,
        obs_low: np.ndarray | None = None,
        obs_high: np.ndarray | None = None,
        server_version: str = "",
        store: TransitionStore | None = None,
        hello_timeout_s: float = 0.0,
    ) -> None:
        self.batcher = batcher
        self.hello_timeout_s = hello_timeout_s
        self.store = store
        self.backend = backend
        self.env_name = env_name
        self.limits = limits
        self.server_version = server_version
        self.obs_shape = backend.obs_shape
        self.rejected_invalid = 0
        self.rejected_streams = 0
        self.active_streams = 0
        self.streams_awaiting_hello = 0
        """Act streams (gRPC and local) whose first message has not come: at most ``max_streams``."""
        self._session_streams: dict[str, int] = {}
        """Streams past their hello, by session, over gRPC and the local socket."""
        self._obs_low = _bound(obs_low, self.obs_shape, -np.inf, "obs_low")
        self._obs_high = _bound(obs_high, self.obs_shape, np.inf, "obs_high")

    def count_invalid(self) -> None:
        """Count a request refused as invalid before a method of this servicer ran (one that did
        not parse, or too large, :mod:`edgerl.edge_server.parsing`)."""
        self.rejected_invalid += 1

    @property
    def streams_open(self) -> int:
        """Streams past their hello, over gRPC and the local socket (``max_streams`` bounds it)."""
        return sum(self._session_streams.values())

    def claim_stream(self, session_id: str) -> None:
        """Count a stream whose hello was valid; :meth:`release_stream` when it ends.

        Raises:
            StreamLimitError: ``max_streams`` streams are open, and the hello does not take over
                a session that has one of them (a client back before its old stream ended).
        """
        limit, now = self.limits.max_streams, self.streams_open
        same = self._session_streams.get(session_id, 0)
        if now >= limit and same != 1:
            self.rejected_streams += 1
            log.info("stream %s refused: %d streams open", session_id, now)
            raise StreamLimitError(
                f"max_streams: {now} stream(s) open, the server takes at most {limit}; "
                "retry when one has ended"
            )
        self._session_streams[session_id] = same + 1

    def release_stream(self, session_id: str) -> None:
        """A stream counted by :meth:`claim_stream` ended."""
        left = self._session_streams.pop(session_id) - 1
        if left:
            self._session_streams[session_id] = left

    # -- Act (bidirectional stream) ------------------------------------------------------------
    async def Act(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.ActRequest | Unparsed], context: grpc.aio.ServicerContext
    ) -> None:
        hello = self.await_hello()
        if hello.refused is not None:
            await drop_until_quiet(request_iterator)  # so that the client reads the refusal
            await context.abort(grpc.StatusCode.UNAVAILABLE, hello.refused)
        pending: asyncio.Queue[_Pending | _Abort | None] = asyncio.Queue()
        opened = _Opened(hello=hello)
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read_stream(request_iterator, pending, opened))
        no_hello = (
            loop.call_later(self.hello_timeout_s, self._hello_overdue, opened, pending)
            if self.hello_timeout_s
            else None
        )
        self.active_streams += 1
        store = self.store
        try:
            while True:
                item = await pending.get()
                if item is _END:
                    return
                if isinstance(item, _Abort):
                    await _end(context, opened, reader, item.code, item.message)
                    return
                try:
                    res = await item.future
                except Exception as exc:
                    await _end(context, opened, reader, *answer_failure(exc))
                    return
                try:
                    if store is not None and item.handle is not None and item.ids is not None:
                        store.record(item.handle, item.ids, res)
                    response = _response(item.seq, item.env_ids, res)
                except Exception as exc:  # a fault of the server's own, as in the reader
                    await _end(context, opened, reader, *own_fault(log, f"stream {opened.session_id}", exc))
                    return
                await write_message(context, response)
        finally:
            if no_hello is not None:
                no_hello.cancel()
            hello.came()  # or never will
            self.active_streams -= 1
            reader.cancel()
            if opened.slots is not None:  # its queued requests too: no one reads their answers
                self.batcher.drop_queued(opened.slots)
            while not pending.empty():  # requests still waiting for admission go with the stream
                left = pending.get_nowait()
                if isinstance(left, _Pending) and isinstance(left.future, asyncio.Task):
                    left.future.cancel()
            if store is not None:
                for handle in opened.handles:
                    store.close_stream(handle)

    def await_hello(self) -> HelloWait:
        """A stream (over gRPC or the local socket) starts: count it among those that have sent
        no hello until its :meth:`HelloWait.came`, or refuse it (:attr:`HelloWait.refused`, for
        its UNAVAILABLE) where ``max_streams`` wait already: each holds some memory until its
        hello or ``hello_timeout_s`` (~26 KB over gRPC)."""
        waiting, limit = self.streams_awaiting_hello, self.limits.max_streams
        if waiting >= limit:
            self.rejected_streams += 1
            message = (
                f"max_streams: {waiting} stream(s) have sent no hello yet, the server waits for at "
                f"most {limit} at once; retry when one has ended"
            )
            log.info("stream refused: %s", message)  # one of a flood: not a warning each
            return HelloWait(None, message)
        self.streams_awaiting_hello += 1
        return HelloWait(self)

    def hello_overdue(self, missing: str = "hello: no StreamHello") -> str:
        """The refusal of a stream without its hello ``hello_timeout_s`` after its start (counted
        as invalid); ``missing`` names what did not come."""
        self.rejected_invalid += 1
        return f"{missing} within {self.hello_timeout_s:g} s of the stream's start"

    def _hello_overdue(self, opened: _Opened, out: asyncio.Queue[_Pending | _Abort | None]) -> None:
        if opened.slots is None and not opened.ending:  # (a stream refused already is ending)
            message = self.hello_overdue()
            log.warning("stream refused: %s", message)
            out.put_nowait(_Abort(grpc.StatusCode.DEADLINE_EXCEEDED, message))

    async def _read_stream(
        self,
        requests: AsyncIterator[pb.ActRequest | Unparsed],
        out: asyncio.Queue[_Pending | _Abort | None],
        opened: _Opened,
    ) -> None:
        store = self.store
        handle: StreamHandle | None = None
        spec: StreamSpec | None = None
        slots = None
        seq = 0
        try:
            async for req in requests:
                if opened.ending:  # the handler is ending the stream: dropped, counted for its wait
                    opened.reads += 1
                    continue
                if isinstance(req, Unparsed):
                    raise InvalidRequestError(req.code, req.message)
                if self.batcher.closing:
                    raise BatcherClosedError("server is shutting down")
                kind = req.WhichOneof("kind")
                if spec is None:
                    opened.hello.came()
                    if kind != "hello":
                        raise InvalidRequestError(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            f"{kind or 'request'}: the first message of an Act stream must be a StreamHello",
                        )
                    spec = check_hello(
                        req.hello, self.obs_shape, self.limits.max_envs_per_stream, self.env_name
                    )
                    opened.session_id = spec.session_id
                    self.claim_stream(spec.session_id)
                    slots = opened.slots = self.batcher.open_stream(spec.max_inflight, backfill=spec.backfill)
                    if store is not None:
                        handle = store.open_stream(
                            spec.session_id,
                            spec.num_envs,
                            mid_episode=spec.mid_episode,
                            resumes=spec.resumes,
                        )
                        opened.handles.append(handle)
                    log.info("stream %s opened: %d envs of %s", spec.session_id, spec.num_envs, spec.env_name)
                    continue
                if kind != "step":
                    raise InvalidRequestError(
                        grpc.StatusCode.FAILED_PRECONDITION, "hello: sent twice on one stream"
                    )
                step = req.step
                obs, env_ids = check_step(step, spec, seq, self.obs_shape, self.limits.max_batch_size)
                ids = None
                if store is not None and handle is not None:
                    n = len(env_ids)
                    ids = np.asarray(env_ids)
                    future = self.submit_step(
                        slots,
                        handle,
                        ids,
                        obs,
                        rewards=np.asarray(step.rewards, np.float32),
                        terminated=np.asarray(step.terminated, bool),
                        truncated=np.asarray(step.truncated, bool),
                        fallback=np.asarray(step.fallback, bool) if step.fallback else np.zeros(n, bool),
                        obs_index=np.fromiter(step.obs_index, np.int64, n) if step.obs_index else None,
                    )
                else:
                    future = self.batcher.submit(obs, slots)
                out.put_nowait(_Pending(seq, env_ids, future, handle, ids))
                seq += 1
            out.put_nowait(_END)
        except STEP_REFUSALS as exc:
            code, message, invalid = step_refusal(exc)
            if invalid:
                self.rejected_invalid += 1
            if isinstance(exc, InvalidRequestError):
                log.warning("stream %s rejected: %s", opened.session_id, message)
            out.put_nowait(_Abort(code, message))
            await _drop_the_rest(requests, opened)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            # The transport ended the stream (e.g. an oversized message); the handler ends with it.
            log.info("stream %s ended by transport: %s", opened.session_id, exc.code())
            out.put_nowait(_END)
        except grpc.aio.AbortError:  # the handler ended the stream, and the read that waited with it
            pass
        except Exception as exc:  # a fault of the server's own: the stream ends, it does not hang
            out.put_nowait(_Abort(*own_fault(log, f"stream {opened.session_id}", exc)))
            await _drop_the_rest(requests, opened)
        finally:
            if slots is not None:
                self.batcher.close_stream(slots)
                self.release_stream(opened.session_id)

    def submit_step(
        self,
        slots: StreamSlots | None,
        handle: StreamHandle,
        ids: np.ndarray,
        obs: np.ndarray,
        *,
        rewards: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        fallback: np.ndarray,
        obs_index: np.ndarray | None = None,
    ) -> asyncio.Future[BatchResult]:
        """Hand a stream's validated step to the transition store and the batcher (a server that
        collects transitions; without, a step goes to the batcher alone).

        Raises what :meth:`TransitionStore.observe` and :meth:`DynamicBatcher.submit` raise.
        """
        store = self.store
        assert store is not None  # the handle is the store's
        store.observe(
            handle,
            ids,
            obs,
            rewards=rewards,
            terminated=terminated,
            truncated=truncated,
            fallback=fallback,
            obs_index=obs_index,
        )
        if store.try_admit(handle, ids) or slots is None:
            return self.batcher.submit(obs, slots)
        # Wait for admission off the read path: the stream's other messages must still be
        # read (they complete rows the trainer is waiting for).
        self.batcher.hold(slots)
        return asyncio.get_running_loop().create_task(self._admit_and_submit(store, handle, ids, obs, slots))

    async def _admit_and_submit(
        self,
        store: TransitionStore,
        handle: StreamHandle,
        env_ids: np.ndarray,
        obs: np.ndarray,
        slots: StreamSlots,
    ) -> BatchResult:
        try:
            await store.admit(handle, env_ids)
        finally:
            self.batcher.release(slots)
        return await self.batcher.submit(obs, slots)

    # -- unary RPCs --------------------------------------------------------------------------------
    @answers_own_faults
    async def ActUnary(  # noqa: N802
        self, request: pb.ActUnaryRequest, context: grpc.aio.ServicerContext
    ) -> pb.ActResponse:
        try:
            obs = check_obs(request.obs, "obs", self.obs_shape, None, self.limits.max_batch_size)
            future = self.batcher.submit(obs)
        except STEP_REFUSALS as exc:
            code, message, invalid = step_refusal(exc)
            if invalid:
                self.rejected_invalid += 1
            await context.abort(code, message)
        try:
            res = await future
        except Exception as exc:  # as a stream's step: INTERNAL, naming the failure, not UNKNOWN
            await context.abort(*answer_failure(exc))
        return _response(0, list(range(obs.shape[0])), res)

    @answers_own_faults
    async def Describe(  # noqa: N802
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        b = self.backend
        return pb.DescribeResponse(
            observation_space=_box(self.obs_shape, self._obs_low, self._obs_high),
            action_space=_box(b.act_shape, b.act_low, b.act_high),
            policy_version=b.version,
            limits=self.limits,
            backend=b.name,
            env_name=self.env_name,
            server_version=self.server_version,
            action_chunk=b.chunk,
        )

    @answers_own_faults
    async def Stats(  # noqa: N802
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        return self.stats()

    def stats(self) -> pb.StatsResponse:
        """The counters since start and the recent percentiles, as the ``Stats`` RPC gives them."""
        st = self.batcher.stats
        queue_wait = percentiles(st.queue_wait_us, 50, 99)
        inference = percentiles(st.inference_us, 50, 99)
        return pb.StatsResponse(
            requests=st.requests,
            batches=st.batches,
            rows=st.rows,
            max_batch_rows=st.max_batch_rows,
            rejected_queue_full=st.rejected_queue_full,
            rejected_invalid=self.rejected_invalid,
            rejected_streams=self.rejected_streams,
            failed_requests=st.failed_requests,
            active_streams=self.active_streams,
            streams_awaiting_hello=self.streams_awaiting_hello,
            queue_wait_us_p50=queue_wait[0],
            queue_wait_us_p99=queue_wait[1],
            inference_us_p50=inference[0],
            inference_us_p99=inference[1],
            queue_wait_us_sum=st.queue_wait_us_sum,
            inference_us_sum=st.inference_us_sum,
            policy_version=self.backend.version,
            **self._transition_stats(),
        )

    def _transition_stats(self) -> dict[str, int]:
        if self.store is None:
            return {}
        c = self.store.counters
        return {
            "transitions": c.transitions,
            "segments_acked": c.segments_acked,
            "transitions_pending": self.store.pending_steps,
            "transitions_dropped_overflow": c.transitions_dropped_overflow,
            "transitions_dropped_disconnect": c.transitions_dropped_disconnect,
            "backpressure_wait_us": self.store.backpressure_wait_us(),
            "weight_publishes": c.weight_publishes,
            "sessions_forgotten": c.sessions_forgotten,
        }
