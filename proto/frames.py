"""The frames of the Act stream without gRPC: a network process's socket, the local Act socket.

A robot host or a sim worker talks to its network process
(:mod:`edgerl.robot_client.netproc`) in these frames, and a sim worker on the
edge server's machine talks to the server's local Act socket
(:mod:`edgerl.edge_server.local`) in the same ones. A frame is a
little-endian ``u32`` length and a payload whose first byte is its kind:

- ``C`` (client first): the stream's settings, a JSON object. The local Act
  socket reads ``session_id``, ``num_envs``, ``obs_shape``, ``env_name``,
  ``backfill``, ``mid_episode`` and ``resumes``.
- ``O`` (client): ``epoch, rows, obs_size`` (``u32``), then the rows' env ids
  (``i32``), observations (``f32``), rewards (``f32``), terminated /
  truncated / fallback flags (``u8`` each, row by row) and the rows'
  numbers among their envs' requests (``u64``, ``StepObservation.obs_index``).
- ``U`` / ``D`` (to the client): the stream of ``epoch`` (``u32``) is up /
  failed. A ``D`` frame goes on with the failure, UTF-8: its gRPC status name
  (empty for a failure with none), a newline, the message. The local Act
  socket's ``U`` frame goes on with the most rows an ``O`` frame may hold, the
  server's ``max_batch_size`` (``u32``); a network process's ends at the epoch.
- ``A`` (to the client): ``epoch, rows`` (``u32``), ``policy_version``
  (``i64``), the action shape of one row (``u8`` count, ``u32`` each), then the
  actions (``f32``) and log-probabilities (``f32``). Answers come in the order
  of the rows sent, so the client matches them by position.
- ``H`` (a network process to its client): nothing more. Written every
  ``HEARTBEAT_S`` of :mod:`edgerl.robot_client.netproc` while its event loop
  runs, so that its client hears from a live process also while the server
  is slow to answer, and takes its silence for a hang.
- ``S`` (a robot host to its network process): nothing more. The robots have
  stepped without a stream (their loop began before one came up): every
  stream the process opens from now on says ``mid_episode``.

A network process numbers its streams (epochs) itself. The local Act socket
keeps no epochs: its ``U`` and ``D`` frames carry 0, and each ``A`` frame the
epoch of the ``O`` frame it answers.
"""

from __future__ import annotations

import math
import select
import socket
import struct
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ObsRows:
    """Observations of some robots, and what their previous actions earned."""

    env_ids: np.ndarray
    obs: np.ndarray
    """float32 ``[rows, obs_size]`` (flattened observations)."""
    rewards: np.ndarray
    flags: np.ndarray
    """uint8 ``[rows, 3]``: terminated, truncated, fallback."""
    obs_index: np.ndarray
    """uint64 ``[rows]``: each row's number among its env's requests (``StepObservation.obs_index``)."""


LENGTH = struct.Struct("<I")
RECV_BYTES = 1 << 16
"""Most bytes a client reads off a frame socket at once: under glibc's default mmap threshold
(128 KiB), as ``socket.recv(n)`` allocates ``n`` bytes before shrinking them to what came. In a
fresh process a 1 KiB answer took 10 us of CPU to read with ``n`` of 1 MiB, 0.9 us with 64 KiB. (In a
running sim worker glibc had raised the threshold: strace showed no mapping calls either way.)"""
CONFIG, OBS, UP, DOWN, ANSWER, HEARTBEAT, STEPPED = b"C", b"O", b"U", b"D", b"A", b"H", b"S"
_OBS = struct.Struct("<cIII")
_STATE = struct.Struct("<cI")
_ROWS = struct.Struct("<I")
_ANSWER = struct.Struct("<cIIqB")


def frame(payload: bytes) -> bytes:
    return LENGTH.pack(len(payload)) + payload


def encode_obs(epoch: int, rows: ObsRows) -> bytes:
    n = len(rows.env_ids)
    obs = np.ascontiguousarray(rows.obs, np.float32).reshape(n, -1)
    return frame(
        b"".join(
            (
                _OBS.pack(OBS, epoch, n, obs.shape[1]),
                np.ascontiguousarray(rows.env_ids, np.int32).tobytes(),
                obs.tobytes(),
                np.ascontiguousarray(rows.rewards, np.float32).tobytes(),
                np.ascontiguousarray(rows.flags, np.uint8).tobytes(),
                np.ascontiguousarray(rows.obs_index, np.uint64).tobytes(),
            )
        )
    )


