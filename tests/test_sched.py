"""Scheduling policies set on threads: listing them, SCHED_BATCH, SCHED_IDLE for a whole process."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import threading
from typing import Any

import pytest

from edgerl.watchdog.sched import for_each_thread, idle_priority, no_wakeup_preemption, thread_ids


def _held() -> tuple[threading.Thread, threading.Event]:
    """A started thread that waits until the returned event is set."""
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait()

    t = threading.Thread(target=hold)
    t.start()
    started.wait()
    return t, release


def _in_a_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_thread_ids_lists_this_process_threads_by_0_or_by_its_pid() -> None:
    t, release = _held()
    try:
        mine = thread_ids()
        assert threading.get_native_id() in mine and t.native_id in mine
        assert set(thread_ids(os.getpid())) == set(mine)
    finally:
        release.set()
        t.join()


def test_thread_ids_of_a_process_that_ended_is_empty() -> None:
    proc = mp.get_context("spawn").Process(target=int)
    proc.start()
    proc.join()
    assert proc.pid is not None and thread_ids(proc.pid) == []


def test_for_each_thread_skips_a_thread_that_ended_and_raises_any_other_error() -> None:
    seen: list[int] = []
    first = thread_ids()[0]

    def gone_then_seen(tid: int) -> None:
        if tid == first:
            raise ProcessLookupError(errno.ESRCH, "no such thread")
        seen.append(tid)

    t, release = _held()
    try:
        for_each_thread(gone_then_seen)
        assert first not in seen and t.native_id in seen

        def refused(tid: int) -> None:
            raise PermissionError(errno.EPERM, "not permitted")

        with pytest.raises(PermissionError):
            for_each_thread(refused)
    finally:
        release.set()
        t.join()


def test_no_wakeup_preemption_sets_sched_batch_on_the_calling_thread_only() -> None:
    def batch_then_read() -> int:
        no_wakeup_preemption()
        return os.sched_getscheduler(0)

    assert _in_a_thread(batch_then_read) == os.SCHED_BATCH
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_no_wakeup_preemption_of_a_thread_that_ended_does_nothing() -> None:
    t = threading.Thread(target=int)
    t.start()
    t.join()
    assert t.native_id is not None
    no_wakeup_preemption(t.native_id)  # the id names no thread now: ESRCH, suppressed
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def _idle_report(out: Any) -> None:
    before, release = _held()
    idle_priority()
    after = _in_a_thread(lambda: os.sched_getscheduler(0))
    assert before.native_id is not None
    out.put((os.sched_getscheduler(0), os.sched_getscheduler(before.native_id), after))
    release.set()
    before.join()


def test_idle_priority_covers_every_thread_and_those_started_later() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    proc = ctx.Process(target=_idle_report, args=(out,))  # it changes the whole process
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert out.get() == (os.SCHED_IDLE, os.SCHED_IDLE, os.SCHED_IDLE)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the test's own process is left as it was
