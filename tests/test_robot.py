"""Robots behind the watchdog against a real edge server: latency, faults, outages, chunks."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgerl.edge_server.policy import TorchPolicyBackend
from edgerl.edge_server.transitions import TransitionConfig
from edgerl.launch.bench_robot import BenchRobotConfig, busy_robot_processes
from edgerl.launch.cli import main
from edgerl.launch.machine import BUSY_CORES, CpuMeter
from edgerl.launch.robot import ESTOPPED_STATUS
from edgerl.models import build_policy
from edgerl.proto import tensors
from edgerl.robot_client.bags import read_bag
from edgerl.robot_client.netproc import HUNG_AFTER_S
from edgerl.robot_client.robot import Robot, RobotKind, RobotState, load_robot
from edgerl.robot_client.runner import (
    LinkFaults,
    RobotHost,
    RobotLink,
    RobotRunnerConfig,
    _Request,
    chunk_defaults,
)
from edgerl.sim.envs import env_spec
from edgerl.sim.robot import MujocoRobot
from edgerl.watchdog.clock import MonotonicClock
from edgerl.watchdog.watchdog import Tick, TickKind, WatchdogConfig
from tests.helpers import (
    EDGERL,
    EchoPolicy,
    ServerThread,
    check_machine_block,
    hellos_checked,
    nothing_left_for_a_later_loop,
    unclosed_resources,
    wait_until,
)

HZ = 50.0
BOTH_STREAMS = pytest.mark.parametrize("network_process", [False, True], ids=["thread", "process"])
"""Run a test with the stream on the control thread and in a network process."""


class CounterRobot:
    """Observation [tick count, robot id, 0]; applied actions are kept for the test to inspect."""

    obs_shape: tuple[int, ...] = (3,)
    action_low = np.full(2, -1000.0, np.float32)
    action_high = np.full(2, 1000.0, np.float32)
    joint_names: tuple[str, ...] = ("count", "id", "zero")

    def __init__(self, name: str = "counter", rid: int = 0) -> None:
        self.name = name
        self.rid = rid
        self.count = 0
        self.applied: list[np.ndarray] = []

    def safe_action(self) -> np.ndarray:
        return np.zeros(2, np.float32)

    def read(self) -> RobotState:
        return RobotState(np.array([self.count, self.rid, 0.0], np.float32), reward=1.0)

    def apply(self, action: np.ndarray) -> None:
        self.applied.append(action.copy())
        self.count += 1

    def reset(self) -> RobotState:
        return self.read()

    def close(self) -> None:
        pass


class SlowRobot(CounterRobot):
    """A :class:`CounterRobot` whose driver takes a second to connect; it says so on stderr first."""

    def __init__(self, name: str = "counter", rid: int = 0) -> None:
        print("a robot driver: connecting", file=sys.stderr, flush=True)
        time.sleep(1.0)
        super().__init__(name, rid)


def _run(host: RobotHost, seconds: float) -> list[dict[str, Any]]:
    """The robots' stats after ``seconds`` of running, taken once the host stopped: they count
    every tick the robots applied, up to the last (a stall may fall between a snapshot and the stop)."""
    with host:
        time.sleep(seconds)
    return host.stats()


def _config(server: str, **kw: Any) -> RobotRunnerConfig:
    wd = {"hz": HZ, "deadline_s": 0.02, "max_delta": 1e6, **kw.pop("watchdog", {})}
    return RobotRunnerConfig(server, WatchdogConfig(**wd), **kw)


def test_mujoco_robot_runs_one_control_period_per_action() -> None:
    robot = MujocoRobot("HalfCheetah-v5", hz=50.0)
    assert isinstance(robot, Robot)
    assert getattr(robot.env.unwrapped, "dt") == pytest.approx(0.02)  # noqa: B009 - not in gymnasium's Env type
    before = robot.read().obs.copy()
    robot.apply(robot.safe_action())
    assert not np.array_equal(before, robot.read().obs)
    robot.close()


def test_load_robot_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="module:Class"):
        load_robot("nocolon")
    with pytest.raises(ValueError, match="does not implement the Robot protocol"):
        load_robot("collections:OrderedDict")
    with pytest.raises(ValueError, match=r"^robot 'no_such_module:Arm': No module named 'no_such_module'$"):
        load_robot("no_such_module:Arm")
    with pytest.raises(ValueError, match=r"^robot 'collections:Arm': module 'collections' has no attribute"):
        load_robot("collections:Arm")
    with pytest.raises(ValueError, match=r"^robot 'math:pi' is not a class$"):
        load_robot("math:pi")


@BOTH_STREAMS
def test_policy_actions_reach_every_robot_in_time(network_process: bool) -> None:
    robots = [CounterRobot(f"c{i}", rid=i) for i in range(3)]
    with ServerThread(EchoPolicy(3, 2)) as srv:
        stats = _run(RobotHost(robots, _config(srv.address, network_process=network_process)), 1.5)
    for r, s in zip(robots, stats, strict=True):
        assert s["ticks"] >= 60 and len(r.applied) == s["ticks"]  # the stats count every tick
        # The first tick has nothing to apply yet; a stall of the whole shared machine (seen up
        # to 50 ms here) costs a few more: CI once saw 4 of 75 with the network process.
        assert s["fallbacks"] <= 2 + s["ticks"] // 10, s
        # the median: a stall of the machine decides the p99 of 75 ticks (CI once saw 27.8 ms)
        assert s["latency_ms_p50"] < 10.0
        # The echo policy answers the observation [count, id, 0] with [count, id]: each tick
        # applies the answer to the previous tick's observation, taken after count applies.
        applied = np.array(r.applied[5:])
        np.testing.assert_allclose(applied[:, 1], r.rid)
        counts, ticks = applied[:, 0], np.arange(5, 5 + len(applied))
        # In order, and never an answer to an observation not yet taken. A fallback holds the
        # last action (its count lags), and the answer it stood in for may apply a tick late:
        # each fallback puts at most two ticks off their count (CI once saw 2 off, max lag 2).
        assert np.all(np.diff(counts) >= 0) and np.all(counts <= ticks), counts
        off = int(np.sum(counts != ticks))
        assert off <= 2 * s["fallbacks"], (off, s, counts)


@BOTH_STREAMS
def test_more_robots_than_the_servers_batch_go_in_several_messages(network_process: bool) -> None:
    """9 robots (a slot of 8 and one of 1) and a server whose batch holds 4 rows: a slot's rows
    went in one message, which the server refused (``step.env_ids: need 1 to 4 env ids
    (max_batch_size)``), ending the stream each time it opened, and the robots fell back. Now they
    go in messages of at most 4 rows, and each robot applies policy actions."""
    robots = [CounterRobot(f"c{i}", rid=i) for i in range(9)]
    with ServerThread(EchoPolicy(3, 2), max_batch_size=4) as srv:
        stats = _run(RobotHost(robots, _config(srv.address, network_process=network_process)), 1.5)
        assert srv.server is not None
        served = srv.server.servicer.stats()
    assert (served.rejected_invalid, served.max_batch_rows) == (0, 4)
    assert served.requests >= 3 * 60  # at least three messages a tick
    for r, s in zip(robots, stats, strict=True):
        # most ticks on policy actions (all fell back before): under a full test run on a slow
        # 2-core machine up to 14 % fell back
        assert s["ticks"] >= 60 and s["fallbacks"] <= s["ticks"] // 4, s
        np.testing.assert_allclose(np.array(r.applied[5:])[:, 1], r.rid)  # its own answers


@BOTH_STREAMS
def test_injected_latency_beyond_the_deadline_gives_fallbacks_and_the_server_is_told(
    network_process: bool,
) -> None:
    backend = EchoPolicy(3, 2)
    learner = TransitionConfig(segment_steps=8)
    robot = CounterRobot()
    with ServerThread(backend, learner=learner) as srv:
        cfg = _config(
            srv.address,
            network_process=network_process,
            faults=LinkFaults(delay_ms=30.0),
            watchdog={"estop_after": 0},
        )
        stats = _run(RobotHost([robot], cfg), 1.5)

        def segments() -> list[Any]:
            assert srv.server is not None and srv.server.store is not None
            store = srv.server.store
            store.ack(0, 1 << 20)
            return list(store.take_sendable())

        segs = segments()
    (s,) = stats
    assert s["fallback_rate"] == 1.0
    assert s["late_actions"] >= 50
    assert s["latency_ms_p50"] >= 30.0
    rows = [f for seg in segs for f in seg.fallback[1:]]  # row 0 of the stream precedes any action
    assert len(rows) >= 40 and all(rows)


@BOTH_STREAMS
def test_lost_answers_become_fallbacks(network_process: bool) -> None:
    robot = CounterRobot()
    with ServerThread(EchoPolicy(3, 2)) as srv:
        cfg = _config(
            srv.address,
            network_process=network_process,
            faults=LinkFaults(drop=0.5, seed=3),
            watchdog={"estop_after": 0},
        )
        (s,) = _run(RobotHost([robot], cfg), 1.5)
    assert s["answers"] >= 60
    assert 0.3 <= s["dropped"] / s["answers"] <= 0.7
    # A lost answer leaves its tick without a fresh action: one fallback for each loss (the last
    # loss may come after the last tick), and not two. A few more fall back where an answer came
    # late on a busy machine, and at the first tick, before any answer: 41 against 37 losses on
    # a machine at a third of its usual speed, where this allowed 3.
    assert s["dropped"] - 1 <= s["fallbacks"] <= 1.2 * s["dropped"] + 3


@BOTH_STREAMS
def test_small_injected_latency_is_absorbed(network_process: bool) -> None:
    robot = CounterRobot()
    with ServerThread(EchoPolicy(3, 2)) as srv:
        cfg = _config(
            srv.address, network_process=network_process, faults=LinkFaults(delay_ms=5.0, jitter_ms=5.0)
        )
        (s,) = _run(RobotHost([robot], cfg), 1.0)
    # 5-10 ms of delay inside a 20 ms deadline: no tick falls back for it. Allowed: the first
    # tick (nothing to apply yet) and the stalls of a shared 2-core CI machine (3 were seen in
    # 50 ticks once, 10 in a slow spell); a delay counted as a miss would make most of the 50
    # ticks fall back.
    assert s["ticks"] >= 40 and s["fallbacks"] <= s["ticks"] // 4, s
    assert 5.0 <= s["latency_ms_p50"] <= 19.0


@BOTH_STREAMS
def test_server_killed_robots_keep_rate_fall_back_and_resume(
    network_process: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    robots = [CounterRobot(f"c{i}", rid=i) for i in range(2)]
    kinds: list[list[TickKind]] = [[], []]
    hellos = hellos_checked(monkeypatch)

    def record(i: int, tick: Tick, reading: Any, was_reset: bool) -> None:
        kinds[i].append(tick.kind)

    with ServerThread(EchoPolicy(3, 2)) as srv:
        host = RobotHost(
            robots,
            _config(srv.address, network_process=network_process, watchdog={"estop_after": 100}),
            on_tick=record,
        )
        with host:
            time.sleep(0.5)
            srv.kill()
            t_kill = time.monotonic()
            time.sleep(1.0)
            srv.restart()
            down_s = time.monotonic() - t_kill
            time.sleep(1.5)
            stats = host.stats()
    for k, s in zip(kinds, stats, strict=True):
        assert s["ticks"] >= 0.95 * 3.0 * HZ  # the loop kept its rate throughout
        assert s["estops"] == 0
        assert s["max_consecutive_fallbacks"] >= int(down_s * HZ * 0.8)
        # Back on policy actions: the last half second is policy ticks, but for a rare late
        # answer on a loaded machine (CI once saw the very last tick fall back).
        tail = k[-int(0.5 * HZ) :]
        assert tail.count(TickKind.POLICY) >= 0.8 * len(tail), tail
        assert host.reconnects >= 1
    # The robots stepped on through the outage: the restarted server is told they are mid-episode.
    mid_episode = [h.mid_episode for h in hellos]  # what each stream's hello said
    assert mid_episode[0] is False and len(mid_episode) >= 2 and all(mid_episode[1:]), mid_episode


@BOTH_STREAMS
def test_robots_whose_loop_began_without_a_stream_say_mid_episode_on_their_first(
    network_process: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No stream within ``connect_timeout_s``: the loop runs the robots on fallbacks, so when the
    server comes their episodes are under way, and the first stream says so, not only later ones
    (its hello said otherwise, and a trainer logged the episodes' tails as whole ones)."""
    hellos = hellos_checked(monkeypatch)
    with ServerThread(EchoPolicy(3, 2)) as srv:
        srv.kill()
        cfg = _config(srv.address, network_process=network_process, connect_timeout_s=0.2)
        with RobotHost([CounterRobot()], cfg) as host:
            assert not host.connected
            time.sleep(0.3)  # the robots step on fallbacks
            srv.restart()
            assert wait_until(lambda: host.connected, 10, 0.01), "no stream"
            (s,) = host.stats()
    assert s["ticks"] > 0 and s["fallbacks"] > 0
    mid_episode = [h.mid_episode for h in hellos]
    assert mid_episode and all(mid_episode), mid_episode


