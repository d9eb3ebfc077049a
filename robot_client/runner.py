"""Robots behind the watchdog, streaming to the edge server.

A :class:`RobotHost` runs any number of robots on one **control thread** (a
:class:`~edgerl.watchdog.watchdog.ControlLoop`). Each tick of a robot applies
the watchdog's action, reads the robot and, when the robot's action queue
runs low, queues its observation; the observations of the robots that tick
together (a slot) go out in one message on the host's Act stream.

The stream's asyncio loop runs on that same thread, in the gaps between
slots, and is stopped at every tick's deadline. It is the host's only Python
thread (gRPC's C core does the socket work), so no tick ever waits for
another thread to give up the GIL. With a separate network thread, MuJoCo's
step and every socket call handed the GIL over and the ticks of 100 robots
ran up to ~3 ms late at p99 on two cores; on one thread they ran within
~1.6 ms. The network never holds a tick: nothing in a tick awaits it, and a
callback runs only until the next deadline comes due.

If the server is slow or gone, answers stop arriving; the watchdogs emit
fallbacks at their rate, and the stream reconnects with backoff and jitter.
The observation-to-answer latency of every answer is kept for the statistics.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import os
import random
import selectors
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgerl.robot_client import errors
from edgerl.robot_client.client import ActStream, EdgeClient
from edgerl.robot_client.robot import Reading, Robot
from edgerl.robot_client.security import ClientSecurity
from edgerl.watchdog.clock import Clock, MonotonicClock
from edgerl.watchdog.loop import ControlLoop, slot_count
from edgerl.watchdog.samples import Samples
from edgerl.watchdog.watchdog import Tick, Watchdog, WatchdogConfig

log = logging.getLogger(__name__)


def precise_event_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose waits end on time, for running between control ticks.

    The default loop waits in ``epoll``, whose timeout has whole milliseconds,
    rounded up: a loop run until the next tick would wake up to a millisecond
    late, on every tick. ``select`` takes microseconds (and a robot process has
    few file descriptors, far below its limit of 1024).
    """
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


POLL_ITERATIONS = 3
"""Event-loop iterations of a poll (``run_loop_for(loop, 0)``): one takes in the answers and
wakes the sender, the next writes and hands the answers to the robots."""


def run_loop_for(loop: asyncio.AbstractEventLoop, seconds: float) -> None:
    """Run ``loop`` for ``seconds`` (the control loop's idle time between two slots).

    With ``seconds <= 0`` (the control loop is behind), run only what is ready,
    for :data:`POLL_ITERATIONS` iterations, without waiting for anything.
    """
    if seconds <= 0:
        for _ in range(POLL_ITERATIONS):
            loop.call_soon(loop.stop)
            loop.run_forever()
        return
    timer = loop.call_later(seconds, loop.stop)
    loop.run_forever()
    timer.cancel()


