"""``edgerl bench throughput``: three designs side by side, same env, policy and env count.

- ``sync_inprocess``: one vector env + a batched forward pass in one process, no RPC.
- ``sync_unary``: one unary RPC per env per step, waiting for each answer (the naive design).
- ``async_stream``: the edge server + double-buffered streaming sim workers (gRPC).
- ``async_local``: the same over the server's local Act socket instead of gRPC
  (:mod:`edgerl.edge_server.local`), as sim workers on the server's machine may run.

Modes run one after another, ``--repeats`` times interleaved; the JSON gives
each mode's median env steps/s, every run, and the ratios of the medians.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from edgerl.edge_server.batcher import STATS_WINDOW
from edgerl.edge_server.server import ServerConfig
from edgerl.launch.machine import CpuMeter, SpeedProbe, descendants
from edgerl.launch.processes import (
    LLM_PRESET,
    LOCAL_SOCKET_NAME,
    PolicySpec,
    ServerProcess,
    WorkerFleet,
    build_backend,
    check_fleet,
    kept_cpus,
    local_socket_folder,
    other_cpus,
    server_stats,
)
from edgerl.proto.settings import check_finite
from edgerl.robot_client.sim_worker import SimWorkerConfig

MODES = ("sync_inprocess", "sync_unary", "async_stream", "async_local")
STREAM_MODES = ("async_stream", "async_local")


@dataclass(frozen=True)
class ThroughputConfig:
    """Settings of one throughput benchmark."""

    env: str = "HalfCheetah-v5"
    """Gymnasium id."""
    envs: int = 64
    """Envs in every mode."""
    seconds: float = 10.0
    """Measured time per mode and repeat, after warm-up (seconds)."""
    warmup_s: float = 2.0
    """Unmeasured time before each measurement (seconds)."""
    policy: str = "mlp"
    """Policy preset: mlp, mlp-large, mlp-small or llm."""
    model: str = ""
    """Local model folder of the llm policy (empty: the small random Llama)."""
    workers: int = 1
    """Sim worker processes in async_stream."""
    groups: int = 0
    """Env groups per worker in async_stream (2 = double-buffered); 0: for the llm policy one per
    server replica, else 2.

    The language model's forward pass costs ~12x a step of the envs, so one engine has little to
    overlap, and one batch of 64 prompts costs less than two of 32 even with the engine batching
    continuously (a group that leaves the engine to step its envs costs it a step with half the
    sequences): against one engine, one group ran at 1,395 env steps/s and two at 1,371 (medians
    of 2 alternated runs). With a replica per group the groups' batches run side by side."""
    repeats: int = 1
    """Interleaved repeats of all modes; medians are reported."""
    max_delay_us: int = 1000
    """Edge server batching delay (microseconds)."""
    torch_threads: int = 1
    """Torch threads for inference, in-process and in the server alike."""
    dtype: str = "float32"
    """Engine dtype of the llm policy, in-process and in the server alike."""
    seed: int = 0
    """Seed of envs and weights."""
    network_process: bool | None = None
    """Each sim worker of async_stream runs its Act stream in a network process of its own (not
    async_local's, which have no gRPC stream); None: chosen with ``worker_cpus`` by
    :func:`choose_placement`, or by trial (:func:`stream_candidates`)."""
    worker_cpus: str | None = None
    """CPUs of the async_stream sim workers, one each ("auto": the last CPUs, if some are left for
    the server and the network processes, which then run on the others; "off": no pinning);
    None: chosen with ``network_process`` by :func:`choose_placement`."""
    replicas: int = 0
    """Policy replicas in the async_stream server, each in a process of its own; 0: chosen by
    :func:`choose_placement`. The in-process loop always has one."""
    backfill_envs: int | None = None
    """Of the envs of async_stream and async_local, those stepped by a backfill worker (idle CPU
    priority, on the server's CPUs); None: chosen by :func:`choose_placement`, and for
    async_stream by trial where ``network_process`` is None too (:func:`stream_candidates`)."""

    def __post_init__(self) -> None:
        check_finite(self)
        if self.envs < 1 or self.seconds <= 0 or self.repeats < 1 or self.warmup_s < 0:
            raise ValueError("need envs >= 1, seconds > 0, repeats >= 1, warmup_s >= 0")
        if self.groups < 0:
            raise ValueError(f"groups must be >= 0 (0: by policy), got {self.groups}")
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0 (0: chosen), got {self.replicas}")
        by_policy = self.replicas if self.policy == LLM_PRESET else 2  # 0: open until the replicas are
        if self.groups == 0 and by_policy:
            object.__setattr__(self, "groups", by_policy)
        if self.groups:  # else checked once the replicas, and with them the groups, are chosen
            check_fleet(
                self.envs,
                self.workers,
                self.groups,
                max_envs_per_stream=ServerConfig.max_envs_per_stream,
                backfill_envs=self.backfill_envs or 0,
            )
        if self.worker_cpus is not None:
            kept_cpus(self.worker_cpus, self.workers, "worker_cpus")  # fails naming the field

    def placement(self) -> tuple[list[int], frozenset[int] | None]:
        """The sim workers' CPUs (one each; [] for any) and those of the server and the network
        processes (None: any)."""
        workers = kept_cpus(self.worker_cpus or "off", self.workers, "worker_cpus")
        return workers, other_cpus(workers)

    def placed(self, env_s: float, inference_s: float, cpus: int) -> ThroughputConfig:
        """This config with the :class:`Placement` :func:`choose_placement` gives for these costs
        and ``cpus`` CPUs for inference, where ``worker_cpus``, ``network_process``, ``replicas``
        or ``backfill_envs`` is left open (and ``groups``, which follows ``replicas`` for the llm
        policy). A backfill worker needs CPUs the sim workers leave and envs enough to leave each
        worker ``groups`` of them; without one the placement's fallback holds."""
        chosen = choose_placement(env_s, inference_s, cpus)
        placed = replace(
            self,
            worker_cpus=chosen.worker_cpus if self.worker_cpus is None else self.worker_cpus,
            replicas=self.replicas or chosen.replicas,
        )
        backfill = self.backfill_envs
        if backfill is None:
            backfill = int(self.envs * chosen.backfill_share) if placed.placement()[1] else 0
            if self.envs - backfill < self.workers * (placed.groups or 2):
                backfill = 0
        if self.network_process is None:
            placed = replace(placed, network_process=chosen.stream_leaves_worker(backfill))
        return replace(placed, backfill_envs=backfill)


