"""Finished episodes kept in bounded memory, for a run's progress and summary."""

from __future__ import annotations

from collections.abc import Iterable

from edgerl.watchdog.samples import Samples

#: Episodes an :class:`EpisodeLog` keeps at each end of a run (returns and lengths).
KEEP = 100


class EpisodeLog:
    """How many episodes finished, the returns of the first ``keep`` of them, and the returns and
    lengths of the last ``keep``: what a progress bar and a run's summary show (the mean return
    of the first and of the last 20), in memory that does not grow with the run. The last ones
    are :class:`~edgerl.watchdog.samples.Samples` rings, which hold no Python object an episode
    (a robot host keeps one log per robot beside its control loop).

    A run on an env whose episodes are short finishes thousands a second (InvertedPendulum-v5
    under a random policy: 3,500), and the lists of every episode that a fleet and each of its
    workers once kept grew by ~200 KB a second each, for good.
    """

    def __init__(self, keep: int = KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.count = 0
        self._first: list[float] = []
        self._last_returns = Samples(keep)
        self._last_lengths = Samples(keep)

    def add(self, ret: float, length: int) -> None:
        """One more episode, of return ``ret`` and ``length`` steps."""
        self.count += 1
        if len(self._first) < self.keep:
            self._first.append(float(ret))
        self._last_returns.append(ret)
        self._last_lengths.append(length)

    def extend(self, episodes: Iterable[tuple[float, int]]) -> None:
        """More episodes, as (return, length), in the order they finished."""
        for ret, length in episodes:
            self.add(ret, length)

    def __len__(self) -> int:
        return self.count

    def first_returns(self, n: int) -> list[float]:
        """The returns of the first ``n`` episodes (fewer while fewer finished)."""
        return self._first[: self._checked(n)]

    def last_returns(self, n: int) -> list[float]:
        """The returns of the last ``n`` episodes, oldest first (fewer while fewer finished)."""
        return [float(r) for r in self._last_returns.values()[-self._checked(n) :]]

    def last_lengths(self, n: int) -> list[int]:
        """The lengths of the last ``n`` episodes, oldest first (fewer while fewer finished)."""
        return [int(length) for length in self._last_lengths.values()[-self._checked(n) :]]

    def _checked(self, n: int) -> int:
        if not 1 <= n <= self.keep:
            raise ValueError(f"n must be in [1, keep={self.keep}], got {n}")
        return n