@dataclass(frozen=True)
class LinkFaults:
    """Faults injected on the way from the server to the robot (tests and benchmarks)."""

    delay_ms: float = 0.0
    """Added to every answer's latency (ms)."""
    jitter_ms: float = 0.0
    """Uniformly random extra latency in [0, jitter_ms] per answer (ms)."""
    drop: float = 0.0
    """Probability that an answer is lost."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError("delay_ms and jitter_ms must be >= 0")
        if not 0.0 <= self.drop <= 1.0:
            raise ValueError(f"drop must be in [0, 1], got {self.drop}")


@dataclass(frozen=True)
class RobotRunnerConfig:
    """How robots talk to the edge server."""

    server: str
    """Edge server address, host:port."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Rate, deadline, fallback mode and e-stop of every robot."""
    refill_at: int = 1
    """Ask for new actions when this many or fewer are left in the robot's queue."""
    timeout_s: float = 1.0
    """An answer later than this ends the stream, which is reopened (seconds)."""
    connect_timeout_s: float = 10.0
    """How long ``start`` waits for the first streams before the loop runs anyway (seconds)."""
    backoff_initial_s: float = 0.05
    """First reconnect delay (seconds); doubles per failure, with jitter."""
    backoff_max_s: float = 0.25
    """Longest reconnect delay (seconds); short, since robots fall back while disconnected.
    gRPC's own reconnect backoff is capped at the same."""
    faults: LinkFaults = field(default_factory=LinkFaults)
    """Injected link faults; none by default."""
    security: ClientSecurity | None = None
    """TLS files and token of the robots' channel; None: plaintext, no token."""
    stats_window: int = 8192
    """Answers kept for the latency percentiles."""
    realtime_priority: int = 0
    """SCHED_FIFO priority (1-99) of the control thread; 0: normal scheduling. Needs CAP_SYS_NICE
    (e.g. root); without it the loop runs normally and says so once."""
    poll_behind_s: float = 0.0
    """While the control loop runs behind, serve the stream (send what the robots queued, take
    in the answers) at least this often (seconds); 0: only once the loop has caught up.

    Fewer fallbacks, but later and skipped ticks: each poll does the network work that piled up
    in front of overdue ticks. 100 robots at 50 Hz, 0.005 side by side with 0: in a noisy spell
    1.3-4.6 % fallbacks against 5.9-8.3 %, and 969-2,076 loop deadline misses against 602-975;
    in a quiet one 0.006-0.65 % against 0.75-1.37 %, and a median robot's tick jitter p99 of
    3.4-5.6 ms against 2.4-3.6 ms (README, Robots)."""
    robots_per_slot: int = 8
    """Robots of one host ticked back to back, their observations sent in one message.

    Fewer slots mean fewer messages (and less network work between ticks);
    more robots per slot mean a later tick for the last robot of a slot (about
    0.1 ms or less per MuJoCo robot here)."""

    def __post_init__(self) -> None:
        if self.robots_per_slot < 1:
            raise ValueError(f"robots_per_slot must be >= 1, got {self.robots_per_slot}")
        if self.refill_at < 0:
            raise ValueError(f"refill_at must be >= 0, got {self.refill_at}")
        if self.poll_behind_s < 0:
            raise ValueError(f"poll_behind_s must be >= 0, got {self.poll_behind_s}")
        if self.timeout_s <= 0 or self.connect_timeout_s < 0:
            raise ValueError("timeout_s must be > 0 and connect_timeout_s >= 0")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")


@dataclass(frozen=True, slots=True)
class _Request:
    tick: int
    time: float
    obs: np.ndarray
    reward: float
    terminated: bool
    truncated: bool
    fallback: bool


TickHook = Callable[[int, Tick, Reading, bool], None]
"""Called from the control thread after each tick: (robot index, tick, reading, robot was reset)."""


