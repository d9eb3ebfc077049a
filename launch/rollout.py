"""``edgerl rollout`` and ``edgerl sim``: run sim workers with a live progress bar."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from edgerl.launch.processes import WorkerFleet
from edgerl.launch.progress import advance, step_bar


def watch(
    fleet: WorkerFleet,
    *,
    seconds: float,
    steps: int,
    desc: str,
    start_timeout_s: float | None = 120.0,
    check: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Show progress until ``seconds`` pass, ``steps`` env steps are done, workers end, or Ctrl-C.

    Both count from the workers' first env steps, which may wait ``start_timeout_s`` (``None``:
    without limit) for the server: :meth:`WorkerFleet.wait_started`. ``check`` is called every
    half second beside the workers' own check, and raises to end the watch (the server's
    process ended, for one).

    Returns:
        A summary: the env steps the workers made, the wall time watched (from when their first
        steps were seen), the steps/s over that time, episodes and their mean return.
    """
    fleet.wait_started(start_timeout_s)
    t0 = time.perf_counter()
    s0 = fleet.total_steps()
    total = steps if steps > 0 else None
    interrupted = False
    # The bar counts the workers' steps from their first, as ``steps`` does: it ends full.
    with step_bar(desc, total, s0) as bar:
        try:
            while True:
                time.sleep(0.5)
                now, done = time.perf_counter(), fleet.total_steps()
                fleet.poll_episodes()
                recent = fleet.episodes.last_returns(20)
                advance(bar, done)
                bar.set_postfix(
                    episodes=fleet.episodes.count,
                    ret=f"{statistics.fmean(recent):.1f}" if recent else "-",
                )
                fleet.check()
                check()
                if (
                    (seconds > 0 and now - t0 >= seconds)
                    or (steps > 0 and done - s0 >= steps)
                    or fleet.alive() == 0
                ):
                    break
        except KeyboardInterrupt:
            interrupted = True
        wall = time.perf_counter() - t0
        fleet.stop()
        made = fleet.total_steps()  # with --steps N, N or more: the workers count from their first
        advance(bar, made)  # the steps made since the last look
    last = fleet.episodes.last_returns(20)
    return {
        "env_steps": made,
        "wall_s": round(wall, 2),
        "steps_per_s": round((made - s0) / wall, 1) if wall > 0 else 0.0,
        "episodes": fleet.episodes.count,
        "return_mean_last20": round(statistics.fmean(last), 2) if last else None,
        "interrupted": interrupted,
    }


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"{k:<22}{v}" for k, v in summary.items() if not isinstance(v, dict)]
    for k, v in summary.items():
        if isinstance(v, dict):
            lines.append(f"{k}:")
            lines.extend(f"  {kk:<20}{vv}" for kk, vv in v.items())
    return "\n".join(lines)
