"""The control loop: one thread ticking one or more watchdogs on absolute deadlines."""

from __future__ import annotations

import heapq
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from edgerl.watchdog.clock import Clock
from edgerl.watchdog.watchdog import Watchdog

log = logging.getLogger(__name__)


@dataclass(order=True)
class _Due:
    when: float
    order: int
    index: int = field(compare=False)
    t0: float = field(compare=False)
    dog: Watchdog = field(compare=False)


def slot_count(members: int, per_slot: int) -> int:
    """Slots for ``members`` ticked at most ``per_slot`` back to back."""
    return -(-members // per_slot)


def slot_index(i: int, n: int, slots: int) -> int:
    """The slot (0 to ``slots - 1``) of member ``i`` of ``n``: the slots share the members evenly
    and start at even offsets over the period."""
    return i * slots // n


class ControlLoop:
    """One thread that ticks one or more watchdogs, each on its own absolute schedule.

    The watchdogs are split into ``slots`` evenly spread over the period:
    watchdog ``i`` of ``n`` ticks at ``t0 + (i * slots // n) / (slots * hz) + k / hz``.
    Watchdogs of one slot tick back to back; ``slots=n`` (the default) gives
    every watchdog its own slot. ``after_slot`` runs after the ticks that were
    due together, before the loop sleeps (a host flushes the observations of
    the slot in one message there); then ``idle(seconds)`` is called until the
    next slot is due. A tick found more than one period late skips to the
    next due time on its grid; the skipped ticks are counted as loop deadline
    misses.

    While the loop runs behind (after a stall every slot is due at once, so
    there is no idle time), a host's stream goes unserved until the loop has
    caught up: on a noisy machine up to 130 ms, with every robot falling back
    meanwhile. With ``poll_behind_s > 0``, ``after_slot`` and one
    ``idle(0.0)`` still run that often while behind, so a host sends what
    its robots queued and takes in the answers that came meanwhile. That
    trades fallbacks for later and skipped ticks (the network work that
    piled up runs in front of overdue ticks), so it is off by default.
    """

    def __init__(
        self,
        watchdogs: Sequence[Watchdog],
        *,
        clock: Clock | None = None,
        name: str = "control",
        slots: int = 0,
        after_slot: Callable[[], None] | None = None,
        idle: Callable[[float], None] | None = None,
        realtime_priority: int = 0,
        poll_behind_s: float = 0.0,
    ) -> None:
        if not watchdogs:
            raise ValueError("a control loop needs at least one watchdog")
        self.watchdogs = list(watchdogs)
        self.slots = slots or len(self.watchdogs)
        if not 1 <= self.slots <= len(self.watchdogs):
            raise ValueError(f"slots must be in [1, {len(self.watchdogs)}], got {slots}")
        self.after_slot = after_slot
        self.idle = idle
        if not 0 <= realtime_priority <= 99:
            raise ValueError(f"realtime_priority must be in [0, 99], got {realtime_priority}")
        self.realtime_priority = realtime_priority
        if poll_behind_s < 0:
            raise ValueError(f"poll_behind_s must be >= 0 (0: never while behind), got {poll_behind_s}")
        self.poll_behind_s = poll_behind_s
        self.clock: Clock = clock or self.watchdogs[0].clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def run_for(self, ticks: int) -> None:
        """Run in the calling thread until every watchdog ran ``ticks`` more ticks (tests, fake clock)."""
        self._run(max_ticks=ticks)

    def _make_realtime(self) -> None:
        """Best effort: SCHED_FIFO for this thread, so that other processes cannot delay a tick."""
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(self.realtime_priority))
        except (OSError, AttributeError) as exc:
            log.warning("control loop runs without real-time priority (%s)", exc)

    def _run(self, max_ticks: int = 0) -> None:
        if self.realtime_priority:
            self._make_realtime()
        try:
            self._loop(max_ticks)
        except BaseException as exc:
            self.error = exc
            log.exception("control loop %s stopped", self._thread.name)
            raise

    def _loop(self, max_ticks: int) -> None:
        start = self.clock.now()
        n = len(self.watchdogs)
        heap = []
        for i, dog in enumerate(self.watchdogs):
            t0 = start + slot_index(i, n, self.slots) * dog.config.period_s / self.slots
            k = dog.next_tick_index
            heap.append(_Due(t0, i, k, t0 - k * dog.config.period_s, dog))
        heapq.heapify(heap)
        done = 0
        served = start  # when the idle hook last ran
        while not self._stop.is_set():
            due = heap[0]
            now = self.clock.now()
            if due.when > now:
                if self.after_slot is not None:
                    self.after_slot()
                if self.idle is None:
                    self.clock.sleep_until(due.when, self._stop)
                else:
                    while not self._stop.is_set() and (left := due.when - self.clock.now()) > 0:
                        self.idle(left)
                    served = due.when  # the idle hook ran until then
            elif self.idle is not None and self.poll_behind_s and now - served >= self.poll_behind_s:
                if self.after_slot is not None:
                    self.after_slot()
                self.idle(0.0)  # behind: no wait, but what is ready goes out and comes in
                served = self.clock.now()
            if self._stop.is_set():
                return
            now = self.clock.now()
            period = due.dog.config.period_s
            late = int((now - due.when) / period)
            if late > 0:
                due.dog.missed(late)
                due.index += late
                due.when = due.t0 + due.index * period
            due.dog.tick(due.index, due.when, now)
            due.index += 1
            due.when = due.t0 + due.index * period
            heapq.heapreplace(heap, due)
            done += 1
            if max_ticks and done >= max_ticks * n:
                if self.after_slot is not None:
                    self.after_slot()
                return
