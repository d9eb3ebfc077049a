"""What edgerl needs of a robot (real, or the MuJoCo one in ``edgerl.sim.robot``).

``Robot`` is a structural protocol: a driver implements these members and
needs nothing of edgerl. All calls come from the control-loop thread, once
per tick; none may block for long (they run inside the watchdog's tick).

A robot that runs a gymnasium task (the MuJoCo robot of ``edgerl.sim.robot``)
may also have ``env_name``, the task's id: a server whose policy is for
another env is then refused, as it is for sim workers. A real robot leaves it
out, and only its shapes are checked.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np


class Reading(Protocol):
    """What ``Robot.read`` returns; :class:`RobotState` is the ready-made one."""

    @property
    def obs(self) -> np.ndarray: ...
    @property
    def reward(self) -> float: ...
    @property
    def terminated(self) -> bool: ...
    @property
    def truncated(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class RobotState:
    """One reading of the robot after an action."""

    obs: np.ndarray
    """Observation, float32 ``[*obs_shape]``."""
    reward: float = 0.0
    """What the last applied action earned (task units; 0 where no reward is defined)."""
    terminated: bool = False
    """The last action ended the episode in a terminal state."""
    truncated: bool = False
    """The episode was cut off (time limit, operator)."""


@runtime_checkable
class Robot(Protocol):
    """A robot driven at a fixed rate by the watchdog."""

    name: str
    """Identity used as the stream's session id and in recordings."""
    obs_shape: tuple[int, ...]
    action_low: np.ndarray
    """Lower action limit per dimension (float32)."""
    action_high: np.ndarray
    """Upper action limit per dimension (float32)."""
    joint_names: tuple[str, ...]
    """Names of the observation entries (recorded in JointState messages)."""

    def safe_action(self) -> np.ndarray:
        """The stop action an e-stop ramps to (e.g. zero torque or velocity)."""
        ...

    def read(self) -> Reading:
        """The current observation and what the last applied action earned."""
        ...

    def apply(self, action: np.ndarray) -> None:
        """Send one action (already clamped and rate-limited) to the actuators."""
        ...

    def reset(self) -> Reading:
        """Start a new episode (a sim resets; a real robot returns to its start pose). Never
        called while the robot is e-stopped: an episode that ends then waits for the e-stop's
        reset, and the e-stop's ticks go on applying its stop action meanwhile."""
        ...

    def close(self) -> None:
        """Release the robot; called once no tick of it runs any more. After a normal stop the
        last action applied was whatever the loop had reached, so a real robot's driver should
        leave it safe here (brakes, zero torque). After a failed loop, the loop's last ticks
        already ramped it to :meth:`safe_action` (see ``ControlLoop``)."""
        ...


@dataclass(frozen=True)
class RobotKind:
    """What the robots of one host share, and a server's policy must serve."""

    obs_shape: tuple[int, ...]
    act_shape: tuple[int, ...]
    env_name: str
    """The gymnasium id of the robots' task, where they have one (``env_name``); else empty."""

    @classmethod
    def of(cls, robots: Sequence[Robot]) -> RobotKind:
        """The kind of ``robots``.

        Raises:
            ValueError: there are none, or they differ in a shape or their env.
        """
        if not robots:
            raise ValueError("a robot host needs at least one robot")
        return cls(
            _one("observation shape", {tuple(r.obs_shape) for r in robots}),
            _one("action shape", {tuple(np.shape(r.action_low)) for r in robots}),
            _one("env", {str(getattr(r, "env_name", "")) for r in robots}),
        )


T = TypeVar("T", tuple[int, ...], str)


def _one(what: str, values: set[T]) -> T:
    """The one value that the robots of a host share."""
    if len(values) != 1:
        raise ValueError(f"robots of one host need one {what}, got {sorted(values)}")
    return next(iter(values))


def robot_class(spec: str) -> type:
    """The class named by ``module:Class``.

    Raises:
        ValueError: the spec is malformed or cannot be imported.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"robot: expected 'module:Class', got {spec!r}")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"robot {spec!r}: {exc}") from exc
    if not isinstance(cls, type):
        raise ValueError(f"robot {spec!r} is not a class")
    return cls


def load_robot(spec: str, **kwargs: Any) -> Robot:
    """Instantiate ``module:Class`` with ``kwargs`` and check it is a :class:`Robot`.

    Raises:
        ValueError: the spec is malformed, cannot be imported, or is not a Robot.
    """
    robot = robot_class(spec)(**kwargs)
    if not isinstance(robot, Robot):
        raise ValueError(f"robot {spec!r}: {type(robot).__name__} does not implement the Robot protocol")
    return robot