@dataclass(frozen=True)
class Placement:
    """Where async_stream's sim workers and their streams run, and what serves them."""

    worker_cpus: str
    """The sim workers' CPUs (``ThroughputConfig.worker_cpus``)."""
    replicas: int
    """Policy replicas in the server."""
    backfill_share: float = 0.0
    """Share of the envs for a backfill worker (0: none)."""
    network_process: bool = False
    """Each worker's stream in a network process, where no backfill worker runs. A backfill
    worker takes the server's idle CPU time, the time a network process would use: beside one
    the workers keep their streams (a worker that kept its stream ran 1.02-1.43x, 4 ABBA rounds,
    median 1.18x, the env steps/s of one whose stream ran in a network process)."""

    def stream_leaves_worker(self, backfill_envs: int) -> bool:
        """Whether each worker's stream runs in a network process, beside ``backfill_envs``."""
        return self.network_process and not backfill_envs


NETWORK_PROCESS_BELOW = 0.25
"""Inference cheaper than this share of env stepping: the sim worker's core is the bottleneck."""
REPLICAS_ABOVE = 3.0
"""Inference costlier than this multiple of env stepping: a policy replica per CPU. Well above the
``mlp-large`` preset, whose cost is about that of env stepping (0.92-0.94 of it: see
:data:`edgerl.models.presets.POLICY_PRESETS`) and in some noisy first runs came out above it: those
chose two replicas on the two CPUs and ran at 0.82x the in-process loop (0.81x with
``--replicas 2 --worker-cpus off`` given); well below the ``llm`` policy's ~12x."""
BACKFILL_SHARE = 0.375
"""Share of the envs :func:`choose_placement` gives a backfill worker where the workers' cores are
the bottleneck. With 64 HalfCheetah envs and ``mlp`` (the slower machine, 6 s runs in ABBA
order), a backfill worker of 16 envs ran at 1.09x (median 1.10x of 6) the env steps/s of one
worker of all 64, one of 24 at 1.05-1.14x that of 16 (3), one of 32 at 0.87-0.95x that of 24
(3): the backfill worker's messages cost the server's core too."""
MAX_CHOSEN_REPLICAS = 4
"""Most policy replicas :func:`choose_placement` chooses (each holds a whole engine)."""


