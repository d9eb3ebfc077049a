"""The ``PolicyBackend`` interface: what the edge server needs of a policy.

A backend is called from exactly one thread, the batcher's inference thread,
so implementations need no locking; weight swaps run on that same thread
between two batches. This module imports no torch: the server's modules, and
the clients and launchers that import them for their settings, start without
it (a sim worker or a robot host never loads torch). The torch backend is
:class:`~edgerl.edge_server.policy.TorchPolicyBackend`.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edgerl.proto.settings import GRPC_INT_MAX

#: The largest policy version: versions travel as signed 64-bit integers on the local Act
#: socket and network processes' frames and in the trainer's arrays, so a server refuses a
#: publish of a larger one (as a backend built with one).
MAX_VERSION = 2**63 - 1


@dataclass(frozen=True)
class PolicyResult:
    """Output of one forward pass over a batch of ``n`` observations."""

    actions: np.ndarray
    """float32 ``[n, *act_shape]``: raw policy samples, unclipped."""
    log_probs: np.ndarray
    """float32 ``[n]``: log-probability of each action (nats)."""
    values: np.ndarray | None = None
    """float32 ``[n]``: state-value estimates, or None if the backend computes none."""


def check_weights(weights: Mapping[str, np.ndarray], expected: Mapping[str, tuple[int, ...]]) -> None:
    """Check that ``weights`` has exactly the tensors of ``expected`` (name to shape).

    Raises:
        KeyError: a tensor is missing or unknown (up to five of each are named).
        ValueError: a tensor has another shape.
    """
    missing = sorted(set(expected) - set(weights))
    unknown = sorted(set(weights) - set(expected))
    if missing or unknown:
        raise KeyError(f"weights: missing {missing[:5]}, unknown {unknown[:5]}")
    for name, value in weights.items():
        if tuple(value.shape) != tuple(expected[name]):
            raise ValueError(
                f"weights[{name!r}]: expected shape {list(expected[name])}, got {list(value.shape)}"
            )


def weights_limit(weights_values: int) -> int:
    """The most bytes a publish may carry (``ServerLimits.max_weights_bytes``): ``weights_values``
    values as FLOAT64 (8 bytes each; the trainer's own dtype is at most that) and 1 MiB for the
    names and tensor headers."""
    return 8 * weights_values + (1 << 20)


def publish_limit(weights_values: int, max_message_bytes: int) -> int:
    """The largest message a server with a learner receives: a ``PublishWeights`` request of
    :func:`weights_limit`, or ``max_message_bytes`` where that is more; at most gRPC's limit.
    A trainer's ``mlp-large`` weights (4.4 M float32 values, 17.5 MB as sent) went over the
    default ``max_message_bytes`` (4 MiB), and ``edgerl train --policy mlp-large`` failed at its
    first publish. Weights past gRPC's limit go in parts (``PublishWeightsStream``)."""
    return min(max(weights_limit(weights_values), max_message_bytes), GRPC_INT_MAX)


class PolicyBackend(abc.ABC):
    """What the edge server needs of a policy."""

    #: Short name reported by ``Describe`` (e.g. ``"torch-mlp"``).
    name: str = "policy"
    #: Actions per observation; a backend with ``chunk > 1`` returns ``[n, chunk, *act_shape]``.
    chunk: int = 1
    #: Batches the backend takes at once: above 1, :meth:`infer` is called from that many
    #: threads concurrently (a backend that batches continuously inside, e.g. vLLM).
    pipeline_depth: int = 1
    #: Values its weights hold (0: it takes no weights): a server with a learner accepts a
    #: ``PublishWeights`` request of them as FLOAT64 however large (:func:`publish_limit`).
    weights_values: int = 0

    def __init__(
        self,
        obs_shape: tuple[int, ...],
        act_shape: tuple[int, ...],
        act_low: np.ndarray,
        act_high: np.ndarray,
        version: int = 0,
    ) -> None:
        if not 0 <= version <= MAX_VERSION:
            raise ValueError(f"version must be in [0, 2**63 - 1], got {version}")
        self.obs_shape = tuple(obs_shape)
        self.act_shape = tuple(act_shape)
        self.act_low = np.asarray(act_low, dtype=np.float32).reshape(self.act_shape)
        self.act_high = np.asarray(act_high, dtype=np.float32).reshape(self.act_shape)
        self.version = version

    @abc.abstractmethod
    def infer(self, obs: np.ndarray) -> PolicyResult:
        """Actions for float32 observations ``[n, *obs_shape]`` (n >= 1)."""

    def load_weights(self, weights: dict[str, np.ndarray], version: int) -> None:
        """Swap in new weights and stamp them ``version``; called between two batches.

        Raises:
            KeyError, ValueError: a tensor is missing, unknown or of the wrong shape;
                the served weights are then unchanged.
        """
        raise NotImplementedError(f"{type(self).__name__} does not take weight updates")

    def init_thread(self) -> None:  # noqa: B027 - optional: most backends need no per-thread set-up
        """Called once in each thread that will call :meth:`infer`, before its first call."""

    def warmup(self, rows: int = 8) -> None:
        """Run one dummy batch so the first real request does not pay for lazy init."""
        self.infer(np.zeros((rows, *self.obs_shape), dtype=np.float32))

    def close(self) -> None:  # noqa: B027 - optional: most backends hold nothing to release
        """Release what the backend holds (threads, engines); it takes no batches after this."""
