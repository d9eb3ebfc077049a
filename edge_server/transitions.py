"""Version-stamped transitions, assembled by the edge server for the trainer.

The server already sees everything a transition holds: the observation and
the action it answered (with its log-prob, value and ``policy_version``),
then the reward and done flags that arrive with the env's next message. The
:class:`TransitionStore` keeps one row per env per step in preallocated
arrays and, every ``segment_steps`` rows, cuts a :class:`Segment` for that env:
``T`` contiguous transitions plus the observation after the last one (the
bootstrap observation), so the trainer can run GAE on each segment alone.

Flags travel with each row instead of rows being dropped, so GAE stays
contiguous:

- ``autoreset``: the observation was an episode's final one, so the env
  (gymnasium 1.x ``NEXT_STEP`` autoreset) ignored the action and reset. The
  row's reward is 0 and it belongs to no episode; the trainer masks it.
- ``fallback``: the robot applied another action than the policy's (watchdog
  fallback), as reported by the client with the next message.

A stream that ends has its envs' completed rows cut into (short) segments.
A row that was answered and waits for its reward is lost with it (counted)
unless the client resumes (``StreamHello.resumes``): then the env's first
message on its next stream completes the row, or sends the request answered
there again (its answer never reached the client), which is answered anew in
its place: a sim env's observation repeated, a robot's observed anew. Where
the client numbers its requests (``StepObservation.obs_index``), the numbers
say which of the two the message is, and a number past the next says that
requests between were lost and not sent again: the row is then lost, as
without resuming, not completed with a later step's reward. Without them the
observations are compared. A sim worker's or a robot host's reconnect to a
server that lives on loses no step that way.

Segments wait in a bounded outgoing buffer until the trainer acknowledges
them. The trainer pulls with a window (admission control); when the buffer
is full, step requests wait (``overflow="block"``, backpressure on the
envs) or the oldest unsent segment is dropped (``overflow="drop"``). Every
transition that does not reach the trainer is counted.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edgerl.edge_server.batcher import BatchResult
from edgerl.proto import tensors
from edgerl.proto.settings import check_finite, check_wire_int
from edgerl.proto.v1 import edge_pb2 as pb

log = logging.getLogger(__name__)

OVERFLOW_MODES = ("block", "drop")


@dataclass(frozen=True)
class TransitionConfig:
    """How the edge server assembles and buffers transitions."""

    segment_steps: int = 32
    """Transitions per segment (per env)."""
    max_pending_steps: int = 65536
    """Most env steps held for the trainer (unsent plus unacknowledged)."""
    overflow: str = "block"
    """When the buffer is full: "block" delays step requests, "drop" drops the oldest unsent segment."""
    sync_env_steps: int = 0
    """Synchronous mode when > 0: each env gets at most this many actions per published
    version (one segment's worth, so that every env fills exactly one segment of the batch);
    a step request naming an env that has had its share waits for the next publish."""
    weight_sync_interval: int = 1
    """Swap in every k-th published version (a publish less than k versions ahead is skipped)."""
    closed_session_keep_s: float = 600.0
    """How long a closed session's env counters are kept for a stream that takes it over
    (seconds). A session that comes back later is one the server does not know, as after a
    restart (see :meth:`TransitionStore.open_stream`)."""
    max_closed_sessions: int = 10_000
    """Most closed sessions kept (~1.7 KB each with 32 envs, and up to 3.7 KB more for the steps a
    resuming stream of 32 HalfCheetah envs left answered); past it the longest closed goes."""

    def __post_init__(self) -> None:
        check_finite(self)
        if self.segment_steps < 1:
            raise ValueError(f"segment_steps must be >= 1, got {self.segment_steps}")
        if self.max_pending_steps < self.segment_steps:
            raise ValueError(
                f"max_pending_steps ({self.max_pending_steps}) must be >= "
                f"segment_steps ({self.segment_steps})"
            )
        if self.overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {self.overflow!r}")
        if self.sync_env_steps < 0:
            raise ValueError(f"sync_env_steps must be >= 0, got {self.sync_env_steps}")
        check_wire_int("sync_env_steps", self.sync_env_steps)  # ServerLimits carries it
        if self.weight_sync_interval < 1:
            raise ValueError(f"weight_sync_interval must be >= 1, got {self.weight_sync_interval}")
        if self.closed_session_keep_s < 0:
            raise ValueError(f"closed_session_keep_s must be >= 0, got {self.closed_session_keep_s}")
        if self.max_closed_sessions < 0:
            raise ValueError(f"max_closed_sessions must be >= 0, got {self.max_closed_sessions}")
        if self.sync_env_steps and self.weight_sync_interval != 1:
            raise ValueError("synchronous mode (sync_env_steps > 0) needs weight_sync_interval = 1")


@dataclass
class TransitionCounters:
    """Where every transition went."""

    transitions: int = 0
    """Completed rows (reward known)."""
    segments_emitted: int = 0
    segments_sent: int = 0
    """Segment sends, re-sends included."""
    segments_resent: int = 0
    """Segments queued to go out again when a trainer (re)connected; those its acknowledgements
    then cover go unsent."""
    segments_acked: int = 0
    transitions_acked: int = 0
    transitions_dropped_overflow: int = 0
    transitions_dropped_disconnect: int = 0
    backpressure_wait_us: int = 0
    weight_publishes: int = 0
    sessions_forgotten: int = 0
    """Closed sessions let go (``closed_session_keep_s`` or ``max_closed_sessions``)."""


@dataclass(eq=False)
class _Wait:
    since_ns: int


class EnvBusyError(Exception):
    """A step named an env whose previous request is still unanswered."""


class SessionTakenOverError(Exception):
    """A step came on a stream whose session a newer stream took over (two live clients with
    one session id: each would have its steps served and half the transitions dropped)."""


class _Session:
    """One client session (one stream's envs): its envs' episode counters, kept for the streams
    that take it over, and the row buffers, held while a stream has it open."""

    def __init__(
        self, session_id: str, num_envs: int, steps: int, obs_shape: tuple[int, ...], mid_episode: bool
    ) -> None:
        self.session_id = session_id
        self.num_envs = num_envs
        self.generation = 0
        self.first_episode = time.time_ns() // 1000 if mid_episode else 0
        """What the envs' first episodes here are numbered. Envs that come mid-episode to a server
        that does not know their session (restarted, or forgotten it) are numbered from the clock
        in microseconds: a transition's identity is (session, env, episode, t), and counting from
        0 again would repeat ones that a trainer has taken (and drops as duplicates). Episodes
        take more than a microsecond, so no earlier count reaches it."""
        self.act_shape: tuple[int, ...] | None = None
        self.resumes = False
        """The open (or last) stream resumes where the one before it left off (``StreamHello.resumes``)."""
        self.carried: _Carried | None = None
        """Answered rows a resuming stream left open when it closed, for the stream that takes the
        session over next."""
        self._rows_shape = (num_envs, steps + 1)  # row T holds the bootstrap observation
        self._obs_shape = obs_shape
        e = num_envs
        self.acted = np.zeros(e, np.int64)
        """Actions admitted per env since the last publish (the sync-mode quota)."""
        self.completed = np.zeros(e, np.int64)
        """Rows completed per env since the last publish (sync mode)."""
        self.counted = np.zeros(e, bool)
        """The env's open row's action was admitted since the last publish (sync mode): it is given
        back to the quota if the row is lost."""
        self.episode = np.full(e, self.first_episode, np.int64)
        self.t = np.zeros(e, np.int64)
        self.hold_rows()

    def hold_rows(self) -> None:
        """(Re)allocate the row buffers, empty: no row completed, none open."""
        e, t = self._rows_shape
        self.obs: np.ndarray = np.zeros((e, t, *self._obs_shape), np.float32)
        self.actions: np.ndarray | None = None
        self.log_probs: np.ndarray = np.zeros((e, t), np.float32)
        self.values: np.ndarray = np.zeros((e, t), np.float32)
        self.versions: np.ndarray = np.zeros((e, t), np.uint64)
        self.rewards: np.ndarray = np.zeros((e, t), np.float32)
        self.terminated: np.ndarray = np.zeros((e, t), bool)
        self.truncated: np.ndarray = np.zeros((e, t), bool)
        self.fallback: np.ndarray = np.zeros((e, t), bool)
        self.autoreset: np.ndarray = np.zeros((e, t), bool)
        self.pos: np.ndarray = np.zeros(e, np.int64)
        """Completed rows in each env's current segment; row ``pos`` is the open one."""
        self.awaiting: np.ndarray = np.zeros(e, bool)
        """Row ``pos`` has its observation and waits for its action."""
        self.has_action: np.ndarray = np.zeros(e, bool)
        """Row ``pos`` has its action and waits for its reward."""
        self.resuming: np.ndarray = np.zeros(e, bool)
        """Row 0 holds an answered row of the stream before, which the env's first message on this
        stream (a resuming one) either completes or repeats."""
        self.index: np.ndarray = np.full(e, -1, np.int64)
        """The client's number of row ``pos``'s request (``StepObservation.obs_index``); -1: none."""
        self.seg_episode: np.ndarray = np.zeros(e, np.int64)
        self.seg_t: np.ndarray = np.zeros(e, np.int64)

    @property
    def joined_mid_episode(self) -> bool:
        """The envs' first episodes here began before the server knew the session."""
        return self.first_episode != 0

    @property
    def rows_held(self) -> bool:
        return self.pos is not _NO_ROWS

    def drop_rows(self) -> None:
        """Free the row buffers of a session no stream has open (flushed: they hold nothing)."""
        none = _NO_ROWS
        self.obs = self.log_probs = self.values = self.versions = self.rewards = none
        self.terminated = self.truncated = self.fallback = self.autoreset = none
        self.pos = self.awaiting = self.has_action = self.resuming = self.index = none
        self.seg_episode = self.seg_t = none
        self.actions = None

    def action_rows(self, act_shape: tuple[int, ...]) -> np.ndarray:
        """The action buffer, allocated at the first answer (its shape comes with it)."""
        if self.actions is None:
            self.act_shape = act_shape
            self.actions = np.zeros((*self._rows_shape, *act_shape), np.float32)
        return self.actions


@dataclass(frozen=True, slots=True)
class _Carried:
    """Answered open rows of a session's envs (``envs``), kept from one stream to the next."""

    envs: np.ndarray
    obs: np.ndarray
    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    versions: np.ndarray
    autoreset: np.ndarray
    index: np.ndarray

    @classmethod
    def take(cls, s: _Session, envs: np.ndarray) -> _Carried:
        """Copy the open rows of ``envs`` (answered) out of the session's buffers."""
        assert s.actions is not None
        p = s.pos[envs]
        return cls(
            envs,
            s.obs[envs, p],
            s.actions[envs, p],
            s.log_probs[envs, p],
            s.values[envs, p],
            s.versions[envs, p],
            s.autoreset[envs, p],
            s.index[envs],
        )

    def put(self, s: _Session) -> None:
        """Make them the envs' open rows again, at row 0 of their next segments, each to be
        completed or repeated by the env's first message."""
        assert s.act_shape is not None
        e = self.envs
        s.obs[e, 0] = self.obs
        s.action_rows(s.act_shape)[e, 0] = self.actions
        s.log_probs[e, 0] = self.log_probs
        s.values[e, 0] = self.values
        s.versions[e, 0] = self.versions
        s.autoreset[e, 0] = self.autoreset  # row 0: every env's pos is 0 after a flush or a hold
        s.index[e] = self.index
        s.has_action[e] = True
        s.resuming[e] = True
        s.seg_episode[e] = s.episode[e]
        s.seg_t[e] = s.t[e]


_NO_ROWS = np.zeros(0)
"""What a closed session's row buffers are: a stray use of one fails at once."""


@dataclass(frozen=True, slots=True)
class StreamHandle:
    """One stream's claim on a session; a newer stream for the session invalidates it."""

    session: _Session
    generation: int


class TransitionStore:
    """Assembles transitions of all sessions and hands segments to one trainer."""

    def __init__(
        self,
        config: TransitionConfig,
        obs_shape: tuple[int, ...],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.obs_shape = obs_shape
        self.counters = TransitionCounters()
        self._clock = clock
        self._sessions: dict[str, _Session] = {}
        self._closed: collections.OrderedDict[str, float] = collections.OrderedDict()
        """The sessions no stream has open, by the time their last stream closed, oldest first."""
        self._next_seq = 1
        self._outgoing: collections.deque[tuple[int, int, pb.Segment]] = collections.deque()
        self._unacked: collections.deque[tuple[int, int, pb.Segment]] = collections.deque()
        self._outgoing_steps = 0
        self._unacked_steps = 0
        self._window_steps = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._trainer_generation = 0
        self._waiting: set[_Wait] = set()

    def backpressure_wait_us(self) -> int:
        """Time step requests have waited for admission, ongoing waits included (us)."""
        now = time.perf_counter_ns()
        ongoing = sum(now - w.since_ns for w in self._waiting) // 1000
        return self.counters.backpressure_wait_us + ongoing

    # -- sessions -------------------------------------------------------------------------------------
    def open_stream(
        self, session_id: str, num_envs: int, *, mid_episode: bool = False, resumes: bool = False
    ) -> StreamHandle:
        """Claim a session's buffers for a new stream (a reconnect takes over the old one). A
        session this store does not know starts its envs at episode 0; with ``mid_episode`` (the
        client's envs stepped before this stream) those first episodes are numbered from the clock
        and marked as joined midway, since their earlier steps were never seen here.

        Where both the stream before and this one resume (``StreamHello.resumes``), the steps the
        one before had answered and not seen the rewards of stay open, for the env's first message
        here to complete or repeat (:meth:`observe`). Otherwise they are counted lost, and their
        episodes go on one step later."""
        self._forget_closed()
        self._closed.pop(session_id, None)
        s = self._sessions.get(session_id)
        if s is None or s.num_envs != num_envs:
            if s is not None:
                self._let_go(s)
                s.generation += 1  # its stream's handle is spent
            s = _Session(session_id, num_envs, self.config.segment_steps, self.obs_shape, mid_episode)
            self._sessions[session_id] = s
        else:
            if s.rows_held:  # taken over from a live stream
                s.carried = self._flush(s)
            else:
                s.hold_rows()
            if s.carried is not None:
                if resumes:
                    s.carried.put(s)
                else:
                    self._lose(s, s.carried.envs, s.carried.autoreset)
                s.carried = None
        s.resumes = resumes
        s.generation += 1
        return StreamHandle(s, s.generation)

    def close_stream(self, handle: StreamHandle) -> None:
        """The stream ended: hand over completed rows, count the half-built ones as dropped (a
        resuming stream's answered ones are kept for the stream that resumes it), and free the
        session's row buffers (its episode counters stay, for the stream that takes it over, until
        ``closed_session_keep_s`` has passed). A sim fleet's sessions are named by its host and
        pid, new ones at each start; the buffers of every closed session were once kept, 127 KB
        for 32 HalfCheetah envs, and their counters (1.7 KB) for good after that."""
        s = handle.session
        if handle.generation == s.generation:
            s.carried = self._flush(s)
            s.drop_rows()
            s.generation += 1  # the handle is spent: a late answer for it is not recorded
            self._closed[s.session_id] = self._clock()
            self._forget_closed()

    def _forget_closed(self) -> None:
        """Let go of the sessions closed longer than ``closed_session_keep_s`` and of the oldest
        past ``max_closed_sessions``."""
        closed, cfg = self._closed, self.config
        if not closed:
            return
        keep_after = self._clock() - cfg.closed_session_keep_s
        while closed and (len(closed) > cfg.max_closed_sessions or next(iter(closed.values())) <= keep_after):
            session_id, _ = closed.popitem(last=False)
            self._let_go(self._sessions.pop(session_id))
            self.counters.sessions_forgotten += 1

    def _let_go(self, s: _Session) -> None:
        """The session goes: what its stream had open is lost."""
        if s.rows_held:
            s.carried = self._flush(s)
        if s.carried is not None:
            self._lose(s, s.carried.envs, s.carried.autoreset)
            s.carried = None

    def _lose(self, s: _Session, envs: np.ndarray, autoreset: np.ndarray) -> None:
        """Answered rows of ``envs`` whose rewards never came (``autoreset``: each row's
        observation began an episode): counted, and their envs' episodes go on one step later (or,
        after a final observation, with the next episode)."""
        self.counters.transitions_dropped_disconnect += len(envs)
        s.episode[envs] += autoreset
        s.t[envs] = np.where(autoreset, 0, s.t[envs] + 1)
        self._unquota(s, envs)

    def _unquota(self, s: _Session, envs: np.ndarray) -> None:
        """Give the envs' open rows' actions back to the sync-mode quota: their rows will not be
        completed (lost with their stream, or their observation answered again). Each env must
        still complete one segment's rows per version, or the batch that the trainer waits for
        never fills: an env whose stream ended with an action admitted and its row open was once
        held one row short of its segment until a publish that could not come."""
        if self.config.sync_env_steps:
            given = envs[s.counted[envs]]
            s.acted[given] -= 1
            s.counted[given] = False

    def _flush(self, s: _Session) -> _Carried | None:
        """Cut every env's completed rows into a (short) segment and clear the open rows. The
        answered ones are returned where the stream resumes, else counted lost."""
        envs = np.flatnonzero(s.pos > 0)  # completed rows imply an open row with its observation
        for e in envs.tolist():
            p = int(s.pos[e])  # the open row's observation bootstraps the last completed one
            self._emit(s, e, p, s.obs[e, p])
        answered = np.flatnonzero(s.has_action)
        rows = _Carried.take(s, answered) if answered.size else None
        self._unquota(s, np.flatnonzero(s.awaiting))  # sent again, or lost, on the next stream
        s.pos[:] = 0
        s.awaiting[:] = False
        s.has_action[:] = False
        s.resuming[:] = False
        if rows is not None and not s.resumes:
            self._lose(s, rows.envs, rows.autoreset)
            return None
        return rows

    # -- the act path ----------------------------------------------------------------------------------
    def observe(
        self,
        handle: StreamHandle,
        env_ids: np.ndarray,
        obs: np.ndarray,
        *,
        rewards: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        fallback: np.ndarray,
        obs_index: np.ndarray | None = None,
    ) -> None:
        """A step message arrived: complete the envs' open rows, cut full segments, open new rows.
        ``obs_index``: the client's number of each row's request (``StepObservation.obs_index``),
        int64; None: not given.

        Raises:
            EnvBusyError: an env in ``env_ids`` still waits for its previous action.
            SessionTakenOverError: a newer stream took the session over.
        """
        s = handle.session
        if handle.generation != s.generation:
            raise SessionTakenOverError(
                f"session_id: {s.session_id!r} was taken over by a newer stream with the same id "
                "(do two clients share it?)"
            )
        busy = s.awaiting[env_ids]
        if busy.any():
            raise EnvBusyError(
                f"step.env_ids: env {int(env_ids[np.argmax(busy)])} was sent again before its "
                "previous action was answered"
            )
        resuming = s.resuming[env_ids]
        if resuming.any():  # each env's first message on a resuming stream
            ids = env_ids[resuming]
            s.resuming[ids] = False
            # The request answered on the stream before, sent again: that answer never reached the
            # client. The row is open again, for a new answer (to the observation this message has).
            again = (obs[resuming] == s.obs[ids, 0]).reshape(len(ids), -1).all(axis=1)
            if obs_index is not None:  # the numbers tell, where both rows have one
                held, told = s.index[ids], obs_index[resuming]
                known = held >= 0
                again = np.where(known, told == held, again)
                # Neither the same request nor the next: one between was lost and not sent again
                # (its reward and flags with it). Completing the row with this one's reward would
                # give it a later step's; it is lost instead.
                gap = known & ~again & (told != held + 1)
                if gap.any():
                    self._lose(s, ids[gap], s.autoreset[ids[gap], 0])
                    s.has_action[ids[gap]] = False
            s.has_action[ids[again]] = False
            self._unquota(s, ids[again])
        steps = self.config.segment_steps
        done = terminated | truncated
        closing = s.has_action[env_ids]
        if closing.any():
            ids = env_ids[closing]
            p = s.pos[ids]
            s.rewards[ids, p] = rewards[closing]
            s.terminated[ids, p] = terminated[closing]
            s.truncated[ids, p] = truncated[closing]
            s.fallback[ids, p] = fallback[closing]
            s.has_action[ids] = False
            was_reset = s.autoreset[ids, p]
            s.episode[ids] += was_reset
            s.t[ids] = np.where(was_reset, 0, s.t[ids] + 1)
            s.pos[ids] = p + 1
            self.counters.transitions += len(ids)
            full = p + 1 == steps
            if self.config.sync_env_steps:
                s.counted[ids] = False  # its action stays in the quota
                # A version's rows go out when the env's quota of them is complete, even where a
                # break of the stream cut the segment short before: left in the buffer, they were
                # rows the trainer's batch waited for in vain.
                s.completed[ids] += 1
                full |= s.completed[ids] == self.config.sync_env_steps
            for row, e in zip(np.flatnonzero(closing)[full].tolist(), ids[full].tolist(), strict=True):
                self._emit(s, e, int(s.pos[e]), obs[row])
                s.pos[e] = 0
        p = s.pos[env_ids]
        start = p == 0
        if start.any():
            s.seg_episode[env_ids[start]] = s.episode[env_ids[start]]
            s.seg_t[env_ids[start]] = s.t[env_ids[start]]
        s.obs[env_ids, p] = obs
        s.autoreset[env_ids, p] = done
        s.index[env_ids] = -1 if obs_index is None else obs_index
        s.awaiting[env_ids] = True

    def record(self, handle: StreamHandle, env_ids: np.ndarray, result: BatchResult) -> None:
        """The server answered ``env_ids``: store the actions in their open rows."""
        s = handle.session
        if handle.generation != s.generation:
            return
        p = s.pos[env_ids]
        s.action_rows(result.actions.shape[1:])[env_ids, p] = result.actions
        s.log_probs[env_ids, p] = result.log_probs
        s.values[env_ids, p] = 0.0 if result.values is None else result.values
        s.versions[env_ids, p] = result.policy_version
        s.awaiting[env_ids] = False
        s.has_action[env_ids] = True

    def _emit(self, s: _Session, e: int, rows: int, bootstrap_obs: np.ndarray) -> None:
        assert s.actions is not None
        seg = pb.Segment(
            seq=self._next_seq,
            session_id=s.session_id,
            env_id=e,
            episode=int(s.seg_episode[e]),
            t=int(s.seg_t[e]),
            joined_mid_episode=s.joined_mid_episode and bool(s.seg_episode[e] == s.first_episode),
            obs=tensors.float32(s.obs[e, :rows]),
            actions=tensors.float32(s.actions[e, :rows]),
            log_probs=s.log_probs[e, :rows].tolist(),
            values=s.values[e, :rows].tolist(),
            policy_versions=s.versions[e, :rows].tolist(),
            rewards=s.rewards[e, :rows].tolist(),
            terminated=s.terminated[e, :rows].tolist(),
            truncated=s.truncated[e, :rows].tolist(),
            fallback=s.fallback[e, :rows].tolist(),
            autoreset=s.autoreset[e, :rows].tolist(),
            bootstrap_obs=tensors.float32(np.asarray(bootstrap_obs)),
        )
        self._next_seq += 1
        self.counters.segments_emitted += 1
        self._outgoing.append((seg.seq, rows, seg))
        self._outgoing_steps += rows
        if self.config.overflow == "drop":
            while self.pending_steps > self.config.max_pending_steps and self._outgoing:
                _, n, _ = self._outgoing.popleft()
                self._outgoing_steps -= n
                self.counters.transitions_dropped_overflow += n
        self._notify()

    @property
    def next_seq(self) -> int:
        """The seq the next segment will get (every seq below it was assigned)."""
        return self._next_seq

    @property
    def pending_steps(self) -> int:
        """Env steps held for the trainer: not yet sent plus sent and unacknowledged."""
        return self._outgoing_steps + self._unacked_steps

    def try_admit(self, handle: StreamHandle, env_ids: np.ndarray) -> bool:
        """Admit a step request for ``env_ids`` now if it may go ahead (never one of a stream whose
        session a newer stream took over: it waits to be cancelled with its stream, charging no
        env's quota)."""
        s = handle.session
        cfg = self.config
        if handle.generation != s.generation:
            return False
        if cfg.overflow == "block" and self.pending_steps >= cfg.max_pending_steps:
            return False
        if cfg.sync_env_steps:
            if (s.acted[env_ids] >= cfg.sync_env_steps).any():
                return False
            s.acted[env_ids] += 1
            s.counted[env_ids] = True
        return True

    async def admit(self, handle: StreamHandle, env_ids: np.ndarray) -> None:
        """Wait until a step request for ``env_ids`` may go ahead (buffer room, sync quota)."""
        if self.try_admit(handle, env_ids):
            return
        start = _Wait(time.perf_counter_ns())
        self._waiting.add(start)
        try:
            while not self.try_admit(handle, env_ids):
                await self.wait_changed()
        finally:
            self._waiting.discard(start)
            self.counters.backpressure_wait_us += (time.perf_counter_ns() - start.since_ns) // 1000

    def published(self) -> None:
        """New weights are served: every env's sync-mode quota starts afresh."""
        for s in self._sessions.values():
            s.acted[:] = 0
            s.completed[:] = 0
            s.counted[:] = False
        self.counters.weight_publishes += 1
        self._notify()

    # -- the trainer side ---------------------------------------------------------------------------
    def trainer_connected(self) -> int:
        """A trainer (re)connected: everything unacknowledged is sent again first."""
        while self._unacked:
            item = self._unacked.pop()
            self._outgoing.appendleft(item)
            self._outgoing_steps += item[1]
            self._unacked_steps -= item[1]
            self.counters.segments_resent += 1
        self._window_steps = 0
        self._trainer_generation += 1
        self._notify()
        return self._trainer_generation

    def is_current_trainer(self, generation: int) -> bool:
        return generation == self._trainer_generation

    def ack(self, acked_seq: int, window_steps: int) -> None:
        """The trainer took every segment up to ``acked_seq`` and accepts ``window_steps`` unacked steps.

        Segments up to ``acked_seq`` that wait to go out again (a trainer that reconnected, whose
        acknowledgements were lost with its stream) go too: sent again, they would fill the
        window with segments the trainer drops as duplicates and never acknowledges again, and
        nothing more would be sent to it."""
        self._unacked_steps -= self._drop_acked(self._unacked, acked_seq)
        self._outgoing_steps -= self._drop_acked(self._outgoing, acked_seq)
        self._window_steps = window_steps
        self._notify()

    def _drop_acked(self, held: collections.deque[tuple[int, int, pb.Segment]], acked_seq: int) -> int:
        """Drop the segments up to ``acked_seq`` from the front of ``held``; their env steps."""
        steps = 0
        while held and held[0][0] <= acked_seq:
            _, n, _ = held.popleft()
            steps += n
            self.counters.segments_acked += 1
        self.counters.transitions_acked += steps
        return steps

    def take_sendable(self) -> list[pb.Segment]:
        """Segments that fit in the trainer's window now (moved to unacknowledged)."""
        out: list[pb.Segment] = []
        while self._outgoing:
            seq, n, seg = self._outgoing[0]
            if self._unacked_steps and self._unacked_steps + n > self._window_steps:
                break
            if not self._window_steps:
                break
            self._outgoing.popleft()
            self._outgoing_steps -= n
            self._unacked.append((seq, n, seg))
            self._unacked_steps += n
            out.append(seg)
        self.counters.segments_sent += len(out)
        return out

    def wait_changed(self) -> asyncio.Future[None]:
        """A future resolved at the next change of the store (segments, acks, publishes).

        The waiter is registered now, not when the caller first awaits it, so no
        change in between is missed (an ``asyncio.Event`` shared by several waiters,
        each clearing it, can lose wake-ups that way).
        """
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
