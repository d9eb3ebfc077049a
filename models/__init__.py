"""Policy networks shared by the edge server (inference) and the trainer (learning).

The two never import each other (they talk over gRPC); both import the
network definition from here, so a published ``state_dict`` always fits.
"""

from edgerl.models.mlp import (
    LOG_2PI,
    POLICY_PRESETS,
    GaussianMLPPolicy,
    RunningNorm,
    build_policy,
    gaussian_log_prob,
    mlp_linears,
)

__all__ = [
    "LOG_2PI",
    "POLICY_PRESETS",
    "GaussianMLPPolicy",
    "RunningNorm",
    "build_policy",
    "gaussian_log_prob",
    "mlp_linears",
]
