"""A sim worker: a group of MuJoCo envs streaming to the edge server.

The worker splits its envs into ``groups`` (two by default) and keeps one
message per group in flight: while the server computes actions for one half,
the worker steps the other. Env stepping thereby overlaps inference, network
and the other half's gRPC work (double buffering).

With ``network_process`` the Act stream runs in a child process of the
worker's own (:mod:`edgerl.robot_client.netproc`, as for a robot host's), and
the worker only steps envs and moves arrays over a Unix socket: the gRPC
client's work (~0.3 ms of CPU per message here) leaves the worker's core.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import random
import socket
import subprocess
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from edgerl.proto import frames
from edgerl.proto.settings import check_backoff, check_finite, check_socket_path
from edgerl.robot_client import errors, netproc
from edgerl.robot_client.client import ActStream, EdgeClient
from edgerl.robot_client.keeper import (
    StreamSettings,
    check_cpus,
    host_session_id,
    mid_episode_settings,
    row_slices,
    split_rows,
)
from edgerl.robot_client.security import ClientSecurity, check_target
from edgerl.sim.envs import make_vector_env

log = logging.getLogger(__name__)

ENDING_GRACE_S = 0.2
"""How long a network process whose socket closed is given to exit before it is killed."""


@dataclass(frozen=True)
class SimWorkerConfig:
    """One sim worker process."""

    server: str
    """Edge server address, host:port."""
    env_name: str = "HalfCheetah-v5"
    """Gymnasium id of the envs."""
    num_envs: int = 32
    """Envs in this worker."""
    groups: int = 2
    """Env groups with one message in flight each; 2 = double-buffered, 1 = lockstep."""
    seed: int = 0
    """Env i is seeded ``seed + i``."""
    session_id: str = ""
    """Stream identity; default ``<host>/<pid>``."""
    timeout_s: float = 10.0
    """Deadline for each answer from the server (seconds). An answer overdue ends the stream, and
    the worker opens a new one on a new connection (a link that died without closing its
    connection delivers nothing), sending the unanswered rows again."""
    max_steps: int = 0
    """Stop after this many env steps (0: run until stopped)."""
    backoff_initial_s: float = 0.1
    """First reconnect delay after UNAVAILABLE or an overdue answer (seconds); doubles per failure."""
    backoff_max_s: float = 5.0
    """Longest reconnect delay (seconds)."""
    give_up_after_s: float = 60.0
    """Stop reconnecting after this long without a working stream (seconds)."""
    security: ClientSecurity | None = None
    """TLS files and token of the channel; None: plaintext, no token."""
    network_process: bool = False
    """Run the Act stream in a network process of the worker's own (joined by a Unix socket)
    instead of on the worker's thread: the worker's core then only steps envs."""
    cpus: tuple[int, ...] = ()
    """CPUs the worker process runs on (set by the worker process at start); empty: any."""
    network_cpus: tuple[int, ...] = ()
    """CPUs of the network process; empty: any."""
    local_socket: str = ""
    """Path of the edge server's local Act socket (``edgerl serve --local-socket``): stream over it
    instead of gRPC, as a worker on the server's machine may; ``server`` is then not used."""
    backfill: bool = False
    """Only fill the CPU time the server leaves idle: the worker process runs at idle CPU
    priority (``SCHED_IDLE``, set where it starts) and its stream tells the server not to wait
    for it (``StreamHello.backfill``), so it slows neither the server nor other workers."""

    def __post_init__(self) -> None:
        check_finite(self)
        if self.num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {self.num_envs}")
        if not 1 <= self.groups <= self.num_envs:
            raise ValueError(f"groups must be in [1, num_envs={self.num_envs}], got {self.groups}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {self.max_steps}")
        check_backoff(self.backoff_initial_s, self.backoff_max_s)
        check_cpus(self, "cpus", "network_cpus")
        check_socket_path("local_socket", self.local_socket)
        if not self.local_socket:
            check_target(self.server)
        if self.local_socket and self.network_process:
            raise ValueError(
                "local_socket and network_process exclude each other: the local socket needs no gRPC"
            )


@dataclass
class WorkerProgress:
    """What a worker reports as it runs. ``episode_returns`` and ``episode_lengths`` hold the
    episodes finished since its owner last took them out (a fleet's worker process sends them on
    and clears both every 0.2 s): left there, a long run on an env with short episodes fills them
    with millions."""

    steps: int = 0
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    reconnects: int = 0
    last_policy_version: int = 0