def choose_placement(env_s: float, inference_s: float, cpus: int) -> Placement:
    """Where async_stream's sim workers and their streams run, how many policy replicas serve
    them and what share of the envs a backfill worker steps, given the time the in-process loop
    spent stepping the envs and in inference, and the CPUs inference may use (1 where it runs on
    a GPU).

    Measured side by side on the reference 2-core machine (64 HalfCheetah envs, medians of 3):
    - inference under a quarter of env stepping (``mlp``: 0.09) leaves the worker's core the
      bottleneck, its gRPC client included, and the server's core idle a third of the time: a
      backfill worker (:data:`BACKFILL_SHARE` of the envs) steps envs in that time, and the
      worker keeps a CPU of its own. Without a backfill worker, a network process takes the
      stream off the worker (1.016x the in-process loop, against 0.85x unplaced and 0.79x with
      the CPU alone);
    - inference about as costly as env stepping (``mlp-large``: 0.88-0.98 when measured) makes
      the server's core the busier one, which a network process would share: the worker keeps a
      CPU of its own (1.32x, against 1.27x unplaced and 0.98x with a network process too);
    - inference far costlier than env stepping (``llm``: ~12x) needs every CPU for the engine, and
      one engine steps on one core: a replica per CPU (up to :data:`MAX_CHOSEN_REPLICAS`), one
      env group each, nothing pinned, the stream in the worker (1.31x the in-process loop in two
      runs, 2,096 and 2,086 env steps/s against 1,601 and 1,595, where one engine gave 0.94x,
      1,478 against 1,579).
    """
    if inference_s > REPLICAS_ABOVE * env_s:
        return Placement("off", max(1, min(cpus, MAX_CHOSEN_REPLICAS)))
    if inference_s < NETWORK_PROCESS_BELOW * env_s:
        return Placement("auto", 1, BACKFILL_SHARE, network_process=True)
    return Placement("auto", 1)


TRIAL_S = 2.0
"""Measured seconds of each trial run of a placement that async_stream tries (:func:`try_placements`;
``seconds`` where shorter)."""
TRIAL_WARMUP_S = 1.0
"""Unmeasured seconds before each trial run (``warmup_s`` where shorter)."""


PLACING_S = 2.0
"""Measured seconds of the in-process run by which ``edgerl rollout --place`` chooses its placement."""
PLACING_WARMUP_S = 1.0
"""Unmeasured seconds before it."""


def stream_candidates(
    given: ThroughputConfig, env_s: float, inference_s: float, cpus: int
) -> list[ThroughputConfig]:
    """The placements of async_stream that :func:`run` tries before its runs, each ``given``
    placed by :meth:`ThroughputConfig.placed` for these costs: the one it chooses first; one
    alone where there is nothing to try.

    Where the workers' cores are the bottleneck, two placements take work off them, and which
    gains more over gRPC depends on the machine: a backfill worker on the server's idle time
    (the workers keep their streams), or the streams in network processes (no backfill worker:
    beside one, a network process loses). On the reference 2-core machine the first gave ``mlp``
    1.0-1.06x the in-process loop; on a 2-core Intel Xeon machine (2026-12-07, 6 s runs in ABBA
    order) 0.88-0.89x against 1.00-1.03x for the second. Where ``given`` leaves both open and
    the rule chose a backfill worker, both are tried: the second is ``given`` placed without one.
    async_local keeps the first: its workers have no gRPC stream to move, and there the backfill
    worker gained (1.26x against 0.95x)."""
    placed = given.placed(env_s, inference_s, cpus)
    if given.network_process is None and given.backfill_envs is None and placed.backfill_envs:
        return [placed, replace(given, backfill_envs=0).placed(env_s, inference_s, cpus)]
    return [placed]


