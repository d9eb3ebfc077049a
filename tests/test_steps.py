"""The hand-written Gaussian MLP step against torch autograd: loss, stats, gradients, Adam, updates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edgerl.models import GaussianMLPPolicy, build_policy
from edgerl.trainer.config import TrainerConfig
from edgerl.trainer.policies import Evaluation, GaussianTrainable, TrainablePolicy
from edgerl.trainer.ppo import LossCoefs
from edgerl.trainer.steps import (
    AutogradStep,
    FlatAdam,
    FlatParams,
    GaussianMLPStep,
    Targets,
    minibatch_step,
)
from edgerl.trainer.trainer import Trainer
from tests.helpers import random_batch

OBS, ACT, K = 7, 3, 48


def _rows(policy: GaussianTrainable, rng: np.random.Generator, decoupled: bool) -> Targets:
    """Targets that reach every branch: ratios clipped above and below (with either sign of
    advantage), exactly 1 (ties inside the range), values moved past the value clip and not."""
    with torch.no_grad():
        current = policy.evaluate(torch.arange(K))
    log_probs = current.log_probs.numpy()
    shift = rng.choice([-0.6, -0.1, 0.0, 0.1, 0.6], size=K).astype(np.float32)
    behaviour = log_probs + shift  # ratio exp(-shift): 1.82, 1.1, 1, 0.9, 0.55
    values = current.values.numpy()
    old_values = values + rng.choice([-1.0, -0.05, 0.0, 0.05, 1.0], size=K).astype(np.float32)
    return Targets(
        behaviour_log_probs=behaviour,
        advantages=rng.standard_normal(K).astype(np.float32),
        old_values=old_values,
        returns=rng.standard_normal(K).astype(np.float32) * 2,
        policy_mask=(rng.random(K) > 0.2).astype(np.float32),
        value_mask=(rng.random(K) > 0.2).astype(np.float32),
        proximal_log_probs=(behaviour + rng.normal(0, 0.5, K).astype(np.float32)) if decoupled else None,
    )


def _prepared(net: GaussianMLPPolicy, rng: np.random.Generator) -> GaussianTrainable:
    with torch.no_grad():
        net.actor_log_std.copy_(torch.linspace(-0.5, 0.3, ACT))
        net.obs_norm.update(torch.from_numpy(rng.standard_normal((100, OBS)).astype(np.float32) * 3))
    policy = GaussianTrainable(net)
    policy.prepare(
        rng.standard_normal((K, OBS)).astype(np.float32) * 2,
        rng.standard_normal((K, ACT)).astype(np.float32),
    )
    return policy


def _autograd(
    policy: GaussianTrainable, targets: Targets, coefs: LossCoefs
) -> tuple[float, dict[str, float], np.ndarray]:
    """Loss, stats and gradient vector of ``ppo_loss`` differentiated by torch."""
    loss, stats = AutogradStep(policy, coefs, 1e-3, 0.5).loss(np.arange(K), targets, with_stats=True)
    policy.module.zero_grad()
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in policy.module.parameters() if p.grad is not None])
    return loss.item(), {k: float(v) for k, v in stats.items()}, grads.numpy().copy()


@pytest.mark.parametrize("hidden", [(64, 64), (16, 8, 12)])
@pytest.mark.parametrize(
    ("clip_value", "entropy_coef", "decoupled"),
    [(True, 0.0, False), (False, 0.01, False), (True, 0.01, True)],
)
def test_loss_stats_and_gradients_equal_autograd(
    hidden: tuple[int, ...], clip_value: bool, entropy_coef: float, decoupled: bool
) -> None:
    rng = np.random.default_rng(1)
    policy = _prepared(GaussianMLPPolicy(OBS, ACT, hidden), rng)
    targets = _rows(policy, rng, decoupled)
    coefs = LossCoefs(clip=0.2, value_coef=0.5, entropy_coef=entropy_coef, clip_value=clip_value, is_cap=1.5)
    ref_loss, ref_stats, ref_grad = _autograd(policy, targets, coefs)
    assert 0.05 < ref_stats["clip_fraction"] < 0.95  # both branches of the clip are taken

    step = GaussianMLPStep(policy, coefs, learning_rate=1e-3, max_grad_norm=0.5)
    obs, actions = policy.prepared
    loss, stats = step.gradients(obs, actions, targets, with_stats=True)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert stats.keys() == ref_stats.keys()
    for name, value in ref_stats.items():
        assert stats[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    # Same layout: FlatParams keeps the module's parameter order.
    np.testing.assert_allclose(step.flat.grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert np.abs(ref_grad).max() > 1e-2


def test_flat_params_are_the_modules_parameters() -> None:
    net = build_policy("mlp-small", OBS, ACT, seed=0)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    flat = FlatParams(net)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # rebinding kept the values
    flat.vector[:] = 0.25  # writes through the flat vector are the module's weights...
    assert all(bool((p == 0.25).all()) for p in net.parameters())
    net.load_state_dict(before)  # ...and loading weights writes into the flat vector
    first = net.actor_mean[0]
    assert isinstance(first, torch.nn.Linear)
    np.testing.assert_array_equal(flat.view(first.weight), before["actor_mean.0.weight"].numpy())
    np.testing.assert_array_equal(flat.view(net.actor_log_std), before["actor_log_std"].numpy())
    with pytest.raises(TypeError, match="float32"):
        FlatParams(torch.nn.Linear(2, 2).double())


def test_flat_adam_matches_torch_adam() -> None:
    rng = np.random.default_rng(0)
    start = rng.standard_normal(50).astype(np.float32)
    ref = torch.nn.Parameter(torch.from_numpy(start.copy()))
    torch_adam = torch.optim.Adam([ref], lr=3e-3, eps=1e-5)
    params = start.copy()
    adam = FlatAdam(params, lr=3e-3, eps=1e-5)
    for i in range(20):
        g = rng.standard_normal(50).astype(np.float32) * (10.0 if i % 7 == 0 else 0.1)
        if i == 10:  # a learning-rate change (annealing) is seen by the next step
            torch_adam.param_groups[0]["lr"] = adam.param_groups[0]["lr"] = 1e-3
        ref.grad = torch.from_numpy(g)
        torch_adam.step()
        adam.step(g)
    np.testing.assert_allclose(params, ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(params - start).max() > 1e-2

    restored = FlatAdam(np.zeros(50, np.float32), lr=1.0)
    restored.load_state_dict(adam.state_dict())
    assert restored.steps == 20 and restored.param_groups[0]["lr"] == 1e-3
    np.testing.assert_array_equal(restored.exp_avg_sq, adam.exp_avg_sq)
    with pytest.raises(ValueError, match="FlatAdam"):
        FlatAdam(np.zeros(3, np.float32), lr=1.0).load_state_dict(adam.state_dict())
    with pytest.raises(ValueError, match="FlatAdam"):
        restored.load_state_dict(torch_adam.state_dict())


def _trainer(tmp_path: Path, backend: str, **config: Any) -> Trainer:
    cfg = TrainerConfig(
        batch_steps=128, minibatch_size=32, epochs=3, seed=5, update_backend=backend, **config
    )
    net = build_policy("mlp-small", OBS, ACT, seed=0)
    return Trainer(cfg, net, "unused:0", tmp_path / backend, tensorboard=False)


@pytest.mark.parametrize("decoupled", [False, True])
def test_whole_updates_agree_between_backends(tmp_path: Path, decoupled: bool) -> None:
    trainers = [_trainer(tmp_path, b, decoupled=decoupled) for b in ("autograd", "numpy")]
    assert isinstance(trainers[0].minibatch_step, AutogradStep)
    assert isinstance(trainers[1].minibatch_step, GaussianMLPStep)
    start = [p.detach().clone() for p in trainers[0].policy.module.parameters()]
    scalars = []
    for trainer in trainers:
        rng = np.random.default_rng(2)
        for _ in range(2):  # two updates: Adam state and the normaliser carry over
            out = trainer.update(random_batch(rng, 128, OBS, ACT))
        scalars.append(out)
    a, b = (list(t.policy.module.parameters()) for t in trainers)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
    assert max(float((p - s).detach().abs().max()) for p, s in zip(a, start, strict=True)) > 1e-3
    for name in ("losses/policy_loss", "losses/value_loss", "losses/approx_kl", "losses/entropy"):
        assert scalars[1][name] == pytest.approx(scalars[0][name], rel=1e-3, abs=1e-6), name


def test_checkpoints_keep_the_flat_optimizer_and_refuse_the_other_backends(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "numpy")
    trainer.update(random_batch(np.random.default_rng(0), 128, OBS, ACT))
    trainer.save_checkpoint()
    resumed = Trainer(
        trainer.config,
        build_policy("mlp-small", OBS, ACT, seed=9),
        "unused:0",
        trainer.run_dir,
        resume=True,
        tensorboard=False,
    )
    opt = resumed.minibatch_step.optimizer
    assert isinstance(opt, FlatAdam) and opt.steps == 12  # 3 epochs x 4 minibatches
    np.testing.assert_array_equal(opt.exp_avg, trainer.minibatch_step.optimizer.exp_avg)
    for p, q in zip(resumed.policy.module.parameters(), trainer.policy.module.parameters(), strict=True):
        assert torch.equal(p, q)
    config = TrainerConfig(batch_steps=128, minibatch_size=32, update_backend="autograd")
    with pytest.raises(ValueError, match="update_backend"):
        Trainer(
            config,
            build_policy("mlp-small", OBS, ACT),
            "unused:0",
            trainer.run_dir,
            resume=True,
            tensorboard=False,
        )


class _Opaque(TrainablePolicy):
    kind = "opaque"

    def __init__(self) -> None:
        self.module = torch.nn.Linear(2, 1)

    def values(self, obs: np.ndarray) -> np.ndarray:
        return np.zeros(len(obs), np.float32)

    def prepare(self, obs: np.ndarray, actions: np.ndarray) -> None:
        pass

    def evaluate(self, idx: torch.Tensor) -> Evaluation:
        raise NotImplementedError

    def served_state(self) -> dict[str, torch.Tensor]:
        return {}


def test_backend_choice_and_errors() -> None:
    coefs = LossCoefs()
    assert isinstance(minibatch_step(_Opaque(), coefs, learning_rate=1e-3, max_grad_norm=0.5), AutogradStep)
    with pytest.raises(ValueError, match="numpy: only for the Gaussian MLP"):
        minibatch_step(_Opaque(), coefs, learning_rate=1e-3, max_grad_norm=0.5, backend="numpy")
    with pytest.raises(ValueError, match="update_backend must be one of"):
        TrainerConfig(update_backend="jax")