class _Outbox:
    """Requests of the robots that ticked together, handed to the stream in one message."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[tuple[int, _Request]]] = asyncio.Queue()
        self.connected = False
        self._collected: list[tuple[int, _Request]] = []

    def post(self, index: int, req: _Request) -> None:
        self._collected.append((index, req))

    def flush(self) -> None:
        """Queue the collected requests as one message (after a slot)."""
        if self._collected:
            batch, self._collected = self._collected, []
            self.queue.put_nowait(batch)


class RobotLink:
    """One robot: its watchdog, its episode bookkeeping and its slot on the host's stream."""

    def __init__(
        self,
        index: int,
        robot: Robot,
        config: RobotRunnerConfig,
        clock: Clock,
        on_tick: TickHook | None = None,
    ) -> None:
        self.index = index
        self.robot = robot
        self.config = config
        self.watchdog = Watchdog(
            robot.action_low,
            robot.action_high,
            self._tick,
            config.watchdog,
            stop_action=robot.safe_action(),
            clock=clock,
        )
        self.on_tick = on_tick
        self.outbox: _Outbox | None = None
        self._outstanding = False
        self._final: _Request | None = None
        self._reset_next = False
        self._reward = 0.0
        self._terminated = self._truncated = self._fallback = False
        self._rng = random.Random(config.faults.seed * 100_003 + index)
        self.latencies_s = Samples(config.stats_window)
        self.counts = dict.fromkeys(("requests", "answers", "dropped", "episodes"), 0)
        self.episode_returns: list[float] = []
        self._ep_return = 0.0
        self.last_version = -1

    # -- control thread -----------------------------------------------------

    def _tick(self, tick: Tick) -> None:
        robot = self.robot
        was_reset = self._reset_next
        if was_reset:  # the action of the tick after an episode's end is not applied
            reading = robot.reset()
            self._reset_next = False
            self.watchdog.discard()
        else:
            robot.apply(tick.action)
            reading = robot.read()
            self._reward += reading.reward
            self._ep_return += reading.reward
        self._terminated |= reading.terminated
        self._truncated |= reading.truncated
        self._fallback |= tick.fallback
        done = reading.terminated or reading.truncated
        if done:
            self._reset_next = True
            self.counts["episodes"] += 1
            self.episode_returns.append(self._ep_return)
            self._ep_return = 0.0
        if self.on_tick is not None:
            self.on_tick(self.index, tick, reading, was_reset)
        if not done and self.watchdog.remaining() > self.config.refill_at:
            return
        outbox = self.outbox
        if outbox is None or not outbox.connected:
            return
        busy = self._outstanding
        if busy and not done:
            return  # the answer in flight will refill the queue; this observation is skipped
        self._outstanding = True
        req = _Request(
            tick.index,
            self.watchdog.clock.now(),
            np.asarray(reading.obs, np.float32),
            self._reward,
            self._terminated,
            self._truncated,
            self._fallback,
        )
        self._reward = 0.0
        self._terminated = self._truncated = self._fallback = False
        if busy:
            # An episode's last observation must reach the server (it carries the
            # final reward and flags): it goes out as soon as the answer in flight is in.
            self._final = req
            return
        outbox.post(self.index, req)

    # -- the stream's side ----------------------------------------------------

    def release(self) -> None:
        """The request in flight is gone (stream failed): a new one may be sent."""
        self._outstanding = False
        self._final = None

    def deliver(self, actions: np.ndarray, version: int, log_prob: float, req: _Request) -> None:
        """The answer to ``req`` arrived: hand it to the watchdog (after injected faults)."""
        final, self._final = self._final, None
        self._outstanding = final is not None
        if final is not None and self.outbox is not None:
            self.outbox.queue.put_nowait([(self.index, final)])
        self.counts["answers"] += 1
        faults = self.config.faults
        if faults.drop and self._rng.random() < faults.drop:
            self.counts["dropped"] += 1
            return
        delay_s = (faults.delay_ms + self._rng.uniform(0.0, faults.jitter_ms)) / 1e3
        if delay_s > 0:
            asyncio.get_running_loop().call_later(delay_s, self._submit, actions, (version, log_prob), req)
        else:
            self._submit(actions, (version, log_prob), req)

    def _submit(self, actions: np.ndarray, tag: tuple[int, float], req: _Request) -> None:
        self.latencies_s.append(self.watchdog.clock.now() - req.time)
        self.last_version = tag[0]
        self.watchdog.submit(actions, req.tick, req.time, tag=tag)

    def reset_stats(self) -> None:
        self.watchdog.reset_stats()
        self.latencies_s.clear()
        for key in self.counts:
            self.counts[key] = 0

    def stats(self, percentiles: bool = True) -> dict[str, Any]:
        """Watchdog counters, latency percentiles (ms; NaN unless ``percentiles``) and link counters."""
        s = self.watchdog.stats(percentiles)
        p50, p99 = (
            (self.latencies_s.percentile_ms(50), self.latencies_s.percentile_ms(99))
            if percentiles
            else (math.nan, math.nan)
        )
        return {
            "robot": self.robot.name,
            "ticks": s.ticks,
            "fallbacks": s.fallbacks,
            "fallback_rate": s.fallback_rate,
            "estops": s.estops,
            "max_consecutive_fallbacks": s.max_consecutive_fallbacks,
            "estopped": s.estopped,
            "loop_deadline_misses": s.loop_deadline_misses,
            "late_actions": s.late_actions,
            "tick_jitter_ms_p50": s.jitter_ms_p50,
            "tick_jitter_ms_p99": s.jitter_ms_p99,
            "action_age_ms_p50": s.age_ms_p50,
            "action_age_ms_p99": s.age_ms_p99,
            "latency_ms_p50": p50,
            "latency_ms_p99": p99,
            "policy_ticks": s.policy_ticks,
            "policy_version": self.last_version,
            **self.counts,
        }