def placement_of(cfg: ThroughputConfig, local: bool = False) -> dict[str, Any]:
    """Where ``cfg`` runs async_stream's workers (async_local's with ``local``)."""
    return {
        "worker_cpus": cfg.worker_cpus,
        "network_process": bool(cfg.network_process) and not local,
        "backfill_envs": cfg.backfill_envs or 0,
    }


def describe_placement(cfg: ThroughputConfig) -> str:
    """``cfg``'s placement of async_stream's workers, in words."""
    stream = "in a network process" if cfg.network_process else "in the worker"
    return f"sim worker CPUs {cfg.worker_cpus}, stream {stream}, {cfg.backfill_envs or 0} backfill env(s)"


def try_placements(
    candidates: list[ThroughputConfig],
    measure: Callable[[ThroughputConfig], float],
    progress: Callable[[str], None] = lambda s: None,
    what: str = "async_stream",
) -> tuple[ThroughputConfig, list[dict[str, Any]]]:
    """The candidate under which ``measure`` (async_stream's env steps/s under a config: see
    :func:`run`) gave the most, with each candidate's placement and runs (none where there was one
    candidate: not run). Each is run twice in ABBA order for :data:`TRIAL_S` after
    :data:`TRIAL_WARMUP_S`, and, where the runs of the best overlap another's (the machine's
    speed moved more than the placements differ), twice more in BAAB order; the highest median
    wins, the first on a tie. One outlying run then no longer decides: on a machine at a third of
    its speed the backfill worker's runs were 14,261 and 10,683 env steps/s against the network
    process's 10,895 and 10,718, and the first decided. ``progress`` is told of each run, as a
    run of ``what``."""
    if len(candidates) < 2:
        return candidates[0], []
    order = list(range(len(candidates)))
    rates: list[list[float]] = [[] for _ in candidates]

    def run(i: int) -> None:
        c = candidates[i]
        progress(f"  trying {what}: {describe_placement(c)}")
        trial = replace(c, seconds=min(c.seconds, TRIAL_S), warmup_s=min(c.warmup_s, TRIAL_WARMUP_S))
        rates[i].append(measure(trial))
        progress(f"    {rates[i][-1]:,.0f} env steps/s")

    for i in order + order[::-1]:
        run(i)
    if not _clear_winner(rates):
        for i in order[::-1] + order:
            run(i)
    best = max(order, key=lambda i: statistics.median(rates[i]))  # the first on a tie
    tried = [
        {**placement_of(c), "env_steps_per_s": [round(x, 1) for x in r]}
        for c, r in zip(candidates, rates, strict=True)
    ]
    return candidates[best], tried


def _clear_winner(rates: list[list[float]]) -> bool:
    """Whether the slowest run of the candidate with the highest median beat every run of the
    others."""
    best = max(range(len(rates)), key=lambda i: statistics.median(rates[i]))
    return all(min(rates[best]) > max(r) for i, r in enumerate(rates) if i != best)


def inference_cpus() -> int:
    """CPUs that inference may use: this process's, or 1 where torch has a GPU."""
    import torch

    return 1 if torch.cuda.is_available() else len(os.sched_getaffinity(0))


def _timed(step: Callable[[], int], warmup_s: float, seconds: float) -> float:
    """Env steps/s of repeated ``step()`` calls (each returns steps taken)."""
    end_warm = time.perf_counter() + warmup_s
    while time.perf_counter() < end_warm:
        step()
    steps, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        steps += step()
    return steps / elapsed


def overlap_bound(env_s: float, inference_s: float) -> float:
    """(env + inference) / max(env, inference): the speed-up a perfect overlap of the two could give
    (with one inference engine: replicas running batches side by side add to it)."""
    return (env_s + inference_s) / max(env_s, inference_s, 1e-12)


def run_sync_inprocess(cfg: ThroughputConfig) -> tuple[float, float, float]:
    """Env steps/s of the in-process loop, and the seconds it spent stepping the envs and in inference."""
    from edgerl.sim.envs import make_vector_env

    backend, spec = build_backend(PolicySpec.from_options(cfg))
    envs, obs = make_vector_env(cfg.env, cfg.envs, cfg.seed)
    state = {"obs": obs}
    spent = {"env": 0.0, "inference": 0.0}

    def step() -> int:
        t0 = time.perf_counter()
        actions = np.clip(backend.infer(state["obs"]).actions, spec.act_low, spec.act_high)
        t1 = time.perf_counter()
        state["obs"] = envs.step(actions)[0]
        spent["inference"] += t1 - t0
        spent["env"] += time.perf_counter() - t1
        return cfg.envs

    try:
        sps = _timed(step, cfg.warmup_s, cfg.seconds)
    finally:
        envs.close()
        backend.close()
    return sps, spent["env"], spent["inference"]


