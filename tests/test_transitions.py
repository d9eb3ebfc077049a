"""The edge server's transition assembly, driven step by step, and the trainer's reading of the
segments it makes (episodes rebuilt, per-env state forgotten once an env goes quiet)."""

from __future__ import annotations

import asyncio
import math
import re
import time
from typing import Any

import numpy as np
import pytest

from edgerl.edge_server.batcher import BatchResult
from edgerl.edge_server.transitions import (
    EnvBusyError,
    SessionTakenOverError,
    StreamHandle,
    TransitionConfig,
    TransitionStore,
)
from edgerl.proto import tensors
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.trainer.segments import Deduplicator, EnvStates, EpisodeTracker, RewardScaler, assemble

OBS = (3,)


def _store(**kw: object) -> TransitionStore:
    return TransitionStore(TransitionConfig(**kw), OBS)  # type: ignore[arg-type,unused-ignore]


def _step(
    store: TransitionStore,
    h: StreamHandle,
    ids: list[int],
    k: int,
    *,
    reward: float = 0.0,
    term: list[bool] | None = None,
    trunc: list[bool] | None = None,
    fallback: list[bool] | None = None,
    version: int = 0,
    index: int | None = None,
) -> None:
    """Message k: obs rows are [k, env, 0], rewards reward+env, each numbered ``index`` where given
    (``StepObservation.obs_index``); then the server answers."""
    n = len(ids)
    env_ids = np.array(ids)
    obs = np.array([[k, e, 0] for e in ids], np.float32)
    store.observe(
        h,
        env_ids,
        obs,
        rewards=np.array([reward + e for e in ids], np.float32),
        terminated=np.array(term or [False] * n),
        truncated=np.array(trunc or [False] * n),
        fallback=np.array(fallback or [False] * n),
        obs_index=None if index is None else np.full(n, index, np.int64),
    )
    actions = np.array([[k * 10 + e] for e in ids], np.float32)
    store.record(h, env_ids, BatchResult(actions, -actions[:, 0], actions[:, 0] / 2, version, 0, 0, n))


def _drain(store: TransitionStore) -> list[pb.Segment]:
    store.ack(0, 1 << 30)
    segs: list[pb.Segment] = store.take_sendable()
    return segs


