"""Policy networks shared by the edge server (inference) and the trainer (learning).

The two never import each other (they talk over gRPC); both import the
network definition from here, so a published ``state_dict`` always fits.
The networks are imported on first use: ``POLICY_PRESETS`` and ``LOG_2PI``
come without torch, so that a process that only reads them (a launcher, a
sim worker, a robot host) never loads it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from edgerl.models.presets import LOG_2PI, POLICY_PRESETS

if TYPE_CHECKING:
    from edgerl.models.mlp import GaussianMLPPolicy as GaussianMLPPolicy
    from edgerl.models.mlp import RunningNorm as RunningNorm
    from edgerl.models.mlp import build_policy as build_policy
    from edgerl.models.mlp import gaussian_log_prob as gaussian_log_prob
    from edgerl.models.mlp import mlp_linears as mlp_linears

__all__ = [
    "LOG_2PI",
    "POLICY_PRESETS",
    "GaussianMLPPolicy",
    "RunningNorm",
    "build_policy",
    "gaussian_log_prob",
    "mlp_linears",
]
_FROM_MLP = frozenset(__all__) - {"LOG_2PI", "POLICY_PRESETS"}
"""The names served from :mod:`edgerl.models.mlp`, imported on first use."""


def __getattr__(name: str) -> Any:
    if name in _FROM_MLP:
        return getattr(importlib.import_module("edgerl.models.mlp"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
