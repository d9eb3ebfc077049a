"""The simulated tasks: seeded, vectorised, served end to end."""

import contextlib
import json
import math
import multiprocessing as mp
import os
import select
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from edgerl.edge_server.server import ServerConfig
from edgerl.edge_server.transitions import TransitionConfig
from edgerl.launch.processes import (
    EPISODES_PER_MESSAGE,
    MAX_SAID_CHARS,
    OWNER_STOP,
    PolicySpec,
    ServerLostError,
    ServerProcess,
    SharedFlag,
    WorkerError,
    WorkerFleet,
    WorkerLink,
    check_fleet,
    end_with_parent,
    largest_request,
)
from edgerl.robot_client.sim_worker import SimWorker, SimWorkerConfig
from edgerl.sim.envs import SUPPORTED_ENVS, env_spec, make_env, make_vector_env, model_files_key
from edgerl.sim.episodes import EpisodeLog
from edgerl.watchdog.sched import thread_ids
from tests.helpers import EchoPolicy, ended, free_port, run, running_server, wait_until


def test_same_seed_same_trajectory() -> None:
    a, obs_a = make_vector_env("Hopper-v5", 3, seed=7)
    b, obs_b = make_vector_env("Hopper-v5", 3, seed=7)
    c, obs_c = make_vector_env("Hopper-v5", 3, seed=8)
    np.testing.assert_array_equal(obs_a, obs_b)
    assert not np.array_equal(obs_a, obs_c)
    act = np.full((3, 3), 0.3, np.float32)
    np.testing.assert_array_equal(a.step(act)[0], b.step(act)[0])
    for e in (a, b, c):
        e.close()


def test_vector_env_steps_exactly_like_gymnasiums_sync_vector_env() -> None:
    n, steps = 4, 150
    ours, obs = make_vector_env("Hopper-v5", n, seed=3)
    ref = gym.vector.SyncVectorEnv([lambda: gym.make("Hopper-v5") for _ in range(n)])
    ref_obs, _ = ref.reset(seed=[3 + i for i in range(n)])
    np.testing.assert_array_equal(obs, ref_obs.astype(np.float32))
    actions = np.random.default_rng(0).uniform(-1, 1, (steps, n, 3)).astype(np.float32)
    ends = 0
    for t in range(steps):
        got = ours.step(actions[t])
        want = ref.step(actions[t])[:4]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, np.asarray(w).astype(g.dtype), err_msg=f"step {t}")
        assert got[0].dtype == np.float32 and got[1].dtype == np.float32 and got[2].dtype == bool
        ends += int((got[2] | got[3]).sum())
    assert ends >= n  # episodes ended and were autoreset along the way
    ours.close()
    ref.close()


def _mujoco(env: gym.Env[Any, Any]) -> Any:
    """The gymnasium ``MujocoEnv`` inside ``env`` (its ``model`` and ``data``)."""
    return env.unwrapped


def test_mujoco_envs_of_a_process_share_one_compiled_model() -> None:
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv
    from gymnasium.envs.mujoco.half_cheetah_v5 import HalfCheetahEnv

    from edgerl.sim.robot import MujocoRobot

    envs, _ = make_vector_env("HalfCheetah-v5", 3, seed=0)
    robot = MujocoRobot("HalfCheetah-v5", hz=50.0)
    raws = [_mujoco(e) for e in [*envs.envs, robot.env]]
    assert all(r.model is raws[0].model for r in raws)
    assert len({id(r.data) for r in raws}) == len(raws)  # a state of its own each
    assert isinstance(raws[0], HalfCheetahEnv) and type(raws[0]).__name__ == "HalfCheetahEnv"
    assert envs.envs[0].spec is not None and envs.envs[0].spec.max_episode_steps == 1000  # the id's own
    own = make_env("HalfCheetah-v5", share_model=False)
    assert isinstance(own.unwrapped, HalfCheetahEnv) and _mujoco(own).model is not raws[0].model
    wider = make_env("HalfCheetah-v5", width=720, height=720)  # the framebuffer's size is in the model
    assert _mujoco(wider).model is not raws[0].model
    assert _mujoco(wider).model.vis.global_.offwidth == 720
    assert _mujoco(make_env("HalfCheetah-v5", width=720, height=720)).model is _mujoco(wider).model
    cartpole = make_env("CartPole-v1")  # not MuJoCo's: built as it is
    assert type(cartpole.unwrapped) is CartPoleEnv
    by_module = make_env("gymnasium.envs.mujoco:HalfCheetah-v5")  # an id gymnasium resolves itself
    assert type(by_module.unwrapped) is HalfCheetahEnv
    for env in (envs, robot, own, wider, cartpole, by_module):
        env.close()


