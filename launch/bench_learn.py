"""``edgerl bench learn``: learning quality and speed of full training runs.

Each seed is one complete ``edgerl train`` job (fresh server, workers and
trainer). With ``--sync`` every seed also runs in synchronous lockstep mode,
side by side with the asynchronous default: the same steps, so returns compare
at equal env steps, and the wall-clock shows what the overlap buys.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from edgerl.launch.machine import SpeedProbe
from edgerl.launch.train import RunConfig, run_training


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    returns = [r["return_last20"] for r in runs if r["return_last20"] is not None]
    return {
        "return_mean": round(statistics.fmean(returns), 2) if returns else None,
        "return_std": round(statistics.pstdev(returns), 2) if returns else None,
        "steps_per_s": round(statistics.fmean(r["steps_per_s"] for r in runs), 1),
        "wall_s": round(statistics.fmean(r["wall_s"] for r in runs), 2),
        "stale_fraction": round(statistics.fmean(r["stale_fraction"] for r in runs), 5),
        "lag_mean": round(statistics.fmean(r["lag_mean"] for r in runs), 3),
        "per_seed": runs,
    }


def run(
    cfg: RunConfig, seeds: int, *, with_sync: bool, progress: Callable[[str], None] = lambda s: None
) -> dict[str, Any]:
    """Train ``seeds`` seeds (async, and sync too if ``with_sync``); returns the JSON summary."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    probe = SpeedProbe.start(progress)
    base = cfg.run_dir or f"runs/bench-learn-{cfg.env}-{time.strftime('%Y%m%d-%H%M%S')}"
    modes = ["async", "sync"] if with_sync else ["async"]
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for seed in range(cfg.seed, cfg.seed + seeds):
        for mode in modes:
            run_cfg = dataclasses.replace(
                cfg, seed=seed, sync=mode == "sync", run_dir=f"{base}/{mode}-s{seed}"
            )
            summary = run_training(run_cfg, progress=sys.stderr.isatty())
            progress(
                f"{mode} seed {seed}: return {summary['return_last20']}, "
                f"{summary['steps_per_s']:.0f} steps/s, {summary['wall_s']:.0f}s"
            )
            results[mode].append(summary)
    out: dict[str, Any] = {
        "bench": "learn",
        "env": cfg.env,
        "steps": cfg.steps,
        "seeds": seeds,
        "config": json.loads(json.dumps(dataclasses.asdict(cfg.resolved()))),
        **_aggregate(results["async"]),
    }
    if with_sync:
        sync = _aggregate(results["sync"])
        out["sync"] = sync
        out["ratios"] = {
            "async/sync steps_per_s": round(out["steps_per_s"] / sync["steps_per_s"], 3),
            "async/sync wall_s": round(out["wall_s"] / sync["wall_s"], 3),
        }
    out["machine"] = probe.machine()
    out["unix_time"] = int(time.time())
    return out


def format_table(result: dict[str, Any]) -> str:
    lines = [f"learn: {result['env']}, {result['steps']:,} steps x {result['seeds']} seed(s)"]
    rows = [("async", result)] + ([("sync", result["sync"])] if "sync" in result else [])
    lines.append(f"{'mode':<8}{'return mean':>12}{'std':>9}{'steps/s':>10}{'wall s':>9}{'stale':>9}")
    for name, r in rows:
        ret = "-" if r["return_mean"] is None else f"{r['return_mean']:.1f}"
        std = "-" if r["return_std"] is None else f"{r['return_std']:.1f}"
        lines.append(
            f"{name:<8}{ret:>12}{std:>9}{r['steps_per_s']:>10,.0f}{r['wall_s']:>9.1f}{r['stale_fraction']:>9.4f}"
        )
    return "\n".join(lines)
