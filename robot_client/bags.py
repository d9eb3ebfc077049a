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

import io
import logging
import math
import os
import queue
import shutil
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np
from rosbags.rosbag2 import Reader, ReaderError, StoragePlugin, Writer
from rosbags.rosbag2.storage_mcap import decompress
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

    A write that fails (a full disk) ends the recording, not the robots: it is said once, kept
    in ``error``, and the ticks after it are counted in ``lost``, not queued. The writer thread
    once died with a traceback, the queue grew for the rest of the run, and the bag's close
    raised again at the end, so ``edgerl robot`` ended with a second traceback and no statistics.
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
        self._refused = 0
        """Ticks handed over after the recording failed (counted by the control thread)."""
        self._dropped_queued = 0
        """Ticks queued or in hand when it failed (counted by the writer thread)."""
        self.error: BaseException | None = None
        """Why the recording failed, if it did: the bag is incomplete."""
        self.failed_when = ""
        """When it failed: "while the robots ran" or "as the bag was closed"."""
        self._in_hand = 0
        """1 while the writer thread writes a tick's messages."""
        # Monotonic control-loop times, shifted to the wall clock at the start.
        self._offset = time.time() - time.monotonic()
        self._thread = threading.Thread(target=self._run, name="bag-writer", daemon=True)
        self._thread.start()

    def record(self, index: int, tick: Any, reading: Any, was_reset: bool) -> None:
        """Queue one tick of robot ``index`` (control thread); fits ``RobotHost(on_tick=...)``."""
        if self.error is not None:
            self._refused += 1
            return
        if self._queue.qsize() >= self._max_queued:
            self.dropped += 1
            return
        self._queue.put((index, tick, reading, was_reset))

    @property
    def lost(self) -> int:
        """Ticks not recorded because the recording had failed (queued then, or handed over later)."""
        return self._refused + self._dropped_queued

    def close(self) -> None:
        """Write what is queued and close the bag (a failure is kept in ``error``, not raised)."""
        self._queue.put(None)
        self._thread.join()
        try:
            self._writer.close()
        except Exception as exc:  # the last chunk, the summary, metadata.yaml: a full disk again
            if self.error is None:
                self._failed(exc, "as the bag was closed")
        if self.dropped:
            log.warning("bag %s: %d ticks dropped (writer too slow)", self.path, self.dropped)

    def _failed(self, exc: BaseException, when: str) -> None:
        self.error = exc
        self.failed_when = when
        log.error(
            "bag %s: the recording failed %s, after %d ticks (%s); the bag is incomplete",
            self.path,
            when,
            self.written,
            errors.first_line(exc),
        )

    def _run(self) -> None:
        try:
            self._write_queued()
        except Exception as exc:
            self._failed(exc, "while the robots ran")
            self._dropped_queued += self._in_hand  # the tick whose messages were being written
            while self._queue.get() is not None:  # what was queued is lost; record() queues no more
                self._dropped_queued += 1

    def _write_queued(self) -> None:
        types = self.store.types
        header_t, time_t = types["std_msgs/msg/Header"], types["builtin_interfaces/msg/Time"]
        joint_state_t, float_array_t, step_t = types[JOINT_STATE], types[FLOAT_ARRAY], types[STEP_TYPE]
        layout_t, dim_t = types["std_msgs/msg/MultiArrayLayout"], types["std_msgs/msg/MultiArrayDimension"]
        empty = np.zeros(0, np.float64)
        while (item := self._queue.get()) is not None:
            self._in_hand = 1
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
            self._in_hand = 0


TICK_KINDS = {"observation": JOINT_STATE, "action": FLOAT_ARRAY, "step": STEP_TYPE}
"""The messages of one tick, by the last part of their topic: their types."""

Progress = Callable[[int, int], None]
"""Told (messages read, messages in all) while a bag is read."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BagStep:
    """The fields of a tick's ``edgerl_msgs/msg/Step``, its header aside."""

    tick: int
    reward: float
    terminated: bool
    truncated: bool
    fallback: bool
    estop: bool
    reset: bool
    policy_version: int
    log_prob: float
    action_age: float

    @classmethod
    def of(cls, msg: Any) -> BagStep:
        return cls(
            int(msg.tick),
            float(msg.reward),
            bool(msg.terminated),
            bool(msg.truncated),
            bool(msg.fallback),
            bool(msg.estop),
            bool(msg.reset),
            int(msg.policy_version),
            float(msg.log_prob),
            float(msg.action_age),
        )


