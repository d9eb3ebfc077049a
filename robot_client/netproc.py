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

This module holds the child, which runs a
:class:`~edgerl.robot_client.keeper.StreamKeeper`, and the frames that name
errors and carry settings; the rest of the frame codec is
:mod:`edgerl.proto.frames`. Observations of another epoch than the open
stream's are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys

from edgerl.proto.frames import (
    CONFIG,
    HEARTBEAT,
    LENGTH,
    OBS,
    STEPPED,
    UP,
    decode_failure,
    decode_obs,
    encode_answer,
    encode_failure,
    encode_state,
    frame,
)
from edgerl.robot_client import errors
from edgerl.robot_client.client import Actions
from edgerl.robot_client.keeper import StreamKeeper, StreamSettings, concat_rows
from edgerl.watchdog.sched import for_each_thread, leave_stop_signals

RESTART_DELAY_S = 1.0
"""Network processes of one robot host or sim worker start at least this long apart (seconds): a
lost one is replaced at once, or this long after the one before it started, so that one that
keeps failing is not restarted in a tight loop."""
HUNG_AFTER_S = 0.25
"""A network process that has written nothing, heartbeats included, for this long (seconds)
while its client waits on it (a robot host: with observations unanswered; a sim worker: from its
first observations on) is taken for hung, and killed: a live one writes something at least
every :data:`HEARTBEAT_S` (a heartbeat when it has nothing else to say), also while it waits on
the server. A robot host whose robots would e-stop sooner waits less (:func:`hung_after`). A
robot host whose server answered 0.9 s late heard nothing from its live network process for
61 ms at most (40 s, three busy loops on this 2-core machine). A process taken for hung by
mistake costs a robot host's robots the few fallbacks of a spare's take-over, a sim worker
~0.2 s to start another."""
HEARTBEATS_PER_HUNG = 5
"""The silence after which a network process is hung holds this many of its heartbeat intervals."""
HEARTBEAT_S = HUNG_AFTER_S / HEARTBEATS_PER_HUNG
"""A network process that has written nothing for this long (seconds) writes a heartbeat frame,
from its event loop, unless its settings name another interval (``StreamSettings.heartbeat_s``):
answers that come faster leave no room for heartbeats."""
MIN_HUNG_AFTER_S = 0.1
"""The shortest silence a robot host takes a network process for hung after (seconds), its
heartbeat then every 0.02 s: with that heartbeat and a server answering 0.9 s late, a robot host
heard nothing from its live network process for 27 ms at most (two 40 s runs under three busy
loops on this 2-core machine; 20 ms without them)."""
ESTOP_SHARE = 0.5
"""A robot host takes a silent network process for hung after at most this share of the time its
robots take to e-stop on fallbacks, so that the spare takes over well before the e-stop."""


def hung_after(hz: float, estop_after: int) -> float:
    """The silence (seconds) after which a robot host whose robots tick at ``hz`` and e-stop after
    ``estop_after`` fallbacks in a row (0: never) takes its network process for hung:
    :data:`ESTOP_SHARE` of their time to e-stop, within [:data:`MIN_HUNG_AFTER_S`,
    :data:`HUNG_AFTER_S`] (0.25 s at 50 and 100 Hz, 0.125 s at 200 Hz, with the default e-stop
    of 50)."""
    if estop_after == 0:
        return HUNG_AFTER_S
    return min(HUNG_AFTER_S, max(MIN_HUNG_AFTER_S, ESTOP_SHARE * estop_after / hz))


def estop_riding_out_a_hang(hz: float) -> int:
    """The fewest fallbacks in a row (``estop_after``) after which robots ticking at ``hz`` may
    e-stop and still have :func:`hung_after` be their :data:`ESTOP_SHARE` of that time: below it,
    the bound is held at :data:`MIN_HUNG_AFTER_S` and a hang may e-stop them."""
    return math.ceil(MIN_HUNG_AFTER_S / ESTOP_SHARE * hz - 1e-9)


def next_start(started_at: float, now: float) -> tuple[float, str]:
    """When to replace a network process that started at ``started_at`` and was lost at ``now``
    (:data:`RESTART_DELAY_S`), and how a log line says it ("now", "in 0.40s", "in 0.04s")."""
    at = max(now, started_at + RESTART_DELAY_S)
    return at, f"in {at - now:.2f}s" if at - now >= 0.005 else "now"


def encode_down(epoch: int, error: errors.EdgeRLError) -> bytes:
    details = error.details if isinstance(error, errors.RpcError) else str(error)
    return encode_failure(epoch, errors.code_of(error), details)


def decode_down(payload: bytes) -> tuple[int, errors.EdgeRLError]:
    """The epoch of a ``D`` frame and the named error it reports."""
    epoch, code, details = decode_failure(payload)
    return epoch, errors.from_code(code, details)


def encode_settings(settings: StreamSettings) -> bytes:
    return frame(CONFIG + json.dumps(dataclasses.asdict(settings)).encode())


def decode_settings(payload: bytes) -> StreamSettings:
    fields = json.loads(payload[1:])
    fields["obs_shape"] = tuple(fields["obs_shape"])
    fields["cpus"] = tuple(fields["cpus"])
    if fields["act_shape"] is not None:
        fields["act_shape"] = tuple(fields["act_shape"])
    return StreamSettings(**fields)


