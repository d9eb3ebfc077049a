"""The safety watchdog: a fixed-rate control loop that never waits for the policy.

The loop ticks on absolute deadlines (``t0 + i / hz``, so it does not drift).
At each tick it applies the policy action meant for that tick if one arrived
in time, and a fallback action otherwise. The inference side only calls
:meth:`Watchdog.submit`, which takes a lock for a few microseconds; nothing in
the loop waits on the network.

Timing of policy actions. The observation read at tick ``n`` is answered by a
*chunk* of ``K >= 1`` actions: action ``k`` is meant for tick ``n + 1 + k``.
A chunk is accepted only if it arrives within ``deadline_s`` of its
observation (its end-to-end latency); a later one is dropped as *late*. At
tick ``j`` the watchdog uses the newest accepted chunk: action ``j - n - 1``
if the chunk still has it (*fresh*), a fallback if the chunk is exhausted or
there is none (*stale* or *missing*). An action's *age* at the tick is the
time since the observation it answers was read.

Every action leaving the watchdog, fallbacks included, is clamped to the
action limits and rate-limited to ``max_delta`` per tick, so a fallback never
jumps. Non-finite policy actions are never applied (they count as missing).
After ``estop_after`` consecutive fallbacks the watchdog latches an e-stop: it
ramps to the stop action and stays there until :meth:`Watchdog.reset`.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from edgerl.watchdog.clock import Clock, MonotonicClock
from edgerl.watchdog.samples import Samples

if TYPE_CHECKING:  # the loop module imports this one
    from edgerl.watchdog.loop import ControlLoop

log = logging.getLogger(__name__)


class Fallback(enum.StrEnum):
    """What the watchdog applies when no fresh policy action is there."""

    HOLD = "hold"
    """Repeat the last applied action."""
    ZERO = "zero"
    """Ramp to zero (clamped into the limits) through the rate limit, like diff-drive braking."""
    SAFE_POSE = "safe_pose"
    """Move to ``safe_pose`` along a rate-limited trajectory."""


class TickKind(enum.StrEnum):
    POLICY = "policy"
    FALLBACK = "fallback"
    ESTOP = "estop"


@dataclass(frozen=True)
class WatchdogConfig:
    """Settings of one robot's watchdog."""

    hz: float = 50.0
    """Control rate (ticks per second)."""
    deadline_s: float = 0.02
    """Latency budget: a policy action must arrive within this long of its observation (seconds)."""
    fallback: Fallback = Fallback.HOLD
    """Fallback mode: hold, zero or safe_pose."""
    max_delta: float | tuple[float, ...] | None = None
    """Largest change of each action dimension per tick (action units); None: 25 % of its range."""
    estop_after: int = 50
    """Latch an e-stop after this many consecutive fallbacks (0: never)."""
    safe_pose: tuple[float, ...] | None = None
    """Target of the safe_pose fallback (action units, one per dimension)."""
    warn_interval_s: float = 5.0
    """At most one fallback warning per this many seconds."""
    stats_window: int = 4096
    """Ticks kept for the age and jitter percentiles."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fallback", Fallback(self.fallback))
        if not 0 < self.hz <= 10_000:
            raise ValueError(f"hz must be in (0, 10000], got {self.hz}")
        if not 0 < self.deadline_s < math.inf:  # a NaN deadline took actions however late they came
            raise ValueError(f"deadline_s must be a finite number > 0, got {self.deadline_s}")
        if self.estop_after < 0:
            raise ValueError(f"estop_after must be >= 0, got {self.estop_after}")
        if self.fallback is Fallback.SAFE_POSE and self.safe_pose is None:
            raise ValueError("fallback 'safe_pose' needs safe_pose")
        if self.safe_pose is not None and not np.all(np.isfinite(self.safe_pose)):
            raise ValueError(f"safe_pose must be finite numbers, got {self.safe_pose}")
        deltas = np.atleast_1d(np.asarray(self.max_delta if self.max_delta is not None else 1.0))
        if not (np.all(np.isfinite(deltas)) and np.all(deltas > 0)):
            raise ValueError(f"max_delta must be finite and > 0, got {self.max_delta}")
        if not 0 <= self.warn_interval_s < math.inf:
            raise ValueError(f"warn_interval_s must be a finite number >= 0, got {self.warn_interval_s}")
        if self.stats_window < 1:
            raise ValueError(f"stats_window must be >= 1, got {self.stats_window}")

    @property
    def period_s(self) -> float:
        return 1.0 / self.hz


@dataclass(frozen=True, slots=True)
class Tick:
    """What the watchdog decided at one tick; handed to the apply callback."""

    index: int
    """Tick number since start (skipped ticks count)."""
    scheduled: float
    """When the tick was due (clock seconds)."""
    time: float
    """When it ran (clock seconds)."""
    action: np.ndarray
    """The action applied: clamped and rate-limited, float32."""
    kind: TickKind
    age_s: float
    """Age of the policy action (since its observation); NaN for fallbacks."""
    tag: Any = None
    """The tag the policy action was submitted with (e.g. its policy version); None for fallbacks."""

    @property
    def fallback(self) -> bool:
        return self.kind is not TickKind.POLICY


@dataclass(frozen=True)
class WatchdogStats:
    """Counters since start."""

    ticks: int
    policy_ticks: int
    fallbacks: int
    consecutive_fallbacks: int
    max_consecutive_fallbacks: int
    """Longest fallback streak since start (or the last stats reset)."""
    loop_deadline_misses: int
    """Ticks the loop itself skipped because it ran more than a period late."""
    estops: int
    estopped: bool
    late_actions: int
    """Chunks dropped because they arrived after the deadline."""
    nonfinite_actions: int
    apply_errors: int
    age_ms_p50: float
    age_ms_p99: float
    jitter_ms_p50: float
    jitter_ms_p99: float
    """How late ticks ran against their schedule (ms)."""

    @property
    def fallback_rate(self) -> float:
        return self.fallbacks / self.ticks if self.ticks else 0.0


@dataclass
class _Chunk:
    actions: np.ndarray  # [K, *act_shape]
    obs_tick: int
    obs_time: float
    tag: Any
    finite: np.ndarray  # [K] bool: the action has no NaN or Inf (checked once, on submit)


class Watchdog:
    """One robot's safety layer.

    Args:
        low, high: action limits, one per dimension.
        apply: called from the loop with each :class:`Tick`; it applies
            ``tick.action`` to the robot (and may read the next observation).
            It must not block. An exception from it latches an e-stop.
        config: rates, deadline, fallback mode, limits.
        stop_action: what an e-stop ramps to; default zeros clamped into the limits.
        clock: time source; a :class:`~edgerl.watchdog.clock.FakeClock` in tests.
    """

    def __init__(
        self,
        low: Sequence[float] | np.ndarray,
        high: Sequence[float] | np.ndarray,
        apply: Callable[[Tick], None],
        config: WatchdogConfig | None = None,
        *,
        stop_action: Sequence[float] | np.ndarray | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = cfg = config or WatchdogConfig()
        self.low = np.asarray(low, dtype=np.float32)
        self.high = np.asarray(high, dtype=np.float32)
        if self.low.shape != self.high.shape or not np.all(self.low <= self.high):
            raise ValueError("action limits need the same shape and low <= high")
        self.act_shape = self.low.shape
        span = self.high - self.low
        self.max_delta = (
            np.broadcast_to(np.asarray(cfg.max_delta, np.float32), self.act_shape).copy()
            if cfg.max_delta is not None
            else np.where(np.isfinite(span), 0.25 * span, np.float32(1.0)).astype(np.float32)
        )
        self.stop_action = self._clamp(self._vector(stop_action, "stop_action", 0.0))
        self.safe_pose = self._clamp(self._vector(cfg.safe_pose, "safe_pose", 0.0))
        self.apply = apply
        self.clock: Clock = clock or MonotonicClock()
        self._lock = threading.Lock()
        self._chunk: _Chunk | None = None
        # Zero clamped into the limits: the start action and the zero fallback's target
        # (never modified in place: _last is only ever rebound).
        self._zero = self._clamp(np.zeros(self.act_shape, np.float32))
        self._last = self._zero
        self._tick_index = -1
        self._estopped = False
        self._shape_warned = False  # a server of another action shape warns once, not every tick
        self._consecutive = 0
        self._max_consecutive = 0
        self._counts = dict.fromkeys(
            ("ticks", "policy_ticks", "fallbacks", "loop_deadline_misses", "estops", "late_actions",
             "nonfinite_actions", "apply_errors"),
            0,
        )  # fmt: skip
        self._ages = Samples(cfg.stats_window)
        self._jitter = Samples(cfg.stats_window)
        self._last_warning = -math.inf
        self._fallbacks_at_warning = 0
        self._loop: ControlLoop | None = None

    def _vector(self, value: Sequence[float] | np.ndarray | None, name: str, default: float) -> np.ndarray:
        if value is None:
            return np.full(self.act_shape, default, np.float32)
        arr = np.asarray(value, dtype=np.float32)
        if arr.shape != self.act_shape or not np.all(np.isfinite(arr)):
            raise ValueError(f"{name}: expected {list(self.act_shape)} finite values, got {arr.tolist()}")
        return arr

    def _clamp(self, action: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.clip(action, self.low, self.high).astype(np.float32, copy=False)
        return out

    # -- inference side -------------------------------------------------------

    def submit(self, actions: np.ndarray, obs_tick: int, obs_time: float, tag: Any = None) -> bool:
        """Hand over the policy's answer to the observation read at tick ``obs_tick``.

        Args:
            actions: ``[*act_shape]`` (one action) or ``[K, *act_shape]`` (a chunk
                for the ``K`` ticks after ``obs_tick``).
            obs_tick, obs_time: the tick and clock time of the observation.
            tag: carried into the :class:`Tick` of each action (e.g. the policy version).

        Returns:
            False if the chunk was dropped: late, older than the one held, or of the wrong shape.
        """
        arr = np.asarray(actions, dtype=np.float32)
        if arr.shape == self.act_shape:
            arr = arr[None]
        if arr.shape[1:] != self.act_shape or arr.shape[0] < 1:
            if not self._shape_warned:
                self._shape_warned = True
                log.warning(
                    "dropped an action chunk of shape %s (action shape %s); the next ones of a wrong "
                    "shape are dropped without a warning",
                    arr.shape,
                    self.act_shape,
                )
            return False
        finite = np.asarray(np.isfinite(arr).reshape(len(arr), -1).all(axis=1))  # outside the lock
        latency = self.clock.now() - obs_time
        with self._lock:
            if latency > self.config.deadline_s:
                self._counts["late_actions"] += 1
                return False
            if self._chunk is not None and obs_tick <= self._chunk.obs_tick:
                return False
            self._chunk = _Chunk(arr, obs_tick, obs_time, tag, finite)
            return True

    def remaining(self) -> int:
        """Policy actions left in the held chunk for ticks after the last one run."""
        with self._lock:
            chunk = self._chunk
            if chunk is None:
                return 0
            return max(0, len(chunk.actions) - (self._tick_index - chunk.obs_tick))

    def discard(self) -> None:
        """Drop the held actions (e.g. the robot was reset and they answer an old observation)."""
        with self._lock:
            self._chunk = None

    @property
    def estopped(self) -> bool:
        return self._estopped

    @property
    def at_stop_action(self) -> bool:
        """E-stopped, and the last action applied was the stop action (the ramp is over)."""
        return self._estopped and bool(np.array_equal(self._last, self.stop_action))

    def estop(self, why: str | None = None) -> None:
        """Latch an e-stop from the loop's side (its thread, or once it has ended): the next
        ticks ramp to the stop action. ``why`` is logged; None: the caller logs it."""
        self._latch(why)

    def reset(self) -> None:
        """Clear a latched e-stop and the fallback streak; policy actions apply again."""
        with self._lock:  # the control thread waits on it: log after, not while holding it
            was_estopped, self._estopped = self._estopped, False
            self._consecutive = 0
            self._chunk = None
        if was_estopped:
            log.warning("e-stop reset")

    # -- the loop side --------------------------------------------------------

    def _policy_action(self, index: int, now: float) -> tuple[np.ndarray | None, float, Any]:
        with self._lock:
            chunk = self._chunk
            if chunk is None:
                return None, math.nan, None
            k = index - chunk.obs_tick - 1
            if not 0 <= k < len(chunk.actions):
                return None, math.nan, None
            action = chunk.actions[k]
        if not chunk.finite[k]:
            self._counts["nonfinite_actions"] += 1
            return None, math.nan, None
        return action, now - chunk.obs_time, chunk.tag

    def tick(self, index: int, scheduled: float, now: float) -> Tick:
        """Run tick ``index`` (due at ``scheduled``, running at ``now``); the loop calls this."""
        c = self._counts
        self._tick_index = index
        c["ticks"] += 1
        self._jitter.append(max(0.0, now - scheduled))
        action, age, tag = (None, math.nan, None) if self._estopped else self._policy_action(index, now)
        if action is not None:
            kind, target = TickKind.POLICY, action
            self._consecutive = 0
            c["policy_ticks"] += 1
            self._ages.append(age)
        else:
            c["fallbacks"] += 1
            self._consecutive += 1
            self._max_consecutive = max(self._max_consecutive, self._consecutive)
            limit = self.config.estop_after
            if not self._estopped and limit and self._consecutive >= limit:
                self._latch(f"{self._consecutive} consecutive fallbacks")
            kind = TickKind.ESTOP if self._estopped else TickKind.FALLBACK
            target = self._fallback_target()
            self._maybe_warn(now)
        # Clamp to the limits and rate-limit in one: _last is within the limits, so the two
        # ranges overlap and clipping to their intersection is clipping to each in turn.
        # Plain ufuncs: np.clip's dispatch costs more than the arithmetic on a few entries.
        last = self._last
        lo = np.maximum(last - self.max_delta, self.low)
        hi = np.minimum(last + self.max_delta, self.high)
        out = np.minimum(np.maximum(target, lo, out=lo), hi, out=hi)
        self._last = out
        t = Tick(index, scheduled, now, out, kind, age, tag)
        try:
            self.apply(t)
        except Exception:
            c["apply_errors"] += 1
            log.exception("applying the action of tick %d failed", index)
            self._latch("the robot failed to apply an action")
        return t

    def _fallback_target(self) -> np.ndarray:
        if self._estopped:
            return self.stop_action
        mode = self.config.fallback
        if mode is Fallback.HOLD:
            return self._last
        if mode is Fallback.ZERO:
            return self._zero
        return self.safe_pose

    def _latch(self, why: str | None) -> None:
        if not self._estopped:
            self._estopped = True
            self._counts["estops"] += 1
            if why is not None:
                log.error("e-stop latched: %s; call reset() to resume", why)

    def _maybe_warn(self, now: float) -> None:
        if now - self._last_warning < self.config.warn_interval_s:
            return
        n = self._counts["fallbacks"] - self._fallbacks_at_warning
        log.warning("%d fallback action(s) since the last warning (%d in a row)", n, self._consecutive)
        self._last_warning = now
        self._fallbacks_at_warning = self._counts["fallbacks"]

    def missed(self, ticks: int) -> None:
        """The loop skipped ``ticks`` ticks because it ran late; counted, not applied."""
        self._counts["loop_deadline_misses"] += ticks

    def reset_stats(self) -> None:
        """Zero the counters and percentile windows (e.g. after a warm-up); state is kept."""
        for key in self._counts:
            self._counts[key] = 0
        self._ages.clear()
        self._jitter.clear()
        self._max_consecutive = self._consecutive

    @property
    def next_tick_index(self) -> int:
        """Index of the tick to come (0 before the first): a loop continues the schedule from it."""
        return self._tick_index + 1

    def jitter_s(self) -> np.ndarray:
        """Lateness of the recent ticks against their schedule (seconds)."""
        out: np.ndarray = self._jitter.values()
        return out

    def stats(self, percentiles: bool = True) -> WatchdogStats:
        """Counters, and the age and jitter percentiles unless ``percentiles`` is False (NaN then:
        cheap enough to call from another thread while the loop runs)."""
        c = self._counts
        nan = [math.nan, math.nan]
        ages = self._ages.percentiles_ms(50, 99) if percentiles else nan
        jitter = self._jitter.percentiles_ms(50, 99) if percentiles else nan
        return WatchdogStats(
            ticks=c["ticks"],
            policy_ticks=c["policy_ticks"],
            fallbacks=c["fallbacks"],
            consecutive_fallbacks=self._consecutive,
            max_consecutive_fallbacks=self._max_consecutive,
            loop_deadline_misses=c["loop_deadline_misses"],
            estops=c["estops"],
            estopped=self._estopped,
            late_actions=c["late_actions"],
            nonfinite_actions=c["nonfinite_actions"],
            apply_errors=c["apply_errors"],
            age_ms_p50=ages[0],
            age_ms_p99=ages[1],
            jitter_ms_p50=jitter[0],
            jitter_ms_p99=jitter[1],
        )

    # -- running --------------------------------------------------------------

    def start(self) -> None:
        """Run this watchdog's loop in its own thread."""
        from edgerl.watchdog.loop import ControlLoop

        if self._loop is not None:
            raise RuntimeError("watchdog already started")
        self._loop = ControlLoop([self], clock=self.clock, name="watchdog")
        self._loop.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._loop is not None:
            self._loop.stop(timeout_s)
            self._loop = None