def test_envs_sharing_a_model_step_exactly_as_envs_of_their_own() -> None:
    """Stepped in turn with different actions, two envs of one model keep their states apart."""
    shared = [make_env("HalfCheetah-v5") for _ in range(2)]
    own = [make_env("HalfCheetah-v5", share_model=False) for _ in range(2)]
    assert _mujoco(shared[0]).model is _mujoco(shared[1]).model
    for i, (s, o) in enumerate(zip(shared, own, strict=True)):
        np.testing.assert_array_equal(s.reset(seed=i)[0], o.reset(seed=i)[0])
    actions = np.random.default_rng(1).uniform(-1, 1, (100, 2, 6)).astype(np.float32)
    for t in range(len(actions)):
        for i in range(2):
            got, want = shared[i].step(actions[t, i]), own[i].step(actions[t, i])
            np.testing.assert_array_equal(got[0], want[0], err_msg=f"env {i} step {t}")
            assert got[1] == want[1]
    assert not np.array_equal(_mujoco(shared[0]).data.qpos, _mujoco(shared[1]).data.qpos)
    for env in (*shared, *own):
        env.close()


def test_a_model_file_written_again_is_compiled_again_and_unused_models_are_let_go(tmp_path: Path) -> None:
    import gc
    import weakref

    from gymnasium.envs import mujoco as gym_mujoco

    xml = (Path(gym_mujoco.__file__).parent / "assets" / "inverted_pendulum.xml").read_text()
    path = tmp_path / "pendulum.xml"
    path.write_text(xml)
    first = [make_env("InvertedPendulum-v5", xml_file=str(path)) for _ in range(2)]
    assert _mujoco(first[0]).model is _mujoco(first[1]).model
    assert _mujoco(first[0]).model.opt.timestep == pytest.approx(0.02)
    path.write_text(xml.replace('timestep="0.02"', 'timestep="0.01"'))  # the same size, a new model
    second = make_env("InvertedPendulum-v5", xml_file=str(path))
    assert _mujoco(second).model.opt.timestep == pytest.approx(0.01)
    assert _mujoco(first[0]).model.opt.timestep == pytest.approx(0.02)  # live envs keep theirs
    old = weakref.ref(_mujoco(first[0]).model)
    for env in first:
        env.close()
    del env, first
    gc.collect()
    assert old() is None  # no env holds it, so neither does the cache
    assert _mujoco(second).model.opt.timestep == pytest.approx(0.01)
    second.close()


_TETRAHEDRON = "v 0 0 0\nv 0.1 0 0\nv 0 0.1 0\nv 0 0 0.1\nf 1 3 2\nf 1 2 4\nf 1 4 3\nf 2 3 4\n"
_PYRAMID = (  # a square base: one vertex more
    "v 0 0 0\nv 0.1 0 0\nv 0.1 0.1 0\nv 0 0.1 0\nv 0.05 0.05 0.1\n"
    "f 1 4 3\nf 1 3 2\nf 1 2 5\nf 2 3 5\nf 3 4 5\nf 4 1 5\n"
)


def test_a_model_whose_included_file_or_mesh_is_written_again_is_compiled_again(tmp_path: Path) -> None:
    from gymnasium.envs import mujoco as gym_mujoco

    xml = (Path(gym_mujoco.__file__).parent / "assets" / "inverted_pendulum.xml").read_text()
    option = '<option gravity="0 0 -9.81" integrator="RK4" timestep="0.02"/>'
    assert option in xml
    main = xml.replace(option, '<include file="parts/option.xml"/>').replace(
        '<compiler inertiafromgeom="true"/>',
        '<compiler inertiafromgeom="true" meshdir="meshes"/><asset><mesh name="tip" file="tip.obj"/></asset>',
    )
    (tmp_path / "parts").mkdir()
    (tmp_path / "meshes").mkdir()
    (tmp_path / "parts" / "option.xml").write_text(f"<mujoco>{option}</mujoco>")
    (tmp_path / "meshes" / "tip.obj").write_text(_TETRAHEDRON)
    path = tmp_path / "pendulum.xml"
    path.write_text(main)

    envs: list[gym.Env[Any, Any]] = []

    def built() -> Any:
        envs.append(make_env("InvertedPendulum-v5", xml_file=str(path)))
        return _mujoco(envs[-1])

    first = built()
    assert (first.model.opt.timestep, first.model.mesh_vertnum[0]) == (pytest.approx(0.02), 4)
    assert built().model is first.model  # nothing written: shared
    (tmp_path / "parts" / "option.xml").write_text(f"<mujoco>{option.replace('0.02', '0.01')}</mujoco>")
    second = built()
    assert second.model is not first.model
    assert (second.model.opt.timestep, second.model.mesh_vertnum[0]) == (pytest.approx(0.01), 4)
    (tmp_path / "meshes" / "tip.obj").write_text(_PYRAMID)
    third = built()
    assert third.model is not second.model
    assert (third.model.opt.timestep, third.model.mesh_vertnum[0]) == (pytest.approx(0.01), 5)
    assert built().model is third.model
    assert first.model.opt.timestep == pytest.approx(0.02)  # live envs keep theirs
    for env in envs:
        env.close()