def test_rows_pair_each_observation_with_the_reward_of_the_next_message() -> None:
    store = _store(segment_steps=3)
    h = store.open_stream("s", 2)
    for k in range(4):  # message k carries the reward of action k-1
        _step(store, h, [0, 1], k, reward=float(k), version=k // 2)
    segs = _drain(store)
    assert [(s.env_id, s.episode, s.t) for s in segs] == [(0, 0, 0), (1, 0, 0)]
    s1 = segs[1]
    np.testing.assert_array_equal(tensors.decode(s1.obs)[:, 0], [0, 1, 2])
    np.testing.assert_array_equal(tensors.decode(s1.obs)[:, 1], [1, 1, 1])
    np.testing.assert_array_equal(tensors.decode(s1.actions)[:, 0], [1, 11, 21])
    assert list(s1.rewards) == [2.0, 3.0, 4.0]  # rewards of messages 1..3 for env 1
    assert list(s1.policy_versions) == [0, 0, 1]
    assert list(s1.log_probs) == [-1.0, -11.0, -21.0]
    assert list(s1.values) == [0.5, 5.5, 10.5]
    np.testing.assert_array_equal(tensors.decode(s1.bootstrap_obs), [3, 1, 0])  # obs of message 3
    assert [s.seq for s in segs] == [1, 2]
    assert store.counters.transitions == 6


def test_done_marks_the_next_row_autoreset_and_starts_a_new_episode() -> None:
    store = _store(segment_steps=4)
    h = store.open_stream("s", 1)
    _step(store, h, [0], 0)
    _step(store, h, [0], 1, reward=1.0, trunc=[True])  # action 0 truncated: obs 1 is the final one
    _step(store, h, [0], 2, reward=0.0)  # the env reset on action 1 (ignored)
    _step(store, h, [0], 3, reward=2.0, fallback=[True])
    _step(store, h, [0], 4, reward=3.0, term=[True])
    _step(store, h, [0], 5)
    _step(store, h, [0], 6)
    _step(store, h, [0], 7)
    _step(store, h, [0], 8)
    first, second = _drain(store)
    assert list(first.truncated) == [True, False, False, False]
    assert list(first.terminated) == [False, False, False, True]
    assert list(first.autoreset) == [False, True, False, False]
    assert list(first.fallback) == [False, False, True, False]
    assert (first.episode, first.t) == (0, 0)
    assert list(second.autoreset) == [True, False, False, False]  # obs 4 was final
    # Episode 0 = row 0 (+ its autoreset row 1); episode 1 = rows 2-3; episode 2 starts at row 5.
    assert (second.episode, second.t) == (1, 2)


def test_env_sent_again_before_its_answer_is_refused() -> None:
    store = _store()
    h = store.open_stream("s", 2)
    z = np.zeros(1, np.float32)
    f = np.zeros(1, bool)
    obs = np.zeros((1, 3), np.float32)
    store.observe(h, np.array([1]), obs, rewards=z, terminated=f, truncated=f, fallback=f)
    with pytest.raises(EnvBusyError, match=r"step.env_ids: env 1 was sent again"):
        store.observe(h, np.array([1]), obs, rewards=z, terminated=f, truncated=f, fallback=f)


def test_reconnect_flushes_completed_rows_and_counts_the_open_one() -> None:
    store = _store(segment_steps=8)
    h = store.open_stream("s", 1)
    for k in range(3):
        _step(store, h, [0], k)
    h2 = store.open_stream("s", 1)  # the client reconnected: row 2 never gets its reward
    (seg,) = _drain(store)
    assert len(seg.rewards) == 2
    np.testing.assert_array_equal(tensors.decode(seg.bootstrap_obs), [2, 0, 0])
    assert store.counters.transitions_dropped_disconnect == 1
    with pytest.raises(SessionTakenOverError, match=r"^session_id: 's' was taken over by a newer stream"):
        _step(store, h, [0], 99)  # the old stream's late steps are refused (it would lose them)
    store.record(h, np.array([0]), BatchResult(np.ones((1, 1), np.float32), np.zeros(1), None, 0, 0, 0, 1))
    for k in range(3, 12):
        _step(store, h2, [0], k)
    (seg2,) = _drain(store)
    assert (seg2.episode, seg2.t) == (0, 3)  # the episode goes on, one step lost
    np.testing.assert_array_equal(tensors.decode(seg2.obs)[:, 0], list(range(3, 11)))


@pytest.mark.parametrize("ended", ["taken-over", "closed"])
def test_a_resuming_stream_completes_or_repeats_what_the_stream_before_left_answered(ended: str) -> None:
    """Both envs' message 2 was answered when the stream ended (taken over by a reconnect, or
    closed before it). Env 0's answer reached the client, which stepped and sends message 3 on
    its next stream; env 1's was lost with the stream, and the client sends message 2 again.
    Before, both rows were counted lost and both episodes went on one step later (cut). A stream
    that resumes (``StreamHello.resumes``) has env 0's row completed with message 3's reward and
    env 1's answered again: nothing is lost, and the episodes are logged whole."""
    store = _store(segment_steps=8)
    h = store.open_stream("s", 2, resumes=True)
    for k in range(3):
        _step(store, h, [0, 1], k, reward=float(k), version=1)
    segs = []
    if ended == "closed":
        store.close_stream(h)
        segs = _drain(store)
    h2 = store.open_stream("s", 2, resumes=True)
    _step(store, h2, [0], 3, reward=3.0, version=2)  # follows the answer of message 2
    _step(store, h2, [1], 2, reward=2.0, version=2)  # message 2 again: the env did not step
    for k in range(4, 9):  # env 0's episode ends with message 6, env 1's with message 7
        _step(store, h2, [0], k, reward=float(k), term=[k == 6], version=2)
        _step(store, h2, [1], k - 1, reward=float(k - 1), term=[k - 1 == 6], version=2)
    store.close_stream(h2)
    segs += _drain(store)
    assert store.counters.transitions_dropped_disconnect == 0
    assert store.counters.transitions == 8 + 7  # env 1's message 2 completed one row, not two
    assert [(seg.env_id, seg.episode, seg.t, len(seg.rewards)) for seg in segs] == [
        (0, 0, 0, 2),
        (1, 0, 0, 2),
        (0, 0, 2, 6),  # contiguous: t = 2 follows the 2 rows before
        (1, 0, 2, 5),
    ]
    rows: dict[int, list[tuple[float, float, int]]] = {0: [], 1: []}
    for seg in segs:
        obs = tensors.decode(seg.obs)[:, 0]
        rows[seg.env_id] += zip(obs.tolist(), seg.rewards, seg.policy_versions, strict=True)
    # (the observation's message, the reward its action earned (from the next message), version)
    assert rows[0][:4] == [(0.0, 1.0, 1), (1.0, 2.0, 1), (2.0, 3.0, 1), (3.0, 4.0, 2)]
    assert rows[1][:4] == [(0.0, 2.0, 1), (1.0, 3.0, 1), (2.0, 4.0, 2), (3.0, 5.0, 2)]  # reward + env
    tracker = EpisodeTracker()
    assemble(segs, None, tracker)
    assert tracker.cut == 0
    assert sorted(zip(tracker.log.last_returns(10), tracker.log.last_lengths(10), strict=True)) == [
        (1.0 + 2 + 3 + 4 + 5 + 6, 6),
        (2.0 + 3 + 4 + 5 + 6 + 7, 6),
    ]


@pytest.mark.parametrize("ended", ["taken-over", "closed"])
def test_request_numbers_tell_a_resuming_streams_repeat_from_a_step_that_follows_or_one_after_a_gap(
    ended: str,
) -> None:
    """Message 2 of three envs, numbered 2 (``StepObservation.obs_index``), was answered when the
    stream ended. On the next stream, env 0 sends index 3, an observation equal to message 2's (a
    robot at rest): comparing observations took it for message 2 again, dropped its reward and
    flags, and answered a step the robot had already taken. Env 1 sends message 2 again, index 2.
    Env 2's index 3 was lost with the stream (a robot's request in flight), so its next is index
    4: comparing observations completed row 2 with message 4's reward, the reward of a step later.
    Now env 0's row is completed, env 1's answered anew, and env 2's counted lost."""
    store = _store(segment_steps=8)
    h = store.open_stream("s", 3, resumes=True)
    for k in range(3):
        _step(store, h, [0, 1, 2], k, reward=float(k), index=k)
    if ended == "closed":
        store.close_stream(h)
    h2 = store.open_stream("s", 3, resumes=True)
    _step(store, h2, [0], 2, reward=3.0, index=3)  # at rest: message 2's observation
    _step(store, h2, [1], 2, reward=2.0, index=2)  # message 2 again
    _step(store, h2, [2], 4, reward=4.0, index=4)  # message 3 never came
    assert store.counters.transitions_dropped_disconnect == 1
    for k in range(5, 7):
        _step(store, h2, [0, 1, 2], k, reward=float(k), index=k - 1)
    store.close_stream(h2)
    rows: dict[int, list[tuple[int, int, float, float]]] = {0: [], 1: [], 2: []}
    for seg in _drain(store):
        obs = tensors.decode(seg.obs)[:, 0]
        t = range(seg.t, seg.t + len(obs))
        rows[seg.env_id] += zip(t, obs.tolist(), seg.rewards, tensors.decode(seg.actions)[:, 0], strict=True)
    # (t, the observation's message, the reward its action earned (from the next message), action)
    assert rows[0] == [(0, 0, 1, 0), (1, 1, 2, 10), (2, 2, 3, 20), (3, 2, 5, 20), (4, 5, 6, 50)]
    assert rows[1] == [(0, 0, 2, 1), (1, 1, 3, 11), (2, 2, 6, 21), (3, 5, 7, 51)]
    assert rows[2] == [(0, 0, 3, 2), (1, 1, 4, 12), (3, 4, 7, 42), (4, 5, 8, 52)]  # t 2 lost
    assert store.counters.transitions == 5 + 4 + 4


def test_answered_steps_are_lost_where_either_stream_does_not_resume_or_the_session_is_let_go() -> None:
    clock = _Clock()
    store = _closed_store(clock, closed_session_keep_s=60.0)
    h = store.open_stream("s", 1, resumes=True)
    for k in range(3):
        _step(store, h, [0], k)
    h = store.open_stream("s", 1)  # does not resume: row 2 is lost, the episode goes on at t = 3
    assert store.counters.transitions_dropped_disconnect == 1
    for k in range(3, 5):
        _step(store, h, [0], k)
    h = store.open_stream("s", 1, resumes=True)  # nor did the one before: row 4 is lost
    assert store.counters.transitions_dropped_disconnect == 2
    for k in range(5, 8):
        _step(store, h, [0], k)
    store.close_stream(h)  # row 7 kept for a stream that resumes: not lost yet
    assert store.counters.transitions_dropped_disconnect == 2
    clock.now += 61.0
    store.open_stream("other", 1)  # the session is let go, and row 7 with it
    assert store.counters.transitions_dropped_disconnect == 3
    assert [(seg.t, len(seg.rewards)) for seg in _drain(store)] == [(0, 2), (3, 1), (5, 2)]


def test_a_final_observation_answered_and_lost_begins_the_next_episode_at_t_0() -> None:
    """Message 2 (the final observation of episode 0) was answered and the stream ended: the
    client's next observation begins episode 1. It was numbered (0, 3) before, as if episode 0
    went on."""
    store = _store(segment_steps=8)
    h = store.open_stream("s", 1)
    for k in range(3):
        _step(store, h, [0], k, term=[k == 2])
    h = store.open_stream("s", 1)
    for k in range(3, 12):
        _step(store, h, [0], k)
    assert [(seg.episode, seg.t) for seg in _drain(store)] == [(0, 0), (1, 0)]


def _row_bytes(store: TransitionStore) -> int:
    """Bytes of the row buffers the store's sessions hold."""
    arrays = [v for s in store._sessions.values() for v in vars(s).values() if isinstance(v, np.ndarray)]
    return sum(a.nbytes for a in arrays)


def test_a_closed_session_frees_its_rows_and_a_later_stream_goes_on_with_its_episodes() -> None:
    """A session whose stream closed keeps its envs' episode counters only (a sim worker's
    session is its host and pid: each start makes a new one); a stream that takes it over later
    gets fresh buffers, its segments numbered on from where the last one ended."""
    store = _store(segment_steps=4)
    h = store.open_stream("s", 2)
    for k in range(6):
        _step(store, h, [0, 1], k)
    held = _row_bytes(store)
    store.close_stream(h)  # rows 4 and 5 completed; the open row of message 5 dropped
    assert [(s.env_id, s.t, len(s.rewards)) for s in _drain(store)] == [
        (0, 0, 4),
        (1, 0, 4),
        (0, 4, 1),
        (1, 4, 1),
    ]
    closed = _row_bytes(store)
    assert closed == 2 * (4 * 8 + 1)  # per env: its episode, its step, its sync quota's counts, a flag
    late = BatchResult(np.ones((2, 1), np.float32), np.zeros(2), None, 0, 0, 0, 2)
    store.record(h, np.array([0, 1]), late)  # a late answer of the closed stream is not recorded
    assert _row_bytes(store) == closed
    h2 = store.open_stream("s", 2)
    for k in range(6, 11):
        _step(store, h2, [0, 1], k)
    segs = _drain(store)
    assert [(s.env_id, s.episode, s.t) for s in segs] == [(0, 0, 6), (1, 0, 6)]  # one step lost
    np.testing.assert_array_equal(tensors.decode(segs[0].obs)[:, 0], [6, 7, 8, 9])
    store.close_stream(h)  # the first stream's handle, spent: nothing changes
    assert _row_bytes(store) == held


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _closed_store(clock: _Clock, **kw: object) -> TransitionStore:
    return TransitionStore(TransitionConfig(segment_steps=2, **kw), OBS, clock=clock)  # type: ignore[arg-type,unused-ignore]


def _session_ran(
    store: TransitionStore, session_id: str, steps: int = 3, *, close: bool = True
) -> StreamHandle:
    h = store.open_stream(session_id, 1)
    for k in range(steps):
        _step(store, h, [0], k, term=[k == 1])  # its episode 0 ends: row 1 is its final observation
    if close:
        store.close_stream(h)
    return h


def test_a_closed_session_is_kept_for_closed_session_keep_s_and_then_let_go() -> None:
    """A closed session's counters were kept for good (1.7 KB each with 32 envs, every sim fleet
    start making new sessions). A stream that comes back within ``closed_session_keep_s`` still
    goes on with its episodes; one that comes back later starts afresh."""
    clock = _Clock()
    store = _closed_store(clock, closed_session_keep_s=600.0)
    _session_ran(store, "back-soon")
    _session_ran(store, "back-late")
    assert {(seg.session_id, seg.episode, seg.t) for seg in _drain(store)} == {
        ("back-soon", 0, 0),
        ("back-late", 0, 0),
    }
    clock.now += 599.0
    again = store.open_stream("back-soon", 1)  # reopened in time: off the closed list
    _step(store, again, [0], 0)
    clock.now += 1.0
    _session_ran(store, "another")  # each close lets go of what has been closed too long
    assert store.counters.sessions_forgotten == 1
    assert sorted(store._sessions) == ["another", "back-soon"]
    _step(store, again, [0], 1)
    _step(store, again, [0], 2)
    late = store.open_stream("back-late", 1)
    _step(store, late, [0], 0)
    _step(store, late, [0], 1)
    _step(store, late, [0], 2)
    assert [(seg.session_id, seg.episode, seg.t) for seg in _drain(store)] == [
        ("another", 0, 0),
        ("back-soon", 1, 1),  # went on: episode 1 began at the close, its first step lost
        ("back-late", 0, 0),  # afresh
    ]
    clock.now += 10_000.0  # nothing closes: what is closed goes at the next open
    store.open_stream("new", 1)
    assert sorted(store._sessions) == ["back-late", "back-soon", "new"]  # those two stay open
    assert store.counters.sessions_forgotten == 2


def test_at_most_max_closed_sessions_are_kept_the_longest_closed_going_first() -> None:
    clock = _Clock()
    store = _closed_store(clock, max_closed_sessions=2)
    for n in range(5):
        _session_ran(store, f"s{n}")
        clock.now += 1.0
    assert sorted(store._sessions) == ["s3", "s4"] and store.counters.sessions_forgotten == 3
    open_one = _session_ran(store, "open", close=False)
    _session_ran(store, "s5")
    assert sorted(store._sessions) == ["open", "s4", "s5"]  # an open session is never let go
    store.close_stream(open_one)
    assert sorted(store._sessions) == ["open", "s5"]
    nothing = _closed_store(clock, max_closed_sessions=0)
    _session_ran(nothing, "s")
    assert nothing._sessions == {} and nothing.counters.sessions_forgotten == 1


def test_a_session_that_comes_back_mid_episode_to_a_server_that_does_not_know_it_is_marked_joined() -> None:
    """A robot's stream comes back after its server restarted: the new server numbered its envs'
    episodes from 0 again, so the trainer dropped the new segments whose identities (session,
    env, 0, t) it had taken before as duplicates (here both of the episode's, 4 transitions
    lost) and, once those had left its memory, took the episode's tail for a whole episode (3
    steps of 8). A client that says ``mid_episode`` now has the episodes in progress numbered
    from the clock and marked as joined midway; the trainer counts them as cut and takes every
    segment."""
    tracker, dedupe = EpisodeTracker(), Deduplicator()

    def trainer_takes(store: TransitionStore) -> list[pb.Segment]:
        segs = [seg for seg in _drain(store) if dedupe.first_time(seg)]
        assemble(segs, None, tracker)
        return segs

    before = _store(segment_steps=2)
    h = before.open_stream("robot", 1)
    for k in range(5):
        _step(before, h, [0], k, reward=float(k))
    assert [(s.episode, s.t) for s in trainer_takes(before)] == [(0, 0), (0, 2)]
    from_us = time.time_ns() // 1000
    restarted = _store(segment_steps=2)  # the server restarted: it knows no session
    h = restarted.open_stream("robot", 1, mid_episode=True)
    for k in range(5, 12):  # the robot's episode goes on, and ends with message 8
        _step(restarted, h, [0], k, reward=float(k), term=[k == 8])
    taken = trainer_takes(restarted)
    assert [(s.episode - from_us >= 0, s.t, s.joined_mid_episode) for s in taken] == [
        (True, 0, True),
        (True, 2, True),
        (True, 0, False),  # its next episode is whole: row 3's autoreset began it
    ]
    first = taken[0].episode
    assert from_us <= first <= time.time_ns() // 1000 and taken[2].episode == first + 1
    assert dedupe.duplicates == 0
    assert (tracker.cut, tracker.log.count) == (1, 0)
    h = restarted.open_stream("robot", 1, mid_episode=True)  # a reconnect the server knows of
    for k in range(12, 15):
        _step(restarted, h, [0], k, reward=float(k), term=[k == 14])
    assert [(s.episode, s.t, s.joined_mid_episode) for s in trainer_takes(restarted)] == [
        (first + 1, 3, False),  # goes on, its step in flight lost to the reconnect: cut
    ]
    assert (tracker.cut, tracker.log.count) == (2, 0)
    fresh = restarted.open_stream("sim", 1)  # not mid-episode: numbered from 0, whole
    for k in range(4):
        _step(restarted, fresh, [0], k, reward=float(k), term=[k == 2])
    assert [(s.episode, s.t, s.joined_mid_episode) for s in trainer_takes(restarted)] == [(0, 0, False)]
    assert tracker.log.last_lengths(10) == [2]  # the sim's episode (rows 0-1); the robot's are cut
    assert tracker.cut == 2


def test_window_resend_and_ack() -> None:
    store = _store(segment_steps=2)
    h = store.open_stream("s", 4)
    for k in range(3):
        _step(store, h, [0, 1, 2, 3], k)
    assert store.take_sendable() == []  # no trainer window yet
    store.ack(0, 4)
    assert [s.seq for s in store.take_sendable()] == [1, 2]  # 2 segments x 2 steps fill the window
    assert store.take_sendable() == []
    store.ack(1, 4)
    assert [s.seq for s in store.take_sendable()] == [3]
    assert store.pending_steps == 6
    store.trainer_connected()  # unacked 2 and 3 go out again first
    store.ack(1, 100)
    assert [s.seq for s in store.take_sendable()] == [2, 3, 4]
    assert store.counters.segments_resent == 2
    store.ack(4, 100)
    assert store.pending_steps == 0 and store.counters.transitions_acked == 8


def test_segments_a_reconnected_trainer_acknowledged_are_not_sent_again() -> None:
    """The trainer took and acknowledged segments 1-3, but its acknowledgements went down with its
    stream. Its new stream's first acknowledgement covers them: they are not sent again. Before,
    they went out again, filled the window (here all of it), were dropped by the trainer as
    duplicates and never acknowledged again, and nothing more was ever sent to it."""
    store = _store(segment_steps=2)
    h = store.open_stream("s", 2)
    store.ack(0, 6)
    for k in range(5):
        _step(store, h, [0, 1], k)
    assert [s.seq for s in store.take_sendable()] == [1, 2, 3]  # the window: 3 segments
    store.trainer_connected()  # the acks of 1-3 were lost
    store.ack(3, 6)  # the new stream's first message
    assert [s.seq for s in store.take_sendable()] == [4]
    assert store.counters.segments_resent == 3 and store.counters.segments_acked == 3
    assert store.pending_steps == 2 and store.counters.transitions_acked == 6


def test_drop_overflow_counts_what_it_drops() -> None:
    store = _store(segment_steps=2, max_pending_steps=4, overflow="drop")
    h = store.open_stream("s", 4)
    for k in range(3):
        _step(store, h, [0, 1, 2, 3], k)
    assert store.pending_steps == 4
    assert store.counters.transitions_dropped_overflow == 4
    assert [s.env_id for s in _drain(store)] == [2, 3]  # the oldest went first


def test_block_overflow_makes_steps_wait() -> None:
    async def main() -> None:
        store = _store(segment_steps=2, max_pending_steps=4)
        h = store.open_stream("s", 2)
        both = np.array([0, 1])
        for k in range(3):  # the third message completes one 2-step segment per env
            await store.admit(h, both)
            _step(store, h, [0, 1], k)
        assert store.pending_steps == 4
        waiter = asyncio.ensure_future(store.admit(h, both))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # the buffer is full: backpressure
        store.ack(0, 100)
        sent = store.take_sendable()
        store.ack(max(s.seq for s in sent), 100)
        await asyncio.wait_for(waiter, 1.0)
        assert store.counters.backpressure_wait_us >= 40_000

    asyncio.run(main())


def test_sync_quota_is_per_env_so_uneven_streams_fill_one_segment_each() -> None:
    async def main() -> None:
        store = _store(segment_steps=2, sync_env_steps=2)
        fast, slow = store.open_stream("fast", 2), store.open_stream("slow", 1)
        fast_ids, slow_ids = np.array([0, 1]), np.array([0])
        await store.admit(fast, fast_ids)
        await store.admit(fast, fast_ids)
        assert not store.try_admit(fast, fast_ids)  # its share of this version is used up
        assert not store.try_admit(fast, np.array([1]))
        blocked = asyncio.ensure_future(store.admit(fast, fast_ids))
        await asyncio.sleep(0.05)
        assert not blocked.done()
        # The slow stream's env still has its share, whatever the fast one took.
        assert store.try_admit(slow, slow_ids) and store.try_admit(slow, slow_ids)
        assert not store.try_admit(slow, slow_ids)
        store.published()
        await asyncio.wait_for(blocked, 1.0)
        assert store.counters.weight_publishes == 1
        assert store.try_admit(slow, slow_ids)  # a publish renews every env's share
        # The woken request took the first of the fast envs' two new actions.
        assert store.try_admit(fast, fast_ids) and not store.try_admit(fast, fast_ids)

    asyncio.run(main())


@pytest.mark.parametrize("resumes", [False, True], ids=["does-not-resume", "resumes"])
@pytest.mark.parametrize("answered", [False, True], ids=["unanswered", "answered"])
def test_sync_mode_fills_each_envs_segment_though_a_stream_ended_mid_version(
    resumes: bool, answered: bool
) -> None:
    """Sync mode admits ``segment_steps`` actions per env per version, and the trainer waits for
    that many rows of each env. The stream ended with message 2 admitted (answered or not) and the
    client, which never got its answer, sends it again on its next stream. Before, message 2's
    first admission stayed in the quota though its row was never completed: the env was held
    with 3 of its 4 rows, and the batch never filled. And the version's last rows, in a segment
    that the break had begun short, stayed in the server's buffer until the segment filled,
    which the quota kept it from doing."""
    store = _store(segment_steps=4, sync_env_steps=4)
    env = np.array([0])

    def send(h: StreamHandle, k: int, *, answer: bool = True) -> bool:
        """Message k; whether it was admitted (and answered, with ``answer``)."""
        z, f = np.zeros(1, np.float32), np.zeros(1, bool)
        obs = np.full((1, 3), k, np.float32)
        store.observe(h, env, obs, rewards=z, terminated=f, truncated=f, fallback=f)
        if not store.try_admit(h, env):
            return False
        if answer:
            store.record(h, env, BatchResult(np.zeros((1, 1), np.float32), z, None, 0, 0, 0, 1))
        return True

    h = store.open_stream("s", 1, resumes=resumes)
    assert send(h, 0) and send(h, 1) and send(h, 2, answer=answered)
    h = store.open_stream("s", 1, resumes=resumes)
    k = 2
    while send(h, k):
        k += 1
    assert store.counters.transitions == 4  # the env's segment of this version is full
    assert [len(seg.rewards) for seg in _drain(store)] == [2, 2]  # and all of it reaches the trainer
    assert store.counters.transitions_dropped_disconnect == int(answered and not resumes)
    store.published()
    assert store.try_admit(h, env)  # the held message goes ahead with the next version


def test_a_taken_over_streams_waiting_request_is_never_admitted() -> None:
    """A request of a stream that waited for its admission (backpressure, or the sync quota) while
    a newer stream took its session over: admitted, it charged the env's quota for a step that
    would never be answered."""
    store = _store(segment_steps=2, sync_env_steps=2)
    old = store.open_stream("s", 1)
    new = store.open_stream("s", 1)
    assert not store.try_admit(old, np.array([0]))
    assert store.try_admit(new, np.array([0])) and store.try_admit(new, np.array([0]))
    assert not store.try_admit(new, np.array([0]))


BAD_SETTINGS: dict[str, tuple[dict[str, Any], str]] = {
    "segment_steps": ({"segment_steps": 0}, "segment_steps must be >= 1, got 0"),
    "max_pending_steps": (
        {"segment_steps": 64, "max_pending_steps": 63},
        "max_pending_steps (63) must be >= segment_steps (64)",
    ),
    "overflow": ({"overflow": "spill"}, "overflow must be one of ('block', 'drop'), got 'spill'"),
    "sync_env_steps": ({"sync_env_steps": -1}, "sync_env_steps must be >= 0, got -1"),
    "sync_env_steps beyond a uint32": (
        {"sync_env_steps": 2**32},
        "sync_env_steps must be at most 4294967295, got 4294967296",
    ),
    "weight_sync_interval": ({"weight_sync_interval": 0}, "weight_sync_interval must be >= 1, got 0"),
    "closed_session_keep_s": (
        {"closed_session_keep_s": -1.0},
        "closed_session_keep_s must be >= 0, got -1.0",
    ),
    "closed_session_keep_s NaN": (
        {"closed_session_keep_s": math.nan},
        "closed_session_keep_s must be a finite number, got nan",
    ),
    "max_closed_sessions": ({"max_closed_sessions": -1}, "max_closed_sessions must be >= 0, got -1"),
    "sync with interval": (
        {"sync_env_steps": 32, "weight_sync_interval": 2},
        "synchronous mode (sync_env_steps > 0) needs weight_sync_interval = 1",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_a_bad_learner_setting_is_refused_naming_it(case: str) -> None:
    setting, message = BAD_SETTINGS[case]
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        TransitionConfig(**setting)


# -- the trainer's episodes, rebuilt from the segments -----------------------------------------------
# Message k carries the reward of action k-1 (``_step`` with reward=k): the row that message j
# opened has reward j + 1.


def _episodes(tracker: EpisodeTracker, store: TransitionStore) -> list[tuple[float, int]]:
    """Feed the store's sendable segments through the trainer's path and acknowledge them; the
    episodes logged so far."""
    batch = assemble(_drain(store), None, tracker)
    store.ack(batch.last_seq, 1 << 30)
    returns = tracker.log.last_returns(100)
    return list(zip(returns, tracker.log.last_lengths(100), strict=True))


def test_an_episode_is_logged_only_if_every_step_of_it_reached_the_trainer() -> None:
    """The server dropped the first segment (``overflow = "drop"``, as for a trainer that joins a
    running server): the episode it began is cut, counted, not logged; the next one is whole."""
    store = _store(segment_steps=4, max_pending_steps=4, overflow="drop")
    tracker = EpisodeTracker()
    h = store.open_stream("s", 1)
    # Episode 0: rows 0-5, ended by message 6 (row 6 is its final observation, autoreset).
    for k in range(9):
        _step(store, h, [0], k, reward=float(k), term=[k == 6])
    assert store.counters.transitions_dropped_overflow == 4  # rows 0-3
    assert _episodes(tracker, store) == [] and tracker.cut == 1  # rows 4-5 (rewards 5, 6) only
    # Episode 1: rows 7-10, ended by message 11.
    for k in range(9, 13):
        _step(store, h, [0], k, reward=float(k), term=[k == 11])
    assert _episodes(tracker, store) == [(8.0 + 9.0 + 10.0 + 11.0, 4)]
    assert tracker.cut == 1


def test_an_episode_that_lost_a_step_to_a_reconnect_is_cut() -> None:
    store = _store(segment_steps=4)
    tracker = EpisodeTracker()
    h = store.open_stream("s", 1)
    for k in range(3):
        _step(store, h, [0], k, reward=float(k))
    h2 = store.open_stream("s", 1)  # row 2's action is lost: episode 0 goes on at t = 3
    # Episode 0 ends with message 5 (row 4); episode 1 is rows 6-8, ended by message 9.
    for k in range(3, 12):
        _step(store, h2, [0], k, reward=float(k), term=[k in (5, 9)])
    assert _episodes(tracker, store) == [(7.0 + 8.0 + 9.0, 3)]
    assert tracker.cut == 1


def test_episodes_longer_than_a_segment_are_summed_over_their_segments() -> None:
    store = _store(segment_steps=2)
    tracker = EpisodeTracker()
    h = store.open_stream("s", 2)
    for k in range(12):  # env 0 ends after rows 0-4, env 1 after rows 0-2 and 4-8
        _step(store, h, [0, 1], k, reward=float(k), term=[k == 5, k in (3, 9)])
    logged = _episodes(tracker, store)
    # _step adds the env id to the reward: env 1's rows have reward j + 2
    assert sorted(logged) == sorted([(15.0, 5), (2.0 + 3.0 + 4.0, 3), (6.0 + 7.0 + 8.0 + 9.0 + 10.0, 5)])
    assert tracker.cut == 0


def test_env_states_forget_an_env_quiet_for_a_whole_period() -> None:
    now = [0.0]
    states: EnvStates[int] = EnvStates(idle_s=10.0, idle_segments=3, clock=lambda: now[0])
    a, b, c = ("s", 0), ("s", 1), ("t", 0)
    states.put(a, 1)
    states.put(b, 1)
    now[0] = 100.0
    states.put(a, 2)  # 3 segments and 100 s: the first period ends
    states.put(c, 1)
    states.put(a, 3)
    assert states.get(b) == 1 and len(states) == 3  # b is quiet for part of a period only
    states.put(a, 4)  # 3 segments, but no time has passed: the period goes on
    assert states.get(b) == 1
    now[0] = 200.0
    states.put(c, 2)  # the second period ends: b sent nothing in it
    assert states.get(b) is None and states.forgotten == 1
    assert (states.get(a), states.get(c), len(states)) == (4, 2, 2)


def test_env_states_forget_nothing_while_nothing_arrives_or_no_time_passes() -> None:
    now = [0.0]
    states: EnvStates[int] = EnvStates(idle_s=10.0, idle_segments=3, clock=lambda: now[0])
    fast, slow = ("sim", 0), ("robot", 0)
    states.put(slow, 1)
    now[0] = 5.0
    for i in range(100):  # a slow env among fast ones: segments pass, not enough time
        states.put(fast, i)
    now[0] = 10_000.0  # a stalled trainer: time passes, nothing arrives
    states.put(fast, 100)  # a period ends: the slow env sent in it
    states.put(fast, 101)
    states.put(fast, 102)
    assert (states.get(slow), states.forgotten) == (1, 0)
    states.put(fast, 103)  # the next period's 3 segments, but it is not 10 s long yet
    assert (states.get(slow), states.forgotten) == (1, 0)
    now[0] = 10_010.0
    states.put(fast, 104)  # a whole period without the slow env
    assert (states.get(slow), states.forgotten, len(states)) == (None, 1, 1)


def test_env_states_refuse_a_bad_setting() -> None:
    with pytest.raises(ValueError, match=r"^idle_s must be a finite number >= 0, got -1.0$"):
        EnvStates(idle_s=-1.0)
    with pytest.raises(ValueError, match=r"^idle_segments must be >= 1, got 0$"):
        EnvStates(idle_segments=0)


def test_the_trainer_keeps_the_state_of_the_envs_still_sending_only() -> None:
    """Sessions that come and go (each robot start makes a new one) leave no state behind once
    quiet for a period; an env that comes back mid-episode afterwards has that episode cut."""
    scaler = RewardScaler(0.99, returns=EnvStates(idle_s=0.0, idle_segments=64))
    tracker = EpisodeTracker(running=EnvStates(idle_s=0.0, idle_segments=64))
    store = _store(segment_steps=2)
    first = store.open_stream("first", 1)
    for k in range(3):
        _step(store, first, [0], k)
    assemble(_drain(store), scaler, tracker)  # rows 0-1 of its episode 0
    assert tracker.running.get(("first", 0)) is not None
    for n in range(100):  # 100 sessions of 8 envs, one segment each
        h = store.open_stream(f"host/{n}", 8)
        for k in range(3):
            _step(store, h, list(range(8)), k)
        store.close_stream(h)
        assemble(_drain(store), scaler, tracker)
        assert len(tracker.running) <= 2 * 64 and len(scaler.returns) <= 2 * 64
    assert tracker.running.get(("first", 0)) is None and scaler.returns.get(("first", 0)) is None
    assert tracker.running.forgotten >= 801 - 2 * 64
    _step(store, first, [0], 3)
    _step(store, first, [0], 4, term=[True])  # its episode 0 ends: rows 0-3
    assemble(_drain(store), scaler, tracker)  # rows 2-3: the trainer forgot rows 0-1
    assert (tracker.cut, tracker.log.count) == (1, 0)
