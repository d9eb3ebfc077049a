"""Replicas of a policy, each in a process of its own, taking batches side by side.

Triton's instance groups, for a CPU-bound policy: one vLLM engine runs its
steps on one core (two torch threads made a 64-prompt batch slower here,
48.7 against 38.4 ms), so on a machine with more cores one engine leaves
them idle. With ``replicas=N`` the batcher keeps up to N batches in flight,
one per replica; a sim worker with N env groups then has every group's batch
running at once while the others step their envs.

Each replica is a child process (``python -m edgerl.edge_server.replicas``,
started with :mod:`subprocess`, so a daemonic server process may start it)
that builds its backend from a picklable factory and answers calls over a
socket pair: ``infer``, ``load_weights`` (sent to every replica between two
batches, so one version serves every batch) and ``warmup``. A replica that
dies fails the calls that need it with a clear error, never a hang.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from edgerl.edge_server.backend import PolicyBackend, PolicyResult
from edgerl.watchdog.sched import leave_stop_signals

log = logging.getLogger(__name__)

#: How long a replica may take to build its backend (a vLLM engine takes ~10 s here).
START_TIMEOUT_S = 600.0
#: How long a replica may take to stop before it is killed.
STOP_TIMEOUT_S = 15.0


class ReplicaError(RuntimeError):
    """A replica process failed to start or died."""


class _Replica:
    """One child process and its end of the socket pair."""

    def __init__(self, index: int, factory: Callable[[int], PolicyBackend]) -> None:
        self.index = index
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "edgerl.edge_server.replicas", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send((factory, index))

    def ready(self, timeout_s: float) -> dict[str, Any]:
        """The backend's description once the replica has built it."""
        if not self.conn.poll(timeout_s):
            raise ReplicaError(f"policy replica {self.index} did not start within {timeout_s:g}s")
        info: dict[str, Any] = self.call_reply()
        return info

    def call(self, *msg: Any) -> Any:
        try:
            self.conn.send(msg)
        except OSError as exc:
            raise self.died() from exc
        return self.call_reply()

    def call_reply(self) -> Any:
        try:
            ok, value = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise self.died() from exc
        if not ok:
            raise value
        return value

    def died(self) -> ReplicaError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1.0)
        return ReplicaError(f"policy replica {self.index} exited (code {self.proc.returncode})")

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("close",))
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("policy replica %d did not stop within %.0fs; killing it", self.index, STOP_TIMEOUT_S)
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


