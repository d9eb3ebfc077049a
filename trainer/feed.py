"""The trainer's gRPC link to the edge server's Learner service.

A background thread keeps one ``StreamTransitions`` stream open (reconnecting
with jittered backoff), drops duplicate segments and queues the rest. The
training loop takes whole batches with :meth:`TransitionFeed.take` and
acknowledges them; the acknowledgement carries the window (admission
control: how many env steps the server may send ahead of the updates).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import grpc
import numpy as np

from edgerl.proto import tensors
from edgerl.proto.keepalive import check_keepalive, keepalive_options
from edgerl.proto.settings import GRPC_INT_MAX
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.proto.v1 import edge_pb2_grpc as pb_grpc
from edgerl.robot_client import errors
from edgerl.robot_client.security import ClientSecurity, open_channel
from edgerl.trainer.segments import Deduplicator

log = logging.getLogger(__name__)

_MAX_MESSAGE = 64 * 1024 * 1024

KEEPALIVE_S = 10.0
"""A trainer's channel pings the server after this long without a ping or data (seconds)."""
KEEPALIVE_TIMEOUT_S = 10.0
"""An unanswered ping closes the connection this long after it went out (seconds): a link that
died without closing then fails the feed's call with UNAVAILABLE and the feed reconnects, where
a trainer waiting for segments sends nothing that TCP could time out on, and would wait for
ever."""


class TransitionFeed:
    """Segments from the edge server, deduplicated, in order."""

    def __init__(
        self,
        server: str,
        *,
        window_steps: int,
        trainer_id: str = "",
        backoff_max_s: float = 5.0,
        security: ClientSecurity | None = None,
        keepalive_s: float = KEEPALIVE_S,
        keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
    ) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        self.server = server
        self.window_steps = window_steps
        self.trainer_id = trainer_id
        self.backoff_max_s = backoff_max_s
        # What the server re-sends after a reconnect is what this feed had not acknowledged: at
        # most a window of steps, a segment each at worst. Four windows of segment identities
        # hold those with room to spare (the default, a million, took ~210 MB once full).
        self.dedupe = Deduplicator(capacity=4 * window_steps)
        self.received = 0
        self.received_steps = 0
        self.reconnects = 0
        self.security = security or ClientSecurity()
        self._channel = learner_channel(server, self.security, keepalive_s, keepalive_timeout_s)
        self._stub = pb_grpc.LearnerStub(self._channel)
        self._segments: queue.Queue[pb.Segment] = queue.Queue()
        self._queued_steps = 0
        self._acks: queue.Queue[pb.TransitionAck | None] = queue.Queue()
        self._acked = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name="edgerl-feed", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> TransitionFeed:
        self._thread.start()
        return self

    def close(self, grace_s: float = 1.0) -> None:
        """Stop the feed; the acknowledgements given so far reach the server first.

        The request stream is closed and the server ends the call once it has read every
        acknowledgement on it. A call still open after ``grace_s`` (a server that is down or
        does not answer) is cancelled; the server then re-sends what it never heard acknowledged.
        """
        self._stop.set()
        self._acks.put(None)
        self._thread.join(grace_s)
        call = self._call
        if call is not None and self._thread.is_alive():
            call.cancel()
        self._thread.join(10.0)
        self._channel.close()

    @property
    def queued_steps(self) -> int:
        """Env steps received and not yet taken."""
        return self._queued_steps

    # -- the training loop's side -------------------------------------------------------------------
    def take(self, steps: int, should_stop: Any = None, poll_s: float = 0.2) -> list[pb.Segment] | None:
        """Block until at least ``steps`` env steps are queued; return them (whole segments).

        Returns None when ``should_stop()`` became true first. Raises the feed's
        error if its thread failed for good.
        """
        if steps > self.window_steps:
            # The server never sends more than the window unacknowledged: this would wait forever.
            raise ValueError(f"take({steps}): more than window_steps ({self.window_steps})")
        out: list[pb.Segment] = []
        got = 0
        while got < steps:
            if self._error is not None:
                raise self._error
            if should_stop is not None and should_stop():
                for seg in out:  # put back: nothing taken, nothing acknowledged
                    self._segments.put(seg)
                return None
            try:
                seg = self._segments.get(timeout=poll_s)
            except queue.Empty:
                continue
            n = len(seg.rewards)
            with self._lock:
                self._queued_steps -= n
            out.append(seg)
            got += n
        return out

    def ack(self, seq: int) -> None:
        """Acknowledge every segment up to ``seq`` (taken into an update)."""
        self._acked = max(self._acked, seq)
        self._acks.put(self._ack_message())

    def _ack_message(self) -> pb.TransitionAck:
        return pb.TransitionAck(
            acked_seq=self._acked, window_steps=self.window_steps, trainer_id=self.trainer_id
        )

    # -- the stream thread ------------------------------------------------------------------------------
    def _requests(self) -> Iterator[pb.TransitionAck]:
        yield self._ack_message()
        while True:  # up to the None that close() or a reconnect puts: no ack is left unsent
            msg = self._acks.get()
            if msg is None:
                return
            yield msg

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            code = grpc.StatusCode.UNAVAILABLE
            try:
                # wait_for_ready: while the server is down the call waits instead of failing.
                self._call = self._stub.StreamTransitions(
                    self._requests(), wait_for_ready=True, metadata=self.security.metadata()
                )
                for batch in self._call:
                    backoff = 0.1
                    self._take_batch(batch)
            except grpc.RpcError as exc:
                code = exc.code()
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    self._error = errors.from_grpc(exc)
                    return
            if self._stop.is_set():
                return
            delay = backoff * random.uniform(0.5, 1.0)
            log.warning("transitions from %s lost (%s); reconnecting in %.2fs", self.server, code, delay)
            self.reconnects += 1
            time.sleep(delay)
            backoff = min(backoff * 2, self.backoff_max_s)
            # Anything the server re-sends was either taken already (dedupe drops it) or never arrived.
            old, self._acks = self._acks, queue.Queue()
            old.put(None)  # ends the dead call's request iterator

    def _take_batch(self, batch: pb.TransitionBatch) -> None:
        for seg in batch.segments:
            self.received += 1
            if not self.dedupe.first_time(seg):
                continue
            n = len(seg.rewards)
            self.received_steps += n
            with self._lock:
                self._queued_steps += n
            self._segments.put(seg)