@dataclass(frozen=True, slots=True)
class BagTick:
    """One tick of one robot, read back from a bag."""

    time_ns: int
    obs: np.ndarray
    action: np.ndarray
    step: BagStep


def _tick_part(kind: str, msg: Any) -> Any:
    """What a tick keeps of one of its messages."""
    if kind == "observation":
        return np.asarray(msg.position, np.float32)
    if kind == "action":
        return np.asarray(msg.data, np.float32)
    return BagStep.of(msg)


def _robot_ticks(messages: Iterable[tuple[str, int, str, T]]) -> Iterator[tuple[str, int, dict[str, T]]]:
    """A bag's messages (robot, time, kind, item), in time order, gathered into each robot's
    ticks as (robot, time, items by kind): each as its robot's next tick begins (its messages
    all came before), the last ones at the end, in time order. It holds one tick a robot."""
    building: dict[str, tuple[int, dict[str, T]]] = {}
    for robot, t_ns, kind, item in messages:
        tick = building.get(robot)
        if tick is not None and tick[0] != t_ns:
            yield robot, *building.pop(robot)
            tick = None
        if tick is None:
            tick = building[robot] = (t_ns, {})
        tick[1][kind] = item
    for robot, (t_ns, parts) in sorted(building.items(), key=lambda item: (item[1][0], item[0])):
        yield robot, t_ns, parts


def bag_ticks(path: str | Path, progress: Progress | None = None) -> Iterator[tuple[str, BagTick]]:
    """Each tick of a bag, as (robot, tick), in the bag's order (time), as soon as it is whole
    (its robot's next tick begins); ``progress(read, total)`` is called every 1,000 messages and
    at the end. What it holds does not grow with the bag: one tick a robot.

    Raises:
        FileNotFoundError: no bag at ``path``: nothing there, or a folder without ``metadata.yaml``.
        ValueError: the bag cannot be read, holds no edgerl robot topics, or a tick lacks one of
            its messages (said when the robot's next tick begins, or at the end).
    """
    folder = Path(path)
    if not folder.exists():
        raise FileNotFoundError(f"bag {path}: no such folder")
    if folder.is_dir() and not (folder / "metadata.yaml").exists():
        unclosed = (
            "; its .mcap file is of a recording that was never closed (a full disk?): "
            f"edgerl bag repair {path} --out NEW saves what can be read"
            if any(folder.glob("*.mcap"))
            else ""
        )
        raise FileNotFoundError(
            f"bag {path}: no metadata.yaml in this folder (a rosbag2 bag is a folder with one){unclosed}"
        )
    store = typestore()
    try:
        with Reader(folder) as reader:
            conns = [c for c in reader.connections if c.topic.startswith("/edgerl/")]
            if not conns:
                raise ValueError(f"bag {path}: no /edgerl/<robot>/... topics")
            for c in conns:
                kind = c.topic.rsplit("/", 1)[-1]
                if kind in TICK_KINDS and c.msgtype != TICK_KINDS[kind]:
                    raise ValueError(f"bag {path}: topic {c.topic} is {c.msgtype}, not {TICK_KINDS[kind]}")
            total = sum(c.msgcount for c in conns)

            def messages() -> Iterator[tuple[str, int, str, Any]]:
                read = 0
                for conn, t_ns, raw in reader.messages(connections=conns):
                    read += 1
                    if progress is not None and read % 1000 == 0:
                        progress(read, total)
                    _, _, robot, kind = conn.topic.split("/", 3)
                    part = None  # a topic of another kind is not read (a tick it alone makes is not whole)
                    if kind in TICK_KINDS:
                        part = _tick_part(kind, store.deserialize_cdr(raw, conn.msgtype))
                    yield robot, t_ns, kind, part
                if progress is not None:
                    progress(read, total)

            for robot, t_ns, parts in _robot_ticks(messages()):
                if not TICK_KINDS.keys() <= parts.keys():
                    raise _lacks(path, robot, t_ns, parts)
                yield robot, BagTick(t_ns, parts["observation"], parts["action"], parts["step"])
    except ReaderError as exc:  # its metadata or storage files missing or broken
        raise ValueError(f"bag {path}: cannot be read ({errors.first_line(exc, 'unreadable')})") from None


def _lacks(path: str | Path, robot: str, t_ns: int, parts: dict[str, Any]) -> ValueError:
    missing = sorted(set(TICK_KINDS) - set(parts))
    return ValueError(f"bag {path}: robot {robot} at t={t_ns} ns lacks {missing}")