@BOTH_STREAMS
@pytest.mark.parametrize("failure", ["reset", "silent", "route-down"])
def test_a_robot_hosts_broken_stream_loses_no_answered_step_to_a_server_that_lives_on(
    network_process: bool, failure: str
) -> None:
    """The host's stream breaks four times: its connection reset on the way, or gone silent (a
    link that died without closing: the answer is overdue after ``timeout_s``), there with the
    route down until a new connection failed too (it goes silent at once). Before, the
    server counted each robot's answered step lost at every break and at the stop (10 with the
    resets), and the trainer cut the robot's episode; and after a silent link the host never
    came back: each new stream went over the dead connection of the old (7 reconnects in 8 s,
    every tick a fallback). The host now opens each stream on a connection of its own, and
    resumes (``StreamHello.resumes``): each robot's next request completes the step, or, where
    the request in flight at the break went unanswered, goes in its place, numbered as it was
    (``StepObservation.obs_index``) and with all the robot earned since its last answer. Every
    row's reward is what the robot earned until its next request: one per tick, the count its
    next observation shows."""
    robots = [CounterRobot(f"c{i}", rid=i) for i in range(2)]
    with ServerThread(EchoPolicy(3, 2), learner=TransitionConfig(segment_steps=8)) as srv, srv.link() as link:
        host = RobotHost(robots, _config(f"127.0.0.1:{link.port}", network_process=network_process,
                                         watchdog={"estop_after": 0}))  # fmt: skip
        with host:
            for _ in range(4):
                assert wait_until(lambda: host.connected, 10, 0.01), "no stream"
                time.sleep(0.3)
                before = host.reconnects
                link.mute_new = failure == "route-down"
                srv.in_loop(link.cut if failure == "reset" else link.go_silent)
                seen = wait_until(lambda: host.reconnects > before + (failure == "route-down"), 10, 0.01)  # noqa: B023
                assert seen, "the break went unseen"
                link.mute_new = False
            assert wait_until(lambda: host.connected, 10, 0.01), "no stream"
            time.sleep(0.3)

        dropped, segments = srv.lost_and_segments()
    assert host.reconnects >= 4
    assert dropped == 0, dropped
    gaps, rows = 0, 0
    last: dict[int, tuple[int, int]] = {}
    for seg in segments:
        counts = [*tensors.decode(seg.obs)[:, 0].tolist(), tensors.decode(seg.bootstrap_obs)[0]]
        assert list(seg.rewards) == np.diff(counts).tolist(), seg  # a reward of 1 per tick
        if seg.env_id in last:
            gaps += last[seg.env_id] != (seg.episode, seg.t)
        last[seg.env_id] = (seg.episode, seg.t + len(seg.rewards))
        rows += len(seg.rewards)
    assert sorted(last) == [0, 1] and rows >= 2 * HZ  # a second of each robot's steps, at least
    assert gaps == dropped  # an episode goes on without a gap but where a step was lost


