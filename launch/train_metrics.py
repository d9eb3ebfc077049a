"""A training run's own figures for Prometheus, after its server's on one ``GET /metrics``.

``edgerl train --metrics-port PORT`` answers on ``PORT`` with the counters of the server the run
started (``edgerl_*``, as ``edgerl serve`` gives them, fetched from that server's own endpoint on
loopback when a scrape comes) followed by the trainer's (``edgerl_train_*``):

- counters of the run since it began (a resumed run's earlier updates included): updates, env
  steps learned from, and the steps masked as stale, as fallback actions, and at autoresets;
- each scalar of the trainer's last update as a gauge, named after its key in ``metrics.jsonl``
  and TensorBoard: ``losses/approx_kl`` is ``edgerl_train_losses_approx_kl``,
  ``charts/episodic_return`` is ``edgerl_train_charts_episodic_return``. The ``server/`` keys are
  left out: the server's families carry them;
- ``edgerl_train_last_update_timestamp_seconds``, for an alert on a run that stopped learning
  (``time() - edgerl_train_last_update_timestamp_seconds > 600``), and ``edgerl_train_info``.

All trainer values of one scrape are of the same update: the trainer hands them over as one
snapshot after each update (:meth:`TrainerMetrics.on_update`). The counters appear once the
trainer is built (:meth:`TrainerMetrics.begin`), at a resumed run's values: never at 0 first,
which Prometheus would read as counters that rose by all the earlier run's at once.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from edgerl.edge_server.metrics import family_lines

if TYPE_CHECKING:
    from edgerl.trainer.trainer import TrainerState

PREFIX = "edgerl_train_"
SERVER_KEYS = "server/"
"""Scalars under this prefix are the server's, which its own families carry."""
FETCH_TIMEOUT_S = 5.0
"""How long a scrape waits for the server's part (seconds)."""

COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("updates", "updates_total", "PPO updates made (a resumed run's earlier ones included)."),
    ("env_steps", "env_steps_total", "Env steps learned from (the run's global step)."),
    ("masked_stale", "masked_stale_total", "Env steps whose policy loss was masked as too stale."),
    ("masked_fallback", "masked_fallback_total", "Env steps masked because a fallback action was taken."),
    ("masked_autoreset", "masked_autoreset_total", "Env steps masked at an env's autoreset."),
)
"""Each counter of the run: its ``TrainerState`` field, its name after :data:`PREFIX`, its help."""


def scalar_name(key: str) -> str:
    """The gauge of a trainer scalar: ``losses/approx_kl`` is ``edgerl_train_losses_approx_kl``."""
    return PREFIX + re.sub(r"[^A-Za-z0-9_]", "_", key)


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
    lines = family_lines(
        PREFIX + "info", "gauge", "The training run: its env, policy and mode.", [("", dict(info), 1)]
    )
    if snapshot is None:
        return "\n".join(lines) + "\n"
    for field, name, help in COUNTERS:
        lines += family_lines(PREFIX + name, "counter", help, [("", {}, snapshot.counters[field])])
    if snapshot.at is not None:
        lines += family_lines(
            PREFIX + "last_update_timestamp_seconds",
            "gauge",
            "When the trainer's last update ended (seconds since the epoch).",
            [("", {}, snapshot.at)],
        )
        for key, value in sorted(snapshot.scalars.items()):
            help = f"The trainer's {key} at its last update, as in metrics.jsonl."
            lines += family_lines(scalar_name(key), "gauge", help, [("", {}, float(value))])
    return "\n".join(lines) + "\n"


class TrainerMetrics:
    """What a training run answers on ``GET /metrics``: its server's exposition, fetched from
    ``server_url`` (the server process's endpoint on loopback), then the trainer's. Hand it the
    trainer's state once built (:meth:`begin`) and then each update (:meth:`on_update`);
    :meth:`render` is called on the metrics thread."""

    def __init__(self, server_url: str, info: Mapping[str, str]) -> None:
        self.server_url = server_url
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

    def render(self) -> str:
        """The server's exposition and the trainer's.

        Raises:
            OSError: the server's endpoint did not answer in :data:`FETCH_TIMEOUT_S` (the scrape
                gets a 500 naming why).
        """
        try:
            with urllib.request.urlopen(self.server_url, timeout=FETCH_TIMEOUT_S) as reply:
                served: str = reply.read().decode()
        except OSError as exc:
            raise OSError(f"the run's server did not answer at {self.server_url}: {exc}") from exc
        return served + trainer_exposition(self.snapshot, self.info)


def _counters(state: TrainerState) -> dict[str, int]:
    return {field: int(getattr(state, field)) for field, _, _ in COUNTERS}
