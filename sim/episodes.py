"""Finished episodes kept in bounded memory, for a run's progress and summary."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

#: Episodes an :class:`EpisodeLog` keeps at each end of a run (returns and lengths).
KEEP = 100


class EpisodeLog:
    """How many episodes finished, and the returns and lengths of the first and the last
    ``keep`` of them: what a progress bar and a run's summary show (the mean return of the first
    and of the last 20), in memory that does not grow with the run.

    A run on an env whose episodes are short finishes thousands a second (InvertedPendulum-v5
    under a random policy: 3,500), and the lists of every episode that a fleet and each of its
    workers once kept grew by ~200 KB a second each, for good.
    """

    def __init__(self, keep: int = KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.count = 0
        self._first: list[tuple[float, int]] = []
        self._last: deque[tuple[float, int]] = deque(maxlen=keep)

    def add(self, ret: float, length: int) -> None:
        """One more episode, of return ``ret`` and ``length`` steps."""
        self.count += 1
        if len(self._first) < self.keep:
            self._first.append((ret, length))
        self._last.append((ret, length))

    def extend(self, episodes: Iterable[tuple[float, int]]) -> None:
        """More episodes, as (return, length), in the order they finished."""
        for ret, length in episodes:
            self.add(ret, length)

    def __len__(self) -> int:
        return self.count

    def first_returns(self, n: int) -> list[float]:
        """The returns of the first ``n`` episodes (fewer while fewer finished)."""
        return [r for r, _ in self._first[: self._checked(n)]]

    def last_returns(self, n: int) -> list[float]:
        """The returns of the last ``n`` episodes, oldest first (fewer while fewer finished)."""
        return [r for r, _ in list(self._last)[-self._checked(n) :]]

    def last_lengths(self, n: int) -> list[int]:
        """The lengths of the last ``n`` episodes, oldest first (fewer while fewer finished)."""
        return [length for _, length in list(self._last)[-self._checked(n) :]]

    def _checked(self, n: int) -> int:
        if not 1 <= n <= self.keep:
            raise ValueError(f"n must be in [1, keep={self.keep}], got {n}")
        return n
