"""The PPO trainer: takes batches from the edge server, learns, publishes weights.

One loop, in order: take ``batch_steps`` env steps of segments (the feed
has been receiving them meanwhile, up to the window), acknowledge them,
compute values and GAE, mask what must not drive the policy (stale beyond
``max_policy_lag``, fallback and autoreset steps), run the PPO epochs,
update the observation normaliser, publish the weights as ``version + 1``,
log, checkpoint. Sampling and inference never wait for this loop except
through the server's bounded buffer (admission control), or, in
synchronous mode, by design.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
import threading
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from torch import nn

from edgerl.launch import jsonout
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.proto.v1 import edge_pb2_grpc as pb_grpc
from edgerl.robot_client import errors
from edgerl.robot_client.keeper import host_and_pid
from edgerl.robot_client.security import ClientSecurity
from edgerl.trainer.config import TrainerConfig
from edgerl.trainer.feed import TransitionFeed, learner_channel, publish_weights
from edgerl.trainer.policies import TrainablePolicy, trainable
from edgerl.trainer.ppo import LossCoefs, gae, group_advantages, normalize_advantages, segment_positions
from edgerl.trainer.runfiles import RunFilesError, quiet_writer_threads, writing
from edgerl.trainer.segments import Batch, EpisodeTracker, RewardScaler, assemble
from edgerl.trainer.steps import Targets, minibatch_step

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest.pt"


class MetricsLog:
    """Per-update scalars to ``metrics.jsonl`` and TensorBoard, on one global-step axis."""

    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self._jsonl_path, self._tb_path = run_dir / "metrics.jsonl", run_dir / "tb"
        self._failed: set[Path] = set()
        with writing(self._jsonl_path):
            run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = self._jsonl_path.open("a", buffering=1)
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                before = set(threading.enumerate())
                with writing(self._tb_path):
                    self._tb = SummaryWriter(str(self._tb_path))
                quiet_writer_threads(set(threading.enumerate()) - before, f"TensorBoard ({self._tb_path})")
            except ImportError:  # pragma: no cover - tensorboard is a dependency
                log.warning("tensorboard is not installed; logging to metrics.jsonl only")

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """One line of ``scalars`` at ``step``. A non-finite value (the explained variance of
        returns that do not vary) is ``null`` in the file, which stays standard JSON.

        Raises:
            RunFilesError: a file could not be written.
        """
        with self._writing(self._jsonl_path):
            self._jsonl.write(jsonout.dumps({"global_step": step, "time": time.time(), **scalars}) + "\n")
        if self._tb is not None:
            with self._writing(self._tb_path):
                for k, v in scalars.items():
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        """Close the files (each, whatever the other did); raises :class:`RunFilesError` if one
        could not be written, unless :meth:`write` raised that already."""
        try:
            with self._writing(self._jsonl_path):
                self._jsonl.close()
        finally:
            if self._tb is not None:
                with self._writing(self._tb_path):
                    self._tb.close()

    @contextlib.contextmanager
    def _writing(self, path: Path) -> Iterator[None]:
        """:func:`writing`, said once a file: TensorBoard's writer raises its thread's failure
        again at each call, its close included."""
        try:
            with writing(path):
                yield
        except RunFilesError:
            if path in self._failed:
                return
            self._failed.add(path)
            raise


@dataclass
class LagSummary:
    """The policy lag of a trainer's updates (each batch's mean and max, in versions), summed as
    they come: its run's summary figures, in memory that does not grow with the run. (The trainer
    once kept every update's scalars for them: 1.6 KB an update, several a second.)"""

    updates: int = 0
    mean_sum: float = 0.0
    max: float = 0.0

    def add(self, scalars: dict[str, float]) -> None:
        """One more update's ``staleness/lag_mean`` and ``staleness/lag_max``."""
        self.updates += 1
        self.mean_sum += scalars["staleness/lag_mean"]
        self.max = max(self.max, scalars["staleness/lag_max"])

    @property
    def mean(self) -> float:
        """The mean over the updates of each batch's mean lag; 0.0 before the first."""
        return self.mean_sum / self.updates if self.updates else 0.0


@dataclass
class TrainerState:
    """Counters saved with checkpoints."""

    version: int = 0
    updates: int = 0
    env_steps: int = 0
    """Env steps taken into updates (the global step)."""
    masked_stale: int = 0
    masked_fallback: int = 0
    masked_autoreset: int = 0
    wall_s: float = 0.0


