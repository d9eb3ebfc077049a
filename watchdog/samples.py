"""Fixed windows of float samples for the watchdog's percentiles."""

from __future__ import annotations

import math

import numpy as np


class Samples:
    """The last ``size`` float samples, in a preallocated numpy ring.

    Unlike a deque of floats it holds no Python objects: with 100 robots a
    deque-based window kept ~1M of them alive, and every full garbage
    collection walked them while the control loop waited.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._buf = np.zeros(size, np.float64)
        self._next = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def append(self, value: float) -> None:
        self._buf[self._next] = value
        self._next = (self._next + 1) % len(self._buf)
        self._count = min(self._count + 1, len(self._buf))

    def clear(self) -> None:
        self._next = self._count = 0

    def values(self) -> np.ndarray:
        """The samples held (oldest first)."""
        if self._count < len(self._buf):
            return self._buf[: self._count].copy()
        return np.concatenate([self._buf[self._next :], self._buf[: self._next]])

    def percentile_ms(self, q: float) -> float:
        """The ``q``-th percentile of samples in seconds, in milliseconds; NaN when empty."""
        return float(np.percentile(self.values(), q) * 1e3) if self._count else math.nan
