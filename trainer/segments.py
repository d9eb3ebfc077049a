"""From received segments to a training batch: dedupe, reward scaling, episodes.

Segments of one env arrive in order (the server cuts and sends them in
order), so per-env state (discounted return for reward scaling, the running
episode) is carried from one segment to the next, and forgotten once the env
has gone quiet (:class:`EnvStates`).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from edgerl.proto import tensors
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.sim.episodes import EpisodeLog

SegmentKey = tuple[str, int, int, int]
"""Identity of a segment's first transition: (session, env, episode, t)."""

EnvKey = tuple[str, int]
"""An env of a session: (session, env)."""

ENV_IDLE_S = 600.0
"""A period of :class:`EnvStates` lasts at least this long (seconds) ..."""
ENV_IDLE_SEGMENTS = 65536
"""... and at least this many segments taken: an env quiet for a whole period is forgotten."""

V = TypeVar("V")


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


class EnvStates(Generic[V]):
    """Per-env state, forgotten for an env that has gone quiet.

    A robot's session is named by its host and pid, new at each start, and so is a sim
    fleet's: the state of every env that ever sent a segment was once kept for good (9.6 KB a
    closed session of 32 envs, the reward scaler's and the episode tracker's). Time here runs
    in periods, each at least ``idle_s`` seconds *and* ``idle_segments`` segments taken long;
    an env that sent nothing in a whole period is forgotten at its end (so after one to two
    periods of quiet). A trainer that stalls (nothing arrives) forgets nothing, and neither
    does a slow robot among fast sims. An env that comes back later starts afresh, as a new one
    does. Two plain dicts, the period's and the one before, hold it all: no clock per env.
    """

    def __init__(
        self,
        idle_s: float = ENV_IDLE_S,
        idle_segments: int = ENV_IDLE_SEGMENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= idle_s < math.inf:
            raise ValueError(f"idle_s must be a finite number >= 0, got {idle_s}")
        if idle_segments < 1:
            raise ValueError(f"idle_segments must be >= 1, got {idle_segments}")
        self.idle_s = idle_s
        self.idle_segments = idle_segments
        self._clock = clock
        self._now: dict[EnvKey, V] = {}
        """The envs that sent a segment in this period."""
        self._before: dict[EnvKey, V] = {}
        """The envs that sent one in the period before and none since."""
        self._taken = 0
        self._period_taken = 0
        self._period_s = clock()
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._now) + len(self._before)

    def get(self, key: EnvKey) -> V | None:
        """The env's state, or None for an env not seen (or forgotten)."""
        state = self._now.get(key)
        return self._before.get(key) if state is None else state

    def put(self, key: EnvKey, state: V) -> None:
        """The env's state after one more of its segments; at a period's end, forgets the envs
        that sent none in it."""
        self._before.pop(key, None)
        self._now[key] = state
        self._taken += 1
        if self._taken - self._period_taken >= self.idle_segments:
            now = self._clock()
            if now - self._period_s >= self.idle_s:
                self.forgotten += len(self._before)
                self._before, self._now = self._now, {}
                self._period_taken, self._period_s = self._taken, now


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

    def __init__(
        self, gamma: float, clip: float = 10.0, eps: float = 1e-8, returns: EnvStates[float] | None = None
    ) -> None:
        self.gamma, self.clip, self.eps = gamma, clip, eps
        self.rms = RunningMeanStd()
        self.returns: EnvStates[float] = EnvStates() if returns is None else returns
        """Each env's discounted return so far."""

    def scale(self, key: EnvKey, rewards: np.ndarray, done: np.ndarray) -> np.ndarray:
        g = self.returns.get(key) or 0.0
        discounted = np.empty(len(rewards), np.float64)
        for i, (r, d) in enumerate(zip(rewards.tolist(), done.tolist(), strict=True)):
            g = g * self.gamma + r
            discounted[i] = g
            if d:
                g = 0.0
        self.returns.put(key, g)
        self.rms.update(discounted)
        scaled: np.ndarray = np.clip(rewards / np.sqrt(self.rms.var + self.eps), -self.clip, self.clip)
        return scaled.astype(np.float32)


@dataclass(slots=True)
class _Running:
    """An env's episode in progress, and where its next segment must begin to go on with it."""

    episode: int
    t: int
    ret: float = 0.0
    length: int = 0
    whole: bool = True
    """Seen from its first step, with no step missing."""


@dataclass
class EpisodeTracker:
    """Episode returns and lengths rebuilt from the transitions (raw rewards).

    An episode is logged only if every one of its steps arrived: a trainer that joins a server
    mid-run, a segment the server dropped (``overflow = "drop"``) and a reconnect with an answer
    in flight from a client that does not resume (``StreamHello.resumes``; sim workers and robot
    hosts do) all cut one, and so does a client's return mid-episode to a server that had
    restarted (or forgotten its session); a cut episode's return and length were once logged as
    if they were whole. The cut ones are counted in ``cut``.
    """

    log: EpisodeLog = field(default_factory=EpisodeLog)
    cut: int = 0
    """Episodes that ended but were not logged: some of their steps never arrived."""
    running: EnvStates[_Running] = field(default_factory=EnvStates)
    """Each env's episode in progress."""

    def add(
        self,
        key: EnvKey,
        start: tuple[int, int],
        rewards: np.ndarray,
        done: np.ndarray,
        autoreset: np.ndarray,
        *,
        joined: bool = False,
    ) -> None:
        """One segment of env ``key`` whose first row is ``start`` = (episode, t); ``joined``:
        its episode began before the server knew the env (``Segment.joined_mid_episode``)."""
        run = self.running.get(key)
        if run is None or (run.episode, run.t) != start:
            # An episode's first row has t = 0, unless the server joined the episode midway.
            run = _Running(*start, whole=start[1] == 0 and not joined)
        episode, t, ret, length, whole = run.episode, run.t, run.ret, run.length, run.whole
        for r, d, a in zip(rewards.tolist(), done.tolist(), autoreset.tolist(), strict=True):
            if a:  # the env reset on this row's action: the next row begins an episode
                episode, t, ret, length, whole = episode + 1, 0, 0.0, 0, True
                continue
            ret += r
            length += 1
            t += 1
            if d:
                if whole:
                    self.log.add(ret, length)
                else:
                    self.cut += 1
                ret, length = 0.0, 0
        run.episode, run.t, run.ret, run.length, run.whole = episode, t, ret, length, whole
        self.running.put(key, run)


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
        start = (int(seg.episode), int(seg.t))
        episodes.add(key, start, raw, term | trunc, auto, joined=seg.joined_mid_episode)
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
