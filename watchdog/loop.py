"""The control loop: one thread ticking one or more watchdogs on absolute deadlines."""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from edgerl.watchdog.clock import Clock
from edgerl.watchdog.watchdog import Watchdog

log = logging.getLogger(__name__)

WIND_DOWN_MAX_S = 2.0
"""The longest a control loop that failed goes on ticking its watchdogs toward their stop action."""


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
    every watchdog its own slot. ``after_slot`` runs after the ticks of each
    slot, also while the loop runs behind (a robot host sends the slot's
    observations and takes in the answers that came meanwhile there, without
    waiting); then, if the next slot is not yet due, ``idle(seconds)`` is
    called until it is. A tick found more than one period late skips to the
    next due time on its grid; the skipped ticks are counted as loop deadline
    misses.

    A loop that fails (an error in ``after_slot``, ``idle`` or a tick, or an
    interrupt in :meth:`run_for`) does not leave its robots where the error
    found them: it latches an e-stop on every watchdog and goes on ticking
    them on their schedule, without ``after_slot`` or ``idle`` (the error may
    be theirs), until each has applied its stop action (rate-limited as
    always: a few ticks by default), for at most ``WIND_DOWN_MAX_S``. Then it
    ends with the error, kept in ``error``.
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
        self.clock: Clock = clock or self.watchdogs[0].clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run_thread, name=name, daemon=True)
        self.error: BaseException | None = None
        self._heap: list[_Due] = []  # the running loop's next tick of each watchdog

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
        """Best effort: SCHED_FIFO for this thread, so that other processes cannot delay a tick.

        A process started from the thread (a robot host's new network process) starts under the
        normal policy: at this thread's priority, its start-up (~0.15 s of imports) would hold a
        CPU from every normal thread, and from this one where they share it."""
        try:
            policy = os.SCHED_FIFO | os.SCHED_RESET_ON_FORK
            os.sched_setscheduler(0, policy, os.sched_param(self.realtime_priority))
        except (OSError, AttributeError) as exc:
            log.warning("control loop runs without real-time priority (%s)", exc)

    def _run(self, max_ticks: int = 0) -> None:
        if self.realtime_priority:
            self._make_realtime()
        try:
            self._loop(max_ticks)
        except BaseException as exc:
            log.exception("control loop %s stopped", self._thread.name)
            try:
                self._wind_down()
            except Exception:
                log.exception("control loop %s: the e-stop after it failed", self._thread.name)
            finally:
                self.error = exc  # set once the loop is over: no tick of it runs after this
            raise

    def _run_thread(self) -> None:
        """The loop's thread: an error ends it, kept in ``error`` and logged once by ``_run``
        (not a second time by the thread's excepthook)."""
        with contextlib.suppress(BaseException):
            self._run()

    def _schedule(self) -> list[_Due]:
        """Every watchdog's next tick, its slot's offset from now, as a heap."""
        start = self.clock.now()
        n = len(self.watchdogs)
        heap = []
        for i, dog in enumerate(self.watchdogs):
            t0 = start + slot_index(i, n, self.slots) * dog.config.period_s / self.slots
            k = dog.next_tick_index
            heap.append(_Due(t0, i, k, t0 - k * dog.config.period_s, dog))
        heapq.heapify(heap)
        return heap

    def _tick(self, due: _Due) -> float:
        """Run ``due``'s tick (skipping ahead on its grid if it is more than a period late), move
        it to its next one and return the time the tick was due."""
        now = self.clock.now()
        period = due.dog.config.period_s
        late = int((now - due.when) / period)
        if late > 0:
            due.dog.missed(late)
            due.index += late
            due.when = due.t0 + due.index * period
        slot = due.when
        due.dog.tick(due.index, slot, now)
        due.index += 1
        due.when = due.t0 + due.index * period
        return slot

    def _wind_down(self) -> None:
        """Latch an e-stop on every watchdog and tick each until it applied its stop action."""
        n = len(self.watchdogs)
        for dog in self.watchdogs:
            dog.estop()
        log.error("control loop %s: e-stopping its %d watchdog(s), for at most %gs",
                  self._thread.name, n, WIND_DOWN_MAX_S)  # fmt: skip
        # on the grid the loop ran on (a new one from now if it failed before it had one)
        heap = [due for due in (self._heap or self._schedule()) if not due.dog.at_stop_action]
        heapq.heapify(heap)
        end = self.clock.now() + WIND_DOWN_MAX_S
        never = threading.Event()  # a stop() meanwhile does not cut this short: it is bounded
        while heap and heap[0].when <= end:
            due = heap[0]
            self.clock.sleep_until(due.when, never)
            try:
                self._tick(due)
            except Exception:
                log.exception("control loop %s: watchdog %d failed to tick; left as it is",
                              self._thread.name, due.order)  # fmt: skip
                heapq.heappop(heap)
                continue
            if due.dog.at_stop_action:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, due)
        if heap:
            log.error("control loop %s: %d of %d watchdog(s) did not reach their stop action",
                      self._thread.name, len(heap), n)  # fmt: skip

    def _loop(self, max_ticks: int) -> None:
        self._heap = heap = self._schedule()
        n = len(heap)
        done = 0
        while not self._stop.is_set():
            due = heap[0]
            if self.idle is None:
                self.clock.sleep_until(due.when, self._stop)
            else:
                while not self._stop.is_set() and (left := due.when - self.clock.now()) > 0:
                    self.idle(left)
            if self._stop.is_set():
                return
            slot = self._tick(due)
            heapq.heapreplace(heap, due)
            done += 1
            last = bool(max_ticks) and done >= max_ticks * n
            if self.after_slot is not None and (last or heap[0].when != slot):
                self.after_slot()  # the slot's ticks are done
            if last:
                return