def read_bag(path: str | Path, progress: Progress | None = None) -> dict[str, list[BagTick]]:
    """The ticks of every robot in a bag, in tick order, all in memory (~0.9 KB a tick; a
    deserialised message with its header, names and layout took ~4.8 KB); ``progress`` and
    errors as for :func:`bag_ticks`."""
    ticks: dict[str, list[BagTick]] = defaultdict(list)
    for robot, tick in bag_ticks(path, progress):
        ticks[robot].append(tick)
    return {robot: sorted(robot_ticks, key=lambda t: t.step.tick) for robot, robot_ticks in ticks.items()}


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


@dataclass
class _RobotRows:
    """A robot's rows not yet in a segment, and where its next segment begins."""

    prev: BagTick
    rows: list[_Row] = field(default_factory=list)
    episode: int = 0
    t: int = 0
    ended: bool = False
    """The episode has ended and the robot was not reset yet."""


def iter_segments(
    path: str | Path, segment_steps: int = 32, progress: Progress | None = None
) -> Iterator[pb.Segment]:
    """The transitions of a bag as trainer segments (identity: robot name, env 0, episode, t),
    each as soon as it is whole (robots' segments interleaved, each robot's in order); what it
    holds does not grow with the bag. ``progress`` and errors as for :func:`bag_ticks`.

    Row ``j`` of a robot is (observation of tick ``j-1``, action of tick ``j``) with the
    reward and flags of tick ``j``; a robot's first tick has no observation before it and
    starts no row. The row of a reset tick (autoreset) closes its episode's last segment.
    The rows between an episode's last tick and the reset (an e-stopped robot is held, not
    reset, until its e-stop is reset) are masked as autoreset rows too.
    """
    if segment_steps < 1:
        raise ValueError(f"segment_steps must be >= 1, got {segment_steps}")
    robots: dict[str, _RobotRows] = {}
    seq = 0
    for robot, cur in bag_ticks(path, progress):
        r = robots.get(robot)
        if r is None:
            robots[robot] = _RobotRows(cur)
            continue
        if cur.step.tick <= r.prev.step.tick:
            raise ValueError(
                f"bag {path}: robot {robot}'s tick {cur.step.tick} at t={cur.time_ns} ns comes after "
                f"its tick {r.prev.step.tick} (the bag's ticks are not in time order)"
            )
        r.rows.append((r.prev, cur, r.ended or cur.step.reset))
        r.ended = (r.ended or cur.step.terminated or cur.step.truncated) and not cur.step.reset
        r.prev = cur
        if cur.step.reset or len(r.rows) == segment_steps:
            seq += 1
            yield _segment(robot, r.rows, cur.obs, seq=seq, episode=r.episode, t=r.t)
            r.episode, r.t = (r.episode + 1, 0) if cur.step.reset else (r.episode, r.t + len(r.rows))
            r.rows = []
    for robot, r in sorted(robots.items()):
        if r.rows:
            seq += 1
            yield _segment(robot, r.rows, r.prev.obs, seq=seq, episode=r.episode, t=r.t)


def bag_to_segments(path: str | Path, segment_steps: int = 32) -> list[pb.Segment]:
    """Every segment of :func:`iter_segments`, in a list."""
    return list(iter_segments(path, segment_steps))


