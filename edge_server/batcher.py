"""One dynamic batcher across all streams.

Requests (one per client message, each a block of observation rows) wait in a
bounded FIFO queue. A batch is dispatched when

1. it is full (``max_batch_size`` rows), or
2. every open stream already has a request waiting (nobody else is about to
   send: waiting longer only adds latency), or
3. the oldest waiting request has waited ``max_delay_us`` (Triton / Ray Serve
   semantics: the delay counts from the oldest request, not from the batch).

Rule 2 matters: a batcher that always waits for the delay adds it to every
round trip when few streams are connected. The forward pass runs on a
dedicated thread, never on the event loop; while it runs the next batch
forms. A backend with ``pipeline_depth = k > 1`` (one that batches
continuously inside, like a vLLM engine) gets up to ``k`` batches at once,
each on its own thread, so the next batch joins the running ones instead of
waiting for them. Weight swaps wait until no batch is running. A request
that does not fit in the queue is refused at once (:class:`QueueFullError`),
never queued without bound.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from edgerl.edge_server.policy import PolicyBackend, PolicyResult

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class QueueFullError(Exception):
    """The batcher queue cannot take the request's rows."""


class TooManyInflightError(Exception):
    """A stream sent more requests than the ``max_inflight`` it declared."""


class BatcherClosedError(Exception):
    """The batcher is draining or stopped and takes no new requests."""


@dataclass(frozen=True, slots=True)
class BatchResult:
    """One request's share of a batch."""

    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray | None
    policy_version: int
    queue_wait_us: int
    inference_us: int
    batch_rows: int


@dataclass(slots=True)
class StreamSlots:
    """Accounting of one open stream (see dispatch rule 2)."""

    max_inflight: int
    """Most requests the stream may have outstanding (queued or being computed)."""
    outstanding: int = 0
    admitting: int = 0
    """Requests read but held back before the batcher (admission control); they count as in flight."""
    queued: int = 0
    open: bool = True


@dataclass(slots=True)
class _Request:
    obs: np.ndarray
    slots: StreamSlots | None
    future: asyncio.Future[BatchResult]
    enqueued_ns: int


@dataclass
class BatcherStats:
    """Counters since start, plus recent samples for percentiles."""

    requests: int = 0
    batches: int = 0
    rows: int = 0
    max_batch_rows: int = 0
    rejected_queue_full: int = 0
    queue_wait_us: collections.deque[int] = field(default_factory=lambda: collections.deque(maxlen=8192))
    inference_us: collections.deque[int] = field(default_factory=lambda: collections.deque(maxlen=8192))
    batch_rows: collections.deque[int] = field(default_factory=lambda: collections.deque(maxlen=8192))


def percentile(samples: collections.deque[int] | list[int], q: float) -> int:
    """The ``q``-th percentile (0-100) of integer samples, 0 when empty."""
    return int(np.percentile(np.fromiter(samples, dtype=np.int64), q)) if samples else 0