class _Group:
    def __init__(self, env_name: str, ids: list[int], seed: int) -> None:
        self.env_name = env_name
        self.ids = ids
        self._ids32 = np.asarray(ids, np.int32)  # the ids as every O frame carries them
        self.envs, self.obs = make_vector_env(env_name, len(ids), seed)
        # The envs' own action space: every answer is checked and clipped against it, whatever
        # the transport (a network process or the local socket asks no Describe).
        spec = self.envs.spec()
        self.act_low, self.act_high = spec.act_low, spec.act_high
        n = len(ids)
        self.rewards = np.zeros(n, np.float32)
        self.terminated = np.zeros(n, bool)
        self.truncated = np.zeros(n, bool)
        self.ep_return = np.zeros(n, np.float64)
        self.ep_length = np.zeros(n, np.int64)
        self.resetting = np.zeros(n, bool)
        self.obs_index = np.zeros(n, np.uint64)
        """Each env's number for its next request (``StepObservation.obs_index``): its steps so
        far, as the group's envs step together; a request sent again on a new stream keeps it."""

    def messages(self, max_rows: int) -> int:
        """Messages a step of the group takes: its rows, ``max_rows`` (the server's
        ``max_batch_size``) at most to a message."""
        return -(-len(self.ids) // max_rows)

    async def send(self, stream: ActStream, max_rows: int) -> None:
        """Send the group's step, in :meth:`messages` messages."""
        for rows in row_slices(len(self.ids), max_rows):
            await stream.send(
                self.ids[rows],
                self.obs[rows],
                self.rewards[rows],
                self.terminated[rows],
                self.truncated[rows],
                obs_index=self.obs_index[rows],
            )

    async def receive(self, stream: ActStream, max_rows: int) -> tuple[np.ndarray, int]:
        """The answer to the group's step: the actions of its messages' answers, joined, and the
        policy version of the last."""
        answers = [await stream.recv() for _ in range(self.messages(max_rows))]
        actions = answers[0].actions if len(answers) == 1 else np.concatenate([a.actions for a in answers])
        return actions, answers[-1].policy_version

    def rows(self) -> frames.ObsRows:
        flags = np.zeros((len(self.ids), 3), np.uint8)
        flags[:, 0], flags[:, 1] = self.terminated, self.truncated
        return frames.ObsRows(self._ids32, self.obs, self.rewards, flags, self.obs_index)

    def step(self, actions: np.ndarray, progress: WorkerProgress) -> None:
        """Step the envs on the server's ``actions``, clipped to the envs' action space.

        Raises:
            PolicyMismatchError: the actions are not of the envs' shape (a server of another
                env's policy that does not name its env in ``Describe``, met over the local socket,
                which has no ``Describe``).
        """
        if actions.shape[1:] != self.act_low.shape:
            raise errors.PolicyMismatchError(
                f"the server answers actions of shape {actions.shape[1:]}, "
                f"{self.env_name} takes {self.act_low.shape}"
            )
        actions = np.clip(actions, self.act_low, self.act_high)
        self.obs, self.rewards, self.terminated, self.truncated = self.envs.step(actions)
        self.obs_index = self.obs_index + 1  # a new array: a frame or message may hold the last one
        # NEXT_STEP autoreset: a reset step is no part of an episode. It reports reward 0, so
        # only its length needs the mask.
        self.ep_return += self.rewards
        self.ep_length += ~self.resetting
        done = self.terminated | self.truncated
        if done.any():
            progress.episode_returns.extend(self.ep_return[done].tolist())
            progress.episode_lengths.extend(self.ep_length[done].tolist())
            self.ep_return[done] = 0.0
            self.ep_length[done] = 0
        self.resetting = done
        progress.steps += len(self.ids)

    def close(self) -> None:
        self.envs.close()


class SimWorker:
    """Runs envs against an edge server until stopped, reconnecting on UNAVAILABLE."""

    def __init__(self, config: SimWorkerConfig, progress: WorkerProgress | None = None) -> None:
        self.config = cfg = config
        self.progress = progress or WorkerProgress()
        self.session_id = cfg.session_id or host_session_id()
        bounds = [cfg.num_envs * i // cfg.groups for i in range(cfg.groups + 1)]
        self._groups = [
            _Group(cfg.env_name, list(range(lo, hi)), cfg.seed + lo) for lo, hi in itertools.pairwise(bounds)
        ]
        self._obs_shape = self._groups[0].obs.shape[1:]
        self._act_shape = self._groups[0].act_low.shape
        self._answered = False

    def close(self) -> None:
        for g in self._groups:
            g.close()

    def _done(self, should_stop: Callable[[], bool]) -> bool:
        cfg = self.config
        return should_stop() or (cfg.max_steps > 0 and self.progress.steps >= cfg.max_steps)

    async def run(self, should_stop: Callable[[], bool] = lambda: False) -> WorkerProgress:
        """Step the envs until ``should_stop()`` or ``max_steps``; returns the progress.

        With ``network_process`` or ``local_socket`` this runs :meth:`run_blocking` (in a
        thread, so that the event loop stays free); a worker process of its own calls that
        directly.

        Raises:
            ServerUnavailableError: no working stream for ``give_up_after_s`` (streams that the
                server ends with UNAVAILABLE, or whose answers are overdue, are retried until then).
            RpcError: any other failure (named by its gRPC code).
        """
        cfg = self.config
        if cfg.network_process or cfg.local_socket:
            cancelled = False
            try:
                return await asyncio.to_thread(self.run_blocking, lambda: cancelled or should_stop())
            except asyncio.CancelledError:
                cancelled = True  # the thread stops within its next wait (0.1 s)
                raise
        backoff = cfg.backoff_initial_s
        loop = asyncio.get_running_loop()
        failing_since: float | None = None
        while not self._done(should_stop):
            try:
                async with EdgeClient(cfg.server, timeout_s=cfg.timeout_s, security=cfg.security) as client:
                    if not await client.wait_ready(should_stop=lambda: self._done(should_stop)):
                        break
                    info = await client.describe_for(self._obs_shape, cfg.env_name, act_shape=self._act_shape)
                    # A group of more envs than the server's batch holds steps in several messages.
                    max_rows = info.max_batch_size or cfg.num_envs  # 0: a server that says none
                    stream = await client.open_stream(
                        session_id=self.session_id,
                        num_envs=cfg.num_envs,
                        obs_shape=self._obs_shape,
                        env_name=cfg.env_name,
                        max_inflight=sum(g.messages(max_rows) for g in self._groups),
                        backfill=cfg.backfill,
                        mid_episode=self.progress.steps > 0,
                        resumes=True,  # every stream starts by sending each group's rows (again)
                    )
                    self._answered = False
                    # Stops promptly even while an answer is pending (e.g. held by backpressure).
                    await self._unless_stopped(self._pump(stream, max_rows, should_stop), should_stop)
                    await stream.close()
                    return self.progress
            except errors.BROKEN_STREAM as exc:
                now = loop.time()
                if self._answered or failing_since is None:  # the last stream worked: start afresh
                    failing_since, backoff, self._answered = now, cfg.backoff_initial_s, False
                if now - failing_since > cfg.give_up_after_s:
                    raise errors.ServerUnavailableError(
                        f"no working stream to {cfg.server} for {cfg.give_up_after_s:.0f}s ({exc.details})"
                    ) from exc
                if self._done(should_stop):
                    break
                delay = backoff * random.uniform(0.5, 1.0)
                log.warning("stream to %s failed (%s); reconnecting in %.2fs", cfg.server, exc, delay)
                self.progress.reconnects += 1
                await self._unless_stopped(asyncio.sleep(delay), should_stop)
                backoff = min(backoff * 2, cfg.backoff_max_s)
        return self.progress

    async def _unless_stopped(self, aw: Awaitable[object], should_stop: Callable[[], bool]) -> None:
        """Await ``aw`` unless the worker is done first (asked every 0.1 s), cancelling it then;
        raises its exception if it failed. A stop does not wait for a reconnect delay or a
        pending answer. (The wait for the server asks ``should_stop`` itself: a health check
        cancelled in flight can complete into a closed event loop, see ``EdgeClient.wait_ready``.)
        """
        task = asyncio.ensure_future(aw)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.1)
                if not task.done() and self._done(should_stop):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    return
            task.result()
        finally:
            if not task.done():
                task.cancel()

    async def _pump(self, stream: ActStream, max_rows: int, should_stop: Callable[[], bool]) -> None:
        # The groups are kept in the order of their messages, the oldest first: a new stream sends
        # their rows (again) in the order they were sent on the one before (see run_blocking).
        groups, progress = self._groups, self.progress
        for g in groups:
            await g.send(stream, max_rows)
        while not self._done(should_stop):
            for _ in range(len(groups)):
                g = groups[0]
                actions, progress.last_policy_version = await g.receive(stream, max_rows)
                self._answered = True
                g.step(actions, progress)
                groups.append(groups.pop(0))
                await g.send(stream, max_rows)

    def run_blocking(
        self, should_stop: Callable[[], bool] = lambda: False, report: Callable[[], None] = lambda: None
    ) -> WorkerProgress:
        """:meth:`run` with the stream in a network process (``network_process``) or over the
        server's local Act socket (``local_socket``), on this thread.

        ``report`` is called about every 0.2 s. The network process (or the socket's end,
        :class:`_LocalEnd`) keeps the stream open and reconnects with backoff; every stream it
        opens, the worker sends each group's latest observations again (what was in flight on a
        failed stream is never answered).

        Raises:
            ServerUnavailableError: no working stream for ``give_up_after_s`` (a network
                process that keeps failing is one; streams that end with UNAVAILABLE, or whose
                answers are overdue, are retried until then).
            EdgeRLError: any other failure of the stream.
        """
        cfg = self.config
        groups, progress = self._groups, self.progress
        where = cfg.local_socket or cfg.server
        settings = StreamSettings.of(
            cfg,
            self.session_id,
            cfg.num_envs,
            self._obs_shape,
            act_shape=self._act_shape,
            env_name=cfg.env_name,
            backfill=cfg.backfill,
            resumes=True,  # every stream starts by sending each group's rows (again)
        )

        def stepped() -> bool:
            return progress.steps > 0

        net: _NetworkEnd | _LocalEnd = (
            _LocalEnd(cfg.local_socket, settings, stepped)
            if cfg.local_socket
            else _NetworkEnd(settings, stepped)
        )
        epoch = 0  # of the open stream; 0: none
        sent: deque[_Group] = deque()  # groups awaiting actions, in the order sent
        # The order a new stream sends the groups' rows in: as they were sent on the stream before
        # (the oldest first), so that each env's steps keep their order. A group sent out of turn
        # could be held by the sync-mode quota ahead of another's step that the batch still needs.
        order = list(groups)
        answered = _Rows()
        failing_since = time.monotonic()  # without a stream since; reset by a stream that answered
        since_up = False  # an answer came on the open stream
        last_failure = "no stream opened yet"
        next_report = 0.0
        try:
            while not self._done(should_stop):
                now = time.monotonic()
                if now >= next_report:
                    report()
                    next_report = now + 0.2
                if sent and answered.count >= len(sent[0].ids):
                    g = sent.popleft()
                    g.step(answered.take(len(g.ids)), progress)
                    net.send(epoch, g.rows())
                    sent.append(g)
                    continue
                if epoch == 0 and now - failing_since > cfg.give_up_after_s:
                    raise errors.ServerUnavailableError(
                        f"no working stream to {where} for {cfg.give_up_after_s:.0f}s ({last_failure})"
                    )
                payload = net.receive(0.1)
                kind = payload[:1]
                if kind == frames.ANSWER:
                    answer = frames.decode_answer(payload)
                    if answer.epoch == epoch:
                        answered.add(answer.actions)
                        progress.last_policy_version = answer.policy_version
                        since_up = True
                elif kind == frames.UP:
                    epoch = frames.decode_state(payload)
                    order = list(sent) or order
                    sent.clear()
                    answered = _Rows()
                    for g in order:
                        net.send(epoch, g.rows())
                        sent.append(g)
                elif kind == frames.DOWN:
                    down, error = netproc.decode_down(payload)
                    if not isinstance(error, errors.BROKEN_STREAM):
                        raise error
                    if down == epoch:
                        epoch = 0
                        order = list(sent) or order
                        sent.clear()
                    if since_up:  # the last stream worked: count the outage from now
                        failing_since, since_up = time.monotonic(), False
                    progress.reconnects += 1
                    last_failure = error.details
                    log.warning("stream to %s failed (%s); reconnecting", where, error.details)
        finally:
            net.close()
            report()
        return progress


class _Rows:
    """Actions answered and not yet handed to their group, in order."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self.count = 0

    def add(self, actions: np.ndarray) -> None:
        self._parts.append(actions)
        self.count += len(actions)

    def take(self, n: int) -> np.ndarray:
        rows = self._parts[0] if len(self._parts) == 1 else np.concatenate(self._parts)
        self._parts = [rows[n:]] if len(rows) > n else []
        self.count -= n
        return rows[:n]


class _NetworkEnd:
    """A sim worker's end of its network process: frames out, frames in (blocking).

    A network process that ends, or hangs (it is killed then), is replaced as a robot host's is:
    at once, or :data:`~edgerl.robot_client.netproc.RESTART_DELAY_S` after the one before it
    started. Its loss reaches the worker as a ``D`` frame (UNAVAILABLE) of the last stream it
    opened, and the new one's stream as a ``U`` frame, as a reconnect would; a worker that has
    no stream for ``give_up_after_s`` gives up.
    """

    def __init__(self, settings: StreamSettings, stepped: Callable[[], bool]) -> None:
        self._settings = settings
        self._stepped = stepped
        self._frames: deque[bytes] = deque()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._in = bytearray()
        self._heard_at: float | None = None  # the process's last word (or the first send); None until
        # the first send: a process that is starting up is not judged
        self._epoch = 0  # the last stream the process said was up
        self._started_at = -math.inf
        self._restart_at = 0.0
        self._start()

    def _start(self) -> None:
        self._sock, self._proc = netproc.spawn(self._settings.cpus)
        self._sock.setblocking(True)
        self._in.clear()
        self._heard_at, self._epoch, self._started_at = None, 0, time.monotonic()
        with contextlib.suppress(OSError):  # it ended at once: seen by the next receive
            self._sock.sendall(netproc.encode_settings(mid_episode_settings(self._settings, self._stepped())))

    def send(self, epoch: int, rows: frames.ObsRows) -> None:
        """Send ``rows`` to the network process (dropped while it is being replaced: the worker
        sends every group's rows again on the new one's first stream)."""
        if self._sock is None:
            return
        if self._heard_at is None:
            self._heard_at = time.monotonic()
        try:
            self._sock.sendall(frames.encode_obs(epoch, rows))
        except OSError:  # the process is gone: a broken pipe, or a reset connection
            self._ended()

    def receive(self, timeout_s: float) -> bytes:
        """The next frame, or b"" if none came within ``timeout_s`` (heartbeats are taken in here)."""
        if not self._frames:
            if self._sock is None:
                self._restart(timeout_s)
            else:
                self._read(timeout_s)
        return self._frames.popleft() if self._frames else b""

    def _restart(self, timeout_s: float) -> None:
        wait = self._restart_at - time.monotonic()
        if wait > 0:
            time.sleep(min(wait, timeout_s))
            return
        self._start()

    def _read(self, timeout_s: float) -> None:
        assert self._sock is not None
        try:
            got = frames.read_frames(self._sock, self._in, timeout_s)
        except OSError:  # a process killed with data unread resets the socket
            got = None
        if got is None:
            self._ended()
            return
        now = time.monotonic()
        if not got:
            if self._heard_at is not None and now - self._heard_at > netproc.HUNG_AFTER_S:
                self._lost(
                    f"said nothing for {now - self._heard_at:.1f}s, heartbeats included: killed as hung"
                )
            return
        if self._heard_at is not None:
            self._heard_at = now
        for payload in got:
            kind = payload[:1]
            if kind == frames.UP:
                self._epoch = frames.decode_state(payload)
            if kind != frames.HEARTBEAT:
                self._frames.append(payload)

    def _ended(self) -> None:
        """The process's socket closed or failed: it ended, or is killed (a process that closed
        its socket is of no more use, and the worker must not wait on it)."""
        assert self._proc is not None
        try:
            code = self._proc.wait(ENDING_GRACE_S)  # a process that ends closes its socket first
        except subprocess.TimeoutExpired:
            self._lost(f"closed its socket but still ran {ENDING_GRACE_S:g}s later: killed")
        else:
            self._lost(f"ended (exit code {code})")

    def _lost(self, why: str) -> None:
        """Kill the process if it still runs, report its stream failed, and replace it."""
        sock, proc, self._sock, self._proc = self._sock, self._proc, None, None
        if proc is not None:
            netproc.kill(proc)
        if sock is not None:
            sock.close()
        self._restart_at, when = netproc.next_start(self._started_at, time.monotonic())
        details = f"the sim worker's network process {why}; a new one starts {when}"
        self._frames.append(frames.failure_payload(self._epoch, "UNAVAILABLE", details))

    def close(self) -> None:
        if self._sock is not None and self._proc is not None:
            netproc.stop(self._sock, self._proc)
            self._sock = self._proc = None


class _LocalEnd:
    """A sim worker's end of the edge server's local Act socket (``local_socket``).

    It gives :meth:`SimWorker.run_blocking` the frames a network process would: ``U`` with a
    new epoch for every connection the server accepted, ``D`` for every one that failed (or
    could not be made: UNAVAILABLE, retried with backoff), ``A`` for each frame's actions.
    An answer, or the server's acceptance of a new connection, later than ``timeout_s`` fails
    the stream with DEADLINE_EXCEEDED.
    """

    def __init__(self, path: str, settings: StreamSettings, stepped: Callable[[], bool]) -> None:
        self._path = path
        self._settings = settings
        self._stepped = stepped
        self._sock: socket.socket | None = None
        self._epoch = 0
        self._up = False  # the server accepted the open connection's settings
        self._retry_at = 0.0
        self._backoff = settings.backoff_initial_s
        self._in = bytearray()
        self._frames: deque[bytes] = deque()
        self._sent: deque[float] = deque()  # when each unanswered frame of rows went out
        self._connected_at = 0.0
        self._max_rows = 0  # the most rows a frame may hold, as the server's U frame says; 0: any

    def send(self, epoch: int, rows: frames.ObsRows) -> None:
        """Send a group's rows: in frames of at most the server's ``max_batch_size`` rows, as its
        ``U`` frame says, whose answers (an ``A`` frame each) the worker joins."""
        if self._sock is None or not self._up or epoch != self._epoch:
            return  # for a stream that is gone: never answered, as with a network process
        try:
            for part in split_rows(rows, self._max_rows or len(rows.env_ids)):
                self._sock.sendall(frames.encode_obs(epoch, part))
                self._sent.append(time.monotonic())
        except OSError as exc:
            self._lost(f"the local socket {self._path} failed: {exc}")

    def receive(self, timeout_s: float) -> bytes:
        """The next frame, or b"" if none came within ``timeout_s``."""
        if not self._frames:
            if self._sock is None:
                self._connect(timeout_s)
            else:
                self._read(timeout_s)
        return self._frames.popleft() if self._frames else b""

    def _connect(self, timeout_s: float) -> None:
        wait = self._retry_at - time.monotonic()
        if wait > 0:
            time.sleep(min(wait, timeout_s))
            return
        self._epoch += 1  # each attempt: its D frame, or its stream's U and A frames
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self._path)
            sock.sendall(netproc.encode_settings(mid_episode_settings(self._settings, self._stepped())))
        except OSError as exc:
            sock.close()
            self._lost(f"cannot reach the local socket {self._path}: {exc}")
            return
        self._sock, self._up, self._connected_at = sock, False, time.monotonic()
        self._in.clear()

    def _read(self, timeout_s: float) -> None:
        assert self._sock is not None
        if self._sent:
            since: float | None = self._sent[0]
        elif not self._up:
            since = self._connected_at  # the server has not accepted the settings yet
        else:
            since = None
        deadline = None if since is None else since + self._settings.timeout_s
        wait = timeout_s if deadline is None else max(0.0, min(timeout_s, deadline - time.monotonic()))
        try:
            got = frames.read_frames(self._sock, self._in, wait)
        except OSError as exc:
            self._lost(f"the local socket {self._path} failed: {exc}")
            return
        if got is None:
            self._lost(f"the server closed the local socket {self._path}")
            return
        if not got and deadline is not None and time.monotonic() >= deadline:
            self._fail("DEADLINE_EXCEEDED", f"no answer within {self._settings.timeout_s:g}s")
            return
        for payload in got:
            kind = payload[:1]
            if kind == frames.ANSWER:
                if self._sent:
                    self._sent.popleft()
                self._frames.append(payload)
            elif kind == frames.UP:
                self._up, self._backoff = True, self._settings.backoff_initial_s
                self._max_rows = frames.decode_up_rows(payload)
                self._frames.append(frames.state_payload(frames.UP, self._epoch))
            elif kind == frames.DOWN:
                _, code, details = frames.decode_failure(payload)
                self._fail(code, details)
                return

    def _lost(self, details: str) -> None:
        self._fail("UNAVAILABLE", details)

    def _fail(self, code: str, details: str) -> None:
        """End the connection with a ``D`` frame; reconnect after the backoff."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._up = False
        self._sent.clear()
        self._frames.append(frames.failure_payload(self._epoch, code, details))
        self._retry_at = time.monotonic() + self._backoff * random.uniform(0.5, 1.0)
        self._backoff = min(2 * self._backoff, self._settings.backoff_max_s)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
