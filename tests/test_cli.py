"""The edgerl command line, run as users run it (real processes on loopback)."""

import asyncio
import contextlib
import dataclasses
import json
import os
import pty
import re
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgerl.edge_server.policy import TorchPolicyBackend
from edgerl.launch.processes import fleet_groups
from edgerl.launch.progress import advance, step_bar
from edgerl.launch.robot import RECORDING_FAILED_STATUS
from edgerl.launch.train import RunConfig
from edgerl.models import build_policy
from edgerl.sim.envs import env_spec
from tests.helpers import (
    EDGERL,
    EchoPolicy,
    ServerThread,
    act_once,
    check_machine_block,
    file_size_limited,
    free_port,
    serving,
    spawned_children,
    wait_until,
)


def _edgerl(args: str, json_path: Path, tmpdir: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``edgerl ARGS --json PATH`` to completion (with ``TMPDIR`` when given); fails the test
    on a non-zero exit."""
    env = {**os.environ, "TMPDIR": str(tmpdir)} if tmpdir else None
    return subprocess.run(
        [*EDGERL, *args.split(), "--json", str(json_path)],
        check=True,
        timeout=300,
        capture_output=True,
        text=True,
        env=env,
    )


@pytest.mark.parametrize(
    "command",
    [
        ["serve"],
        ["sim"],
        ["rollout"],
        ["train"],
        ["robot"],
        ["describe"],
        ["bench", "throughput"],
        ["bench", "learn"],
        ["bench", "robot"],
    ],
)
def test_help_explains_every_option_with_its_default(command: list[str]) -> None:
    env = {**os.environ, "COLUMNS": "400"}  # one line per option
    out = subprocess.run([*EDGERL, *command, "--help"], capture_output=True, text=True, check=True, env=env)
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip().startswith("--")]
    assert len(lines) >= 5
    for line in lines:
        option = line.split()[0]
        if option in ("--help", "--server"):  # --server is required: no default
            continue
        assert line.count("(default: ") == 1, f"{option} states its default {line.count('(default: ')} times"
        assert len(line.split("  ", 1)[-1]) > 20, f"{option} has no explanation"


def test_top_level_help_lists_the_subcommands() -> None:
    out = subprocess.run([*EDGERL, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("serve", "sim", "rollout", "train", "robot", "describe", "bench"):
        assert f"    {command} " in out


def test_version_is_the_installed_package_s(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib

    from edgerl.launch.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert capsys.readouterr().out == f"edgerl {project['version']}\n"


def test_results_are_written_as_standard_json(tmp_path: Path) -> None:
    from edgerl.launch import jsonout

    result = {
        "unmeasured": float("nan"),
        "bounds": (float("inf"), -float("inf"), 1.5),
        "numpy": {"rate": np.float32(0.25), "count": np.int64(3), "nan": np.float64("nan")},
        "rows": np.arange(3),
        "flag": True,
        "name": "x",
        "none": None,
    }
    expected = {
        "unmeasured": None,
        "bounds": [None, None, 1.5],
        "numpy": {"rate": 0.25, "count": 3, "nan": None},
        "rows": [0, 1, 2],
        "flag": True,
        "name": "x",
        "none": None,
    }
    assert json.loads(jsonout.dumps(result)) == expected
    assert "NaN" not in jsonout.dumps(result) and "Infinity" not in jsonout.dumps(result)
    jsonout.write_json(result, str(tmp_path / "r.json"))
    text = (tmp_path / "r.json").read_text()
    assert text.endswith("}\n") and json.loads(text) == expected
    with pytest.raises(TypeError, match="not JSON serializable"):
        jsonout.dumps({"x": object()})


def _run_refused(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``edgerl ARGS``, expecting the exit status of a bad option value (2)."""
    out = subprocess.run([*EDGERL, *args], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, out.stderr
    return out


def _refused(*args: str) -> str:
    """:func:`_run_refused`'s stderr."""
    return _run_refused(*args).stderr


@pytest.mark.parametrize(
    "command", [["rollout", "--groups", "2"], ["bench", "throughput"], ["train", "--set", "groups=2"]]
)
def test_envs_the_workers_cannot_share_are_refused_before_anything_starts(command: list[str]) -> None:
    out = _run_refused(*command, "--envs", "3", "--workers", "2")  # bench: 2 groups by default
    line = out.stderr.splitlines()[-1]  # train names where the value came from
    assert line.startswith("edgerl: error: ")
    assert line.endswith("envs (3) must be >= workers x groups (2 x 2)")
    assert "edge server on" not in out.stdout  # rollout: no server started
    assert "repeat 1/" not in out.stderr  # bench: no mode measured first


@pytest.mark.parametrize("command", [["rollout"], ["bench", "throughput"], ["train"]])
def test_more_envs_per_stream_than_the_server_takes_are_refused_before_anything_starts(
    command: list[str],
) -> None:
    """The server these commands start takes 1024 envs per stream; a worker of more would build
    its envs first (seconds to minutes) only to be refused."""
    out = _run_refused(*command, "--envs", "2100", "--workers", "2")
    assert out.stderr.splitlines()[-1].endswith(
        "envs (2100) over workers (2) puts 1050 envs on a worker's stream, and the server takes at "
        "most 1024 per stream: use workers >= 3"
    )
    assert "edge server on" not in out.stdout


@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_a_rollout_whose_groups_are_larger_than_the_servers_batch_runs(
    transport: str, tmp_path: Path
) -> None:
    """A group's step was one request of a row per env, and a server takes at most
    ``--max-batch-size`` rows per forward pass: ``edgerl rollout --envs 1024`` (2 groups of 512)
    built its envs and started its server, and its worker was refused at the first step. Now a
    group larger than a batch steps in several messages (here 2 groups of 8 envs, 4 rows to a
    batch)."""
    path = tmp_path / "rollout.json"
    args = "rollout --env InvertedPendulum-v5 --envs 16 --workers 1 --max-batch-size 4 --steps 1600"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    _edgerl(f"{args} --transport {transport}", path, tmpdir=tmp)
    summary = json.loads(path.read_text())
    server = summary["server"]
    assert summary["env_steps"] >= 1600 and (server["rejected_invalid"], server["max_batch_rows"]) == (0, 4)
    assert server["requests"] >= 2 * summary["env_steps"] // 8  # two messages a group's step


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ("train --resume", "--resume needs --run-dir (the run to continue)"),
        ("robot --server 127.0.0.1:1 --robot-arg env", "--robot-arg: expected KEY=VALUE, got 'env'"),
        (
            "robot --server 127.0.0.1:1 --robot no_such_module:Arm",
            "robot 'no_such_module:Arm': No module named 'no_such_module'",
        ),
        ("train --set ppo.epochs", "--set 'ppo.epochs': expected key=value"),
        # it started the server and workers, and failed at its first publish: NaN weights
        ("train --set ppo.learning_rate=nan", "--set: learning_rate must be a finite number, got nan"),
    ],
)
def test_a_bad_option_value_is_a_one_line_error_before_anything_starts(
    args: str, error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgerl.launch.cli import main

    assert main(args.split()) == 2
    out, err = capsys.readouterr()
    assert err == f"edgerl: error: {error}\n"
    assert out == ""  # nothing started: no server, no run folder, no robot


def test_groups_default_to_double_buffering_and_to_lockstep_for_a_single_env() -> None:
    assert [fleet_groups(0, envs, 2) for envs in (2, 3, 4, 64)] == [1, 1, 2, 2]
    assert fleet_groups(3, 64, 2) == 3  # as given
    assert "envs (3) must be >= workers x groups (4 x 1)" in _refused(
        "sim", "--server", "127.0.0.1:1", "--envs", "3", "--workers", "4"
    )


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ("rollout --envs 0", "argument --envs: must be >= 1, got 0"),
        ("rollout --workers two", "argument --workers: invalid int value: 'two'"),
        ("rollout --seconds -1", "argument --seconds: must be >= 0, got -1"),
        ("rollout --timeout-s 0", "argument --timeout-s: must be > 0, got 0"),
        ("rollout --torch-threads 0", "argument --torch-threads: must be >= 1, got 0"),
        ("sim --server 127.0.0.1:1 --steps -5", "argument --steps: must be >= 0, got -5"),
        ("serve --port 70000", "argument --port: must be in [0, 65535], got 70000"),
        ("serve --max-delay-us -1", "argument --max-delay-us: must be in [0, 18446744073709551615], got -1"),
        ("serve --max-streams 0", "argument --max-streams: must be in [1, 4294967295], got 0"),
        # beyond what the wire carries: "edgerl: error: Value out of range: 5000000000" at start before
        (
            "serve --max-batch-size 5000000000",
            "argument --max-batch-size: must be in [1, 4294967295], got 5000000000",
        ),
        (
            "serve --max-queue-rows 4294967296",
            "argument --max-queue-rows: must be in [1, 4294967295], got 4294967296",
        ),
        (
            "bench throughput --max-delay-us 18446744073709551616",
            "argument --max-delay-us: must be in [0, 18446744073709551615], got 18446744073709551616",
        ),
        ("bench throughput --seconds 0", "argument --seconds: must be > 0, got 0"),
        ("bench throughput --workers 0", "argument --workers: must be >= 1, got 0"),
        ("bench robot --robots 0", "argument --robots: must be >= 1, got 0"),
        ("bench learn --seeds 0", "argument --seeds: must be >= 1, got 0"),
        ("robot --hz nan", "argument --hz: must be > 0, got nan"),
        ("serve --grace-s inf", "argument --grace-s: must be a finite number, got inf"),
        ("serve --keepalive-s 1e300", "argument --keepalive-s: must be in [0, 2147483], got 1e300"),
        ("robot --deadline-ms inf", "argument --deadline-ms: must be a finite number, got inf"),
        ("rollout --timeout-s inf", "argument --timeout-s: must be a finite number, got inf"),
        ("describe --timeout-s=-inf", "argument --timeout-s: must be > 0, got -inf"),
        ("robot --drop 1.5", "argument --drop: must be in [0, 1], got 1.5"),
        ("robot --answer-timeout-s 0", "argument --answer-timeout-s: must be > 0, got 0"),
        ("train --envs 0", "argument --envs: must be >= 1, got 0"),
        # files written at the end: refused before a run of minutes or hours, not after it
        (
            "train --json /no-such-dir/summary.json",
            "argument --json: no folder /no-such-dir to write summary.json in",
        ),
        ("rollout --json /tmp", "argument --json: /tmp is a folder, not a file"),
        (
            "bench learn --json /no-such-dir/l.json",
            "argument --json: no folder /no-such-dir to write l.json in",
        ),
        (
            "bench throughput --json /no-such-dir/t.json",
            "argument --json: no folder /no-such-dir to write t.json in",
        ),
        (
            "bench robot --json /no-such-dir/r.json",
            "argument --json: no folder /no-such-dir to write r.json in",
        ),
        ("robot --json /no-such-dir/r.json", "argument --json: no folder /no-such-dir to write r.json in"),
        ("describe --json /no-such-dir/d.json", "argument --json: no folder /no-such-dir to write d.json in"),
        (
            "bag import some-bag --out /no-such-dir/t.pb",
            "argument --out: no folder /no-such-dir to write t.pb in",
        ),
    ],
)
def test_a_number_out_of_range_is_refused_naming_its_option_before_anything_starts(
    args: str, error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import multiprocessing

    from edgerl.launch.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(args.split())
    assert exit_.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("edgerl ") and last.endswith(f": error: {error}")
    assert multiprocessing.active_children() == []  # refused while parsing: no server, no worker


def test_worker_cpus_are_checked_naming_the_option() -> None:
    from edgerl.launch.bench_throughput import ThroughputConfig

    stderr = _refused("sim", "--server", "127.0.0.1:1", "--worker-cpus", "x")
    assert '--worker-cpus ("auto", "off" or CPUs): expected CPU numbers like "0,1"' in stderr
    with pytest.raises(ValueError, match="worker_cpus needs 2 distinct CPUs"):
        ThroughputConfig(workers=2, worker_cpus="0")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:  # auto: the last CPU for the one worker, the others for server and network
        assert ThroughputConfig(worker_cpus="auto").placement() == ([cpus[-1]], frozenset(cpus[:-1]))
    assert ThroughputConfig().placement() == ([], None)


def test_bench_throughput_places_the_worker_by_what_costs_more() -> None:
    from edgerl.launch.bench_throughput import BACKFILL_SHARE, Placement, ThroughputConfig, choose_placement

    # the worker's core is the bottleneck: a backfill worker, else the stream leaves the worker
    mlp = choose_placement(env_s=1.0, inference_s=0.1, cpus=2)
    assert mlp == Placement("auto", 1, BACKFILL_SHARE, network_process=True)
    assert (mlp.stream_leaves_worker(0), mlp.stream_leaves_worker(24)) == (True, False)
    # the server's core is the bottleneck (or about even, with noise): the stream stays
    for inference_s in (0.9, 1.5):
        large = choose_placement(env_s=1.0, inference_s=inference_s, cpus=2)
        assert large == Placement("auto", 1) and not large.stream_leaves_worker(0)
    # the engine needs every CPU and steps on one: a replica per CPU, up to 4
    assert choose_placement(env_s=1.0, inference_s=15.0, cpus=2) == Placement("off", 2)
    assert choose_placement(env_s=1.0, inference_s=15.0, cpus=16) == Placement("off", 4)
    assert choose_placement(env_s=1.0, inference_s=15.0, cpus=1) == Placement("off", 1)
    cfg = ThroughputConfig().placed(1.0, 0.1, cpus=2)
    # the workers' cores are the bottleneck: where the server has CPUs of its own, a backfill
    # worker takes 3/8 of the envs and the server's idle time, and the worker keeps its stream
    spare = len(os.sched_getaffinity(0)) > 1
    assert (cfg.worker_cpus, cfg.network_process, cfg.replicas, cfg.groups) == ("auto", not spare, 1, 2)
    assert cfg.backfill_envs == (24 if spare else 0)
    both = ThroughputConfig(network_process=True).placed(1.0, 0.1, cpus=2)
    assert (both.network_process, both.backfill_envs) == (True, 24 if spare else 0)  # given: kept
    assert ThroughputConfig().placed(1.0, 0.9, cpus=2).backfill_envs == 0  # the server's core is
    # 6 envs: 2 for a backfill worker would leave 4 for the worker's 5 groups
    assert ThroughputConfig(envs=6, groups=5).placed(1.0, 0.1, cpus=2).backfill_envs == 0
    given = ThroughputConfig(worker_cpus="off", network_process=False, replicas=3).placed(1.0, 0.1, cpus=2)
    assert (given.worker_cpus, given.network_process, given.replicas) == ("off", False, 3)  # given: kept
    assert given.backfill_envs == 0  # no CPU of the server's own to fill
    assert ThroughputConfig(backfill_envs=8).placed(1.0, 0.9, cpus=2).backfill_envs == 8  # given: kept
    # given for mlp: the stream stays in the worker beside a backfill worker, leaves it without one
    for given_envs, leaves in ((8, False), (0, True)):
        placed = ThroughputConfig(backfill_envs=given_envs).placed(1.0, 0.1, cpus=2)
        assert (placed.backfill_envs, placed.network_process) == (given_envs, leaves)
    with pytest.raises(ValueError, match="replicas must be >= 0"):
        ThroughputConfig(replicas=-1)


def _placement_trial(a: Any, b: Any, rates: dict[int, list[float]]) -> tuple[Any, list[Any], list[Any]]:
    """``try_placements([a, b], ...)`` where each run gives the next of its backfill's ``rates``, and
    the configs it ran."""
    from edgerl.launch.bench_throughput import ThroughputConfig, try_placements

    runs = {k: iter(v) for k, v in rates.items()}
    asked: list[ThroughputConfig] = []

    def measure(c: ThroughputConfig) -> float:
        asked.append(c)
        return next(runs[c.backfill_envs or 0])

    return (*try_placements([a, b], measure), asked)


def _trial_winner(runs: list[list[float]]) -> int:
    """Which of a trial's placements, each with its ``runs``, the rule of ``try_placements`` picks,
    after checking that it ran them as the rule says: two runs each where those of the one with
    the higher median all beat the other's, else four."""
    first = [r[:2] for r in runs]
    lead = 0 if statistics.median(first[0]) >= statistics.median(first[1]) else 1
    clear = min(first[lead]) > max(first[1 - lead])
    assert all(len(r) == (2 if clear else 4) and min(r) > 0 for r in runs), runs
    return 0 if statistics.median(runs[0]) >= statistics.median(runs[1]) else 1


def test_bench_throughput_tries_both_ways_off_a_busy_workers_core_where_both_are_open() -> None:
    from edgerl.launch.bench_throughput import (
        TRIAL_S,
        TRIAL_WARMUP_S,
        ThroughputConfig,
        stream_candidates,
        try_placements,
    )

    backfilled = ThroughputConfig(worker_cpus="auto", backfill_envs=24, network_process=False, replicas=1)
    # inference cheap beside env stepping (0.1 of it), nothing given: a backfill worker, or the
    # streams in network processes without one
    assert stream_candidates(ThroughputConfig(), 1.0, 0.1, cpus=2) == [
        backfilled,
        dataclasses.replace(backfilled, backfill_envs=0, network_process=True),
    ]
    # either given, or no backfill worker chosen (the server's core the busier): nothing to try
    assert stream_candidates(ThroughputConfig(network_process=False), 1.0, 0.1, cpus=2) == [backfilled]
    assert stream_candidates(ThroughputConfig(backfill_envs=24), 1.0, 0.1, cpus=2) == [backfilled]
    large = dataclasses.replace(backfilled, backfill_envs=0)
    assert stream_candidates(ThroughputConfig(), 1.0, 0.9, cpus=2) == [large]
    # a given network process: the backfill worker is still chosen beside it, and not tried
    given_np = ThroughputConfig(network_process=True)
    assert stream_candidates(given_np, 1.0, 0.1, cpus=2) == [given_np.placed(1.0, 0.1, cpus=2)]

    a, b = stream_candidates(ThroughputConfig(), 1.0, 0.1, cpus=2)
    in_worker = {"worker_cpus": "auto", "network_process": False, "backfill_envs": 24}
    in_np = {"worker_cpus": "auto", "network_process": True, "backfill_envs": 0}
    abba, abba_baab = [24, 0, 0, 24], [24, 0, 0, 24, 0, 24, 24, 0]
    for rates, chosen, order in (
        ({24: [900.0, 990.0], 0: [1000.0, 1100.0]}, b, abba),  # every run of b past a's: decided
        ({24: [1200.0, 1150.0], 0: [1000.0, 1100.0]}, a, abba),
        ({24: [950.0, 1000.0, 960.0, 970.0], 0: [1100.0, 1000.0, 1050.0, 1080.0]}, b, abba_baab),  # overlap
        # one outlying run, which decided by the mean of two: b by the median of four
        ({24: [1400.0, 1000.0, 1010.0, 990.0], 0: [1050.0, 1060.0, 1040.0, 1070.0]}, b, abba_baab),
        ({24: [5.0, 5.0, 5.0, 5.0], 0: [4.0, 6.0, 4.0, 6.0]}, a, abba_baab),  # a tie: the first
    ):
        best, tried, asked = _placement_trial(a, b, rates)
        assert best == chosen, rates  # the higher median; the first on a tie
        assert [c.backfill_envs for c in asked] == order
        assert all((c.seconds, c.warmup_s) == (TRIAL_S, TRIAL_WARMUP_S) for c in asked)  # short runs
        assert tried == [{**in_worker, "env_steps_per_s": rates[24]}, {**in_np, "env_steps_per_s": rates[0]}]
    assert try_placements([large], lambda c: pytest.fail("one candidate: nothing to run")) == (large, [])


def test_bench_throughput_tries_placements_on_a_real_server() -> None:
    """The trial of :func:`try_placements` as ``bench throughput`` runs it: sim workers streaming
    to a real server, beside a backfill worker and with their streams in network processes."""
    from edgerl.edge_server.server import ServerConfig
    from edgerl.launch.bench_throughput import (
        ThroughputConfig,
        run_async_stream,
        stream_candidates,
        try_placements,
    )
    from edgerl.launch.processes import PolicySpec, ServerProcess, server_stats

    given = ThroughputConfig(env="InvertedPendulum-v5", envs=8, seconds=1.0, warmup_s=0.3)
    candidates = stream_candidates(given, 1.0, 0.1, cpus=2)  # inference cheap: a backfill worker, or not
    with ServerProcess(PolicySpec.from_options(given, replicas=1), ServerConfig(port=0)) as server:
        best, tried = try_placements(candidates, lambda c: run_async_stream(c, server.address))
        served = server_stats(server.address)["rows"]
    assert [(t["network_process"], t["backfill_envs"]) for t in tried] == [(False, 3), (True, 0)]
    runs = [t["env_steps_per_s"] for t in tried]
    assert best == candidates[_trial_winner(runs)]
    assert served >= sum(x * 1.0 for r in runs for x in r)  # each counted 1 s of steps, all served


def test_each_role_s_cpu_is_summed_over_its_processes_and_weighed_by_each_run_s_seconds() -> None:
    from edgerl.launch.bench_throughput import CPU_ROLES, ModeCpu

    cpu = ModeCpu(server_pid=1)
    roles = ["server", "sim_workers", "network_processes", "network_processes"]
    cpu.add([1.0, 0.75, 0.25, 0.25], roles, 2.0)
    cpu.add([0.7, 0.9, 0.1, None], roles, 1.0)  # a network process not measured: its role is left out
    assert cpu.cores() == {
        "server": round((1.0 * 2 + 0.7) / 3, 3),
        "sim_workers": round((0.75 * 2 + 0.9) / 3, 3),
        "network_processes": round(0.5 * 2 / 3, 3),  # the first run's, over both runs' seconds
        "backfill_worker": None,  # no such process
    }
    assert tuple(cpu.cores()) == CPU_ROLES


def test_bench_throughput_counts_each_modes_server_work_alone() -> None:
    from edgerl.edge_server.batcher import STATS_WINDOW
    from edgerl.launch.bench_throughput import mode_stats

    def stats(
        requests: int,
        batches: int,
        rows: int,
        *,
        queue_full: int = 0,
        failed: int = 0,
        refused: int = 0,
        times_us: tuple[int, int] = (0, 0),
    ) -> dict[str, float]:
        totals = {"requests": requests, "batches": batches, "rows": rows, "rejected_invalid": 0}
        totals["failed_requests"], totals["rejected_streams"] = failed, refused
        totals["queue_wait_us_sum"], totals["inference_us_sum"] = times_us
        percentiles = {"queue_wait_us_p50": 11, "queue_wait_us_p99": 99, "inference_us_p50": rows % 1000}
        extra = {"inference_us_p99": 2000, "max_batch_rows": 64, "mean_batch_rows": 1.0, "policy_version": 7}
        return {**totals, "rejected_queue_full": queue_full, **percentiles, **extra}

    # the server's totals since start hold an earlier mode's 100 requests of one row
    # (each waiting 500 us and each a batch of 50 us); this mode's 200 waited 30 us each, and its
    # 50 batches took 700 us each
    before = stats(100, 100, 100, failed=1, refused=5, times_us=(50_000, 5_000))
    after = stats(300, 150, 6500, queue_full=2, failed=4, refused=6, times_us=(56_000, 40_000))
    first = mode_stats(None, before, after)
    assert first == {
        **{"requests": 200, "batches": 50, "rows": 6400, "rejected_queue_full": 2, "rejected_invalid": 0},
        "rejected_streams": 1,
        "failed_requests": 3,
        "queue_wait_us_sum": 6000,
        "inference_us_sum": 35000,
        "mean_batch_rows": 128.0,
        "queue_wait_us_mean": 30.0,  # the mode's own, where its percentiles are not: no window
        "inference_us_mean": 700.0,
        # the server's window holds the earlier mode's samples too: no percentile is this mode's
        **dict.fromkeys(["queue_wait_us_p50", "queue_wait_us_p99", "inference_us_p50", "inference_us_p99"]),
        "policy_version": 7,
    }  # no max_batch_rows: the server's largest batch since start may be another mode's
    both = mode_stats(first, stats(1000, 500, 9000), stats(1100, 600, 9100))
    totals = (both["requests"], both["batches"], both["rows"], both["mean_batch_rows"])
    assert totals == (300, 150, 6500, 43.3)
    # a run whose requests alone fill the window, not its batches (two requests per batch)
    many = mode_stats(None, stats(0, 0, 0), stats(STATS_WINDOW, STATS_WINDOW // 2, 64 * STATS_WINDOW))
    assert (many["queue_wait_us_p50"], many["queue_wait_us_p99"]) == (11, 99)  # as after the run
    assert (many["inference_us_p50"], many["inference_us_p99"]) == (None, None)


def test_dtype_is_checked_and_only_for_the_llm_policy() -> None:
    stderr = _refused("serve", "--port", "0", "--dtype", "bfloat16")
    assert "dtype: 'bfloat16' is for policy 'llm'; the MLP presets run float32" in stderr
    with pytest.raises(ValueError, match="dtype: 'half' is not one of float32, bfloat16, float16, auto"):
        RunConfig(policy="llm", dtype="half")


def test_rollout_runs_server_and_workers_and_reports(tmp_path: Path) -> None:
    path = tmp_path / "rollout.json"
    # two policy replicas: processes of a server that is itself a daemonic child process
    _edgerl("rollout --env InvertedPendulum-v5 --envs 8 --workers 2 --seconds 4 --replicas 2", path)
    summary = json.loads(path.read_text())
    assert summary["env_steps"] > 1000
    assert summary["episodes"] > 0  # the random initial policy drops the pendulum quickly
    assert summary["server"]["requests"] > 100
    assert summary["server"]["requests"] > summary["server"]["batches"]  # streams shared batches
    assert summary["server"]["failed_requests"] == 0
    plain = {"chosen": False, "worker_cpus": "off", "network_process": False, "backfill_envs": 0}
    assert summary["placement"] == {**plain, "replicas": 2}  # nothing placed without --place


@pytest.mark.parametrize(
    ("given", "chosen"),
    [
        ("", {"network_process": False, "backfill_envs": 6}),  # 3/8 of 16 envs
        ("--backfill-envs 0", {"network_process": True, "backfill_envs": 0}),
        ("--backfill-envs 0 --transport local", {"network_process": False, "backfill_envs": 0}),
    ],
)
def test_rollout_place_takes_work_off_the_workers_where_inference_is_cheap(
    tmp_path: Path, given: str, chosen: dict[str, Any]
) -> None:
    """Ant's physics costs far more than a small MLP's forward pass: ``--place`` pins the worker
    and takes work off its core, with a backfill worker or, where the backfill envs are given as
    0, with the stream in a network process (not over the local socket: no gRPC stream there)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("placing needs a CPU for the worker and one for the server")
    path = tmp_path / "rollout.json"
    out = _edgerl(f"rollout --env Ant-v5 --envs 16 --policy mlp-small --seconds 2 --place {given}", path)
    summary = json.loads(path.read_text())
    placement = summary["placement"]
    assert placement["inference_per_env_s"] < 0.25 and placement["inprocess_steps_per_s"] > 0
    assert {k: placement[k] for k in ("chosen", "worker_cpus", "replicas")} == {
        "chosen": True,
        "worker_cpus": "auto",
        "replicas": 1,
    }
    assert {k: placement[k] for k in chosen} == chosen
    assert f"{chosen['backfill_envs']} backfill env(s)" in out.stdout  # said before the run
    assert "tried" not in placement and "trying" not in out.stdout  # by the rule alone
    assert summary["env_steps"] > 0 and summary["server"]["failed_requests"] == 0


def test_rollout_place_trial_runs_both_ways_off_the_workers_and_keeps_the_faster(tmp_path: Path) -> None:
    """Where the rule leaves two placements (inference cheap: a backfill worker, or the stream in a
    network process), ``--place trial`` runs each on the server in ABBA order, and the run keeps
    the one with the higher median."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("placing needs a CPU for the worker and one for the server")
    path = tmp_path / "rollout.json"
    out = _edgerl("rollout --env Ant-v5 --envs 16 --policy mlp-small --seconds 2 --place trial", path)
    summary = json.loads(path.read_text())
    placement, server = summary["placement"], summary["server"]
    tried = placement.pop("tried")
    # the run's own rows, not the thousands of the trial's 4 or 8 runs: each env's last answer may
    # be unstepped, in the run and in the trial's last batch
    assert 0 < server["rows"] <= summary["env_steps"] + 2 * 16 and server["failed_requests"] == 0
    ways = [{k: t[k] for k in ("worker_cpus", "network_process", "backfill_envs")} for t in tried]
    assert ways == [
        {"worker_cpus": "auto", "network_process": False, "backfill_envs": 6},
        {"worker_cpus": "auto", "network_process": True, "backfill_envs": 0},
    ]
    runs = [t["env_steps_per_s"] for t in tried]
    assert {len(r) for r in runs} <= {2, 4} and len(runs[0]) == len(runs[1]) and min(map(min, runs)) > 0
    best = max(range(2), key=lambda i: statistics.median(runs[i]))
    assert {k: placement[k] for k in ways[best]} == ways[best]  # the run kept the faster
    assert out.stdout.count("trying the placement:") == 2 * len(runs[0])
    stream = "in the worker" if best == 0 else "in a network process"
    assert f"placed by trial: sim worker CPUs auto, stream {stream}" in out.stdout


def test_rollout_place_serves_replicas_where_inference_is_costly(tmp_path: Path) -> None:
    """A large MLP's forward pass costs many times the pendulum's physics: ``--place`` serves a
    replica per CPU, pins nothing, and keeps ``--network-process`` as given."""
    from edgerl.launch.bench_throughput import MAX_CHOSEN_REPLICAS

    path = tmp_path / "rollout.json"
    _edgerl(
        "rollout --env InvertedPendulum-v5 --envs 8 --policy mlp-large --seconds 2 --place --network-process",
        path,
    )
    summary = json.loads(path.read_text())
    placement = summary["placement"]
    assert placement["inference_per_env_s"] > 3
    replicas = min(len(os.sched_getaffinity(0)), MAX_CHOSEN_REPLICAS)
    measured = ("inference_per_env_s", "inprocess_steps_per_s")
    assert {k: v for k, v in placement.items() if k not in measured} == {
        "chosen": True,
        "worker_cpus": "off",
        "network_process": True,
        "backfill_envs": 0,
        "replicas": replicas,
    }
    assert summary["env_steps"] > 0 and summary["server"]["failed_requests"] == 0


def test_a_summary_lines_up_keys_of_any_length() -> None:
    """Values start in one column, past the longest key (a nested one included) and a gap."""
    from edgerl.launch.rollout import format_summary

    text = format_summary({"steps": 5, "placement": {"inprocess_steps_per_s": 1.5, "x": 2}, "wall_s": 1.0})
    lines = text.splitlines()
    assert [line.split() for line in lines] == [
        ["steps", "5"],
        ["wall_s", "1.0"],
        ["placement:"],
        ["inprocess_steps_per_s", "1.5"],
        ["x", "2"],
    ]
    values = [line.rsplit(" ", 1) for line in lines if line != "placement:"]
    assert {len(key) for key, _ in values} == {len("  inprocess_steps_per_s  ") - 1}
    assert lines[3].startswith("  inprocess_steps_per_s  ")


def test_a_step_bar_ends_full_at_its_total_and_counts_on_without_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run whose last batch goes past its budget ends its bar at 100 %, not as a bare count
    (tqdm drops the bar when ``n`` passes ``total``); a bar without total counts every step."""
    with step_bar("run", 100, 10) as bar:
        advance(bar, 64)
        assert bar.n == 64
        advance(bar, 128)
        assert bar.n == 100
    assert "100/100" in capsys.readouterr().err.split("\r")[-1]
    with step_bar("run", None) as bar:
        advance(bar, 128)
        assert bar.n == 128


def test_a_rollout_of_one_env_runs_in_lockstep(tmp_path: Path) -> None:
    """One env cannot be split in two groups: by default the worker then runs one."""
    path = tmp_path / "rollout.json"
    out = _edgerl("rollout --env InvertedPendulum-v5 --envs 1 --steps 300", path)
    summary = json.loads(path.read_text())
    assert summary["env_steps"] == 300  # one env: the worker stops at its budget exactly
    frames = [f for f in out.stderr.splitlines() if f.startswith("InvertedPendulum-v5 x1:")]  # \r reads as \n
    assert " 300/300 " in frames[-1] and "100%|" in frames[-1], frames[-1]  # the progress bar, as it was left
    # one message per step, each of the single env: as many requests and rows as steps
    assert summary["server"]["rows"] == summary["server"]["requests"] >= summary["env_steps"]


def test_rollout_over_the_local_socket(tmp_path: Path) -> None:
    path = tmp_path / "rollout.json"
    args = "rollout --env InvertedPendulum-v5 --envs 8 --workers 1 --seconds 3 --transport local"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = _edgerl(args, path, tmpdir=tmp)
    sock = next(word for word in out.stdout.split() if word.endswith("act.sock"))
    assert sock.startswith(f"{tmp}/edgerl-rollout-")  # a folder of its own for the socket
    assert not any(tmp.iterdir())  # removed at the end
    summary = json.loads(path.read_text())
    assert summary["env_steps"] > 1000
    assert summary["server"]["rows"] >= summary["env_steps"] - 8  # every step's actions came from it


def _failed(*args: str) -> str:
    """Run ``edgerl ARGS``, expecting a server or worker that failed (exit status 1) to be
    reported in one line; that line."""
    out = subprocess.run([*EDGERL, *args], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return out.stderr.splitlines()[-1]


def test_a_taken_port_is_a_one_line_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _failed("serve", "--port", str(port))
    assert line.startswith(f"edgerl: error: could not bind 127.0.0.1:{port}: the port is in use"), line


def test_an_unknown_env_is_refused_before_a_server_starts() -> None:
    for command in (["rollout"], ["serve", "--port", "0"]):
        line = _refused(*command, "--env", "NoSuchEnv-v0").splitlines()[-1]
        assert line == "edgerl: error: env 'NoSuchEnv-v0': Environment `NoSuchEnv` doesn't exist.", line


def test_a_server_or_worker_that_cannot_start_says_why_in_one_line(tmp_path: Path) -> None:
    # a server that cannot start: test_checkpoints' mislabeled checkpoint
    line = _failed("sim", "--server", "127.0.0.1:1", "--env", "NoSuchEnv-v0", "--envs", "2")
    # the worker is named by its session: the fleet's host and pid, and its number
    host = re.escape(socket.gethostname())
    said = rf"edgerl: error: a sim worker process ended \(exit code 1\); {host}/\d+/worker-0: ValueError"
    assert re.match(said, line), line
    assert "env 'NoSuchEnv-v0'" in line
    # the server refuses the worker (its envs are not the served ones): the refusal is the reason
    spec = env_spec("HalfCheetah-v5")
    backend = TorchPolicyBackend(build_policy("mlp", 17, 6, seed=1), spec.act_low, spec.act_high)
    cheetah_sock = str(tmp_path / "cheetah.sock")
    with ServerThread(backend, env_name="HalfCheetah-v5", local_socket=cheetah_sock) as server:
        line = _failed("sim", "--server", server.address, "--env", "Hopper-v5", "--envs", "2")
        assert line.endswith("the server serves observations of shape (17,), Hopper-v5 has (11,)"), line
        # an env of the same shapes: the policy is another env's all the same
        for network in ([], ["--network-process"]):  # the worker's own stream, or a network process's
            line = _failed("sim", "--server", server.address, "--env", "Walker2d-v5", "--envs", "2", *network)
            reason = "the server serves a policy for HalfCheetah-v5, not for Walker2d-v5"
            assert line.endswith(f"{reason} (their observations share the shape (17,))"), line
        # the local socket has no Describe: the server refuses the stream's settings
        line = _failed("sim", "--local-socket", cheetah_sock, "--env", "Walker2d-v5", "--envs", "2")
        reason = (
            "INVALID_ARGUMENT: hello.env_name: the server serves a policy for HalfCheetah-v5, got Walker2d-v5"
        )
        assert line.endswith(reason), line
        assert server.server is not None and server.server.servicer.stats().requests == 0  # nothing served
    # a server that names no env, its actions of another shape: refused at Describe over gRPC, at
    # the first answer over the local socket (which has no Describe)
    sock = str(tmp_path / "act.sock")
    with ServerThread(EchoPolicy(17, 3), local_socket=sock) as server:
        for where in (["--server", server.address], ["--server", server.address, "--network-process"]):
            line = _failed("sim", *where, "--env", "HalfCheetah-v5", "--envs", "2")
            assert line.endswith("the server answers actions of shape (3,), HalfCheetah-v5 takes (6,)"), line
        assert server.server is not None and server.server.servicer.stats().requests == 0
        line = _failed("sim", "--local-socket", sock, "--env", "HalfCheetah-v5", "--envs", "2")
        assert line.endswith("the server answers actions of shape (3,), HalfCheetah-v5 takes (6,)"), line


def test_describe_prints_what_the_server_serves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from edgerl.edge_server.server import ServerConfig
    from edgerl.launch.cli import main

    spec = env_spec("Hopper-v5")
    backend = TorchPolicyBackend(build_policy("mlp", 11, 3, seed=1), spec.act_low, spec.act_high)
    with ServerThread(backend, env_name="Hopper-v5", max_batch_size=64) as server:
        asyncio.run(act_once(server.address, np.zeros((2, 11), np.float32)))
        out = tmp_path / "describe.json"
        assert main(["describe", "--server", server.address, "--stats", "--json", str(out)]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert main(["describe", "--server", server.address]) == 0  # no --stats: no counters
        assert "stats" not in json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    d = printed["describe"]
    assert (d["obs_shape"], d["act_shape"], d["env_name"], d["action_chunk"]) == ([11], [3], "Hopper-v5", 1)
    assert d["act_low"] == [-1.0] * 3 and d["act_high"] == [1.0] * 3 and d["backend"] == "torch-mlp"
    assert d["obs_low"] == d["obs_high"] == [None] * 11  # unbounded: JSON has no infinity
    assert d["max_batch_size"] == 64 and d["max_envs_per_stream"] == ServerConfig().max_envs_per_stream
    assert d["max_streams"] == ServerConfig().max_streams
    assert (printed["stats"]["requests"], printed["stats"]["rows"]) == (1, 2)  # the one step above
    # no server: one line and status 1, soon after the timeout
    t0 = time.monotonic()
    assert main(["describe", "--server", "127.0.0.1:1", "--timeout-s", "0.5"]) == 1
    assert time.monotonic() - t0 < 5.0
    err = capsys.readouterr().err
    assert (
        err
        == "edgerl: error: could not ask 127.0.0.1:1 (UNAVAILABLE: no server at 127.0.0.1:1 within 0.5s)\n"
    )


def _in_group(pgid: int) -> list[int]:
    """Pids of the live processes of process group ``pgid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry))
    return pids


def _terminated(
    args: list[str],
    tmp_path: Path,
    ready: Callable[[str, str], bool],
    when_ready: Callable[[int], None] | None = None,
    *,
    group: bool = False,
    sig: signal.Signals = signal.SIGTERM,
) -> tuple[int, str]:
    """Run ``edgerl ARGS`` in a session of its own until ``ready(stdout, stderr)``, call
    ``when_ready(pgid)`` (its process group's id), send it ``sig`` (SIGTERM: as ``kill PID`` and
    ``docker stop`` do; with ``group``, to its whole process group, as ``timeout`` and ``kill --
    -PGID`` do, and ``systemctl stop`` to every process of the unit; SIGHUP with ``group``: as a
    terminal that hangs up does), and wait; its exit status and stderr. Fails the test if a
    process of the command is left behind."""
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen([*EDGERL, *args], stdout=out, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ready(out_path.read_text(), err_path.read_text()):
            assert proc.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, "the command never got going"
            time.sleep(0.2)
        if when_ready is not None:
            when_ready(proc.pid)
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        code = proc.wait(timeout=60)
        assert wait_until(lambda: not _in_group(proc.pid), timeout_s=10), _in_group(proc.pid)  # init reaps
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return code, err_path.read_text()


def test_stop_signals_reach_the_handler_in_the_main_thread_and_nothing_is_installed_elsewhere() -> None:
    import threading

    from edgerl.launch.processes import on_stop_signals

    before = signal.getsignal(signal.SIGTERM)
    got: list[int] = []
    with on_stop_signals(lambda signum, frame: got.append(signum)):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # handlers run in the main thread between its bytecodes
    assert got == [signal.SIGTERM, signal.SIGINT]
    assert signal.getsignal(signal.SIGTERM) is before  # restored

    seen: list[object] = []

    def elsewhere() -> None:  # a command run off the main thread: no error, no handler
        with on_stop_signals(lambda signum, frame: None):
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [before]


@pytest.mark.parametrize("group", [False, True], ids=["command", "group"])
def test_sigterm_stops_a_rollout_as_ctrl_c_does(group: bool, tmp_path: Path) -> None:
    """Sent to the whole group too, its server and worker among them: they once ended on it at
    once, the command then failing on its server gone (status 1, no summary)."""
    path = tmp_path / "rollout.json"
    args = ["rollout", "--env", "InvertedPendulum-v5", "--envs", "8", "--seconds", "0", "--json", str(path)]
    code, err = _terminated(args, tmp_path, lambda out, err: "episodes=" in err, group=group)  # stepping
    assert code == 0, err
    summary = json.loads(path.read_text())
    assert summary["interrupted"] is True
    assert summary["env_steps"] > 0 and summary["server"]["rows"] > 0
    assert "Traceback" not in err and "leaked" not in err, err  # the workers' queues were closed


@pytest.mark.parametrize(
    ("group", "sig"),
    [(False, signal.SIGTERM), (True, signal.SIGTERM), (True, signal.SIGHUP)],
    ids=["command", "group-with-its-network-process", "hangup-with-its-network-process"],
)
def test_sigterm_stops_edgerl_robot_cleanly_and_its_bag_is_complete(
    group: bool, sig: signal.Signals, tmp_path: Path
) -> None:
    """Sent to the whole group, the network process among them, it is the command's: the robots
    stop as on a SIGTERM to the command alone, their bag complete. So they do where the
    terminal hangs up (an SSH session that drops), where the command once ended at once, its
    bag left without its metadata."""
    from edgerl.robot_client.bags import read_bag

    spec = env_spec("InvertedPendulum-v5")
    backend = TorchPolicyBackend(build_policy("mlp-small", 4, 1, seed=0), spec.act_low, spec.act_high)
    bag = tmp_path / "bag"
    with ServerThread(backend) as server:
        args = ["robot", "--server", server.address, "--robot-arg", "env=InvertedPendulum-v5",
                "--record", str(bag), "--json", str(tmp_path / "robot.json")]  # fmt: skip
        args += ["--network-process"] if group else []
        code, err = _terminated(
            args, tmp_path, lambda out, err: "edgerl robot: ticks" in out, group=group, sig=sig
        )
    assert code == 0, err
    assert "Traceback" not in err, err
    ticks = json.loads((tmp_path / "robot.json").read_text())["robots"][0]["ticks"]
    assert ticks >= 50  # at 50 Hz for the 2 s before its first report
    assert (bag / "metadata.yaml").exists()  # written when the bag is closed
    assert len(next(iter(read_bag(bag).values()))) == ticks  # every tick recorded


FULL_DISKS = {  # robots, Hz, seconds, the file size limit, when the recording fails
    "while-running": (8, 100, 8, 200_000, "while the robots ran"),  # a chunk each 1 MiB: ~4 s in
    "at-close": (1, 50, 1, 4_096, "as the bag was closed"),  # its one chunk is written at the close
}


@pytest.mark.parametrize("case", list(FULL_DISKS))
def test_a_recording_that_fails_on_a_full_disk_ends_the_bag_not_the_robots(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The robots run on to the end: the failure is said once as it happens and once at the end,
    every tick is either written or counted as lost, and the command ends with status 4 (it
    ended with a traceback and no statistics, its writer thread having died with another)."""
    robots, hz, seconds, limit, when = FULL_DISKS[case]
    spec = env_spec("InvertedPendulum-v5")
    backend = TorchPolicyBackend(build_policy("mlp-small", 4, 1, seed=0), spec.act_low, spec.act_high)
    bag, stats = tmp_path / "bag", tmp_path / "robot.json"
    with ServerThread(backend) as server:
        args = ["robot", "--server", server.address, "--robot-arg", "env=InvertedPendulum-v5",
                "--robots", str(robots), "--hz", str(hz), "--seconds", str(seconds),
                "--record", str(bag), "--json", str(stats)]  # fmt: skip
        command = file_size_limited(limit, [*EDGERL, *args])
        run = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == RECORDING_FAILED_STATUS, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    said = re.fullmatch(
        rf"edgerl robot: the recording in {re.escape(str(bag))} failed {when}, after (\d+) ticks "
        r"\(\[Errno 27\] File too large\)(?:; the (\d+) ticks after it were not recorded)?: "
        r"the bag is incomplete",
        run.stderr.splitlines()[-1],
    )
    assert said, run.stderr.splitlines()[-1]
    written, lost = int(said[1]), int(said[2] or 0)
    logged = [line for line in run.stderr.splitlines() if "edgerl.robot_client.bags" in line]
    assert len(logged) == 1 and f"the recording failed {when}" in logged[0], logged
    ticks = [r["ticks"] for r in json.loads(stats.read_text())["robots"]]
    assert written + lost == sum(ticks)  # every tick: written, or lost after the failure
    assert min(ticks) >= 0.8 * hz * seconds  # each robot ran on to the end
    assert (lost > 0) == (when == "while the robots ran")
    # the bag was never closed: what reads it says so, and what can save from it
    from edgerl.launch.cli import main

    assert main(["bag", "info", str(bag)]) == 2
    assert f"never closed (a full disk?): edgerl bag repair {bag} --out NEW" in capsys.readouterr().err
    assert main(["bag", "repair", str(bag), "--out", str(tmp_path / "repaired")]) == 2
    assert capsys.readouterr().err.endswith(
        ": not one whole chunk (rosbags writes one each 1 MiB): nothing to save\n"
    )


def _torch_free(pgid: int, processes: int) -> None:
    """The live processes of group ``pgid`` (a command and its children, at least ``processes``
    of them, multiprocessing's resource tracker aside) have not loaded torch: no library of it is
    mapped."""
    pids = _in_group(pgid)
    assert len(pids) >= processes, pids
    for pid in pids:
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps, Path(f"/proc/{pid}/cmdline").read_text()


@pytest.mark.parametrize(
    ("command", "processes"),
    [(["robot", "--network-process"], 2), (["sim", "--envs", "2", "--workers", "2"], 3)],
    ids=["robot-and-its-network-process", "sim-and-its-workers"],
)
def test_robots_and_sim_workers_run_without_torch(tmp_path: Path, command: list[str], processes: int) -> None:
    """A robot host, its network process and sim workers step envs and stream: none of them
    needs torch, and none loads it (~180 MB and ~1.5 s of start-up each, on a robot's computer too)."""
    spec = env_spec("InvertedPendulum-v5")
    backend = TorchPolicyBackend(build_policy("mlp-small", 4, 1, seed=0), spec.act_low, spec.act_high)
    with ServerThread(backend) as server:
        args = [*command, "--server", server.address]
        args += (
            ["--robot-arg", "env=InvertedPendulum-v5"]
            if command[0] == "robot"
            else ["--env", "InvertedPendulum-v5"]
        )
        running = "edgerl robot: ticks" if command[0] == "robot" else "episodes="
        code, err = _terminated(
            args,
            tmp_path,
            lambda out, err: running in out + err,
            lambda pgid: _torch_free(pgid, processes),
        )
        assert server.server is not None
        served = server.server.batcher.stats.rows
    assert served > 0  # they streamed
    assert code == 0, err
    assert "Traceback" not in err, err


def _ignoring_sigterm(pids: list[int]) -> bool:
    """Whether one of ``pids`` ignores SIGTERM (its ``SigIgn`` mask in /proc)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            mask = re.search(r"^SigIgn:\s*([0-9a-f]+)$", status, re.M)
            if mask and int(mask.group(1), 16) >> (signal.SIGTERM - 1) & 1:
                return True
    return False


@pytest.mark.parametrize("group", [False, True], ids=["command", "group"])
def test_a_rollout_stopped_while_its_server_starts_ends_at_once_and_leaves_nothing(
    group: bool, tmp_path: Path
) -> None:
    """SIGTERM while the command waits for its server process to bind: it stops that process
    and ends with status 130. Its server, which leaves SIGTERM to the command, once outlived
    the command's wait, and multiprocessing's exit, which ends such a process with SIGTERM, then
    waited for it for good."""
    args = ["rollout", "--env", "InvertedPendulum-v5", "--envs", "2", "--seconds", "0"]
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen([*EDGERL, *args], stdout=out, stderr=err, start_new_session=True)
    try:
        # the server process once it ignores SIGTERM: it has yet to import torch and build its
        # policy, a second or more, before it binds
        assert wait_until(lambda: _ignoring_sigterm(spawned_children(proc.pid)), timeout_s=60, poll_s=0.01)
        assert "edge server on" not in out_path.read_text()  # not bound yet
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        assert wait_until(lambda: not _in_group(proc.pid), timeout_s=10), _in_group(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    err_text = err_path.read_text()
    assert code == 130 and err_text.rstrip().endswith("edgerl: interrupted"), err_text
    assert "Traceback" not in err_text, err_text


def test_sigterm_to_its_whole_group_stops_sim_and_its_workers_as_ctrl_c_does(tmp_path: Path) -> None:
    """``timeout`` and ``systemctl stop`` send SIGTERM to the sim workers too. The command stops
    them, and its summary counts their steps; the workers leave the signal to it."""
    spec = env_spec("InvertedPendulum-v5")
    backend = TorchPolicyBackend(build_policy("mlp-small", 4, 1, seed=0), spec.act_low, spec.act_high)
    with ServerThread(backend) as server:
        args = ["sim", "--server", server.address, "--env", "InvertedPendulum-v5", "--envs", "4"]
        args += ["--workers", "2"]
        code, err = _terminated(args, tmp_path, lambda out, err: "episodes=" in err, group=True)
        assert server.server is not None
        served = server.server.batcher.stats.rows
    assert served > 0
    assert code == 0, err
    assert "Traceback" not in err and "leaked" not in err, err
    summary = (tmp_path / "out.txt").read_text()
    assert re.search(r"^env_steps +[1-9]", summary, re.M), summary  # its summary, after the workers stopped


@pytest.mark.parametrize("reader", ["pipe", "terminal"])
def test_a_stream_whose_reader_is_gone_goes_on_into_dev_null(reader: str) -> None:
    """A pipe whose reader closed (EPIPE) or a terminal that hung up (EIO): the stream, and what
    it held, go to /dev/null, the command's writes go on. Another error is the command's."""
    from edgerl.launch.entry import ReaderSafe

    theirs, ours = os.pipe() if reader == "pipe" else pty.openpty()
    with os.fdopen(ours, "w") as stream:
        safe = ReaderSafe(stream)
        safe.write("before\n")
        safe.flush()
        assert not safe.reader_gone and os.readlink(f"/proc/self/fd/{ours}") != os.devnull
        os.close(theirs)
        assert safe.write("after\n") == 6  # held in the stream's buffer
        safe.flush()
        assert safe.reader_gone and os.readlink(f"/proc/self/fd/{ours}") == os.devnull
        print("and on", file=safe, flush=True)
        assert safe.closed is False  # the stream's own attributes
    full = open("/dev/full", "w")  # noqa: SIM115 - a full disk under a redirect
    safe = ReaderSafe(full)
    safe.write("x")
    with pytest.raises(OSError, match="No space left on device"):
        safe.flush()
    with contextlib.suppress(OSError):  # its close flushes "x" again
        full.close()


def test_a_rollout_whose_reader_goes_away_runs_to_its_end_and_writes_its_json(tmp_path: Path) -> None:
    """``edgerl rollout --json F 2>&1 | head -1``: the reader gone after one line, the command
    once ended with ``edgerl: error: [Errno 32] Broken pipe`` at its next write, status 1 and
    no ``F``."""
    path = tmp_path / "rollout.json"
    args = ["rollout", "--env", "InvertedPendulum-v5", "--envs", "2", "--seconds", "3", "--json", str(path)]
    with subprocess.Popen([*EDGERL, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(b"edgerl: edge server on ")
        proc.stdout.close()
        assert proc.wait(timeout=120) == 0
    summary = json.loads(path.read_text())
    assert summary["env_steps"] > 0 and summary["interrupted"] is False


def test_edgerl_robot_runs_on_when_the_reader_of_its_output_goes_away(tmp_path: Path) -> None:
    """``edgerl robot | head -1`` (or a ``tee`` or log shipper that ends): its robots run on, where
    the command once ended their run at its next status line, 2 s later, on a broken pipe."""
    spec = env_spec("InvertedPendulum-v5")
    backend = TorchPolicyBackend(build_policy("mlp-small", 4, 1, seed=0), spec.act_low, spec.act_high)
    path = tmp_path / "robot.json"
    with ServerThread(backend) as server:
        args = [
            "robot",
            "--server",
            server.address,
            "--robot-arg",
            "env=InvertedPendulum-v5",
            "--json",
            str(path),
        ]
        with subprocess.Popen([*EDGERL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            first = proc.stdout.readline().decode()
            ticks = re.match(r"edgerl robot: ticks (\d+) ", first)
            assert ticks, first
            proc.stdout.close()
            time.sleep(5.0)  # two status lines more, into no reader
            assert proc.poll() is None, proc.stderr.read().decode()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
    ran = json.loads(path.read_text())["robots"][0]["ticks"]
    assert ran >= int(ticks.group(1)) + 200  # 5 s more at 50 Hz, less a margin


def test_sim_waits_for_its_server_says_so_and_stops_at_once(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    # Each connection attempt may take 60 s: the stop must not wait for one.
    args = ["sim", "--server", address, "--env", "InvertedPendulum-v5", "--envs", "2", "--timeout-s", "60"]
    t0 = time.monotonic()
    code, err = _terminated(args, tmp_path, lambda out, err: "edgerl: waiting for the server" in err)
    took = time.monotonic() - t0
    assert f"edgerl: waiting for the server at {address} (the workers retry with backoff)" in err
    assert code == 130 and err.rstrip().endswith("edgerl: interrupted"), err  # nothing ran: no summary
    assert "Traceback" not in err, err
    assert took < 40.0, f"{took:.1f}s"  # a few seconds to start and say so, not a 60 s attempt


def test_two_sims_against_one_server_keep_their_own_sessions() -> None:
    """Two `edgerl sim` runs against one training server, as from two machines: each fleet's
    workers are named by its host and pid. Both were "sim/worker-0", and the second run's stream
    took the first's session over: the first was served on, its transitions dropped without a
    word (now it would be ended with ABORTED)."""
    from edgerl.edge_server.transitions import TransitionConfig

    spec = env_spec("InvertedPendulum-v5")
    backend = TorchPolicyBackend(build_policy("mlp-small", 4, 1, seed=1), spec.act_low, spec.act_high)
    with ServerThread(
        backend, env_name="InvertedPendulum-v5", learner=TransitionConfig(overflow="drop")
    ) as server:
        args = [
            "sim",
            "--server",
            server.address,
            "--env",
            "InvertedPendulum-v5",
            "--envs",
            "2",
            "--steps",
            "3000",
        ]
        runs = [subprocess.Popen([*EDGERL, *args], stderr=subprocess.PIPE, text=True) for _ in range(2)]
        errs = [run.communicate(timeout=120)[1] for run in runs]
        outcomes = [(run.returncode, err) for run, err in zip(runs, errs, strict=True)]
        assert server.server is not None and server.server.store is not None
        sessions = set(server.server.store._sessions)
    assert [code for code, _ in outcomes] == [0, 0], outcomes
    host = re.escape(socket.gethostname())
    assert len(sessions) == 2 and all(re.fullmatch(rf"{host}/\d+/worker-0", s) for s in sessions), sessions


def test_sim_needs_a_server_or_a_local_socket() -> None:
    stderr = _refused("sim", "--envs", "2")
    assert "sim: give one of --server ADDR (gRPC) and --local-socket PATH" in stderr


def test_bench_throughput_writes_all_modes(tmp_path: Path) -> None:
    from edgerl.edge_server.batcher import STATS_WINDOW
    from edgerl.launch.bench_throughput import MODE_PERCENTILES

    path = tmp_path / "bench.json"
    out = _edgerl(
        "bench throughput --env InvertedPendulum-v5 --envs 8 --seconds 1.5 --warmup-s 0.5 --workers 1", path
    )
    result = json.loads(path.read_text())
    assert json.loads(out.stdout.strip().splitlines()[-1]) == result
    for mode in ("sync_inprocess", "sync_unary", "async_stream", "async_local"):
        assert result[mode] > 0
    assert result["config"]["groups"] == 2  # the MLP's default: double-buffered
    assert result["config"]["replicas"] == 1  # inference costs less than env stepping: one copy
    c = result["config"]  # the placement was chosen from the first in-process run
    assert c["worker_cpus"] in ("auto", "off") and isinstance(c["network_process"], bool)
    placed, tried = result["placement"], result["placement"]["tried"]
    assert placed["async_stream"] == {k: c[k] for k in ("worker_cpus", "network_process", "backfill_envs")}
    assert placed["async_local"]["network_process"] is False  # no gRPC stream to move
    if placed["async_local"]["backfill_envs"]:  # chosen: async_stream tried the streams' other way
        assert [(t["network_process"], t["backfill_envs"]) for t in tried] == [
            (False, placed["async_local"]["backfill_envs"]),
            (True, 0),
        ]
        best = tried[_trial_winner([t["env_steps_per_s"] for t in tried])]
        assert placed["async_stream"] == {k: v for k, v in best.items() if k != "env_steps_per_s"}
    else:  # none (the machine's costs decide): nothing to try
        assert tried == [] and placed["async_stream"] == placed["async_local"]
    assert (result["config"]["envs"], result["config"]["seconds"]) == (8, 1.5)
    assert result["ratios"]["async_stream/sync_unary"] == pytest.approx(
        result["async_stream"] / result["sync_unary"], rel=1e-2
    )
    assert result["ratios"]["async_local/sync_inprocess"] == pytest.approx(
        result["async_local"] / result["sync_inprocess"], rel=1e-2
    )
    for mode in ("async_stream", "async_local"):  # the server's counters over that mode's runs alone
        st = result[f"server_{mode}"]
        assert 0 < st["batches"] <= st["requests"] <= st["rows"] <= st["batches"] * 8  # 8 envs at most
        assert st["mean_batch_rows"] == round(st["rows"] / st["batches"], 1)
        # one repeat: a percentile is given where that run alone filled the server's window
        for key, of in MODE_PERCENTILES.items():
            assert (st[key] is None) == (st[of] < STATS_WINDOW), (key, st)
        # each role's share of a core: the server and the sim worker worked; a network process and a
        # backfill worker where the mode's placement ran one, else none
        cores, where = result["cpu_cores"][mode], placed[mode]
        assert 0.0 < cores["server"] < 2.5 and 0.0 < cores["sim_workers"] < 2.5, cores
        assert (cores["network_processes"] is not None) == where["network_process"], (cores, where)
        assert (cores["backfill_worker"] is not None) == bool(where["backfill_envs"]), (cores, where)
    lines = out.stderr.splitlines()  # the table
    assert any(line.startswith("async_stream cores used: server ") for line in lines), lines
    check_machine_block(result)


def test_serve_options_become_the_server_config() -> None:
    from edgerl.edge_server.server import ServerConfig
    from edgerl.launch.argtypes import config_from_args
    from edgerl.launch.cli import build_parser

    args = "serve --port 5151 --max-delay-us 250 --grace-s 0.5 --keepalive-s 0 --max-streams 12"
    a = build_parser().parse_args(args.split())
    cfg = config_from_args(ServerConfig, a)
    assert (cfg.port, cfg.max_delay_us, cfg.grace_s, cfg.keepalive_s) == (5151, 250, 0.5, 0.0)
    assert cfg.max_streams == 12
    assert cfg.max_batch_size == ServerConfig().max_batch_size and cfg.learner is None  # not options
    assert config_from_args(ServerConfig, a, port=0).port == 0  # overrides win


def test_activity_lines_say_what_the_server_did_and_nothing_when_it_was_idle() -> None:
    from edgerl.edge_server.server import Activity, activity_line

    before = Activity(10.0, 2, rows=1000, batches=100, refused_full=0, refused_invalid=1, refused_streams=0,
                      failed=0, version=3, queue_wait_us_p99=0, inference_us_p50=0)  # fmt: skip
    busy = dataclasses.replace(
        before, time_s=12.0, rows=9000, batches=600, queue_wait_us_p99=1250, inference_us_p50=800
    )
    assert activity_line(before, busy) == (
        "2 stream(s), 4,000 rows/s in 250 batches/s (16.0 rows each), queue wait p99 1.2 ms, "
        "inference p50 0.8 ms, policy version 3"
    )
    assert activity_line(busy, dataclasses.replace(busy, time_s=22.0)) is None  # idle: no line
    left = dataclasses.replace(busy, time_s=22.0, streams=1, version=4, refused_full=5, refused_invalid=3)
    assert activity_line(busy, left) == (
        "1 stream(s), 0 rows/s in 0 batches/s, policy version 4; "
        "refused 5 (queue full), 2 (invalid), 0 (max_streams)"
    )
    crowded = dataclasses.replace(left, time_s=32.0, refused_streams=7)  # nothing but refusals
    assert activity_line(left, crowded) == (
        "1 stream(s), 0 rows/s in 0 batches/s, policy version 4; "
        "refused 0 (queue full), 0 (invalid), 7 (max_streams)"
    )
    faulty = dataclasses.replace(crowded, time_s=34.0, rows=9064, batches=602, failed=3)  # a policy's faults
    assert activity_line(crowded, faulty) == (
        "1 stream(s), 32 rows/s in 1 batches/s (32.0 rows each), queue wait p99 1.2 ms, "
        "inference p50 0.8 ms, policy version 4; 3 failed (the policy's forward pass)"
    )
    assert activity_line(faulty, dataclasses.replace(faulty, time_s=36.0, failed=4)) == (
        "1 stream(s), 0 rows/s in 0 batches/s, policy version 4; 1 failed (the policy's forward pass)"
    )


def test_edgerl_serve_prints_what_it_did_every_stats_interval() -> None:
    with serving("--stats-every-s", "0.5") as (proc, first):
        assert proc.stdout is not None
        proc.stdout.readline()  # the policy line
        address = first.split()[-1]
        obs = np.zeros((4, 17), np.float32)  # one step of 4 HalfCheetah envs per stream
        for _ in range(3):
            asyncio.run(act_once(address, obs))
        # a tick may fall between a stream's opening and its step: a line with streams, no rows
        lines = [proc.stdout.readline().strip()]
        while "rows each" not in lines[-1] and len(lines) < 4:
            lines.append(proc.stdout.readline().strip())
        pattern = r"edgerl: [01] stream\(s\), [\d,]+ rows/s in [\d,]+ batches/s{}, policy version 0"
        for line in lines[:-1]:
            assert re.fullmatch(pattern.format(""), line), lines
        # every stream sent one step of 4 rows, alone: 4 rows a batch
        each = r" \(4\.0 rows each\), queue wait p99 [\d.]+ ms, inference p50 [\d.]+ ms"
        assert re.fullmatch(pattern.format(each), lines[-1]), lines


def test_bench_throughput_gives_the_llm_policy_one_env_group_per_replica() -> None:
    from edgerl.launch.bench_throughput import ThroughputConfig

    llm = ThroughputConfig(policy="llm")
    assert llm.groups == 0  # open until the placement chooses the replicas
    assert llm.placed(1.0, 15.0, cpus=2).groups == 2
    assert ThroughputConfig(policy="llm", replicas=1).groups == 1  # one engine: all envs in one batch
    assert ThroughputConfig(policy="llm", groups=1).placed(1.0, 15.0, cpus=2).groups == 1  # given stays
    assert ThroughputConfig(policy="mlp").groups == 2
    with pytest.raises(ValueError, match="groups"):
        ThroughputConfig(groups=-1)


def test_robot_options_become_the_runner_config() -> None:
    from edgerl.launch.cli import build_parser
    from edgerl.launch.robot import runner_config

    parser = build_parser()
    a = parser.parse_args(["robot", "--network-process", "--network-cpus", "0", "--hz", "20"])
    cfg = runner_config(a)
    assert (cfg.network_process, cfg.network_cpus, cfg.watchdog.hz) == (True, (0,), 20)
    assert cfg.network_spare  # by default
    assert cfg.timeout_s == 1.0  # by default
    assert runner_config(parser.parse_args(["robot", "--answer-timeout-s", "4.5"])).timeout_s == 4.5
    no_spare = parser.parse_args(["robot", "--network-process", "--no-network-spare"])
    assert not runner_config(no_spare).network_spare
