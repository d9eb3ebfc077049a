"""``edgerl train``: edge server, sim workers and the PPO trainer on loopback.

Configuration is one :class:`RunConfig` (with the trainer's
:class:`~edgerl.trainer.config.TrainerConfig` under ``ppo``). Values come
from, in increasing priority: the dataclass defaults, a TOML file (``--config``,
or the tuned file shipped for the env in ``launch/configs/``), the command-line
flags, and ``--set key=value`` overrides (e.g. ``--set ppo.learning_rate=1e-3``).
A resumed run starts from its own ``config.json`` instead of the first two.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import sys
import time
import tomllib
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgerl.edge_server.server import ServerConfig
from edgerl.edge_server.transitions import TransitionConfig
from edgerl.launch import jsonout, run_metrics
from edgerl.launch.processes import (
    LLM_PRESET,
    PolicySpec,
    ServerLostError,
    ServerProcess,
    WorkerError,
    WorkerFleet,
    build_mlp,
    check_dtype,
    check_fleet,
    fleet_groups,
    largest_request,
    llm_model_dir,
    on_stop_signals,
)
from edgerl.launch.progress import advance, step_bar
from edgerl.launch.run_metrics import FleetFigures, TrainerFigures
from edgerl.proto.settings import check_finite
from edgerl.robot_client import errors
from edgerl.robot_client.sim_worker import SimWorkerConfig
from edgerl.trainer.config import TrainerConfig
from edgerl.trainer.runfiles import RunFilesError, writing

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DEMO_ENV = "InvertedPendulum-v5"


@dataclass(frozen=True)
class RunConfig:
    """One training run. ``ppo.batch_steps`` is always ``envs * segment_steps``."""

    env: str = DEMO_ENV
    """Gymnasium id of the task."""
    envs: int = 16
    """Envs in total, split over the sim workers."""
    steps: int = 100_000
    """Env steps to learn from."""
    seed: int = 0
    """Seeds the initial weights, the envs (env i of the run gets seed*1000+i) and sampling."""
    policy: str = "mlp-small"
    """Network preset (``mlp-small``, ``mlp``, ``mlp-large``), or ``llm``: a language model
    served by vLLM and trained over its action tokens."""
    model: str = ""
    """Local model folder of ``policy = "llm"``; empty: the small random Llama built on first use."""
    dtype: str = "float32"
    """Engine dtype of ``policy = "llm"`` on the edge server (the trainer computes in float32:
    with bfloat16 the served log-probs it corrects with differ from its own more)."""
    log_std_init: float = 0.0
    """Initial log-std of an MLP policy's action noise (0: std 1; HalfCheetah learns far more
    reliably from -1, std 0.37)."""
    segment_steps: int = 32
    """Transitions per env per batch (the rollout length)."""
    workers: int = 1
    """Sim worker processes."""
    groups: int = 0
    """Env groups per worker (2: double-buffered; 0: two, or one where a worker has a single env)."""
    sync: bool = False
    """Lockstep baseline: every action from the newest weights, no overlap."""
    weight_sync_interval: int = 1
    """The edge server swaps in every k-th published version only."""
    run_dir: str = ""
    """Output folder; default runs/<env>-s<seed>-<time>."""
    ppo: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        check_finite(self)
        if self.groups < 0:
            raise ValueError(f"groups must be >= 0 (0: chosen by envs per worker), got {self.groups}")
        check_fleet(
            self.envs,
            self.workers,
            self.fleet_groups,
            max_envs_per_stream=ServerConfig.max_envs_per_stream,
        )
        if self.steps < 1 or self.segment_steps < 1:
            raise ValueError("steps and segment_steps must be >= 1")
        if self.model and self.policy != LLM_PRESET:
            raise ValueError(f"model: a model folder is for policy {LLM_PRESET!r}, not {self.policy!r}")
        check_dtype(self.dtype, self.policy)
        if self.log_std_init and self.policy == LLM_PRESET:
            raise ValueError(f"log_std_init: for the MLP policies; policy {LLM_PRESET!r} samples tokens")

    @property
    def fleet_groups(self) -> int:
        """The env groups per worker the run uses (``groups``, or for 0 the choice it leaves)."""
        return fleet_groups(self.groups, self.envs, self.workers)

    @property
    def batch_steps(self) -> int:
        return self.envs * self.segment_steps

    def resolved(self) -> RunConfig:
        """The config with the trainer's derived fields filled in."""
        ppo = dataclasses.replace(
            self.ppo,
            batch_steps=self.batch_steps,
            total_steps=self.steps,
            seed=self.seed,
            minibatch_size=min(self.ppo.minibatch_size, self.batch_steps),
        )
        return dataclasses.replace(self, ppo=ppo)


