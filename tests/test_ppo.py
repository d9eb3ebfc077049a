"""GAE and the PPO loss against hand-computed values; masking in a real update."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edgerl.models import build_policy
from edgerl.trainer.config import TrainerConfig
from edgerl.trainer.ppo import (
    LossCoefs,
    gae,
    gaussian_entropy,
    group_advantages,
    masked_mean,
    normalize_advantages,
    ppo_loss,
    segment_positions,
)
from edgerl.trainer.segments import Batch, RewardScaler, RunningMeanStd
from edgerl.trainer.trainer import Trainer
from tests.helpers import random_batch, unclosed_resources

F = np.float32


Flags = list[bool] | None


def _gae(
    rewards: list[float],
    values: list[float],
    next_values: list[float],
    *,
    term: Flags = None,
    trunc: Flags = None,
    end: Flags = None,
    gamma: float = 0.9,
    lam: float = 0.8,
) -> tuple[np.ndarray, np.ndarray]:
    n = len(rewards)
    z = np.zeros(n, bool)
    out: tuple[np.ndarray, np.ndarray] = gae(
        np.array(rewards, F),
        np.array(values, F),
        np.array(next_values, F),
        terminated=z if term is None else np.array(term),
        truncated=z if trunc is None else np.array(trunc),
        segment_end=z if end is None else np.array(end),
        gamma=gamma,
        lam=lam,
    )
    return out


def test_gae_matches_the_recursion_by_hand() -> None:
    adv, ret = _gae([1.0, 2.0, 3.0], [0.5, 0.4, 0.3], [0.4, 0.3, 0.2])
    d2 = 3.0 + 0.9 * 0.2 - 0.3  # 2.88
    d1 = 2.0 + 0.9 * 0.3 - 0.4  # 1.87
    d0 = 1.0 + 0.9 * 0.4 - 0.5  # 0.86
    a2 = d2
    a1 = d1 + 0.9 * 0.8 * a2
    a0 = d0 + 0.9 * 0.8 * a1
    np.testing.assert_allclose(adv, [a0, a1, a2], rtol=1e-6)
    np.testing.assert_allclose(ret, [a0 + 0.5, a1 + 0.4, a2 + 0.3], rtol=1e-6)


def test_termination_does_not_bootstrap_but_truncation_does() -> None:
    # Row 0 ends the episode; next_values[0] = V(final obs) = 10.
    term, _ = _gae([1.0, 5.0], [0.0, 0.0], [10.0, 0.0], term=[True, False])
    trunc, _ = _gae([1.0, 5.0], [0.0, 0.0], [10.0, 0.0], trunc=[True, False])
    assert term[0] == pytest.approx(1.0)  # r only: a terminal state is worth 0
    assert trunc[0] == pytest.approx(1.0 + 0.9 * 10.0)  # r + gamma V(final obs)
    # Neither lets the next episode's advantage leak back.
    cont, _ = _gae([1.0, 5.0], [0.0, 0.0], [10.0, 0.0])
    assert cont[0] == pytest.approx(1.0 + 0.9 * 10.0 + 0.9 * 0.8 * 5.0)


def test_segment_end_stops_propagation_but_bootstraps() -> None:
    adv, _ = _gae([1.0, 5.0], [0.0, 0.0], [2.0, 0.0], end=[True, False])
    assert adv[0] == pytest.approx(1.0 + 0.9 * 2.0)


def test_masked_mean_and_normalisation_ignore_masked_rows() -> None:
    x = torch.tensor([1.0, 3.0, 100.0])
    m = torch.tensor([True, True, False])
    assert masked_mean(x, m).item() == pytest.approx(2.0)
    assert masked_mean(x, torch.zeros(3, dtype=torch.bool)).item() == 0.0
    n = normalize_advantages(x.numpy(), m.numpy())
    assert n.dtype == np.float32
    assert n[:2].tolist() == pytest.approx([-1.0, 1.0], rel=1e-5)
    assert n[2] == pytest.approx((100.0 - 2.0) / 1.0, rel=1e-5)  # kept in place, same affine map
    assert normalize_advantages(x.numpy(), np.zeros(3, bool)).tolist() == [0.0, 0.0, 0.0]


def test_gaussian_entropy_matches_torch() -> None:
    log_std = torch.tensor([0.1, -0.5, 0.3])
    normal = torch.distributions.Normal(torch.zeros(3), log_std.exp())
    expected = normal.entropy().sum()  # type: ignore[no-untyped-call]
    assert gaussian_entropy(log_std).item() == pytest.approx(expected.item(), rel=1e-6)


def _loss(**kw: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    base: dict[str, Any] = {
        "new_log_probs": torch.tensor([math.log(1.5), math.log(0.5)]),
        "behaviour_log_probs": torch.zeros(2),
        "advantages": torch.tensor([1.0, -1.0]),
        "new_values": torch.tensor([1.0, 2.0]),
        "old_values": torch.tensor([1.0, 2.0]),
        "returns": torch.tensor([2.0, 2.0]),
        "entropy": torch.tensor(0.7),
        "policy_mask": torch.tensor([True, True]),
        "value_mask": torch.tensor([True, True]),
        "coefs": LossCoefs(clip=0.2, value_coef=0.5, entropy_coef=0.01, clip_value=False),
    }
    base.update(kw)
    out: tuple[torch.Tensor, dict[str, torch.Tensor]] = ppo_loss(**base)
    return out


def test_ppo_loss_clips_the_ratio_by_hand() -> None:
    loss, st = _loss()
    # Row 0: ratio 1.5, A=+1 -> min(1.5, 1.2) = 1.2. Row 1: ratio 0.5, A=-1 -> min(-0.5, -0.8) = -0.8.
    pg = -(1.2 + -0.8) / 2
    v = 0.5 * ((1.0 - 2.0) ** 2 + 0.0) / 2
    assert st["policy_loss"].item() == pytest.approx(pg, rel=1e-6)
    assert st["value_loss"].item() == pytest.approx(v, rel=1e-6)
    assert loss.item() == pytest.approx(pg + 0.5 * v - 0.01 * 0.7, rel=1e-6)
    assert st["clip_fraction"].item() == pytest.approx(1.0)
    kl = ((1.5 - 1) - math.log(1.5) + (0.5 - 1) - math.log(0.5)) / 2
    assert st["approx_kl"].item() == pytest.approx(kl, rel=1e-5)


def test_ppo_loss_masks_rows_and_clips_values() -> None:
    _, st = _loss(policy_mask=torch.tensor([True, False]), value_mask=torch.tensor([False, True]))
    assert st["policy_loss"].item() == pytest.approx(-1.2)
    assert st["value_loss"].item() == pytest.approx(0.0)
    coefs = LossCoefs(clip=0.2, value_coef=0.5, entropy_coef=0.0, clip_value=True)
    # Value moved 1.0 -> 1.5 towards a return of 2: the clipped value 1.2 has the larger error.
    _, st = _loss(new_values=torch.tensor([1.5, 2.0]), old_values=torch.tensor([1.0, 2.0]), coefs=coefs)
    assert st["value_loss"].item() == pytest.approx(0.5 * (0.8**2) / 2, rel=1e-5)


def test_decoupled_ratio_uses_the_proximal_policy_and_a_capped_weight() -> None:
    coefs = LossCoefs(clip=0.2, entropy_coef=0.0, clip_value=False, is_cap=2.0)
    _, st = _loss(
        new_log_probs=torch.tensor([0.0, 0.0]),
        behaviour_log_probs=torch.tensor([0.0, math.log(0.25)]),
        proximal_log_probs=torch.tensor([0.0, 0.0]),
        advantages=torch.tensor([1.0, 1.0]),
        coefs=coefs,
    )
    # ratio pi/proximal = 1 for both; weights proximal/behaviour = 1 and min(4, 2) = 2.
    assert st["policy_loss"].item() == pytest.approx(-(1.0 * 1 + 1.0 * 2) / 2)


# -- masking inside a real update ----------------------------------------------------------------
OBS, ACT, N = 5, 2, 64


def _batch(
    rng: np.random.Generator, versions: np.ndarray, fallback: np.ndarray, autoreset: np.ndarray
) -> Batch:
    return random_batch(rng, N, OBS, ACT, versions=versions, fallback=fallback, autoreset=autoreset)


def _update(
    tmp_path: Path, batch: Batch, version: int, **config: Any
) -> tuple[dict[str, float], list[torch.Tensor]]:
    settings: dict[str, Any] = {"batch_steps": N, "minibatch_size": 16, "epochs": 2, "max_policy_lag": 1}
    cfg = TrainerConfig(**{**settings, "seed": 3, "anneal_lr": False, **config})
    trainer = Trainer(
        cfg, build_policy("mlp-small", OBS, ACT, seed=0), "unused:0", tmp_path, tensorboard=False
    )
    trainer.state.version = version
    scalars = trainer.update(batch)
    return scalars, [p.detach().clone() for p in trainer.policy.module.parameters()]


def test_running_mean_std_in_chunks_matches_numpy_over_all_of_it() -> None:
    data = np.random.default_rng(0).normal(3.0, 2.0, size=1000)
    rms = RunningMeanStd()
    for chunk in np.split(data, [1, 10, 10, 400]):  # sizes 1, 9, 0, 390, 600
        rms.update(chunk)
    assert rms.count == pytest.approx(1000, abs=1e-3)  # its prior counts 1e-4
    assert rms.mean == pytest.approx(data.mean(), rel=1e-6)
    assert rms.var == pytest.approx(data.var(), rel=1e-6)


def test_reward_scaler_divides_by_the_std_of_returns_kept_per_env_and_reset_at_episode_ends() -> None:
    scaler = RewardScaler(gamma=0.5)
    a0 = ("stream-a", 0)
    first = scaler.scale(a0, np.array([1.0, 1.0, 1.0]), np.array([False, True, False]))
    # returns 1, 0.5 * 1 + 1 = 1.5, then the episode ended: 1
    later = scaler.scale(a0, np.array([2.0]), np.array([False]))  # 0.5 * 1 + 2 = 2.5, carried over
    other = scaler.scale(("stream-b", 0), np.array([2.0]), np.array([False]))  # its own: 2
    returns = np.array([1.0, 1.5, 1.0, 2.5, 2.0])
    assert scaler.rms.mean == pytest.approx(returns.mean(), rel=1e-4)
    assert scaler.rms.var == pytest.approx(returns.var(), rel=1e-3)
    for scaled, rewards, seen in ((first, 1.0, 3), (later, 2.0, 4), (other, 2.0, 5)):
        assert scaled.dtype == np.float32
        np.testing.assert_allclose(scaled, rewards / returns[:seen].std(), rtol=1e-3)

    clipped = RewardScaler(gamma=0.5, clip=1.0)  # returns -1, -1.5: std 0.25, so -1 / 0.25 = -4
    np.testing.assert_array_equal(clipped.scale(a0, -np.ones(2), np.zeros(2, bool)), [-1.0, -1.0])


def test_segment_positions_restart_at_each_segment() -> None:
    end = np.array([False, False, True, False, True, True, False, True])
    assert segment_positions(end).tolist() == [0, 1, 2, 0, 1, 0, 0, 1]


def test_group_advantages_standardise_within_each_group_over_counted_rows() -> None:
    returns = np.array([1.0, 3.0, 10.0, 20.0, 99.0, 7.0, 4.0, 4.0])
    groups = np.array([0, 0, 1, 1, 1, 2, 3, 3])
    mask = np.array([True, True, True, True, False, True, True, True])
    adv = group_advantages(returns, groups, mask, eps=0.0)
    # group 0: mean 2, std 1; group 1 counts 10 and 20 only (mean 15, std 5), 99 is out;
    # groups 2 and 3 have no spread: no signal
    np.testing.assert_allclose(adv, [-1.0, 1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0], rtol=1e-6)


def test_group_baseline_trains_the_actor_and_leaves_the_critic_alone(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    batch = _batch(rng, np.full(N, 10, np.int64), np.zeros(N, bool), np.zeros(N, bool))
    batch.segment_end[N // 2 - 1] = True  # two segments: groups are positions 0..N/2-1
    before = [p.detach().clone() for p in build_policy("mlp-small", OBS, ACT, seed=0).parameters()]
    scalars, after = _update(tmp_path, batch, version=10, baseline="group")
    names = [name for name, _ in build_policy("mlp-small", OBS, ACT, seed=0).named_parameters()]
    moved = {n for n, p, q in zip(names, before, after, strict=True) if not torch.equal(p, q)}
    assert moved and all(not n.startswith("critic.") for n in moved)
    assert any(n.startswith("actor_mean.") for n in moved)
    assert scalars["losses/value_loss"] == 0.0
    with pytest.raises(ValueError, match="baseline"):
        TrainerConfig(baseline="mean")


def test_target_kl_ends_an_update_after_the_epoch_that_passed_it(tmp_path: Path) -> None:
    batch = _batch(np.random.default_rng(0), np.full(N, 10, np.int64), np.zeros(N, bool), np.zeros(N, bool))
    one, after_one = _update(tmp_path / "one", batch, version=10, epochs=1)
    # any move passes a KL of 1e-12: the second of two epochs is not run
    stopped, after_stopped = _update(tmp_path / "stopped", batch, version=10, target_kl=1e-12)
    # a KL never reached: both epochs run
    both, after_both = _update(tmp_path / "both", batch, version=10, target_kl=10.0)
    assert (one["losses/early_stop"], stopped["losses/early_stop"], both["losses/early_stop"]) == (0, 1, 0)
    assert stopped["losses/approx_kl"] > 1e-12
    for p, q in zip(after_one, after_stopped, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert any(not torch.equal(p, q) for p, q in zip(after_one, after_both, strict=True))


def test_masked_rows_do_not_move_the_policy(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    versions = np.full(N, 10, np.int64)
    versions[:8] = 7  # lag 3 > max_policy_lag 1: stale
    fallback = np.zeros(N, bool)
    fallback[8:12] = True
    autoreset = np.zeros(N, bool)
    autoreset[12:14] = True
    batch = _batch(rng, versions, fallback, autoreset)
    scalars, params = _update(tmp_path / "a", batch, version=10)
    assert scalars["staleness/masked_stale_fraction"] == pytest.approx(8 / N)
    assert scalars["staleness/masked_fallback_fraction"] == pytest.approx(4 / N)
    assert scalars["staleness/masked_autoreset_fraction"] == pytest.approx(2 / N)
    assert scalars["staleness/lag_max"] == 3.0 and scalars["staleness/lag_min"] == 0.0

    # Garbage actions and log-probs on masked rows change nothing...
    masked = np.zeros(N, bool)
    masked[:14] = True
    noisy = _batch(np.random.default_rng(0), versions, fallback, autoreset)
    noisy.actions[masked] += 5.0
    noisy.log_probs[masked] -= 7.0
    _, same = _update(tmp_path / "b", noisy, version=10)
    for p, q in zip(params, same, strict=True):
        torch.testing.assert_close(p, q)
    # ...while the same change on live rows does (the comparison can fail). Several rows: for
    # one row alone the clipped objective can be flat (negative advantage, ratio below 1 - eps).
    live = _batch(np.random.default_rng(0), versions, fallback, autoreset)
    live.actions[20:32] += 5.0
    live.log_probs[20:32] -= 7.0
    _, moved = _update(tmp_path / "c", live, version=10)
    assert any(not torch.equal(p, q) for p, q in zip(params, moved, strict=True))


def test_a_trainer_opens_its_metrics_log_only_for_a_run(tmp_path: Path) -> None:
    """Built and updated without :meth:`Trainer.run` (as a library user or a test does), a
    trainer holds no open metrics file nor TensorBoard writer (whose thread would outlive it)."""
    run_dir = tmp_path / "run"
    with unclosed_resources() as unclosed:
        trainer = Trainer(
            TrainerConfig(batch_steps=N, minibatch_size=16, epochs=1),
            build_policy("mlp-small", OBS, ACT),
            "unused:0",
            run_dir,
        )
        trainer.update(random_batch(np.random.default_rng(0), N, OBS, ACT))
        del trainer
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "tb").exists()  # tb: the writer's
    ours = [message for message in unclosed if str(run_dir) in message]
    assert not ours, ours


def test_metrics_lines_are_standard_json_with_non_finite_values_as_null(tmp_path: Path) -> None:
    import json

    from edgerl.trainer.trainer import MetricsLog

    metrics = MetricsLog(tmp_path, tensorboard=False)
    metrics.write(64, {"losses/explained_variance": float("nan"), "losses/value": 0.5, "x": float("inf")})
    metrics.close()

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    row = json.loads(line, parse_constant=refuse)
    assert row["global_step"] == 64 and row["losses/value"] == 0.5
    assert row["losses/explained_variance"] is None and row["x"] is None
