"""Robots behind the watchdog, streaming to the edge server.

A :class:`RobotHost` runs any number of robots on one **control thread** (a
:class:`~edgerl.watchdog.watchdog.ControlLoop`). Each tick of a robot applies
the watchdog's action, reads the robot and, when the robot's action queue
runs low, queues its observation; the observations of the robots that tick
together (a slot) go out in one message on the host's Act stream.

By default the stream's asyncio loop runs on that same thread, in the gaps
between slots, and is stopped at every tick's deadline. It is then the
host's only Python thread (gRPC's C core does the socket work), so no tick
ever waits for another thread to give up the GIL: with a separate network
thread, MuJoCo's step and every socket call handed the GIL over and the ticks
of 100 robots ran up to ~3 ms late at p99 on two cores. The network never
holds a tick: nothing in a tick awaits it, and a callback runs only until
the next deadline comes due. The price: while the loop runs behind after a
stall, it has no idle time, so no answer is read and no observation is sent
until it has caught up (10-130 ms on a noisy machine), and every robot falls
back meanwhile.

With ``network_process=True`` the stream lives in a network process of the
host's own (:mod:`edgerl.robot_client.netproc`), joined to the control
thread by a Unix socket pair: after each slot, also while behind, the control
thread writes the slot's observations to the socket and takes in the answers
that came meanwhile, without waiting; while no tick is due it waits on the
socket. The network process reads the answers off the network on its own
core time. If it ends, a new one starts at once (at most one a second). Both use one
:class:`~edgerl.robot_client.keeper.StreamKeeper`.

If the server is slow or gone, answers stop arriving; the watchdogs emit
fallbacks at their rate, and the stream reconnects with backoff and jitter.
The observation-to-answer latency of every answer is kept for the statistics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import heapq
import logging
import math
import random
import select
import selectors
import socket
import statistics
import subprocess
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgerl.proto import frames
from edgerl.proto.settings import check_backoff, check_finite
from edgerl.robot_client import errors, netproc
from edgerl.robot_client.client import Actions
from edgerl.robot_client.keeper import (
    StreamKeeper,
    StreamSettings,
    check_cpus,
    host_session_id,
    mid_episode_settings,
)
from edgerl.robot_client.robot import Reading, Robot, RobotKind, RobotState
from edgerl.robot_client.security import ClientSecurity, check_target
from edgerl.sim.episodes import EpisodeLog
from edgerl.watchdog.clock import Clock, MonotonicClock
from edgerl.watchdog.loop import ControlLoop, slot_count
from edgerl.watchdog.samples import Samples
from edgerl.watchdog.watchdog import Tick, Watchdog, WatchdogConfig

log = logging.getLogger(__name__)

MAX_BACKLOG_BYTES = 8 << 20
"""Observations waiting for a stuck network process beyond this are dropped (their robots fall back)."""


DEFAULT_DEADLINE_MS = 20.0
"""Latency budget of a policy action without action chunks (ms)."""


def chunk_defaults(
    hz: float, chunk: int, deadline_ms: float | None = None, refill_at: int | None = None
) -> tuple[float, int]:
    """The deadline (ms) and refill level that suit answers of ``chunk`` actions at ``hz``;
    ``deadline_ms`` and ``refill_at``, where given, are kept.

    One action per answer: 20 ms, and ask again when one action is left. A chunk of
    ``K > 1`` actions covers the next ``K`` ticks, so an answer is of use until the
    chunk's span (``K / hz``) has passed: that is its deadline, and a robot asks for the
    next chunk when half of the held one is left (as LeRobot's asynchronous inference
    does), so a policy call may take up to about half the span without a fallback.
    """
    default = (DEFAULT_DEADLINE_MS, 1) if chunk <= 1 else (1e3 * chunk / hz, chunk // 2)
    return (
        default[0] if deadline_ms is None else deadline_ms,
        default[1] if refill_at is None else refill_at,
    )


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
        check_finite(self)
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
    """An answer later than this ends the stream, which is reopened on a new connection (seconds)."""
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
    (e.g. root); without it the loop runs normally and says so once. A process the thread starts
    (a new network process) runs under normal scheduling."""
    network_process: bool = False
    """Run the stream in a network process of its own instead of on the control thread.

    The answers are then read off the network while the control loop is busy, also while it
    runs behind after a stall, instead of only in its idle time. On two cores shared with the
    edge server (``edgerl bench robot``, the server and the network process kept off the last
    CPU), in a noisy spell: 1.2-3.3 % fallbacks against 5.4-12.6 % with the stream on the
    control thread, but 1.4-2.7x the skipped ticks (docs/performance-log.md, Robots). Off by default."""
    network_spare: bool = True
    """With ``network_process``: keep a second network process started, to take over at once
    from one that is lost. Its stream was up ~0.01 s after the loss, against ~0.15 s for a
    process started then (~47 MB more memory)."""
    network_cpus: tuple[int, ...] = ()
    """CPUs the network process runs on; empty: any. Leave the control thread a CPU of its own:
    on two cores shared with the edge server, the control thread, the network process and the
    server otherwise take turns on both, and the ticks ran later (README, Robot path)."""
    robots_per_slot: int = 8
    """Robots of one host ticked back to back, their observations sent in one message.

    Fewer slots mean fewer messages (and less network work between ticks);
    more robots per slot mean a later tick for the last robot of a slot (about
    0.1 ms or less per MuJoCo robot here)."""

    def __post_init__(self) -> None:
        check_finite(self)
        if self.robots_per_slot < 1:
            raise ValueError(f"robots_per_slot must be >= 1, got {self.robots_per_slot}")
        check_cpus(self, "network_cpus")
        check_target(self.server)
        if self.refill_at < 0:
            raise ValueError(f"refill_at must be >= 0, got {self.refill_at}")
        if self.timeout_s <= 0 or self.connect_timeout_s < 0:
            raise ValueError("timeout_s must be > 0 and connect_timeout_s >= 0")
        check_backoff(self.backoff_initial_s, self.backoff_max_s)