_KIND = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _coerce(cls: type, key: str, value: Any) -> Any:
    """``value`` (a string from the command line, or a TOML value) as the type of ``cls.key``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if key not in fields or key == "ppo":
        raise ValueError(f"{key}: unknown setting; known: {', '.join(sorted(fields))}")
    kind = type(fields[key].default)  # every setting has a default of its type
    if isinstance(value, str) and kind is not str:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{key}: expected true or false, got {value!r}")
            return value.lower() in ("true", "1")
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{key}: expected {_KIND[kind]}, got {value!r}") from None
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:  # a TOML true is no number, nor 1 a boolean
        raise ValueError(f"{key}: expected {_KIND[kind]}, got {value!r}")
    return value


def apply_overrides(cfg: RunConfig, values: Mapping[str, Any], source: str) -> RunConfig:
    """Apply ``{"envs": 64, "ppo": {"epochs": 4}}`` or ``{"ppo.epochs": "4"}`` to ``cfg``."""
    top: dict[str, Any] = {}
    ppo: dict[str, Any] = {}
    try:
        for key, value in values.items():
            if key == "ppo":
                if not isinstance(value, Mapping):
                    raise ValueError(f"ppo: expected a table of PPO settings ([ppo]), got {value!r}")
                ppo.update({k: _coerce(TrainerConfig, k, v) for k, v in value.items()})
            elif key.startswith("ppo."):
                k = key.removeprefix("ppo.")
                ppo[k] = _coerce(TrainerConfig, k, value)
            else:
                top[key] = _coerce(RunConfig, key, value)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    try:
        return dataclasses.replace(cfg, **top, ppo=dataclasses.replace(cfg.ppo, **ppo))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from None


def config_file_for(env: str, policy: str | None = None) -> Path | None:
    """The tuned config shipped for ``env`` (``<env>-llm.toml`` for the ``llm`` policy), if any."""
    path = CONFIG_DIR / (f"{env}-{LLM_PRESET}.toml" if policy == LLM_PRESET else f"{env}.toml")
    return path if path.exists() else None


def load_config(
    env: str | None,
    file: str | None,
    flags: Mapping[str, Any],
    sets: list[str],
    resume: str | Path | None = None,
) -> tuple[RunConfig, list[str]]:
    """Defaults, then the file, then explicit flags, then ``--set`` pairs. Returns (config, sources).

    With ``resume`` (the folder of a run to continue), the run's own ``config.json`` takes the
    place of the defaults and the env's tuned file: a resumed run keeps its settings, but for
    those given again (``--steps``, to train it further). Its env and policy cannot change.
    """
    if resume is None:
        cfg = RunConfig() if env is None else RunConfig(env=env)
        sources = ["defaults"]
        path = Path(file) if file else config_file_for(cfg.env, flags.get("policy"))
    else:
        saved = Path(resume) / "config.json"
        if not saved.exists():
            raise FileNotFoundError(f"--resume: no run in {resume} (it has no config.json)")
        cfg = apply_overrides(RunConfig(), json.loads(saved.read_text()), str(saved))
        for option, given, kept in (("--env", env, cfg.env), ("--policy", flags.get("policy"), cfg.policy)):
            if given is not None and given != kept:
                raise ValueError(f"{option} {given}: the run in {resume} trains {kept}")
        sources = [str(saved)]
        path = Path(file) if file else None
    if path is not None:
        if not path.exists():
            raise FileNotFoundError(f"--config: {path} does not exist")
        with path.open("rb") as fh:
            data = tomllib.load(fh)
        cfg = apply_overrides(cfg, data, str(path))
        sources.append(str(path))
    explicit = {k: v for k, v in flags.items() if v is not None}
    if explicit:
        cfg = apply_overrides(cfg, explicit, "command line")
        sources.append("flags")
    pairs: dict[str, str] = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value")
        pairs[key.strip()] = value.strip()
    if pairs:
        cfg = apply_overrides(cfg, pairs, "--set")
        sources.append("--set")
    return cfg.resolved(), sources


def _json_ready(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: _json_ready(v) for k, v in dataclasses.asdict(obj).items()}
    return obj


class _StopFlag:
    """The first Ctrl-C or SIGTERM asks for a clean stop (``handle``, under
    :func:`on_stop_signals`); a second one interrupts."""

    def __init__(self) -> None:
        self.set = False

    def handle(self, signum: int, frame: types.FrameType | None) -> None:
        if self.set:
            raise KeyboardInterrupt
        self.set = True


def _resume_hint(run_dir: Path) -> str:
    """How to go on with a run that failed, where it saved a checkpoint."""
    from edgerl.trainer.trainer import latest_checkpoint

    if latest_checkpoint(run_dir) is None:
        return ""
    return f"; its last checkpoint is in {run_dir} (edgerl train --run-dir {run_dir} --resume goes on)"


def run_training(
    cfg: RunConfig,
    *,
    resume: bool = False,
    progress: bool = True,
    log_level: str = "WARNING",
    metrics_port: int | None = None,
    metrics_host: str = "",
) -> dict[str, Any]:
    """Run one training job; returns its summary (also written to ``summary.json``).

    With ``metrics_port`` (0: a free one) the run answers ``GET /metrics`` on that port of
    ``metrics_host`` (default: the server's host, loopback): its server's counters and the
    learner's, then the sim workers' and the trainer's (:mod:`edgerl.launch.run_metrics`); it
    prints where."""
    import torch

    from edgerl.sim.envs import env_spec
    from edgerl.trainer.trainer import Trainer, latest_checkpoint

    cfg = cfg.resolved()
    spec = env_spec(cfg.env)  # an unknown env fails here, before the run folder is written
    run_dir = Path(cfg.run_dir or f"runs/{cfg.env}-s{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}")
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if resume and checkpoint is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {run_dir}")
    torch.set_num_threads(cfg.ppo.torch_threads)
    policy_spec = PolicySpec(
        env_name=cfg.env,
        preset=cfg.policy,
        seed=cfg.seed,
        compute_values=True,
        checkpoint=str(checkpoint or ""),
        model=cfg.model,
        log_std_init=cfg.log_std_init,
        dtype=cfg.dtype,
    )
    net: Any
    if cfg.policy == LLM_PRESET:
        from edgerl.models.llm_actor_critic import load_llm_actor_critic

        policy_spec = dataclasses.replace(policy_spec, model=llm_model_dir(policy_spec))
        net = load_llm_actor_critic(policy_spec.model, spec.act_low, spec.act_high)
    else:
        net = build_mlp(policy_spec, spec)  # the server builds its version 0 the same way
    batch = cfg.batch_steps
    learner = TransitionConfig(
        segment_steps=cfg.segment_steps,
        # Sims may run one window ahead of the batch being learned, no further: this bounds lag.
        max_pending_steps=batch * cfg.ppo.max_batches_ahead,
        overflow="block",
        sync_env_steps=cfg.segment_steps if cfg.sync else 0,
        weight_sync_interval=1 if cfg.sync else cfg.weight_sync_interval,
    )
    t_start = time.monotonic()
    # a group's step in one forward pass however many envs it holds (past the default batch, its
    # worker would split it in messages of 256 rows, each a forward pass of its own)
    rows = max(ServerConfig.max_batch_size, largest_request(cfg.envs, cfg.workers, cfg.fleet_groups))
    # the server's own metrics endpoint on loopback, for the run's to fetch when scraped
    served_metrics = None if metrics_port is None else 0
    server_cfg = ServerConfig(port=0, max_batch_size=rows, learner=learner, metrics_port=served_metrics)
    run_info = {"env": cfg.env, "policy": cfg.policy, "model": policy_spec.model}
    metrics_info = {"env": cfg.env, "policy": cfg.policy, "mode": "sync" if cfg.sync else "async"}
    figures = TrainerFigures(metrics_info)
    fleet_figures = FleetFigures(run_metrics.fleet_info(cfg.env, cfg.envs, cfg.workers))
    with (
        ServerProcess(policy_spec, server_cfg, log_level=log_level) as server,
        run_metrics.serving(
            metrics_host or server_cfg.host,
            metrics_port,
            server.metrics_url,
            lambda: fleet_figures.exposition() + figures.exposition(),
            lambda line: print(f"edgerl: {line}", file=sys.stderr, flush=True),
        ),
    ):
        # the run folder once the server is up: a run that could not start leaves none behind
        run_dir.mkdir(parents=True, exist_ok=True)
        with writing(run_dir / "config.json"):
            (run_dir / "config.json").write_text(json.dumps(_json_ready(cfg), indent=2) + "\n")
        trainer = Trainer(cfg.ppo, net, server.address, run_dir, resume=resume, run_info=run_info)
        figures.begin(trainer.state)
        worker_cfg = SimWorkerConfig(
            server=server.address,
            env_name=cfg.env,
            num_envs=cfg.envs,
            groups=cfg.fleet_groups,
            seed=cfg.seed * 1000,
            session_id=f"train-s{cfg.seed}",
            timeout_s=300.0,  # steps wait for the trainer by design (backpressure, sync mode)
        )
        start_steps = trainer.state.env_steps
        stop = _StopFlag()
        with WorkerFleet(worker_cfg, cfg.workers, log_level=log_level) as fleet, on_stop_signals(stop.handle):
            fleet_figures.attach(fleet)
            # Any worker, not every one: the first up may fill the server's window (admission
            # control) before the others connect; they step once the trainer takes a batch.
            fleet.wait_started(every=False, should_stop=lambda: stop.set)
            t0 = time.monotonic()
            bar = step_bar(f"train {cfg.env}", cfg.steps, start_steps, disable=not progress)

            def on_update(scalars: dict[str, float]) -> None:
                figures.on_update(trainer.state, scalars)
                fleet.poll_episodes()
                fleet_figures.look()
                fleet.check()
                advance(bar, trainer.state.env_steps)
                recent = fleet.episodes.last_returns(20)
                bar.set_postfix(
                    ret=f"{statistics.fmean(recent):.1f}" if recent else "-",
                    v=trainer.state.version,
                    lag=f"{scalars['staleness/lag_mean']:.2f}",
                )

            def should_stop() -> bool:
                """Polled while the trainer takes transitions (per segment, and every 0.2 s while
                none comes; ~2.4 us): a server or a worker that ended ends the run, which would
                otherwise wait for it for good."""
                server.check()
                fleet.check()
                return stop.set

            try:
                try:
                    state = trainer.run(should_stop, on_update)
                except errors.EdgeRLError:  # a call that failed because the server is gone says so
                    server.check(wait_s=1.0)
                    raise
            except (ServerLostError, WorkerError, errors.EdgeRLError, RunFilesError) as exc:
                if hint := _resume_hint(run_dir):
                    exc.add_note(hint)  # the command line prints it after the error
                raise
            finally:
                bar.close()
            wall = time.monotonic() - t0
    episodes = fleet.episodes
    first, last = episodes.first_returns(20), episodes.last_returns(20)
    learned = state.env_steps - start_steps
    summary: dict[str, Any] = {
        "env": cfg.env,
        "seed": cfg.seed,
        "mode": "sync" if cfg.sync else "async",
        "env_steps": state.env_steps,
        "updates": state.updates,
        "policy_version": state.version,
        "wall_s": round(wall, 2),
        "total_s": round(time.monotonic() - t_start, 2),
        "steps_per_s": round(learned / wall, 1) if wall > 0 else 0.0,
        "episodes": episodes.count,
        "worker_steps": fleet.worker_steps(),
        "return_first20": round(statistics.fmean(first), 2) if first else None,
        "return_last20": round(statistics.fmean(last), 2) if last else None,
        "stale_fraction": round(state.masked_stale / max(1, state.env_steps), 5),
        "lag_mean": round(trainer.lag.mean, 3),
        "lag_max": trainer.lag.max,
        "interrupted": stop.set,
        "run_dir": str(run_dir),
    }
    with writing(run_dir / "summary.json"):
        jsonout.write_json(summary, str(run_dir / "summary.json"))
    return summary