def test_outage_longer_than_n_latches_estop_that_survives_the_servers_return() -> None:
    robot = CounterRobot()
    with ServerThread(EchoPolicy(3, 2)) as srv:
        host = RobotHost([robot], _config(srv.address, watchdog={"estop_after": 10}))
        with host:
            time.sleep(0.3)
            srv.kill()
            time.sleep(0.5)
            srv.restart()
            time.sleep(0.8)
            (s,) = host.stats()
            assert s["estopped"] and s["estops"] == 1
            assert host.connected  # the link came back, the e-stop did not clear
            host.links[0].watchdog.reset()
            time.sleep(0.3)
            (s,) = host.stats()
    assert not s["estopped"]
    np.testing.assert_allclose(robot.applied[-1], [robot.count - 1, 0.0])


class EndingRobot(CounterRobot):
    """A :class:`CounterRobot` whose episode ends after ``length`` actions and stays ended (a
    fallen pendulum) until it is reset."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length
        self.since_reset = 0
        self.resets = 0
        self.reads = 0

    def apply(self, action: np.ndarray) -> None:
        super().apply(action)
        self.since_reset += 1

    def read(self) -> RobotState:
        self.reads += 1
        obs = np.array([self.count, self.rid, 0.0], np.float32)
        return RobotState(obs, reward=1.0, terminated=self.since_reset >= self.length)

    def reset(self) -> RobotState:
        self.resets += 1
        self.since_reset = 0
        return self.read()


def _lone_link(robot: Robot) -> RobotLink:
    """A robot's link with no stream: each of its ticks is driven by the test."""
    return RobotLink(0, robot, _config("127.0.0.1:1"), MonotonicClock())


def _fallback_tick(i: int) -> Tick:
    return Tick(i, 0.0, 0.0, np.zeros(2, np.float32), TickKind.FALLBACK, math.nan)


def test_what_a_robot_earns_after_an_episode_end_no_request_carried_goes_to_no_step() -> None:
    """An episode of 5 ticks ends while the robot has no stream, and it runs on into the next.
    Before, the robot's next request carried the reward of every tick since its last, the next
    episode's too, to the ended episode's last step. It now carries that episode's 5 and its end."""
    link = _lone_link(EndingRobot(length=5))
    for i in range(12):  # 5 to the end, a reset, the next episode's 5 to its end, a reset
        link._tick(_fallback_tick(i))
    assert link.counts["episodes"] == 2
    assert (link._reward, link._terminated, link._fallback) == (5.0, True, True)  # 10.0 before


def _lost(reward: float, index: int, *, end: bool = False, fallback: bool = False) -> Any:
    return _Request(0, 0.0, np.zeros(3, np.float32), reward, end, False, fallback, index)


@pytest.mark.parametrize("ended", [False, True], ids=["no-end", "episode-end"])
def test_a_released_request_goes_back_into_the_next_with_its_number(ended: bool) -> None:
    """The stream broke with request 7 in flight and, queued behind it, request 8: the episode's
    last (or, with no end, another request). The next request takes number 7 and carries what both
    earned, and what the robot earned since, unless an episode ended: that goes to no step."""
    link = _lone_link(CounterRobot())
    link._sent, link._final = _lost(2.0, 7), _lost(3.0, 8, end=ended)
    link._requests_made = 9
    link._reward, link._fallback = 4.0, True  # since request 8 (the next episode's, where it ended)
    link.release()
    assert not link._outstanding and link._sent is None and link._final is None
    assert link._requests_made == 7
    carried = (link._reward, link._terminated, link._fallback)
    assert carried == ((5.0, True, False) if ended else (9.0, False, True))


def test_an_e_stopped_robot_whose_episode_ends_is_held_not_reset_until_the_e_stop_is() -> None:
    """A reset moves a real robot (to its start pose): under an e-stop the robot is not reset."""
    robot = EndingRobot(length=30)
    seen: list[tuple[Tick, Any, bool]] = []
    with ServerThread(EchoPolicy(3, 2)) as srv:
        host = RobotHost(
            [robot], _config(srv.address, watchdog={"estop_after": 5}), on_tick=lambda *t: seen.append(t[1:])
        )
        with host:
            (link,) = host.links
            # on policy actions, episodes end and the robot is reset
            assert wait_until(lambda: robot.resets >= 1, 10, 0.005), "no reset on policy actions"
            srv.kill()
            assert wait_until(lambda: link.watchdog.estopped, 10, 0.005), "no e-stop"
            srv.restart()
            ended = wait_until(lambda: robot.since_reset >= robot.length and host.connected, 10, 0.005)
            assert ended, "no episode end"
            time.sleep(0.2)
            count, reads, resets = robot.count, robot.reads, robot.resets
            requests, episodes = link.counts["requests"], link.counts["episodes"]
            time.sleep(0.5)
            # held: ticks ran (the e-stop's actions applied, the robot read), no reset, no request,
            # no episode
            assert host.connected and robot.count > count + 20
            assert abs((robot.reads - reads) - (robot.count - count)) <= 1  # taken while it ticks
            assert robot.resets == resets
            assert (link.counts["requests"], link.counts["episodes"]) == (requests, episodes)
            link.watchdog.reset()  # the operator's reset: the robot is reset, the policy drives it
            assert wait_until(lambda: robot.resets == resets + 1, 10, 0.005), "no reset after the e-stop's"
            asking = wait_until(lambda: link.counts["requests"] > requests + 5, 10, 0.005)
            assert asking, "no requests after the reset"
    estop_at = next(k for k, (tick, _, _) in enumerate(seen) if tick.kind == TickKind.ESTOP)
    end = next(k for k in range(estop_at, len(seen)) if seen[k][1].terminated)
    reset = next(k for k in range(end, len(seen)) if seen[k][2])
    held = seen[end + 1 : reset]
    assert len(held) >= 0.5 * HZ
    for tick, reading, _ in held:  # the stop action (zero) applied; no reward or episode flags
        assert tick.kind == TickKind.ESTOP and not tick.action.any()
        assert (reading.reward, reading.terminated, reading.truncated) == (0.0, False, False)
    assert sum(was_reset for _, _, was_reset in seen[estop_at:]) == 1  # only the one after the e-stop's
    assert any(tick.kind == TickKind.POLICY for tick, _, _ in seen[reset:])


def test_an_episodes_last_observation_reaches_the_server_when_it_ends_with_a_request_in_flight() -> None:
    """Answers take 50 ms, so most episodes end while the robot's request is in flight: the last
    observation, which carries the episode's end, goes out once the answer is in."""
    learner = TransitionConfig(segment_steps=8)
    robot = EndingRobot(length=10)
    with ServerThread(EchoPolicy(3, 2, delay_s=0.05), learner=learner) as srv:
        (s,) = _run(RobotHost([robot], _config(srv.address, watchdog={"estop_after": 0})), 2.0)
        assert srv.server is not None and srv.server.store is not None
        srv.server.store.ack(0, 1 << 20)
        segs = list(srv.server.store.take_sendable())
    terminated = sum(t for seg in segs for t in seg.terminated)
    assert s["episodes"] >= 8 and s["requests"] < s["ticks"] / 2  # most ticks found a request in flight
    assert s["return_last20"] == 10.0  # a reward of 1 for each of an episode's 10 actions
    # every episode's end reached the server, but the last one's if the host stopped first
    assert s["episodes"] - 1 <= terminated <= s["episodes"]