def run_sync_unary(cfg: ThroughputConfig, address: str) -> float:
    from edgerl.robot_client.client import EdgeClient
    from edgerl.sim.envs import make_env

    envs = [make_env(cfg.env) for _ in range(cfg.envs)]
    obs = [np.asarray(e.reset(seed=cfg.seed + i)[0], np.float32) for i, e in enumerate(envs)]

    async def main() -> float:
        async with EdgeClient(address) as client:
            info = await client.describe()

            async def step() -> int:
                for i, env in enumerate(envs):
                    res = await client.act(obs[i][None])
                    o, _, term, trunc, _ = env.step(np.clip(res.actions[0], info.act_low, info.act_high))
                    obs[i] = np.asarray(env.reset()[0] if term or trunc else o, np.float32)
                return cfg.envs

            t_warm = time.perf_counter() + cfg.warmup_s
            while time.perf_counter() < t_warm:
                await step()
            steps, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < cfg.seconds:
                steps += await step()
            return steps / elapsed

    try:
        return float(asyncio.run(main()))
    finally:
        for e in envs:
            e.close()


CPU_ROLES = ("server", "sim_workers", "network_processes", "backfill_worker")
"""The processes of a streaming mode whose CPU :class:`ModeCpu` sums, each role over its processes."""


@dataclass
class ModeCpu:
    """The CPU time each role's processes (:data:`CPU_ROLES`) used over a streaming mode's
    measured runs, warm-ups left out, and those runs' seconds: :meth:`cores` tells which core was
    full (with ``mlp-large`` the server's, with ``mlp`` the sim worker's)."""

    server_pid: int
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds by role, where its processes could be measured (``/proc``)."""
    seconds: float = 0.0
    _run: tuple[CpuMeter, list[str]] | None = field(default=None, init=False, repr=False)
    """The running run's meter and each of its processes' role."""

    def start(self, fleet: WorkerFleet, workers: int) -> None:
        """A run starts: meter the server and ``fleet``'s processes (its ``workers`` sim workers,
        their network processes, then a backfill worker if it has one)."""
        sims, backfill = fleet.pids[:workers], fleet.pids[workers:]
        nets = descendants(sims)  # their network processes, where they have them
        roles = ["server"] + ["sim_workers"] * len(sims) + ["network_processes"] * len(nets)
        roles += ["backfill_worker"] * len(backfill)
        self._run = CpuMeter([self.server_pid, *sims, *nets, *backfill]), roles

    def stop(self, seconds: float) -> None:
        """The run started last ended, measured over ``seconds``: add what its processes used."""
        assert self._run is not None, "stop() without start()"
        meter, roles = self._run
        self._run = None
        self.add(meter.cores(), roles, seconds)

    def add(self, cores: list[float | None], roles: list[str], seconds: float) -> None:
        """One run's :meth:`CpuMeter.cores` of the processes of ``roles``, over ``seconds``."""
        self.seconds += seconds
        for role in CPU_ROLES:
            got = [c for c, r in zip(cores, roles, strict=True) if r == role]
            measured = [c for c in got if c is not None]
            if got and len(measured) == len(got):
                self.cpu_s[role] = self.cpu_s.get(role, 0.0) + sum(measured) * seconds

    def cores(self) -> dict[str, float | None]:
        """Each role's share of a core over the runs (1.0: one whole core; summed over its
        processes); None for a role with no process, or one that could not be measured."""
        return {r: round(self.cpu_s[r] / self.seconds, 3) if r in self.cpu_s else None for r in CPU_ROLES}


