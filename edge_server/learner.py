"""The ``edgerl.v1.Learner`` servicer: segments out to the trainer, weights in."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Mapping

import grpc
import numpy as np

from edgerl.edge_server.backend import MAX_VERSION, PolicyBackend, weights_limit
from edgerl.edge_server.batcher import DynamicBatcher
from edgerl.edge_server.parsing import Unparsed
from edgerl.edge_server.service import answers_own_faults, drop_until_quiet, own_fault, write_message
from edgerl.edge_server.transitions import TransitionStore
from edgerl.proto import tensors
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.proto.v1 import edge_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def decode_weights(msg: Mapping[str, pb.Tensor]) -> dict[str, np.ndarray]:
    """Decode the ``tensors`` map of a PublishWeightsRequest.

    Raises:
        tensors.TensorError: a tensor is malformed (the message names it).
    """
    out = {name: tensors.decode(t, f"tensors[{name!r}]") for name, t in msg.items()}
    check_finite(out, "tensors")
    return out


def check_finite(weights: Mapping[str, np.ndarray], field: str) -> None:
    """Raise :class:`~edgerl.proto.tensors.TensorError` naming the first tensor of ``weights``
    (the map ``field`` of the request) that holds NaN or Inf."""
    for name, arr in weights.items():
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise tensors.TensorError(f"{field}[{name!r}]", "contains NaN or Inf")


class PublishRefusedError(Exception):
    """A publish refused with ``code``, and the message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def layout_buffers(layout: Mapping[str, pb.Tensor], max_bytes: int) -> dict[str, np.ndarray]:
    """Empty arrays for the tensors a ``WeightsPart.layout`` declares.

    Raises:
        PublishRefusedError: a tensor's dtype or shape is malformed, or it holds data
            (INVALID_ARGUMENT); the tensors hold more than ``max_bytes`` in all
            (RESOURCE_EXHAUSTED). Nothing is allocated then.
    """
    shapes = {}
    total = 0
    for name, t in layout.items():
        field = f"layout[{name!r}]"
        try:
            dtype, shape = tensors.dtype_and_shape(t, field)
        except tensors.TensorError as exc:
            raise PublishRefusedError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if t.data:
            raise PublishRefusedError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{field}.data: a layout holds no data ({len(t.data):,} bytes); they follow in parts",
            )
        shapes[name] = dtype, shape
        total += math.prod(shape) * dtype.itemsize
    if total > max_bytes:
        raise PublishRefusedError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"layout: {total:,} bytes of weights, more than max_weights_bytes ({max_bytes:,})",
        )
    return {name: np.empty(shape, dtype) for name, (dtype, shape) in shapes.items()}


async def read_parts(parts: AsyncIterator[pb.WeightsPart | Unparsed], buffers: dict[str, np.ndarray]) -> None:
    """Fill ``buffers`` (see :func:`layout_buffers`) with the data of the ``WeightsPart`` messages
    after the first, until the client half-closes.

    Raises:
        PublishRefusedError: a part does not parse, names a tensor outside the layout or holds
            more bytes than its tensor has left; a tensor's bytes did not all come.
    """
    views = {name: arr.reshape(-1).view(np.uint8) for name, arr in buffers.items()}
    filled = dict.fromkeys(buffers, 0)
    i = 0
    async for part in parts:
        i += 1
        if isinstance(part, Unparsed):
            raise PublishRefusedError(part.code, f"part {i}: {part.message}")
        view = views.get(part.name)
        if view is None:
            raise PublishRefusedError(
                grpc.StatusCode.INVALID_ARGUMENT, f"part {i}.name: {part.name!r} is not in the layout"
            )
        data = part.data
        at = filled[part.name]
        if at + len(data) > len(view):
            raise PublishRefusedError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"part {i}.data: {at + len(data):,} bytes of {part.name!r}, whose layout holds {len(view):,}",
            )
        view[at : at + len(data)] = np.frombuffer(data, np.uint8)
        filled[part.name] = at + len(data)
    short = [name for name, at in filled.items() if at < len(views[name])]
    if short:
        name = short[0]
        raise PublishRefusedError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"layout[{name!r}]: {filled[name]:,} of its {len(views[name]):,} bytes came before the "
            f"stream ended ({len(short)} tensor(s) short)",
        )


class _OvertakenError(Exception):
    """A publish that one of a newer version, sent beside it, overtook."""


def _not_newer(version: int, served: int) -> str:
    return f"version: must be greater than the served version {served}, got {version}"


