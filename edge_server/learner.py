"""The ``edgerl.v1.Learner`` servicer: segments out to the trainer, weights in."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping

import grpc
import numpy as np

from edgerl.edge_server.backend import MAX_VERSION, PolicyBackend
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
    out: dict[str, np.ndarray] = {}
    for name, t in msg.items():
        arr = tensors.decode(t, f"tensors[{name!r}]")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise tensors.TensorError(f"tensors[{name!r}]", "contains NaN or Inf")
        out[name] = arr
    return out


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

    @answers_own_faults
    async def PublishWeights(  # noqa: N802
        self, request: pb.PublishWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.PublishWeightsResponse:
        start = time.perf_counter_ns()
        backend = self.backend
        served = backend.version
        if request.version > MAX_VERSION:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"version: at most 2**63 - 1 ({MAX_VERSION}), got {request.version}",
            )
        version = request.version
        if version <= served:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, _not_newer(version, served))
        if version - served < self.weight_sync_interval:
            return pb.PublishWeightsResponse(policy_version=served, applied=False)
        try:
            weights = decode_weights(request.tensors)
        except tensors.TensorError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

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
        self.last_swap_us = (time.perf_counter_ns() - start) // 1000
        return pb.PublishWeightsResponse(policy_version=version, applied=True, swap_us=self.last_swap_us)
