"""Clocks for the control loop: the real monotonic one and a fake one for tests."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """What the control loop needs of time."""

    def now(self) -> float:
        """Seconds on a monotonic scale."""
        ...

    def sleep_until(self, deadline: float, stop: threading.Event) -> None:
        """Return at ``deadline`` (or later), or as soon as ``stop`` is set."""
        ...


class MonotonicClock:
    """``time.monotonic()``; sleeps on an event so that a stop wakes the loop at once."""

    def now(self) -> float:
        return time.monotonic()

    def sleep_until(self, deadline: float, stop: threading.Event) -> None:
        remaining = deadline - time.monotonic()
        if remaining > 0:
            stop.wait(remaining)


class FakeClock:
    """A clock that only moves when told to; ``sleep_until`` jumps to the deadline.

    A loop run on it ticks as fast as the CPU allows, with exact tick times,
    so a test can drive hundreds of ticks in milliseconds. ``advance`` moves
    time forward by hand (e.g. to make an action stale).
    """

    def __init__(self, start: float = 0.0) -> None:
        self._t = start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"time cannot go back (dt={dt})")
        with self._lock:
            self._t += dt

    def sleep_until(self, deadline: float, stop: threading.Event) -> None:
        with self._lock:
            self._t = max(self._t, deadline)