@BOTH_STREAMS
def test_action_chunks_need_fewer_requests(network_process: bool) -> None:
    net = build_policy("mlp-small", 3, 2 * 4, seed=0)
    backend = TorchPolicyBackend(net, -np.ones(2), np.ones(2), chunk=4)
    robot = CounterRobot()
    with ServerThread(backend) as srv:
        cfg = _config(
            srv.address, network_process=network_process, refill_at=1, watchdog={"deadline_s": 0.06}
        )
        (s,) = _run(RobotHost([robot], cfg), 1.5)
    assert s["fallbacks"] <= 2
    # a request every 3 ticks, not every tick: each request is counted, each answered
    assert s["ticks"] / 5 <= s["requests"] <= s["ticks"] / 2.5
    assert s["requests"] - 1 <= s["answers"] <= s["requests"]
    assert s["action_age_ms_p99"] > 40.0  # later actions of a chunk are older


def test_bench_robot_defaults_suit_the_policy() -> None:
    assert chunk_defaults(50.0, 1) == (20.0, 1)
    assert chunk_defaults(20.0, 4) == (200.0, 2)
    assert chunk_defaults(50.0, 5) == (100.0, 2)
    cfg = BenchRobotConfig(hz=20.0, chunk=4, policy="llm")
    assert (cfg.deadline_ms, cfg.refill_at) == (200.0, 2)
    assert cfg.network_process  # behind the engine, the streams leave the control threads
    assert not BenchRobotConfig(policy="mlp").network_process
    cfg = BenchRobotConfig(
        hz=20.0, chunk=4, deadline_ms=100.0, refill_at=1, policy="llm", network_process=False
    )
    assert (cfg.deadline_ms, cfg.refill_at, cfg.network_process) == (100.0, 1, False)  # given values stay
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        BenchRobotConfig(chunk=0)
    with pytest.raises(ValueError, match=r"network_loss_s must be 0 or >= 1 .*got 0\.5"):
        BenchRobotConfig(network_loss_s=0.5)
    with pytest.raises(ValueError, match="network_loss_s >= 0"):
        BenchRobotConfig(network_loss_s=-1.0)


def test_chunks_slower_than_20_ms_apply_with_the_chunk_defaults() -> None:
    """Answers 30 ms late: every one misses the 20 ms deadline of single actions, while chunks of
    4 (80 ms at 50 Hz), asked for when 2 are left, arrive in time for their actions."""
    net = build_policy("mlp-small", 3, 2 * 4, seed=0)
    late = LinkFaults(delay_ms=30.0)
    stats = {}
    for name, (deadline_ms, refill_at) in (
        ("single", chunk_defaults(HZ, 1)),
        ("chunk", chunk_defaults(HZ, 4)),
    ):
        with ServerThread(TorchPolicyBackend(net, -np.ones(2), np.ones(2), chunk=4)) as srv:
            cfg = _config(
                srv.address, refill_at=refill_at, faults=late, watchdog={"deadline_s": deadline_ms / 1e3}
            )
            (stats[name],) = _run(RobotHost([CounterRobot()], cfg), 1.5)
    assert stats["single"]["policy_ticks"] == 0 and stats["single"]["late_actions"] >= 5
    # the first ticks, before the first chunk, fall back; a stall of the machine over the 10 ms of
    # margin (40 ms of actions left against 30 ms late) may cost a few more: 90 %, against 0 %
    chunk = stats["chunk"]
    assert chunk["ticks"] >= 60 and chunk["policy_ticks"] >= 0.9 * chunk["ticks"], chunk


def test_a_reset_signal_while_the_robots_connect_does_not_end_edgerl_robot(tmp_path: Any) -> None:
    """SIGUSR1 (the operator's e-stop reset) sent while a robot's driver connects: the command
    runs on, its robot gets policy actions, and it ends 0 (before, the signal's default action
    killed it)."""
    out, err_path = tmp_path / "robot.json", tmp_path / "err.txt"
    with ServerThread(EchoPolicy(3, 2)) as srv, err_path.open("w") as err:
        args = ["robot", "--server", srv.address, "--robot", "tests.test_robot:SlowRobot",
                "--seconds", "2", "--json", str(out)]  # fmt: skip
        proc = subprocess.Popen([*EDGERL, *args], stdout=subprocess.DEVNULL, stderr=err)
        try:
            connecting = wait_until(lambda: "a robot driver: connecting" in err_path.read_text(), 60, 0.01)
            assert connecting, err_path.read_text()
            os.kill(proc.pid, signal.SIGUSR1)  # within the driver's second of connecting
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert code == 0, (code, err_path.read_text())
    (robot,) = json.loads(out.read_text())["robots"]
    assert robot["policy_ticks"] >= 50  # driven for most of its 2 s at 50 Hz


def _sigusr1_disposition(pid: int) -> str:
    """How process ``pid`` takes SIGUSR1: "default", "ignored" or "caught" (/proc/PID/status)."""
    status = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
    )
    bit = 1 << (signal.SIGUSR1 - 1)
    if int(status["SigCgt"], 16) & bit:
        return "caught"
    return "ignored" if int(status["SigIgn"], 16) & bit else "default"


