"""Robot sessions as ROS 2 bags (rosbag2, MCAP storage), and bags back into transitions.

Per robot ``R`` and control tick, three messages, all stamped with the
control-loop time of the tick (the header stamps and the bag timestamps agree):

============================  ===============================  ==========================================
topic                         type                             content
============================  ===============================  ==========================================
``/edgerl/R/observation``     ``sensor_msgs/msg/JointState``   ``name``: observation entry names;
                                                               ``position``: the observation read after
                                                               the tick's action (float64)
``/edgerl/R/action``          ``std_msgs/msg/Float32MultiArray`` ``data``: the action applied at the tick,
                                                               after clamping and rate limiting;
                                                               ``layout.dim[0]``: label ``action``
``/edgerl/R/step``            ``edgerl_msgs/msg/Step``         reward, flags, policy version, log-prob,
                                                               action age (see ``STEP_MSG``)
============================  ===============================  ==========================================

An rclpy node exchanges the same messages by building ``edgerl_msgs`` from
``STEP_MSG`` (``edgerl bag msg`` prints it). ``bag_to_segments`` turns a bag
into the transitions the trainer takes from the edge server: row ``j`` of a
robot is (observation of tick ``j-1``, action of tick ``j``) -> (reward and
flags of tick ``j``); a tick that reset the robot is an autoreset row.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rosbags.rosbag2 import Reader, ReaderError, StoragePlugin, Writer
from rosbags.typesys import Stores, get_types_from_msg, get_typestore
from rosbags.typesys.store import Typestore

from edgerl.proto import tensors
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.robot_client import errors

log = logging.getLogger(__name__)

STEP_TYPE = "edgerl_msgs/msg/Step"
STEP_MSG = """\
# One control tick of an edgerl robot.
std_msgs/Header header
# Tick number of the robot's control loop (skipped ticks count).
uint64 tick
# Reward the tick's action earned (task units).
float32 reward
# The action ended the episode in a terminal state / by a cut-off.
bool terminated
bool truncated
# The applied action was the watchdog's, not the policy's.
bool fallback
# The watchdog was in a latched e-stop.
bool estop
# The robot was reset at this tick; its action was not applied (autoreset).
bool reset
# Weight version of the policy action (0 for fallbacks).
uint64 policy_version
# Log-probability of the policy's answer (nats; for an action chunk, of the whole chunk). NaN for fallbacks.
float32 log_prob
# Time from the observation the action answers to this tick (seconds). NaN for fallbacks.
float64 action_age
"""
JOINT_STATE = "sensor_msgs/msg/JointState"
FLOAT_ARRAY = "std_msgs/msg/Float32MultiArray"


def typestore() -> Typestore:
    """The ROS 2 Humble types plus ``edgerl_msgs/msg/Step``."""
    store = get_typestore(Stores.ROS2_HUMBLE)
    store.register(get_types_from_msg(STEP_MSG, STEP_TYPE))
    return store


@dataclass(frozen=True)
class RobotTopics:
    name: str
    joint_names: tuple[str, ...]
    act_dim: int

    @property
    def prefix(self) -> str:
        return f"/edgerl/{self.name}"


class BagRecorder:
    """Writes the ticks of robots into one bag, off the control thread.

    ``record`` only appends to a queue (the control loop must not wait on a
    disk); a writer thread serialises and writes. If the queue grows past
    ``max_queued`` ticks, further ticks are dropped and counted in ``dropped``.
    """

    def __init__(self, path: str | Path, robots: Sequence[RobotTopics], max_queued: int = 100_000) -> None:
        self.path = Path(path)
        if self.path.exists():
            raise FileExistsError(f"record: {self.path} exists; rosbag2 writes a new folder")
        self.robots = list(robots)
        self.store = typestore()
        self._writer = Writer(self.path, version=9, storage_plugin=StoragePlugin.MCAP)
        self._writer.open()
        self._conns = []
        for r in self.robots:
            self._conns.append(
                (
                    self._writer.add_connection(f"{r.prefix}/observation", JOINT_STATE, typestore=self.store),
                    self._writer.add_connection(f"{r.prefix}/action", FLOAT_ARRAY, typestore=self.store),
                    self._writer.add_connection(f"{r.prefix}/step", STEP_TYPE, typestore=self.store),
                )
            )
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._max_queued = max_queued
        self.written = 0
        self.dropped = 0
        # Monotonic control-loop times, shifted to the wall clock at the start.
        self._offset = time.time() - time.monotonic()
        self._thread = threading.Thread(target=self._run, name="bag-writer", daemon=True)
        self._thread.start()

    def record(self, index: int, tick: Any, reading: Any, was_reset: bool) -> None:
        """Queue one tick of robot ``index`` (control thread); fits ``RobotHost(on_tick=...)``."""
        if self._queue.qsize() >= self._max_queued:
            self.dropped += 1
            return
        self._queue.put((index, tick, reading, was_reset))

    def close(self) -> None:
        """Write what is queued and close the bag."""
        self._queue.put(None)
        self._thread.join()
        self._writer.close()
        if self.dropped:
            log.warning("bag %s: %d ticks dropped (writer too slow)", self.path, self.dropped)

    def _run(self) -> None:
        types = self.store.types
        header_t, time_t = types["std_msgs/msg/Header"], types["builtin_interfaces/msg/Time"]
        joint_state_t, float_array_t, step_t = types[JOINT_STATE], types[FLOAT_ARRAY], types[STEP_TYPE]
        layout_t, dim_t = types["std_msgs/msg/MultiArrayLayout"], types["std_msgs/msg/MultiArrayDimension"]
        empty = np.zeros(0, np.float64)
        while (item := self._queue.get()) is not None:
            index, tick, reading, was_reset = item
            robot = self.robots[index]
            c_obs, c_act, c_step = self._conns[index]
            t_ns = int((tick.time + self._offset) * 1e9)
            header = header_t(
                stamp=time_t(sec=t_ns // 1_000_000_000, nanosec=t_ns % 1_000_000_000), frame_id=""
            )
            obs = np.asarray(reading.obs, np.float64).ravel()
            js = joint_state_t(
                header=header, name=list(robot.joint_names), position=obs, velocity=empty, effort=empty
            )
            act = np.asarray(tick.action, np.float32).ravel()
            dims = [dim_t(label="action", size=act.size, stride=act.size)]
            arr = float_array_t(layout=layout_t(dim=dims, data_offset=0), data=act)
            version, log_prob = tick.tag if isinstance(tick.tag, tuple) else (0, math.nan)
            step = step_t(
                header=header,
                tick=tick.index,
                reward=float(reading.reward),
                terminated=bool(reading.terminated),
                truncated=bool(reading.truncated),
                fallback=bool(tick.fallback),
                estop=str(tick.kind) == "estop",
                reset=bool(was_reset),
                policy_version=int(version),
                log_prob=float(log_prob),
                action_age=float(tick.age_s),
            )
            for conn, msg, typ in (
                (c_obs, js, JOINT_STATE),
                (c_act, arr, FLOAT_ARRAY),
                (c_step, step, STEP_TYPE),
            ):
                self._writer.write(conn, t_ns, self.store.serialize_cdr(msg, typ))
            self.written += 1


@dataclass
class BagTick:
    """One tick of one robot, read back from a bag."""

    time_ns: int
    obs: np.ndarray
    action: np.ndarray
    step: Any


def read_bag(path: str | Path) -> dict[str, list[BagTick]]:
    """The ticks of every robot in a bag, in tick order.

    Raises:
        FileNotFoundError: no bag at ``path``: nothing there, or a folder without ``metadata.yaml``.
        ValueError: the bag cannot be read, holds no edgerl robot topics, or a tick lacks one of
            its messages.
    """
    folder = Path(path)
    if not folder.exists():
        raise FileNotFoundError(f"bag {path}: no such folder")
    if folder.is_dir() and not (folder / "metadata.yaml").exists():
        raise FileNotFoundError(
            f"bag {path}: no metadata.yaml in this folder (a rosbag2 bag is a folder with one)"
        )
    store = typestore()
    parts: dict[str, dict[int, dict[str, Any]]] = defaultdict(lambda: defaultdict(dict))
    try:
        with Reader(folder) as reader:
            conns = [c for c in reader.connections if c.topic.startswith("/edgerl/")]
            if not conns:
                raise ValueError(f"bag {path}: no /edgerl/<robot>/... topics")
            for conn, t_ns, raw in reader.messages(connections=conns):
                _, _, robot, kind = conn.topic.split("/", 3)
                parts[robot][t_ns][kind] = store.deserialize_cdr(raw, conn.msgtype)
    except ReaderError as exc:  # its metadata or storage files missing or broken
        raise ValueError(f"bag {path}: cannot be read ({errors.first_line(exc, 'unreadable')})") from None
    out: dict[str, list[BagTick]] = {}
    for robot, by_time in parts.items():
        ticks = []
        for t_ns in sorted(by_time):
            m = by_time[t_ns]
            missing = {"observation", "action", "step"} - set(m)
            if missing:
                raise ValueError(f"bag {path}: robot {robot} at t={t_ns} ns lacks {sorted(missing)}")
            ticks.append(
                BagTick(
                    t_ns,
                    np.asarray(m["observation"].position, np.float32),
                    np.asarray(m["action"].data, np.float32),
                    m["step"],
                )
            )
        out[robot] = sorted(ticks, key=lambda t: t.step.tick)
    return out


_Row = tuple[BagTick, BagTick, bool]
"""A transition of a bag: (the tick before, the tick, masked as an autoreset row)."""


def _segment(
    robot: str, rows: list[_Row], bootstrap: np.ndarray, *, seq: int, episode: int, t: int
) -> pb.Segment:
    steps = [cur.step for _, cur, _ in rows]
    return pb.Segment(
        seq=seq,
        session_id=robot,
        env_id=0,
        episode=episode,
        t=t,
        obs=tensors.float32(np.stack([prev.obs for prev, _, _ in rows])),
        actions=tensors.float32(np.stack([cur.action for _, cur, _ in rows])),
        log_probs=[0.0 if math.isnan(x.log_prob) else x.log_prob for x in steps],
        values=[0.0] * len(rows),
        policy_versions=[x.policy_version for x in steps],
        rewards=[x.reward for x in steps],
        terminated=[x.terminated for x in steps],
        truncated=[x.truncated for x in steps],
        fallback=[x.fallback for x in steps],
        autoreset=[masked for _, _, masked in rows],
        bootstrap_obs=tensors.float32(bootstrap),
    )


def bag_to_segments(path: str | Path, segment_steps: int = 32) -> list[pb.Segment]:
    """The transitions of a bag as trainer segments (identity: robot name, env 0, episode, t).

    Row ``j`` of a robot is (observation of tick ``j-1``, action of tick ``j``) with the
    reward and flags of tick ``j``; a robot's first tick has no observation before it and
    starts no row. The row of a reset tick (autoreset) closes its episode's last segment.
    The rows between an episode's last tick and the reset (an e-stopped robot is held, not
    reset, until its e-stop is reset) are masked as autoreset rows too.
    """
    if segment_steps < 1:
        raise ValueError(f"segment_steps must be >= 1, got {segment_steps}")
    segments: list[pb.Segment] = []
    for robot, ticks in sorted(read_bag(path).items()):
        episode, t = 0, 0
        rows: list[_Row] = []
        ended = False  # the episode has ended and the robot was not reset yet
        for prev, cur in itertools.pairwise(ticks):
            rows.append((prev, cur, ended or cur.step.reset))
            ended = (ended or cur.step.terminated or cur.step.truncated) and not cur.step.reset
            if cur.step.reset or len(rows) == segment_steps:
                segments.append(_segment(robot, rows, cur.obs, seq=len(segments) + 1, episode=episode, t=t))
                episode, t = (episode + 1, 0) if cur.step.reset else (episode, t + len(rows))
                rows = []
        if rows:
            segments.append(_segment(robot, rows, ticks[-1].obs, seq=len(segments) + 1, episode=episode, t=t))
    return segments


def save_transitions(segments: Sequence[pb.Segment], path: str | Path) -> None:
    """Write segments as one ``edgerl.v1.TransitionBatch`` message (what the Learner stream carries)."""
    Path(path).write_bytes(pb.TransitionBatch(segments=segments).SerializeToString())


def load_transitions(path: str | Path) -> list[pb.Segment]:
    """Segments written by :func:`save_transitions` (``edgerl bag import``)."""
    batch = pb.TransitionBatch()
    batch.ParseFromString(Path(path).read_bytes())
    return list(batch.segments)


def bag_info(path: str | Path) -> dict[str, Any]:
    """A summary of a bag: per robot ticks, duration, episodes, fallbacks, e-stops, versions."""
    robots = read_bag(path)
    out: dict[str, Any] = {"path": str(path), "robots": {}}
    for robot, ticks in sorted(robots.items()):
        steps = [t.step for t in ticks]
        duration = (ticks[-1].time_ns - ticks[0].time_ns) / 1e9 if len(ticks) > 1 else 0.0
        versions = [s.policy_version for s in steps if not s.fallback]
        out["robots"][robot] = {
            "ticks": len(ticks),
            "duration_s": duration,
            "rate_hz": (len(ticks) - 1) / duration if duration > 0 else math.nan,
            "episodes_ended": sum(s.terminated or s.truncated for s in steps),
            "reward_sum": float(sum(s.reward for s in steps)),
            "fallbacks": sum(s.fallback for s in steps),
            "estop_ticks": sum(s.estop for s in steps),
            "policy_versions": [min(versions), max(versions)] if versions else [],
            "obs_dim": int(ticks[0].obs.size),
            "act_dim": int(ticks[0].action.size),
        }
    return out