class RobotHost:
    """Runs robots behind watchdogs on one control thread, with one Act stream (env id = robot index).

    The robots tick in slots spread over the period (``robots_per_slot`` per
    slot); the observations of a slot go out in one message; the stream's
    asyncio loop runs on the control thread between slots (see the module
    doc). ``with RobotHost(robots, config) as host: ...``; :meth:`start` waits
    (up to ``connect_timeout_s``) for the stream, then starts the loop, which
    runs whether the server is there or not.

    Args:
        robots: the robots, all with the same observation shape and unique names.
        config: link and watchdog settings shared by all of them.
        session_id: the stream's identity (transitions are keyed by it and the
            robot index); default: the robot's name for one robot, else ``host/pid``.
        client_factory: builds the :class:`EdgeClient`. Default: a channel to
            ``config.server`` with ``config.security``.
        clock: the control loop's clock.
        on_tick: called after each tick of any robot (control thread).
    """

    def __init__(
        self,
        robots: Sequence[Robot],
        config: RobotRunnerConfig,
        *,
        session_id: str = "",
        client_factory: Callable[[], EdgeClient] | None = None,
        clock: Clock | None = None,
        on_tick: TickHook | None = None,
    ) -> None:
        if not robots:
            raise ValueError("a robot host needs at least one robot")
        shapes = {tuple(r.obs_shape) for r in robots}
        if len(shapes) != 1:
            raise ValueError(f"robots of one host need one observation shape, got {sorted(shapes)}")
        names = [r.name for r in robots]
        if len(set(names)) != len(names):
            raise ValueError(f"robot names must be unique, got {names}")
        self.obs_shape = shapes.pop()
        self.config = config
        self.session_id = session_id or (
            robots[0].name if len(robots) == 1 else f"{socket.gethostname()}/{os.getpid()}"
        )
        self.clock: Clock = clock or MonotonicClock()
        self.links = [RobotLink(i, r, config, self.clock, on_tick) for i, r in enumerate(robots)]
        self._client_factory = client_factory or (
            lambda: EdgeClient(
                config.server,
                timeout_s=config.timeout_s,
                security=config.security,
                reconnect_backoff_max_s=config.backoff_max_s,
            )
        )
        self._loop = precise_event_loop()
        self._outbox = _Outbox()
        for link in self.links:
            link.outbox = self._outbox
        self._control = ControlLoop(
            [link.watchdog for link in self.links],
            clock=self.clock,
            name="robot-control",
            slots=slot_count(len(self.links), config.robots_per_slot),
            after_slot=self._outbox.flush,
            idle=functools.partial(run_loop_for, self._loop),
            realtime_priority=config.realtime_priority,
            poll_behind_s=config.poll_behind_s,
        )
        self._stopping: asyncio.Event | None = None
        self._task: asyncio.Future[None] | None = None
        self.reconnects = 0
        self.messages = 0

    def __enter__(self) -> RobotHost:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def connected(self) -> bool:
        return self._outbox.connected

    def start(self) -> None:
        """Open the stream (waiting up to ``connect_timeout_s``), then start the control loop."""
        self._loop.run_until_complete(self._start())
        deadline = time.monotonic() + self.config.connect_timeout_s
        while not self._outbox.connected and time.monotonic() < deadline:
            run_loop_for(self._loop, 0.02)
        if not self._outbox.connected:
            log.warning(
                "no stream to %s within %.1fs; the robots run on fallbacks until it connects",
                self.config.server,
                self.config.connect_timeout_s,
            )
        # A full collection over the robots' heap (MuJoCo models, envs) stalls the
        # loop for milliseconds; moving what exists now out of the collector's
        # reach took the tick jitter p99 of 50 robots from ~2-3 ms to ~0.2 ms.
        gc.collect()
        gc.freeze()
        self._control.start()

    async def _start(self) -> None:
        self._stopping = asyncio.Event()
        self._task = asyncio.ensure_future(self._run(self._client_factory(), self._stopping))

    @property
    def control_error(self) -> BaseException | None:
        error: BaseException | None = self._control.error
        return error

    def stop(self) -> None:
        """Stop the control loop (robots get no further action), then close the stream."""
        self._control.stop()
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._stop())
            self._loop.close()
        for link in self.links:
            link.robot.close()

    async def _stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, 5.0)

    def stats(self) -> list[dict[str, Any]]:
        return [link.stats() for link in self.links]

    # -- the stream (on the control thread, between slots) ---------------------

    async def _run(self, client: EdgeClient, stopping: asyncio.Event) -> None:
        """Keep the stream open until ``stopping`` is set, reconnecting with backoff and jitter."""
        cfg = self.config
        rng = random.Random()
        backoff = cfg.backoff_initial_s
        async with client:
            while not stopping.is_set():
                stream: ActStream | None = None
                try:
                    # A unary call first: auth and shape errors come back with their own status.
                    await client.describe_for(self.obs_shape, "the robots")
                    stream = await client.open_stream(
                        session_id=self.session_id,
                        num_envs=len(self.links),
                        obs_shape=self.obs_shape,
                        max_inflight=len(self.links),
                        timeout_s=cfg.timeout_s,
                    )
                    self._outbox.connected = True
                    backoff = cfg.backoff_initial_s
                    await self._serve(stream, stopping)
                except errors.EdgeRLError as exc:
                    if stopping.is_set():
                        break
                    self.reconnects += 1
                    level = logging.WARNING if backoff == cfg.backoff_initial_s else logging.DEBUG
                    log.log(level, "stream to %s failed (%s); reconnecting", cfg.server, exc)
                finally:
                    self._outbox.connected = False
                    if stream is not None:
                        await stream.close()
                    while not self._outbox.queue.empty():
                        self._outbox.queue.get_nowait()
                    for link in self.links:
                        link.release()
                if not stopping.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopping.wait(), backoff * rng.uniform(0.5, 1.0))
                    backoff = min(2 * backoff, cfg.backoff_max_s)

    async def _serve(self, stream: ActStream, stopping: asyncio.Event) -> None:
        pending: deque[list[tuple[int, _Request]]] = deque()
        sent = asyncio.Event()
        sender = asyncio.ensure_future(self._send_loop(stream, pending, sent))
        stop_wait = asyncio.ensure_future(stopping.wait())
        try:
            while not stopping.is_set():
                if not pending:
                    sent.clear()
                    sent_wait = asyncio.ensure_future(sent.wait())
                    await asyncio.wait({sender, stop_wait, sent_wait}, return_when=asyncio.FIRST_COMPLETED)
                    sent_wait.cancel()
                    if sender.done():
                        sender.result()
                        return
                    continue
                answer = await stream.recv(self.config.timeout_s)
                batch = pending.popleft()
                for row, (i, req) in enumerate(batch):
                    self.links[i].deliver(
                        answer.actions[row], answer.policy_version, float(answer.log_probs[row]), req
                    )
        finally:
            sender.cancel()
            stop_wait.cancel()

    async def _send_loop(
        self, stream: ActStream, pending: deque[list[tuple[int, _Request]]], sent: asyncio.Event
    ) -> None:
        queue = self._outbox.queue
        while True:
            batch = await queue.get()
            while not queue.empty():
                batch.extend(queue.get_nowait())
            reqs = [r for _, r in batch]
            await stream.send(
                [i for i, _ in batch],
                np.stack([r.obs for r in reqs]),
                [r.reward for r in reqs],
                [r.terminated for r in reqs],
                [r.truncated for r in reqs],
                fallback=[r.fallback for r in reqs],
            )
            pending.append(batch)
            self.messages += 1
            for i, _ in batch:
                self.links[i].counts["requests"] += 1
            sent.set()