def run_async_stream(
    cfg: ThroughputConfig, address: str, local_socket: str = "", cpu: ModeCpu | None = None
) -> float:
    """Env steps/s of the sim workers streaming to the server at ``address`` (gRPC), or over
    its ``local_socket``; with ``cpu``, what the server and the workers used is added to it."""
    worker_cpus, others = cfg.placement()
    network_process = bool(cfg.network_process) and not local_socket
    fleet = WorkerFleet(
        SimWorkerConfig(
            server=address,
            env_name=cfg.env,
            num_envs=cfg.envs,
            groups=cfg.groups,
            seed=cfg.seed,
            session_id="bench",
            network_process=network_process,
            network_cpus=tuple(sorted(others or ())) if network_process else (),
            local_socket=local_socket,
        ),
        cfg.workers,
        worker_cpus=worker_cpus,
        backfill_envs=cfg.backfill_envs or 0,
    )
    with fleet:
        fleet.wait_started()
        time.sleep(cfg.warmup_s)
        if cpu is not None:
            cpu.start(fleet, cfg.workers)
        s0, t0 = fleet.total_steps(), time.perf_counter()
        time.sleep(cfg.seconds)
        s1, t1 = fleet.total_steps(), time.perf_counter()
        if cpu is not None:
            cpu.stop(t1 - t0)
        fleet.check()
    return float(s1 - s0) / (t1 - t0)


#: The server's counters that :func:`mode_stats` takes per mode: what its runs added to them.
MODE_COUNTERS = (
    "requests",
    "batches",
    "rows",
    "rejected_queue_full",
    "rejected_invalid",
    "rejected_streams",
    "failed_requests",
    "queue_wait_us_sum",
    "inference_us_sum",
)
#: The server's percentiles, each with the counter of the samples it is taken over.
MODE_PERCENTILES = {
    "queue_wait_us_p50": "requests",
    "queue_wait_us_p99": "requests",
    "inference_us_p50": "batches",
    "inference_us_p99": "batches",
}


