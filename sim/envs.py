"""Seeded, vectorised gymnasium MuJoCo envs.

Envs of one worker process are grouped in a ``SyncVectorEnv``: on a 2-core
machine it steps 32 HalfCheetah envs about 3x faster than ``AsyncVectorEnv``,
whose per-step pipe traffic costs more than the physics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

log = logging.getLogger(__name__)

#: Tasks that are tested and shipped with configs. Any other gymnasium id works too.
SUPPORTED_ENVS = ("HalfCheetah-v5", "Hopper-v5", "Walker2d-v5", "Ant-v5", "InvertedPendulum-v5")

_QUIET_WARNINGS = ("'settotalmass' is deprecated",)
_warning_handler_installed = False


def quiet_mujoco_warnings() -> None:
    """Route MuJoCo's C-level warnings to logging and drop known-noisy ones.

    MuJoCo 4 prints a ``settotalmass`` deprecation for every HalfCheetah/Ant
    env it compiles, which buries the output of a 64-env run.
    """
    global _warning_handler_installed  # noqa: PLW0603 - process-wide C hook, installed once
    if _warning_handler_installed:
        return
    import mujoco

    def _handler(message: str) -> None:
        if not any(q in message for q in _QUIET_WARNINGS):
            log.warning("mujoco: %s", message)

    mujoco.set_mju_user_warning(_handler)
    _warning_handler_installed = True


@dataclass(frozen=True)
class EnvSpec:
    """Spaces of one env, as the edge server needs them."""

    env_name: str
    obs_shape: tuple[int, ...]
    act_shape: tuple[int, ...]
    act_low: np.ndarray
    act_high: np.ndarray
    obs_low: np.ndarray
    obs_high: np.ndarray


def env_spec(env_name: str) -> EnvSpec:
    """Build one env, read its spaces, close it.

    Raises:
        ValueError: the env is unknown or its spaces are not continuous boxes.
    """
    quiet_mujoco_warnings()
    try:
        env = gym.make(env_name)
    except gym.error.Error as exc:
        raise ValueError(f"env {env_name!r}: {exc}") from exc
    try:
        obs_space, act_space = env.observation_space, env.action_space
        if not isinstance(obs_space, gym.spaces.Box) or not isinstance(act_space, gym.spaces.Box):
            raise ValueError(f"env {env_name!r}: edgerl needs Box observation and action spaces")
        return EnvSpec(
            env_name=env_name,
            obs_shape=tuple(obs_space.shape),
            act_shape=tuple(act_space.shape),
            act_low=np.asarray(act_space.low, dtype=np.float32),
            act_high=np.asarray(act_space.high, dtype=np.float32),
            obs_low=np.asarray(obs_space.low, dtype=np.float32),
            obs_high=np.asarray(obs_space.high, dtype=np.float32),
        )
    finally:
        env.close()


def make_vector_env(env_name: str, num_envs: int, seed: int) -> tuple[gym.vector.SyncVectorEnv, np.ndarray]:
    """A ``SyncVectorEnv`` of ``num_envs`` copies reset with seeds ``seed..seed+n-1``.

    Autoreset is gymnasium 1.x's default ``NEXT_STEP``: the step after an
    episode ends resets that env and ignores its action.

    Returns:
        The envs and their first observations, float32 ``[num_envs, *obs_shape]``.
    """
    if num_envs < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    quiet_mujoco_warnings()
    envs = gym.vector.SyncVectorEnv([lambda: gym.make(env_name) for _ in range(num_envs)])
    obs, _ = envs.reset(seed=[seed + i for i in range(num_envs)])
    return envs, np.asarray(obs, dtype=np.float32)
