"""``edgerl bench robot``: many MuJoCo robots behind watchdogs against one edge server.

First, unless ``baseline_s`` is 0, the robots of one process are stepped by a
plain sleep-until-due loop with no watchdog, no gRPC and no server: its tick
lateness is what the machine itself allows in that moment (a virtual machine
whose CPU is taken away now and then shows it here), measured in the same run
as the figures it qualifies. Then robot processes (each one control thread that
also serves the stream between slots, see ``edgerl.robot_client.runner``) drive
``robots`` real-time MuJoCo robots at ``hz``. After a warm-up the counters
are zeroed and the steady state is measured; then, unless ``kill_server_s``
is 0, the server is killed (SIGKILL) for that long and restarted on the same
port, and the report says whether every robot kept its rate, fell back,
e-stopped only past ``estop_after`` and resumed policy actions.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from edgerl.edge_server.server import ServerConfig
from edgerl.launch.machine import BUSY_CORES, CpuMeter, SpeedProbe, busy_text
from edgerl.launch.processes import (
    LLM_PRESET,
    OwnedProcess,
    PolicySpec,
    ServerProcess,
    configure_logging,
    kept_cpus,
    other_cpus,
    owned_by_parent,
)
from edgerl.proto.settings import check_finite
from edgerl.robot_client.netproc import RESTART_DELAY_S, hung_after
from edgerl.robot_client.runner import LinkFaults, RobotRunnerConfig, chunk_defaults
from edgerl.watchdog.watchdog import Fallback, WatchdogConfig

log = logging.getLogger(__name__)
_CTX = mp.get_context("spawn")


@dataclass(frozen=True)
class BenchRobotConfig:
    robots: int = 100
    """MuJoCo robots in all."""
    hz: float = 50.0
    """Control rate of every robot."""
    env: str = "HalfCheetah-v5"
    """Gymnasium MuJoCo task each robot simulates."""
    policy: str = "mlp"
    """Network preset served."""
    model: str = ""
    """Local model folder of the llm policy (empty: the small random Llama)."""
    dtype: str = "float32"
    """Engine dtype of the llm policy."""
    chunk: int = 1
    """Actions per policy answer (action chunks when > 1)."""
    refill_at: int | None = None
    """A robot asks for new actions when this many or fewer are left; None: as
    :func:`~edgerl.robot_client.runner.chunk_defaults` (1 without chunks, half a chunk with)."""
    deadline_ms: float | None = None
    """Latency budget of a policy action (ms); None: as
    :func:`~edgerl.robot_client.runner.chunk_defaults` (20 ms without chunks, a chunk's span with)."""
    fallback: Fallback = Fallback.HOLD
    estop_after: int = 150
    """Consecutive fallbacks that latch an e-stop (150 = 3 s at 50 Hz, longer than the outage)."""
    processes: int = 1
    """Robot processes; the robots are split evenly between them. One leaves the other core to
    the server: on two cores, two robot processes and the server ran the ticks later (p99
    ~2.5-3.6 ms against ~1.6 ms)."""
    robots_per_slot: int = 8
    """Robots ticked back to back in a process (see RobotRunnerConfig)."""
    realtime_priority: int = 0
    """SCHED_FIFO priority of the control threads (0: normal scheduling)."""
    network_process: bool | None = None
    """The robots' streams in network processes (RobotRunnerConfig.network_process); None: for
    the llm policy only. Its engine shares the two cores with the robots: with the streams on
    the control threads their ticks ran 1.3-2.7 ms late at p99 (5 runs), with network
    processes, which keep a core for the control threads (``control_cpu``), 0.7-1.5 ms (3 runs)."""
    control_cpu: str = "auto"
    """CPUs kept for the control threads, one per robot process ("1" or "2,3"): the server and
    the robots' network processes run on the others. "auto": with network processes, the last
    CPUs of the machine, one per robot process, if some are left over; else none. "off": none."""
    warmup_s: float = 3.0
    duration_s: float = 20.0
    """Steady-state measurement (seconds)."""
    baseline_s: float = 5.0
    """First step one process's robots in a plain loop (no watchdog, no gRPC) this long; 0: skip."""
    sync_loop_s: float = 5.0
    """Also run one robot in a synchronous loop (wait for each action) this long; 0: skip."""
    kill_server_s: float = 2.0
    """Outage phase: the server is killed for this long (0: no outage phase)."""
    recover_s: float = 4.0
    """How long the outage phase runs after the server is back (seconds)."""
    network_loss_s: float = 2.0
    """With network processes, last: each robot process's network process is killed (SIGKILL),
    and this long later the new one is stopped (SIGSTOP, taken for hung and replaced); each is
    watched for this long (seconds; 0: no network-loss phase)."""
    network_spare: bool = True
    """Keep a spare network process per robot process (RobotRunnerConfig.network_spare)."""
    delay_ms: float = 0.0
    """Injected extra latency per answer (ms)."""
    jitter_ms: float = 0.0
    """Injected random extra latency per answer, uniform in [0, jitter_ms] (ms)."""
    drop: float = 0.0
    """Injected probability that an answer is lost."""
    seed: int = 0
    torch_threads: int = 1
    max_delay_us: int = 500
    """Server batching delay (us)."""
    log_level: str = "ERROR"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_finite(self)
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        deadline_ms, refill_at = chunk_defaults(self.hz, self.chunk, self.deadline_ms, self.refill_at)
        object.__setattr__(self, "deadline_ms", deadline_ms)
        object.__setattr__(self, "refill_at", refill_at)
        network_process = self.policy == LLM_PRESET if self.network_process is None else self.network_process
        object.__setattr__(self, "network_process", network_process)
        if self.robots < 1 or not 1 <= self.processes <= self.robots:
            raise ValueError("need robots >= 1 and 1 <= processes <= robots")
        control_cpus(self.control_cpu, self.processes, network_process)  # fails naming the field
        if (
            self.duration_s <= 0
            or min(self.warmup_s, self.kill_server_s, self.baseline_s, self.network_loss_s) < 0
        ):
            raise ValueError(
                "need duration_s > 0, and warmup_s, kill_server_s, baseline_s and network_loss_s >= 0"
            )
        if 0 < self.network_loss_s < RESTART_DELAY_S:
            raise ValueError(
                f"network_loss_s must be 0 or >= {RESTART_DELAY_S:g} (a network process lost sooner after "
                f"its start is replaced only {RESTART_DELAY_S:g}s after it), got {self.network_loss_s:g}"
            )

    def server_cpus(self) -> frozenset[int] | None:
        """The CPUs of the server and the network processes (None: any)."""
        return other_cpus(control_cpus(self.control_cpu, self.processes, bool(self.network_process)))


def control_cpus(spec: str, processes: int, network_process: bool = True) -> list[int]:
    """The CPUs kept for the control threads (``BenchRobotConfig.control_cpu``); [] for none.

    "auto" keeps the last CPUs only with ``network_process`` (with the stream on the control
    thread, the host is one busy thread that takes whichever core is free).

    Raises:
        ValueError: ``spec`` is not "auto", "off" or CPU numbers, one per process, of this machine.
    """
    if spec == "auto" and not network_process:
        return []
    return kept_cpus(spec, processes, "control_cpu")


def _robot_main(cfg: BenchRobotConfig, server: str, first: int, count: int, conn: Any) -> None:
    owned_by_parent()  # stopped by its "stop" message
    configure_logging(cfg.log_level)
    from edgerl.robot_client.runner import RobotHost
    from edgerl.sim.robot import MujocoRobot

    robots = [
        MujocoRobot(cfg.env, hz=cfg.hz, seed=cfg.seed * 10_000 + first + i, name=f"robot-{first + i}")
        for i in range(count)
    ]
    assert cfg.deadline_ms is not None and cfg.refill_at is not None  # set in __post_init__
    run_cfg = RobotRunnerConfig(
        server,
        WatchdogConfig(
            hz=cfg.hz, deadline_s=cfg.deadline_ms / 1e3, fallback=cfg.fallback, estop_after=cfg.estop_after
        ),
        robots_per_slot=cfg.robots_per_slot,
        refill_at=cfg.refill_at,
        realtime_priority=cfg.realtime_priority,
        network_process=bool(cfg.network_process),
        network_cpus=tuple(sorted(cfg.server_cpus() or ())) if cfg.network_process else (),
        network_spare=cfg.network_spare,
        faults=LinkFaults(cfg.delay_ms, cfg.jitter_ms, cfg.drop, seed=cfg.seed + first),
        connect_timeout_s=60.0,
    )
    host = RobotHost(robots, run_cfg, session_id=f"bench-robots-{first}")
    host.start()
    conn.send(("ready", host.connected))
    marks: list[int] = [0] * count
    try:
        while True:
            try:
                cmd = conn.recv()
            except EOFError:  # the bench is gone (killed, say): stop the robots, with no one to tell
                return
            if cmd == "reset":
                for link in host.links:
                    link.reset_stats()
                conn.send("ok")
            elif cmd == "network_pid":
                conn.send(host.network_pid)
            elif cmd == "mark":
                marks = [link.watchdog.stats(percentiles=False).policy_ticks for link in host.links]
                conn.send("ok")
            elif cmd == "stats":
                # Counters first, for all robots at one moment; then copies of the raw samples.
                # Percentiles are left to the parent: for 100 robots they would hold the GIL
                # for tens of milliseconds while the control loop runs.
                out = [link.stats(percentiles=False) for link in host.links]
                for s, link, mark in zip(out, host.links, marks, strict=True):
                    s["policy_ticks_since_mark"] = s["policy_ticks"] - mark
                    s["jitter_s"] = link.watchdog.jitter_s()
                    s["latency_s"] = link.latencies_s.values()
                conn.send(
                    (out, host.reconnects, host.messages, host.control_error is None, host.network_restarts)
                )
            elif cmd in _LOSSES:  # answered with whether a process was hit, and the restarts before
                pid, restarts = host.network_pid, host.network_restarts
                if pid is not None:
                    os.kill(pid, _LOSSES[cmd])
                conn.send((pid is not None, restarts))
            elif cmd == "stop":
                break
    finally:
        host.stop()
        with contextlib.suppress(OSError):  # the bench may be gone
            conn.send("stopped")


def robot_bounds(cfg: BenchRobotConfig) -> list[int]:
    """Where each robot process's robots begin, and the end: process ``i`` runs robots
    ``bounds[i]`` to ``bounds[i + 1] - 1``."""
    return [cfg.robots * i // cfg.processes for i in range(cfg.processes + 1)]


class _Fleet:
    def __init__(self, cfg: BenchRobotConfig, server: str) -> None:
        self.procs: list[Any] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        for lo, hi in itertools.pairwise(robot_bounds(cfg)):
            parent, child = _CTX.Pipe()
            p = OwnedProcess(target=_robot_main, args=(cfg, server, lo, hi - lo, child), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(parent)

    def ask(self, cmd: str, timeout_s: float = 120.0) -> list[Any]:
        for c in self.conns:
            c.send(cmd)
        out = []
        for c in self.conns:
            if not c.poll(timeout_s):
                raise TimeoutError(f"robot process did not answer {cmd!r} within {timeout_s}s")
            out.append(c.recv())
        return out

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        for c in self.conns:
            if not c.poll(timeout_s):
                raise TimeoutError("robot processes did not start")
            _, connected = c.recv()
            if not connected:
                raise RuntimeError("a robot process could not connect to the edge server")

    def stop(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                c.send("stop")
        for p in self.procs:
            p.join(15.0)
            if p.is_alive():
                p.kill()


def _pct(values: np.ndarray, q: float, scale: float = 1e3) -> float:
    return float(np.percentile(values, q) * scale) if len(values) else math.nan


@dataclass
class _Collected:
    robots: list[dict[str, Any]] = field(default_factory=list)
    reconnects: int = 0
    messages: int = 0
    healthy: bool = True
    network_restarts: int = 0


def _collect(fleet: _Fleet) -> _Collected:
    c = _Collected()
    for out, reconnects, messages, healthy, restarts in fleet.ask("stats"):
        c.robots.extend(out)
        c.reconnects += reconnects
        c.messages += messages
        c.healthy &= healthy
        c.network_restarts += restarts
    return c


def _summary(robots: list[dict[str, Any]], seconds: float, hz: float) -> dict[str, Any]:
    ticks = sum(r["ticks"] for r in robots)
    fallbacks = sum(r["fallbacks"] for r in robots)
    jitter = np.concatenate([r["jitter_s"] for r in robots])
    latency = np.concatenate([r["latency_s"] for r in robots])
    rates = [r["ticks"] / seconds for r in robots]
    misses = sum(r["loop_deadline_misses"] for r in robots)
    return {
        "latency_ms_p50": _pct(latency, 50),
        "latency_ms_p99": _pct(latency, 99),
        "fallback_rate": fallbacks / ticks if ticks else math.nan,
        "tick_jitter_ms_p99": _pct(jitter, 99),
        "tick_jitter_ms_p50": _pct(jitter, 50),
        "tick_rate_hz_min": min(rates),
        "tick_rate_hz_median": float(np.median(rates)),
        "ticks": ticks,
        "fallbacks": fallbacks,
        "late_actions": sum(r["late_actions"] for r in robots),
        "loop_deadline_misses": misses,
        # of the control periods due (ticks run + ticks skipped), those that applied a fresh
        # policy action: a fallback and a skipped tick both leave a robot without one
        "fresh_action_rate": (ticks - fallbacks) / (ticks + misses) if ticks else math.nan,
        "estops": sum(r["estops"] for r in robots),
        "dropped_injected": sum(r["dropped"] for r in robots),
        "seconds": seconds,
    }


def _cpu_cores(cores: list[float | None], robot_processes: int) -> dict[str, Any]:
    """``CpuMeter.cores`` of the server, the robot processes and their network processes (in that
    order), as the report's ``cpu_cores``."""
    return {
        "server": cores[0],
        "robot_processes": cores[1 : 1 + robot_processes],
        "network_processes": cores[1 + robot_processes :],
    }


def busy_robot_processes(cores: list[float | None], cfg: BenchRobotConfig) -> list[str]:
    """A line for each robot process that used :data:`BUSY_CORES` of a core or more: one that
    runs behind on every slot answers late, and its robots fall back for it, whatever the
    server does."""
    bounds = robot_bounds(cfg)
    return [
        busy_text(f"robot process {i}", c, hi - lo, cfg.hz, "give fewer robots to each process: --processes")
        for i, (c, (lo, hi)) in enumerate(zip(cores, itertools.pairwise(bounds), strict=True))
        if c is not None and c >= BUSY_CORES
    ]


def run_bench_robot(cfg: BenchRobotConfig, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-ready report."""
    configure_logging(cfg.log_level)
    probe = SpeedProbe.start(progress)
    baseline = None
    if cfg.baseline_s > 0:
        progress(f"baseline: {cfg.robots // cfg.processes} robots in a plain loop for {cfg.baseline_s:g}s")
        baseline = baseline_loop(cfg)
    policy = PolicySpec.from_options(cfg, chunk=cfg.chunk)
    server_cpus = cfg.server_cpus()
    server = ServerProcess(
        policy, ServerConfig(port=0, max_delay_us=cfg.max_delay_us), log_level=cfg.log_level, cpus=server_cpus
    )
    address = server.start()
    fleet = _Fleet(cfg, address)
    spare = ServerProcess(server.policy, server.config, log_level=cfg.log_level, cpus=server_cpus)
    try:
        progress(f"starting {cfg.robots} robots in {cfg.processes} processes against {address}")
        fleet.wait_ready()
        time.sleep(cfg.warmup_s)
        fleet.ask("reset")
        progress(f"measuring {cfg.duration_s:.0f}s at {cfg.hz:g} Hz")
        network_pids = [pid for pid in fleet.ask("network_pid") if pid is not None]
        robot_pids = [p.pid for p in fleet.procs]
        assert server.pid is not None  # started above
        meter = CpuMeter([server.pid, *robot_pids, *network_pids])
        t0 = time.monotonic()
        time.sleep(cfg.duration_s)
        got = _collect(fleet)
        steady = _summary(got.robots, time.monotonic() - t0, cfg.hz)
        steady.update(reconnects=got.reconnects, messages_per_s=got.messages / max(1e-9, steady["seconds"]))
        steady["cpu_cores"] = _cpu_cores(meter.cores(), len(robot_pids))
        for line in busy_robot_processes(steady["cpu_cores"]["robot_processes"], cfg):
            progress(line)
        report: dict[str, Any] = {
            "bench": "robot",
            "config": asdict(cfg),
            **{
                k: steady[k]
                for k in ("latency_ms_p50", "latency_ms_p99", "fallback_rate", "tick_jitter_ms_p99")
            },
            "steady": steady,
            "control_loops_healthy": got.healthy,
        }
        if baseline is not None:
            report["baseline_loop"] = baseline
        if cfg.sync_loop_s > 0:
            progress(f"a synchronous control loop with the same policy for {cfg.sync_loop_s:g}s")
            report["sync_loop"] = sync_loop(cfg, address)
        if cfg.kill_server_s > 0:
            spare.port = server.port
            report["outage"] = _outage(cfg, server, spare, fleet, progress)
        if cfg.network_process and cfg.network_loss_s > 0:
            report["network_loss"] = _network_loss(cfg, fleet, progress)
    finally:
        fleet.stop()
        server.stop()
        spare.stop()
    report["machine"] = probe.machine()
    return report


def baseline_loop(cfg: BenchRobotConfig) -> dict[str, Any]:
    """One process's robots stepped at ``hz`` by a plain loop: no watchdog, no gRPC, no server.

    The robots are ticked in the same slots as in a robot process (``robots_per_slot``
    back to back, the slots spread over the period), each with its safe action; a
    tick's lateness is the time from its due time to the start of its step, as the
    watchdog counts it. The machine's own stalls show up here.
    """
    from edgerl.sim.robot import MujocoRobot
    from edgerl.watchdog.loop import slot_count, slot_index

    count = cfg.robots // cfg.processes
    robots = [MujocoRobot(cfg.env, hz=cfg.hz, seed=cfg.seed + i, name=f"baseline-{i}") for i in range(count)]
    slots: list[list[Any]] = [[] for _ in range(slot_count(count, cfg.robots_per_slot))]
    for i, robot in enumerate(robots):
        slots[slot_index(i, count, len(slots))].append((robot, robot.safe_action()))
    period = 1.0 / cfg.hz
    late: list[float] = []
    try:
        start = time.monotonic() + period
        k = 0
        while (due := start + k * period / len(slots)) < start + cfg.baseline_s:
            while (left := due - time.monotonic()) > 0:
                time.sleep(left)
            for robot, action in slots[k % len(slots)]:
                late.append(time.monotonic() - due)
                robot.apply(action)
                reading = robot.read()
                if reading.terminated or reading.truncated:
                    robot.reset()
            k += 1
    finally:
        for r in robots:
            r.close()
    jitter = np.asarray(late)
    return {
        "robots": count,
        "tick_jitter_ms_p50": _pct(jitter, 50),
        "tick_jitter_ms_p99": _pct(jitter, 99),
        "tick_jitter_ms_max": float(jitter.max() * 1e3) if len(jitter) else math.nan,
        "ticks": len(jitter),
        "seconds": cfg.baseline_s,
    }


def sync_loop(cfg: BenchRobotConfig, address: str) -> dict[str, Any]:
    """One robot whose loop waits for the policy every tick: the control rate it really gets.

    The robot applies the first action of each answer, then reads and asks again at once
    (no fixed rate, no watchdog): the design the watchdog replaces, for comparison.
    """
    import asyncio

    from edgerl.robot_client.client import EdgeClient
    from edgerl.sim.robot import MujocoRobot

    robot = MujocoRobot(cfg.env, hz=cfg.hz, seed=cfg.seed, name="sync-robot")

    async def main() -> tuple[int, float, list[float]]:
        latencies: list[float] = []
        async with EdgeClient(address, timeout_s=30.0) as client:
            t_end = time.monotonic() + cfg.sync_loop_s
            t0, ticks = time.monotonic(), 0
            while time.monotonic() < t_end:
                t = time.monotonic()
                answer = await client.act(robot.read().obs[None])
                latencies.append(time.monotonic() - t)
                action = answer.actions[0].reshape(-1, robot.action_low.size)[0]
                robot.apply(np.clip(action, robot.action_low, robot.action_high))
                reading = robot.read()
                if reading.terminated or reading.truncated:
                    robot.reset()
                ticks += 1
            return ticks, time.monotonic() - t0, latencies

    try:
        ticks, seconds, latencies = asyncio.run(main())
    finally:
        robot.close()
    lat = np.asarray(latencies)
    return {
        "control_hz": ticks / seconds,
        "target_hz": cfg.hz,
        "policy_call_ms_p50": _pct(lat, 50),
        "policy_call_ms_p99": _pct(lat, 99),
        "seconds": seconds,
    }


def _outage(
    cfg: BenchRobotConfig,
    server: ServerProcess,
    spare: ServerProcess,
    fleet: _Fleet,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    spare.start(standby=True)  # the replacement, built and warm, not yet bound
    fleet.ask("reset")
    t0 = time.monotonic()
    time.sleep(1.0)
    progress(f"killing the edge server for {cfg.kill_server_s:g}s")
    server.kill()
    t_kill = time.monotonic()
    time.sleep(cfg.kill_server_s)
    spare.activate()
    killed_for = time.monotonic() - t_kill
    fleet.ask("mark")
    progress(f"server back on {spare.address}; watching recovery for {cfg.recover_s:g}s")
    time.sleep(cfg.recover_s)
    got = _collect(fleet)
    robots, seconds = got.robots, time.monotonic() - t0
    summary = _summary(robots, seconds, cfg.hz)
    outage_ticks = killed_for * cfg.hz
    return {
        "killed_for_s": killed_for,
        "estop_after_ticks": cfg.estop_after,
        "outage_ticks": outage_ticks,
        "robots_kept_rate": sum(r["ticks"] >= 0.98 * seconds * cfg.hz for r in robots),
        "robots_fell_back": sum(r["fallbacks"] > 0 for r in robots),
        "robots_estopped": sum(r["estops"] > 0 for r in robots),
        "robots_estopped_below_n": sum(
            r["estops"] > 0 and r["max_consecutive_fallbacks"] < cfg.estop_after for r in robots
        ),
        "max_consecutive_fallbacks": max(r["max_consecutive_fallbacks"] for r in robots),
        "robots_resumed": sum(r["policy_ticks_since_mark"] > 0 and not r["estopped"] for r in robots),
        "robots": len(robots),
        "reconnects": got.reconnects,
        "control_loops_healthy": got.healthy,
        **{k: summary[k] for k in ("tick_rate_hz_min", "tick_jitter_ms_p99", "fallback_rate", "ticks")},
    }


_LOSSES = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}
"""The network-loss phase's commands to a robot process: what its network process is sent."""


def _network_loss(cfg: BenchRobotConfig, fleet: _Fleet, progress: Callable[[str], None]) -> dict[str, Any]:
    """Each robot process's network process is killed, then (the new one) stopped: how long its
    robots fell back, and whether any e-stopped (``max_fell_back_s``: the longest run of fallbacks
    of any robot, in seconds at ``hz``; ``hung_after_s``: the silence after which a robot process
    takes its network process for hung)."""
    report: dict[str, Any] = {
        "network_spare": cfg.network_spare,
        "hung_after_s": hung_after(cfg.hz, cfg.estop_after),
    }
    for cmd in _LOSSES:
        fleet.ask("reset")
        progress(f"network processes: {cmd.upper()}, watched for {cfg.network_loss_s:g}s")
        hits = fleet.ask(cmd)
        sent, before = sum(hit for hit, _ in hits), sum(restarts for _, restarts in hits)
        time.sleep(cfg.network_loss_s)
        got = _collect(fleet)
        worst = max(r["max_consecutive_fallbacks"] for r in got.robots)
        report[cmd] = {
            "processes_hit": sent,
            "network_restarts": got.network_restarts - before,
            "max_consecutive_fallbacks": worst,
            "max_fell_back_s": worst / cfg.hz,
            "robots_fell_back": sum(r["fallbacks"] > 0 for r in got.robots),
            "robots_estopped": sum(r["estops"] > 0 for r in got.robots),
            "robots": len(got.robots),
            "control_loops_healthy": got.healthy,
        }
    return report
