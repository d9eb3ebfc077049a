"""``edgerl robot``: robots of a ``module:Class`` behind watchdogs, streaming to an edge server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from edgerl.launch import jsonout
from edgerl.launch.argtypes import (
    COUNT,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    PROBABILITY,
    add_json_option,
    add_metrics_options,
)
from edgerl.launch.machine import BUSY_CORES, CpuMeter, busy_text
from edgerl.launch.processes import on_signals, on_stop_signals, parse_cpus
from edgerl.robot_client import errors
from edgerl.robot_client.bags import BagRecorder, RobotTopics
from edgerl.robot_client.robot import Robot, RobotKind, load_robot, robot_class
from edgerl.robot_client.runner import LinkFaults, RobotHost, RobotLink, RobotRunnerConfig, chunk_defaults
from edgerl.robot_client.security import ClientSecurity
from edgerl.watchdog.watchdog import Fallback, WatchdogConfig

DEFAULT_ROBOT = "edgerl.sim.robot:MujocoRobot"
ESTOPPED_STATUS = 3
"""Exit status of ``edgerl robot`` when a robot ended the run e-stopped (latched until reset)."""
RECORDING_FAILED_STATUS = 4
"""Exit status of ``edgerl robot`` when its ``--record`` bag failed (a full disk) and no robot
ended e-stopped: the robots ran on, the bag is incomplete."""
RESET_SIGNAL = signal.SIGUSR1
"""The operator's e-stop reset of a running ``edgerl robot`` (``kill -USR1 PID``)."""
STATS_EVERY_S = 2.0
"""How often ``edgerl robot`` prints a line of its robots' counts (seconds)."""
METRICS_HOST = "127.0.0.1"
"""Where ``--metrics-port`` binds without ``--metrics-host``: loopback."""

log = logging.getLogger(__name__)


def add_watchdog_arguments(
    p: argparse.ArgumentParser, *, estop_after: int, serves_policy: bool = False
) -> None:
    """Options shared by ``edgerl robot`` and ``edgerl bench robot``: rate, deadline, fallback,
    e-stop, when to ask for new actions and where the stream runs. The deadline and refill level
    default to None: :func:`~edgerl.robot_client.runner.chunk_defaults` for the chunk length of
    the policy. With ``serves_policy`` (a command that starts the server, so knows ``--chunk``
    and ``--policy``) the stream's placement defaults to a network process behind the LLM policy."""
    p.add_argument("--hz", type=POSITIVE, default=50.0, help="control rate (ticks per second)")
    p.add_argument("--fallback", default="hold", choices=[f.value for f in Fallback], help="fallback mode")
    p.add_argument(
        "--deadline-ms",
        type=POSITIVE,
        default=None,
        help="latency budget of a policy action (ms); None: 20, or with chunks of K > 1 actions the "
        "chunk's span, 1000 K / hz"
        + (" (K: --chunk)" if serves_policy else " (K: the server's, asked with Describe at start)"),
    )
    p.add_argument(
        "--estop-after",
        type=NON_NEGATIVE_INT,
        default=estop_after,
        help="consecutive fallbacks that latch an e-stop (0: never)",
    )
    p.add_argument(
        "--refill-at",
        type=NON_NEGATIVE_INT,
        default=None,
        help="ask for actions when this many are left; None: 1, or with chunks of K > 1 actions, K // 2",
    )
    p.add_argument(
        "--network-process",
        action=argparse.BooleanOptionalAction if serves_policy else "store_true",
        default=None if serves_policy else False,
        help="run the stream in a network process of its own instead of on the control thread: "
        "answers are taken in while the loop runs behind (fewer fallbacks after a stall, more skipped ticks)"
        + (
            "; None: on for --policy llm, whose engine shares the cores (the control threads then keep "
            "one of their own), else off"
            if serves_policy
            else ""
        ),
    )


