"""Robot sessions recorded as ROS 2 bags (MCAP), read back with rosbags, imported as transitions."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rosbags.rosbag2 import Reader, StoragePlugin, Writer
from rosbags.typesys import get_types_from_msg
from tqdm import tqdm

from edgerl.edge_server.policy import TorchPolicyBackend
from edgerl.launch.cli import main
from edgerl.launch.robot import ESTOPPED_STATUS
from edgerl.models import build_policy
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.robot_client.bags import (
    STEP_TYPE,
    BagRecorder,
    RobotTopics,
    bag_info,
    bag_ticks,
    bag_to_segments,
    iter_segments,
    iter_transitions,
    load_transitions,
    read_bag,
    repair_bag,
    save_transitions,
    typestore,
)
from edgerl.robot_client.runner import RobotHost, RobotRunnerConfig
from edgerl.sim.envs import env_spec
from edgerl.sim.robot import MujocoRobot
from edgerl.trainer.segments import EpisodeTracker, assemble
from edgerl.watchdog.watchdog import Tick, TickKind, WatchdogConfig
from tests.helpers import ServerThread

ENV = "InvertedPendulum-v5"  # an untrained policy drops the pole within a second: resets happen


def _topics(robot: MujocoRobot) -> RobotTopics:
    return RobotTopics(robot.name, robot.joint_names, robot.action_low.size)


@pytest.fixture(scope="module")
def robots() -> list[MujocoRobot]:
    """The two MuJoCo robots :func:`session` drives (and closes: their names stay to read)."""
    return [MujocoRobot(ENV, hz=50.0, seed=i, name=f"pendulum-{i}") for i in range(2)]


@pytest.fixture(scope="module")
def session(
    tmp_path_factory: pytest.TempPathFactory, robots: list[MujocoRobot]
) -> tuple[Path, list[list[tuple[Tick, Any, bool]]]]:
    """Two MuJoCo robots driven for 2 s against a real server, every tick recorded."""
    spec = env_spec(ENV)
    net = build_policy("mlp-small", spec.obs_shape[0], spec.act_shape[0], seed=0)
    path = tmp_path_factory.mktemp("bags") / "session"
    recorder = BagRecorder(path, [_topics(r) for r in robots])
    seen: list[list[tuple[Tick, Any, bool]]] = [[], []]

    def on_tick(i: int, tick: Tick, reading: Any, was_reset: bool) -> None:
        seen[i].append((tick, reading, was_reset))
        recorder.record(i, tick, reading, was_reset)

    with ServerThread(TorchPolicyBackend(net, spec.act_low, spec.act_high)) as srv:
        cfg = RobotRunnerConfig(srv.address, WatchdogConfig(hz=50.0, estop_after=0))
        with RobotHost(robots, cfg, on_tick=on_tick):
            time.sleep(2.0)
    recorder.close()
    assert recorder.dropped == 0 and recorder.written == sum(len(s) for s in seen)
    return path, seen


def test_bag_reads_back_with_rosbags_standard_types(session: tuple[Path, Any]) -> None:
    path, seen = session
    store = typestore()
    assert "storage_identifier: mcap" in (path / "metadata.yaml").read_text()
    assert list(path.glob("*.mcap"))
    with Reader(path) as reader:
        types = {c.topic: c.msgtype for c in reader.connections}
        assert types["/edgerl/pendulum-0/observation"] == "sensor_msgs/msg/JointState"
        assert types["/edgerl/pendulum-0/action"] == "std_msgs/msg/Float32MultiArray"
        assert types["/edgerl/pendulum-1/step"] == STEP_TYPE
        conns = [c for c in reader.connections if c.topic == "/edgerl/pendulum-0/step"]
        stamps: list[int] = []
        msgs: list[Any] = []
        for conn, t_ns, raw in reader.messages(connections=conns):
            msg: Any = store.deserialize_cdr(raw, conn.msgtype)
            assert msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec == t_ns
            stamps.append(t_ns)
            msgs.append(msg)
    ticks = [t for t, _, _ in seen[0]]
    assert [m.tick for m in msgs] == [t.index for t in ticks]
    # timestamps are the control-loop times (shifted by one constant to the wall clock)
    np.testing.assert_allclose(np.diff(stamps) / 1e9, np.diff([t.time for t in ticks]), atol=2e-6)
    assert [m.fallback for m in msgs] == [t.fallback for t in ticks]


def test_import_gives_the_transitions_the_robot_made(session: tuple[Path, Any]) -> None:
    path, seen = session
    segments = bag_to_segments(path, segment_steps=16)
    for i, ticks in enumerate(seen):
        segs = [s for s in segments if s.session_id == f"pendulum-{i}"]
        obs = np.concatenate([np.frombuffer(s.obs.data, np.float32).reshape(-1, 4) for s in segs])
        act = np.concatenate([np.frombuffer(s.actions.data, np.float32).reshape(-1, 1) for s in segs])
        rew = np.concatenate([np.asarray(s.rewards, np.float32) for s in segs])
        auto = np.concatenate([np.asarray(s.autoreset, bool) for s in segs])
        fb = np.concatenate([np.asarray(s.fallback, bool) for s in segs])
        # expected: row j = (observation read at tick j-1, action of tick j) -> reward/flags of tick j
        np.testing.assert_array_equal(obs, np.stack([r.obs for _, r, _ in ticks[:-1]]))
        np.testing.assert_array_equal(act[:, 0], [t.action[0] for t, _, _ in ticks[1:]])
        np.testing.assert_array_equal(rew, [r.reward for _, r, _ in ticks[1:]])
        np.testing.assert_array_equal(auto, [rs for _, _, rs in ticks[1:]])
        np.testing.assert_array_equal(fb, [t.fallback for t, _, _ in ticks[1:]])
        assert auto.sum() >= 1  # the pendulum fell and the robot was reset
        # a reset row closes its episode; the next segment starts episode + 1 at t = 0
        for a, b in itertools.pairwise(segs):
            if a.autoreset[-1]:
                assert (b.episode, b.t) == (a.episode + 1, 0)
            else:
                assert (b.episode, b.t) == (a.episode, a.t + len(a.rewards))
    tracker = EpisodeTracker()
    batch = assemble(segments, None, tracker)
    assert batch.autoreset.sum() == sum(sum(s.autoreset) for s in segments)
    # every episode the robots ended is in the bag whole: the trainer logs each of them
    ended = (batch.terminated | batch.truncated) & ~batch.autoreset
    assert (tracker.log.count, tracker.cut) == (int(ended.sum()), 0)
    assert tracker.log.count >= 1


def test_save_load_and_info(session: tuple[Path, Any], tmp_path: Path) -> None:
    path, seen = session
    segments = bag_to_segments(path)
    out = tmp_path / "t.pb"
    save_transitions(segments, out)
    assert load_transitions(out) == segments
    info = bag_info(path)["robots"]["pendulum-1"]
    assert info["ticks"] == len(seen[1])
    assert info["fallbacks"] == sum(t.fallback for t, _, _ in seen[1])
    assert info["episodes_ended"] == sum(r.terminated or r.truncated for _, r, _ in seen[1])
    ticks = [t for t, _, _ in seen[1]]  # the bag's rate is the ticks' own, a tick a busy loop skipped too
    assert info["rate_hz"] == pytest.approx((len(ticks) - 1) / (ticks[-1].time - ticks[0].time), rel=1e-6)
    assert info["rate_hz"] == pytest.approx(50.0, rel=0.1)  # the loop ran at about its rate
    assert (info["obs_dim"], info["act_dim"]) == (4, 1)


def test_bag_cli(session: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = session
    assert main(["bag", "info", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info["robots"]) == {"pendulum-0", "pendulum-1"}
    out = tmp_path / "x.pb"
    assert main(["bag", "import", str(path), "--out", str(out), "--segment-steps", "8"]) == 0
    said = capsys.readouterr()
    segments = load_transitions(out)
    rows = sum(len(s.rewards) for s in segments)
    assert said.out == f"edgerl: {rows} transitions in {len(segments)} segments -> {out}\n"
    assert all(len(s.rewards) <= 8 for s in segments)
    messages = tqdm.format_sizeof(3 * sum(info["robots"][r]["ticks"] for r in info["robots"]))
    assert f"| {messages}/{messages} [" in said.err.split("\r")[-1]  # the bar over the bag's messages, full
    assert main(["bag", "msg"]) == 0
    assert "uint64 policy_version" in capsys.readouterr().out


def test_segments_come_while_the_bag_is_read_and_are_written_as_one_transition_batch(
    session: tuple[Path, Any], tmp_path: Path
) -> None:
    """Nothing waits for the whole bag (a long session's ticks, all held, took ~4.8 KB each):
    the first segment comes before the bag's end, and the file is written segment by segment."""
    path, seen = session
    told: list[tuple[int, int]] = []
    segments = iter_segments(path, 16, progress=lambda read, total: told.append((read, total)))
    first = next(segments)
    assert told == []  # the reader tells its end (and every 1,000 messages): not reached yet
    rest = list(segments)
    messages = 3 * (len(seen[0]) + len(seen[1]))
    assert told[-1] == (messages, messages)
    out = tmp_path / "t.pb"
    written = save_transitions(iter([first, *rest]), out)
    assert written == (1 + len(rest), sum(len(s.rewards) for s in [first, *rest]))
    assert out.read_bytes() == pb.TransitionBatch(segments=[first, *rest]).SerializeToString()
    assert list(iter_transitions(out)) == [first, *rest]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.pb"]


def test_a_failed_write_leaves_no_file_and_an_earlier_one_as_it_was(
    session: tuple[Path, Any], tmp_path: Path
) -> None:
    path, _ = session
    out = tmp_path / "t.pb"
    out.write_bytes(b"an earlier import")

    def failing() -> Any:
        yield from bag_to_segments(path)[:3]
        raise ValueError("the bag broke")

    with pytest.raises(ValueError, match=r"^the bag broke$"):
        save_transitions(failing(), out)
    assert out.read_bytes() == b"an earlier import"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.pb"]


def test_a_pipe_or_a_link_given_as_the_output_is_written_through_not_replaced(
    session: tuple[Path, Any], tmp_path: Path
) -> None:
    """``--out /dev/stdout`` (a link to a pipe or a terminal) once was, under the temporary
    name: renamed over, as root it would have replaced the system's ``/dev/stdout``."""
    path, _ = session
    segments = bag_to_segments(path)
    whole = pb.TransitionBatch(segments=segments).SerializeToString()
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(pipe.read_bytes()), daemon=True)
    reader.start()
    save_transitions(segments, pipe)
    reader.join(10.0)
    assert got == [whole] and stat.S_ISFIFO(pipe.lstat().st_mode)
    target, link = tmp_path / "target.pb", tmp_path / "link.pb"
    link.symlink_to(target)
    save_transitions(segments, link)
    assert link.is_symlink() and target.read_bytes() == whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.pb", "pipe", "target.pb"]


