"""``edgerl train`` end to end: server, workers and trainer as real processes on loopback."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from edgerl.launch.train import RunConfig, load_config
from tests.helpers import (
    EDGERL,
    check_machine_block,
    child_pids,
    ended,
    file_size_limited,
    spawned_children,
    wait_until,
)


def _train(args: list[str], tmp_path: Path, name: str) -> dict[str, Any]:
    """Run ``edgerl train ARGS`` to its end; its summary. Its progress bar ends full (its last
    batch may pass the step budget)."""
    out = tmp_path / f"{name}.json"
    cmd = [*EDGERL, "train", *args, "--json", str(out)]
    run = subprocess.run(cmd, check=True, timeout=900, text=True, stderr=subprocess.PIPE)
    summary: dict[str, Any] = json.loads(out.read_text())
    frames = [f for f in run.stderr.splitlines() if f.startswith("train ")]  # text mode: \r reads as \n
    assert frames and "100%|" in frames[-1], frames[-1:]
    return summary


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_inverted_pendulum_learns_through_the_full_pipeline(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    summary = _train(["--steps", "50000", "--run-dir", str(run_dir)], tmp_path, "train")
    assert summary["env"] == "InvertedPendulum-v5" and summary["mode"] == "async"
    assert summary["return_last20"] >= 500, summary  # random play scores ~5-10
    assert summary["env_steps"] >= 50_000
    assert summary["stale_fraction"] < 0.01
    assert 0 < summary["lag_mean"] <= 2.0  # async: sampling overlaps the updates

    rows = _metrics(run_dir)
    assert len(rows) == summary["updates"]
    lag_means = [r["staleness/lag_mean"] for r in rows]
    assert summary["lag_mean"] == pytest.approx(statistics.fmean(lag_means), abs=1e-3)
    assert summary["lag_max"] == max(r["staleness/lag_max"] for r in rows)
    steps = [r["global_step"] for r in rows]
    versions = [r["charts/policy_version"] for r in rows]
    assert steps == sorted(steps) and versions == sorted(versions)  # never decrease
    assert all(r["charts/served_version"] == r["charts/policy_version"] for r in rows)
    for key in ("losses/approx_kl", "losses/clip_fraction", "perf/sampler_steps_per_s", "staleness/lag_max"):
        assert key in rows[-1]
    # Every episode reached the trainer whole (none began before it, no step was lost); the
    # fleet counts those that ended after the trainer's last update too.
    assert rows[-1]["charts/episodes_cut"] == 0
    assert 0 < rows[-1]["charts/episodes"] <= summary["episodes"]
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoints" / "latest.pt").exists()
    config = json.loads((run_dir / "config.json").read_text())
    assert config["ppo"]["batch_steps"] == config["envs"] * config["segment_steps"]

    # The trained policy, served again from its run folder: its env, preset and version come
    # from the checkpoint, and it still balances the pendulum (random play: ~5-10).
    out = tmp_path / "rollout.json"
    rollout = [*EDGERL, "rollout", "--checkpoint", str(run_dir), "--envs", "8", "--workers", "1"]
    subprocess.run([*rollout, "--steps", "24000", "--json", str(out)], check=True, timeout=300)
    served = json.loads(out.read_text())
    assert served["server"]["policy_version"] == summary["policy_version"]
    assert served["episodes"] >= 8 and served["return_mean_last20"] >= 300, served


def test_a_run_past_the_servers_default_limits_trains(tmp_path: Path) -> None:
    """Two limits of a server's defaults that a run met: ``mlp-large``'s weights (17.5 MB) are
    more than ``max_message_bytes`` (4 MiB), and the first publish failed; 600 envs in one
    worker's two groups step 300 at a time, more than ``max_batch_size`` (256), and the worker
    was refused at its first step. Now the run's server takes both: two updates, two publishes."""
    run_dir = tmp_path / "run"
    args = (
        "--env InvertedPendulum-v5 --envs 600 --workers 1 --segment-steps 4 --steps 4800 --policy mlp-large"
    )
    summary = _train([*args.split(), "--run-dir", str(run_dir)], tmp_path, "limits")
    assert (summary["updates"], summary["policy_version"], summary["env_steps"]) == (2, 2, 4800)
    assert [m["charts/served_version"] for m in _metrics(run_dir)] == [1, 2]  # the server took each publish