class LearnerServicer(pb_grpc.LearnerServicer):
    """Serves one trainer at a time; a newly connected trainer takes over."""

    def __init__(
        self,
        store: TransitionStore,
        batcher: DynamicBatcher,
        backend: PolicyBackend,
        *,
        max_message_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self.store = store
        self.batcher = batcher
        self.backend = backend
        self.weight_sync_interval = store.config.weight_sync_interval
        self.max_batch_bytes = max_message_bytes // 2
        self.last_swap_us = 0

    async def StreamTransitions(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.TransitionAck | Unparsed], context: grpc.aio.ServicerContext
    ) -> None:
        store = self.store
        generation = store.trainer_connected()
        bad_ack: list[tuple[grpc.StatusCode, str]] = []
        reader = asyncio.get_running_loop().create_task(self._read_acks(request_iterator, bad_ack))
        log.info("trainer connected (generation %d)", generation)
        try:
            while store.is_current_trainer(generation) and not reader.done():
                segments = store.take_sendable()
                if not segments:
                    changed = store.wait_changed()
                    await asyncio.wait((changed, reader), return_when=asyncio.FIRST_COMPLETED)
                    changed.cancel()
                    continue
                batch: list[pb.Segment] = []
                size = 0
                for seg in segments:
                    n = seg.ByteSize()
                    if batch and size + n > self.max_batch_bytes:
                        await write_message(context, pb.TransitionBatch(segments=batch))
                        batch, size = [], 0
                    batch.append(seg)
                    size += n
                await write_message(context, pb.TransitionBatch(segments=batch))
            if bad_ack:
                await context.abort(*bad_ack[0])
            if reader.done() and not reader.cancelled() and (exc := reader.exception()) is not None:
                # a fault of the server's own: said, where the stream once ended as if all was well
                await context.abort(*own_fault(log, f"trainer stream of generation {generation}", exc))
            if not store.is_current_trainer(generation):
                # said, where the stream once ended as if all was well: a second trainer against
                # this server reconnected, took the stream back, and the two took turns for good
                await context.abort(
                    grpc.StatusCode.ABORTED,
                    "a newer trainer stream took the transitions over (is a second trainer "
                    "connected to this server?)",
                )
        finally:
            reader.cancel()
            log.info("trainer stream ended (generation %d)", generation)

    async def _read_acks(
        self, requests: AsyncIterator[pb.TransitionAck | Unparsed], bad: list[tuple[grpc.StatusCode, str]]
    ) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.AbortError):
            async for ack in requests:
                last = self.store.next_seq - 1
                if isinstance(ack, Unparsed):
                    bad.append((ack.code, ack.message))
                elif ack.acked_seq > last:
                    never = f"acked_seq: {ack.acked_seq} was never sent (last segment is {last})"
                    bad.append((grpc.StatusCode.INVALID_ARGUMENT, never))
                else:
                    self.store.ack(ack.acked_seq, ack.window_steps)
                    continue
                await drop_until_quiet(requests)  # so that an asyncio trainer reads the refusal
                return

    def _skipped(self, version: int) -> pb.PublishWeightsResponse | None:
        """The answer to a publish of ``version`` that ``weight_sync_interval`` skips, or None.

        Raises:
            PublishRefusedError: a version past 2**63 - 1, or not newer than the served one.
        """
        served = self.backend.version
        if version > MAX_VERSION:
            invalid = f"version: at most 2**63 - 1 ({MAX_VERSION}), got {version}"
            raise PublishRefusedError(grpc.StatusCode.INVALID_ARGUMENT, invalid)
        if version <= served:
            raise PublishRefusedError(grpc.StatusCode.FAILED_PRECONDITION, _not_newer(version, served))
        if version - served < self.weight_sync_interval:
            return pb.PublishWeightsResponse(policy_version=served, applied=False)
        return None

    @answers_own_faults
    async def PublishWeights(  # noqa: N802
        self, request: pb.PublishWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.PublishWeightsResponse:
        start = time.perf_counter_ns()
        try:
            skipped = self._skipped(request.version)
            if skipped is not None:
                return skipped
            weights = decode_weights(request.tensors)
        except PublishRefusedError as exc:
            await context.abort(exc.code, str(exc))
        except tensors.TensorError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return await self._swap_in(weights, request.version, start, context)

    @answers_own_faults
    async def PublishWeightsStream(  # noqa: N802
        self, request_iterator: AsyncIterator[pb.WeightsPart | Unparsed], context: grpc.aio.ServicerContext
    ) -> pb.PublishWeightsResponse:
        start = time.perf_counter_ns()
        parts = aiter(request_iterator)
        try:
            first = await anext(parts, None)
            if first is None:
                raise PublishRefusedError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "part 0: the stream ended before it (the version and layout)",
                )
            if isinstance(first, Unparsed):
                raise PublishRefusedError(first.code, f"part 0: {first.message}")
            if first.name or first.data:
                raise PublishRefusedError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "part 0: holds the version and layout, no data (it names tensor "
                    f"{first.name!r} and holds {len(first.data):,} bytes)",
                )
            version = first.version
            skipped = self._skipped(version)
            if skipped is not None:
                await drop_until_quiet(parts)  # data the skipped version does not need
                return skipped
            buffers = layout_buffers(first.layout, weights_limit(self.backend.weights_values))
            await read_parts(parts, buffers)
            check_finite(buffers, "layout")
        except PublishRefusedError as exc:
            await drop_until_quiet(parts)  # so that the trainer reads the refusal
            await context.abort(exc.code, str(exc))
        except tensors.TensorError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return await self._swap_in(buffers, version, start, context)

    async def _swap_in(
        self, weights: dict[str, np.ndarray], version: int, start_ns: int, context: grpc.aio.ServicerContext
    ) -> pb.PublishWeightsResponse:
        """Swap ``weights`` in as ``version`` between two batches; the answer to a publish that
        began at ``start_ns`` (``time.perf_counter_ns``)."""
        backend = self.backend

        def swap() -> None:
            """The version check again, on the inference thread, where swaps run one at a time:
            a publish of a newer version, sent beside this one, may have been swapped in while
            this one waited (it was then overwritten by this older one, and the served version
            went back, 20 times in 20 such pairs)."""
            now = backend.version
            if version <= now:
                raise _OvertakenError(_not_newer(version, now))
            backend.load_weights(weights, version)

        try:
            await self.batcher.run_between_batches(swap)
        except _OvertakenError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (KeyError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc).strip('"'))
        except NotImplementedError as exc:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))
        self.store.published()
        self.last_swap_us = (time.perf_counter_ns() - start_ns) // 1000
        return pb.PublishWeightsResponse(policy_version=version, applied=True, swap_us=self.last_swap_us)
