"""Keeps a robot host's Act stream open: observations in, answers out, reconnects.

One :class:`StreamKeeper` serves a :class:`~edgerl.robot_client.runner.RobotHost`,
either on the host's control thread (its asyncio loop run between slots) or
in the host's network process (:mod:`edgerl.robot_client.netproc`). It sends
what was offered to it, all rows offered meanwhile in one message, and hands
each answer on in order; the owner matches answers to rows by position.
Every stream it opens has a new *epoch*; rows offered for another epoch than
the open stream's are dropped, so rows sent before a reconnect are never
answered on the next stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import random
import socket
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from edgerl.proto.frames import ObsRows
from edgerl.robot_client import errors
from edgerl.robot_client.client import Actions, ActStream, EdgeClient
from edgerl.robot_client.security import ClientSecurity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSettings:
    """Where the stream goes and how it behaves (sent to a network process as JSON)."""

    server: str
    session_id: str
    num_envs: int
    obs_shape: tuple[int, ...]
    timeout_s: float
    backoff_initial_s: float
    backoff_max_s: float
    security: dict[str, str] | None = None
    """:class:`ClientSecurity` fields; None: plaintext, no token."""
    log_level: int = logging.WARNING
    cpus: tuple[int, ...] = ()
    """CPUs a network process runs on; empty: any."""
    env_name: str = ""
    """Gymnasium id of the envs or robots behind the stream (empty: robots that run no gymnasium
    task); checked against the env the server's ``Describe`` names, where it names one."""
    act_shape: tuple[int, ...] | None = None
    """Shape of one action of the envs or robots behind the stream, checked against the
    server's; None: not checked."""
    backfill: bool = False
    """The stream only fills the server's idle time (``StreamHello.backfill``)."""
    heartbeat_s: float = 0.0
    """After how long without writing a frame a network process writes a heartbeat (seconds); 0:
    ``netproc.HEARTBEAT_S``."""
    mid_episode: bool = False
    """The envs or robots have stepped before the first stream opens (a network process that
    replaces one): every stream says so (``StreamHello.mid_episode``), as every one after the
    first does anyway."""
    resumes: bool = False
    """Each stream resumes where the one before left off (``StreamHello.resumes``): a sim
    worker's and a robot host's do, sending their unanswered requests again, numbered as before
    (``StepObservation.obs_index``)."""

    @classmethod
    def of(
        cls,
        link: _LinkConfig,
        session_id: str,
        num_envs: int,
        obs_shape: tuple[int, ...],
        *,
        act_shape: tuple[int, ...] | None = None,
        env_name: str = "",
        backfill: bool = False,
        resumes: bool = False,
    ) -> StreamSettings:
        """The settings of a stream that a robot host's or a sim worker's config describes."""
        return cls(
            server=link.server,
            session_id=session_id,
            num_envs=num_envs,
            obs_shape=tuple(obs_shape),
            timeout_s=link.timeout_s,
            backoff_initial_s=link.backoff_initial_s,
            backoff_max_s=link.backoff_max_s,
            security=dataclasses.asdict(link.security) if link.security is not None else None,
            log_level=logging.getLogger("edgerl").getEffectiveLevel(),
            cpus=tuple(link.network_cpus),
            env_name=env_name,
            act_shape=None if act_shape is None else tuple(act_shape),
            backfill=backfill,
            resumes=resumes,
        )


def mid_episode_settings(settings: StreamSettings, stepped: bool) -> StreamSettings:
    """``settings`` for a keeper (or local stream) that starts after the envs or robots stepped
    (``stepped``) or before."""
    return dataclasses.replace(settings, mid_episode=True) if stepped else settings


_host_sessions = itertools.count()


def host_and_pid() -> str:
    """``host/pid``: this process among all that talk to a server (a trainer's id, say)."""
    return f"{socket.gethostname()}/{os.getpid()}"


def host_session_id() -> str:
    """The session id of a client given none: its host and process id, new at each start, so
    that two clients (on two machines, or two runs on one) never share a session. The second
    and later ones in a process (two fleets a script starts, say) get ``host/pid.K``."""
    k = next(_host_sessions)
    return f"{host_and_pid()}.{k}" if k else host_and_pid()


