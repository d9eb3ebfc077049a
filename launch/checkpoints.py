"""Trainer checkpoints as policies to serve: ``edgerl serve --checkpoint`` and ``edgerl rollout
--checkpoint`` read what a checkpoint holds before a server starts on it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LLM_KIND = "llm"


@dataclass(frozen=True)
class CheckpointInfo:
    """What a trainer checkpoint holds, as far as serving it goes."""

    path: str
    """The checkpoint file (a run folder's newest, where a folder was named)."""
    kind: str
    """``"mlp"`` or ``"llm"``."""
    version: int
    """Policy version of its weights: the server answers with it and counts on from it."""
    env: str
    """Gymnasium id it was trained on; empty where the checkpoint does not say (written before
    checkpoints recorded it)."""
    policy: str
    """``--policy`` it was trained with: an MLP preset or ``llm``; empty where unknown."""
    model: str
    """Base model folder of an ``llm`` policy (its served weights load over this model)."""
    obs_dim: int
    """Observation values its MLP takes (0 for ``llm``)."""
    act_dim: int
    """Action values its MLP gives (0 for ``llm``)."""

    def check_serves(
        self, env: str, policy: str, obs_shape: tuple[int, ...], act_shape: tuple[int, ...]
    ) -> None:
        """Raise ValueError, naming the option, unless this checkpoint can serve ``policy`` on
        ``env``, whose spaces are ``obs_shape`` and ``act_shape``."""
        if self.env and env != self.env:
            raise ValueError(f"--env {env}: checkpoint {self.path} was trained on {self.env}")
        if self.policy and policy != self.policy:
            raise ValueError(f"--policy {policy}: checkpoint {self.path} holds policy {self.policy!r}")
        if (policy == LLM_KIND) != (self.kind == LLM_KIND):
            raise ValueError(f"--policy {policy}: checkpoint {self.path} holds policy kind {self.kind!r}")
        if self.kind == LLM_KIND:
            return
        for what, dim, shape in (
            ("observations", self.obs_dim, obs_shape),
            ("actions", self.act_dim, act_shape),
        ):
            if (dim,) != tuple(shape):
                raise ValueError(
                    f"--env {env}: its {what} have shape {list(shape)}; the policy in checkpoint "
                    f"{self.path} has {dim} values"
                )


def read_checkpoint(path: str) -> CheckpointInfo:
    """What the checkpoint at ``path`` holds: a trainer checkpoint file, or a run folder of
    ``edgerl train`` or its ``checkpoints/`` folder (the newest checkpoint).

    Raises:
        FileNotFoundError: nothing at ``path``, or a folder without checkpoints.
        ValueError: the file is not a trainer checkpoint.
    """
    from edgerl.models import POLICY_PRESETS
    from edgerl.trainer.trainer import CHECKPOINT_DIR, latest_checkpoint, load_payload

    file = Path(path)
    if file.is_dir():
        newest = latest_checkpoint(file)
        if newest is None:
            raise FileNotFoundError(
                f"checkpoint {path}: a folder without {CHECKPOINT_DIR}/ (give a run folder of "
                "edgerl train or a checkpoint file)"
            )
        file = newest
    elif not file.exists():
        raise FileNotFoundError(f"checkpoint {path}: no such file or folder")
    payload = load_payload(file, mmap=True)  # a few fields and shapes: no tensor is read
    kind = str(payload.get("kind", "mlp"))
    run = payload.get("run") or {}
    weights = payload["policy"]
    policy = str(run.get("policy", ""))
    if not policy:  # a checkpoint from before "run" was recorded: its hidden sizes name the preset
        hidden = tuple(payload.get("hidden", ()))
        policy = (
            LLM_KIND if kind == LLM_KIND else next((k for k, v in POLICY_PRESETS.items() if v == hidden), "")
        )
    mlp = kind != LLM_KIND
    return CheckpointInfo(
        path=str(file),
        kind=kind,
        version=int(payload["state"]["version"]),
        env=str(run.get("env", "")),
        policy=policy,
        model=str(run.get("model", "")),
        obs_dim=int(weights["obs_norm.mean"].shape[0]) if mlp else 0,
        act_dim=int(weights["actor_log_std"].shape[0]) if mlp else 0,
    )
