"""The torch implementation of :class:`~edgerl.edge_server.backend.PolicyBackend`."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from edgerl.edge_server.backend import PolicyBackend, PolicyResult, check_weights
from edgerl.models import LOG_2PI, GaussianMLPPolicy, mlp_linears

_LOG_2PI = np.float32(LOG_2PI)


class TorchPolicyBackend(PolicyBackend):
    """A :class:`GaussianMLPPolicy` evaluated with torch on the CPU.

    With ``chunk=K > 1`` the network's action head holds ``K`` actions of the
    ``len(act_low)`` dimensions of the env, and each observation is answered
    by a chunk ``[K, act_dim]`` whose log-probability sums over the chunk.
    """

    name = "torch-mlp"

    def __init__(
        self,
        policy: GaussianMLPPolicy,
        act_low: np.ndarray,
        act_high: np.ndarray,
        *,
        seed: int = 0,
        version: int = 0,
        compute_values: bool = False,
        chunk: int = 1,
    ) -> None:
        step_dim = int(np.asarray(act_low).size)
        if chunk < 1 or policy.act_dim != chunk * step_dim:
            raise ValueError(
                f"chunk: the policy outputs {policy.act_dim} values, "
                f"not chunk={chunk} x {step_dim} action dims"
            )
        super().__init__((policy.obs_dim,), (step_dim,), act_low, act_high, version)
        self.chunk = chunk
        self.policy = policy.eval()
        self.compute_values = compute_values
        self._rng = np.random.default_rng(seed)
        self._served = _ServedMLP(self.policy, compute_values)
        self.weights_values = sum(v.numel() for v in self.policy.state_dict().values())
        self.torch_threads = torch.get_num_threads()
        """Threads of torch's math kernels in every thread that infers: the count set when the
        backend was built (``torch.set_num_threads``)."""

    def init_thread(self) -> None:
        """Give this thread the backend's torch thread count.

        OpenMP keeps the count per thread: a thread started after ``torch.set_num_threads(1)``
        still ran MKL's kernels on as many OpenMP threads as the machine has CPUs. On two CPUs,
        a 1-row forward pass then took 0.23 ms, burning both cores, against 0.06 ms on one; in a
        server kept to one CPU, 57 ms (its OpenMP threads spun, waiting for one another).
        """
        torch.set_num_threads(self.torch_threads)

    def load_weights(self, weights: dict[str, np.ndarray], version: int) -> None:
        """Serve ``weights`` from now on, stamped ``version``.

        Raises:
            KeyError, ValueError: tensors missing, unknown or of another shape, values that do
                not fit the module's dtype (:func:`check_fits`), or weights that cannot give finite
                actions (:meth:`_ServedMLP._check`); the served weights and the module's stay as
                they were.
        """
        current = self.policy.state_dict()
        check_weights(weights, {k: tuple(v.shape) for k, v in current.items()})
        for k, v in weights.items():
            check_fits(k, v, current[k].dtype)
        state = {k: torch.from_numpy(np.array(v)).to(current[k].dtype) for k, v in weights.items()}
        served = _ServedMLP(self.policy, self.compute_values, state)  # checked: ValueError
        self.policy.load_state_dict(state)
        self._served = served
        self.version = version

    def infer(self, obs: np.ndarray) -> PolicyResult:
        served = self._served
        mean, values = served.forward(obs)
        # Sampling runs in numpy, which costs a few microseconds per op on these
        # small arrays instead of tens.
        noise = self._rng.standard_normal(mean.shape, dtype=np.float32)
        actions = mean + noise * served.std
        log_probs = -0.5 * (noise * noise + _LOG_2PI).sum(-1) - served.log_std_sum
        if self.chunk > 1:
            actions = actions.reshape(len(obs), self.chunk, *self.act_shape)
        return PolicyResult(
            actions=actions, log_probs=log_probs.astype(np.float32, copy=False), values=values
        )


_NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def check_fits(name: str, value: np.ndarray, dtype: torch.dtype) -> None:
    """Check that ``value`` (a weight a trainer sent, maybe of another dtype: a numpy trainer's
    FLOAT64) keeps finite when cast to the served ``dtype``. Costs nothing where no cast is needed,
    and two passes over the values where one is (a float32 weight served as bfloat16).

    Raises:
        ValueError: a finite value past the range of ``dtype`` (``1e300`` as float32), which the
            cast would make Inf: such a bias in the value head made every answer's value Inf.
    """
    if not dtype.is_floating_point or value.dtype.kind == "b" or not value.size:
        return
    if (
        value.dtype == _NUMPY_DTYPES.get(dtype)
        or max(float(value.max()), -float(value.min())) <= torch.finfo(dtype).max
    ):
        return
    cast = torch.from_numpy(np.array(value)).to(dtype)  # exact: a value just past the top rounds to it
    bad = (~torch.isfinite(cast)).reshape(-1).nonzero()
    if len(bad):
        flat = int(bad[0])
        index = [int(i) for i in np.unravel_index(flat, value.shape)] if value.ndim > 1 else flat
        raise ValueError(
            f"weights[{name!r}]: {value.reshape(-1)[flat].item()!r} at index {index} is past the "
            f"range of {str(dtype).removeprefix('torch.')} ({len(bad)} such values in all)"
        )


class _ServedMLP:
    """A copy of a :class:`GaussianMLPPolicy`'s weights laid out for small-batch inference.

    Each layer is one ``torch.addmm`` on a weight stored ``[in, out]``, each
    activation an in-place ``tanh_``, and the observation normaliser runs in
    numpy: fewer, cheaper ops than the module's own forward pass, whose per-op
    overhead dominates at batch sizes of a few dozen rows. On 32-row batches
    (sampling included) this took 220 us where the module's forward alone
    took 350 us with the ``mlp`` preset, and 1.0 ms where it took 1.4 ms with
    three 768-wide layers (``mlp-large`` then). The copy is taken at
    construction and after each weight swap: change the module's weights
    through :meth:`TorchPolicyBackend.load_weights` only.
    """

    def __init__(
        self, policy: GaussianMLPPolicy, with_critic: bool, state: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """The served copy of ``policy``'s weights, or of ``state`` (a full ``state_dict`` of it:
        the module is left as it is).

        Raises:
            ValueError: weights that cannot give finite actions (:meth:`_check`).
        """
        state = policy.state_dict() if state is None else state
        self.obs_norm = policy.obs_norm.frozen(state["obs_norm.mean"], state["obs_norm.var"])
        self.log_std = state["actor_log_std"].numpy().astype(np.float32, copy=True)
        with np.errstate(over="ignore"):  # an overflow is what _check() refuses
            # Fixed between weight swaps: computed here, not for every batch.
            self.std = np.exp(self.log_std)
        self.log_std_sum = self.log_std.sum()
        names = {module: name for name, module in policy.named_modules()}
        self.actor = self._layers(policy.actor_mean, names, state)
        self.critic = self._layers(policy.critic, names, state) if with_critic else None
        self._check(state["obs_norm.var"])

    @staticmethod
    def _layers(
        seq: nn.Module, names: Mapping[nn.Module, str], state: Mapping[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(weight ``[in, out]``, bias) of each layer; a tanh follows every layer but the last."""
        return [
            (_padded_rows(state[f"{names[m]}.weight"].t()), state[f"{names[m]}.bias"].clone())
            for m in mlp_linears(seq)
        ]

    def _check(self, var: torch.Tensor) -> None:
        """Refuse weights that cannot give finite actions: an observation variance ``var`` below 0
        (the normaliser divides by ``sqrt(var + eps)``), an action std ``exp(log_std)`` that
        overflows float32, or a forward pass that is not finite on the mean observation.

        Raises:
            ValueError: naming the tensor, or the output, and the first bad index.
        """
        norm_std = self.obs_norm.std
        if (bad := np.flatnonzero(~(np.isfinite(norm_std) & (norm_std > 0)))).size:
            raise ValueError(
                f"weights['obs_norm.var']: a variance must be >= 0 (the observations are divided "
                f"by sqrt(var + eps)), got {var.reshape(-1)[bad[0]].item()} at index {bad[0]}"
            )
        if (bad := np.flatnonzero(~np.isfinite(self.std))).size:
            raise ValueError(
                f"weights['actor_log_std']: the action std exp(log_std) must be finite, got "
                f"log_std {self.log_std[bad[0]]} at index {bad[0]}"
            )
        mean, values = self.forward(self.obs_norm.mean[None, :])
        for what, out in (("action means", mean), ("values", values)):
            if out is not None and (bad := np.flatnonzero(~np.isfinite(out))).size:
                raise ValueError(
                    f"weights: the policy's {what} on its mean observation are not finite "
                    f"({out.ravel()[bad[0]]} at index {bad[0]})"
                )

    @staticmethod
    def _run(layers: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> np.ndarray:
        for i, (weight, bias) in enumerate(layers):
            x = torch.addmm(bias, x, weight)
            if i < len(layers) - 1:
                x.tanh_()
        return x.numpy()

    def forward(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Action means ``[n, act_dim]`` and, with the critic, values ``[n]``."""
        x = torch.from_numpy(self.obs_norm(obs))
        mean = self._run(self.actor, x)
        values = None if self.critic is None else self._run(self.critic, x)[:, 0]
        return mean, values


_CACHE_LINE_BYTES = 64


def _padded_rows(matrix: torch.Tensor) -> torch.Tensor:
    """A copy of 2-D ``matrix`` whose rows start an odd number of cache lines apart.

    A row stride of a power of two (1024 float32 values: 4 KiB) maps the same column of
    successive rows onto the same few cache sets, and the matrix product then evicts what
    it is about to reuse. Padding each row to an odd number of lines spreads them out: the
    served forward pass of three 1024-wide layers took 0.90 ms instead of 1.15 ms on 32 rows
    and 1.56 ms instead of 2.07 ms on 64 (512 wide: 17 % faster; 64 and 256 wide: the same).
    The result is a view of the padded buffer with ``matrix``'s shape and values.
    """
    rows, cols = matrix.shape
    per_line = max(1, _CACHE_LINE_BYTES // matrix.element_size())
    lines = -(-cols // per_line)
    lines += 1 - lines % 2
    buffer = matrix.new_zeros((rows, lines * per_line))
    buffer[:, :cols] = matrix
    return buffer[:, :cols]
