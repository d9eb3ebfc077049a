"""The trainer's settings (:class:`TrainerConfig`), apart from the trainer: they import no
torch, so that the launcher reads and checks a run's settings without it."""

from __future__ import annotations

from dataclasses import dataclass

from edgerl.proto.settings import check_finite

BASELINES = ("critic", "group")
UPDATE_BACKENDS = ("auto", "autograd", "numpy")
"""``TrainerConfig.update_backend`` choices."""


def check_backend(backend: str) -> None:
    """Raise ValueError unless ``backend`` is one of :data:`UPDATE_BACKENDS`."""
    if backend not in UPDATE_BACKENDS:
        raise ValueError(f"update_backend must be one of {', '.join(UPDATE_BACKENDS)}, got {backend!r}")


@dataclass(frozen=True)
class TrainerConfig:
    """PPO and pipeline settings of the trainer (defaults: CleanRL's MuJoCo PPO)."""

    batch_steps: int = 2048
    """Env steps per update."""
    epochs: int = 10
    """Passes over each batch."""
    minibatch_size: int = 64
    """Transitions per gradient step."""
    learning_rate: float = 3e-4
    anneal_lr: bool = True
    """Decay the learning rate linearly to 0 over ``total_steps``."""
    total_steps: int = 1_000_000
    """Env steps the run is planned for (learning-rate schedule, end of training)."""
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    clip_value_loss: bool = True
    max_grad_norm: float = 0.5
    normalize_advantages: bool = True
    """Per minibatch, over the rows that drive the policy loss (as CleanRL does)."""
    normalize_rewards: bool = True
    """Scale rewards by the std of the discounted return (per env), clipped to +-10."""
    target_kl: float = 0.0
    """Stop an update's epochs early once approx KL exceeds this (0: never)."""
    baseline: str = "critic"
    """``critic``: GAE with the value function. ``group`` (GRPO-style, no critic): a step's
    advantage is its discounted reward-to-go to the end of its segment, standardised among
    the batch's steps at the same position of their segments (the same horizon left)."""
    max_policy_lag: int = 2
    """Transitions from weights more than this many publishes old are masked (kept for GAE)."""
    decoupled: bool = False
    """Decoupled PPO: ratio against the proximal policy (recomputed at update start),
    behaviour/proximal weight truncated at ``is_cap``."""
    is_cap: float = 2.0
    max_batches_ahead: int = 1
    """Admission control: the server sends at most this many batches beyond the one being learned."""
    checkpoint_every: int = 50
    """Save a checkpoint every N updates (and at the end); 0: only at the end."""
    keep_checkpoints: int = 3
    update_backend: str = "auto"
    """How gradient steps are computed: ``autograd`` (torch, any policy), ``numpy`` (hand-written
    gradients of the Gaussian MLP, same arithmetic, ~5x faster on small networks), ``auto``
    (numpy where the policy allows)."""
    torch_threads: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        check_finite(self)
        for name in ("batch_steps", "epochs", "minibatch_size", "total_steps", "max_batches_ahead"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.minibatch_size > self.batch_steps:
            raise ValueError(f"minibatch_size ({self.minibatch_size}) must be <= batch_steps")
        if not 0 < self.gamma <= 1 or not 0 <= self.gae_lambda <= 1:
            raise ValueError("need 0 < gamma <= 1 and 0 <= gae_lambda <= 1")
        if self.max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0, got {self.max_policy_lag}")
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {', '.join(BASELINES)}, got {self.baseline!r}")
        if self.learning_rate <= 0 or self.clip <= 0:
            raise ValueError("learning_rate and clip must be > 0")
        check_backend(self.update_backend)
