"""The torch policy: normaliser statistics, log-densities, served log-probs."""

import numpy as np
import pytest
import torch

from edgerl.edge_server.policy import TorchPolicyBackend, _padded_rows
from edgerl.launch.processes import PolicySpec, build_backend
from edgerl.models import GaussianMLPPolicy, RunningNorm, build_policy, gaussian_log_prob


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


def _module_mean_and_value(policy: GaussianMLPPolicy, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        mean, _ = policy.distribution(torch.from_numpy(obs))
        return mean.numpy(), policy.value(torch.from_numpy(obs)).numpy()


def test_the_served_forward_pass_is_the_modules() -> None:
    rng = np.random.default_rng(2)
    policy = build_policy("mlp-small", 5, 4, seed=2)
    policy.obs_norm.update(torch.from_numpy(rng.normal(3.0, 2.0, size=(500, 5)).astype(np.float32)))
    backend = TorchPolicyBackend(policy, -np.ones(2), np.ones(2), compute_values=True, chunk=2)
    obs = rng.normal(3.0, 20.0, size=(16, 5)).astype(np.float32)  # some rows hit the normaliser's clip
    out = backend.infer(obs)
    mean, value = _module_mean_and_value(policy, obs)
    assert out.values is not None
    np.testing.assert_allclose(out.values, value, rtol=1e-5, atol=1e-5)
    # actions = mean + std * noise with std 1: the mean is recovered from the log-prob's noise term
    noise = out.actions.reshape(16, 4) - mean
    np.testing.assert_allclose(out.log_probs, -0.5 * (noise**2 + np.log(2 * np.pi)).sum(-1), rtol=1e-4)
    assert out.actions.shape == (16, 2, 2)


@pytest.mark.parametrize(("cols", "stride"), [(1024, 1040), (64, 80), (17, 48), (6, 16), (1, 16)])
def test_served_weights_rows_start_an_odd_number_of_cache_lines_apart(cols: int, stride: int) -> None:
    matrix = torch.randn(3, cols)
    padded = _padded_rows(matrix)
    assert padded.shape == matrix.shape
    assert padded.stride() == (stride, 1)  # float32: 16 values per 64-byte line
    assert torch.equal(padded, matrix)


def test_the_frozen_normaliser_is_the_modules_and_ignores_later_updates() -> None:
    rng = np.random.default_rng(4)
    norm = RunningNorm((3,), clip=2.0)
    norm.update(torch.from_numpy(rng.normal(1.0, 3.0, size=(200, 3)).astype(np.float32)))
    frozen = norm.frozen()
    x = rng.normal(1.0, 12.0, size=(50, 3)).astype(np.float32)
    with torch.no_grad():
        expected = norm(torch.from_numpy(x)).numpy()
    assert np.abs(expected).max() == 2.0  # some rows are clipped
    np.testing.assert_allclose(frozen(x), expected, rtol=1e-6, atol=1e-6)
    norm.update(torch.from_numpy(rng.normal(-5.0, 1.0, size=(200, 3)).astype(np.float32)))
    np.testing.assert_allclose(frozen(x), expected, rtol=1e-6, atol=1e-6)  # a copy, not a view


def test_a_weight_swap_changes_the_served_forward_pass() -> None:
    obs = np.random.default_rng(3).normal(size=(8, 5)).astype(np.float32)
    backend = TorchPolicyBackend(
        build_policy("mlp-small", 5, 2, seed=0), -np.ones(2), np.ones(2), compute_values=True
    )
    other = build_policy("mlp-small", 5, 2, seed=1)
    before = backend.infer(obs).values
    backend.load_weights({k: v.numpy() for k, v in other.state_dict().items()}, version=1)
    after = backend.infer(obs).values
    assert before is not None and after is not None
    np.testing.assert_allclose(after, _module_mean_and_value(other, obs)[1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(before, after)


def test_a_layer_the_server_cannot_run_is_refused() -> None:
    policy = build_policy("mlp-small", 5, 2)
    policy.actor_mean[1] = torch.nn.ReLU()
    with pytest.raises(TypeError, match="ReLU"):
        TorchPolicyBackend(policy, -np.ones(2), np.ones(2))


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