def test_workers_that_start_late_still_join_a_full_window(tmp_path: Path) -> None:
    # A window of 8 steps: the first worker up fills it in 4 steps of its 2 envs, long before
    # the second has spawned and built its envs; the second must join once updates drain it.
    args = ["--envs", "4", "--workers", "2", "--set", "groups=1", "--segment-steps", "2", "--steps", "2000"]
    summary = _train([*args, "--run-dir", str(tmp_path / "run")], tmp_path, "late")
    assert summary["env_steps"] >= 2000 and len(summary["worker_steps"]) == 2
    assert min(summary["worker_steps"]) > 0, summary["worker_steps"]


def test_sync_mode_has_no_lag_and_resume_keeps_the_version(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    common = ["--sync", "--envs", "8", "--segment-steps", "16", "--run-dir", run_dir]
    # Two workers step at their own pace; the per-env quota still fills every batch evenly.
    first = _train([*common, "--workers", "2", "--steps", "1024"], tmp_path, "first")
    assert first["mode"] == "sync" and first["lag_max"] == 0 and first["stale_fraction"] == 0
    assert first["policy_version"] == first["updates"] == 1024 // 128
    assert len(first["worker_steps"]) == 2 and min(first["worker_steps"]) >= 1024 // 2
    # only the run and a longer --steps: the run's own config keeps sync, its envs and segments
    again = _train(["--run-dir", run_dir, "--steps", "2048", "--resume"], tmp_path, "again")
    assert again["mode"] == "sync" and again["env"] == "InvertedPendulum-v5"
    assert again["policy_version"] == 2048 // 128  # continues from 8, not from 0
    assert again["env_steps"] == 2048
    rows = _metrics(Path(run_dir))
    assert [r["charts/policy_version"] for r in rows] == list(range(1, 17))
    assert all(r["staleness/lag_max"] == 0 for r in rows)


@pytest.mark.parametrize(
    ("stop", "group"),
    [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGHUP, True)],
    ids=["ctrl-c", "sigterm", "sigterm-group", "hangup"],
)
def test_ctrl_c_sigterm_or_a_hangup_stops_everything_cleanly(
    stop: signal.Signals, group: bool, tmp_path: Path
) -> None:
    """Ctrl-C in a terminal reaches the command's whole process group, and so does SIGHUP where
    the terminal hangs up (an SSH session that drops: the command once ended at once, its final
    checkpoint unwritten); so does SIGTERM from ``timeout`` or ``kill -- -PGID``, and ``systemctl
    stop`` sends it to every process of the unit; ``kill PID`` and ``docker stop`` send it to the
    command alone. Each way the command stops its workers, its trainer and its server in its own
    order: its server and workers once ended on the group's SIGTERM, before the trainer was done
    with them."""
    run_dir = tmp_path / "run"
    out = tmp_path / "summary.json"
    cmd = [*EDGERL, "train", "--steps", "10000000", "--run-dir", str(run_dir), "--json", str(out)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    try:
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        assert len(spawned_children(proc.pid)) == 2  # its server and its worker, both sent the signal below
        if group:
            os.killpg(proc.pid, stop)
        else:
            proc.send_signal(stop)
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a run that did not end: not left behind
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-2000:]
    summary = json.loads(out.read_text())
    assert summary["interrupted"] is True and summary["updates"] >= 3
    assert (run_dir / "checkpoints" / "latest.pt").exists()
    assert "Traceback" not in err