class ReplicatedBackend(PolicyBackend):
    """``replicas`` copies of the backend ``factory`` builds, each in a child process.

    Args:
        factory: ``factory(index)`` builds replica ``index``'s backend in its process; it must
            pickle (a module-level function, or a :func:`functools.partial` of one) and build
            the same policy for every index (its own sampling seed is welcome).
        replicas: child processes (>= 1).
        start_timeout_s: how long each may take to build its backend.

    Raises:
        ReplicaError: a replica failed to start (the others are stopped).
    """

    def __init__(
        self,
        factory: Callable[[int], PolicyBackend],
        replicas: int,
        *,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self._replicas: list[_Replica] = []
        try:
            for i in range(replicas):  # all started, then built side by side
                self._replicas.append(_Replica(i, factory))
            infos = [r.ready(start_timeout_s) for r in self._replicas]
        except BaseException:
            self._stop_all()
            raise
        info = infos[0]
        super().__init__(
            info["obs_shape"], info["act_shape"], info["act_low"], info["act_high"], info["version"]
        )
        self.name = f"{info['name']}-x{replicas}"
        self.chunk = info["chunk"]
        self.weights_values = info["weights_values"]
        self.pipeline_depth = replicas
        # the replicas not answering a batch; None once none is alive (wakes every waiter)
        self._free: queue.SimpleQueue[_Replica | None] = queue.SimpleQueue()
        for r in self._replicas:
            self._free.put(r)
        self._alive = list(self._replicas)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def replicas(self) -> int:
        """Replicas alive."""
        return len(self._alive)

    def infer(self, obs: np.ndarray) -> PolicyResult:
        """Actions for ``obs`` from the next free replica (blocks while all are busy).

        Raises:
            ReplicaError: the replica died answering (the others serve on) or none is alive.
        """
        while True:
            replica = None if self._closed else self._free.get()
            if replica is None:
                self._free.put(None)
                raise ReplicaError("no policy replica is alive" + (" (closed)" if self._closed else ""))
            with self._lock:
                if replica in self._alive:
                    break
            # found dead while it was free (by load_weights): out of the queue, no batch fails on it
        try:
            result: PolicyResult = replica.call("infer", obs)
        except ReplicaError:
            self._lose(replica)
            raise
        except BaseException:
            self._free.put(replica)
            raise
        self._free.put(replica)
        return result

    def _lose(self, replica: _Replica) -> None:
        with self._lock:
            if replica not in self._alive:
                return
            self._alive.remove(replica)
            left = len(self._alive)
        log.error("policy replica %d exited; %d of %d serve on", replica.index, left, len(self._replicas))
        if not left:
            self._free.put(None)

    def load_weights(self, weights: dict[str, np.ndarray], version: int) -> None:
        """Load ``weights`` into every live replica; the batcher calls this with no batch running.

        A tensor that is missing, unknown or misshapen fails in the first replica, before
        any other has changed. A replica that dies meanwhile is dropped.
        """
        for i, replica in enumerate(list(self._alive)):
            try:
                replica.call("load_weights", weights, version)
            except ReplicaError:
                self._lose(replica)
            except (KeyError, ValueError):
                if i == 0:
                    raise  # nothing changed: the served weights stay as they were
                raise ReplicaError(
                    f"policy replica {replica.index} refused weights that another took"
                ) from None
        if not self._alive:
            raise ReplicaError("no policy replica is alive")
        self.version = version

    def warmup(self, rows: int = 8) -> None:
        for replica in self._alive:
            replica.call("warmup", rows)

    def close(self) -> None:
        """Stop every replica; calls after this fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._alive = []
        self._free.put(None)
        self._stop_all()

    def _stop_all(self) -> None:
        for replica in self._replicas:
            replica.stop()


def _serve(conn: Connection) -> None:
    """A replica's life: build the backend, then answer calls until ``close`` or EOF."""
    try:
        factory, index = conn.recv()
    except EOFError:  # the server went before sending it
        return
    try:
        backend: PolicyBackend = factory(index)
        backend.init_thread()
    except Exception as exc:
        log.exception("policy replica %d failed to build its backend", index)
        conn.send((False, ReplicaError(f"policy replica {index} failed to build its backend: {exc!r}")))
        return
    conn.send(
        (
            True,
            {
                "name": backend.name,
                "chunk": backend.chunk,
                "weights_values": backend.weights_values,
                "obs_shape": backend.obs_shape,
                "act_shape": backend.act_shape,
                "act_low": backend.act_low,
                "act_high": backend.act_high,
                "version": backend.version,
            },
        )
    )
    calls: dict[str, Callable[..., Any]] = {
        "infer": backend.infer,
        "load_weights": backend.load_weights,
        "warmup": backend.warmup,
    }
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the server is gone
                return
            if msg[0] == "close":
                return
            try:
                reply = (True, calls[msg[0]](*msg[1:]))
            except Exception as exc:  # handed to the caller, named as raised
                reply = (False, exc)
            try:
                conn.send(reply)
            except Exception as exc:  # an exception that does not pickle
                conn.send((False, RuntimeError(f"policy replica: {reply[1]!r} ({exc})")))
    finally:
        backend.close()


if __name__ == "__main__":
    # The server owns this process and closes it (its "close" message, or its end of the pipe
    # closing). Ctrl-C, a terminal's hangup and the SIGTERM that `timeout` or `systemctl stop` send
    # to every process of the server's command are the server's: it finishes its batches on this
    # replica first.
    leave_stop_signals()
    logging.basicConfig(level=logging.WARNING)
    # run as the module, not as __main__, so that what it sends unpickles in the server
    from edgerl.edge_server import replicas

    replicas._serve(Connection(int(sys.argv[1])))
