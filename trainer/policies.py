"""What the PPO trainer needs of a policy, for the Gaussian MLP and for a language model.

The trainer's update is the same for both: values for GAE, then minibatches
of log-probs of the taken actions, entropy and values. A
:class:`TrainablePolicy` turns a batch's observations and actions into the
model's inputs once per update (:meth:`~TrainablePolicy.prepare`) and
evaluates rows of them (:meth:`~TrainablePolicy.evaluate`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from edgerl.models import GaussianMLPPolicy, gaussian_log_prob
from edgerl.models.llm_actor_critic import LLMActorCritic
from edgerl.trainer.ppo import gaussian_entropy


@dataclass(frozen=True)
class Evaluation:
    """The current policy on some rows of the prepared batch."""

    log_probs: torch.Tensor
    """``[k]`` log-probability of each row's taken action."""
    entropy: torch.Tensor
    """Scalar: mean entropy of the action distribution over the rows."""
    values: torch.Tensor
    """``[k]`` state values."""


class TrainablePolicy(abc.ABC):
    """A policy network as the trainer uses it."""

    #: ``"mlp"`` or ``"llm"``; saved in checkpoints so the server knows how to load them.
    kind: str
    #: The parameters the optimiser updates (and the checkpointed ``state_dict``).
    module: nn.Module

    @abc.abstractmethod
    def values(self, obs: np.ndarray) -> np.ndarray:
        """float32 state values ``[m]`` of raw observations ``[m, *obs_shape]`` (no gradient)."""

    @abc.abstractmethod
    def prepare(self, obs: np.ndarray, actions: np.ndarray) -> None:
        """Take the update's ``n`` observations and actions; rows are then evaluated by index."""

    @abc.abstractmethod
    def evaluate(self, idx: torch.Tensor) -> Evaluation:
        """The current policy on rows ``idx`` of the prepared batch (with gradient)."""

    def log_probs(self, rows: int, chunk: int = 1024) -> torch.Tensor:
        """Log-probs ``[rows]`` of all prepared rows without gradient (the proximal policy)."""
        with torch.no_grad():
            parts = [
                self.evaluate(torch.arange(lo, min(lo + chunk, rows))).log_probs
                for lo in range(0, rows, chunk)
            ]
        return torch.cat(parts)

    def observe(self, obs: np.ndarray) -> None:  # noqa: B027 - optional hook, no-op by default
        """After an update: fold the batch's observations into the policy's statistics, if it has any."""

    @abc.abstractmethod
    def served_state(self) -> dict[str, torch.Tensor]:
        """The weights published to the edge server."""

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint records besides the ``state_dict`` (to rebuild the network)."""
        return {"kind": self.kind}


class GaussianTrainable(TrainablePolicy):
    """A :class:`GaussianMLPPolicy`: normalised observations are computed once per update."""

    kind = "mlp"

    def __init__(self, policy: GaussianMLPPolicy) -> None:
        self.module = self.policy = policy
        self._nobs = torch.empty(0)
        self._actions = torch.empty(0)

    def values(self, obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            values: np.ndarray = self.policy.value(torch.from_numpy(obs)).numpy()
        return values

    def prepare(self, obs: np.ndarray, actions: np.ndarray) -> None:
        # The normaliser's statistics stay fixed during the update (they change after
        # it), so observations are normalised once, not in every minibatch.
        with torch.no_grad():
            self._nobs = self.policy.obs_norm(torch.from_numpy(obs))
        self._actions = torch.from_numpy(actions)

    @property
    def prepared(self) -> tuple[np.ndarray, np.ndarray]:
        """The update's normalised observations ``[n, obs_dim]`` and actions ``[n, act_dim]``."""
        return self._nobs.numpy(), self._actions.numpy()

    def evaluate(self, idx: torch.Tensor) -> Evaluation:
        pol, o = self.policy, self._nobs[idx]
        return Evaluation(
            log_probs=gaussian_log_prob(pol.actor_mean(o), pol.actor_log_std, self._actions[idx]),
            entropy=gaussian_entropy(pol.actor_log_std),
            values=pol.critic(o).squeeze(-1),
        )

    def observe(self, obs: np.ndarray) -> None:
        self.policy.obs_norm.update(torch.from_numpy(obs))

    def served_state(self) -> dict[str, torch.Tensor]:
        return self.policy.state_dict()

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"kind": self.kind, "hidden": list(self.policy.hidden)}


class LLMTrainable(TrainablePolicy):
    """An :class:`LLMActorCritic`: prompts and action tokens are built once per update."""

    kind = "llm"

    def __init__(self, policy: LLMActorCritic, value_chunk: int = 1024) -> None:
        self.module = self.policy = policy
        self.value_chunk = value_chunk
        self._prompts = torch.empty(0, dtype=torch.int64)
        self._tokens = torch.empty(0, dtype=torch.int64)

    def values(self, obs: np.ndarray) -> np.ndarray:
        prompts = self.policy.prompts(obs)
        with torch.no_grad():
            parts = [
                self.policy.value(prompts[lo : lo + self.value_chunk])
                for lo in range(0, len(prompts), self.value_chunk)
            ]
        values: np.ndarray = torch.cat(parts).numpy()
        return values

    def prepare(self, obs: np.ndarray, actions: np.ndarray) -> None:
        self._prompts = self.policy.prompts(obs)
        self._tokens = self.policy.action_tokens(actions)

    def evaluate(self, idx: torch.Tensor) -> Evaluation:
        log_probs, entropy, values = self.policy(self._prompts[idx], self._tokens[idx])
        return Evaluation(log_probs=log_probs, entropy=entropy.mean(), values=values)

    def served_state(self) -> dict[str, torch.Tensor]:
        return self.policy.served_state()


def trainable(policy: nn.Module | TrainablePolicy) -> TrainablePolicy:
    """``policy`` as the trainer uses it."""
    if isinstance(policy, TrainablePolicy):
        return policy
    if isinstance(policy, GaussianMLPPolicy):
        return GaussianTrainable(policy)
    if isinstance(policy, LLMActorCritic):
        return LLMTrainable(policy)
    raise TypeError(f"no trainer support for {type(policy).__name__}")