def check_cpus(config: Any, *names: str) -> None:
    """Make the CPU fields ``names`` of a frozen ``config`` tuples of this process's CPUs, and
    check that ``network_cpus`` comes with ``network_process``.

    Raises:
        ValueError: naming the field.
    """
    if config.network_cpus and not config.network_process:
        raise ValueError("network_cpus needs network_process")
    allowed = os.sched_getaffinity(0)
    for name in names:
        cpus = tuple(getattr(config, name))
        object.__setattr__(config, name, cpus)
        if not set(cpus) <= allowed:
            raise ValueError(f"{name} {cpus} are not all among this process's CPUs {sorted(allowed)}")


class _LinkConfig(Protocol):
    """What :meth:`StreamSettings.of` reads of a client's config."""

    @property
    def server(self) -> str: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def backoff_initial_s(self) -> float: ...
    @property
    def backoff_max_s(self) -> float: ...
    @property
    def security(self) -> ClientSecurity | None: ...
    @property
    def network_cpus(self) -> tuple[int, ...]: ...


Part = TypeVar("Part")


class StreamKeeper(Generic[Part]):
    """Keeps the Act stream open until :attr:`stopping` is set.

    Args:
        settings: the stream's address, identity and timing.
        combine: the rows of the parts offered since the last message, in order (called once
            per message, so that a part costs nothing until it is sent).
        on_up: called with the epoch of each stream opened.
        on_down: called with the epoch and the error of each stream that failed (or could not
            be opened).
        on_answer: called with the epoch and each answer, in the order of the rows offered.
    """

    def __init__(
        self,
        settings: StreamSettings,
        combine: Callable[[list[Part]], ObsRows],
        on_up: Callable[[int], None],
        on_down: Callable[[int, errors.EdgeRLError], None],
        on_answer: Callable[[int, Actions], None],
    ) -> None:
        self.settings = settings
        self.combine = combine
        self.on_up, self.on_down, self.on_answer = on_up, on_down, on_answer
        self.epoch = 0
        self._mid_episode = settings.mid_episode  # the envs or robots stepped before its first stream
        self.stopping = asyncio.Event()
        self._live: asyncio.Queue[Part] | None = None

    def offer(self, epoch: int, part: Part) -> None:
        """Queue ``part`` for the open stream; dropped unless ``epoch`` is the open stream's."""
        if self._live is not None and epoch == self.epoch:
            self._live.put_nowait(part)

    def stepped(self) -> None:
        """The envs or robots stepped without a stream: every stream from now on says
        ``mid_episode``."""
        self._mid_episode = True

    async def run(self) -> None:
        """Keep the stream open, reconnecting with backoff and jitter."""
        cfg = self.settings
        security = ClientSecurity(**cfg.security) if cfg.security is not None else None
        rng = random.Random()
        backoff = cfg.backoff_initial_s
        while not self.stopping.is_set():
            # Each stream on a channel, and so a connection, of its own: where a link died
            # without closing (an answer overdue), the old connection is dead, and a stream
            # on the old channel would wait on it until the system's TCP timeout.
            client = EdgeClient(cfg.server, timeout_s=cfg.timeout_s, security=security,
                                reconnect_backoff_max_s=cfg.backoff_max_s)  # fmt: skip
            async with client:
                stream: ActStream | None = None
                try:
                    # A unary call first: auth and shape errors come back with their own status.
                    info = await client.describe_for(
                        cfg.obs_shape, cfg.env_name, act_shape=cfg.act_shape, owner="the robot host"
                    )
                    stream = await client.open_stream(
                        session_id=cfg.session_id,
                        num_envs=cfg.num_envs,
                        obs_shape=cfg.obs_shape,
                        env_name=cfg.env_name,
                        max_inflight=cfg.num_envs,
                        timeout_s=cfg.timeout_s,
                        backfill=cfg.backfill,
                        mid_episode=self._mid_episode or self.epoch > 0,
                        resumes=cfg.resumes,
                    )
                    self.epoch += 1
                    self._live = asyncio.Queue()
                    self.on_up(self.epoch)
                    backoff = cfg.backoff_initial_s
                    await self._serve(
                        stream,
                        self._live,
                        join=not info.sync_env_steps,
                        max_rows=info.max_batch_size or cfg.num_envs,  # 0: a server that says none
                    )
                except errors.EdgeRLError as exc:
                    self._live = None
                    if self.stopping.is_set():
                        break
                    self.on_down(self.epoch, exc)
                    level = logging.WARNING if backoff == cfg.backoff_initial_s else logging.DEBUG
                    log.log(level, "stream to %s failed (%s); reconnecting", cfg.server, exc)
                finally:
                    self._live = None
                    if stream is not None:
                        await stream.close()
            if not self.stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), backoff * rng.uniform(0.5, 1.0))
                backoff = min(2 * backoff, cfg.backoff_max_s)

    async def _serve(
        self, stream: ActStream, live: asyncio.Queue[Part], *, join: bool, max_rows: int
    ) -> None:
        pending: deque[int] = deque()
        sent = asyncio.Event()
        sender = asyncio.ensure_future(
            self._send_loop(stream, live, pending, sent, join=join, max_rows=max_rows)
        )
        stop_wait = asyncio.ensure_future(self.stopping.wait())
        try:
            while not self.stopping.is_set():
                if not pending:
                    sent.clear()
                    sent_wait = asyncio.ensure_future(sent.wait())
                    await asyncio.wait({sender, stop_wait, sent_wait}, return_when=asyncio.FIRST_COMPLETED)
                    sent_wait.cancel()
                    if sender.done():
                        sender.result()
                        return
                    continue
                answer = await stream.recv(self.settings.timeout_s)
                pending.popleft()
                self.on_answer(self.epoch, answer)
        finally:
            sender.cancel()
            stop_wait.cancel()

    async def _send_loop(
        self,
        stream: ActStream,
        live: asyncio.Queue[Part],
        pending: deque[int],
        sent: asyncio.Event,
        *,
        join: bool,
        max_rows: int,
    ) -> None:
        """Send what was offered: with ``join``, all parts offered meanwhile in one message; else
        each part in one of its own (a server in synchronous mode, ``ServerLimits.sync_env_steps``,
        holds a message whole while any of its envs is at its quota: joined, a sim worker's group
        at its quota held the other's step that the batch still needed, and the run stopped).
        A message holds at most ``max_rows`` rows, the server's ``max_batch_size``: the rest go in
        the next (a slot of 8 robots to a server of 4 rows a batch, or the slots a host that ran
        behind joins past 256, went as one message, which the server refused, ending the stream
        each time it opened)."""
        while True:
            parts = [await live.get()]
            while join and not live.empty():
                parts.append(live.get_nowait())
            for some in split_rows(self.combine(parts), max_rows):
                n = len(some.env_ids)
                await stream.send(
                    some.env_ids.tolist(),
                    some.obs.reshape(n, *self.settings.obs_shape),
                    some.rewards,
                    some.flags[:, 0],
                    some.flags[:, 1],
                    fallback=some.flags[:, 2],
                    obs_index=some.obs_index,
                )
                pending.append(n)
                sent.set()


_ROW_FIELDS = ("env_ids", "obs", "rewards", "flags", "obs_index")


def row_slices(total: int, max_rows: int) -> list[slice]:
    """Rows ``0`` to ``total`` in parts of at most ``max_rows``, in order: a message or frame
    each, for a server that takes ``max_rows`` per batch (its ``max_batch_size``)."""
    return [slice(start, start + max_rows) for start in range(0, total, max_rows)]


def split_rows(rows: ObsRows, max_rows: int) -> Iterator[ObsRows]:
    """``rows`` in the parts of :func:`row_slices` (``rows`` itself where it holds no more)."""
    total = len(rows.env_ids)
    if total <= max_rows:
        yield rows
        return
    for part in row_slices(total, max_rows):
        yield ObsRows(*(getattr(rows, f)[part] for f in _ROW_FIELDS))


def concat_rows(parts: list[ObsRows]) -> ObsRows:
    """The rows of ``parts``, in order, as one."""
    if len(parts) == 1:
        return parts[0]
    return ObsRows(*(np.concatenate([getattr(p, f) for p in parts]) for f in _ROW_FIELDS))
