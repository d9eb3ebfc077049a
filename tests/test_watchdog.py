"""The safety watchdog on a fake clock: fallback modes, limits, e-stop, NaN, chunks, timing."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from edgerl.watchdog.clock import FakeClock, MonotonicClock
from edgerl.watchdog.loop import WIND_DOWN_MAX_S, ControlLoop
from edgerl.watchdog.samples import Samples, percentiles
from edgerl.watchdog.watchdog import Fallback, Tick, TickKind, Watchdog, WatchdogConfig
from tests.helpers import wait_until

HZ = 50.0
PERIOD = 1.0 / HZ


class Recorder:
    def __init__(self) -> None:
        self.ticks: list[Tick] = []

    def __call__(self, tick: Tick) -> None:
        self.ticks.append(tick)

    @property
    def actions(self) -> np.ndarray:
        return np.stack([t.action for t in self.ticks])

    @property
    def kinds(self) -> list[TickKind]:
        return [t.kind for t in self.ticks]


def make(
    clock: FakeClock, low: float = -1.0, high: float = 1.0, dims: int = 2, **cfg: Any
) -> tuple[Watchdog, Recorder]:
    rec = Recorder()
    config = WatchdogConfig(**{"hz": HZ, "deadline_s": 0.015, "max_delta": 0.1, **cfg})
    dog = Watchdog([low] * dims, [high] * dims, rec, config, clock=clock)
    return dog, rec


def run_tick(dog: Watchdog, clock: FakeClock, index: int) -> Tick:
    """Run tick ``index`` on time: the clock moves to its due time first."""
    due = index * PERIOD
    clock.advance(max(0.0, due - clock.now()))
    return dog.tick(index, due, clock.now())


def answer(dog: Watchdog, clock: FakeClock, obs_tick: int, actions: object, latency: float = 0.002) -> bool:
    """Submit the answer to tick ``obs_tick``'s observation ``latency`` after that tick."""
    clock.advance(max(0.0, obs_tick * PERIOD + latency - clock.now()))
    accepted: bool = dog.submit(np.asarray(actions, np.float32), obs_tick, obs_tick * PERIOD, tag=7)
    return accepted


def test_fresh_action_is_applied_after_ramp_and_carries_age_and_tag() -> None:
    clock = FakeClock()
    dog, rec = make(clock)
    run_tick(dog, clock, 0)  # nothing yet: fallback (hold at 0)
    for i in range(0, 6):
        assert answer(dog, clock, i, [0.25, -0.05])
        run_tick(dog, clock, i + 1)
    assert rec.kinds == [TickKind.FALLBACK] + [TickKind.POLICY] * 6
    # rate limit 0.1 per tick: 0.1, 0.2, then 0.25 reached; the small dimension at once
    np.testing.assert_allclose(rec.actions[1:4, 0], [0.1, 0.2, 0.25], atol=1e-6)
    np.testing.assert_allclose(rec.actions[1:, 1], -0.05, atol=1e-6)
    assert rec.ticks[1].tag == 7
    assert rec.ticks[1].age_s == pytest.approx(PERIOD)
    s = dog.stats()
    assert (s.ticks, s.policy_ticks, s.fallbacks) == (7, 6, 1)
    assert s.age_ms_p50 == pytest.approx(20.0)


def test_late_answer_is_dropped_and_counted() -> None:
    clock = FakeClock()
    dog, rec = make(clock)
    run_tick(dog, clock, 0)
    assert not answer(dog, clock, 0, [0.5, 0.5], latency=0.016)  # deadline 15 ms
    run_tick(dog, clock, 1)
    assert rec.kinds[-1] is TickKind.FALLBACK
    assert dog.stats().late_actions == 1


def test_hold_repeats_last_applied_action() -> None:
    clock = FakeClock()
    dog, rec = make(clock, fallback="hold")
    run_tick(dog, clock, 0)
    for i in range(3):
        answer(dog, clock, i, [0.1, 0.05])
        run_tick(dog, clock, i + 1)
    for i in range(4, 8):  # answers stop
        run_tick(dog, clock, i)
    assert rec.kinds[4:] == [TickKind.FALLBACK] * 4
    np.testing.assert_allclose(rec.actions[4:], [[0.1, 0.05]] * 4, atol=1e-6)