def decode_obs(payload: bytes) -> tuple[int, ObsRows]:
    """The epoch and the rows of an ``O`` frame."""
    _, epoch, rows, size = _OBS.unpack_from(payload)
    at = _OBS.size
    ids = np.frombuffer(payload, np.int32, rows, at)
    at += 4 * rows
    obs = np.frombuffer(payload, np.float32, rows * size, at).reshape(rows, size)
    at += 4 * rows * size
    rewards = np.frombuffer(payload, np.float32, rows, at)
    at += 4 * rows
    flags = np.frombuffer(payload, np.uint8, 3 * rows, at).reshape(rows, 3)
    at += 3 * rows
    obs_index = np.frombuffer(payload, np.uint64, rows, at)
    return epoch, ObsRows(ids, obs, rewards, flags, obs_index)


def state_payload(kind: bytes, epoch: int) -> bytes:
    """The payload of a ``U`` or ``D`` frame without a failure (:func:`encode_state` frames it)."""
    return _STATE.pack(kind, epoch)


def encode_state(kind: bytes, epoch: int) -> bytes:
    return frame(state_payload(kind, epoch))


def decode_state(payload: bytes) -> int:
    epoch: int = _STATE.unpack_from(payload)[1]
    return epoch


def encode_up(epoch: int, max_rows: int) -> bytes:
    """A ``U`` frame that says how many rows an ``O`` frame may hold (the local Act socket's)."""
    return frame(state_payload(UP, epoch) + _ROWS.pack(max_rows))


def decode_up_rows(payload: bytes) -> int:
    """The most rows an ``O`` frame may hold, as a ``U`` frame's payload says; 0: it says none."""
    if len(payload) < _STATE.size + _ROWS.size:
        return 0
    rows: int = _ROWS.unpack_from(payload, _STATE.size)[0]
    return rows


def failure_payload(epoch: int, code_name: str, details: str) -> bytes:
    """The payload of a ``D`` frame: the stream of ``epoch`` failed with the gRPC status ``code_name``."""
    return state_payload(DOWN, epoch) + f"{code_name}\n{details}".encode()


def encode_failure(epoch: int, code_name: str, details: str) -> bytes:
    """A ``D`` frame (:func:`failure_payload`, framed)."""
    return frame(failure_payload(epoch, code_name, details))


def decode_failure(payload: bytes) -> tuple[int, str, str]:
    """The epoch, the gRPC status name and the message of a ``D`` frame."""
    code, _, details = payload[_STATE.size :].decode(errors="replace").partition("\n")
    return decode_state(payload), code, details


@dataclass(frozen=True, slots=True)
class AnswerRows:
    """The server's answer to the rows of one or more ``O`` frames, in their order."""

    epoch: int
    policy_version: int
    actions: np.ndarray
    """float32 ``[rows, *row_shape]`` (a chunk per row for chunk policies)."""
    log_probs: np.ndarray


def encode_answer(epoch: int, policy_version: int, actions: np.ndarray, log_probs: np.ndarray) -> bytes:
    actions = np.ascontiguousarray(actions, np.float32)
    row_shape = actions.shape[1:]
    return frame(
        b"".join(
            (
                _ANSWER.pack(ANSWER, epoch, len(actions), policy_version, len(row_shape)),
                struct.pack(f"<{len(row_shape)}I", *row_shape),
                actions.tobytes(),
                np.ascontiguousarray(log_probs, np.float32).tobytes(),
            )
        )
    )


def decode_answer(payload: bytes) -> AnswerRows:
    _, epoch, rows, version, ndim = _ANSWER.unpack_from(payload)
    at = _ANSWER.size
    row_shape = struct.unpack_from(f"<{ndim}I", payload, at)
    at += 4 * ndim
    size = rows * math.prod(row_shape)  # Python ints: no numpy call on the worker's hot path
    actions = np.frombuffer(payload, np.float32, size, at).reshape(rows, *row_shape)
    at += 4 * size
    log_probs = np.frombuffer(payload, np.float32, rows, at)
    return AnswerRows(epoch, version, actions, log_probs)


def split_frames(buffer: bytearray) -> list[bytes]:
    """Take the complete frames off the front of ``buffer`` (what is left is a frame's start)."""
    frames = []
    at = 0
    while len(buffer) - at >= LENGTH.size:
        (n,) = LENGTH.unpack_from(buffer, at)
        if len(buffer) - at - LENGTH.size < n:
            break
        frames.append(bytes(buffer[at + LENGTH.size : at + LENGTH.size + n]))
        at += LENGTH.size + n
    del buffer[:at]
    return frames


def read_frames(sock: socket.socket, buffer: bytearray, timeout_s: float) -> list[bytes] | None:
    """Wait up to ``timeout_s`` for ``sock`` (blocking) to be readable, read what came into
    ``buffer`` and take the complete frames off it: ``[]`` if none is complete yet, ``None``
    if the peer closed the socket.

    Raises:
        OSError: reading the socket failed.
    """
    ready, _, _ = select.select([sock], [], [], timeout_s)
    if not ready:
        return []
    data = sock.recv(RECV_BYTES)
    if not data:
        return None
    buffer += data
    return split_frames(buffer)