def test_a_file_that_is_not_transitions_is_refused_naming_where(tmp_path: Path) -> None:
    seg = pb.Segment(session_id="r", rewards=[1.0, 2.0])
    whole = pb.TransitionBatch(segments=[seg, seg]).SerializeToString()
    cases = {
        "cut.pb": (whole[:-1], r"cut\.pb: cut short \(a segment at byte \d+ needs \d+ bytes\)$"),
        "cut-length.pb": (whole[:1], r"cut-length\.pb: cut short \(in a segment's length\)$"),
        "other.pb": (
            b"\x12\x00",
            r"other\.pb: not an edgerl\.v1\.TransitionBatch \(byte 0 is no segment's start\)$",
        ),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=message):
            load_transitions(tmp_path / name)
    (tmp_path / "empty.pb").write_bytes(b"")
    assert load_transitions(tmp_path / "empty.pb") == []


def _rewritten(path: Path, out: Path, change: Any) -> Path:
    """A copy of the bag at ``path`` whose messages pass through ``change(robot, kind, index, msg)``
    (``index``: the robot's tick, counted from 0), which returns the message to write or None."""
    store = typestore()
    with Reader(path) as reader, Writer(out, version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        conns = {c.id: writer.add_connection(c.topic, c.msgtype, typestore=store) for c in reader.connections}
        counts: dict[str, int] = {}
        for conn, t_ns, raw in reader.messages():
            _, _, robot, kind = conn.topic.split("/", 3)
            index = counts.get(conn.topic, 0)
            counts[conn.topic] = index + 1
            msg = change(robot, kind, index, store.deserialize_cdr(raw, conn.msgtype))
            if msg is not None:
                writer.write(conns[conn.id], t_ns, store.serialize_cdr(msg, conn.msgtype))
    return out


def test_a_tick_that_lacks_a_message_is_refused_when_its_robots_next_tick_begins(
    session: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, seen = session
    gap = _rewritten(
        path,
        tmp_path / "gap",
        lambda robot, kind, index, msg: (
            None if (robot, kind, index) == ("pendulum-0", "observation", 9) else msg
        ),
    )
    before = []
    with pytest.raises(
        ValueError, match=r"gap: robot pendulum-0 at t=(\d+) ns lacks \['observation'\]$"
    ) as info:
        for robot, tick in bag_ticks(gap):
            before.append((robot, tick.step.tick))
    ticks = [tick for r, tick in before if r == "pendulum-0"]
    assert ticks == [t.index for t, _, _ in seen[0][:9]]  # said at the next tick, not at the bag's end
    assert len(before) < len(seen[0]) + len(seen[1]) - 2
    assert int(info.value.args[0].split("t=")[1].split(" ")[0]) == read_bag(path)["pendulum-0"][9].time_ns
    out = tmp_path / "x.pb"
    assert main(["bag", "import", str(gap), "--out", str(out)]) == 2
    assert "robot pendulum-0 at t=" in capsys.readouterr().err.splitlines()[-1]
    assert not out.exists()


def test_ticks_out_of_time_order_are_refused_on_import(session: tuple[Path, Any], tmp_path: Path) -> None:
    path, seen = session

    def renumbered(robot: str, kind: str, index: int, msg: Any) -> Any:
        if (robot, kind, index) == ("pendulum-1", "step", 5):
            msg.tick = 1000
        return msg

    bag = _rewritten(path, tmp_path / "renumbered", renumbered)
    sixth = seen[1][6][0].index
    with pytest.raises(
        ValueError, match=rf"robot pendulum-1's tick {sixth} at t=\d+ ns comes after its tick 1000 "
    ):
        list(iter_segments(bag))
    assert [t.step.tick for t in read_bag(bag)["pendulum-1"]][-1] == 1000  # read_bag sorts by tick


def test_a_robot_e_stopped_when_its_episode_ends_is_held_and_its_rows_are_masked(tmp_path: Path) -> None:
    bag = tmp_path / "held"
    # no server: the robot runs on fallbacks, e-stops after 20 ticks, and the pole falls later
    code = main(
        ["robot", "--server", "127.0.0.1:1", "--robot-arg", f"env={ENV}", "--hz", "50", "--seconds", "3",
         "--connect-timeout-s", "0", "--estop-after", "20", "--record", str(bag)]
    )  # fmt: skip
    assert code == ESTOPPED_STATUS
    ((robot, ticks),) = read_bag(bag).items()
    steps = [t.step for t in ticks]
    end = next(k for k, step in enumerate(steps) if step.terminated or step.truncated)
    held = steps[end + 1 :]
    assert steps[end].estop and len(held) >= 25  # the pole fell under the e-stop, 0.5 s before the end
    # held, not reset (a reset moves a real robot), on the e-stop's ticks: no reward, no episode
    assert all(step.estop and not (step.reset or step.terminated or step.truncated) for step in held)
    assert not any(step.reward for step in held)
    segments = bag_to_segments(bag, segment_steps=16)
    autoreset = [masked for s in segments for masked in s.autoreset]
    # row j holds tick j's flags: the episode's rows are transitions, the rows after it are masked
    assert autoreset == [False] * end + [True] * len(held)
    assert bag_info(bag)["robots"][robot]["episodes_ended"] == 1


def _string_bag(path: Path, topic: str) -> Path:
    """A rosbag2 bag (MCAP) holding one ``std_msgs/msg/String`` on ``topic``, at t = 5 ns."""
    store = typestore()
    with Writer(path, version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        conn = writer.add_connection(topic, "std_msgs/msg/String", typestore=store)
        message = store.types["std_msgs/msg/String"](data="hello")
        writer.write(conn, 5, store.serialize_cdr(message, "std_msgs/msg/String"))
    return path


def test_paths_that_hold_no_readable_bag_are_refused_naming_what_is_missing(
    session: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = session

    def broken(name: str, change: Any) -> Path:
        copy = tmp_path / name
        shutil.copytree(path, copy)
        change(copy)
        return copy

    no_storage = broken("no-mcap", lambda bag: [f.unlink() for f in bag.glob("*.mcap")])
    bad_yaml = broken("bad-yaml", lambda bag: (bag / "metadata.yaml").write_text("topics: [\n"))
    bad_mcap = broken("bad-mcap", lambda bag: [f.write_bytes(b"not mcap") for f in bag.glob("*.mcap")])
    chatter = _string_bag(tmp_path / "chatter", "/chatter")  # a readable bag of another program
    partial = _string_bag(tmp_path / "partial", "/edgerl/r0/note")  # a robot's topic, not its tick
    mistyped = _string_bag(tmp_path / "mistyped", "/edgerl/r0/step")
    cases = [
        (tmp_path / "missing", FileNotFoundError, r"missing: no such folder"),
        (tmp_path, FileNotFoundError, r": no metadata.yaml in this folder"),
        (no_storage, ValueError, r"no-mcap: cannot be read \(Some database files are missing"),
        (bad_yaml, ValueError, r"bad-yaml: cannot be read \(Could not load YAML"),
        (bad_mcap, ValueError, r"bad-mcap: cannot be read \(File magic is invalid"),
        (chatter, ValueError, r"chatter: no /edgerl/<robot>/\.\.\. topics$"),
        (partial, ValueError, r"partial: robot r0 at t=5 ns lacks \['action', 'observation', 'step'\]$"),
        (
            mistyped,
            ValueError,
            r"mistyped: topic /edgerl/r0/step is std_msgs/msg/String, not edgerl_msgs/msg/Step$",
        ),
    ]
    for bag, error, message in cases:
        with pytest.raises(error, match=message):
            bag_info(bag)
        assert main(["bag", "import", str(bag), "--out", str(tmp_path / "x.pb")]) == 2
        assert re.search(message, capsys.readouterr().err.splitlines()[-1]), bag
    assert not (tmp_path / "x.pb").exists()


def _long_recording(path: Path, ticks: int) -> list[RobotTopics]:
    """A bag of two robots of ``ticks`` ticks each, written by the recorder (rosbags writes a
    chunk each 1 MiB: ~330 bytes a tick here, so several chunks)."""
    robots = [RobotTopics(f"r{i}", ("x", "x_dot", "theta", "theta_dot"), 1) for i in range(2)]
    recorder = BagRecorder(path, robots)
    for k in range(ticks):
        for i in range(2):
            tick = Tick(
                k,
                k * 0.02,
                k * 0.02,
                np.array([k / ticks], np.float32),
                TickKind.POLICY,
                0.004,
                (k // 50, -1.5),
            )
            reading = types.SimpleNamespace(
                obs=np.full(4, k + i, np.float64), reward=1.0, terminated=k % 500 == 499, truncated=False
            )
            recorder.record(i, tick, reading, k % 500 == 0 and k > 0)
    recorder.close()
    assert recorder.error is None and recorder.written == 2 * ticks
    return robots


def test_a_recording_its_disk_cut_short_is_repaired_to_its_whole_chunks(tmp_path: Path) -> None:
    """A recording whose disk filled: its .mcap ends inside a chunk, with no summary, footer or
    metadata.yaml. ``bag info`` says so and names the repair; ``bag repair`` writes a bag of the
    whole chunks' ticks, each as it was recorded, less a last tick a chunk cut in two."""
    whole = tmp_path / "whole"
    _long_recording(whole, 6000)
    cut = tmp_path / "cut"
    cut.mkdir()
    data = (whole / "whole.mcap").read_bytes()
    (cut / "cut.mcap").write_bytes(data[: int(2.5 * 2**20)])  # two whole chunks and half of one
    with pytest.raises(
        FileNotFoundError, match=rf"recording that was never closed .*: edgerl bag repair {cut} "
    ):
        bag_info(cut)
    out = tmp_path / "repaired"
    report = repair_bag(cut, out)
    recorded, repaired = read_bag(whole), read_bag(out)
    assert set(repaired) == {"r0", "r1"} and report["ticks"] == sum(len(t) for t in repaired.values())
    for robot, ticks in repaired.items():
        assert 2 * 2**20 / (2 * 400) < len(ticks) < 6000  # two chunks of two robots' ticks, not all
        for got, was in zip(ticks, recorded[robot], strict=False):
            assert (got.time_ns, got.step.tick, got.step.reward) == (
                was.time_ns,
                was.step.tick,
                was.step.reward,
            )
            assert np.array_equal(got.obs, was.obs) and np.array_equal(got.action, was.action)
    assert report["messages"] == 3 * report["ticks"]
    assert sum(1 for _ in iter_segments(out)) > 0  # it imports
    with pytest.raises(FileExistsError, match=r"^--out: .*repaired exists; rosbag2 writes a new folder$"):
        repair_bag(cut, out)
    (cut / "cut.mcap").write_bytes(b"not mcap")
    with pytest.raises(ValueError, match=r"cut\.mcap: not an MCAP file$"):
        repair_bag(cut, tmp_path / "again")
    assert not (tmp_path / "again").exists()
    odd = tmp_path / "odd"  # a whole bag with a topic of a type edgerl does not record
    store = typestore()
    store.register(get_types_from_msg("int32 n", "test_msgs/msg/Odd"))
    with Writer(odd, version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        conn = writer.add_connection("/odd", "test_msgs/msg/Odd", typestore=store)
        writer.write(conn, 5, store.serialize_cdr(store.types["test_msgs/msg/Odd"](n=1), "test_msgs/msg/Odd"))
    with pytest.raises(
        ValueError, match=r"topic /odd is of a type edgerl does not record: 'test_msgs/msg/Odd'$"
    ):
        repair_bag(odd, tmp_path / "again")
    assert not (tmp_path / "again").exists()  # the bag it had begun is removed


def test_recorder_refuses_to_overwrite(session: tuple[Path, Any]) -> None:
    path, _ = session
    with pytest.raises(FileExistsError):
        BagRecorder(path, [RobotTopics("r", ("a",), 1)])


def test_ticks_a_stalled_disk_cannot_take_are_dropped_counted_and_said(
    session: tuple[Path, Any],
    robots: list[MujocoRobot],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The control thread never waits on the disk: with the writer stalled (a disk that hangs),
    ticks past ``max_queued`` waiting are dropped and counted, the bag says how many when it
    closes, and the ticks kept are in it."""
    _, seen = session
    robot = robots[0]  # the one whose ticks ``seen[0]`` holds
    disk = threading.Event()
    write = Writer.write

    def stalled(self: Writer, *args: Any, **kwargs: Any) -> None:
        disk.wait(30.0)
        write(self, *args, **kwargs)

    monkeypatch.setattr(Writer, "write", stalled)
    path = tmp_path / "stalled"
    recorder = BagRecorder(path, [_topics(robot)], max_queued=3)
    start = time.monotonic()
    for tick, reading, was_reset in seen[0][:10]:
        recorder.record(0, tick, reading, was_reset)
    recording_s = time.monotonic() - start
    disk.set()
    with caplog.at_level(logging.WARNING, logger="edgerl.robot_client.bags"):
        recorder.close()
    assert recording_s < 5.0  # not the 30 s the stalled write holds its thread
    # the writer took the first tick, or not yet: 3 or 4 kept
    assert (recorder.written, recorder.dropped) in ((3, 7), (4, 6))
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"bag {path}: {recorder.dropped} ticks dropped (writer too slow)"]
    kept = [t.step.tick for t in read_bag(path)[robot.name]]
    assert kept == [t.index for t, _, _ in seen[0][: recorder.written]]