def mode_stats(acc: dict[str, Any] | None, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The server's ``Stats`` for one mode: ``acc`` (its earlier runs, or None) plus what one run
    (warm-up included) added to the counters. The server is shared by every mode: its own totals
    since start would count the other modes' requests too, and its largest batch may be theirs.

    A percentile is the server's after the run where that run alone filled the server's window
    (its last :data:`STATS_WINDOW` requests or batches), else None: the window then holds
    other modes' samples too (a unary run before it leaves thousands of 1-row batches)."""
    run = {k: after[k] - before[k] for k in MODE_COUNTERS}
    counters = {k: run[k] + (acc[k] if acc else 0) for k in MODE_COUNTERS}
    percentiles = {k: after[k] if run[of] >= STATS_WINDOW else None for k, of in MODE_PERCENTILES.items()}
    return {
        **counters,
        "mean_batch_rows": round(counters["rows"] / max(1, counters["batches"]), 1),
        # the means need no window: over every request and batch of the mode's runs
        "queue_wait_us_mean": round(counters["queue_wait_us_sum"] / max(1, counters["requests"]), 1),
        "inference_us_mean": round(counters["inference_us_sum"] / max(1, counters["batches"]), 1),
        **percentiles,
        "policy_version": after["policy_version"],
    }


def run(cfg: ThroughputConfig, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run every mode ``cfg.repeats`` times; returns the JSON-ready summary.

    The first in-process run comes before the server starts: where ``cfg`` leaves the placement
    open, the time it spent in the envs and in inference chooses it (:func:`choose_placement`).
    Where that leaves async_stream two placements (:func:`stream_candidates`), short runs of each
    choose between them before the repeats (:func:`try_placements`); ``placement`` in the result
    says where each streaming mode's workers ran, and what the trial runs gave.
    """
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    bounds: list[float] = []
    stream_stats: dict[str, dict[str, Any]] = {}
    probe = SpeedProbe.start(progress)
    progress(f"repeat 1/{cfg.repeats}: sync_inprocess ({cfg.seconds:.0f}s)")
    first = run_sync_inprocess(cfg)
    candidates = stream_candidates(cfg, first[1], first[2], inference_cpus())
    cfg = candidates[0]
    progress(
        f"  placement: {describe_placement(cfg)}, {cfg.replicas} policy replica(s), "
        f"{cfg.groups} env group(s) per worker"
        + (f"; async_stream tries {len(candidates)} placements" if candidates[1:] else "")
    )
    policy = PolicySpec.from_options(cfg, replicas=cfg.replicas)
    server_cpus = cfg.placement()[1]
    sock_dir = local_socket_folder("edgerl-bench-")
    local_socket = os.path.join(sock_dir.name, LOCAL_SOCKET_NAME)
    server_cfg = ServerConfig(port=0, max_delay_us=cfg.max_delay_us, local_socket=local_socket)
    with sock_dir, ServerProcess(policy, server_cfg, cpus=server_cpus) as server:
        local_cfg = cfg
        assert server.pid is not None  # started
        cpu = {mode: ModeCpu(server.pid) for mode in STREAM_MODES}
        cfg, tried = try_placements(candidates, lambda c: run_async_stream(c, server.address), progress)
        if tried:
            progress(f"  async_stream: {describe_placement(cfg)}")
        for r in range(cfg.repeats):
            for mode in MODES:
                if r or mode != "sync_inprocess":
                    progress(f"repeat {r + 1}/{cfg.repeats}: {mode} ({cfg.seconds:.0f}s)")
                if mode == "sync_inprocess":
                    sps, env_s, inf_s = run_sync_inprocess(cfg) if r else first
                    bounds.append(overlap_bound(env_s, inf_s))
                elif mode == "sync_unary":
                    sps = run_sync_unary(cfg, server.address)
                else:
                    before = server_stats(server.address)
                    if mode == "async_local":
                        sps = run_async_stream(local_cfg, server.address, local_socket, cpu[mode])
                    else:
                        sps = run_async_stream(cfg, server.address, cpu=cpu[mode])
                    after = server_stats(server.address)
                    stream_stats[mode] = mode_stats(stream_stats.get(mode), before, after)
                runs[mode].append(sps)
                progress(f"  {mode}: {sps:,.0f} env steps/s")
    med = {m: statistics.median(v) for m, v in runs.items()}
    overlap = statistics.median(bounds)
    return {
        "bench": "throughput",
        "config": asdict(cfg),
        # where each streaming mode's workers ran, and the placements async_stream tried (if any)
        "placement": {
            "async_stream": placement_of(cfg),
            "async_local": placement_of(local_cfg, local=True),
            "tried": tried,
        },
        **{m: round(med[m], 1) for m in MODES},
        "overlap_bound": round(overlap, 3),
        "ratios": {
            key: value
            for mode in STREAM_MODES
            for key, value in (
                (f"{mode}/sync_unary", round(med[mode] / med["sync_unary"], 3)),
                (f"{mode}/sync_inprocess", round(med[mode] / med["sync_inprocess"], 3)),
                # how much of the overlap bound the pipeline reaches (1.0: perfect overlap of one
                # inference engine with the envs; policy replicas and a backfill worker can go beyond it)
                (f"{mode}/overlap_bound", round(med[mode] / (med["sync_inprocess"] * overlap), 3)),
            )
        },
        "runs": {m: [round(x, 1) for x in v] for m, v in runs.items()},
        **{f"server_{mode}": stream_stats.get(mode, {}) for mode in STREAM_MODES},
        # each role's share of a core over a streaming mode's runs: which core was full
        "cpu_cores": {mode: cpu[mode].cores() for mode in STREAM_MODES},
        "machine": probe.machine(),
        "unix_time": int(time.time()),
    }


def format_table(result: dict[str, Any]) -> str:
    """A readable table of a :func:`run` result."""
    cfg = result["config"]
    lines = [
        f"throughput: {cfg['env']}, {cfg['envs']} envs, policy {cfg['policy']}, "
        f"{cfg['seconds']:.0f}s x {cfg['repeats']} repeat(s)",
        f"{'mode':<16}{'median steps/s':>16}  runs",
    ]
    for m in MODES:
        runs = ", ".join(f"{x:,.0f}" for x in result["runs"][m])
        lines.append(f"{m:<16}{result[m]:>16,.0f}  [{runs}]")
    for k, v in result["ratios"].items():
        lines.append(f"{k:<30}{v:>8.2f}x")
    for mode, cores in result.get("cpu_cores", {}).items():
        used = ", ".join(f"{r.replace('_', ' ')} {c:.2f}" for r, c in cores.items() if c is not None)
        lines.append(f"{mode} cores used: {used}")
    return "\n".join(lines)
