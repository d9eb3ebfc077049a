"""Torch policy networks served by the edge server and trained by the trainer.

The observation normaliser lives inside the model (as buffers), so the
weights a trainer publishes carry it and server and trainer can never
disagree on it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from edgerl.models.presets import LOG_2PI, POLICY_PRESETS


class RunningNorm(nn.Module):
    """Observation normaliser: ``clip((x - mean) / sqrt(var + eps), -clip, clip)``.

    Statistics are buffers (saved with the weights) and change only through
    :meth:`update`, which the trainer calls; inference never mutates them.
    """

    mean: torch.Tensor
    var: torch.Tensor
    count: torch.Tensor

    def __init__(self, shape: Sequence[int], clip: float = 10.0, eps: float = 1e-8) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(*shape))
        self.register_buffer("var", torch.ones(*shape))
        self.register_buffer("count", torch.tensor(eps, dtype=torch.float64))
        self.clip = clip
        self.eps = eps

    def std(self, var: torch.Tensor | None = None) -> torch.Tensor:
        """``sqrt(var + eps)``, the divisor of :meth:`forward`; ``var``: a variance to take in place
        of the module's own."""
        return torch.sqrt((self.var if var is None else var) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp((x - self.mean) / self.std(), -self.clip, self.clip)

    @torch.no_grad()
    def frozen(self, mean: torch.Tensor | None = None, var: torch.Tensor | None = None) -> FrozenNorm:
        """A numpy copy of the current statistics that normalises as :meth:`forward` does; ``mean``
        and ``var``: statistics to take in place of the module's own (which stay as they are)."""
        return FrozenNorm(
            (self.mean if mean is None else mean).numpy().astype(np.float32, copy=True),
            self.std(var).numpy().astype(np.float32),
            np.float32(self.clip),
        )

    @torch.no_grad()
    def update(self, batch: torch.Tensor) -> None:
        """Merge a batch ``[n, *shape]`` into the statistics (parallel Welford)."""
        n = batch.shape[0]
        if n == 0:
            return
        b_mean = batch.mean(0)
        b_var = batch.var(0, unbiased=False)
        total = self.count + n
        delta = b_mean - self.mean
        new_mean = self.mean + delta * (n / total).float()
        m2 = self.var * self.count.float() + b_var * n + delta.pow(2) * (self.count * n / total).float()
        self.mean.copy_(new_mean)
        self.var.copy_(m2 / total.float())
        self.count.copy_(total)


class FrozenNorm:
    """:class:`RunningNorm`'s transform on numpy arrays, with its statistics fixed.

    Cheaper than the module's torch ops on the small batches a server answers.
    """

    def __init__(self, mean: np.ndarray, std: np.ndarray, clip: np.float32) -> None:
        self.mean, self.std, self.clip = mean, std, clip

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.clip((x - self.mean) / self.std, -self.clip, self.clip)
        return out


def mlp_linears(seq: nn.Module) -> list[nn.Linear]:
    """The Linear layers of an MLP as :func:`_mlp` builds it: Linear, Tanh, ..., Tanh, Linear.

    Code that runs the network without its ``forward`` (the server's served copy, the
    trainer's numpy gradients) relies on that shape: a tanh after every layer but the last.

    Raises:
        TypeError: ``seq`` has another layer or another order (the message names it).
    """
    children = list(seq.children())
    for i, m in enumerate(children):
        expected = nn.Linear if i % 2 == 0 else nn.Tanh
        if not isinstance(m, expected):
            raise TypeError(f"layer {i} is a {type(m).__name__}: expected Linear layers with Tanh between")
    if not children or len(children) % 2 == 0:
        raise TypeError("an MLP ends with a Linear layer")
    return [m for m in children if isinstance(m, nn.Linear)]


def _mlp(sizes: Sequence[int], out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        linear = nn.Linear(a, b)
        last = i == len(sizes) - 2
        nn.init.orthogonal_(linear.weight, out_gain if last else math.sqrt(2.0))
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if not last:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


class GaussianMLPPolicy(nn.Module):
    """Diagonal-Gaussian actor and a separate value critic, each an MLP.

    Inference runs the actor only; the critic is evaluated by the trainer.
    """

    def __init__(
        self, obs_dim: int, act_dim: int, hidden: Sequence[int] = (256, 256), log_std_init: float = 0.0
    ) -> None:
        super().__init__()
        if obs_dim < 1 or act_dim < 1:
            raise ValueError(f"obs_dim and act_dim must be >= 1, got {obs_dim}, {act_dim}")
        self.obs_dim, self.act_dim, self.hidden = obs_dim, act_dim, tuple(hidden)
        self.obs_norm = RunningNorm((obs_dim,))
        self.actor_mean = _mlp((obs_dim, *hidden, act_dim), out_gain=0.01)
        self.actor_log_std = nn.Parameter(torch.full((act_dim,), float(log_std_init)))
        self.critic = _mlp((obs_dim, *hidden, 1), out_gain=1.0)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """State value ``[n]`` of raw observations ``[n, obs_dim]``."""
        value: torch.Tensor = self.critic(self.obs_norm(obs)).squeeze(-1)
        return value

    def distribution(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean ``[n, act_dim]`` and log-std ``[act_dim]`` of the action distribution."""
        return self.actor_mean(self.obs_norm(obs)), self.actor_log_std


def gaussian_log_prob(mean: torch.Tensor, log_std: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Log-density of ``actions`` under N(mean, exp(log_std)^2), summed over the last dim."""
    z = (actions - mean) * torch.exp(-log_std)
    return -0.5 * (z.pow(2) + LOG_2PI).sum(-1) - log_std.sum(-1)


def build_policy(
    preset: str, obs_dim: int, act_dim: int, seed: int = 0, log_std_init: float = 0.0
) -> GaussianMLPPolicy:
    """A freshly initialised policy of a named preset, deterministic in ``seed``.

    ``log_std_init`` is the initial log-std of the action noise (0: std 1, as CleanRL).
    """
    try:
        hidden = POLICY_PRESETS[preset]
    except KeyError:
        raise ValueError(f"policy {preset!r}: choose one of {sorted(POLICY_PRESETS)}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GaussianMLPPolicy(obs_dim, act_dim, hidden, log_std_init)
