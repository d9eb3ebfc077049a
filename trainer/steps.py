"""One PPO gradient step on a minibatch: with autograd, or hand-written for the Gaussian MLP.

:class:`AutogradStep` works for any :class:`~edgerl.trainer.policies.TrainablePolicy`:
the policy evaluates the rows, :func:`~edgerl.trainer.ppo.ppo_loss` builds the
loss, torch differentiates it, clips the global gradient norm and steps Adam.

:class:`GaussianMLPStep` does the same for a
:class:`~edgerl.models.GaussianMLPPolicy` in numpy, without autograd. With
CleanRL's MuJoCo settings (minibatches of 64 rows, 64x64 networks) an
autograd step costs ~1.5 ms on the reference machine and nearly all of it is
per-operation overhead (torch's dispatcher and autograd over a few dozen tiny
tensors, then clipping and Adam over ten parameter tensors), while the
arithmetic is a few MFLOP. Here instead:

- the module's parameters are views of one contiguous float32 vector
  (:class:`FlatParams`), so publishing, checkpoints and inference read the
  same ``nn.Module`` as before;
- forward and backward of actor and critic are written out layer by layer
  into a gradient vector laid out like the parameters;
- gradient clipping and Adam are a handful of operations on those two vectors
  (:class:`FlatAdam`, torch's Adam arithmetic).

The loss is :func:`~edgerl.trainer.ppo.ppo_loss` term for term, including
torch's tie rules of ``min``/``max``/``clamp``; ``tests/test_steps.py`` checks
loss, statistics, gradients and whole updates of the two against each other.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from edgerl.models import LOG_2PI, mlp_linears
from edgerl.trainer.config import check_backend
from edgerl.trainer.policies import GaussianTrainable, TrainablePolicy
from edgerl.trainer.ppo import GAUSSIAN_ENTROPY_CONST, LossCoefs, ppo_loss


class FlatParams:
    """A module's parameters rebound as views of one float32 buffer, and a gradient buffer like it.

    ``vector`` and ``grad`` are numpy views; ``view(p)`` / ``grad_view(p)`` give a
    parameter's own slice, shaped like it. In-place writes through ``vector``
    are seen by the module (``state_dict``, ``load_state_dict`` and inference
    keep working, as they copy in place).
    """

    def __init__(self, module: nn.Module) -> None:
        params = list(module.parameters())
        if any(p.dtype != torch.float32 for p in params):
            raise TypeError("FlatParams needs float32 parameters")
        total = sum(p.numel() for p in params)
        self.buffer = torch.empty(total, dtype=torch.float32)
        self._slices: dict[int, slice] = {}
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                view = self.buffer[offset : offset + n]
                view.copy_(p.reshape(-1))
                p.data = view.view_as(p)
                self._slices[id(p)] = slice(offset, offset + n)
                offset += n
        self.vector: np.ndarray = self.buffer.numpy()
        self.grad = np.zeros_like(self.vector)

    def view(self, p: torch.Tensor) -> np.ndarray:
        arr: np.ndarray = self.vector[self._slices[id(p)]].reshape(p.shape)
        return arr

    def grad_view(self, p: torch.Tensor) -> np.ndarray:
        arr: np.ndarray = self.grad[self._slices[id(p)]].reshape(p.shape)
        return arr


class FlatAdam:
    """Adam (torch's arithmetic, no weight decay) on one flat parameter vector.

    ``param_groups`` mirrors torch's optimisers for what the trainer reads and
    sets (the learning rate); ``state_dict`` / ``load_state_dict`` checkpoint it.
    """

    def __init__(
        self, params: np.ndarray, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
    ) -> None:
        self.params = params
        self.param_groups: list[dict[str, Any]] = [{"lr": lr}]
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.steps = 0
        self.exp_avg = np.zeros_like(params)
        self.exp_avg_sq = np.zeros_like(params)
        self._denom = np.empty_like(params)

    def step(self, grad: np.ndarray) -> None:
        """One Adam step with gradient ``grad`` (same shape as the parameters)."""
        self.steps += 1
        b1, b2 = self.beta1, self.beta2
        m, v, denom = self.exp_avg, self.exp_avg_sq, self._denom
        m *= b1
        m += (1.0 - b1) * grad
        v *= b2
        np.multiply(grad, grad, out=denom)
        denom *= 1.0 - b2
        v += denom
        bias1 = 1.0 - b1**self.steps
        bias2_sqrt = math.sqrt(1.0 - b2**self.steps)
        np.sqrt(v, out=denom)
        denom /= bias2_sqrt
        denom += self.eps
        np.divide(m, denom, out=denom)
        denom *= self.param_groups[0]["lr"] / bias1
        self.params -= denom

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "flat_adam",
            "lr": self.param_groups[0]["lr"],
            "steps": self.steps,
            # tensors, not arrays: checkpoints hold nothing torch's weights-only reader refuses
            "exp_avg": torch.from_numpy(self.exp_avg.copy()),
            "exp_avg_sq": torch.from_numpy(self.exp_avg_sq.copy()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "flat_adam" or state["exp_avg"].shape != self.exp_avg.shape:
            raise ValueError("optimizer state: not a FlatAdam state of this network")
        self.param_groups[0]["lr"] = state["lr"]
        self.steps = int(state["steps"])
        self.exp_avg[:] = np.asarray(state["exp_avg"])
        self.exp_avg_sq[:] = np.asarray(state["exp_avg_sq"])


@dataclass(frozen=True)
class Targets:
    """What the PPO loss needs of a minibatch's rows besides the policy: float32 ``[k]`` arrays."""

    behaviour_log_probs: np.ndarray
    advantages: np.ndarray
    """Already normalised, where the trainer normalises them."""
    old_values: np.ndarray
    """Values at update start (the centre of the value clip)."""
    returns: np.ndarray
    policy_mask: np.ndarray
    """1.0 for rows that drive the policy loss, 0.0 for masked ones."""
    value_mask: np.ndarray
    proximal_log_probs: np.ndarray | None = None
    """Decoupled PPO: the proximal policy's log-probs; None for standard PPO."""


class MinibatchStep(abc.ABC):
    """Loss, gradients, clipping and one optimiser step on rows of the policy's prepared batch."""

    #: What the trainer reads and sets (``param_groups[0]["lr"]``) and checkpoints.
    optimizer: Any

    @abc.abstractmethod
    def step(self, idx: np.ndarray, targets: Targets, with_stats: bool = False) -> dict[str, float]:
        """One gradient step on rows ``idx``; returns ``ppo_loss``'s stats if ``with_stats``, else {}."""


class AutogradStep(MinibatchStep):
    """Any trainable policy: torch autograd, ``clip_grad_norm_`` and fused Adam."""

    def __init__(
        self,
        policy: TrainablePolicy,
        coefs: LossCoefs,
        learning_rate: float,
        max_grad_norm: float,
        adam_eps: float = 1e-5,
    ) -> None:
        self.policy, self.coefs, self.max_grad_norm = policy, coefs, max_grad_norm
        self.params = [p for p in policy.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=learning_rate, eps=adam_eps, fused=True)

    def loss(
        self, idx: np.ndarray, targets: Targets, with_stats: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:func:`~edgerl.trainer.ppo.ppo_loss` of the policy on rows ``idx`` (with gradient)."""
        t = torch.from_numpy
        ev = self.policy.evaluate(t(idx))
        prox = targets.proximal_log_probs
        return ppo_loss(
            new_log_probs=ev.log_probs,
            behaviour_log_probs=t(targets.behaviour_log_probs),
            advantages=t(targets.advantages),
            new_values=ev.values,
            old_values=t(targets.old_values),
            returns=t(targets.returns),
            entropy=ev.entropy,
            policy_mask=t(targets.policy_mask),
            value_mask=t(targets.value_mask),
            coefs=self.coefs,
            proximal_log_probs=None if prox is None else t(prox),
            with_stats=with_stats,
        )

    def step(self, idx: np.ndarray, targets: Targets, with_stats: bool = False) -> dict[str, float]:
        loss, stats = self.loss(idx, targets, with_stats)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
        self.optimizer.step()
        return {k: float(v) for k, v in stats.items()}


class _Net:
    """Forward and backward of one tanh MLP whose weights are views of the flat vectors."""

    def __init__(self, seq: nn.Sequential, flat: FlatParams) -> None:
        linears = mlp_linears(seq)
        self.weights = [flat.view(m.weight) for m in linears]
        self.biases = [flat.view(m.bias) for m in linears]
        self.weight_grads = [flat.grad_view(m.weight) for m in linears]
        self.bias_grads = [flat.grad_view(m.bias) for m in linears]
        self._acts: list[np.ndarray] = []

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Output ``[k, out]``; keeps the activations for :meth:`backward`."""
        acts = [x]
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            z = acts[-1] @ w.T
            z += b
            if i < last:
                np.tanh(z, out=z)
            acts.append(z)
        self._acts = acts
        return acts[-1]

    def backward(self, grad_out: np.ndarray) -> None:
        """Write d(loss)/d(weights) for the last forward's output gradient ``[k, out]``."""
        g = grad_out
        acts = self._acts
        for i in range(len(self.weights) - 1, -1, -1):
            np.matmul(g.T, acts[i], out=self.weight_grads[i])
            np.sum(g, axis=0, out=self.bias_grads[i])
            if i:
                h = acts[i]
                g = g @ self.weights[i]
                g *= 1.0 - h * h


class GaussianMLPStep(MinibatchStep):
    """:class:`AutogradStep`'s arithmetic for a :class:`GaussianTrainable`, in numpy.

    Args:
        policy: the trainable Gaussian MLP; its module's parameters become views of
            one flat vector. Rows are read from what it prepared for the update.
        coefs: the loss coefficients (as :func:`~edgerl.trainer.ppo.ppo_loss` takes them).
        learning_rate: Adam's initial learning rate (``optimizer.param_groups[0]["lr"]``).
        max_grad_norm: clip the global gradient norm to this (<= 0: no clipping).
        adam_eps: Adam's epsilon.
    """

    def __init__(
        self,
        policy: GaussianTrainable,
        coefs: LossCoefs,
        learning_rate: float,
        max_grad_norm: float,
        adam_eps: float = 1e-5,
    ) -> None:
        net = policy.policy
        self.policy, self.coefs, self.max_grad_norm = policy, coefs, max_grad_norm
        self.flat = flat = FlatParams(net)
        self.optimizer = FlatAdam(flat.vector, learning_rate, eps=adam_eps)
        self.actor = _Net(net.actor_mean, flat)
        self.critic = _Net(net.critic, flat)
        self.log_std = flat.view(net.actor_log_std)
        self.log_std_grad = flat.grad_view(net.actor_log_std)

    def gradients(
        self, obs: np.ndarray, actions: np.ndarray, targets: Targets, with_stats: bool = False
    ) -> tuple[float, dict[str, float]]:
        """Fill ``flat.grad`` with d(loss)/d(parameters) on normalised ``obs`` and ``actions``.

        Returns ``(loss, stats)``; ``stats`` is empty unless ``with_stats``.
        """
        c, tg = self.coefs, targets
        log_std = self.log_std
        inv_std = np.exp(-log_std)
        # Actor: log-probs of the taken actions, the clipped surrogate.
        mean = self.actor.forward(obs)
        z = (actions - mean) * inv_std
        log_probs = -0.5 * (z * z + LOG_2PI).sum(1) - log_std.sum()
        prox = tg.proximal_log_probs
        log_ratio = log_probs - (tg.behaviour_log_probs if prox is None else prox)
        ratio = np.exp(log_ratio)
        clipped = np.clip(ratio, 1.0 - c.clip, 1.0 + c.clip)
        adv = tg.advantages
        unclipped_obj, clipped_obj = ratio * adv, clipped * adv
        pm = tg.policy_mask
        p_count = max(float(pm.sum()), 1.0)
        row_w = pm
        if prox is not None:
            row_w = pm * np.minimum(np.exp(prox - tg.behaviour_log_probs), c.is_cap)
        pg_loss = -float((np.minimum(unclipped_obj, clipped_obj) * row_w).sum()) / p_count
        # d(surrogate)/d(ratio * A): torch's min sends half the gradient to each side on
        # ties and clamp passes it on [lo, hi]. Inside the clip range the two sides are
        # equal and their halves add up to all of it; outside it they tie only where
        # A = 0, whose gradient is 0 either way. So: all where r*A <= clip(r)*A, else none.
        d_surr = unclipped_obj <= clipped_obj
        d_logp = -(row_w / p_count) * d_surr * adv * ratio
        # log_prob = -0.5 * sum(z^2) - sum(log_std) - const, with z = (a - mean) / std.
        self.actor.backward((d_logp[:, None] * z) * inv_std)
        entropy = float(log_std.sum()) + GAUSSIAN_ENTROPY_CONST * log_std.size
        np.matmul(d_logp, z * z - 1.0, out=self.log_std_grad)
        self.log_std_grad -= c.entropy_coef

        # Critic: the (clipped) squared error; torch's max splits ties the same way.
        values = self.critic.forward(obs)[:, 0]
        err = values - tg.returns
        v_err = err * err
        d_err = 2.0 * err
        if c.clip_value:
            delta = values - tg.old_values
            err_c = tg.old_values + np.clip(delta, -c.clip, c.clip) - tg.returns
            v_err_c = err_c * err_c
            d_err_c = np.where(np.abs(delta) <= c.clip, 2.0 * err_c, 0.0)
            d_err = np.where(
                v_err > v_err_c, d_err, np.where(v_err == v_err_c, 0.5 * (d_err + d_err_c), d_err_c)
            )
            v_err = np.maximum(v_err, v_err_c)
        vm = tg.value_mask
        v_count = max(float(vm.sum()), 1.0)
        v_loss = 0.5 * float((v_err * vm).sum()) / v_count
        self.critic.backward(((c.value_coef * 0.5 / v_count) * vm * d_err)[:, None])

        loss = pg_loss + c.value_coef * v_loss - c.entropy_coef * entropy
        if not with_stats:
            return loss, {}
        return loss, {
            "policy_loss": pg_loss,
            "value_loss": v_loss,
            "entropy": entropy,
            "approx_kl": float((((ratio - 1.0) - log_ratio) * pm).sum()) / p_count,
            "clip_fraction": float(((np.abs(ratio - 1.0) > c.clip) * pm).sum()) / p_count,
        }

    def step(self, idx: np.ndarray, targets: Targets, with_stats: bool = False) -> dict[str, float]:
        obs, actions = self.policy.prepared
        _, stats = self.gradients(obs[idx], actions[idx], targets, with_stats)
        grad = self.flat.grad
        if self.max_grad_norm > 0:  # torch's clip_grad_norm_
            coef = self.max_grad_norm / (float(np.sqrt(np.dot(grad, grad))) + 1e-6)
            if coef < 1.0:
                grad *= coef
        self.optimizer.step(grad)
        return stats


def minibatch_step(
    policy: TrainablePolicy,
    coefs: LossCoefs,
    *,
    learning_rate: float,
    max_grad_norm: float,
    backend: str = "auto",
) -> MinibatchStep:
    """The step for ``policy`` by ``backend``: ``numpy`` (Gaussian MLPs only), ``autograd``, or
    ``auto`` (numpy where the policy allows)."""
    check_backend(backend)
    if isinstance(policy, GaussianTrainable) and backend in ("auto", "numpy"):
        return GaussianMLPStep(policy, coefs, learning_rate, max_grad_norm)
    if backend == "numpy":
        raise ValueError(f"update_backend numpy: only for the Gaussian MLP policies, not {policy.kind}")
    return AutogradStep(policy, coefs, learning_rate, max_grad_norm)