async def _main(sock: socket.socket) -> None:
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        (n,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        cfg = decode_settings(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionError):  # its host ended (or gave it up) first
        writer.close()
        return
    logging.basicConfig(level=cfg.log_level, format="%(levelname)s %(name)s[net]: %(message)s")
    # Started from the control thread (a restart), it would inherit that thread's CPU and
    # real-time priority: the network process takes neither.
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    if cfg.cpus:  # every thread so far (numpy's among them); gRPC's, started later, inherit it
        for_each_thread(lambda tid: os.sched_setaffinity(tid, cfg.cpus))

    loop = asyncio.get_running_loop()
    wrote_at = loop.time()

    def write(data: bytes) -> None:
        nonlocal wrote_at
        writer.write(data)
        wrote_at = loop.time()

    def answer(epoch: int, a: Actions) -> None:
        write(encode_answer(epoch, a.policy_version, a.actions, a.log_probs))

    def up(epoch: int) -> None:
        write(encode_state(UP, epoch))

    def down(epoch: int, error: errors.EdgeRLError) -> None:
        write(encode_down(epoch, error))

    keeper = StreamKeeper(cfg, concat_rows, up, down, answer)

    async def read_control() -> None:
        """Hand the observations on; stop when the control end closes."""
        try:
            while True:
                (n,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
                payload = await reader.readexactly(n)
                if payload[:1] == OBS:
                    keeper.offer(*decode_obs(payload))
                elif payload[:1] == STEPPED:
                    keeper.stepped()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            keeper.stopping.set()

    beat_s, beat_frame = cfg.heartbeat_s or HEARTBEAT_S, frame(HEARTBEAT)

    async def heartbeat() -> None:
        """A heartbeat once ``beat_s`` has passed without a frame: answers flowing say as much."""
        while True:  # awaits on every turn, whatever the interval: never holds the loop
            await asyncio.sleep(max(0.0, wrote_at + beat_s - loop.time()))
            if loop.time() - wrote_at >= beat_s:
                write(beat_frame)

    control = asyncio.ensure_future(read_control())
    beat = asyncio.ensure_future(heartbeat())
    try:
        await keeper.run()
    finally:
        beat.cancel()
        control.cancel()
        writer.close()


def spawn(cpus: tuple[int, ...] = ()) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    """Start a network process, on ``cpus`` (empty: the caller's); returns its end of the socket
    pair (non-blocking) and the process.

    Write :func:`encode_settings` to the socket first."""
    parent, child = socket.socketpair()
    # Blocked in this thread while it starts the child, SIGUSR1 stays blocked in the child (the
    # mask survives fork and exec) until :func:`main` ignores it: an operator's reset sent to the
    # process group during the child's start-up would otherwise end it.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgerl.robot_client.netproc", str(child.fileno())],
            pass_fds=(child.fileno(),),
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        child.close()
    if cpus:  # at once: its start-up (~0.15 s of imports) is not run on the caller's CPU
        with contextlib.suppress(OSError):  # it ended already: seen on its socket
            os.sched_setaffinity(proc.pid, cpus)
    parent.setblocking(False)
    return parent, proc


class Spare:
    """A network process started ahead of need, for a client to take when it loses its own.

    Started, a network process spends ~0.15 s importing before it reads its settings; a spare has
    done that already, and has its stream up ~0.01 s after it gets them."""

    def __init__(self, cpus: tuple[int, ...] = ()) -> None:
        self._cpus = cpus
        self._held: tuple[socket.socket, subprocess.Popen[bytes]] | None = None

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The waiting spare's process; None: none is started."""
        return None if self._held is None else self._held[1]

    @property
    def pid(self) -> int | None:
        """The waiting spare's process id; None: none is started."""
        return None if self._held is None else self._held[1].pid

    def take(self) -> tuple[socket.socket, subprocess.Popen[bytes]]:
        """The spare, as :func:`spawn` returns it; a new process where there is none, or it ended."""
        held, self._held = self._held, None
        if held is not None:
            sock, proc = held
            if proc.poll() is None:
                return held
            sock.close()
        return spawn(self._cpus)

    def fill(self) -> None:
        """Start a spare, unless one waits already."""
        if self._held is None:
            self._held = spawn(self._cpus)

    def close(self) -> None:
        """End the spare, if any: it sees its socket close before its settings, and exits."""
        held, self._held = self._held, None
        if held is not None:
            stop(*held)


def kill(proc: subprocess.Popen[bytes]) -> int | None:
    """End ``proc`` at once if it still runs (SIGKILL, and reaped); the exit code it had ended
    with, or None where it was still running."""
    code = proc.poll()
    if code is None:
        proc.kill()
        proc.wait()
    return code


def stop(sock: socket.socket, proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """Close the socket; the network process sees it close, closes its stream and exits
    (killed if it has not within ``timeout_s``)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        kill(proc)
    sock.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m edgerl.robot_client.netproc FD``: serve the socket inherited as ``FD``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m edgerl.robot_client.netproc FD (started by a RobotHost)", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=int(args[0]))
    # `edgerl robot`'s operator reset, sent to its whole group: ignored, which drops one sent while
    # this process started (blocked since `spawn`), then let through again.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    # So are Ctrl-C, a terminal's hangup and the SIGTERM of `timeout` or `systemctl stop`, sent to
    # every process of the command: the robot host answers them by stopping its robots, then this
    # process (its socket closing), which carries their last requests meanwhile.
    leave_stop_signals()
    asyncio.run(_main(sock))
    return 0


if __name__ == "__main__":
    sys.exit(main())