_SEGMENTS_TAG = b"\x0a"
"""``TransitionBatch.segments``: field 1, length-delimited."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def save_transitions(segments: Iterable[pb.Segment], path: str | Path) -> tuple[int, int]:
    """Write segments as one ``edgerl.v1.TransitionBatch`` message (what the Learner stream
    carries), one segment at a time: the bytes of the whole message, which is never built (a
    long session's is past the 2 GiB that protobuf serialises at once). A file appears whole or
    not at all (it is written under a temporary name); a path that is not a file of its own (a
    pipe, ``/dev/stdout``, a link) is written as it is, never replaced. Returns the segments and
    the transitions written."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        with open(path, "wb") as f:
            return _write_segments(segments, f)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            written = _write_segments(segments, f)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return written


def _write_segments(segments: Iterable[pb.Segment], f: BinaryIO) -> tuple[int, int]:
    n_segments = n_rows = 0
    for seg in segments:
        data = seg.SerializeToString()
        f.write(_SEGMENTS_TAG + _varint(len(data)) + data)
        n_segments += 1
        n_rows += len(seg.rewards)
    return n_segments, n_rows


def iter_transitions(path: str | Path) -> Iterator[pb.Segment]:
    """The segments of a file written by :func:`save_transitions` (``edgerl bag import``), read
    one at a time: a file past 2 GiB, which protobuf does not parse as one message, reads too.

    Raises:
        ValueError: the file is not a ``TransitionBatch`` of segments only, or is cut short.
    """
    with open(path, "rb") as f:
        while tag := f.read(1):
            if tag != _SEGMENTS_TAG:
                raise ValueError(
                    f"{path}: not an edgerl.v1.TransitionBatch (byte {f.tell() - 1} is no segment's start)"
                )
            size = _read_varint(f, path)
            start = f.tell()
            data = f.read(size)
            if len(data) < size:
                raise ValueError(f"{path}: cut short (a segment at byte {start} needs {size} bytes)")
            yield pb.Segment.FromString(data)


def _read_varint(f: BinaryIO, path: str | Path) -> int:
    n = shift = 0
    while byte := f.read(1):
        n |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return n
        shift += 7
    raise ValueError(f"{path}: cut short (in a segment's length)")


def load_transitions(path: str | Path) -> list[pb.Segment]:
    """Every segment of :func:`iter_transitions`, in a list."""
    return list(iter_transitions(path))


_MCAP_MAGIC = b"\x89MCAP0\r\n"
_U16, _U32, _U64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<Q")
_CHUNK_HEAD = struct.Struct("<QQQI")  # message start and end times, uncompressed size and CRC
_MESSAGE_HEAD = struct.Struct("<HIQQ")  # channel, sequence, log time, publish time


def _mcap_string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = _U32.unpack_from(buf, pos)
    return bytes(buf[pos + 4 : pos + 4 + n]).decode(), pos + 4 + n


def _whole_records(f: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """The records of an MCAP file as (opcode, content), up to the first one cut short."""
    while len(head := f.read(9)) == 9:
        op, (size,) = head[0], _U64.unpack(head[1:])
        content = f.read(size)
        if len(content) < size:
            return
        yield op, content


_Channel = tuple[str, str]
"""An MCAP channel: (topic, message type)."""


def _mcap_salvage(path: Path) -> Iterator[tuple[_Channel, int, bytes]]:
    """The messages of every whole chunk of an MCAP file that may end anywhere (its disk filled:
    no summary, no footer), as (channel, log time, data), in the file's order."""
    schemas: dict[int, str] = {}
    channels: dict[int, _Channel] = {}

    def take(records: Iterator[tuple[int, bytes]]) -> Iterator[tuple[_Channel, int, bytes]]:
        for op, content in records:
            buf = memoryview(content)
            if op == 0x03:  # schema: id, name, encoding, data
                schemas[_U16.unpack_from(buf, 0)[0]] = _mcap_string(buf, 2)[0]
            elif op == 0x04:  # channel: id, schema id, topic, encoding, metadata
                cid, sid = _U16.unpack_from(buf, 0)[0], _U16.unpack_from(buf, 2)[0]
                channels[cid] = (_mcap_string(buf, 4)[0], schemas.get(sid, ""))
            elif op == 0x05:  # message: channel, sequence, log time, publish time, data
                cid, _, log_time, _ = _MESSAGE_HEAD.unpack_from(buf, 0)
                yield channels[cid], log_time, content[_MESSAGE_HEAD.size :]
            elif op == 0x06:  # chunk: times, size, CRC, compression, records (rosbags puts all in them)
                _, _, size, crc = _CHUNK_HEAD.unpack_from(buf, 0)
                compression, pos = _mcap_string(buf, _CHUNK_HEAD.size)
                (n,) = _U64.unpack_from(buf, pos)
                inner = decompress(bytes(buf[pos + 8 : pos + 8 + n]), compression, size, crc)
                yield from take(_whole_records(io.BytesIO(inner)))

    with open(path, "rb") as f:
        if f.read(8) != _MCAP_MAGIC:
            raise ValueError(f"{path}: not an MCAP file")
        yield from take(_whole_records(f))


def repair_bag(path: str | Path, out: str | Path) -> dict[str, Any]:
    """A new bag at ``out`` with what can be read of a recording that was never closed (its disk
    filled: the MCAP file ends inside a chunk, and there is no summary, footer or
    ``metadata.yaml``): every whole chunk's messages, less the ticks of a robot that lack a
    message (a chunk may end inside a tick). It reads as it writes, holding one tick a robot.
    Returns what it kept.

    Raises:
        FileNotFoundError: no folder at ``path``, or no ``.mcap`` file in it.
        FileExistsError: ``out`` exists.
        ValueError: the file is not MCAP, holds not one whole chunk, or holds a topic of a type
            edgerl does not record.
    """
    folder, out = Path(path), Path(out)
    if not folder.is_dir():
        raise FileNotFoundError(f"bag {path}: no such folder")
    files = sorted(folder.glob("*.mcap"))
    if not files:
        raise FileNotFoundError(f"bag {path}: no .mcap file in this folder")
    if out.exists():
        raise FileExistsError(f"--out: {out} exists; rosbag2 writes a new folder")
    store = typestore()
    kept = ticks = cut = 0
    try:
        with Writer(out, version=9, storage_plugin=StoragePlugin.MCAP) as writer:
            conns: dict[_Channel, Any] = {}  # by topic and type: each file of a split bag numbers its own

            def write(channel: _Channel, t_ns: int, data: bytes) -> None:
                nonlocal kept
                if channel not in conns:
                    topic, typ = channel
                    if typ not in store.types:
                        raise ValueError(
                            f"bag {path}: topic {topic} is of a type edgerl does not record: {typ!r}"
                        )
                    conns[channel] = writer.add_connection(topic, typ, typestore=store)
                writer.write(conns[channel], t_ns, data)
                kept += 1

            def robot_messages() -> Iterator[tuple[str, int, str, tuple[_Channel, int, bytes]]]:
                """The robots' messages, to be gathered into ticks; any other is written at once."""
                for file in files:
                    for channel, t_ns, data in _mcap_salvage(file):
                        if channel[0].startswith("/edgerl/"):
                            _, _, robot, kind = channel[0].split("/", 3)
                            yield robot, t_ns, kind, (channel, t_ns, data)
                        else:
                            write(channel, t_ns, data)

            for _, _, parts in _robot_ticks(robot_messages()):
                if TICK_KINDS.keys() <= parts.keys():
                    for message in parts.values():
                        write(*message)
                    ticks += 1
                else:  # a chunk ended inside it
                    cut += 1
            if not kept:
                raise ValueError(
                    f"bag {path}: not one whole chunk (rosbags writes one each 1 MiB): nothing to save"
                )
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return {"path": str(path), "out": str(out), "messages": kept, "ticks": ticks, "ticks_cut": cut}


@dataclass
class _RobotSummary:
    ticks: int
    first_ns: int
    last_ns: int
    obs_dim: int
    act_dim: int
    episodes_ended: int = 0
    reward_sum: float = 0.0
    fallbacks: int = 0
    estop_ticks: int = 0
    versions: tuple[int, int] | None = None
    """The least and the greatest policy version of its policy actions."""


def bag_info(path: str | Path, progress: Progress | None = None) -> dict[str, Any]:
    """A summary of a bag: per robot ticks, duration, episodes, fallbacks, e-stops, versions;
    ``progress`` and errors as for :func:`bag_ticks`, and as little held."""
    robots: dict[str, _RobotSummary] = {}
    for robot, tick in bag_ticks(path, progress):
        r = robots.get(robot)
        if r is None:
            r = robots[robot] = _RobotSummary(0, tick.time_ns, tick.time_ns, tick.obs.size, tick.action.size)
        s = tick.step
        r.ticks += 1
        r.first_ns, r.last_ns = min(r.first_ns, tick.time_ns), max(r.last_ns, tick.time_ns)
        r.episodes_ended += s.terminated or s.truncated
        r.reward_sum += s.reward
        r.fallbacks += s.fallback
        r.estop_ticks += s.estop
        if not s.fallback:
            v = s.policy_version
            r.versions = (v, v) if r.versions is None else (min(r.versions[0], v), max(r.versions[1], v))
    out: dict[str, Any] = {"path": str(path), "robots": {}}
    for robot, r in sorted(robots.items()):
        duration = (r.last_ns - r.first_ns) / 1e9
        out["robots"][robot] = {
            "ticks": r.ticks,
            "duration_s": duration,
            "rate_hz": (r.ticks - 1) / duration if duration > 0 else math.nan,
            "episodes_ended": r.episodes_ended,
            "reward_sum": r.reward_sum,
            "fallbacks": r.fallbacks,
            "estop_ticks": r.estop_ticks,
            "policy_versions": list(r.versions) if r.versions else [],
            "obs_dim": r.obs_dim,
            "act_dim": r.act_dim,
        }
    return out
