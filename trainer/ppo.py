"""PPO for continuous control, as pure functions.

:func:`gae` works on a flat sequence of transitions made of contiguous
segments; :func:`ppo_loss` computes the clipped surrogate, the value loss and
the entropy bonus with masks, so masked rows (stale, fallback, autoreset)
stay in place and GAE stays contiguous. Nothing here keeps state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

#: A unit Gaussian's entropy minus its log-std, per dimension.
GAUSSIAN_ENTROPY_CONST = 0.5 * math.log(2.0 * math.pi * math.e)


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    next_values: np.ndarray,
    *,
    terminated: np.ndarray,
    truncated: np.ndarray,
    segment_end: np.ndarray,
    gamma: float,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over ``n`` transitions in sequence order.

    Args:
        rewards: ``[n]`` reward of each transition.
        values: ``[n]`` V(obs) of each transition.
        next_values: ``[n]`` V of the observation that followed: the next row's
            observation, or a segment's bootstrap observation for its last row. On
            a truncated row it is the episode's final observation, so truncation
            bootstraps; on a terminated row it is ignored (a terminal state is worth 0).
        terminated, truncated: ``[n]`` bool, the transition ended its episode.
        segment_end: ``[n]`` bool, the row is the last of its segment (the next row,
            if any, belongs to another env or another time).
        gamma, lam: discount and GAE lambda.

    Returns:
        ``(advantages, returns)``, float32 ``[n]``; returns = advantages + values.
    """
    n = len(rewards)
    not_term = 1.0 - terminated.astype(np.float64)
    cont = 1.0 - (terminated | truncated | segment_end).astype(np.float64)
    deltas = rewards + gamma * next_values * not_term - values
    carry = gamma * lam * cont
    adv = np.zeros(n, np.float64)
    last = 0.0
    for i in range(n - 1, -1, -1):
        last = deltas[i] + carry[i] * last
        adv[i] = last
    return adv.astype(np.float32), (adv + values).astype(np.float32)


def segment_positions(segment_end: np.ndarray) -> np.ndarray:
    """int64 ``[n]``: each row's index within its segment (segments end where ``segment_end``)."""
    n = len(segment_end)
    starts = np.zeros(n, np.int64)
    ends = np.flatnonzero(segment_end[:-1]) + 1
    starts[ends] = ends
    positions: np.ndarray = np.arange(n, dtype=np.int64) - np.maximum.accumulate(starts)
    return positions


def group_advantages(
    returns: np.ndarray, groups: np.ndarray, mask: np.ndarray, eps: float = 1e-8
) -> np.ndarray:
    """GRPO-style advantages: ``returns`` standardised within each group.

    Args:
        returns: ``[n]`` what each row earned (e.g. the discounted reward-to-go).
        groups: ``[n]`` int group ids (rows that are compared with each other).
        mask: ``[n]`` bool, the rows that take part; the others get 0.
        eps: added to each group's std.

    Returns:
        float32 ``[n]``: ``(returns - group mean) / (group std + eps)`` over the masked
        rows of each group; 0 outside the mask and where a group's returns are all equal.
    """
    g = np.unique(groups, return_inverse=True)[1].ravel()
    k = int(g.max()) + 1 if len(g) else 0
    w = mask.astype(np.float64)
    count = np.maximum(np.bincount(g, weights=w, minlength=k), 1.0)
    mean = np.bincount(g, weights=w * returns, minlength=k) / count
    std = np.sqrt(np.bincount(g, weights=w * (returns - mean[g]) ** 2, minlength=k) / count)
    live = mask & (std[g] > 0)
    adv = np.zeros(len(returns), np.float64)
    adv[live] = (returns[live] - mean[g[live]]) / (std[g[live]] + eps)
    return adv.astype(np.float32)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over rows where ``mask`` is true (0 when none is)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def normalize_advantages(adv: np.ndarray, mask: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """float32: zero mean, unit std over the rows where ``mask`` (masked-out rows keep their place).

    All zeros when no row is in the mask (no row drives the policy then).
    """
    m = mask.astype(np.float64)
    count = float(m.sum())
    if count == 0:
        return np.zeros(len(adv), np.float32)
    mean = float((adv * m).sum()) / count
    std = math.sqrt(float(((adv - mean) ** 2 * m).sum()) / count)
    out: np.ndarray = ((adv - mean) / (std + eps)).astype(np.float32)
    return out


def gaussian_entropy(log_std: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of a diagonal Gaussian with the given log-stds (last dim summed)."""
    return (log_std + GAUSSIAN_ENTROPY_CONST).sum(-1)


@dataclass(frozen=True)
class LossCoefs:
    clip: float = 0.2
    """PPO ratio clip epsilon."""
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    clip_value: bool = True
    """Clip the value update around the values at update start (CleanRL's clip_vloss)."""
    is_cap: float = 2.0
    """Decoupled PPO: cap of the behaviour/proximal importance weight."""


def ppo_loss(
    *,
    new_log_probs: torch.Tensor,
    behaviour_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    entropy: torch.Tensor,
    policy_mask: torch.Tensor,
    value_mask: torch.Tensor,
    coefs: LossCoefs,
    proximal_log_probs: torch.Tensor | None = None,
    with_stats: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO loss of one minibatch and its diagnostics.

    With ``proximal_log_probs`` None the ratio is ``pi / behaviour`` (standard
    PPO with the stamped behaviour log-prob). Otherwise it is decoupled PPO
    (Hilton et al. 2022): the ratio is ``pi / proximal`` and each row is
    weighted by ``min(proximal / behaviour, is_cap)``.

    ``entropy`` is the mean policy entropy (a scalar), added with
    ``entropy_coef``. Masks may be bool or float (0/1). Returns ``(loss, stats)``;
    stats are detached, and empty unless ``with_stats``.
    """
    base = behaviour_log_probs if proximal_log_probs is None else proximal_log_probs
    log_ratio = new_log_probs - base
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - coefs.clip, 1.0 + coefs.clip)
    surrogate = torch.min(ratio * advantages, clipped * advantages)
    if proximal_log_probs is not None:
        weight = (proximal_log_probs - behaviour_log_probs).exp().clamp(max=coefs.is_cap)
        surrogate = surrogate * weight.detach()
    pg_loss = -masked_mean(surrogate, policy_mask)

    v_err = (new_values - returns) ** 2
    if coefs.clip_value:
        v_clipped = old_values + (new_values - old_values).clamp(-coefs.clip, coefs.clip)
        v_err = torch.max(v_err, (v_clipped - returns) ** 2)
    v_loss = 0.5 * masked_mean(v_err, value_mask)

    loss = pg_loss + coefs.value_coef * v_loss - coefs.entropy_coef * entropy
    if not with_stats:
        return loss, {}
    with torch.no_grad():
        stats = {
            "policy_loss": pg_loss.detach(),
            "value_loss": v_loss.detach(),
            "entropy": entropy.detach(),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, policy_mask),
            "clip_fraction": masked_mean(((ratio - 1.0).abs() > coefs.clip).float(), policy_mask),
        }
    return loss, stats