@dataclass(frozen=True, slots=True)
class _Request:
    tick: int
    time: float
    obs: np.ndarray
    reward: float
    terminated: bool
    truncated: bool
    fallback: bool
    index: int
    """Its number among the robot's requests (``StepObservation.obs_index``): how many the robot
    made before it, less those that went unanswered and were sent again (they keep theirs)."""


TickHook = Callable[[int, Tick, Reading, bool], None]
"""Called from the control thread after each tick: (robot index, tick, reading, robot was reset)."""


def precise_event_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose waits end on time, for running between control ticks.

    The default loop waits in ``epoll``, whose timeout has whole milliseconds,
    rounded up: a loop run until the next tick would wake up to a millisecond
    late, on every tick. ``select`` takes microseconds (and a robot process has
    few file descriptors, far below its limit of 1024).
    """
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


def run_loop_for(loop: asyncio.AbstractEventLoop, seconds: float) -> None:
    """Run ``loop`` for ``seconds`` (the control loop's idle time between two slots)."""
    timer = loop.call_later(seconds, loop.stop)
    loop.run_forever()
    timer.cancel()


def _obs_rows(batches: list[list[tuple[int, _Request]]]) -> frames.ObsRows:
    """The requests of ``batches`` (robot index, request), in order, as arrays."""
    pairs = [pair for batch in batches for pair in batch]
    reqs = [r for _, r in pairs]
    return frames.ObsRows(
        np.fromiter((i for i, _ in pairs), np.int32, len(pairs)),
        np.stack([r.obs for r in reqs]).reshape(len(reqs), -1),
        np.fromiter((r.reward for r in reqs), np.float32, len(reqs)),
        np.array([(r.terminated, r.truncated, r.fallback) for r in reqs], np.uint8),
        np.fromiter((r.index for r in reqs), np.uint64, len(reqs)),
    )


class _Outbox:
    """The control thread's side of the host's stream: the robots' requests go out in slot
    batches, and each answer row goes back to its robot (rows are answered in the order sent).

    Two transports: the stream on the control thread itself (:class:`_ThreadOutbox`, the
    default) or in a network process (:class:`_ProcessOutbox`). See the module doc.
    """

    def __init__(self, links: Sequence[RobotLink], settings: StreamSettings, clock: Clock) -> None:
        self.links = links
        self.settings = settings
        self.clock = clock
        self.connected = False
        self.epoch = 0
        self.reconnects = 0
        self.messages = 0
        self.restarts = 0
        self._collected: list[tuple[int, _Request]] = []
        self._rows: deque[tuple[int, _Request]] = deque()  # sent, in order, not yet answered

    @property
    def network_pid(self) -> int | None:
        """The network process serving the stream; None: none."""
        return None

    def open(self) -> None:
        """Start the stream (it connects in the background)."""
        raise NotImplementedError

    def close(self) -> None:
        """Close the stream (after the control loop stopped)."""
        raise NotImplementedError

    def after_slot(self) -> None:
        """After each slot, also while the loop runs behind: send the slot's observations."""
        raise NotImplementedError

    def wait(self, seconds: float) -> None:
        """The control loop has ``seconds`` to spare: serve the stream meanwhile."""
        raise NotImplementedError

    def _emit(self, batch: list[tuple[int, _Request]]) -> bool:
        """Hand ``batch`` (robot index, request) to the stream; False if it cannot take it now."""
        raise NotImplementedError

    def stepping_without_stream(self) -> None:
        """The control loop starts before a stream is up: the robots step on fallbacks, and every
        stream from now on says ``mid_episode``."""
        raise NotImplementedError

    def post(self, index: int, req: _Request) -> None:
        self._collected.append((index, req))

    def later(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` from the control thread in ``delay_s`` (injected link delay)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Hand the collected requests to the stream as one batch."""
        if not self._collected:
            return
        batch, self._collected = self._collected, []
        if not self.connected or not self._emit(batch):
            for i, _ in batch:  # the stream is down or stuck: these robots fall back and ask again
                self.links[i].release()
            return
        self._rows.extend(batch)
        for i, _ in batch:
            self.links[i].counts["requests"] += 1

    def _up(self, epoch: int) -> None:
        self.epoch = epoch
        self.connected = True

    def _down(self, epoch: int, error: errors.EdgeRLError | None = None) -> None:
        """The stream of ``epoch`` failed (with ``error``; robots ride through every failure)."""
        self.reconnects += 1
        self._disconnect()

    def _answer(self, epoch: int, answer: Actions | frames.AnswerRows) -> None:
        actions, version, log_probs = answer.actions, answer.policy_version, answer.log_probs
        n = len(actions)
        if epoch != self.epoch or n > len(self._rows):
            log.error("an answer of %d rows for stream %d; %d rows of stream %d are out",
                      n, epoch, len(self._rows), self.epoch)  # fmt: skip
            return
        self.messages += 1
        rows = self._rows
        for row in range(n):
            i, req = rows.popleft()
            self.links[i].deliver(actions[row], version, float(log_probs[row]), req)

    def _disconnect(self) -> None:
        """The stream failed: what was sent will not be answered; the robots may ask again."""
        self.connected = False
        self._rows.clear()
        self._collected.clear()
        for link in self.links:
            link.release()


class _ThreadOutbox(_Outbox):
    """The stream's asyncio loop runs on the control thread, between slots."""

    def __init__(self, links: Sequence[RobotLink], settings: StreamSettings, clock: Clock) -> None:
        super().__init__(links, settings, clock)
        self._keeper = StreamKeeper(settings, _obs_rows, self._up, self._down, self._answer)
        # made by open(), closed by close(): a host built but never started holds no loop
        self._loop_or_none: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        if self._loop_or_none is None:
            raise RuntimeError("the stream is not open")
        return self._loop_or_none

    def open(self) -> None:
        self._loop_or_none = precise_event_loop()
        self._task = self._loop.create_task(self._keeper.run())

    def close(self) -> None:
        loop = self._loop_or_none
        if loop is None:
            return
        self._keeper.stopping.set()
        try:
            if self._task is not None:  # answers still coming in may call later() meanwhile
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    loop.run_until_complete(asyncio.wait_for(self._task, 5.0))
        finally:
            loop.close()
            self._loop_or_none = None

    def after_slot(self) -> None:
        self.flush()

    def wait(self, seconds: float) -> None:
        run_loop_for(self._loop, seconds)
        self.flush()  # an episode's last observation, queued behind its answer

    def later(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        self._loop.call_later(delay_s, fn, *args)

    def _emit(self, batch: list[tuple[int, _Request]]) -> bool:
        self._keeper.offer(self.epoch, batch)  # made into arrays once per message, when sent
        return True

    def stepping_without_stream(self) -> None:
        self._keeper.stepped()


class _ProcessOutbox(_Outbox):
    """The stream lives in a network process, behind a Unix socket pair. Processes come from
    ``_spare``: with ``spare``, it keeps a second one started (from the first stream up on) to
    replace the first; without, it starts one when one is needed."""

    def __init__(
        self,
        links: Sequence[RobotLink],
        settings: StreamSettings,
        clock: Clock,
        spare: bool = False,
        hung_after_s: float = netproc.HUNG_AFTER_S,
    ) -> None:
        settings = dataclasses.replace(settings, heartbeat_s=hung_after_s / netproc.HEARTBEATS_PER_HUNG)
        super().__init__(links, settings, clock)
        self.hung_after_s = hung_after_s
        """Silence (seconds) after which the network process is taken for hung."""
        self._spare = netproc.Spare(settings.cpus)
        self._keep_spare = spare
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._out = bytearray()
        self._in = bytearray()
        self._restart_at = math.inf
        self._started_at = -math.inf
        self._heard_at = math.inf  # the last word from the network process, or the first row since
        self.heartbeats = 0
        """Heartbeat frames read from the network processes since start."""
        self._closing = False
        self._timers: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._timer_seq = 0

    @property
    def network_pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def open(self) -> None:
        self._sock, self._proc = self._spare.take()
        # A network process that replaces one comes to robots that have stepped.
        self.settings = mid_episode_settings(self.settings, stepped=self._started_at > -math.inf)
        self._out = bytearray(netproc.encode_settings(self.settings))
        self._in.clear()
        self._restart_at = math.inf
        self._started_at = self.clock.now()

    def stepping_without_stream(self) -> None:
        self.settings = mid_episode_settings(self.settings, stepped=True)  # for its replacements
        self._out += frames.frame(frames.STEPPED)  # for the process now starting
        self._send()

    def close(self) -> None:
        """The network process sees the socket close, closes its stream and exits."""
        self._closing = True
        sock, proc, self._sock, self._proc = self._sock, self._proc, None, None
        if sock is not None and proc is not None:
            netproc.stop(sock, proc)
        self._spare.close()

    def after_slot(self) -> None:
        """Send the slot's observations, take in the answers that came meanwhile."""
        self.flush()
        self.pump()

    def wait(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the network process (or an injected delay), then :meth:`pump`."""
        seconds = self._until_timer(seconds)
        sock = self._sock
        if sock is None:
            time.sleep(max(0.0, min(seconds, self._restart_at - self.clock.now())))
        elif seconds > 0:
            select.select([sock], [sock] if self._out else [], [], seconds)
        self.pump()

    def later(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        self._timer_seq += 1
        heapq.heappush(self._timers, (self.clock.now() + delay_s, self._timer_seq, fn, args))

    def _until_timer(self, seconds: float) -> float:
        return min(seconds, self._timers[0][0] - self.clock.now()) if self._timers else seconds

    def _run_timers(self) -> None:
        timers = self._timers
        if timers:
            now = self.clock.now()
            while timers and timers[0][0] <= now:
                _, _, fn, args = heapq.heappop(timers)
                fn(*args)

    def _emit(self, batch: list[tuple[int, _Request]]) -> bool:
        if len(self._out) > MAX_BACKLOG_BYTES:
            return False  # the network process is stuck
        if not self._rows:
            self._heard_at = self.clock.now()  # its silence counts from the first row unanswered
        self._out += frames.encode_obs(self.epoch, _obs_rows([batch]))
        self._send()
        # The send may have found the process lost: the batch was not taken, and must not be
        # held as unanswered, or the process that replaces it is killed as hung at once.
        return self._sock is not None

    def _send(self) -> None:
        if not self._out or self._sock is None:
            return
        try:
            n = self._sock.send(self._out)
        except BlockingIOError:
            return
        except OSError:
            self._lost()
            return
        del self._out[:n]

    def pump(self) -> None:
        """Write what is pending, take in what came, run what is due; never waits."""
        sock = self._sock
        if sock is None:
            if not self._closing and self.clock.now() >= self._restart_at:
                self.open()
            return
        self._send()
        if self._sock is not sock:
            return  # the send found the process lost
        while True:
            try:
                data = sock.recv(frames.RECV_BYTES)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self._lost()
                return
            self._in += data
            self._heard_at = self.clock.now()
            if len(data) < frames.RECV_BYTES:
                break
        for payload in frames.split_frames(self._in):
            kind = payload[:1]
            if kind == frames.ANSWER:
                answer = frames.decode_answer(payload)
                self._answer(answer.epoch, answer)
            elif kind == frames.UP:
                self._up(frames.decode_state(payload))
                if self._keep_spare:
                    self._spare.fill()  # once a stream is up: its start-up does not delay this one's
            elif kind == frames.DOWN:
                self._down(*netproc.decode_down(payload))
            elif kind == frames.HEARTBEAT:
                self.heartbeats += 1
        if self._rows and self.clock.now() - self._heard_at > self.hung_after_s:
            self._lost(hung=True)
            return
        self._run_timers()
        self.flush()  # an episode's last observation, queued behind its answer

    def _lost(self, hung: bool = False) -> None:
        """The network process exited, its socket broke, or it is ``hung`` (killed then): start
        a new one at once, or ``netproc.RESTART_DELAY_S`` after the last one started."""
        now = self.clock.now()
        silent_s, rows = now - self._heard_at, len(self._rows)
        self._disconnect()
        sock, proc, self._sock, self._proc = self._sock, self._proc, None, None
        if sock is not None:
            sock.close()
        if self._closing:
            return
        code = netproc.kill(proc) if proc is not None else None
        self.restarts += 1
        self._out.clear()
        self._restart_at, when = netproc.next_start(self._started_at, now)
        if hung:
            log.error("the robots' network process said nothing for %.1fs with %d observation(s) "
                      "unanswered: killed as hung; a new one starts %s", silent_s, rows, when)  # fmt: skip
        elif code is None:  # it closed its socket, or broke it, and ran on: of no more use
            log.error("the robots' network process closed its socket but still ran: killed; "
                      "a new one starts %s", when)  # fmt: skip
        else:
            log.error("the robots' network process ended (exit code %s); a new one starts %s",
                      code, when)  # fmt: skip


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
        self._sent: _Request | None = None  # posted, not yet answered
        self._final: _Request | None = None
        self._reset_next = False
        self._forget_earned()
        self._requests_made = 0
        self._rng = random.Random(config.faults.seed * 100_003 + index)
        self.latencies_s = Samples(config.stats_window)
        self.counts = dict.fromkeys(("requests", "answers", "dropped", "episodes"), 0)
        self.episodes = EpisodeLog()  # the count and both ends: a host may run for months
        self._ep_return, self._ep_length = 0.0, 0
        self.last_version = -1

    # -- control thread -----------------------------------------------------

    def _tick(self, tick: Tick) -> None:
        robot = self.robot
        if self._reset_next and self.watchdog.estopped:
            self._hold(tick)
            return
        was_reset = self._reset_next
        if was_reset:  # the action of the tick after an episode's end is not applied
            reading = robot.reset()
            self._reset_next = False
            self.watchdog.discard()
            reward = 0.0
        else:
            robot.apply(tick.action)
            reading = robot.read()
            reward = reading.reward
            self._ep_return += reward
            self._ep_length += 1
        self._earn(reward, reading.terminated, reading.truncated, tick.fallback)
        done = reading.terminated or reading.truncated
        if done:
            self._reset_next = True
            self.counts["episodes"] += 1
            self.episodes.add(self._ep_return, self._ep_length)
            self._ep_return, self._ep_length = 0.0, 0
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
        req = _Request(
            tick.index,
            self.watchdog.clock.now(),
            np.asarray(reading.obs, np.float32),
            self._reward,
            self._terminated,
            self._truncated,
            self._fallback,
            self._requests_made,
        )
        self._requests_made += 1
        self._forget_earned()
        if busy:
            # An episode's last observation must reach the server (it carries the
            # final reward and flags): it goes out as soon as the answer in flight is in.
            self._final = req
            return
        self._sent = req
        outbox.post(self.index, req)

    @property
    def _outstanding(self) -> bool:
        """A request is in flight (an episode's last observation may wait behind it)."""
        return self._sent is not None

    def _forget_earned(self) -> None:
        """Start afresh what the robot's next request carries."""
        self._reward = 0.0
        self._terminated = self._truncated = self._fallback = False

    def _earn(self, reward: float, terminated: bool, truncated: bool, fallback: bool) -> None:
        """Add to what the robot's next request carries. After an episode's end that no request
        has carried yet (the robot had no stream then, or the request that carried it was lost),
        the robot is in the next episode, none of whose steps has reached the server: what it
        earns there belongs to no step, not to the ended episode's last one, and is left out."""
        if not (self._terminated or self._truncated):
            self._reward += reward
            self._fallback |= fallback
        self._terminated |= terminated
        self._truncated |= truncated

    def _hold(self, tick: Tick) -> None:
        """A tick of an e-stopped robot whose episode has ended: no reset until the e-stop's.

        A reset would move a real robot (to its start pose). The tick's action (the e-stop's
        ramp to the stop action) is applied instead; no episode runs, so the reading is
        recorded with no reward or episode flags, and nothing goes to the server.
        """
        self.robot.apply(tick.action)
        reading = self.robot.read()  # read as on every tick (a driver may drain its sensors here)
        if self.on_tick is not None:
            self.on_tick(self.index, tick, RobotState(reading.obs), False)

    # -- the stream's side ----------------------------------------------------

    def release(self) -> None:
        """The request in flight is gone, unanswered (the stream failed, or took no more): a new
        one may be sent. It takes the request's number, and its reward and flags (and those of a
        final observation queued behind it) go back into the new one: the server completes the
        step it answered last with it, or, where the lost request reached it and was answered,
        answers it in that request's place (``StreamHello.resumes``). A break of the stream loses
        nothing of what the robot earned in its episode.

        Where a request lost was an episode's last, the new one carries that episode's end: the
        reward and flags of the episode after it, earned on fallbacks before any of its steps
        reached the server, belong to no step and are left out."""
        lost = [req for req in (self._sent, self._final) if req is not None]
        if lost:  # earned before what the robot earned since: all of it goes in again, in order
            since = (self._reward, self._terminated, self._truncated, self._fallback)
            self._forget_earned()
            for req in lost:
                self._earn(req.reward, req.terminated, req.truncated, req.fallback)
            self._earn(*since)
            self._requests_made = lost[0].index
        self._sent = self._final = None

    def deliver(self, actions: np.ndarray, version: int, log_prob: float, req: _Request) -> None:
        """The answer to ``req`` arrived: hand it to the watchdog (after injected faults)."""
        final, self._final = self._final, None
        self._sent = final
        if final is not None and self.outbox is not None:
            self.outbox.post(self.index, final)
        self.counts["answers"] += 1
        faults = self.config.faults
        if faults.drop and self._rng.random() < faults.drop:
            self.counts["dropped"] += 1
            return
        delay_s = (faults.delay_ms + self._rng.uniform(0.0, faults.jitter_ms)) / 1e3
        if delay_s > 0 and self.outbox is not None:
            self.outbox.later(delay_s, self._submit, actions, (version, log_prob), req)
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
        p50, p99 = self.latencies_s.percentiles_ms(50, 99) if percentiles else (math.nan, math.nan)
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
            "return_last20": statistics.fmean(last) if (last := self.episodes.last_returns(20)) else None,
        }


class RobotHost:
    """Runs robots behind watchdogs on one control thread, with one Act stream (env id = robot index).

    The robots tick in slots spread over the period (``robots_per_slot`` per
    slot); the observations of a slot go out in one message; the stream lives
    in the host's network process (see the module doc). ``with
    RobotHost(robots, config) as host: ...``; :meth:`start` waits (up to
    ``connect_timeout_s``) for the stream, then starts the loop, which runs
    whether the server is there or not.

    Args:
        robots: the robots, all with the same observation shape and unique names.
        config: link and watchdog settings shared by all of them.
        session_id: the stream's identity (transitions are keyed by it and the
            robot index); default: the robot's name for one robot with a name, else ``host/pid``.
        clock: the control loop's clock.
        on_tick: called after each tick of any robot (control thread).
    """

    def __init__(
        self,
        robots: Sequence[Robot],
        config: RobotRunnerConfig,
        *,
        session_id: str = "",
        clock: Clock | None = None,
        on_tick: TickHook | None = None,
    ) -> None:
        self.kind = RobotKind.of(robots)
        names = [r.name for r in robots]
        if len(set(names)) != len(names):
            raise ValueError(f"robot names must be unique, got {names}")
        self.obs_shape = self.kind.obs_shape
        self.config = config
        # a robot without a name (``edgerl robot`` names a lone robot "") gets host/pid too: the
        # server refuses an empty session id, and the stream would be refused and reopened forever
        self.session_id = session_id or (robots[0].name if len(robots) == 1 else "") or host_session_id()
        self.clock: Clock = clock or MonotonicClock()
        self.links = [RobotLink(i, r, config, self.clock, on_tick) for i, r in enumerate(robots)]
        kind = self.kind
        settings = StreamSettings.of(
            config,
            self.session_id,
            len(self.links),
            kind.obs_shape,
            act_shape=kind.act_shape,
            env_name=kind.env_name,
            resumes=True,  # a request unanswered at a break goes again, numbered as before
        )
        self._outbox: _Outbox
        if config.network_process:
            wd = config.watchdog
            hung_s = netproc.hung_after(wd.hz, wd.estop_after)
            self._outbox = _ProcessOutbox(
                self.links, settings, self.clock, spare=config.network_spare, hung_after_s=hung_s
            )
            rides_out = netproc.estop_riding_out_a_hang(wd.hz)
            if 0 < wd.estop_after < rides_out:
                log.warning("robots at %g Hz e-stop after %d fallbacks (%.3fs); a hung network "
                            "process is found after %.2fs of silence and then replaced: a hang may "
                            "e-stop them (raise estop_after to %d or more to ride one out)",
                            wd.hz, wd.estop_after, wd.estop_after / wd.hz, hung_s, rides_out)  # fmt: skip
        else:
            self._outbox = _ThreadOutbox(self.links, settings, self.clock)
        for link in self.links:
            link.outbox = self._outbox
        self._control = ControlLoop(
            [link.watchdog for link in self.links],
            clock=self.clock,
            name="robot-control",
            slots=slot_count(len(self.links), config.robots_per_slot),
            after_slot=self._outbox.after_slot,
            idle=self._outbox.wait,
            realtime_priority=config.realtime_priority,
        )

    def __enter__(self) -> RobotHost:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def connected(self) -> bool:
        return self._outbox.connected

    @property
    def reconnects(self) -> int:
        """Streams that failed (or could not be opened) since start."""
        return self._outbox.reconnects

    @property
    def messages(self) -> int:
        """Answers (one per message the network process sent) since start."""
        return self._outbox.messages

    @property
    def network_pid(self) -> int | None:
        """The process id of the network process now serving the stream; None: none (the stream
        runs on the control thread, or its process is being replaced)."""
        return self._outbox.network_pid

    @property
    def network_restarts(self) -> int:
        """Times the network process ended and a new one was started."""
        return self._outbox.restarts

    def start(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Start the network process, wait (up to ``connect_timeout_s``) for its stream, start the
        loop. Once ``should_stop()``, it neither waits nor starts the loop: no robot is touched."""
        self._outbox.open()
        deadline = time.monotonic() + self.config.connect_timeout_s
        while not self._outbox.connected and time.monotonic() < deadline and not should_stop():
            self._outbox.wait(0.02)
        if should_stop():
            return
        if not self._outbox.connected:
            log.warning(
                "no stream to %s within %.1fs; the robots run on fallbacks until it connects",
                self.config.server,
                self.config.connect_timeout_s,
            )
            self._outbox.stepping_without_stream()
        # A full collection over the robots' heap (MuJoCo models, envs) stalls the
        # loop for milliseconds; moving what exists now out of the collector's
        # reach took the tick jitter p99 of 50 robots from ~2-3 ms to ~0.2 ms.
        gc.collect()
        gc.freeze()
        self._control.start()

    @property
    def control_error(self) -> BaseException | None:
        """Why the control loop ended, once it has: its last ticks e-stopped the robots (see
        :class:`~edgerl.watchdog.loop.ControlLoop`); a caller should stop the host then."""
        error: BaseException | None = self._control.error
        return error

    def stop(self) -> None:
        """Stop the control loop (robots get no further action), then end the network process."""
        self._control.stop()
        self._outbox.close()
        for link in self.links:
            link.robot.close()

    def stats(self, percentiles: bool = True) -> list[dict[str, Any]]:
        """Each robot's :meth:`RobotLink.stats` (without its percentiles: NaN, unless ``percentiles``)."""
        return [link.stats(percentiles) for link in self.links]

    def latencies_ms_p50(self) -> list[float]:
        """Each robot's median latency (ms; NaN before its first answer): what the status line needs
        of the percentiles, at a sixth of their cost."""
        return [link.latencies_s.percentile_ms(50) for link in self.links]

    def stream_stats(self) -> dict[str, Any]:
        """The stream: up or not, streams that failed (or could not be opened), answers, and (with
        a network process) how often that process was replaced."""
        return {
            "connected": self.connected,
            "reconnects": self.reconnects,
            "messages": self.messages,
            "network_restarts": self.network_restarts,
        }
