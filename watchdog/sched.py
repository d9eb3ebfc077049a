"""Linux scheduling policies for threads, set best effort; and the stop signals a process
leaves to the process that started it.

The control loop's thread asks for ``SCHED_FIFO`` (see :mod:`edgerl.watchdog.loop`); the helpers
here serve the threads around it: an inference thread that must not preempt the event loop's
thread on waking, a sim worker's gRPC threads that must not preempt its env-stepping thread, and a
backfill worker that runs only on CPU time nothing else wants. Each does nothing where the policy
is missing (not Linux) or a thread has ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Ctrl-C, what ``kill``, ``timeout``, ``systemctl stop`` and ``docker stop`` send, and the
hangup of a command's terminal (an SSH session that drops). A command stops on each as on
Ctrl-C; the processes it starts ignore them (:func:`leave_stop_signals`)."""


def leave_stop_signals() -> None:
    """Ignore :data:`STOP_SIGNALS` in this process, which the process that started it stops in its
    own way (a message, a flag, a socket closing, a signal of its own). A terminal's Ctrl-C and
    hangup, ``timeout``, ``kill -- -PGID`` and ``systemctl stop`` send them to every process of a
    command at once: they are the command's, which stops its processes in its order."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


__all__ = ["for_each_thread", "idle_priority", "no_wakeup_preemption", "thread_ids"]


def thread_ids(pid: int = 0) -> list[int]:
    """Native ids of the threads of process ``pid`` (0: this one); empty where ``/proc`` is missing
    or the process has ended. One may end right after the listing."""
    try:
        return [int(name) for name in os.listdir(f"/proc/{pid or 'self'}/task")]
    except OSError:
        return []


def for_each_thread(fn: Callable[[int], object]) -> None:
    """Call ``fn(tid)`` for each thread of this process, skipping one that ended meanwhile
    (``ProcessLookupError``); any other error is raised."""
    for tid in thread_ids():
        with contextlib.suppress(ProcessLookupError):
            fn(tid)


def no_wakeup_preemption(tid: int = 0) -> None:
    """Give thread ``tid`` (0: the calling thread) the SCHED_BATCH policy: it keeps its fair
    share of the CPU but does not preempt the thread running when it wakes.

    An inference thread wakes for each batch while the event loop's thread is still handing
    out the last batch's answers and reading new requests; preempting it, the forward pass
    held those back by a whole batch's time, and the clients' next requests with them. With the
    server on one CPU (``mlp-large``, 64 envs, double-buffered, over the local Act socket) the
    server's core sat idle 6-7 % of the time for want of requests; with this thread SCHED_BATCH
    it ran full, at 7-8 % more env steps/s (2 alternated pairs), and with the next batch also
    started after the answers (see ``DynamicBatcher._start``) at 8-12 % more; over gRPC both
    gave 3 %.
    """
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))


def idle_priority() -> None:
    """Put every thread of this process, and those started from now on, under the SCHED_IDLE
    policy: they run only on CPU time no other thread wants."""
    try:
        policy, param = os.SCHED_IDLE, os.sched_param(0)
    except AttributeError:  # not Linux
        return

    def idle(tid: int) -> None:  # one thread refusing leaves the others to be set
        with contextlib.suppress(OSError):
            os.sched_setscheduler(tid, policy, param)

    for_each_thread(idle)