def add_fault_arguments(p: argparse.ArgumentParser) -> None:
    """Injected link faults (``LinkFaults``)."""
    p.add_argument("--delay-ms", type=NON_NEGATIVE, default=0.0, help="inject extra latency per answer (ms)")
    p.add_argument("--jitter-ms", type=NON_NEGATIVE, default=0.0, help="inject random extra latency (ms)")
    p.add_argument("--drop", type=PROBABILITY, default=0.0, help="inject a probability of losing an answer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default="127.0.0.1:50051", help="edge server address host:port")
    p.add_argument("--robot", default=DEFAULT_ROBOT, help="robot driver as module:Class")
    p.add_argument(
        "--robot-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument of the robot class (VALUE parsed as JSON, else a string); repeatable",
    )
    p.add_argument("--robots", type=COUNT, default=1, help="robots run by this process (one stream)")
    add_watchdog_arguments(p, estop_after=50)
    p.add_argument("--safe-pose", default="", help="comma-separated target of --fallback safe_pose")
    p.add_argument(
        "--max-delta", type=POSITIVE, default=None, help="rate limit per tick (default: 25%% of range)"
    )
    p.add_argument(
        "--network-cpus",
        default="",
        metavar="CPUS",
        help='with --network-process: its CPUs, e.g. "0" or "0,1" (default: any); leave the control '
        "thread a CPU of its own, and keep an edge server on the same machine off it too",
    )
    p.add_argument(
        "--network-spare",
        action=argparse.BooleanOptionalAction,
        default=RobotRunnerConfig.network_spare,
        help="with --network-process: keep a second network process started, to take over at once from "
        "one that is lost (its stream is up in ~0.01 s, not ~0.15 s; ~47 MB)",
    )
    p.add_argument("--seconds", type=NON_NEGATIVE, default=0.0, help="run time (0: until Ctrl-C)")
    p.add_argument(
        "--connect-timeout-s",
        type=NON_NEGATIVE,
        default=RobotRunnerConfig.connect_timeout_s,
        help="how long to wait for the server's stream before the control loop starts; the robots "
        "then run on fallbacks until it connects (the loop never waits for the server again)",
    )
    p.add_argument(
        "--answer-timeout-s",
        type=POSITIVE,
        default=RobotRunnerConfig.timeout_s,
        help="an answer later than this ends the stream, which is reopened on a new connection (a "
        "link that died without closing); raise it for a policy slower than this (the watchdog's "
        "--deadline-ms still drops late actions)",
    )
    add_fault_arguments(p)
    p.add_argument(
        "--record", metavar="DIR", help="record every tick as a ROS 2 bag (MCAP) in this new folder"
    )
    add_metrics_options(
        p,
        "each robot's counters (ticks, fallbacks, e-stops, latency) and the stream's",
        host=METRICS_HOST,
    )
    add_json_option(p, "write the final statistics as JSON")


def _parse_kwargs(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--robot-arg: expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def build_robots(a: argparse.Namespace) -> list[Robot]:
    """``--robots`` instances of ``--robot``, given the rate, a seed and a name where the class takes them."""
    kwargs = _parse_kwargs(a.robot_arg)
    params = inspect.signature(robot_class(a.robot)).parameters
    robots = []
    for i in range(a.robots):
        kw = dict(kwargs)
        for key, value in (("hz", a.hz), ("seed", i), ("name", f"robot-{i}" if a.robots > 1 else "")):
            if key in params and key not in kw:
                kw[key] = value
        robots.append(load_robot(a.robot, **kw))
    return robots


def ask_server(
    server: str,
    security: ClientSecurity | None,
    kind: RobotKind,
    timeout_s: float = 5.0,
    should_stop: Callable[[], bool] | None = None,
    *,
    wait: bool = True,
) -> int:
    """Ask the server at ``server`` (its Describe) before the robots start: the actions per
    answer of its policy, checking that the policy is for robots of ``kind`` (their observation
    and action shapes, and their env where both name one).

    The robots never wait for the server: this gives 1 if the server cannot be asked within
    ``timeout_s`` (with a warning: the robots start anyway and connect later), and 1 at once when
    ``should_stop()`` (the command was stopped meanwhile). With ``wait`` False (the caller needs
    no chunk) a server that is not up is not waited for, and not warned about: the shapes are
    checked where it answers at once.

    Raises:
        PolicyMismatchError: the server's policy is not for these robots (nothing is started).
    """
    from edgerl.robot_client.client import EdgeClient

    async def ask() -> int:
        async with EdgeClient(server, security=security, timeout_s=timeout_s) as client:
            if wait and not await client.wait_ready(timeout_s, should_stop=should_stop):
                return 1
            info = await client.describe_for(
                kind.obs_shape, kind.env_name, act_shape=kind.act_shape, owner="the robot host"
            )
            return info.action_chunk

    try:
        return asyncio.run(ask())
    except errors.PolicyMismatchError:
        raise
    except errors.EdgeRLError as exc:
        if wait:
            log.warning(
                "could not ask %s for its action chunk within %gs (%s): single-action deadline and refill",
                server,
                timeout_s,
                exc,
            )
        return 1


def runner_config(a: argparse.Namespace, chunk: int = 1) -> RobotRunnerConfig:
    """The runner config of ``edgerl robot``'s options; ``chunk``, the policy's actions per answer,
    sets the deadline and refill level the options leave open (:func:`chunk_defaults`)."""
    pose = tuple(float(x) for x in a.safe_pose.split(",")) if a.safe_pose else None
    deadline_ms, refill_at = chunk_defaults(a.hz, chunk, a.deadline_ms, a.refill_at)
    return RobotRunnerConfig(
        a.server,
        WatchdogConfig(
            hz=a.hz,
            deadline_s=deadline_ms / 1e3,
            fallback=Fallback(a.fallback),
            max_delta=a.max_delta,
            estop_after=a.estop_after,
            safe_pose=pose,
        ),
        refill_at=refill_at,
        network_process=a.network_process,
        network_cpus=parse_cpus(a.network_cpus, "--network-cpus"),
        network_spare=a.network_spare,
        faults=LinkFaults(a.delay_ms, a.jitter_ms, a.drop),
        timeout_s=a.answer_timeout_s,
        connect_timeout_s=a.connect_timeout_s,
    )


def _label(link: RobotLink) -> str:
    """The robot's name in a message, or its index where it has none (a lone robot is given no name)."""
    return link.robot.name or f"robot {link.index}"


def _line_stats(host: RobotHost) -> list[dict[str, Any]]:
    """The robots' counters the status line reads, with the one percentile it shows: the median
    latency. All six percentiles of 100 robots took ~90 ms on a slow machine, every 2 s, on a
    core the control loop needs; this ~10 ms."""
    stats = host.stats(percentiles=False)
    for s, p50 in zip(stats, host.latencies_ms_p50(), strict=True):
        s["latency_ms_p50"] = p50
    return stats


def _line(stats: list[dict[str, Any]], stream: dict[str, Any], cpu: float | None) -> str:
    ticks = sum(s["ticks"] for s in stats)
    fb = sum(s["fallbacks"] for s in stats)
    lat = [s["latency_ms_p50"] for s in stats if not np.isnan(s["latency_ms_p50"])]
    restarts = (
        f", {stream['network_restarts']} network process restarts" if stream["network_restarts"] else ""
    )
    return (
        f"ticks {ticks}  fallbacks {fb} ({fb / max(1, ticks):.2%})  "
        f"e-stopped {sum(s['estopped'] for s in stats)}/{len(stats)}  "
        f"latency p50 {f'{np.median(lat):.1f} ms' if lat else '- (no answer yet)'}  "
        f"version {max(s['policy_version'] for s in stats)}  "
        f"stream {'up' if stream['connected'] else 'down'} ({stream['reconnects']} reconnects{restarts})  "
        f"cpu {'-' if cpu is None else f'{cpu:.2f}'}"
    )


#: Each robot's counters and gauges in ``/metrics``: the key of :meth:`RobotLink.stats`, the
#: family, its type and its help.
ROBOT_METRICS = (
    ("ticks", "edgerl_robot_ticks_total", "counter", "Control ticks run."),
    ("policy_ticks", "edgerl_robot_policy_ticks_total", "counter", "Ticks that applied a policy action."),
    (
        "fallbacks",
        "edgerl_robot_fallbacks_total",
        "counter",
        "Ticks that applied a fallback action: none in time.",
    ),
    ("estops", "edgerl_robot_estops_total", "counter", "E-stops latched."),
    (
        "loop_deadline_misses",
        "edgerl_robot_loop_deadline_misses_total",
        "counter",
        "Ticks the loop skipped, a period late.",
    ),
    (
        "late_actions",
        "edgerl_robot_late_actions_total",
        "counter",
        "Answers dropped: they came after their deadline.",
    ),
    ("requests", "edgerl_robot_requests_total", "counter", "Observations sent to the server."),
    ("answers", "edgerl_robot_answers_total", "counter", "Answers from the server."),
    ("episodes", "edgerl_robot_episodes_total", "counter", "Episodes ended."),
    (
        "estopped",
        "edgerl_robot_estopped",
        "gauge",
        "1 while the robot's e-stop is latched (until the operator's reset).",
    ),
    (
        "policy_version",
        "edgerl_robot_policy_version",
        "gauge",
        "Version of the policy's last answer (-1: none yet).",
    ),
    (
        "max_consecutive_fallbacks",
        "edgerl_robot_max_consecutive_fallbacks",
        "gauge",
        "Longest fallback streak.",
    ),
)
#: Each robot's recent percentiles (ms in :meth:`RobotLink.stats`): the key's stem, the family, its help.
ROBOT_TIMES = (
    (
        "tick_jitter_ms",
        "edgerl_robot_tick_jitter_seconds",
        "How late ticks started, recent ticks by quantile.",
    ),
    ("action_age_ms", "edgerl_robot_action_age_seconds", "Age of the actions applied, by quantile."),
    ("latency_ms", "edgerl_robot_latency_seconds", "Observation to answer, recent answers by quantile."),
)
STREAM_METRICS = (
    ("connected", "edgerl_robot_stream_up", "gauge", "1 while the Act stream is up."),
    (
        "reconnects",
        "edgerl_robot_stream_reconnects_total",
        "counter",
        "Streams that failed or could not open.",
    ),
    ("messages", "edgerl_robot_stream_messages_total", "counter", "Answers the stream took in."),
    ("network_restarts", "edgerl_robot_network_restarts_total", "counter", "Network processes replaced."),
)


def robot_exposition(stats: list[dict[str, Any]], stream: dict[str, Any]) -> str:
    """``edgerl robot``'s ``/metrics``: each robot's counters of :meth:`RobotHost.stats`, labelled
    ``robot`` (its name, or its index where it has none), and the stream's."""
    from edgerl.edge_server.metrics import family_lines

    names = [{"robot": s["robot"] or str(i)} for i, s in enumerate(stats)]
    lines: list[str] = []
    for key, name, kind, help in ROBOT_METRICS:
        lines += family_lines(name, kind, help, [("", n, s[key]) for n, s in zip(names, stats, strict=True)])
    for stem, name, help in ROBOT_TIMES:
        samples = [
            ("", {**n, "quantile": q}, s[f"{stem}_p{p}"] / 1e3)
            for n, s in zip(names, stats, strict=True)
            for q, p in (("0.5", 50), ("0.99", 99))
        ]
        lines += family_lines(name, "gauge", help, samples)
    for key, name, kind, help in STREAM_METRICS:
        lines += family_lines(name, kind, help, [("", {}, stream[key])])
    return "\n".join(lines) + "\n"


def busy_line(cpu: float | None, robots: int, hz: float, network_process: bool) -> str | None:
    """What to tell the operator where this process used :data:`BUSY_CORES` of a core or more:
    its control loop runs behind, and its robots fall back whatever the server does."""
    if cpu is None or cpu < BUSY_CORES:
        return None
    stream = "" if network_process else ", or move the stream to a process of its own: --network-process"
    return busy_text("this process", cpu, robots, hz, f"run fewer robots in each process{stream}")


def _serving_metrics(host: RobotHost, bind: str, port: int | None) -> AbstractContextManager[None]:
    """``GET /metrics`` of ``host`` on ``bind:port`` (None: nothing) for the block, on a thread of
    its own (:func:`edgerl.launch.run_metrics.serving`).

    Raises:
        MetricsBindError: the port is in use, or ``bind`` is not an address of this machine.
    """
    from edgerl.launch import run_metrics

    def render() -> str:
        return robot_exposition(host.stats(), host.stream_stats())

    return run_metrics.serving(
        bind, port, "", render, lambda line: print(f"edgerl robot: {line}", flush=True)
    )


def _estopped(host: RobotHost) -> list[RobotLink]:
    """The robots of ``host`` whose e-stop is latched, in their order."""
    return [link for link in host.links if link.watchdog.estopped]


def reset_estops(host: RobotHost) -> str:
    """The operator's reset: clear the latched e-stop of every e-stopped robot of ``host`` (the
    others keep their actions and fallback streaks). Returns what was done, for the operator."""
    latched = _estopped(host)
    for link in latched:
        link.watchdog.reset()  # thread-safe; an e-stopped robot held after its episode is reset next tick
    if not latched:
        return "e-stop reset asked for: no robot is e-stopped"
    return f"e-stop reset of {len(latched)} robot(s): {', '.join(_label(link) for link in latched)}"


def announce_estops(host: RobotHost, announced: set[str]) -> set[str]:
    """Say which robots of ``host`` latched an e-stop since the robots of ``announced`` did, and
    how the operator resets them. Returns the robots e-stopped now: one that is reset is
    announced again if it latches again."""
    now = [_label(link) for link in _estopped(host)]
    newly = [label for label in now if label not in announced]
    if newly:
        hint = f"the latch holds; kill -USR1 {os.getpid()} resets it"
        print(f"edgerl robot: e-stopped: {', '.join(newly)} ({hint})", flush=True)
    return set(now)


def run(a: argparse.Namespace, security: ClientSecurity | None = None) -> int:
    stop, reset = threading.Event(), threading.Event()
    with contextlib.ExitStack() as handlers:
        # The reset signal is taken before the robots connect (a driver may take seconds): sent
        # meanwhile, its default action would end the command.
        handlers.enter_context(on_signals((RESET_SIGNAL,), lambda *_: reset.set()))
        robots = build_robots(a)
        handlers.enter_context(on_stop_signals(lambda *_: stop.set()))
        # Ctrl-C or SIGTERM ends the waits for the server at once: the robots then stop untouched.
        try:  # the server's shapes are checked before any robot is touched
            asked = a.deadline_ms is None or a.refill_at is None  # else no chunk is needed
            chunk = ask_server(a.server, security, RobotKind.of(robots), should_stop=stop.is_set, wait=asked)
        except errors.PolicyMismatchError as exc:
            for robot in robots:
                robot.close()
            print(f"edgerl robot: {exc}", file=sys.stderr, flush=True)
            return 1
        cfg = dataclasses.replace(runner_config(a, chunk), security=security)
        if chunk > 1:
            print(
                f"edgerl robot: the policy answers with chunks of {chunk} actions: deadline "
                f"{cfg.watchdog.deadline_s * 1e3:g} ms, refill at {cfg.refill_at}",
                flush=True,
            )
        recorder = (
            BagRecorder(a.record, [RobotTopics(r.name, r.joint_names, r.action_low.size) for r in robots])
            if a.record
            else None
        )
        host = RobotHost(robots, cfg, on_tick=recorder.record if recorder else None)
        metrics = contextlib.ExitStack()  # its GET /metrics, where asked
        try:  # before any robot runs: a port that is taken leaves them untouched
            metrics.enter_context(_serving_metrics(host, a.metrics_host or METRICS_HOST, a.metrics_port))
        except OSError as exc:  # a MetricsBindError, saying why
            for robot in robots:
                robot.close()
            if recorder is not None:
                recorder.close()
            print(f"edgerl robot: {exc}", file=sys.stderr, flush=True)
            return 1
        with contextlib.ExitStack() as stack:
            if recorder is not None:
                stack.callback(recorder.close)
            stack.enter_context(metrics)
            host.start(stop.is_set)
            stack.callback(host.stop)
            reset.clear()  # a reset asked for before any robot ran has nothing to reset
            t_end = time.monotonic() + a.seconds if a.seconds > 0 else float("inf")
            next_line = time.monotonic() + STATS_EVERY_S
            announced: set[str] = set()
            run_cpu = line_cpu = CpuMeter([os.getpid()])
            busy_said = False
            # A control loop that failed e-stops its robots and ends (control_error is set then):
            # stop at once (the robots are closed) rather than report a frozen host until the time is up.
            while not stop.is_set() and host.control_error is None and (now := time.monotonic()) < t_end:
                stop.wait(min(0.1, t_end - now))
                if host.control_error is None:
                    if reset.is_set():
                        reset.clear()
                        print(f"edgerl robot: {reset_estops(host)}", flush=True)
                    announced = announce_estops(host, announced)
                now = time.monotonic()
                if host.control_error is None and (now >= min(next_line, t_end) or stop.is_set()):
                    periodic, next_line = now >= next_line, now + STATS_EVERY_S  # and one at the end
                    cpu, line_cpu = line_cpu.cores()[0], CpuMeter([os.getpid()])
                    print(f"edgerl robot: {_line(_line_stats(host), host.stream_stats(), cpu)}", flush=True)
                    if periodic:  # the last line's span may be a moment, its share noise
                        busy = busy_line(cpu, len(robots), a.hz, a.network_process)
                        if busy is not None and not busy_said:  # once, until it is below again
                            print(f"edgerl robot: {busy}", file=sys.stderr, flush=True)
                        busy_said = busy is not None
            stream = host.stream_stats()  # as it was running: stopping the host closes the stream
            stream["cpu_cores"] = run_cpu.cores()[0]
        stats = host.stats()  # stopped: the counts hold every tick run (and recorded)
        if recorder is not None and recorder.error is None:
            print(f"edgerl robot: recorded {recorder.written} ticks in {a.record}", flush=True)
    print(jsonout.dumps({"robots": stats, "stream": stream}, indent=2))
    if a.json:
        jsonout.write_json({"robots": stats, "stream": stream}, a.json)
    if host.control_error is not None:
        # the loop's last ticks e-stopped them: each ramped to its stop action, within a bound
        left = [_label(link) for link in host.links if not link.watchdog.at_stop_action]
        fate = (
            f"{len(left)} of {len(host.links)} robot(s) did not reach their stop action ({', '.join(left)})"
            if left
            else "the robots were ramped to their stop action"
        )
        print(
            f"edgerl robot: the control loop stopped ({host.control_error!r}); {fate}, then closed",
            file=sys.stderr,
            flush=True,
        )
        return 1
    if recorder is not None and recorder.error is not None:
        later = f"; the {recorder.lost} ticks after it were not recorded" if recorder.lost else ""
        print(
            f"edgerl robot: the recording in {a.record} failed {recorder.failed_when}, after "
            f"{recorder.written} ticks ({errors.first_line(recorder.error)}){later}: the bag is incomplete",
            file=sys.stderr,
            flush=True,
        )
    stopped = [_label(link) for link in _estopped(host)]
    if stopped:  # latched: a script running the robots must not take this run for a good one
        print(
            f"edgerl robot: {len(stopped)} of {len(stats)} robot(s) ended e-stopped: {', '.join(stopped)}",
            file=sys.stderr,
            flush=True,
        )
        return ESTOPPED_STATUS
    return 0 if recorder is None or recorder.error is None else RECORDING_FAILED_STATUS
