"""The ``GET /metrics`` of the commands that start sims: ``edgerl train``, ``rollout`` and ``sim``.

With ``--metrics-port PORT`` each answers, in its own process, with the counters of the server it
started (``edgerl_*``, as ``edgerl serve`` gives them, fetched from that server's own endpoint on
loopback when a scrape comes; ``sim`` starts none), followed by its own figures:

- ``edgerl rollout``, ``sim`` and ``train`` (before the trainer's): the sim workers'
  (``edgerl_sim_*``, :class:`FleetFigures`): the env steps of each worker process, the workers
  running, the episodes finished and the mean return of the last 20.
- ``edgerl train``, last: the trainer's (``edgerl_train_*``, :class:`TrainerFigures`): counters of the
  run since it began (a resumed run's earlier updates included): updates, env steps learned
  from, and the steps masked as stale, as fallback actions, and at autoresets; each scalar of
  the trainer's last update as a gauge, named after its key in ``metrics.jsonl`` and
  TensorBoard (``losses/approx_kl`` is ``edgerl_train_losses_approx_kl``; the ``server/`` keys
  are left out: the server's families carry them);
  ``edgerl_train_last_update_timestamp_seconds``, for an alert on a run that stopped learning
  (``time() - edgerl_train_last_update_timestamp_seconds > 600``), and ``edgerl_train_info``.
  All trainer values of one scrape are of one update: the trainer hands them over as one
  snapshot after each. Its counters appear once the trainer is built, at a resumed run's
  values: never at 0 first, which Prometheus would read as counters that rose by all the
  earlier run's at once.
"""

from __future__ import annotations

import contextlib
import re
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from edgerl.edge_server.metrics import MetricsServer, MetricsThread, family_lines

if TYPE_CHECKING:
    from edgerl.launch.processes import WorkerFleet
    from edgerl.trainer.trainer import TrainerState

TRAIN = "edgerl_train_"
SIM = "edgerl_sim_"
SIM_INFO = "The sim workers: their env, envs and worker processes."
SERVER_KEYS = "server/"
"""Trainer scalars under this prefix are the server's, which its own families carry."""
FETCH_TIMEOUT_S = 5.0
"""How long a scrape waits for the server's part (seconds)."""

COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("updates", "updates_total", "PPO updates made (a resumed run's earlier ones included)."),
    ("env_steps", "env_steps_total", "Env steps learned from (the run's global step)."),
    ("masked_stale", "masked_stale_total", "Env steps whose policy loss was masked as too stale."),
    ("masked_fallback", "masked_fallback_total", "Env steps masked because a fallback action was taken."),
    ("masked_autoreset", "masked_autoreset_total", "Env steps masked at an env's autoreset."),
)
"""Each counter of a training run: its ``TrainerState`` field, its name after :data:`TRAIN`, its help."""


def _text(lines: list[str]) -> str:
    return "\n".join(lines) + "\n"


def _info(prefix: str, what: str, info: Mapping[str, str]) -> list[str]:
    return family_lines(prefix + "info", "gauge", what, [("", dict(info), 1)])


def exposition(server_url: str, own: Callable[[], str]) -> str:
    """A command's ``GET /metrics``: the exposition of its server at ``server_url`` (its endpoint on
    loopback; "": the command started none), then ``own()``'s.

    Raises:
        OSError: the server's endpoint did not answer in :data:`FETCH_TIMEOUT_S` (the scrape gets
            a 500 naming why).
    """
    if not server_url:
        return own()
    try:
        with urllib.request.urlopen(server_url, timeout=FETCH_TIMEOUT_S) as reply:
            served: str = reply.read().decode()
    except OSError as exc:
        raise OSError(f"the server did not answer at {server_url}: {exc}") from exc
    return served + own()


@contextlib.contextmanager
def serving(
    host: str, port: int | None, server_url: str, own: Callable[[], str], say: Callable[[str], None]
) -> Iterator[None]:
    """For the block, ``GET /metrics`` on ``host:port`` (None: nothing served), on a thread of its
    own: the exposition of the server at ``server_url`` ("": none) and ``own()``'s
    (:func:`exposition`, called on that thread); ``say`` is told where.

    Raises:
        MetricsBindError: the port is in use, or ``host`` is not an address of this machine.
    """
    if port is None:
        yield
        return
    thread = MetricsThread(MetricsServer(lambda: exposition(server_url, own), host, port, "--metrics-host"))
    thread.start()
    say(f"metrics on {thread.server.url}")
    try:
        yield
    finally:
        thread.close()


def scalar_name(key: str) -> str:
    """The gauge of a trainer scalar: ``losses/approx_kl`` is ``edgerl_train_losses_approx_kl``."""
    return TRAIN + re.sub(r"[^A-Za-z0-9_]", "_", key)


class Snapshot(NamedTuple):
    """The trainer's figures after one update, read together by a scrape."""

    counters: dict[str, int]
    """The ``TrainerState`` field of each of :data:`COUNTERS` and its value."""
    scalars: dict[str, float]
    """The update's scalars, those of the server left out."""
    at: float | None
    """When the update ended (seconds since the epoch); None before the run's first."""