class Trainer:
    """PPO on transitions streamed by an edge server at ``server``.

    ``run_info`` (``env``, ``policy``, ``model``: what the policy was built for) goes into every
    checkpoint, so that ``edgerl serve --checkpoint`` can serve it without being told again.
    """

    def __init__(
        self,
        config: TrainerConfig,
        policy: nn.Module | TrainablePolicy,
        server: str,
        run_dir: str | Path,
        *,
        resume: bool = False,
        tensorboard: bool = True,
        security: ClientSecurity | None = None,
        run_info: Mapping[str, str] | None = None,
    ) -> None:
        self.config = cfg = config
        self.run_info = dict(run_info or {})
        self.security = security or ClientSecurity()
        torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(cfg.seed)
        self.policy = trainable(policy)
        self.server = server
        self.run_dir = Path(run_dir)
        self.scaler = RewardScaler(cfg.gamma) if cfg.normalize_rewards else None
        self.episodes = EpisodeTracker()
        self.state = TrainerState()
        self._rng = np.random.default_rng(cfg.seed)
        coefs = LossCoefs(
            clip=cfg.clip,
            value_coef=cfg.value_coef,
            entropy_coef=cfg.entropy_coef,
            clip_value=cfg.clip_value_loss,
            is_cap=cfg.is_cap,
        )
        self.minibatch_step = minibatch_step(
            self.policy,
            coefs,
            learning_rate=cfg.learning_rate,
            max_grad_norm=cfg.max_grad_norm,
            backend=cfg.update_backend,
        )
        if resume:
            path = latest_checkpoint(self.run_dir)
            if path is None:
                raise FileNotFoundError(f"--resume: no checkpoint under {self.run_dir / CHECKPOINT_DIR}")
            self.load_checkpoint(path)
        self.tensorboard = tensorboard
        self.feed: TransitionFeed | None = None
        self._channel: grpc.Channel | None = None
        self.lag = LagSummary()  # of the updates made since it was built

    @property
    def optimizer(self) -> Any:
        """The optimiser of the minibatch step (torch's Adam, or :class:`~edgerl.trainer.steps.FlatAdam`)."""
        return self.minibatch_step.optimizer

    # -- the loop ----------------------------------------------------------------------------------------
    def run(
        self,
        should_stop: Callable[[], bool] = lambda: False,
        on_update: Callable[[dict[str, float]], None] | None = None,
    ) -> TrainerState:
        """Train until ``total_steps`` env steps were learned from or ``should_stop()``."""
        cfg = self.config
        # first: a run dir it cannot write to fails before any channel or feed thread exists
        metrics = MetricsLog(self.run_dir, self.tensorboard)  # the run's: closed at its end
        self._channel = learner_channel(self.server, self.security)
        stub = pb_grpc.LearnerStub(self._channel)
        policy_stub = pb_grpc.EdgePolicyStub(self._channel)
        self.feed = feed = TransitionFeed(
            self.server,
            window_steps=cfg.batch_steps * cfg.max_batches_ahead,
            trainer_id=host_and_pid(),
            security=self.security,
        ).start()
        start = time.monotonic() - self.state.wall_s
        last_t, last_received = time.monotonic(), 0
        failed: BaseException | None = None
        try:
            while self.state.env_steps < cfg.total_steps and not should_stop():
                segments = feed.take(cfg.batch_steps, should_stop)
                if segments is None:
                    break
                batch = assemble(segments, self.scaler, self.episodes)
                feed.ack(batch.last_seq)
                t0 = time.monotonic()
                scalars = self.update(batch)
                update_s = time.monotonic() - t0
                self.state.version += 1
                resp = publish_weights(
                    stub, self.policy.served_state(), self.state.version, security=self.security
                )
                now = time.monotonic()
                scalars.update(
                    {
                        "perf/update_s": update_s,
                        "perf/learner_steps_per_s": batch.size / max(update_s, 1e-9),
                        "perf/sampler_steps_per_s": (feed.received_steps - last_received) / (now - last_t),
                        "perf/queue_steps": feed.queued_steps,
                        "perf/publish_swap_us": resp.swap_us,
                        "perf/duplicates_dropped": feed.dedupe.duplicates,
                        "charts/policy_version": self.state.version,
                        "charts/served_version": resp.policy_version,
                    }
                )
                scalars.update(self._server_counters(policy_stub))
                last_t, last_received = now, feed.received_steps
                self.state.wall_s = now - start
                metrics.write(self.state.env_steps, scalars)
                self.lag.add(scalars)
                if on_update is not None:
                    on_update(scalars)
                if cfg.checkpoint_every and self.state.updates % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
        except BaseException as exc:
            failed = exc
            raise
        finally:
            feed.close()
            self._channel.close()
            self._close_files(metrics, failed)
        return self.state

    def _close_files(self, metrics: MetricsLog, failed: BaseException | None) -> None:
        """The last checkpoint, then the metrics' files, each tried whatever the other did. A
        file that cannot be written is raised, or, where the run failed already, said in a note
        on that error (a full disk once had the final checkpoint's error take the place of the
        metrics' that had stopped the run)."""
        late: RunFilesError | None = None
        if self.state.updates:
            try:
                self.save_checkpoint()
            except RunFilesError as exc:
                late = exc
        try:
            metrics.close()
        except RunFilesError as exc:
            late = late or exc
        if late is not None:
            if failed is None:
                raise late
            failed.add_note(f"; and {late}")

    def _server_counters(self, stub: pb_grpc.EdgePolicyStub) -> dict[str, float]:
        try:
            st: pb.StatsResponse = stub.Stats(
                pb.StatsRequest(), timeout=5.0, metadata=self.security.metadata()
            )
        except grpc.RpcError as exc:
            log.warning("server stats unavailable: %s", errors.from_grpc(exc))
            return {}
        return {
            "server/transitions_pending": st.transitions_pending,
            "server/transitions_dropped_overflow": st.transitions_dropped_overflow,
            "server/transitions_dropped_disconnect": st.transitions_dropped_disconnect,
            "server/backpressure_wait_s": st.backpressure_wait_us / 1e6,
            "server/inference_us_p50": st.inference_us_p50,
        }

    # -- one update ----------------------------------------------------------------------------------------
    def update(self, batch: Batch) -> dict[str, float]:
        """One PPO update on ``batch``; returns the logged scalars."""
        cfg, pol, st = self.config, self.policy, self.state
        n = batch.size
        if cfg.anneal_lr:
            frac = max(0.0, 1.0 - st.env_steps / cfg.total_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.learning_rate * frac
        lag = st.version - batch.versions
        stale = lag > cfg.max_policy_lag
        policy_mask_np = ~(stale | batch.fallback | batch.autoreset)
        if cfg.baseline == "critic":
            v_ext = pol.values(batch.obs_ext)
            values = v_ext[batch.obs_index]
            next_values = v_ext[batch.next_index]
            value_mask_np = ~(stale | batch.autoreset)
            lam = cfg.gae_lambda
        else:  # no critic: plain discounted returns, nothing bootstrapped, no value loss
            values = next_values = np.zeros(n, np.float32)
            value_mask_np = np.zeros(n, bool)
            lam = 1.0
        adv, ret = gae(
            batch.rewards,
            values,
            next_values,
            terminated=batch.terminated,
            truncated=batch.truncated,
            segment_end=batch.segment_end,
            gamma=cfg.gamma,
            lam=lam,
        )
        if cfg.baseline == "group":
            adv = group_advantages(ret, segment_positions(batch.segment_end), policy_mask_np)

        obs = batch.obs_ext[batch.obs_index]
        pol.prepare(obs, batch.actions)
        pmask = policy_mask_np.astype(np.float32)
        vmask = value_mask_np.astype(np.float32)
        proximal = pol.log_probs(n).numpy() if cfg.decoupled else None

        sums: dict[str, float] = {}
        measured = 0
        stop_early = False
        per_epoch = range(0, n, cfg.minibatch_size)
        for _ in range(cfg.epochs):
            perm = self._rng.permutation(n)
            for lo in per_epoch:
                idx = perm[lo : lo + cfg.minibatch_size]
                last = lo == per_epoch[-1]
                m_p = pmask[idx]
                a = adv[idx]
                if cfg.normalize_advantages:
                    a = normalize_advantages(a, m_p)
                targets = Targets(
                    behaviour_log_probs=batch.log_probs[idx],
                    advantages=a,
                    old_values=values[idx],
                    returns=ret[idx],
                    policy_mask=m_p,
                    value_mask=vmask[idx],
                    proximal_log_probs=None if proximal is None else proximal[idx],
                )
                # diagnostics from each epoch's last minibatch
                stats = self.minibatch_step.step(idx, targets, with_stats=last)
                if last:
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + v
                    measured += 1
            if cfg.target_kl and stats["approx_kl"] > cfg.target_kl:
                stop_early = True
                break
        pol.observe(obs[~batch.autoreset])

        st.updates += 1
        st.env_steps += n
        st.masked_stale += int(stale.sum())
        st.masked_fallback += int(batch.fallback.sum())
        st.masked_autoreset += int(batch.autoreset.sum())
        var_ret = float(np.var(ret[value_mask_np])) if value_mask_np.any() else 0.0
        explained = (
            1.0 - float(np.var((ret - values)[value_mask_np])) / var_ret if var_ret > 0 else float("nan")
        )
        out = {f"losses/{k}": v / measured for k, v in sums.items()}
        recent = self.episodes.log.last_returns(20)
        out.update(
            {
                "losses/explained_variance": explained,
                "losses/learning_rate": self.optimizer.param_groups[0]["lr"],
                "losses/early_stop": float(stop_early),
                "staleness/lag_min": float(lag.min()),
                "staleness/lag_mean": float(lag.mean()),
                "staleness/lag_max": float(lag.max()),
                "staleness/masked_stale_fraction": float(stale.mean()),
                "staleness/masked_fallback_fraction": float(batch.fallback.mean()),
                "staleness/masked_autoreset_fraction": float(batch.autoreset.mean()),
                "charts/episodes": float(self.episodes.log.count),
                "charts/episodes_cut": float(self.episodes.cut),
            }
        )
        if recent:
            out["charts/episodic_return"] = float(np.mean(recent))
            out["charts/episodic_length"] = float(np.mean(self.episodes.log.last_lengths(20)))
        return out

    # -- checkpoints ------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Weights (normaliser included), optimiser, reward scaler, version and counters."""
        folder = self.run_dir / CHECKPOINT_DIR
        path = folder / f"ckpt-{self.state.version:08d}.pt"
        payload = {
            "policy": self.policy.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "state": dataclasses.asdict(self.state),
            "reward_rms": self.scaler.rms.state() if self.scaler else None,
            "config": dataclasses.asdict(self.config),
            "run": self.run_info,
            **self.policy.checkpoint_meta(),
        }
        tmp = path.with_suffix(".tmp")
        try:
            with writing(path):
                folder.mkdir(parents=True, exist_ok=True)
                # a Python file: a failed write raises its OSError, where torch's own C++ stream
                # said only "basic_ios::clear: iostream error"
                with open(tmp, "wb") as f:
                    torch.save(payload, f)
        except RunFilesError:
            tmp.unlink(missing_ok=True)  # half written: the last checkpoint stands
            raise
        with writing(path):
            tmp.replace(path)
            latest = folder / LATEST
            latest.unlink(missing_ok=True)
            latest.symlink_to(path.name)
            for old in sorted(folder.glob("ckpt-*.pt"))[: -self.config.keep_checkpoints]:
                old.unlink()
        return path

    def load_checkpoint(self, path: Path) -> None:
        payload = load_payload(path, self.policy.kind)
        self.policy.module.load_state_dict(payload["policy"])
        try:
            self.optimizer.load_state_dict(payload["optimizer"])
        except (ValueError, KeyError) as exc:
            raise ValueError(
                f"{path}: the optimizer state was saved by another update_backend than "
                f"{self.config.update_backend!r} ({exc}); resume with the run's own setting"
            ) from exc
        self.state = TrainerState(**payload["state"])
        if self.scaler is not None and payload.get("reward_rms"):
            self.scaler.rms.load(payload["reward_rms"])
        log.info("resumed from %s at version %d", path, self.state.version)


def load_payload(path: str | Path, kind: str = "", *, mmap: bool = False) -> dict[str, Any]:
    """The contents of the checkpoint at ``path``, read with torch's weights-only unpickler:
    tensors and plain values only, so that a checkpoint from elsewhere runs no code when read.
    With ``kind`` (``"mlp"`` or ``"llm"``), checked to hold a policy of that kind.

    numpy values, which a checkpoint written or edited by other tools may hold, read as well
    (numpy 1's and 2's pickles): arrays of numbers as tensors, numpy scalars as Python numbers,
    so that they load like the trainer's own checkpoints. Arrays of other dtypes stay arrays.

    With ``mmap``, the tensors are mapped from the file rather than read: a reader that needs a
    few fields, or the policy's weights only, reads just those pages, not the optimizer state
    (two thirds of a trainer checkpoint). The file must then stay unchanged while they are used.

    Raises:
        ValueError: the file is no trainer checkpoint, holds other objects (left unread), or
            holds another kind of policy.
    """
    if Path(path).is_file() and not zipfile.is_zipfile(path):  # torch.save has written zips since 1.6
        raise ValueError(f"checkpoint {path}: not a trainer checkpoint (not a torch.save zip archive)")
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            payload = _from_numpy(torch.load(path, weights_only=True, map_location="cpu", mmap=mmap))
    except pickle.UnpicklingError as exc:
        reason = _unpickler_reason(str(exc))
        if "GLOBAL" in reason:  # a class or function to import and call: nothing of a checkpoint's
            raise ValueError(
                f"checkpoint {path}: holds objects other than tensors and plain values "
                f"({reason}), which could run code when read: refused"
            ) from None
        raise ValueError(f"checkpoint {path}: not a trainer checkpoint ({reason})") from None
    except (RuntimeError, EOFError, OSError) as exc:  # a zip, but not torch's, or broken inside
        raise ValueError(f"checkpoint {path}: not a trainer checkpoint ({errors.first_line(exc)})") from None
    if not isinstance(payload, dict) or "policy" not in payload or "state" not in payload:
        raise ValueError(f"checkpoint {path}: not a trainer checkpoint (no policy weights and state)")
    found = payload.get("kind", "mlp")
    if kind and found != kind:
        raise ValueError(f"checkpoint {path}: holds a {found} policy, not a {kind} policy")
    return payload


def _numpy_globals() -> list[Any]:
    """What numpy's pickles of arrays, scalars and dtypes call: they build numbers from bytes and
    run no code of the file's choosing (an object array's items go through the same unpickler).
    numpy 1 wrote ``numpy.core``, numpy 2 writes ``numpy._core``: both names are taken."""
    from numpy import dtypes
    from numpy._core.multiarray import _reconstruct, scalar

    dtype_classes = [getattr(dtypes, name) for name in dtypes.__all__ if name.endswith("DType")]
    return [
        scalar,
        _reconstruct,
        (scalar, "numpy.core.multiarray.scalar"),
        (_reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        *dtype_classes,
    ]


def _from_numpy(value: Any) -> Any:
    """``value`` with numpy arrays of numbers as tensors and numpy scalars as Python numbers, in
    dicts, lists and tuples at any depth. Dicts and lists are changed in place, so that they keep
    their type and attributes (a state dict's ``_metadata``)."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        for key, item in value.items():
            value[key] = _from_numpy(item)
    elif isinstance(value, list):
        value[:] = [_from_numpy(item) for item in value]
    elif isinstance(value, tuple):
        return tuple(_from_numpy(item) for item in value)
    return value


_TORCH_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation", "(1)", "(2)")


def _unpickler_reason(message: str) -> str:
    """The reason in the message of torch's weights-only unpickler, without its advice around it."""
    lines = [line.split("WeightsUnpickler error:")[-1].strip() for line in message.splitlines()]
    found = [line for line in lines if "GLOBAL" in line] or [
        line for line in lines if line and not line.startswith(_TORCH_ADVICE)
    ]
    return found[0].split(" was not")[0].removesuffix(".") if found else "unreadable"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint of a run directory (or of its ``checkpoints/`` folder itself), or
    None: the one its ``checkpoints/latest.pt`` names, else (a copy that left the link out, as
    ``rsync -r`` does) the one of the highest version there."""
    folder = Path(run_dir)
    if folder.name != CHECKPOINT_DIR or (folder / CHECKPOINT_DIR).is_dir():
        folder = folder / CHECKPOINT_DIR
    latest = folder / LATEST
    if latest.exists():
        return latest.resolve()
    found = sorted(folder.glob("ckpt-*.pt"))  # the version zero-padded: sorted by it
    return found[-1] if found else None
