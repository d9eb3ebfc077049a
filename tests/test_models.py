"""The torch policy: normaliser statistics, log-densities, served log-probs."""

import numpy as np
import torch

from edgerl.edge_server.policy import TorchPolicyBackend
from edgerl.launch.processes import PolicySpec, build_backend
from edgerl.models import RunningNorm, build_policy, gaussian_log_prob


def test_running_norm_matches_numpy_over_batches() -> None:
    rng = np.random.default_rng(0)
    data = rng.normal(3.0, 2.0, size=(1000, 5)).astype(np.float32)
    norm = RunningNorm((5,))
    for chunk in np.array_split(data, 7):
        norm.update(torch.from_numpy(chunk))
    np.testing.assert_allclose(norm.mean.numpy(), data.mean(0), rtol=1e-4)
    np.testing.assert_allclose(norm.var.numpy(), data.var(0), rtol=1e-3)
    out = norm(torch.from_numpy(data)).numpy()
    np.testing.assert_allclose(out.mean(0), 0.0, atol=1e-3)
    np.testing.assert_allclose(out.std(0), 1.0, atol=1e-3)


def test_gaussian_log_prob_matches_torch_distributions() -> None:
    mean, log_std = torch.randn(4, 3), torch.randn(3) * 0.3
    actions = torch.randn(4, 3)
    expected = torch.distributions.Normal(mean, log_std.exp()).log_prob(actions).sum(-1)  # type: ignore[no-untyped-call]
    torch.testing.assert_close(gaussian_log_prob(mean, log_std, actions), expected)


def test_served_log_probs_are_those_of_the_served_actions() -> None:
    policy = build_policy("mlp", 17, 6, seed=3)
    with torch.no_grad():
        policy.actor_log_std.fill_(-0.5)
    backend = TorchPolicyBackend(policy, -np.ones(6), np.ones(6), seed=1)
    obs = np.random.default_rng(1).normal(size=(32, 17)).astype(np.float32)
    out = backend.infer(obs)
    with torch.no_grad():
        mean, log_std = policy.distribution(torch.from_numpy(obs))
        recomputed = gaussian_log_prob(mean, log_std, torch.from_numpy(out.actions)).numpy()
    np.testing.assert_allclose(out.log_probs, recomputed, atol=1e-4)
    assert out.actions.dtype == np.float32 and out.log_probs.dtype == np.float32


def test_log_std_init_is_the_servers_and_the_trainers_initial_noise() -> None:
    assert torch.equal(build_policy("mlp-small", 17, 6).actor_log_std.detach(), torch.zeros(6))
    trainer_net = build_policy("mlp-small", 17, 6, seed=4, log_std_init=-1.0)
    assert torch.equal(trainer_net.actor_log_std.detach(), torch.full((6,), -1.0))
    backend, _ = build_backend(PolicySpec("HalfCheetah-v5", "mlp-small", seed=4, log_std_init=-1.0))
    assert isinstance(backend, TorchPolicyBackend)
    served = backend.policy.state_dict()
    assert torch.equal(served["actor_log_std"], torch.full((6,), -1.0))
    for name, value in trainer_net.state_dict().items():  # (orthogonal init: last bits vary with threads)
        torch.testing.assert_close(served[name], value, rtol=1e-5, atol=1e-6)


def test_presets_are_deterministic_in_the_seed() -> None:
    a, b, c = (
        build_policy("mlp", 4, 2, seed=5),
        build_policy("mlp", 4, 2, seed=5),
        build_policy("mlp", 4, 2, 6),
    )
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(pa, pb)
        if name.endswith("weight"):
            assert not torch.equal(pa, pc)
