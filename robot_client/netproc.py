"""A network process: the Act stream of a robot host or a sim worker, in a process of its own.

A :class:`~edgerl.robot_client.runner.RobotHost` ticks its robots on one
control thread and keeps its Act stream to the edge server in a child
process (``python -m edgerl.robot_client.netproc``), joined to it by a Unix
socket pair. After each slot the control thread writes the slot's
observations to the socket and takes in whatever answers have come; between
slots it waits on the socket until the next tick is due. Neither ever waits
for the other: the child reads the socket and runs the gRPC stream on its
own core time, so answers are read off the network while the control loop
is busy, even when it runs behind. A
:class:`~edgerl.robot_client.sim_worker.SimWorker` with ``network_process``
uses the same child: it writes each env group's observations and waits on the
socket for their actions, so the gRPC client's work leaves the worker's core.

This module holds both ends' frame codec and the child, which runs a
:class:`~edgerl.robot_client.keeper.StreamKeeper`. Frames are a
little-endian ``u32`` length and a payload whose first byte is its kind:

- ``C`` (control → child, first): the child's settings, JSON.
- ``O`` (control → child): ``epoch, rows, obs_size`` (``u32``), then the
  rows' env ids (``i32``), observations (``f32``), rewards (``f32``) and
  terminated / truncated / fallback flags (``u8`` each, row by row).
- ``U`` / ``D`` (child → control): the stream of ``epoch`` (``u32``) is up /
  failed; observations of another epoch than the open stream's are dropped.
  A ``D`` frame goes on with the failure, UTF-8: its gRPC status name (empty
  for a failure with none), a newline, the message.
- ``A`` (child → control): ``epoch, rows`` (``u32``), ``policy_version``
  (``i64``), the action shape of one row (``u8`` count, ``u32`` each), then the
  actions (``f32``) and log-probabilities (``f32``). Answers come in the order
  of the rows sent, so the control end matches them by position.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass

import numpy as np

from edgerl.robot_client import errors
from edgerl.robot_client.client import Actions
from edgerl.robot_client.keeper import ObsRows, StreamKeeper, StreamSettings, concat_rows

LENGTH = struct.Struct("<I")
CONFIG, OBS, UP, DOWN, ANSWER = b"C", b"O", b"U", b"D", b"A"
_OBS = struct.Struct("<cIII")
_STATE = struct.Struct("<cI")
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
    return epoch, ObsRows(ids, obs, rewards, flags)


def encode_state(kind: bytes, epoch: int) -> bytes:
    return frame(_STATE.pack(kind, epoch))


def decode_state(payload: bytes) -> int:
    epoch: int = _STATE.unpack_from(payload)[1]
    return epoch


def encode_down(epoch: int, error: errors.EdgeRLError) -> bytes:
    code = error.code.name if isinstance(error, errors.RpcError) else ""
    details = error.details if isinstance(error, errors.RpcError) else str(error)
    return frame(_STATE.pack(DOWN, epoch) + f"{code}\n{details}".encode())


def decode_down(payload: bytes) -> tuple[int, errors.EdgeRLError]:
    """The epoch of a ``D`` frame and the named error it reports."""
    code, _, details = payload[_STATE.size :].decode(errors="replace").partition("\n")
    return decode_state(payload), errors.from_code(code, details)


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
    size = rows * int(np.prod(row_shape, dtype=np.int64))
    actions = np.frombuffer(payload, np.float32, size, at).reshape(rows, *row_shape)
    at += 4 * size
    log_probs = np.frombuffer(payload, np.float32, rows, at)
    return AnswerRows(epoch, version, actions, log_probs)


def encode_settings(settings: StreamSettings) -> bytes:
    return frame(CONFIG + json.dumps(dataclasses.asdict(settings)).encode())


def decode_settings(payload: bytes) -> StreamSettings:
    fields = json.loads(payload[1:])
    fields["obs_shape"] = tuple(fields["obs_shape"])
    fields["cpus"] = tuple(fields["cpus"])
    return StreamSettings(**fields)


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


async def _main(sock: socket.socket) -> None:
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    (n,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    cfg = decode_settings(await reader.readexactly(n))
    logging.basicConfig(level=cfg.log_level, format="%(levelname)s %(name)s[net]: %(message)s")
    # Started from the control thread (a restart), it would inherit that thread's CPU and
    # real-time priority: the network process takes neither.
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    if cfg.cpus:  # every thread so far (numpy's among them); gRPC's, started later, inherit it
        for task in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(task), cfg.cpus)

    def answer(epoch: int, a: Actions) -> None:
        writer.write(encode_answer(epoch, a.policy_version, a.actions, a.log_probs))

    def up(epoch: int) -> None:
        writer.write(encode_state(UP, epoch))

    def down(epoch: int, error: errors.EdgeRLError) -> None:
        writer.write(encode_down(epoch, error))

    keeper = StreamKeeper(cfg, concat_rows, up, down, answer)

    async def read_control() -> None:
        """Hand the observations on; stop when the control end closes."""
        try:
            while True:
                (n,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
                payload = await reader.readexactly(n)
                if payload[:1] == OBS:
                    keeper.offer(*decode_obs(payload))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            keeper.stopping.set()

    control = asyncio.ensure_future(read_control())
    try:
        await keeper.run()
    finally:
        control.cancel()
        writer.close()


def spawn() -> tuple[socket.socket, subprocess.Popen[bytes]]:
    """Start a network process; returns its end of the socket pair (non-blocking) and the process.

    Write :func:`encode_settings` to the socket first."""
    parent, child = socket.socketpair()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgerl.robot_client.netproc", str(child.fileno())],
            pass_fds=(child.fileno(),),
        )
    finally:
        child.close()
    parent.setblocking(False)
    return parent, proc


def stop(sock: socket.socket, proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """Close the socket; the network process sees it close, closes its stream and exits
    (killed if it has not within ``timeout_s``)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    sock.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m edgerl.robot_client.netproc FD``: serve the socket inherited as ``FD``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m edgerl.robot_client.netproc FD (started by a RobotHost)", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=int(args[0]))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(sock))
    return 0


if __name__ == "__main__":
    sys.exit(main())