def _listens(pid: int) -> bool:
    """Whether process ``pid`` holds a listening TCP socket (the edge server does; workers,
    the trainer and multiprocessing's resource tracker do not)."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                listening.add(fields[9])
    fds = Path(f"/proc/{pid}/fd")
    links = [os.readlink(fd) for fd in fds.iterdir()]
    return any(link[8:-1] in listening for link in links if link.startswith("socket:["))


def _started_run(command: str, run_dir: Path) -> subprocess.Popen[str]:
    """``edgerl train`` (in ``run_dir``) or ``edgerl rollout`` without end, in a session of its own,
    once it has made a few updates or (rollout) had its server and worker up for a while."""
    args = ["--steps", "10000000", *(["--run-dir", str(run_dir)] if command == "train" else [])]
    proc = subprocess.Popen(
        [*EDGERL, command, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    metrics = run_dir / "metrics.jsonl"

    def started() -> bool:
        if command == "train":
            return metrics.exists() and metrics.read_text().count("\n") >= 3
        if len(spawned_children(proc.pid)) < 2:
            return False
        time.sleep(3.0)  # its worker stepping for a while
        return True

    deadline = time.monotonic() + 180
    while not started():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"the run did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.5)
    return proc


@pytest.mark.parametrize(
    ("command", "victim"), [("train", "server"), ("train", "worker"), ("rollout", "server")]
)
def test_a_server_or_worker_killed_mid_run_ends_it_saying_so_with_a_checkpoint_to_go_on_from(
    command: str, victim: str, tmp_path: Path
) -> None:
    """A server or sim worker process that dies (SIGKILL: the OOM killer's way) ends ``edgerl
    train`` at once with exit code 1, what died and how to resume; the run once waited for it for
    good, the trainer and the other processes reconnecting to a server that was gone. So does
    ``edgerl rollout`` without a time limit, which has no checkpoint."""
    run_dir = tmp_path / "run"
    proc = _started_run(command, run_dir)
    try:
        children = spawned_children(proc.pid)
        servers = [c for c in children if _listens(c)]
        assert len(servers) == 1 and len(children) == 2, (children, servers)  # one server, one worker
        worker = next(c for c in children if c not in servers)
        os.kill(servers[0] if victim == "server" else worker, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a run that did not end: not left behind
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-2000:]
    said = err.splitlines()[-1]
    died = "the edge server process" if victim == "server" else "a sim worker process"
    assert said.startswith(f"edgerl: error: {died} ended (killed by SIGKILL)"), said
    if command == "train":
        hint = f"; its last checkpoint is in {run_dir} (edgerl train --run-dir {run_dir} --resume goes on)"
        assert said.endswith(hint), said
        assert (run_dir / "checkpoints" / "latest.pt").exists()
    else:
        assert said == f"edgerl: error: {died} ended (killed by SIGKILL)", said
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["train", "rollout"])
def test_a_run_killed_leaves_no_process_behind(command: str, tmp_path: Path) -> None:
    """A run that is killed itself (SIGKILL: the OOM killer picks the largest process, often the
    trainer) takes its processes with it: its edge server and sim workers end once it is gone,
    where they once ran on for good, orphans, a worker at a full core; so does multiprocessing's
    resource tracker, once they have."""
    proc = _started_run(command, tmp_path / "run")
    try:
        children = child_pids(proc.pid)
        assert len(spawned_children(proc.pid)) == 2 and len(children) == 3, children  # and the tracker
        proc.kill()
        proc.wait()  # not its output: the processes left hold its pipes open
        wait_until(lambda: all(ended(c) for c in children), timeout_s=30.0)
        assert [c for c in children if not ended(c)] == []
    finally:
        with contextlib.suppress(ProcessLookupError):  # what is left: not left behind
            os.killpg(proc.pid, signal.SIGKILL)
        for pipe in (proc.stdout, proc.stderr):
            assert pipe is not None
            pipe.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_full_disk_ends_the_run_in_one_line_and_it_goes_on_from_its_checkpoint(tmp_path: Path) -> None:
    """A run whose files cannot grow (each at most 150 KB here: TensorBoard's fills first) ends
    with exit code 1 and one line naming the file, the system's reason and the checkpoint to go
    on from; no traceback (TensorBoard's writer thread says its failure in one line), no
    half-written checkpoint, no process left. Once there is room, it goes on from there."""
    run_dir = tmp_path / "run"
    cmd = [
        *EDGERL,
        "train",
        "--steps",
        "500000",
        "--run-dir",
        str(run_dir),
        "--set",
        "ppo.checkpoint_every=2",
    ]
    with subprocess.Popen(
        file_size_limited(150_000, cmd),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            _, err = proc.communicate(timeout=300)
        finally:
            wait_until(lambda: not _group_alive(proc.pid), timeout_s=30.0)  # its server and workers ended
    assert proc.returncode == 1, err[-2000:]
    said = err.splitlines()[-1]
    hint = f"; its last checkpoint is in {run_dir} (edgerl train --run-dir {run_dir} --resume goes on)"
    failed = re.fullmatch(
        rf"edgerl: error: cannot write {re.escape(str(run_dir))}/(tb|metrics\.jsonl): "
        rf"\[Errno 27\] File too large{re.escape(hint)}",
        said,
    )
    assert failed, said
    assert failed[1] == "tb"  # ~1.9 KB an update, metrics.jsonl ~1.2 KB, a checkpoint 114 KB
    assert "Traceback" not in err
    assert f"ERROR edgerl.trainer.runfiles: TensorBoard ({run_dir}/tb) could not write: [Errno 27]" in err
    checkpoints = run_dir / "checkpoints"
    assert {p.suffix for p in checkpoints.iterdir()} == {".pt"}  # no half-written .tmp
    version = int((checkpoints / "latest.pt").readlink().stem.split("-")[1])
    assert version >= 10  # the final checkpoint, at the update that failed
    rows = len(_metrics(run_dir))
    summary = _train(["--run-dir", str(run_dir), "--resume", "--steps", "60000"], tmp_path, "resumed")
    assert summary["env_steps"] >= 60_000
    resumed = [m["charts/policy_version"] for m in _metrics(run_dir)[rows:]]
    assert resumed[0] == version + 1 and resumed == sorted(resumed)


@pytest.mark.parametrize("fault", ["refused", "server gone"])
def test_a_publish_that_fails_ends_the_run_in_one_line_with_a_checkpoint_to_go_on_from(
    fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A weight publish that fails ends ``edgerl train`` with exit code 1, one line and the
    checkpoint to resume from, and stops the server and the workers. One the server refuses
    while it runs on (a version it already serves: FAILED_PRECONDITION) is that refusal; one
    that failed because the server process died just before is said as that death, not as the
    UNAVAILABLE the call met."""
    from edgerl.launch.cli import main
    from edgerl.trainer.feed import publish_weights as real

    def publish(stub: Any, state: Any, version: int, **kwargs: Any) -> Any:
        if version == 3 and fault == "refused":
            version = 0  # version 0 is served
        elif version == 3:
            (server,) = [c for c in spawned_children(os.getpid()) if _listens(c)]
            os.kill(server, signal.SIGKILL)
        return real(stub, state, version, **kwargs)

    monkeypatch.setattr("edgerl.trainer.trainer.publish_weights", publish)
    run_dir = tmp_path / "run"
    assert main(["train", "--steps", "10000000", "--run-dir", str(run_dir)]) == 1
    said = capsys.readouterr().err.splitlines()[-1]
    failure = {
        "refused": "FAILED_PRECONDITION: version: must be greater than the served version 2, got 0",
        "server gone": "the edge server process ended (killed by SIGKILL)",
    }[fault]
    hint = f"; its last checkpoint is in {run_dir} (edgerl train --run-dir {run_dir} --resume goes on)"
    assert said == f"edgerl: error: {failure}{hint}"
    assert [m["charts/policy_version"] for m in _metrics(run_dir)] == [1, 2]
    assert (run_dir / "checkpoints" / "latest.pt").exists()
    assert spawned_children(os.getpid()) == []  # its server and worker processes were stopped


def test_a_resumed_run_keeps_its_own_config_but_for_what_is_given_again(tmp_path: Path) -> None:
    first, _ = load_config("Hopper-v5", None, {"envs": 8, "steps": 5000}, ["ppo.epochs=3", "sync=true"])
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(first)))  # as a run writes it
    cfg, sources = load_config(None, None, {"steps": 20_000}, ["ppo.clip=0.1"], resume=tmp_path)
    assert sources == [str(tmp_path / "config.json"), "flags", "--set"]  # not the defaults, nor Hopper's file
    told = dataclasses.replace(first, steps=20_000, ppo=dataclasses.replace(first.ppo, clip=0.1))
    assert cfg == told.resolved()
    assert cfg.ppo.total_steps == 20_000  # the schedule follows the new length
    with pytest.raises(ValueError, match=rf"^--env Walker2d-v5: the run in {tmp_path} trains Hopper-v5$"):
        load_config("Walker2d-v5", None, {}, [], resume=tmp_path)
    with pytest.raises(ValueError, match=r"^--policy mlp-large: .* trains mlp-small$"):
        load_config("Hopper-v5", None, {"policy": "mlp-large"}, [], resume=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"--resume: no run in .*elsewhere \(it has no config.json\)"):
        load_config(None, None, {}, [], resume=tmp_path / "elsewhere")


def test_resuming_a_run_that_saved_no_checkpoint_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgerl.launch.cli import main

    config = dataclasses.asdict(load_config("InvertedPendulum-v5", None, {"envs": 4}, [])[0])
    (tmp_path / "config.json").write_text(json.dumps(config))  # a run stopped before its first update
    assert main(["train", "--run-dir", str(tmp_path), "--resume"]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == f"edgerl: error: --resume: no checkpoint in {tmp_path}"
    assert out == ""  # no server, no workers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # the run folder as it was


BAD_PPO_SETTINGS = {
    "ppo.epochs=0": "--set: epochs must be >= 1, got 0",
    "ppo.minibatch_size=999999": "--set: minibatch_size (999999) must be <= batch_steps",
    "ppo.gamma=1.5": "--set: need 0 < gamma <= 1 and 0 <= gae_lambda <= 1",
    "ppo.gae_lambda=-0.1": "--set: need 0 < gamma <= 1 and 0 <= gae_lambda <= 1",
    "ppo.max_policy_lag=-1": "--set: max_policy_lag must be >= 0, got -1",
    "ppo.baseline=median": "--set: baseline must be one of critic, group, got 'median'",
    "ppo.learning_rate=0": "--set: learning_rate and clip must be > 0",
    "ppo.epochs=2.5": "--set: epochs: expected an integer, got 2.5",
    "sync=maybe": "--set: sync: expected true or false, got 'maybe'",
    "sync": "--set 'sync': expected key=value",
}


@pytest.mark.parametrize("setting", list(BAD_PPO_SETTINGS))
def test_a_bad_ppo_setting_is_refused_naming_it(setting: str) -> None:
    with pytest.raises(ValueError, match=re.escape(BAD_PPO_SETTINGS[setting])):
        load_config(None, None, {}, [setting])


def test_config_precedence_defaults_file_flags_set(tmp_path: Path) -> None:
    cfg, sources = load_config("HalfCheetah-v5", None, {}, [])
    assert (cfg.envs, cfg.steps) == (64, 1_000_000)  # the shipped tuned file
    assert sources[1].endswith("HalfCheetah-v5.toml")
    assert cfg.ppo.batch_steps == 64 * 32 and cfg.ppo.total_steps == 1_000_000
    assert cfg.log_std_init == -1.0 and load_config("Hopper-v5", None, {}, [])[0].log_std_init == 0.0

    file = tmp_path / "my.toml"
    file.write_text("envs = 8\nsteps = 5000\n[ppo]\nepochs = 3\nlearning_rate = 1e-3\n")
    cfg, _ = load_config(None, str(file), {"envs": 12, "steps": None}, ["ppo.epochs=7", "sync=true"])
    assert cfg.env == RunConfig().env
    assert (cfg.envs, cfg.steps, cfg.sync) == (12, 5000, True)  # flag beats file, file beats default
    assert (cfg.ppo.epochs, cfg.ppo.learning_rate) == (7, 1e-3)  # --set beats file

    file.write_text("[ppo]\ngamma = 1\n")  # a TOML integer where a number is wanted
    gamma = load_config(None, str(file), {}, [])[0].ppo.gamma
    assert gamma == 1.0 and isinstance(gamma, float)
    file.write_text("envs = [8]\n")
    with pytest.raises(ValueError, match=re.escape(f"{file}: envs: expected an integer, got [8]")):
        load_config(None, str(file), {}, [])

    with pytest.raises(ValueError, match=r"--set: .*unknown setting"):
        load_config(None, None, {}, ["ppo.nonsense=1"])
    with pytest.raises(ValueError, match="epochs: expected an integer"):
        load_config(None, None, {}, ["ppo.epochs=many"])
    with pytest.raises(ValueError, match="model: a model folder is for policy 'llm'"):
        load_config(None, None, {"model": "/some/folder"}, [])
    with pytest.raises(ValueError, match="log_std_init: for the MLP policies"):
        load_config(None, None, {"policy": "llm"}, ["log_std_init=-1"])
    with pytest.raises(FileNotFoundError, match="--config"):
        load_config(None, str(tmp_path / "missing.toml"), {}, [])


WRONG_TYPES_IN_A_FILE = {
    # a TOML boolean is an int to Python: `steps = true` was taken for 1
    "steps = true": "steps: expected an integer, got True",
    "sync = 1": "sync: expected true or false, got 1",
    "[ppo]\nlearning_rate = false": "learning_rate: expected a number, got False",
    # a string setting took any value: `run_dir = 5` failed later, with a traceback
    "run_dir = 5": "run_dir: expected a string, got 5",
    "policy = 3": "policy: expected a string, got 3",
    "ppo = 5": "ppo: expected a table of PPO settings ([ppo]), got 5",
}


@pytest.mark.parametrize("text", list(WRONG_TYPES_IN_A_FILE))
def test_a_config_file_value_of_the_wrong_type_is_refused_naming_it(text: str, tmp_path: Path) -> None:
    file = tmp_path / "my.toml"
    file.write_text(text + "\n")
    with pytest.raises(ValueError) as refused:
        load_config(None, str(file), {}, [])
    assert str(refused.value) == f"{file}: {WRONG_TYPES_IN_A_FILE[text]}"


def test_env_groups_are_chosen_unless_set() -> None:
    assert RunConfig(envs=16).fleet_groups == 2  # double-buffered
    assert RunConfig(envs=1).fleet_groups == 1  # a single env: one group, not a refusal
    assert RunConfig(envs=3, workers=2).fleet_groups == 1  # a worker with a single env
    assert load_config("Hopper-v5", None, {}, [])[0].fleet_groups == 1  # its tuned file sets it
    with pytest.raises(ValueError, match=r"envs \(1\) must be >= workers x groups \(1 x 2\)"):
        load_config(None, None, {"envs": 1}, ["groups=2"])
    with pytest.raises(ValueError, match="groups must be >= 0"):
        RunConfig(groups=-1)


def test_shipped_configs_parse() -> None:
    for env in ("HalfCheetah-v5", "Hopper-v5", "InvertedPendulum-v5"):
        cfg, sources = load_config(env, None, {}, [])
        assert cfg.env == env and len(sources) == 2, f"no tuned config for {env}"
    # --policy llm picks the env's llm file (its own learning rate and rollout length)
    cfg, sources = load_config("InvertedPendulum-v5", None, {"policy": "llm"}, [])
    assert sources[1].endswith("InvertedPendulum-v5-llm.toml") and cfg.policy == "llm"
    assert cfg.ppo.learning_rate != load_config("InvertedPendulum-v5", None, {}, [])[0].ppo.learning_rate


def test_bench_learn_reports_seeds_and_the_sync_baseline_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "learn.json"
    args = ["bench", "learn", "--seeds", "2", "--steps", "1024", "--envs", "4", "--segment-steps", "32"]
    args += ["--sync", "--run-dir", str(tmp_path / "runs"), "--json", str(out)]
    proc = subprocess.run([*EDGERL, *args], check=True, timeout=600, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    for key in ("return_mean", "return_std", "steps_per_s", "wall_s", "stale_fraction", "per_seed"):
        assert key in result and key in result["sync"]
    assert [r["seed"] for r in result["per_seed"]] == [0, 1]
    assert all(r["mode"] == "sync" and r["lag_max"] == 0 for r in result["sync"]["per_seed"])
    assert all(r["env_steps"] == 1024 for r in result["per_seed"] + result["sync"]["per_seed"])
    assert result["ratios"]["async/sync steps_per_s"] == pytest.approx(
        result["steps_per_s"] / result["sync"]["steps_per_s"], rel=1e-2
    )
    check_machine_block(result)


def test_a_run_that_cannot_start_writes_no_run_folder(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    cases = [
        (["--env", "NoSuchEnv-v0"], 2, "env 'NoSuchEnv-v0'"),
        (["--resume", "--run-dir", "runs/never-trained"], 2, "--resume: no run in runs/never-trained"),
        # its metrics port could not be bound
        (
            ["--metrics-port", str(port)],
            1,
            f"could not bind the metrics port 127.0.0.1:{port}: the port is in use",
        ),
    ]
    with taken:
        for args, code, reason in cases:
            out = subprocess.run(
                [*EDGERL, "train", "--steps", "100", *args],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert out.returncode == code and reason in out.stderr.splitlines()[-1], out.stderr
            assert not (tmp_path / "runs").exists()  # nothing for the user to clean up
