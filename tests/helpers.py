"""Shared test helpers: test policies and a server started on port 0."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import numpy as np

from edgerl.edge_server.policy import PolicyBackend, PolicyResult
from edgerl.edge_server.server import EdgeServer, ServerConfig


class EchoPolicy(PolicyBackend):
    """Action = first act_dim observation entries, log-prob = row sum: lets a test check that
    every env received the answer computed from its own observation."""

    name = "echo"

    def __init__(self, obs_dim: int, act_dim: int, delay_s: float = 0.0) -> None:
        super().__init__((obs_dim,), (act_dim,), -np.ones(act_dim), np.ones(act_dim))
        self.delay_s = delay_s
        self.batch_sizes: list[int] = []

    def infer(self, obs: np.ndarray) -> PolicyResult:
        self.batch_sizes.append(obs.shape[0])
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow model, like Gymnasium's SlowEnv
        act_dim = self.act_shape[0]
        return PolicyResult(
            actions=np.ascontiguousarray(obs[:, :act_dim], dtype=np.float32),
            log_probs=obs.sum(1).astype(np.float32),
        )


@contextlib.asynccontextmanager
async def running_server(backend: PolicyBackend, **config: object) -> AsyncIterator[EdgeServer]:
    """A real edge server on 127.0.0.1, port 0."""
    server = EdgeServer(backend, ServerConfig(port=0, **config))  # type: ignore[arg-type,unused-ignore]
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=1.0)


def run(coro: object, timeout_s: float = 120.0) -> object:
    """Run a coroutine to completion with a hard timeout."""

    async def bounded() -> object:
        return await asyncio.wait_for(coro, timeout_s)  # type: ignore[arg-type]

    return asyncio.run(bounded())