def test_zero_ramps_down_through_the_rate_limit() -> None:
    clock = FakeClock()
    dog, rec = make(clock, fallback="zero")
    dog._last = np.array([0.35, -0.2], np.float32)  # as if a policy had driven it there
    for i in range(6):
        run_tick(dog, clock, i)
    np.testing.assert_allclose(rec.actions[:, 0], [0.25, 0.15, 0.05, 0.0, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(rec.actions[:, 1], [-0.1, 0.0, 0.0, 0.0, 0.0, 0.0], atol=1e-6)


def test_zero_outside_limits_goes_to_the_nearest_limit() -> None:
    clock = FakeClock()
    dog, rec = make(clock, low=0.2, high=1.0, fallback="zero")
    run_tick(dog, clock, 0)
    np.testing.assert_allclose(rec.actions[0], [0.2, 0.2])


def test_safe_pose_is_reached_by_a_rate_limited_trajectory() -> None:
    clock = FakeClock()
    dog, rec = make(clock, fallback="safe_pose", safe_pose=(0.5, -0.3))
    for i in range(7):
        run_tick(dog, clock, i)
    steps = np.abs(np.diff(np.vstack([[0.0, 0.0], rec.actions]), axis=0))
    assert np.all(steps <= 0.1 + 1e-6)
    np.testing.assert_allclose(rec.actions[-1], [0.5, -0.3], atol=1e-6)
    np.testing.assert_allclose(rec.actions[2], [0.3, -0.3], atol=1e-6)


def test_safe_pose_mode_needs_a_pose() -> None:
    with pytest.raises(ValueError, match="safe_pose"):
        WatchdogConfig(fallback=Fallback.SAFE_POSE)


BAD_SETTINGS: dict[str, tuple[dict[str, object], str]] = {
    "hz 0": ({"hz": 0.0}, "hz must be in (0, 10000], got 0.0"),
    "hz 20k": ({"hz": 20_000.0}, "hz must be in (0, 10000], got 20000.0"),
    "deadline_s": ({"deadline_s": 0.0}, "deadline_s must be a finite number > 0, got 0.0"),
    "estop_after": ({"estop_after": -1}, "estop_after must be >= 0, got -1"),
    "max_delta inf": ({"max_delta": float("inf")}, "max_delta must be finite and > 0, got inf"),
    "max_delta 0": ({"max_delta": [0.1, 0.0]}, "max_delta must be finite and > 0, got [0.1, 0.0]"),
    "stats_window": ({"stats_window": 0}, "stats_window must be >= 1, got 0"),
    "fallback": ({"fallback": "freeze"}, "'freeze' is not a valid Fallback"),
}


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_a_bad_watchdog_setting_is_refused_naming_it(case: str) -> None:
    setting, message = BAD_SETTINGS[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        WatchdogConfig(**setting)  # type: ignore[arg-type]


def test_a_bad_control_loop_setting_is_refused_naming_it() -> None:
    clock = FakeClock()
    dogs = [make(clock)[0] for _ in range(2)]
    with pytest.raises(ValueError, match=r"^a control loop needs at least one watchdog$"):
        ControlLoop([], clock=clock)
    with pytest.raises(ValueError, match=re.escape("slots must be in [1, 2], got 3")):
        ControlLoop(dogs, slots=3)
    with pytest.raises(ValueError, match=re.escape("realtime_priority must be in [0, 99], got 100")):
        ControlLoop(dogs, realtime_priority=100)


def test_action_limits_and_poses_of_the_wrong_shape_are_refused_naming_them() -> None:
    clock = FakeClock()
    with pytest.raises(ValueError, match="action limits need the same shape and low <= high"):
        Watchdog([1.0, -1.0], [-1.0, 1.0], Recorder(), clock=clock)  # low > high in the first
    with pytest.raises(ValueError, match="action limits need the same shape"):
        Watchdog([-1.0] * 2, [1.0] * 3, Recorder(), clock=clock)
    with pytest.raises(ValueError, match=re.escape("safe_pose: expected [2] finite values, got [0.0]")):
        make(clock, fallback=Fallback.SAFE_POSE, safe_pose=[0.0])
    with pytest.raises(
        ValueError, match=re.escape("stop_action: expected [2] finite values, got [0.0, nan]")
    ):
        Watchdog([-1.0] * 2, [1.0] * 2, Recorder(), stop_action=[0.0, float("nan")], clock=clock)


def test_policy_actions_are_clamped_to_limits() -> None:
    clock = FakeClock()
    dog, rec = make(clock, low=-0.3, high=0.3, max_delta=10.0)
    run_tick(dog, clock, 0)
    answer(dog, clock, 0, [5.0, -7.0])
    run_tick(dog, clock, 1)
    np.testing.assert_allclose(rec.actions[1], [0.3, -0.3])
    assert rec.kinds[1] is TickKind.POLICY


def test_nan_action_is_never_applied() -> None:
    clock = FakeClock()
    dog, rec = make(clock)
    run_tick(dog, clock, 0)
    answer(dog, clock, 0, [np.nan, 0.1])
    run_tick(dog, clock, 1)
    answer(dog, clock, 1, [0.1, np.inf])
    run_tick(dog, clock, 2)
    assert rec.kinds == [TickKind.FALLBACK] * 3
    assert np.all(np.isfinite(rec.actions))
    assert dog.stats().nonfinite_actions == 2


def test_estop_latches_after_n_fallbacks_and_only_reset_clears_it(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    dog, rec = make(clock, estop_after=3, fallback="hold")
    dog._last = np.array([0.3, 0.3], np.float32)
    for i in range(6):
        run_tick(dog, clock, i)
    assert rec.kinds == [TickKind.FALLBACK] * 2 + [TickKind.ESTOP] * 4
    # the stop action (zeros) is reached through the rate limit, never a jump
    np.testing.assert_allclose(rec.actions[2:, 0], [0.2, 0.1, 0.0, 0.0], atol=1e-6)
    # fresh actions do not clear a latched e-stop
    answer(dog, clock, 5, [0.5, 0.5])
    run_tick(dog, clock, 6)
    assert rec.kinds[-1] is TickKind.ESTOP
    assert dog.stats().estops == 1 and dog.estopped
    dog.reset()
    answer(dog, clock, 6, [0.5, 0.5])
    run_tick(dog, clock, 7)
    assert rec.ticks[-1].kind is TickKind.POLICY
    assert not dog.estopped and dog.stats().consecutive_fallbacks == 0
    dog.reset()  # nothing latched: nothing to say
    assert [r.getMessage() for r in caplog.records].count("e-stop reset") == 1


def test_a_policy_action_resets_the_fallback_streak() -> None:
    clock = FakeClock()
    dog, rec = make(clock, estop_after=3)
    run_tick(dog, clock, 0)
    run_tick(dog, clock, 1)
    answer(dog, clock, 1, [0.0, 0.0])
    run_tick(dog, clock, 2)
    run_tick(dog, clock, 3)
    run_tick(dog, clock, 4)
    assert TickKind.ESTOP not in rec.kinds


def test_chunk_serves_the_following_ticks_then_runs_out() -> None:
    clock = FakeClock()
    dog, rec = make(clock, max_delta=10.0)
    run_tick(dog, clock, 0)
    chunk = [[0.1, 0.0], [0.2, 0.0], [0.3, 0.0]]
    assert answer(dog, clock, 0, chunk)
    assert dog.remaining() == 3
    for i in range(1, 5):
        run_tick(dog, clock, i)
    assert rec.kinds[1:] == [TickKind.POLICY] * 3 + [TickKind.FALLBACK]
    np.testing.assert_allclose(rec.actions[1:4, 0], [0.1, 0.2, 0.3], atol=1e-6)
    assert [t.age_s for t in rec.ticks[1:4]] == pytest.approx([PERIOD, 2 * PERIOD, 3 * PERIOD])
    assert dog.remaining() == 0


def test_newer_chunk_replaces_older_and_older_is_refused() -> None:
    clock = FakeClock()
    dog, rec = make(clock, max_delta=10.0)
    run_tick(dog, clock, 0)
    answer(dog, clock, 0, [[0.1, 0.0]] * 4)
    run_tick(dog, clock, 1)
    assert answer(dog, clock, 1, [[-0.1, 0.0]] * 4)
    assert not dog.submit(np.zeros((4, 2), np.float32), 0, 0.0)  # older observation
    run_tick(dog, clock, 2)
    np.testing.assert_allclose(rec.actions[2], [-0.1, 0.0])


def test_wrong_shape_is_dropped_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    dog, _ = make(clock)
    with caplog.at_level("WARNING", logger="edgerl.watchdog.watchdog"):
        for tick in range(50):  # a server of another action shape answers every tick
            assert not dog.submit(np.zeros(3, np.float32), tick, 0.0)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "dropped an action chunk of shape (3,) (action shape (2,)); "
        "the next ones of a wrong shape are dropped without a warning"
    ]
    assert dog.submit(np.zeros(2, np.float32), 50, 0.0)  # the right shape is taken again


def test_apply_error_latches_estop() -> None:
    clock = FakeClock()

    def broken(tick: Tick) -> None:
        raise RuntimeError("motor driver gone")

    dog = Watchdog([-1.0], [1.0], broken, WatchdogConfig(hz=HZ), clock=clock)
    dog.tick(0, 0.0, 0.0)
    assert dog.estopped and dog.stats().apply_errors == 1


def test_loop_on_fake_clock_ticks_on_an_absolute_grid() -> None:
    clock = FakeClock(start=100.0)
    dog, rec = make(clock)
    ControlLoop([dog], clock=clock).run_for(50)
    sched = np.array([t.scheduled for t in rec.ticks])
    np.testing.assert_allclose(sched - 100.0, np.arange(50) * PERIOD, atol=1e-9)
    assert [t.index for t in rec.ticks] == list(range(50))
    assert dog.stats().jitter_ms_p99 == 0.0


def test_loop_skips_and_counts_ticks_when_it_runs_late() -> None:
    clock = FakeClock()

    def slow(tick: Tick) -> None:
        if tick.index == 3:
            clock.advance(3.5 * PERIOD)  # the robot call hung for 70 ms

    dog = Watchdog([-1.0], [1.0], slow, WatchdogConfig(hz=HZ), clock=clock)
    seen: list[int] = []
    orig = dog.tick

    def spy(index: int, scheduled: float, now: float) -> Tick:
        seen.append(index)
        return orig(index, scheduled, now)

    dog.tick = spy  # type: ignore[method-assign]
    ControlLoop([dog], clock=clock).run_for(6)
    assert seen == [0, 1, 2, 3, 6, 7]
    assert dog.stats().loop_deadline_misses == 2


def test_robots_sharing_a_loop_are_spread_over_the_period() -> None:
    clock = FakeClock()
    dogs, recs = zip(*(make(clock) for _ in range(4)), strict=True)
    ControlLoop(list(dogs), clock=clock).run_for(3)
    firsts = [r.ticks[0].scheduled for r in recs]
    np.testing.assert_allclose(firsts, np.arange(4) * PERIOD / 4)
    assert all(len(r.ticks) == 3 for r in recs)


def test_real_clock_loop_keeps_rate_while_nothing_is_submitted() -> None:
    rec = Recorder()
    dog = Watchdog([-1.0], [1.0], rec, WatchdogConfig(hz=200.0, estop_after=0), clock=MonotonicClock())
    dog.start()
    time.sleep(0.5)
    dog.stop()
    misses = dog.stats().loop_deadline_misses
    n = len(rec.ticks)
    assert 90 <= n + misses <= 102  # 0.5 s at 200 Hz, a tick the loop ran too late for counted as missed
    assert misses <= 5
    # absolute grid: every tick is due a whole number of periods after the first, no drift
    steps = (np.array([t.scheduled for t in rec.ticks]) - rec.ticks[0].scheduled) * 200.0
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-6)
    assert [t.index for t in rec.ticks] == np.round(steps).astype(int).tolist()
    assert all(t.kind is TickKind.FALLBACK for t in rec.ticks)


def test_submit_from_another_thread_while_looping() -> None:
    rec = Recorder()
    dog = Watchdog([-1.0], [1.0], rec, WatchdogConfig(hz=100.0, deadline_s=0.05, max_delta=2.0))
    stop = threading.Event()

    def inference() -> None:
        while not stop.is_set():
            last = rec.ticks[-1] if rec.ticks else None
            if last is not None:
                dog.submit(np.array([0.5], np.float32), last.index, last.time, tag="v1")
            time.sleep(0.002)

    thread = threading.Thread(target=inference)
    dog.start()
    thread.start()
    time.sleep(0.4)
    stop.set()
    thread.join()
    dog.stop()
    policy = [t for t in rec.ticks if t.kind is TickKind.POLICY]
    assert len(policy) >= 0.8 * len(rec.ticks) - 2
    assert all(t.tag == "v1" and t.action[0] == pytest.approx(0.5) for t in policy)


def test_idle_hook_gets_the_time_until_the_next_tick() -> None:
    clock = FakeClock()
    dog, rec = make(clock)
    waits: list[float] = []

    def idle(seconds: float) -> None:
        waits.append(seconds)
        clock.advance(min(seconds, 0.005))  # woken early by traffic every 5 ms

    ControlLoop([dog], clock=clock, idle=idle).run_for(3)
    assert [t.scheduled for t in rec.ticks] == pytest.approx([0.0, PERIOD, 2 * PERIOD])
    assert [t.time for t in rec.ticks] == pytest.approx([0.0, PERIOD, 2 * PERIOD])
    assert waits == pytest.approx([0.02, 0.015, 0.01, 0.005] * 2)


def test_after_slot_runs_after_every_slot_also_while_behind() -> None:
    """Four watchdogs in four slots, each tick taking 4 ms, and one 30 ms stall in the second
    period: the loop runs behind for several slots, and still hands each slot's work on (a host
    sends the slot's observations and takes in answers there), without idling in between."""
    clock = FakeClock()
    ticks: list[Tick] = []
    events: list[str] = []

    def slow(i: int) -> Callable[[Tick], None]:
        def apply(tick: Tick) -> None:
            ticks.append(tick)
            if i == 0 and tick.index == 1:
                clock.advance(0.03)
            clock.advance(0.004)

        return apply

    config = WatchdogConfig(hz=HZ, deadline_s=0.015)
    dogs = [Watchdog([-1.0], [1.0], slow(i), config, clock=clock) for i in range(4)]
    idles: list[float] = []

    def idle(seconds: float) -> None:
        idles.append(seconds)
        events.append("idle")
        clock.advance(seconds)

    def after_slot() -> None:
        events.append(f"slot {len(ticks)}")

    ControlLoop(dogs, clock=clock, idle=idle, after_slot=after_slot).run_for(4)
    assert len(ticks) == 16
    assert [e for e in events if e != "idle"] == [f"slot {n}" for n in range(1, 17)]  # once per slot
    assert all(s > 0 for s in idles)  # idle only while the next slot is not yet due
    behind = sum(a != "idle" and b != "idle" for a, b in itertools.pairwise(events))
    assert behind >= 2  # the stall put the loop behind; its slots were handed on all the same
    assert max(t.time - t.scheduled for t in ticks) > 0.005  # over a slot late


def breaks_at(n: int, calls: list[int] | None = None) -> Callable[[], None]:
    """An ``after_slot`` that raises at its ``n``-th call (and notes each call in ``calls``)."""
    slots = itertools.count(1)

    def after_slot() -> None:
        k = next(slots)
        if calls is not None:
            calls.append(k)
        if k == n:
            raise RuntimeError(f"slot {n} broke")

    return after_slot


def test_a_control_loop_that_raises_keeps_the_error_says_so_once_and_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec = Recorder()
    config = WatchdogConfig(hz=200.0, estop_after=0)
    dog = Watchdog([-1.0], [1.0], rec, config, stop_action=[-1.0], clock=MonotonicClock())
    loop = ControlLoop([dog], name="arm", after_slot=breaks_at(3))
    loop.start()
    assert wait_until(lambda: loop.error is not None, timeout_s=5.0, poll_s=0.01)
    assert repr(loop.error) == "RuntimeError('slot 3 broke')"
    loop._thread.join(1.0)
    assert not loop._thread.is_alive()  # the error is set once the loop is over
    # its e-stop ramp ran (0 to -1 by 0.5 a tick, on the grid), then no tick
    assert rec.kinds == [TickKind.FALLBACK] * 3 + [TickKind.ESTOP] * 2
    np.testing.assert_array_equal(rec.actions[:, 0], [0.0, 0.0, 0.0, -0.5, -1.0])
    assert [t.index for t in rec.ticks] == [0, 1, 2, 3, 4]
    assert dog.at_stop_action and dog.stats().estops == 1
    stopped = [r for r in caplog.records if r.getMessage() == "control loop arm stopped"]
    assert len(stopped) == 1 and stopped[0].exc_info is not None  # with its traceback, once
    loop.stop()  # a loop that ended stops at once
    # run in the caller's thread (tests, a fake clock), the error is the caller's
    clock = FakeClock()
    with pytest.raises(RuntimeError, match=r"^slot 2 broke$"):
        ControlLoop([make(clock)[0]], clock=clock, after_slot=breaks_at(2)).run_for(5)


def test_a_failed_loop_ramps_every_robot_to_its_stop_action_on_the_grid_without_its_hooks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Robots a failed loop leaves do not keep the last action their drivers got: every watchdog
    is e-stopped and ticked on, on its schedule, until it applied its stop action; the loop's
    ``after_slot`` and ``idle`` (where the fault may be) are not called again."""
    clock = FakeClock()
    recs = []
    dogs = []
    for pose in (0.5, -0.3, 0.0):
        rec = Recorder()
        cfg = WatchdogConfig(hz=HZ, fallback=Fallback.SAFE_POSE, safe_pose=(pose, pose), max_delta=0.1)
        dogs.append(Watchdog([-1.0] * 2, [1.0] * 2, rec, cfg, stop_action=[0.0, 0.2], clock=clock))
        recs.append(rec)
    calls: list[int] = []
    idles: list[float] = []

    def idle(s: float) -> None:
        idles.append(s)
        clock.advance(s)

    loop = ControlLoop(dogs, clock=clock, slots=3, after_slot=breaks_at(24, calls), idle=idle)
    with pytest.raises(RuntimeError, match=r"^slot 24 broke$"):
        loop.run_for(100)
    assert calls == list(range(1, 25)) and len(idles) == 23  # no hook after the fault
    assert loop.error is not None
    for dog, rec, pose in zip(dogs, recs, (0.5, -0.3, 0.0), strict=True):
        kinds = rec.kinds
        first = kinds.index(TickKind.ESTOP)
        assert first == 8 and kinds[first:] == [TickKind.ESTOP] * (len(kinds) - first)
        np.testing.assert_allclose(rec.actions[first - 1], [pose, pose], atol=1e-6)  # where it stood
        ramp = rec.actions[first - 1 :]
        assert np.all(np.abs(np.diff(ramp, axis=0)) <= 0.1 + 1e-6)  # rate-limited as always
        stop = np.array([0.0, 0.2], np.float32)
        np.testing.assert_array_equal(rec.actions[-1], stop)  # ends on the stop action
        # ...and no later: the ramp is as short as the rate limit allows (float32 steps of 0.1
        # may leave a sliver of 1e-8 for one more tick)
        shortest = round(max(abs(pose), abs(pose - 0.2)) / 0.1)
        assert shortest <= len(ramp) - 1 <= shortest + 1
        assert dog.at_stop_action and dog.estopped and dog.stats().estops == 1
        times = [t.scheduled for t in rec.ticks]
        np.testing.assert_allclose(np.diff(times), PERIOD, atol=1e-9)  # on its grid throughout
    assert sum("e-stopping its 3 watchdog(s)" in r.getMessage() for r in caplog.records) == 1
    assert not any("did not reach" in r.getMessage() for r in caplog.records)


def test_the_ramp_after_a_failure_is_bounded_and_a_watchdog_that_cannot_tick_is_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ramp longer than ``WIND_DOWN_MAX_S`` is cut there (the loop must end); a watchdog whose own
    tick raises (here: the fault that ended the loop) is left, the others are still stopped."""

    class Broken(Watchdog):
        def tick(self, index: int, scheduled: float, now: float) -> Tick:
            if index >= 5:
                raise RuntimeError("this watchdog broke")
            return super().tick(index, scheduled, now)

    clock = FakeClock()
    slow_rec, ok_rec, broken_rec = Recorder(), Recorder(), Recorder()
    slow = Watchdog([-1.0], [1.0], slow_rec, WatchdogConfig(max_delta=0.001), stop_action=[-1.0], clock=clock)
    ok = Watchdog([-1.0], [1.0], ok_rec, WatchdogConfig(), stop_action=[1.0], clock=clock)
    broken = Broken([-1.0], [1.0], broken_rec, WatchdogConfig(), stop_action=[1.0], clock=clock)
    loop = ControlLoop([slow, ok, broken], clock=clock, name="cell")
    with pytest.raises(RuntimeError, match=r"^this watchdog broke$"):
        loop.run_for(100)
    assert len(broken_rec.ticks) == 5 and not broken.at_stop_action and broken.estopped
    assert ok.at_stop_action and ok_rec.actions[-1, 0] == 1.0
    # the slow one moved 0.001 a tick for WIND_DOWN_MAX_S, then the loop gave up on it
    ramp = [t for t in slow_rec.ticks if t.kind is TickKind.ESTOP]
    span = ramp[-1].scheduled - ramp[0].scheduled  # its first tick comes up to a period after the fault
    assert WIND_DOWN_MAX_S - 1.5 * PERIOD < span <= WIND_DOWN_MAX_S
    assert slow_rec.actions[-1, 0] == pytest.approx(-0.001 * len(ramp), abs=1e-4)
    assert not slow.at_stop_action
    messages = [r.getMessage() for r in caplog.records]
    assert "control loop cell: watchdog 2 failed to tick; left as it is" in messages
    assert "control loop cell: 1 of 3 watchdog(s) did not reach their stop action" in messages


def test_a_loop_whose_clock_fails_keeps_the_first_error_when_its_e_stop_fails_too(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class BrokenClock(FakeClock):
        def sleep_until(self, deadline: float, stop: threading.Event) -> None:
            if deadline > 0.05:
                raise OSError("the clock broke")
            super().sleep_until(deadline, stop)

    clock = BrokenClock()
    rec = Recorder()
    dog = Watchdog([-1.0], [1.0], rec, WatchdogConfig(estop_after=0), stop_action=[0.5], clock=clock)
    loop = ControlLoop([dog], clock=clock, name="arm")
    with pytest.raises(OSError, match=r"^the clock broke$"):
        loop.run_for(10)
    assert repr(loop.error) == "OSError('the clock broke')"  # the loop's, not the ramp's
    # ticks 0-2 (up to 0.04 s), then latched, but the ramp to 0.5 could not wait for its first tick
    assert len(rec.ticks) == 3 and dog.estopped and not dog.at_stop_action
    failed = [r for r in caplog.records if r.getMessage() == "control loop arm: the e-stop after it failed"]
    assert len(failed) == 1 and failed[0].exc_info is not None


def test_a_real_time_loop_runs_its_own_thread_under_sched_fifo_or_says_why_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The priority is the loop thread's alone (never the process's, nor that of a process the
    thread starts); where the system refuses it (no CAP_SYS_NICE), the loop runs on with a
    warning saying so."""
    seen: dict[str, int] = {}

    def after_slot() -> None:
        if "priority" in seen:
            return
        seen["policy"] = os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK  # 0: the calling thread
        seen["priority"] = os.sched_getparam(0).sched_priority
        child = "import os; print(os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)"
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
        seen["child_policy"], seen["child_priority"] = map(int, out.split())

    dog = Watchdog([-1.0], [1.0], Recorder(), WatchdogConfig(hz=200.0, estop_after=0), clock=MonotonicClock())
    loop = ControlLoop([dog], name="rt", after_slot=after_slot, realtime_priority=7)
    loop.start()
    try:
        assert wait_until(lambda: "priority" in seen, timeout_s=5.0, poll_s=0.01)
    finally:
        loop.stop()
    assert loop.error is None
    warned = [r.getMessage() for r in caplog.records if "without real-time priority" in r.getMessage()]
    if warned:
        assert seen["policy"] == os.SCHED_OTHER and len(warned) == 1
    else:
        assert (seen["policy"], seen["priority"]) == (os.SCHED_FIFO, 7)
    assert (seen["child_policy"], seen["child_priority"]) == (os.SCHED_OTHER, 0)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's thread is as it was


def test_samples_ring_keeps_the_last_window() -> None:
    s = Samples(4)
    assert len(s) == 0 and np.isnan(s.percentile_ms(50))
    for x in (1.0, 2.0, 3.0):
        s.append(x)
    np.testing.assert_array_equal(s.values(), [1.0, 2.0, 3.0])
    for x in (4.0, 5.0, 6.0):
        s.append(x)
    np.testing.assert_array_equal(s.values(), [3.0, 4.0, 5.0, 6.0])
    assert s.percentile_ms(100) == pytest.approx(6000.0)
    s.clear()
    assert len(s) == 0


@pytest.mark.parametrize("n", [1, 2, 37, 5000, 8192])
def test_percentiles_from_one_partition_are_numpys(n: int) -> None:
    values = np.random.default_rng(n).random(n)
    qs = [0.0, 1.0, 50.0, 99.0, 99.9, 100.0]
    np.testing.assert_allclose(percentiles(values, qs), np.percentile(values, qs), rtol=1e-12)
    s = Samples(8192)
    for x in values:
        s.append(float(x))
    np.testing.assert_allclose(s.percentiles_ms(50, 99), np.percentile(values, [50, 99]) * 1e3, rtol=1e-12)
    assert s.percentiles_ms(50, 99)[0] == s.percentile_ms(50)