def test_edgerl_robot_ignores_the_reset_signal_until_it_can_take_it(tmp_path: Any) -> None:
    """From before the CLI's imports (~0.4 s), ``edgerl robot`` ignores SIGUSR1, then catches it as
    the operator's reset: there is no moment after the interpreter's start when the signal would
    end it. Sent while it is ignored, it does not; other commands keep the default."""
    out = tmp_path / "robot.json"
    with ServerThread(EchoPolicy(4, 1)) as srv:
        args = ["robot", "--server", srv.address, "--robot-arg", "env=InvertedPendulum-v5",
                "--seconds", "1", "--json", str(out)]  # fmt: skip
        proc = subprocess.Popen([*EDGERL, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seen: list[str] = []
        try:
            while proc.poll() is None and (not seen or seen[-1] != "caught"):
                with contextlib.suppress(OSError, KeyError):
                    state = _sigusr1_disposition(proc.pid)
                    if not seen or seen[-1] != state:
                        seen.append(state)
                        if state == "ignored":
                            os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(0.001)
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert seen[-2:] == ["ignored", "caught"], seen  # ignored first (before, it went default -> caught)
    assert code == 0
    assert json.loads(out.read_text())["robots"][0]["policy_ticks"] >= 25
    serve = subprocess.Popen(
        [*EDGERL, "serve", "--port", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(0.5)
        assert _sigusr1_disposition(serve.pid) == "default"
    finally:
        serve.kill()
        serve.wait()


def test_sigusr1_is_the_operators_reset_of_the_e_stops_of_edgerl_robot(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two robots e-stop (after 1 s of fallbacks) while their server is down, and stay so when it
    is back; the command says so and how to reset them. ``kill -USR1`` clears both latches, the
    policy drives them again, and the run ends 0, not 3. A second SIGUSR1, with no robot
    e-stopped, changes nothing."""
    hosts: list[RobotHost] = []
    start = RobotHost.start

    def kept(self: RobotHost, *args: Any) -> None:
        hosts.append(self)
        start(self, *args)

    monkeypatch.setattr(RobotHost, "start", kept)
    failures: list[BaseException] = []

    def operator(srv: ServerThread) -> None:
        try:
            host = wait_until(lambda: hosts[0] if hosts else None, 60, 0.01)
            assert host is not None, "the robots never started"
            dogs = [link.watchdog for link in host.links]
            assert wait_until(lambda: all(d.estopped for d in dogs), 30, 0.01), "no e-stop"
            srv.restart()
            assert wait_until(lambda: host.connected, 30, 0.01), "no stream after the server came back"
            time.sleep(0.5)
            assert all(d.estopped for d in dogs)  # the latch holds with the server back
            assert [s["policy_ticks"] for s in host.stats()] == [0, 0]
            os.kill(os.getpid(), signal.SIGUSR1)
            driven = wait_until(lambda: all(s["policy_ticks"] >= 25 for s in host.stats()), 30, 0.01)
            assert driven, "no policy actions after the reset"
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.5)  # the main loop sees a signal within 0.1 s
        except BaseException as exc:
            failures.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # ends the run

    out = tmp_path / "robot.json"
    # A signal that came after the command restored the handlers is ignored, not fatal to the tests.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        with ServerThread(EchoPolicy(3, 2)) as srv:
            srv.kill()
            thread = threading.Thread(target=operator, args=(srv,))
            thread.start()
            code = main(
                ["robot", "--server", srv.address, *COUNTER, "--robots", "2", "--hz", "50",
                 "--seconds", "120", "--connect-timeout-s", "0", "--deadline-ms", "20", "--refill-at", "1",
                 "--estop-after", "50", "--json", str(out)]
            )  # fmt: skip
            thread.join(60)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failures:
        raise failures[0]
    assert code == 0
    robots = json.loads(out.read_text())["robots"]
    assert [(r["robot"], r["estops"], r["estopped"]) for r in robots] == [
        ("robot-0", 1, False), ("robot-1", 1, False)
    ]  # fmt: skip
    assert all(r["policy_ticks"] >= 25 for r in robots)
    stream = json.loads(out.read_text())["stream"]
    assert stream["connected"] and stream["reconnects"] >= 1  # down at the start, up at the end
    lines = capsys.readouterr().out.splitlines()
    # each latch is announced once, with how to reset it (both robots may latch in one poll)
    told = [line for line in lines if line.startswith("edgerl robot: e-stopped: ")]
    hint = f" (the latch holds; kill -USR1 {os.getpid()} resets it)"
    assert told and all(line.endswith(hint) for line in told)
    named = [name for line in told for name in line.removesuffix(hint).split(": ", 2)[2].split(", ")]
    assert named == ["robot-0", "robot-1"]
    said = [line for line in lines if "e-stop reset" in line]
    assert said == [
        "edgerl robot: e-stop reset of 2 robot(s): robot-0, robot-1",
        "edgerl robot: e-stop reset asked for: no robot is e-stopped",
    ]


def test_edgerl_robot_takes_the_chunk_defaults_from_the_server(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Answers 30 ms late, chunks of 4: ``edgerl robot`` asks the server for its chunk length and
    applies the chunks; told the 20 ms deadline of single actions, it applies none."""
    net = build_policy("mlp-small", 3, 2 * 4, seed=0)
    robots = {}
    with ServerThread(TorchPolicyBackend(net, -np.ones(2), np.ones(2), chunk=4)) as srv:
        for name, extra in (("chunk", []), ("single", ["--deadline-ms", "20", "--refill-at", "1"])):
            out = tmp_path / f"{name}.json"
            code = main(
                ["robot", "--server", srv.address, "--robot", "tests.test_robot:CounterRobot", "--hz", "50",
                 "--seconds", "1.5", "--delay-ms", "30", "--json", str(out), *extra]
            )  # fmt: skip
            assert code == (0 if name == "chunk" else ESTOPPED_STATUS)  # "single": fallbacks only
            (robots[name],) = json.loads(out.read_text())["robots"]
    assert "chunks of 4 actions: deadline 80 ms, refill at 2" in capsys.readouterr().out
    assert robots["chunk"]["policy_ticks"] >= robots["chunk"]["ticks"] - 5
    assert robots["single"]["policy_ticks"] == 0


def test_a_lone_robot_without_a_name_streams_as_host_and_pid() -> None:
    import os
    import socket

    host = RobotHost([CounterRobot(name="")], _config("127.0.0.1:1"))  # the server refuses ""
    here = rf"{re.escape(socket.gethostname())}/{os.getpid()}(\.[0-9]+)?"  # later ones: pid.K
    assert re.fullmatch(here, host.session_id)
    other = RobotHost([CounterRobot(name="")], _config("127.0.0.1:1"))
    assert re.fullmatch(here, other.session_id) and other.session_id != host.session_id
    assert RobotHost([CounterRobot(name="arm")], _config("127.0.0.1:1")).session_id == "arm"


@BOTH_STREAMS
def test_a_robot_host_holds_its_stream_only_while_started(network_process: bool) -> None:
    """Built and never started (as a library user or a test does), a host holds no event loop
    and no network process; started and stopped, it leaves none behind."""
    cfg = _config("127.0.0.1:1", network_process=network_process, connect_timeout_s=0.0)
    with unclosed_resources() as unclosed:
        idle = RobotHost([CounterRobot()], cfg)
        assert (idle.stats()[0]["ticks"], idle.stats()[0]["return_last20"]) == (0, None)  # no episode yet
        del idle
        host = RobotHost([CounterRobot()], cfg)
        host.start()
        host.stop()
        host.stop()  # a second stop is harmless
        del host
    assert not unclosed, unclosed


KIND = RobotKind.of([CounterRobot()])


def test_the_chunk_is_one_when_no_server_answers(caplog: pytest.LogCaptureFixture) -> None:
    from edgerl.launch.robot import ask_server

    # nothing of the call it gave up on reaches a later event loop (grpc/grpc#26887: a
    # connectivity watch given up on completes later, into the closed loop)
    with nothing_left_for_a_later_loop(caplog):
        assert ask_server("127.0.0.1:1", None, KIND, timeout_s=0.5) == 1
        assert "could not ask 127.0.0.1:1 for its action chunk within 0.5s" in caplog.text
        # not waiting (the deadline and refill were given): no wait, and no warning
        caplog.clear()
        t0 = time.monotonic()
        assert ask_server("127.0.0.1:1", None, KIND, timeout_s=30.0, wait=False) == 1
        assert time.monotonic() - t0 < 5.0 and "could not ask" not in caplog.text


def test_a_stop_ends_the_waits_for_an_absent_server_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """edgerl robot asks the server for its chunk, then waits for the robots' stream; Ctrl-C or
    SIGTERM (``should_stop``) ends either wait, however long it may last."""
    from edgerl.launch.robot import ask_server

    with nothing_left_for_a_later_loop(caplog):
        t0 = time.monotonic()
        assert (
            ask_server(
                "127.0.0.1:1",
                None,
                KIND,
                timeout_s=30.0,
                should_stop=lambda: time.monotonic() > t0 + 0.5,
            )
            == 1
        )
        assert 0.45 < time.monotonic() - t0 < 5.0  # not the 30 s the probe may take
        assert "could not ask" not in caplog.text  # stopped: no warning that the server is missing

        host = RobotHost([CounterRobot()], _config("127.0.0.1:1", connect_timeout_s=30.0))
        t0 = time.monotonic()
        try:
            host.start(should_stop=lambda: time.monotonic() > t0 + 0.5)
            assert 0.45 < time.monotonic() - t0 < 5.0  # not the 30 s the stream may take
        finally:
            host.stop()
        assert host.stats()[0]["ticks"] == 0  # the loop never started: not even a fallback applied
        assert "no stream to" not in caplog.text


def _cheetah_server() -> ServerThread:
    """A server of a policy for HalfCheetah-v5 that names its env (as ``edgerl serve`` does)."""
    spec = env_spec("HalfCheetah-v5")
    net = build_policy("mlp-small", spec.obs_shape[0], spec.act_shape[0], seed=0)
    return ServerThread(TorchPolicyBackend(net, spec.act_low, spec.act_high), env_name="HalfCheetah-v5")


COUNTER = ["--robot", "tests.test_robot:CounterRobot"]  # 3 observations, 2 actions
WALKER = ["--robot-arg", "env=Walker2d-v5"]  # MujocoRobot: the shapes of HalfCheetah-v5, 17 and 6
MISMATCHES: dict[str, tuple[Callable[[], ServerThread], list[str], str]] = {
    "actions": (lambda: ServerThread(EchoPolicy(3, 1)), COUNTER,
                "the server answers actions of shape (1,), the robot host takes (2,)"),
    "observations": (lambda: ServerThread(EchoPolicy(4, 2)), COUNTER,
                     "the server serves observations of shape (4,), the robot host has (3,)"),
    "env": (_cheetah_server, WALKER, "the server serves a policy for HalfCheetah-v5, not for Walker2d-v5 "
            "(their observations share the shape (17,))"),
}  # fmt: skip
"""A server whose policy is not for the robots: how it is made, the robots (``edgerl robot``'s
options), and the reason they are refused."""


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_robots_behind_a_server_of_another_policy_are_refused_before_they_start(
    case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``edgerl robot`` checks the server's policy before it starts a robot, whether or not it
    needs the server's chunk."""
    server, robot, reason = MISMATCHES[case]
    with server() as srv:
        for extra in ([], ["--deadline-ms", "20", "--refill-at", "1"]):
            t0 = time.monotonic()
            code = main(["robot", "--server", srv.address, *robot, "--seconds", "30", *extra])
            assert code == 1 and time.monotonic() - t0 < 10.0  # not the 30 s run
            assert capsys.readouterr().err.splitlines()[-1] == f"edgerl robot: {reason}"
        assert srv.server is not None and srv.server.servicer.stats().requests == 0


@pytest.mark.parametrize("case", ["actions", "env"])
def test_a_robot_host_refuses_a_server_of_another_policy_at_connect(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A host started anyway (the library) refuses the server at every connect and runs on
    fallbacks, saying why."""
    server, _, reason = MISMATCHES[case]
    robot = CounterRobot() if case == "actions" else MujocoRobot("Walker2d-v5", hz=HZ)
    with server() as srv:
        host = RobotHost([robot], _config(srv.address, connect_timeout_s=1.0))
        (stats,) = _run(host, 0.5)
        assert srv.server is not None and srv.server.servicer.stats().requests == 0
    assert not host.connected and stats["policy_ticks"] == 0 and stats["fallbacks"] == stats["ticks"] > 0
    assert reason in caplog.text
    assert "dropped an action chunk" not in caplog.text


def test_robots_of_one_host_share_their_shapes_and_env() -> None:
    class Wider(CounterRobot):
        action_low = np.full(3, -1.0, np.float32)
        action_high = np.full(3, 1.0, np.float32)

    class Named(CounterRobot):
        env_name = "Pusher-v5"

    assert RobotKind.of([CounterRobot("a"), CounterRobot("b")]) == RobotKind((3,), (2,), "")
    assert RobotKind.of([Named("a")]) == RobotKind((3,), (2,), "Pusher-v5")
    with pytest.raises(ValueError, match=r"one action shape, got \[\(2,\), \(3,\)\]"):
        RobotHost([CounterRobot("a"), Wider("b")], _config("127.0.0.1:1"))
    with pytest.raises(ValueError, match=r"one env, got \['', 'Pusher-v5'\]"):
        RobotHost([CounterRobot("a"), Named("b")], _config("127.0.0.1:1"))
    with pytest.raises(ValueError, match="at least one robot"):
        RobotKind.of([])


BAD_HOST_SETTINGS: dict[str, tuple[dict[str, Any], str]] = {
    "robots_per_slot": ({"robots_per_slot": 0}, "robots_per_slot must be >= 1, got 0"),
    "refill_at": ({"refill_at": -1}, "refill_at must be >= 0, got -1"),
    "timeout_s": ({"timeout_s": 0.0}, "timeout_s must be > 0 and connect_timeout_s >= 0"),
    "connect_timeout_s": ({"connect_timeout_s": -1.0}, "timeout_s must be > 0 and connect_timeout_s >= 0"),
    "backoff": (
        {"backoff_initial_s": 1.0, "backoff_max_s": 0.5},
        "need 0 < backoff_initial_s <= backoff_max_s <= 2147483",
    ),
    "backoff_max_s": ({"backoff_max_s": 1e9}, "need 0 < backoff_initial_s <= backoff_max_s <= 2147483"),
    "network_cpus": ({"network_cpus": (0,)}, "network_cpus needs network_process"),
    "delay_ms": ({"faults": {"delay_ms": -1.0}}, "delay_ms and jitter_ms must be >= 0"),
    "jitter_ms": ({"faults": {"jitter_ms": -1.0}}, "delay_ms and jitter_ms must be >= 0"),
    "drop": ({"faults": {"drop": 1.5}}, "drop must be in [0, 1], got 1.5"),
}


@pytest.mark.parametrize("case", list(BAD_HOST_SETTINGS))
def test_a_bad_robot_host_setting_is_refused_naming_it(case: str) -> None:
    setting, message = BAD_HOST_SETTINGS[case]
    faults = setting.get("faults")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        if faults:  # the link's faults are checked where they are made
            LinkFaults(**faults)
        RobotRunnerConfig("127.0.0.1:1", **setting)


def test_robot_names_of_one_host_must_be_unique() -> None:
    with pytest.raises(ValueError, match=re.escape("robot names must be unique, got ['a', 'b', 'a']")):
        RobotHost([CounterRobot("a"), CounterRobot("b"), CounterRobot("a")], _config("127.0.0.1:1"))


def test_chunk_backend_needs_matching_output() -> None:
    net = build_policy("mlp-small", 3, 6, seed=0)
    with pytest.raises(ValueError, match="chunk"):
        TorchPolicyBackend(net, -np.ones(2), np.ones(2), chunk=4)


def test_edgerl_robot_cli_runs_mujoco_robots(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    spec = env_spec("InvertedPendulum-v5")
    net = build_policy("mlp-small", spec.obs_shape[0], spec.act_shape[0], seed=0)
    out = tmp_path / "robot.json"
    with ServerThread(TorchPolicyBackend(net, spec.act_low, spec.act_high)) as srv:
        code = main(
            ["robot", "--server", srv.address, "--robots", "2", "--hz", "50", "--seconds", "1.5",
             "--robot-arg", "env=InvertedPendulum-v5", "--fallback", "zero", "--json", str(out)]
        )  # fmt: skip
    assert code == 0
    robots = json.loads(out.read_text())["robots"]
    assert [r["robot"] for r in robots] == ["robot-0", "robot-1"]
    for r in robots:
        # The policy drove most ticks. How few fall back on a healthy link is bounded above
        # (test_policy_actions_reach_every_robot_in_time); with a neighbour busy on both CPUs,
        # up to a fifth of these did.
        assert r["ticks"] >= 60 and r["policy_ticks"] >= r["ticks"] // 2, r
        assert r["episodes"] >= 1  # the untrained pendulum falls; the robot was reset
    stream = json.loads(out.read_text())["stream"]
    assert stream["connected"] and stream["reconnects"] == 0 and stream["network_restarts"] == 0
    assert stream["messages"] >= min(r["policy_ticks"] for r in robots)  # one answer a tick, or more
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("edgerl robot: ticks")]
    assert lines and all(" stream up (0 reconnects)  cpu " in line for line in lines), lines
    # this process's share of a core over each line's 2 s: the robots and the stream used some
    cpus = [float(line.rsplit(" cpu ", 1)[1]) for line in lines]
    assert all(0.0 < c < 3.0 for c in cpus), lines
    assert 0.0 < stream["cpu_cores"] < 3.0  # over the whole run


def test_edgerl_robot_says_once_that_its_process_is_busy_until_it_is_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each status line gives this process's share of a core; the operator is told when it
    reaches 0.9, once for as long as it stays there, and again after it fell below. The shares
    are set here (a machine whose robots fill a core cannot be had on demand): 0.95, 0.97, 0.5,
    0.93, then 0.1 for the rest of the run."""
    from edgerl.launch import robot as robot_cmd

    shares = iter([0.95, 0.97, 0.5, 0.93])

    class SetMeter(CpuMeter):
        def cores(self) -> list[float | None]:
            return [next(shares, 0.1)]

    monkeypatch.setattr(robot_cmd, "CpuMeter", SetMeter)
    monkeypatch.setattr(robot_cmd, "STATS_EVERY_S", 0.25)
    spec = env_spec("InvertedPendulum-v5")
    net = build_policy("mlp-small", spec.obs_shape[0], spec.act_shape[0], seed=0)
    with ServerThread(TorchPolicyBackend(net, spec.act_low, spec.act_high)) as srv:
        code = main(
            ["robot", "--server", srv.address, "--robots", "1", "--hz", "50", "--seconds", "1.6",
             "--robot-arg", "env=InvertedPendulum-v5"]
        )  # fmt: skip
    assert code == 0
    out, err = capsys.readouterr()
    status = [line for line in out.splitlines() if line.startswith("edgerl robot: ticks")]
    assert [line.rsplit(" cpu ", 1)[1] for line in status][:5] == ["0.95", "0.97", "0.50", "0.93", "0.10"]
    busy = [line.split(":")[1] for line in err.splitlines() if "of a core" in line]
    assert busy == [" this process used 0.95 of a core", " this process used 0.93 of a core"]


def test_edgerl_robot_s_line_says_how_its_stream_fares() -> None:
    from edgerl.launch.robot import _line

    stats = [
        {"ticks": 100, "fallbacks": 25, "estopped": False, "latency_ms_p50": 2.0, "policy_version": 3},
        {
            "ticks": 100,
            "fallbacks": 75,
            "estopped": True,
            "latency_ms_p50": float("nan"),
            "policy_version": 4,
        },
    ]
    stream = {"connected": False, "reconnects": 3, "messages": 10, "network_restarts": 2}
    assert _line(stats, stream, 0.734) == (
        "ticks 200  fallbacks 100 (50.00%)  e-stopped 1/2  latency p50 2.0 ms  version 4  "
        "stream down (3 reconnects, 2 network process restarts)  cpu 0.73"
    )
    assert _line(stats, stream, None).endswith("restarts)  cpu -")  # no /proc to read


def test_edgerl_robot_tells_the_operator_when_its_process_is_near_a_whole_core() -> None:
    """At 0.9 of a core or more the control loop runs behind and the robots fall back whatever the
    server does: the operator is told so, with what to change (the network process only where the
    stream is not in one already); below it, or unmeasured, nothing is said."""
    from edgerl.launch.robot import busy_line

    assert busy_line(0.89, 100, 50.0, False) is None
    assert busy_line(None, 100, 50.0, False) is None
    assert busy_line(BUSY_CORES, 100, 50.0, False) == (
        "this process used 0.90 of a core: 100 robot(s) at 50 Hz are near its limit on this machine, "
        "so its ticks run late and its robots fall back whatever the server does (run fewer robots "
        "in each process, or move the stream to a process of its own: --network-process)"
    )
    assert busy_line(1.02, 8, 200.0, True) == (
        "this process used 1.02 of a core: 8 robot(s) at 200 Hz are near its limit on this machine, "
        "so its ticks run late and its robots fall back whatever the server does (run fewer robots "
        "in each process)"
    )


def test_edgerl_robot_e_stops_its_robots_and_ends_with_status_1_when_its_control_loop_stops(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A control loop that fails ramps its robots to their stop action (they do not keep the
    last action their drivers got), then the command says so and ends, instead of reporting a
    frozen host until its time is up. A robot's own failures become e-stops, so the fault is put
    into edgerl's stream: its hand-off after a slot raises."""
    from edgerl.robot_client import runner

    slots = 0
    hand_off = runner._ThreadOutbox.after_slot

    def breaks_at_the_50th(self: Any) -> None:
        nonlocal slots
        slots += 1
        if slots == 50:
            raise RuntimeError("the stream's books broke")
        hand_off(self)

    monkeypatch.setattr(runner._ThreadOutbox, "after_slot", breaks_at_the_50th)
    out, bag = tmp_path / "robot.json", tmp_path / "bag"
    started = time.monotonic()
    # no server: the fallback walks to the safe pose 2.0 (in 20 ticks), where the fault finds it
    code = main(
        ["robot", "--server", "127.0.0.1:1", "--robot-arg", "env=InvertedPendulum-v5", "--hz", "50",
         "--seconds", "30", "--connect-timeout-s", "0", "--estop-after", "0", "--fallback", "safe_pose",
         "--safe-pose", "2.0", "--max-delta", "0.1", "--record", str(bag), "--json", str(out)]
    )  # fmt: skip
    assert code == 1
    assert time.monotonic() - started < 10  # 1 s of ticks, not the 30 asked for
    assert capsys.readouterr().err.splitlines()[-1] == (
        'edgerl robot: the control loop stopped (RuntimeError("the stream\'s books broke")); the robots '
        "were ramped to their stop action, then closed"
    )
    (r,) = json.loads(out.read_text())["robots"]
    assert r["estopped"] and r["estops"] == 1
    (ticks,) = read_bag(bag).values()
    assert len(ticks) == r["ticks"]
    estop = [t.step.estop for t in ticks]
    assert estop == [False] * 50 + [True] * (len(ticks) - 50)  # the slot's tick ran, then the ramp
    actions = np.array([t.action[0] for t in ticks])
    assert actions[49] == pytest.approx(2.0)
    ramp = actions[49:]
    assert 20 <= len(ramp) - 1 <= 21  # 2.0 to 0 by 0.1 a tick (float32 may leave a sliver)
    assert np.all(np.diff(ramp) < 0) and np.all(np.diff(ramp) >= -0.1 - 1e-6) and ramp[-1] == 0.0
    tick_ms = np.diff([t.time_ns for t in ticks[49:]]) / 1e6
    assert np.median(tick_ms) == pytest.approx(20.0, abs=2.0)  # at 50 Hz, as the loop ran


def _strict_json(text: str) -> Any:
    """``text`` read as every JSON reader reads it: ``NaN`` and ``Infinity`` are refused."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    ("robot", "robots", "named"),
    [
        (COUNTER, 1, "robot 0"),  # a lone robot is given no name: the message names it by its index
        (["--robot-arg", "env=InvertedPendulum-v5"], 2, "robot-0, robot-1"),
    ],
)
def test_edgerl_robot_without_a_server_runs_on_fallbacks_and_reports_standard_json(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], robot: list[str], robots: int, named: str
) -> None:
    out = tmp_path / "robot.json"
    code = main(  # the deadline and refill given: the server is not asked for its chunk either
        ["robot", "--server", "127.0.0.1:1", *robot, "--hz", "50", "--robots", str(robots),
         "--seconds", "1.5", "--connect-timeout-s", "0", "--deadline-ms", "20", "--refill-at", "1",
         "--estop-after", "20", "--json", str(out)]
    )  # fmt: skip
    assert code == ESTOPPED_STATUS == 3  # the run is not taken for a good one
    report = _strict_json(out.read_text())
    written = report["robots"]
    assert len(written) == robots
    r = written[-1]
    assert r["ticks"] >= 50 and r["fallbacks"] == r["ticks"] and r["policy_ticks"] == 0
    assert r["estopped"] and r["max_consecutive_fallbacks"] == r["ticks"]
    # no answer, so no latency or action age: null, where Python's json would write NaN
    assert r["latency_ms_p50"] is None and r["action_age_ms_p99"] is None
    assert r["tick_jitter_ms_p99"] > 0  # the loop's own timing was measured
    stdout, stderr = capsys.readouterr()
    assert "latency p50 - (no answer yet)" in stdout
    assert stderr.splitlines()[-1] == f"edgerl robot: {robots} of {robots} robot(s) ended e-stopped: {named}"
    assert not report["stream"]["connected"] and report["stream"]["messages"] == 0
    assert report["stream"]["reconnects"] >= 1  # each attempt at the absent server failed
    assert _strict_json(stdout[stdout.index("{") :]) == report  # printed as written


def test_bench_robot_reports_the_issue_keys_and_rides_through_an_outage(tmp_path: Any) -> None:
    out = tmp_path / "robot.json"
    code = main(
        ["bench", "robot", "--robots", "4", "--hz", "50", "--policy", "mlp-small", "--warmup-s", "1",
         "--seconds", "2", "--sync-loop-s", "1", "--kill-server-s", "1", "--baseline-s", "0.5",
         "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    r = json.loads(out.read_text())
    c = r["config"]  # every flag reached the config, --seconds as duration_s
    assert (
        c["robots"],
        c["policy"],
        c["duration_s"],
        c["baseline_s"],
        c["fallback"],
        c["control_cpu"],
        c["deadline_ms"],
        c["refill_at"],
        c["network_process"],
    ) == (
        4,
        "mlp-small",
        2,
        0.5,
        "hold",
        "auto",
        20.0,  # no chunks: the single-action defaults
        1,
        False,  # an MLP: the stream stays on the control thread
    )
    for key in ("latency_ms_p50", "latency_ms_p99", "fallback_rate", "tick_jitter_ms_p99"):
        assert isinstance(r[key], float) and r[key] >= 0.0
    st = r["steady"]
    assert st["ticks"] >= 4 * 2 * 50 * 0.95
    # the periods due are the ticks run and the ticks skipped; fresh ones are neither fallbacks nor skipped
    due = st["ticks"] + st["loop_deadline_misses"]
    assert st["fresh_action_rate"] == pytest.approx((st["ticks"] - st["fallbacks"]) / due)
    assert 0.5 < st["fresh_action_rate"] <= 1.0
    assert r["latency_ms_p50"] < 20.0
    cpu = st["cpu_cores"]  # both processes worked in the steady phase; no network process ran
    assert cpu["server"] > 0.0 and cpu["network_processes"] == []
    assert len(cpu["robot_processes"]) == 1 and 0.0 < cpu["robot_processes"][0] < 1.5
    o = r["outage"]
    assert o["robots"] == 4 and o["robots_kept_rate"] == 4 and o["robots_fell_back"] == 4
    assert o["robots_estopped"] == 0 and o["robots_resumed"] == 4
    assert o["max_consecutive_fallbacks"] >= 0.9 * o["killed_for_s"] * 50
    assert r["sync_loop"]["control_hz"] > 0
    b = r["baseline_loop"]  # 4 robots in one slot, 25 slots in 0.5 s
    assert b["robots"] == 4 and 96 <= b["ticks"] <= 104
    assert 0.0 <= b["tick_jitter_ms_p50"] <= b["tick_jitter_ms_p99"] <= b["tick_jitter_ms_max"]
    check_machine_block(r)


def test_bench_robot_kills_and_stops_the_network_processes(tmp_path: Any) -> None:
    """With network processes, the last phase kills each robot process's one, then stops the new
    one: the spare takes over from the killed one within a few ticks; the stopped one is taken
    for hung after HUNG_AFTER_S and replaced; no robot e-stops, every loop keeps running."""
    out = tmp_path / "robot.json"
    code = main(
        ["bench", "robot", "--robots", "2", "--hz", "50", "--policy", "mlp-small", "--network-process",
         "--warmup-s", "0.5", "--seconds", "1", "--sync-loop-s", "0", "--kill-server-s", "0",
         "--baseline-s", "0", "--network-loss-s", "1.5", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    r = json.loads(out.read_text())
    assert (r["config"]["network_loss_s"], r["config"]["network_spare"]) == (1.5, True)
    cpu = r["steady"]["cpu_cores"]  # the robot process's one network process, measured
    assert len(cpu["robot_processes"]) == len(cpu["network_processes"]) == 1
    assert cpu["network_processes"][0] > 0.0
    loss = r["network_loss"]
    assert loss["network_spare"] is True and "outage" not in r
    assert loss["hung_after_s"] == HUNG_AFTER_S  # 50 Hz, the bench's e-stop after 150: the longest bound
    for phase in (loss["sigkill"], loss["sigstop"]):
        assert (phase["processes_hit"], phase["network_restarts"], phase["robots"]) == (1, 1, 2)
        assert phase["robots_estopped"] == 0 and phase["control_loops_healthy"]
        assert phase["max_fell_back_s"] == phase["max_consecutive_fallbacks"] / 50
    assert loss["sigkill"]["max_consecutive_fallbacks"] <= 5  # a process started then: ~10 (README)
    assert 0.9 * HUNG_AFTER_S * 50 <= loss["sigstop"]["max_consecutive_fallbacks"] < 150


def test_the_bench_names_each_robot_process_near_its_limit() -> None:
    """A robot process at 0.9 of a core or more runs behind, and its robots fall back whatever the
    server does: the bench says so for each such process, with the robots it ran (5 robots over 2
    processes: 2, then 3), and says nothing of one below it or not measured."""
    cfg = BenchRobotConfig(robots=5, processes=2, hz=50)
    assert busy_robot_processes([0.89, None], cfg) == []
    assert busy_robot_processes([0.5, 0.97], cfg) == [
        "robot process 1 used 0.97 of a core: 3 robot(s) at 50 Hz are near its limit on this "
        "machine, so its ticks run late and its robots fall back whatever the server does (give "
        "fewer robots to each process: --processes)"
    ]
    lines = busy_robot_processes([BUSY_CORES, 1.0], cfg)
    assert [line.split(" used ")[0] for line in lines] == ["robot process 0", "robot process 1"]
    assert ": 2 robot(s) at" in lines[0]


def test_a_robot_process_whose_bench_is_gone_stops_its_robots_quietly(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A bench that dies (killed, say) closes its end of each robot process's pipe: the process
    stops its robots and ends, exit code 0, where it printed two tracebacks (EOFError, then the
    BrokenPipeError of its goodbye)."""
    import multiprocessing as mp

    from edgerl.launch.bench_robot import _robot_main
    from edgerl.launch.processes import PolicySpec, ServerProcess

    cfg = BenchRobotConfig(robots=2, env="InvertedPendulum-v5", policy="mlp-small")
    with ServerProcess(PolicySpec("InvertedPendulum-v5", "mlp-small")) as server:
        bench, child = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(target=_robot_main, args=(cfg, server.address, 0, 2, child))
        proc.start()
        child.close()
        try:
            assert bench.poll(60.0) and bench.recv()[0] == "ready"
            bench.close()  # what the bench's death does
            proc.join(30.0)
        finally:
            proc.kill()
    assert proc.exitcode == 0
    assert "Traceback" not in capfd.readouterr().err


def test_a_chunk_policy_cannot_feed_the_trainer() -> None:
    from edgerl.edge_server.server import EdgeServer, ServerConfig

    net = build_policy("mlp-small", 3, 2 * 4, seed=0)
    backend = TorchPolicyBackend(net, -np.ones(2), np.ones(2), chunk=4)
    with pytest.raises(ValueError, match="one action per transition"):
        EdgeServer(backend, ServerConfig(port=0, learner=TransitionConfig()))
