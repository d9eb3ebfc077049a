"""From received segments to a training batch: dedupe, reward scaling, episodes.

Segments of one env arrive in order (the server cuts and sends them in
order), so per-env state (discounted return for reward scaling, the running
episode) is carried from one segment to the next.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgerl.proto import tensors
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.sim.episodes import EpisodeLog

SegmentKey = tuple[str, int, int, int]
"""Identity of a segment's first transition: (session, env, episode, t)."""


def segment_key(seg: pb.Segment) -> SegmentKey:
    return (seg.session_id, seg.env_id, seg.episode, seg.t)


class Deduplicator:
    """Remembers the identities of the last ``capacity`` segments taken."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.capacity = capacity
        self._seen: set[SegmentKey] = set()
        self._order: collections.deque[SegmentKey] = collections.deque()
        self.duplicates = 0

    def first_time(self, seg: pb.Segment) -> bool:
        """True the first time a segment identity is seen; counts the repeats."""
        key = segment_key(seg)
        if key in self._seen:
            self.duplicates += 1
            return False
        self._seen.add(key)
        self._order.append(key)
        if len(self._order) > self.capacity:
            self._seen.discard(self._order.popleft())
        return True


class RunningMeanStd:
    """Scalar running mean/variance (parallel Welford), as gymnasium's NormalizeReward keeps."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def update(self, x: np.ndarray) -> None:
        n = x.size
        if n == 0:
            return
        b_mean, b_var = float(x.mean()), float(x.var())
        total = self.count + n
        delta = b_mean - self.mean
        self.mean += delta * n / total
        self.var = (self.var * self.count + b_var * n + delta**2 * self.count * n / total) / total
        self.count = total

    def state(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


class RewardScaler:
    """Divide rewards by the std of the discounted return, per env (CleanRL / gymnasium style)."""

    def __init__(self, gamma: float, clip: float = 10.0, eps: float = 1e-8) -> None:
        self.gamma, self.clip, self.eps = gamma, clip, eps
        self.rms = RunningMeanStd()
        self._returns: dict[tuple[str, int], float] = {}

    def scale(self, key: tuple[str, int], rewards: np.ndarray, done: np.ndarray) -> np.ndarray:
        g = self._returns.get(key, 0.0)
        discounted = np.empty(len(rewards), np.float64)
        for i, (r, d) in enumerate(zip(rewards.tolist(), done.tolist(), strict=True)):
            g = g * self.gamma + r
            discounted[i] = g
            if d:
                g = 0.0
        self._returns[key] = g
        self.rms.update(discounted)
        scaled: np.ndarray = np.clip(rewards / np.sqrt(self.rms.var + self.eps), -self.clip, self.clip)
        return scaled.astype(np.float32)


@dataclass
class EpisodeTracker:
    """Episode returns and lengths rebuilt from the transitions (raw rewards)."""

    log: EpisodeLog = field(default_factory=EpisodeLog)
    _running: dict[tuple[str, int], tuple[float, int]] = field(default_factory=dict)

    def add(self, key: tuple[str, int], rewards: np.ndarray, done: np.ndarray, autoreset: np.ndarray) -> None:
        ret, length = self._running.get(key, (0.0, 0))
        for r, d, a in zip(rewards.tolist(), done.tolist(), autoreset.tolist(), strict=True):
            if a:
                continue
            ret += r
            length += 1
            if d:
                self.log.add(ret, length)
                ret, length = 0.0, 0
        self._running[key] = (ret, length)


@dataclass
class Batch:
    """A flat batch of ``n`` transitions from ``S`` segments.

    ``obs_ext`` holds each segment's ``T`` observations followed by its bootstrap
    observation; ``obs_index``/``next_index`` point rows into it.
    """

    obs_ext: np.ndarray
    obs_index: np.ndarray
    next_index: np.ndarray
    actions: np.ndarray
    log_probs: np.ndarray
    served_values: np.ndarray
    versions: np.ndarray
    rewards: np.ndarray
    raw_rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    fallback: np.ndarray
    autoreset: np.ndarray
    segment_end: np.ndarray
    last_seq: int

    @property
    def size(self) -> int:
        return len(self.rewards)


def assemble(segments: list[pb.Segment], scaler: RewardScaler | None, episodes: EpisodeTracker) -> Batch:
    """Decode segments (already deduplicated, in order) into a :class:`Batch`."""
    cols: dict[str, list[Any]] = collections.defaultdict(list)
    base = 0
    for seg in segments:
        obs = tensors.decode(seg.obs, "segment.obs")
        t = obs.shape[0]
        boot = tensors.decode(seg.bootstrap_obs, "segment.bootstrap_obs").reshape(1, *obs.shape[1:])
        raw = np.asarray(seg.rewards, np.float32)
        term = np.asarray(seg.terminated, bool)
        trunc = np.asarray(seg.truncated, bool)
        auto = np.asarray(seg.autoreset, bool)
        key = (seg.session_id, int(seg.env_id))
        episodes.add(key, raw, term | trunc, auto)
        cols["obs_ext"] += [obs, boot]
        cols["obs_index"].append(np.arange(base, base + t))
        cols["next_index"].append(np.arange(base + 1, base + t + 1))
        base += t + 1
        cols["actions"].append(tensors.decode(seg.actions, "segment.actions"))
        cols["log_probs"].append(np.asarray(seg.log_probs, np.float32))
        cols["served_values"].append(np.asarray(seg.values, np.float32))
        cols["versions"].append(np.asarray(seg.policy_versions, np.int64))
        cols["raw_rewards"].append(raw)
        cols["rewards"].append(scaler.scale(key, raw, term | trunc) if scaler else raw)
        cols["terminated"].append(term)
        cols["truncated"].append(trunc)
        cols["fallback"].append(np.asarray(seg.fallback, bool))
        cols["autoreset"].append(auto)
        end = np.zeros(t, bool)
        end[-1] = True
        cols["segment_end"].append(end)
    arrays = {k: np.concatenate(v) for k, v in cols.items()}
    return Batch(**arrays, last_seq=max(s.seq for s in segments))