def trainer_exposition(snapshot: Snapshot | None, info: Mapping[str, str]) -> str:
    """The trainer's families in Prometheus's text format: its info alone before the trainer is
    built (``None``), its counters too before its first update, then all."""
    lines = _info(TRAIN, "The training run: its env, policy and mode.", info)
    if snapshot is None:
        return _text(lines)
    for field, name, help in COUNTERS:
        lines += family_lines(TRAIN + name, "counter", help, [("", {}, snapshot.counters[field])])
    if snapshot.at is not None:
        lines += family_lines(
            TRAIN + "last_update_timestamp_seconds",
            "gauge",
            "When the trainer's last update ended (seconds since the epoch).",
            [("", {}, snapshot.at)],
        )
        for key, value in sorted(snapshot.scalars.items()):
            help = f"The trainer's {key} at its last update, as in metrics.jsonl."
            lines += family_lines(scalar_name(key), "gauge", help, [("", {}, float(value))])
    return _text(lines)


class TrainerFigures:
    """A training run's own figures. Hand it the trainer's state once built (:meth:`begin`) and
    then each update (:meth:`on_update`); :meth:`exposition` may be called from another thread."""

    def __init__(self, info: Mapping[str, str]) -> None:
        self.info = dict(info)
        self.snapshot: Snapshot | None = None

    def begin(self, state: TrainerState) -> None:
        """Show the counters of the trainer just built (a resumed run's from its checkpoint)."""
        self.snapshot = Snapshot(_counters(state), {}, None)

    def on_update(self, state: TrainerState, scalars: Mapping[str, float]) -> None:
        """Take the figures of the update that just ended: the trainer's state and its scalars."""
        self.snapshot = Snapshot(  # one assignment: a scrape reads all of one update or all of the last
            _counters(state),
            {k: float(v) for k, v in scalars.items() if not k.startswith(SERVER_KEYS)},
            time.time(),
        )

    def exposition(self) -> str:
        return trainer_exposition(self.snapshot, self.info)


def _counters(state: TrainerState) -> dict[str, int]:
    return {field: int(getattr(state, field)) for field, _, _ in COUNTERS}


class FleetSnapshot(NamedTuple):
    """What a fleet's owner saw at its last look (:meth:`FleetFigures.look`)."""

    alive: int
    episodes: int
    return_last20: float | None


def fleet_exposition(
    worker_steps: Sequence[int], snapshot: FleetSnapshot | None, info: Mapping[str, str]
) -> str:
    """The sim workers' families in Prometheus's text format; the steps of each worker, labelled
    by its index, and, once the fleet was looked at, the rest."""
    lines = _info(SIM, SIM_INFO, info)
    lines += family_lines(
        SIM + "env_steps_total",
        "counter",
        "Env steps taken by each sim worker process.",
        [("", {"worker": str(i)}, steps) for i, steps in enumerate(worker_steps)],
    )
    if snapshot is not None:
        lines += family_lines(
            SIM + "workers_running", "gauge", "Sim worker processes running.", [("", {}, snapshot.alive)]
        )
        lines += family_lines(
            SIM + "episodes_total",
            "counter",
            "Episodes the sim workers finished.",
            [("", {}, snapshot.episodes)],
        )
        if snapshot.return_last20 is not None:
            lines += family_lines(
                SIM + "return_last20",
                "gauge",
                "Mean return of the last 20 episodes finished.",
                [("", {}, snapshot.return_last20)],
            )
    return _text(lines)


def fleet_info(env: str, envs: int, workers: int) -> dict[str, str]:
    """The labels of ``edgerl_sim_info``."""
    return {"env": env, "envs": str(envs), "workers": str(workers)}


class FleetFigures:
    """A fleet's figures: each worker's steps as they are when scraped (shared memory), the rest
    as its owner last looked (:meth:`look`, on the thread that polls the fleet's episodes). Before
    a fleet is attached (:meth:`attach`; ``edgerl rollout`` tries placements first), its info alone."""

    def __init__(self, info: Mapping[str, str]) -> None:
        self.info = dict(info)
        self.fleet: WorkerFleet | None = None
        self.snapshot: FleetSnapshot | None = None

    def attach(self, fleet: WorkerFleet) -> None:
        """Show ``fleet``'s figures from now on."""
        self.fleet, self.snapshot = fleet, None

    def look(self) -> None:
        """Take the fleet's workers running and its episodes, as they are now."""
        if self.fleet is None:
            return
        episodes = self.fleet.episodes
        last = episodes.last_returns(20)
        mean = sum(last) / len(last) if last else None
        self.snapshot = FleetSnapshot(self.fleet.alive(), episodes.count, mean)

    def exposition(self) -> str:
        fleet = self.fleet
        if fleet is None:
            return _text(_info(SIM, SIM_INFO, self.info))
        return fleet_exposition(fleet.worker_steps(), self.snapshot, self.info)
