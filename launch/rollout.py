"""``edgerl rollout`` and ``edgerl sim``: run sim workers with a live progress bar."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edgerl.launch.argtypes import config_from_args
from edgerl.launch.processes import LLM_PRESET, WorkerFleet
from edgerl.launch.progress import advance, step_bar

if TYPE_CHECKING:
    from edgerl.launch.bench_throughput import ThroughputConfig


PLACE_RULE, PLACE_TRIAL = "rule", "trial"
"""How ``edgerl rollout --place`` chooses: by the rule alone, or by the rule and a trial where it
leaves two placements of the stream (:func:`place`)."""


def place(
    a: argparse.Namespace, groups: int, say: Callable[[str], None]
) -> tuple[dict[str, Any], list[ThroughputConfig]]:
    """Settle ``edgerl rollout``'s placement options on ``a`` (``worker_cpus``,
    ``network_process``, ``backfill_envs``, ``replicas``; None or 0 where left unset), whose
    workers run ``groups`` env groups each as the options stand.

    With ``--place`` (``a.place``: :data:`PLACE_RULE` or :data:`PLACE_TRIAL`), those left unset
    are chosen as ``edgerl bench throughput`` chooses them: from how a short in-process run of
    the envs and the policy splits its time between env stepping and inference
    (:meth:`~edgerl.launch.bench_throughput.ThroughputConfig.placed`). With ``--transport local``
    the stream stays in the worker (there is no gRPC stream to move). With :data:`PLACE_TRIAL`,
    where the rule leaves the bench two placements of the stream (a backfill worker, or the
    stream in a network process: :func:`~edgerl.launch.bench_throughput.stream_candidates`),
    both are returned, to be tried on the server (:func:`try_placements`); ``a`` then holds the
    first. The rest, and all of them without ``--place``, are no placement: no pinning, the
    stream in the worker, no backfill worker, one replica. With the llm policy and ``--groups
    0``, the workers get a group per replica, as in the bench.

    Returns:
        With ``--place``, the in-process run's env steps/s and its inference time per
        env-stepping time, for the summary (:func:`placement_summary`); and the placements to try
        (none, or two).
    """
    from edgerl.launch import bench_throughput as bench

    measured: dict[str, Any] = {}
    to_try: list[ThroughputConfig] = []
    if a.place:
        llm_groups = a.policy == LLM_PRESET and not a.groups  # a group per replica, once chosen
        cfg = config_from_args(
            bench.ThroughputConfig,
            a,
            seconds=bench.PLACING_S,
            warmup_s=bench.PLACING_WARMUP_S,
            groups=0 if llm_groups else groups,
            network_process=False if a.transport == "local" else a.network_process,
        )
        say(
            f"placing the run: {a.envs} envs of {a.env} and policy {a.policy} in-process for "
            f"{bench.PLACING_WARMUP_S + bench.PLACING_S:g} s"
        )
        steps_per_s, env_s, inference_s = bench.run_sync_inprocess(cfg)
        candidates = bench.stream_candidates(cfg, env_s, inference_s, bench.inference_cpus())
        cfg = candidates[0]
        _adopt(a, cfg)
        a.groups = cfg.groups if llm_groups else a.groups
        share = inference_s / max(env_s, 1e-12)
        measured = {"inprocess_steps_per_s": round(steps_per_s, 1), "inference_per_env_s": round(share, 3)}
        say(
            f"placed: {bench.describe_placement(cfg)}, {cfg.replicas} policy replica(s) "
            f"(inference took {share:.2f}x the time of env stepping)"
        )
        if a.place == PLACE_TRIAL and len(candidates) > 1:
            to_try = candidates
            for other in candidates[1:]:
                say(f"to be tried on the server against: {bench.describe_placement(other)}")
    a.worker_cpus = a.worker_cpus or "off"
    a.network_process = bool(a.network_process)
    a.backfill_envs = a.backfill_envs or 0
    a.replicas = a.replicas or 1
    return measured, to_try


def _adopt(a: argparse.Namespace, cfg: ThroughputConfig) -> None:
    """Set ``a``'s placement options to those of ``cfg``, a placed config."""
    a.worker_cpus, a.network_process = cfg.worker_cpus, cfg.network_process
    a.backfill_envs, a.replicas = cfg.backfill_envs, cfg.replicas


def try_placements(
    a: argparse.Namespace, candidates: list[ThroughputConfig], address: str, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Where :func:`place` left two ``candidates``, run sim workers under each against the server
    at ``address`` as ``edgerl bench throughput`` tries its placements
    (:func:`~edgerl.launch.bench_throughput.try_placements`: runs of a few seconds, in ABBA
    order), and settle ``a``'s placement options on the one that made the most env steps/s.
    Nothing is run for fewer than two.

    Returns:
        Each candidate's placement and env steps/s (none where nothing was run).
    """
    from edgerl.launch import bench_throughput as bench

    if len(candidates) < 2:
        return []
    trial_s = bench.TRIAL_WARMUP_S + bench.TRIAL_S
    say(f"trying {len(candidates)} placements on the server, {trial_s:g} s a run after the workers start")
    best, tried = bench.try_placements(
        candidates, lambda c: bench.run_async_stream(c, address), say, what="the placement"
    )
    _adopt(a, best)
    say(f"placed by trial: {bench.describe_placement(best)}")
    return tried


def placement_summary(
    a: argparse.Namespace, measured: dict[str, Any], tried: list[dict[str, Any]]
) -> dict[str, Any]:
    """The summary's ``placement``: whether it was chosen, the placement options as they ran
    (``a``'s, once settled), what :func:`place` ``measured``, and what a trial ``tried`` (if
    any)."""
    return {
        "chosen": bool(a.place),
        "worker_cpus": a.worker_cpus,
        "network_process": a.network_process,
        "backfill_envs": a.backfill_envs,
        "replicas": a.replicas,
        **measured,
        **({"tried": tried} if tried else {}),
    }


def watch(
    fleet: WorkerFleet,
    *,
    seconds: float,
    steps: int,
    desc: str,
    start_timeout_s: float | None = 120.0,
    check: Callable[[], None] = lambda: None,
    look: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Show progress until ``seconds`` pass, ``steps`` env steps are done, workers end, or Ctrl-C.

    Both count from the workers' first env steps, which may wait ``start_timeout_s`` (``None``:
    without limit) for the server: :meth:`WorkerFleet.wait_started`. ``check`` is called every
    half second beside the workers' own check, and raises to end the watch (the server's
    process ended, for one); ``look`` each half second after the fleet's episodes were taken
    (:meth:`~edgerl.launch.run_metrics.FleetFigures.look`).

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
                look()
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
    """``summary`` as lines of key and value, its dicts after the rest, each indented under its key."""
    keys = [k for k, v in summary.items() if not isinstance(v, dict)]
    keys += [f"  {kk}" for v in summary.values() if isinstance(v, dict) for kk in v]
    width = max([22, *(len(k) + 2 for k in keys)])
    lines = [f"{k:<{width}}{v}" for k, v in summary.items() if not isinstance(v, dict)]
    for k, v in summary.items():
        if isinstance(v, dict):
            lines.append(f"{k}:")
            lines.extend(f"  {kk:<{width - 2}}{vv}" for kk, vv in v.items())
    return "\n".join(lines)