class DynamicBatcher:
    """Gathers requests from all streams into forward passes of one backend."""

    def __init__(
        self,
        backend: PolicyBackend,
        *,
        max_batch_size: int,
        max_delay_us: int,
        max_queue_rows: int,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_delay_us < 0:
            raise ValueError(f"max_delay_us must be >= 0, got {max_delay_us}")
        if max_queue_rows < max_batch_size:
            raise ValueError(
                f"max_queue_rows ({max_queue_rows}) must be >= max_batch_size ({max_batch_size})"
            )
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.max_delay_ns = max_delay_us * 1000
        self.max_queue_rows = max_queue_rows
        self.stats = BatcherStats()
        self._queue: collections.deque[_Request] = collections.deque()
        self._queued_rows = 0
        self._open_streams = 0
        self._streams_waiting = 0
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._depth = max(1, backend.pipeline_depth)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self._depth, thread_name_prefix="edgerl-infer", initializer=backend.init_thread
        )
        self._running: set[asyncio.Task[None]] = set()
        self._swaps_waiting = 0
        self._idle = asyncio.Event()  # no batch running (set while none is)
        self._idle.set()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the dispatch task on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="edgerl-batcher")

    async def close(self) -> None:
        """Refuse new requests, finish every queued one, stop the inference thread."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
        await self._idle.wait()
        self._executor.shutdown(wait=True)

    @property
    def closing(self) -> bool:
        return self._closing

    # -- streams -----------------------------------------------------------------------------
    def open_stream(self, max_inflight: int) -> StreamSlots:
        """Register a stream that keeps up to ``max_inflight`` requests outstanding."""
        self._open_streams += 1
        return StreamSlots(max(1, max_inflight))

    def close_stream(self, slots: StreamSlots) -> None:
        """Forget a stream; its outstanding requests still complete."""
        if slots.open:
            slots.open = False
            self._open_streams -= 1
            if slots.queued:
                self._streams_waiting -= 1
            self._wake.set()

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    # -- requests ----------------------------------------------------------------------------
    def submit(self, obs: np.ndarray, slots: StreamSlots | None = None) -> asyncio.Future[BatchResult]:
        """Queue a block of observation rows; the future resolves with its actions.

        Raises:
            BatcherClosedError: the batcher is draining.
            QueueFullError: the queue cannot take ``len(obs)`` more rows.
            TooManyInflightError: the stream already has ``max_inflight`` requests outstanding.
        """
        if self._closing:
            raise BatcherClosedError("the server is shutting down")
        if slots is not None:
            self._check_inflight(slots)
        rows = obs.shape[0]
        if self._queued_rows + rows > self.max_queue_rows:
            self.stats.rejected_queue_full += 1
            raise QueueFullError(
                f"batcher queue full: {self._queued_rows} of {self.max_queue_rows} rows waiting, "
                f"request has {rows}"
            )
        future: asyncio.Future[BatchResult] = asyncio.get_running_loop().create_future()
        if slots is not None:
            slots.outstanding += 1
            slots.queued += 1
            if slots.queued == 1 and slots.open:
                self._streams_waiting += 1
        self._queue.append(_Request(obs, slots, future, time.monotonic_ns()))
        self._queued_rows += rows
        self._wake.set()
        return future

    def hold(self, slots: StreamSlots) -> None:
        """Count a request that waits before :meth:`submit` (admission) as in flight.

        The caller calls :meth:`release` before submitting it, or when dropping it.

        Raises:
            TooManyInflightError: the stream already has ``max_inflight`` requests in flight.
        """
        self._check_inflight(slots)
        slots.admitting += 1

    @staticmethod
    def release(slots: StreamSlots) -> None:
        slots.admitting -= 1

    @staticmethod
    def _check_inflight(slots: StreamSlots) -> None:
        unanswered = slots.outstanding + slots.admitting
        if unanswered >= slots.max_inflight:
            raise TooManyInflightError(
                f"step: {unanswered} requests already unanswered, the stream declared "
                f"max_inflight={slots.max_inflight}"
            )

    # -- dispatch ----------------------------------------------------------------------------
    def _ready(self, now_ns: int) -> bool:
        return (
            self._closing
            or self._queued_rows >= self.max_batch_size
            or self._streams_waiting >= self._open_streams
            or now_ns - self._queue[0].enqueued_ns >= self.max_delay_ns
        )

    async def _run(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._swaps_waiting or len(self._running) >= self._depth:
                # A weight swap waits for the running batches (no new one starts before it),
                # or the backend has as many batches as it takes.
                self._wake.clear()
                await self._wake.wait()
                continue
            now = time.monotonic_ns()
            if self._ready(now):
                self._start(self._take(), now)
                continue
            self._wake.clear()
            remaining_s = (self._queue[0].enqueued_ns + self.max_delay_ns - now) / 1e9
            try:
                async with asyncio.timeout(remaining_s):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _start(self, batch: list[_Request], now_ns: int) -> None:
        """Run a batch (beside the running ones, up to the backend's ``pipeline_depth``)."""
        task = asyncio.get_running_loop().create_task(self._dispatch(batch, now_ns))
        self._running.add(task)
        self._idle.clear()

        def done(t: asyncio.Task[None]) -> None:
            self._running.discard(t)
            if not self._running:
                self._idle.set()
            self._wake.set()

        task.add_done_callback(done)

    def _take(self) -> list[_Request]:
        batch = [self._queue.popleft()]
        rows = batch[0].obs.shape[0]
        while self._queue and rows + self._queue[0].obs.shape[0] <= self.max_batch_size:
            req = self._queue.popleft()
            rows += req.obs.shape[0]
            batch.append(req)
        self._queued_rows -= rows
        for req in batch:
            slots = req.slots
            if slots is not None:
                slots.queued -= 1
                if slots.queued == 0 and slots.open:
                    self._streams_waiting -= 1
        return batch

    async def run_between_batches(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the inference thread, after the running batch and before the next.

        This is how weights are swapped: no forward pass ever sees half-loaded weights,
        and with a pipelined backend no batch starts before ``fn`` or runs beside it.
        """
        self._swaps_waiting += 1
        try:
            await self._idle.wait()
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn)
        finally:
            self._swaps_waiting -= 1
            self._wake.set()

    def _infer(self, obs: np.ndarray) -> tuple[PolicyResult, int, int]:
        start = time.perf_counter_ns()
        version = self.backend.version
        result = self.backend.infer(obs)
        return result, version, (time.perf_counter_ns() - start) // 1000

    async def _dispatch(self, batch: list[_Request], now_ns: int) -> None:
        obs = np.concatenate([r.obs for r in batch]) if len(batch) > 1 else np.array(batch[0].obs)
        rows = obs.shape[0]
        loop = asyncio.get_running_loop()
        try:
            result, version, inference_us = await loop.run_in_executor(self._executor, self._infer, obs)
        except Exception as exc:
            log.exception("policy forward pass failed on a batch of %d rows", rows)
            for req in batch:
                self._finish(req)
                if not req.future.done():
                    req.future.set_exception(exc)
            return
        st = self.stats
        st.batches += 1
        st.rows += rows
        st.requests += len(batch)
        st.max_batch_rows = max(st.max_batch_rows, rows)
        st.inference_us.append(inference_us)
        st.batch_rows.append(rows)
        actions, log_probs, values = result.actions, result.log_probs, result.values
        offset = 0
        for req in batch:
            n = req.obs.shape[0]
            wait_us = (now_ns - req.enqueued_ns) // 1000
            st.queue_wait_us.append(wait_us)
            self._finish(req)
            if not req.future.done():
                req.future.set_result(
                    BatchResult(
                        actions[offset : offset + n],
                        log_probs[offset : offset + n],
                        None if values is None else values[offset : offset + n],
                        version,
                        wait_us,
                        inference_us,
                        rows,
                    )
                )
            offset += n

    @staticmethod
    def _finish(req: _Request) -> None:
        if req.slots is not None:
            req.slots.outstanding -= 1