def learner_channel(
    server: str,
    security: ClientSecurity | None = None,
    keepalive_s: float = KEEPALIVE_S,
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
) -> grpc.Channel:
    """A (sync) channel to the edge server sized for segments and weights, that pings the server
    every ``keepalive_s`` and takes its connection for dead after ``keepalive_timeout_s``
    without an answer (the server accepts a client's pings as often as twice a second)."""
    check_keepalive(keepalive_s, keepalive_timeout_s, off=False)
    channel: grpc.Channel = open_channel(
        server,
        security,
        [
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            # weights of any size: the server says what it takes (a publish of more gets RESOURCE_EXHAUSTED)
            ("grpc.max_send_message_length", GRPC_INT_MAX),
            *keepalive_options(keepalive_s, keepalive_timeout_s),
            ("grpc.http2.max_pings_without_data", 0),  # else it stops pinging after 2 while idle
        ],
        aio=False,
    )
    return channel


PART_BYTES = 1 << 20
"""Bytes of tensor data in one message of a publish in parts (``PublishWeightsStream``): weights
of more go in parts, of at most this many."""

PUBLISH_BYTES_PER_S = 50e6
"""The slowest transfer a publish's deadline allows for: 50 MB/s (a 400 Mbit/s link). A 2.3 GB
publish took 4.6 s on loopback, and takes ~19 s over 1 Gbit/s Ethernet."""


def publish_deadline_s(nbytes: int, timeout_s: float) -> float:
    """The deadline of a publish of ``nbytes`` of weights: ``timeout_s`` and the time to send them
    at :data:`PUBLISH_BYTES_PER_S`, so that large weights over a slow link are not cut off."""
    return timeout_s + nbytes / PUBLISH_BYTES_PER_S


def _arrays(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A torch ``state_dict`` (or numpy arrays) as C-order, little-endian numpy arrays (0-d
    shapes kept); a CPU tensor's array shares its memory."""
    out = {}
    for name, value in state.items():
        arr = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
        out[name] = np.asarray(arr, arr.dtype.newbyteorder("<"), order="C")  # (ascontiguousarray: >= 1-d)
    return out


def weights_request(state: Mapping[str, Any], version: int) -> pb.PublishWeightsRequest:
    """The PublishWeights request that carries a torch ``state_dict`` (or numpy arrays) as ``version``."""
    msg = pb.PublishWeightsRequest(version=version)
    for name, arr in _arrays(state).items():
        tensors.encode(arr, msg.tensors[name])
    return msg


def weights_parts(
    state: Mapping[str, Any], version: int, part_bytes: int = PART_BYTES
) -> Iterator[pb.WeightsPart]:
    """The ``PublishWeightsStream`` messages that carry a torch ``state_dict`` (or numpy arrays) as
    ``version``: the layout, then each tensor's bytes, ``part_bytes`` at most to a message. Made
    as they are sent, one at a time: the weights are not copied whole.

    Raises:
        ValueError: ``part_bytes`` is under 1, or a tensor's dtype has no wire form (here, not
            inside gRPC's thread that takes the messages).
    """
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
    arrays = _arrays(state)
    first = pb.WeightsPart(version=version)
    for name, arr in arrays.items():
        layout = first.layout[name]
        layout.dtype = tensors.from_numpy_dtype(arr.dtype)  # type: ignore[assignment,unused-ignore]
        layout.shape[:] = arr.shape

    def parts() -> Iterator[pb.WeightsPart]:
        yield first
        for name, arr in arrays.items():
            raw = arr.reshape(-1).view(np.uint8)
            for lo in range(0, len(raw), part_bytes):
                yield pb.WeightsPart(name=name, data=raw[lo : lo + part_bytes].tobytes())

    return parts()


def publish_weights(
    stub: pb_grpc.LearnerStub,
    state: Mapping[str, Any],
    version: int,
    timeout_s: float = 30.0,
    security: ClientSecurity | None = None,
    *,
    part_bytes: int = PART_BYTES,
) -> pb.PublishWeightsResponse:
    """Send a torch ``state_dict`` to the edge server as ``version``: in one ``PublishWeights``
    request where it holds at most ``part_bytes`` of data, else in parts
    (``PublishWeightsStream``; gRPC's messages stop at 2 GiB, a 0.5 B-parameter model as
    float32). The call's deadline is ``timeout_s`` and the weights' transfer time at 50 MB/s
    (:func:`publish_deadline_s`)."""
    metadata = (security or ClientSecurity()).metadata()
    arrays = _arrays(state)
    nbytes = sum(arr.nbytes for arr in arrays.values())
    deadline_s = publish_deadline_s(nbytes, timeout_s)
    try:
        if nbytes <= part_bytes:
            resp: pb.PublishWeightsResponse = stub.PublishWeights(
                weights_request(arrays, version), timeout=deadline_s, metadata=metadata
            )
        else:
            resp = stub.PublishWeightsStream(
                weights_parts(arrays, version, part_bytes), timeout=deadline_s, metadata=metadata
            )
    except grpc.RpcError as exc:
        raise errors.from_grpc(exc) from None
    return resp
