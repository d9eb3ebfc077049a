"""A MuJoCo robot: a gymnasium MuJoCo task run in real time at the control rate.

It implements ``edgerl.robot_client.robot.Robot`` (structurally; nothing here
imports the client). Each ``apply`` advances the physics by one control
period, ``1 / hz`` seconds of simulated time, so a watchdog ticking at ``hz``
drives it in real time. Faults on the way to the policy (latency, jitter,
dropped answers, a killed server) are injected on the link, not here.
"""

from __future__ import annotations

import logging
import math

import gymnasium as gym
import numpy as np

from edgerl.sim.envs import make_env

log = logging.getLogger(__name__)


class _State:
    """Duck-typed ``RobotState`` (sim does not import the client)."""

    __slots__ = ("obs", "reward", "terminated", "truncated")

    def __init__(self, obs: np.ndarray, reward: float, terminated: bool, truncated: bool) -> None:
        self.obs, self.reward, self.terminated, self.truncated = obs, reward, terminated, truncated


class MujocoRobot:
    """A simulated robot for ``edgerl robot`` and the robot benchmark.

    Args:
        env: gymnasium MuJoCo id (e.g. ``HalfCheetah-v5``).
        hz: control rate; the env's ``frame_skip`` is chosen so one action lasts ``1 / hz``
            of simulated time.
        seed: reset seed of the first episode (+1 per episode).
        name: identity of the robot (session id, recordings).
    """

    def __init__(self, env: str = "HalfCheetah-v5", hz: float = 50.0, seed: int = 0, name: str = "") -> None:
        if not 0 < hz < math.inf:
            raise ValueError(f"hz must be a finite number > 0, got {hz}")
        probe = make_env(env)
        timestep = float(probe.unwrapped.model.opt.timestep)  # type: ignore[attr-defined]
        probe.close()
        frame_skip = max(1, round(1.0 / (hz * timestep)))
        if not math.isclose(frame_skip * timestep, 1.0 / hz, rel_tol=0.05):
            log.warning(
                "%s: control period %.4fs is no multiple of the physics step %.4fs; using %d steps (%.4fs)",
                env, 1.0 / hz, timestep, frame_skip, frame_skip * timestep,
            )  # fmt: skip
        # The env checker and order-enforcing wrappers cost more per step than the
        # physics of a small robot; step the raw env and keep the time limit here.
        wrapped = make_env(env, frame_skip=frame_skip, disable_env_checker=True)
        self.env = wrapped
        self._raw = wrapped.unwrapped
        spec = wrapped.spec
        self.max_episode_steps = int(spec.max_episode_steps) if spec and spec.max_episode_steps else 0
        self._t = 0
        self.env_name = env
        self.hz = hz
        self.name = name or f"mujoco-{env}-{seed}"
        self._seed = seed
        obs_space, act_space = self.env.observation_space, self.env.action_space
        assert isinstance(obs_space, gym.spaces.Box) and isinstance(act_space, gym.spaces.Box)
        self.obs_shape: tuple[int, ...] = tuple(obs_space.shape)
        self.action_low = np.asarray(act_space.low, np.float32)
        self.action_high = np.asarray(act_space.high, np.float32)
        self.joint_names = tuple(f"obs_{i}" for i in range(int(np.prod(self.obs_shape))))
        self.episodes = 0
        self._state = self._reset_state()

    def _reset_state(self) -> _State:
        obs, _ = self.env.reset(seed=self._seed + self.episodes)
        self._t = 0
        self.episodes += 1
        return _State(np.asarray(obs, np.float32), 0.0, False, False)

    def safe_action(self) -> np.ndarray:
        return np.clip(np.zeros_like(self.action_low), self.action_low, self.action_high)

    def read(self) -> _State:
        return self._state

    def apply(self, action: np.ndarray) -> None:
        obs, reward, terminated, truncated, _ = self._raw.step(np.asarray(action, np.float32))
        self._t += 1
        truncated = bool(truncated) or (self.max_episode_steps > 0 and self._t >= self.max_episode_steps)
        self._state = _State(np.asarray(obs, np.float32), float(reward), bool(terminated), truncated)

    def reset(self) -> _State:
        self._state = self._reset_state()
        return self._state

    def close(self) -> None:
        self.env.close()