def test_model_files_key_follows_includes_once_and_counts_missing_files(tmp_path: Path) -> None:
    texture = '<asset><texture file="t.png"/></asset>'
    (tmp_path / "a.xml").write_text(f'<mujoco><include file="b.xml"/>{texture}</mujoco>')
    (tmp_path / "b.xml").write_text('<mujoco><include file="a.xml"/></mujoco>')  # a loop: read once
    key = model_files_key(str(tmp_path / "a.xml"))
    assert [entry[0] for entry in key] == [str(tmp_path / n) for n in ("a.xml", "b.xml", "t.png")]
    assert key[2] == (str(tmp_path / "t.png"), None)  # not there yet
    (tmp_path / "t.png").write_bytes(b"png")
    assert model_files_key(str(tmp_path / "a.xml"))[2][1] == 3  # there now: its size counts
    (tmp_path / "c.xml").write_text("<mujoco><unclosed></mujoco>")
    assert len(model_files_key(str(tmp_path / "c.xml"))) == 1  # its bytes alone


def test_model_files_key_parses_each_content_once_and_keeps_the_last_64(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgerl.sim import envs

    parsed: list[bytes] = []
    parse = envs._named_files

    def counted(data: bytes) -> Any:
        parsed.append(data)
        return parse(data)

    monkeypatch.setattr(envs, "_named_files", counted)
    monkeypatch.setattr(envs, "_parsed", {})
    path = tmp_path / "m.xml"
    for i in range(70):
        path.write_text(f'<mujoco model="m{i}"><asset><mesh file="m{i}.obj"/></asset></mujoco>')
        first, again = model_files_key(str(path)), model_files_key(str(path))
        assert first == again and first[1] == (str(tmp_path / f"m{i}.obj"), None)
    assert len(parsed) == 70  # once per content, not per key
    assert len(envs._parsed) == envs._MAX_PARSED == 64


_TIMER_PROBE = """
import json, sys, time
import gymnasium as gym
import mujoco
from edgerl.sim.envs import prepare_mujoco
if sys.argv[1] == "own-timer":
    mujoco.set_mjcb_time(time.perf_counter)
if sys.argv[1] != "raw":
    prepare_mujoco()
env = gym.make("HalfCheetah-v5")
env.reset(seed=0)
for _ in range(3):
    env.step(env.action_space.sample())
timer = env.unwrapped.data.timer[mujoco.mjtTimer.mjTIMER_STEP]
print(json.dumps({"steps": timer.number, "seconds": timer.duration,
                  "own": mujoco.get_mjcb_time() is time.perf_counter}))
"""


def _step_timer(case: str, cwd: Path) -> dict[str, Any]:
    """MjData's mj_step timer after 3 steps in a fresh process (the set-up is process-wide) run in
    ``cwd``: its ``steps`` and ``seconds``, whether the timer callback is still the probe's
    ``own``, and whether MuJoCo wrote its warnings to a ``log`` file there."""
    cwd.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", _TIMER_PROBE, case],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=cwd,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["log"] = (cwd / "MUJOCO_LOG.TXT").exists()
    return result


def test_envs_step_without_mujocos_stage_timers_unless_a_callback_of_the_users_is_set(tmp_path: Path) -> None:
    raw, prepared, own = (_step_timer(case, tmp_path / case) for case in ("raw", "prepared", "own-timer"))
    # HalfCheetah's 'settotalmass' warning: MuJoCo's default writes it to MUJOCO_LOG.TXT in the
    # working folder; prepared, it goes to logging (and this one is dropped), no file is written.
    assert raw["log"] and not prepared["log"] and not own["log"]
    # 3 env steps of HalfCheetah's frame_skip 5: 15 mj_step calls, counted in every case.
    assert raw["steps"] == prepared["steps"] == own["steps"] == 15
    assert raw["seconds"] > 0  # the mujoco package's own timer, on by default
    assert prepared["seconds"] == 0.0  # turned off by prepare_mujoco
    assert own["seconds"] > 0 and own["own"]  # a callback of the user's: nothing reset


def test_a_worker_group_counts_episodes_as_gymnasium_plays_them() -> None:
    """Returns and lengths of the episodes a sim worker reports, against the same envs stepped one
    by one with gymnasium (the step after an episode ends resets the env and is no part of one)."""
    from edgerl.robot_client.sim_worker import WorkerProgress, _Group

    n, steps, seed = 3, 120, 5
    group, progress = _Group("InvertedPendulum-v5", list(range(n)), seed), WorkerProgress()
    envs = [gym.make("InvertedPendulum-v5") for _ in range(n)]
    for i, env in enumerate(envs):
        env.reset(seed=seed + i)
    actions = np.random.default_rng(1).uniform(-3, 3, (steps, n, 1)).astype(np.float32)
    want_returns: list[float] = []
    want_lengths: list[int] = []
    ret, length, resetting = [0.0] * n, [0] * n, [False] * n
    for t in range(steps):
        group.step(actions[t], progress)
        for i, env in enumerate(envs):
            if resetting[i]:
                env.reset()
                resetting[i] = False
                continue
            _, reward, terminated, truncated, _ = env.step(actions[t, i])
            ret[i] += float(np.float32(reward))
            length[i] += 1
            if terminated or truncated:
                want_returns.append(ret[i])
                want_lengths.append(length[i])
                ret[i], length[i], resetting[i] = 0.0, 0, True
    assert len(want_returns) > 2 * n  # random pushes drop the pendulum: many episodes ended
    assert progress.episode_lengths == want_lengths
    np.testing.assert_allclose(progress.episode_returns, want_returns, rtol=1e-6)
    assert progress.steps == n * steps
    group.close()
    for env in envs:
        env.close()


def test_unknown_env_is_a_clear_error() -> None:
    from edgerl.sim.robot import MujocoRobot

    for build in (env_spec, lambda name: make_vector_env(name, 2, 0), MujocoRobot):
        with pytest.raises(ValueError, match="env 'NoSuchEnv-v0': Environment `NoSuchEnv` doesn't exist"):
            build("NoSuchEnv-v0")


@pytest.mark.parametrize("env_name", SUPPORTED_ENVS)
def test_every_supported_task_runs_through_the_server(env_name: str) -> None:
    spec = env_spec(env_name)

    async def main() -> int:
        policy = EchoPolicy(spec.obs_shape[0], spec.act_shape[0])
        async with running_server(policy) as server:
            worker = SimWorker(
                SimWorkerConfig(
                    server=f"127.0.0.1:{server.port}", env_name=env_name, num_envs=4, max_steps=40
                )
            )
            progress = await worker.run()
            worker.close()
            return int(progress.steps)

    assert run(main()) == 40


@pytest.mark.parametrize("transport", ["stream", "network process", "local socket"])
def test_a_group_of_more_envs_than_the_servers_batch_steps_in_several_messages(
    transport: str, tmp_path: Path
) -> None:
    """9 Hopper envs in groups of 4 and 5, and a server whose batch holds 4 rows: the group of 5
    went as one message, which the server refused (``step.env_ids: need 1 to 4 env ids
    (max_batch_size), got 5``) on the worker's stream and over the local socket. Now it goes in
    messages of at most 4 rows, and each env steps on its own answers: the episodes are those
    the same envs play against a server whose batch holds a whole group (the policy acts on each
    row's observation)."""

    def run_worker(max_batch_size: int) -> tuple[list[float], list[int], int, int]:
        async def main() -> tuple[list[float], list[int], int, int]:
            policy = EchoPolicy(11, 3)
            path = str(tmp_path / f"act{max_batch_size}.sock") if transport == "local socket" else ""
            async with running_server(policy, max_batch_size=max_batch_size, local_socket=path) as server:
                worker = SimWorker(
                    SimWorkerConfig(
                        server="" if path else f"127.0.0.1:{server.port}",
                        local_socket=path,
                        network_process=transport == "network process",
                        env_name="Hopper-v5",
                        num_envs=9,
                        max_steps=3600,
                    )
                )
                try:
                    progress = await worker.run()
                finally:
                    worker.close()
                served = server.servicer.stats()
            return (
                progress.episode_returns,
                progress.episode_lengths,
                served.max_batch_rows,
                served.rejected_invalid,
            )

        return run(main())  # type: ignore[return-value]

    returns, lengths, largest, refused = run_worker(4)
    whole_returns, whole_lengths, whole_largest, _ = run_worker(256)
    assert (refused, largest) == (0, 4) and whole_largest >= 5
    assert len(returns) >= 20 and returns == whole_returns and lengths == whole_lengths


def test_a_worker_process_keeps_grpc_threads_from_preempting_its_env_stepping() -> None:
    def policies(pid: int) -> dict[int, int]:
        out = {}
        for tid in thread_ids(pid):
            with contextlib.suppress(OSError):  # the thread ended since the listing
                out[tid] = os.sched_getscheduler(tid)
        return out

    with ServerProcess(PolicySpec("InvertedPendulum-v5", "mlp-small")) as server:
        config = SimWorkerConfig(server=server.address, env_name="InvertedPendulum-v5", num_envs=4)
        with WorkerFleet(config, 1) as fleet:
            fleet.wait_started()
            pid = fleet.pids[0]
            deadline = time.monotonic() + 10.0
            while True:  # a thread started since the last pass is handled by the next (0.2 s)
                seen = policies(pid)
                helpers = {tid: p for tid, p in seen.items() if tid != pid}
                if all(p == os.SCHED_BATCH for p in helpers.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
    assert seen[pid] == os.SCHED_OTHER  # the thread stepping the envs
    assert len(helpers) >= 2, helpers  # gRPC's event engine and the asyncio poller at least
    assert all(p == os.SCHED_BATCH for p in helpers.values()), helpers


def test_a_backfill_worker_steps_its_envs_at_idle_priority_and_is_not_waited_for() -> None:
    # a batching delay of 5 s: a step that waited for the backfill worker's would take seconds
    with ServerProcess(
        PolicySpec("InvertedPendulum-v5", "mlp-small"), ServerConfig(max_delay_us=5_000_000)
    ) as server:
        config = SimWorkerConfig(server=server.address, env_name="InvertedPendulum-v5", num_envs=6)
        with WorkerFleet(config, 1, backfill_envs=2) as fleet:
            fleet.wait_started()
            pids = fleet.pids
            main_policy, backfill_policy = (os.sched_getscheduler(p) for p in pids)
            wait_until(lambda: min(fleet.worker_steps()) >= 200, timeout_s=60.0)
            t0, steps0 = time.monotonic(), fleet.worker_steps()[0]
            time.sleep(1.0)
            rate = (fleet.worker_steps()[0] - steps0) / (time.monotonic() - t0)
    assert len(pids) == 2 and main_policy == os.SCHED_OTHER and backfill_policy == os.SCHED_IDLE
    assert min(fleet.worker_steps()) >= 200  # both step their envs (4 and 2)
    assert rate > 100, rate  # the 4 envs of the other worker: 25 steps per second if it waited 5 s


@pytest.mark.parametrize(
    ("envs", "workers", "backfill", "per_stream", "message"),
    [
        (8, 1, 8, 0, r"backfill envs must be in \[0, envs=8\), got 8"),
        (8, 2, 5, 0, r"envs less backfill envs \(8 - 5\) \(3\) must be >= workers x groups \(2 x 2\)"),
        (600, 4, 300, 256, r"backfill envs \(300\) are all on one stream"),
    ],
)
def test_a_fleet_with_a_backfill_worker_is_checked(
    envs: int, workers: int, backfill: int, per_stream: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_fleet(envs, workers, 2, max_envs_per_stream=per_stream, backfill_envs=backfill)


def test_a_fleets_largest_step_is_a_group_or_the_backfill_workers() -> None:
    """What ``edgerl train`` sizes its server's batch to: each group's step in one forward pass."""
    assert largest_request(1024, 1, 2) == 512 and largest_request(1025, 2, 2) == 257
    assert largest_request(600, 2, 2, backfill_envs=300) == 300
    assert largest_request(1100, 2, 2, backfill_envs=100) == 250


@contextlib.contextmanager
def _pendulum_fleet(num_envs: int, num_workers: int) -> Iterator[WorkerFleet]:
    """A fleet of InvertedPendulum-v5 sim workers, started, against a server process."""
    with ServerProcess(PolicySpec("InvertedPendulum-v5", "mlp-small")) as server:
        config = SimWorkerConfig(server=server.address, env_name="InvertedPendulum-v5", num_envs=num_envs)
        with WorkerFleet(config, num_workers) as fleet:
            fleet.wait_started()
            yield fleet


def test_a_fleet_stops_promptly_with_its_episodes_unread() -> None:
    """Workers whose queued episodes nobody read during the run still exit at once on stop()."""
    with _pendulum_fleet(16, 1) as fleet:
        # a random policy drops the pendulum in ~10 steps: 30,000 steps make thousands of
        # episodes (4 s on the fast machine, and as long as it takes on a slow one)
        wait_until(lambda: fleet.total_steps() >= 30_000, timeout_s=60.0)
        t0 = time.monotonic()
        fleet.stop()
        took = time.monotonic() - t0
    assert fleet.failed() == []  # it exited by itself, not killed
    assert fleet.episodes.count > 2000
    assert took < 5.0, f"stop() took {took:.1f}s"


def test_an_episode_log_keeps_the_count_and_both_ends_of_a_run_in_memory_that_does_not_grow() -> None:
    log = EpisodeLog(keep=50)
    assert (log.count, log.first_returns(20), log.last_returns(20), log.last_lengths(20)) == (0, [], [], [])
    log.extend((float(i), i % 7 + 1) for i in range(10))
    assert log.first_returns(20) == log.last_returns(20) == [float(i) for i in range(10)]  # all 10 so far

    def used_by(episodes: int) -> int:
        tracemalloc.start()
        try:
            log.extend((float(i), i % 7 + 1) for i in range(10, 10 + episodes))
            return tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()

    # its rings are allocated once; lists of every episode grew by 100,000 x 40 bytes and more
    assert used_by(100_000) < 10_000
    n = 100_010
    assert len(log) == log.count == n
    assert log.first_returns(20) == [float(i) for i in range(20)]
    assert log.last_returns(20) == [float(i) for i in range(n - 20, n)]  # oldest first
    assert log.last_lengths(3) == [i % 7 + 1 for i in range(n - 3, n)]
    assert log.first_returns(50)[-1] == 49.0 and log.last_returns(50)[0] == float(n - 50)
    for bad in (0, 51):
        with pytest.raises(ValueError, match=rf"n must be in \[1, keep=50\], got {bad}"):
            log.last_returns(bad)
    with pytest.raises(ValueError, match="keep must be >= 1, got 0"):
        EpisodeLog(keep=0)


def _busy_worker(link: WorkerLink, stop: SharedFlag) -> None:
    """A sim worker's traffic with its fleet, as fast as it goes, until stopped: it reads the stop
    flag (most of the time, as a worker does at every step), counts steps, sets its built flag and
    sends episodes, several messages' worth at a time."""
    n = 0
    while not any(stop.is_set() for _ in range(20)):
        n += 1
        link.steps.value = n
        link.built.set()
        if n % 50 == 0:
            link.send_episodes([0.5 * n] * 300, [n] * 300)


def _fleet_side(stop: SharedFlag, link: WorkerLink, out: list[Any]) -> None:
    """What a fleet does with a worker's link once the worker ended: stop it, read it all."""
    stop.set()
    out.extend([stop.is_set(), link.built.is_set(), link.steps.value, link.said(), link.take_episodes()])


def test_a_worker_killed_at_any_point_leaves_its_fleet_nothing_held() -> None:
    """A worker killed (SIGKILL: the OOM killer's way) while it uses what it shares with its fleet
    leaves the fleet able to stop it, count its steps and read its episodes and error line. A
    worker once read its stop flag from a multiprocessing Event, which takes a lock to be read:
    killed inside, it held that lock for good, and the fleet's stop() then waited forever (here,
    with the flag read that way, in 12 kills of 30)."""
    ctx = mp.get_context("spawn")
    for _ in range(10):
        stop, link = SharedFlag(), WorkerLink()
        proc = ctx.Process(target=_busy_worker, args=(link, stop), daemon=True)
        proc.start()
        episodes: list[tuple[float, int]] = []

        def some_read(link: WorkerLink = link, episodes: list[tuple[float, int]] = episodes) -> bool:
            # a queue's put returns before its feeder thread wrote to the pipe: a busy machine
            # once killed a worker that had counted 100 steps before any episode had reached it
            episodes.extend(link.take_episodes())
            return bool(episodes) and link.steps.value > 100

        wait_until(some_read, timeout_s=60.0)
        os.kill(proc.pid or 0, signal.SIGKILL)  # while the fleet reads its episodes
        proc.join()
        read: list[Any] = []
        fleet = threading.Thread(target=_fleet_side, args=(stop, link, read), daemon=True)
        fleet.start()
        fleet.join(10.0)
        assert not fleet.is_alive(), "the fleet's side waited for what the killed worker held"
        is_stopped, built, steps, said, rest = read
        assert is_stopped and built and steps > 0 and said == []
        episodes += rest
        assert episodes and all(r == 0.5 * n for r, n in episodes)  # no message torn


def test_a_workers_messages_are_written_to_the_pipe_whole_or_not_at_all() -> None:
    """A pipe takes a write of up to PIPE_BUF bytes whole: the largest episode message and the
    longest error line (each with its 4-byte header) fit, so a worker killed mid-write leaves no
    half message to wait for."""
    episodes = [(math.pi * (i + 1) * 1e300, 2**31 - 1 - i) for i in range(EPISODES_PER_MESSAGE)]
    assert 4 + len(ForkingPickler.dumps(episodes)) <= select.PIPE_BUF  # as the queue pickles it
    link = WorkerLink()
    link.send_episodes([r for r, _ in episodes] * 3, [n for _, n in episodes] * 3)
    messages = [link._episodes.get(timeout=10.0) for _ in range(3)]  # as the queue holds them
    assert messages == [episodes] * 3
    assert link.take_episodes() == []

    link.say("\U0001f600" * 5000)  # an error line: 4 bytes a character, the most there is
    (said,) = link.said()
    assert len(said) == MAX_SAID_CHARS and said.endswith("...")
    assert 4 + len(ForkingPickler.dumps(said)) <= select.PIPE_BUF


def test_a_fleet_with_a_worker_killed_stops_at_once_and_its_other_workers_end_by_themselves() -> None:
    with _pendulum_fleet(8, 2) as fleet:
        wait_until(lambda: min(fleet.worker_steps()) > 500, timeout_s=60.0)
        os.kill(fleet.pids[0], signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"^a sim worker process ended \(killed by SIGKILL\)$"):
            wait_until(fleet.check, timeout_s=10.0)
        fleet.poll_episodes()
        episodes, steps = fleet.episodes.count, fleet.worker_steps()[1]
        wait_until(lambda: fleet.worker_steps()[1] > steps + 500, timeout_s=60.0)  # the other steps on
        t0 = time.monotonic()
        fleet.stop()
        took = time.monotonic() - t0
    assert fleet.failed() == [-signal.SIGKILL]  # the other exited by itself, not killed at the timeout
    assert took < 5.0, f"stop() took {took:.1f}s"
    assert fleet.episodes.count > episodes  # the other's episodes kept coming


def test_two_fleets_in_one_process_against_one_server_keep_sessions_of_their_own() -> None:
    """Fleets without a session id are named by host and pid; two in one process (a script
    that runs two) must not share their workers' sessions and take each other's over."""
    # a server claims sessions where it keeps transitions; "drop": no trainer takes them here
    collecting = ServerConfig(port=0, learner=TransitionConfig(overflow="drop"))
    with ServerProcess(PolicySpec("InvertedPendulum-v5", "mlp-small"), collecting) as server:
        config = SimWorkerConfig(server=server.address, env_name="InvertedPendulum-v5", num_envs=4)
        with WorkerFleet(config, 1) as first, WorkerFleet(config, 1) as second:
            first.wait_started()
            second.wait_started()
            steps = first.total_steps(), second.total_steps()

            def both_stepped_on() -> bool:
                first.check()  # the session taken over ends its worker with ABORTED
                second.check()
                return first.total_steps() > steps[0] + 2000 and second.total_steps() > steps[1] + 2000

            wait_until(both_stepped_on, timeout_s=60.0)
    assert first.failed() == [] and second.failed() == []


def _deaf_to_its_stop(pids: Any) -> None:
    """A spawned process that ignores the signal to stop and ends with its parent, 0.5 s after it."""
    signal.signal(OWNER_STOP, signal.SIG_IGN)
    end_with_parent(grace_s=0.5)
    pids.put(os.getpid())
    time.sleep(600)


def _parent_of_deaf(pids: Any) -> None:
    mp.get_context("spawn").Process(target=_deaf_to_its_stop, args=(pids,)).start()
    time.sleep(600)


def test_a_process_whose_parent_died_ends_even_if_it_ignores_its_signal_to_stop() -> None:
    """What :func:`end_with_parent` does past its signal to stop: a process still there
    ``grace_s`` later (an edge server whose graceful shutdown hangs, say) is killed."""
    ctx = mp.get_context("spawn")
    pids = ctx.Queue()
    parent = ctx.Process(target=_parent_of_deaf, args=(pids,))  # not a daemon: it has a child
    parent.start()
    pid = 0
    try:
        pid = pids.get(timeout=60.0)
        assert not ended(pid)
        os.kill(parent.pid or 0, signal.SIGKILL)
        parent.join()
        t0 = time.monotonic()
        wait_until(lambda: ended(pid), timeout_s=30.0, poll_s=0.02)
        took = time.monotonic() - t0
        assert ended(pid)
        assert 0.45 < took < 10.0, took  # its signal ignored, it was killed 0.5 s later
    finally:
        parent.kill()
        parent.join()
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_server_process_that_ended_unasked_is_told_from_one_its_owner_stopped() -> None:
    """``ServerProcess.check`` says nothing while the server runs, nor before it started or after
    its owner stopped it; once its process died unasked, it raises, saying how, also when asked
    to wait for the end a failed call may have seen first (``wait_s``)."""
    server = ServerProcess(PolicySpec("InvertedPendulum-v5", "mlp-small"))
    server.check()  # not started
    with server:
        server.check(wait_s=0.2)  # running: waits out its 0.2 s, then says nothing
        pid = server.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ServerLostError, match=r"^the edge server process ended \(killed by SIGKILL\)$"):
            server.check(wait_s=30.0)  # returns once it has ended, not after 30 s
    assert server.pid is None
    server.check()  # stopped by its owner (the with block): nothing to say


def test_a_fleet_waiting_for_an_absent_server_says_so_then_fails_with_its_address(
    capsys: pytest.CaptureFixture[str],
) -> None:
    address = f"127.0.0.1:{free_port()}"
    config = SimWorkerConfig(server=address, env_name="InvertedPendulum-v5", num_envs=2, timeout_s=0.5)
    with WorkerFleet(config, 1) as fleet:
        waiting = rf"had not started within 8s, waiting for the server at {address}"
        with pytest.raises(WorkerError, match=waiting):  # well past the worker's start (1-3 s)
            fleet.wait_started(8.0, note_after_s=0.5)
    assert capsys.readouterr().err.count(f"edgerl: waiting for the server at {address}") == 1  # once
    assert fleet.failed() == []  # still retrying when stopped, not failed

    with WorkerFleet(config, 1) as fleet:  # a stop flag (edgerl train's) ends the wait without limit
        t0 = time.monotonic()
        fleet.wait_started(None, should_stop=lambda: time.monotonic() > t0 + 1.0)
        assert 0.95 < time.monotonic() - t0 < 5.0
        assert fleet.total_steps() == 0


def test_a_fleet_says_its_workers_build_their_envs_before_it_waits_for_the_server(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Starting a worker process and building its envs takes seconds (more with many envs): that
    is what the fleet waits for then, not the server."""
    address = f"127.0.0.1:{free_port()}"
    config = SimWorkerConfig(server=address, env_name="HalfCheetah-v5", num_envs=64)
    with WorkerFleet(config, 1) as fleet:
        with pytest.raises(WorkerError, match="waiting for 1 of 1 sim worker"):
            # a spawned process's start and imports alone take longer (the CLI's imports: 0.37 s)
            fleet.wait_started(0.25, note_after_s=0.05)
        err = capsys.readouterr().err
        assert err.count("edgerl: waiting for 1 of 1 sim worker(s) to build their envs") == 1
        assert "the server" not in err
        # built, it waits for the absent server, and says so once its envs are built
        with pytest.raises(WorkerError, match=f"waiting for the server at {address}"):
            fleet.wait_started(30.0, note_after_s=1.0)
        assert capsys.readouterr().err.count(f"edgerl: waiting for the server at {address}") == 1
