"""The ``edgerl`` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from edgerl.edge_server.server import BindError, ServerConfig
from edgerl.launch import jsonout, run_metrics
from edgerl.launch import robot as robot_cli
from edgerl.launch.argtypes import (
    COUNT,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    PORT,
    POSITIVE,
    WIRE_COUNT,
    WIRE_MICROSECONDS,
    add_json_option,
    add_metrics_options,
    bounded,
    check_metrics_options,
    config_from_args,
    output_file,
    socket_path,
)
from edgerl.launch.bench_throughput import (
    MAX_CHOSEN_REPLICAS,
    NETWORK_PROCESS_BELOW,
    PLACING_S,
    PLACING_WARMUP_S,
    REPLICAS_ABOVE,
    TRIAL_S,
    TRIAL_WARMUP_S,
    mode_stats,
)
from edgerl.launch.checkpoints import LLM_KIND, CheckpointInfo, read_checkpoint
from edgerl.launch.processes import (
    LLM_DTYPES,
    LLM_PRESET,
    LOCAL_SOCKET_NAME,
    USER_ERRORS,
    PolicySpec,
    ServerLostError,
    ServerProcess,
    ServerStartError,
    WorkerError,
    WorkerFleet,
    check_fleet,
    configure_logging,
    fleet_groups,
    kept_cpus,
    local_socket_folder,
    on_stop_signals,
    other_cpus,
    server_stats,
    start_resource_tracker,
)
from edgerl.launch.rollout import PLACE_RULE, PLACE_TRIAL
from edgerl.launch.run_metrics import FleetFigures
from edgerl.launch.train import DEMO_ENV, RunConfig, load_config
from edgerl.models import POLICY_PRESETS
from edgerl.proto.keepalive import MAX_KEEPALIVE_S
from edgerl.proto.settings import GRPC_INT_MAX
from edgerl.robot_client import errors
from edgerl.robot_client.security import TOKEN_ENV, ClientSecurity, with_env_token
from edgerl.robot_client.sim_worker import SimWorkerConfig
from edgerl.trainer.runfiles import RunFilesError
from edgerl.watchdog.sched import STOP_SIGNALS
from edgerl.watchdog.watchdog import Fallback


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """States each option's default with room for long metavars: not for required options, and
    in words where the help already does (``--model``'s empty default is a small random Llama)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=48)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or "(default: " in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


_FMT = _Formatter
_DEFAULT_SERVER = ServerConfig()
_SERVER_COUNTERS = "the server's counters (those of the Stats RPC)"
_LOOPBACK_WORDS = f"{_DEFAULT_SERVER.host}, as the server's gRPC port"
_SIM_FIGURES = (
    "the sim workers' figures (edgerl_sim_*: each worker's env steps, workers running, episodes, mean return)"
)
#: One core for the edge server, the rest for env stepping (measured best on 2 cores:
#: a second worker process costs more in contention than it adds in stepping).
DEFAULT_WORKERS = max(1, (os.cpu_count() or 2) - 1)


def add_client_security(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default="", help="PEM CA that signed the server certificate (enables TLS)")
    p.add_argument("--tls-cert", default="", help="PEM client certificate, for servers requiring mTLS")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-server-name", default="", help="name to verify the server certificate against")
    p.add_argument("--token", default="", help=f"caller token (default: ${TOKEN_ENV})")


def client_security(a: argparse.Namespace) -> ClientSecurity | None:
    sec = ClientSecurity(a.tls_ca, a.tls_cert, a.tls_key, a.token, a.tls_server_name)
    return with_env_token(sec if sec != ClientSecurity() else None)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level"
    )


DEFAULT_ENV = "HalfCheetah-v5"
_OR_CHECKPOINTS = ", or the --checkpoint's"


def _add_env(p: argparse.ArgumentParser, envs: int, *, checkpoint: bool = False) -> None:
    if checkpoint:  # None until resolved: the checkpoint's env where the flag is not given
        p.add_argument("--env", help=f"gymnasium id of the envs (default: {DEFAULT_ENV}{_OR_CHECKPOINTS})")
    else:
        p.add_argument("--env", default=DEFAULT_ENV, help="gymnasium id of the envs")
    p.add_argument("--envs", type=COUNT, default=envs, help="number of envs in total")
    p.add_argument(
        "--seed", type=NON_NEGATIVE_INT, default=0, help="env i is seeded seed+i; also seeds the policy"
    )


def _add_policy(p: argparse.ArgumentParser, *, checkpoint: bool = False) -> None:
    """``--policy``, ``--model``, ``--torch-threads``, ``--dtype``; with ``checkpoint``, also
    ``--checkpoint``, whose policy and model are then the defaults (resolved by :func:`_served_policy`)."""
    policy_help = (
        "policy: an MLP preset (mlp-large: inference costs about as much as env stepping), "
        "or llm, a language model served by vLLM (pip install edgerl[llm])"
    )
    model_help = "local model folder of --policy llm (default: a small random Llama"
    if checkpoint:
        p.add_argument(
            "--checkpoint",
            metavar="PATH",
            default="",
            help="serve the weights and policy version of this trainer checkpoint: a run folder of "
            "edgerl train or its checkpoints/ folder (the newest checkpoint there), or a checkpoint "
            "file (default: none, fresh weights)",
        )
        policy_help += f" (default: mlp{_OR_CHECKPOINTS})"
        model_help += f"{_OR_CHECKPOINTS} base model"
    p.add_argument(
        "--policy",
        default=None if checkpoint else "mlp",
        choices=[*sorted(POLICY_PRESETS), LLM_PRESET],
        help=policy_help,
    )
    p.add_argument("--model", default="", help=model_help + ")")
    p.add_argument("--torch-threads", type=COUNT, default=1, help="torch threads for inference")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=LLM_DTYPES,
        help="engine dtype of --policy llm: float32 serves the log-probs a float32 trainer recomputes; "
        "bfloat16 is faster on CPUs with AMX and on GPUs (auto: the model's own)",
    )


def _add_batching(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-batch-size",
        type=WIRE_COUNT,
        default=_DEFAULT_SERVER.max_batch_size,
        help="most observation rows per forward pass",
    )
    p.add_argument(
        "--max-delay-us",
        type=WIRE_MICROSECONDS,
        default=_DEFAULT_SERVER.max_delay_us,
        help="longest the oldest queued request waits for a fuller batch (microseconds)",
    )


GIVEN, CHOSEN, PLACE = "given", "chosen", "place"
"""How a command's placement options default: to no placement (``given``); left unset, to be
chosen from the first in-process run (``chosen``: ``bench throughput``, see
``bench_throughput.choose_placement``); left unset, to be chosen with ``--place`` and else no
placement (``place``: ``rollout``, see ``rollout.place``)."""


def _add_workers(p: argparse.ArgumentParser, workers: int, placed: str = GIVEN) -> None:
    """``--workers``, ``--groups``, ``--timeout-s`` and the placement options (``placed``: see
    :func:`_add_worker_placement`)."""
    p.add_argument(
        "--workers", type=COUNT, default=workers, help="sim worker processes (envs are split evenly)"
    )
    p.add_argument(
        "--groups",
        type=NON_NEGATIVE_INT,
        default=0,
        help="env groups per worker with one message in flight each (2 = double-buffered, 1 = "
        "lockstep; 0: 2, or 1 where a worker has a single env)",
    )
    p.add_argument(
        "--timeout-s",
        type=POSITIVE,
        default=10.0,
        help="deadline for each answer from the server; an answer overdue ends the stream, and the "
        "worker opens a new one (s)",
    )
    _add_worker_placement(p, placed)


def _add_local_socket(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument("--local-socket", type=socket_path, default="", metavar="PATH", help=help_text)


def _unset(placed: str, chosen: str, plain: str, unset: str = "unset") -> str:
    """The help text's words on an option left ``unset``: ``chosen`` for ``bench throughput``, for
    ``rollout`` ``plain`` or chosen with ``--place``."""
    texts = {GIVEN: "", CHOSEN: f"; {unset}: {chosen}", PLACE: f"; {unset}: {plain}, or chosen by --place"}
    return texts[placed]


def _add_worker_placement(p: argparse.ArgumentParser, placed: str = GIVEN) -> None:
    """``--network-process``, ``--worker-cpus`` and ``--backfill-envs``; unless ``placed`` is
    :data:`GIVEN` they default to None, to be chosen."""
    given = placed == GIVEN
    p.add_argument(
        "--network-process",
        action="store_true" if given else argparse.BooleanOptionalAction,
        default=False if given else None,
        help="each sim worker runs its Act stream in a network process of its own: the worker's "
        "core only steps envs (worth it where that core is the bottleneck and another has room)"
        + _unset(
            placed,
            f"where inference costs under {NETWORK_PROCESS_BELOW:g}x env stepping, tried against a "
            "backfill worker (if the backfill envs are unset too) or on without one",
            "off",
        ),
    )
    p.add_argument(
        "--worker-cpus",
        default="off" if given else None,
        help='CPUs of the sim workers, one per worker ("1", "2,3"); "auto": the last CPUs, one per '
        "worker, if some are left for the server and the network processes, which run on the others; "
        '"off": no pinning'
        + _unset(placed, f"auto, or off where inference costs over {REPLICAS_ABOVE:g}x env stepping", "off"),
    )
    p.add_argument(
        "--backfill-envs",
        type=NON_NEGATIVE_INT,
        default=0 if given else None,
        metavar="N",
        help="of the envs, N for one more sim worker at idle priority on the CPUs the workers leave: it "
        "steps them in CPU time nothing else wants, and the server never waits for it (worth it "
        "where the workers' cores are the bottleneck)"
        + _unset(
            placed,
            f"3/8 of --envs where inference costs under {NETWORK_PROCESS_BELOW:g}x env stepping and "
            "the workers have CPUs of their own, else 0",
            "0",
        ),
    )


def _add_replicas(p: argparse.ArgumentParser, placed: str = GIVEN) -> None:
    """``--replicas``; unless ``placed`` is :data:`GIVEN`, 0 by default: chosen."""
    given = placed == GIVEN
    p.add_argument(
        "--replicas",
        type=COUNT if given else NON_NEGATIVE_INT,
        default=1 if given else 0,
        help="copies of the policy in the server, each in a process of its own, taking batches side "
        "by side (worth it where one copy cannot use every core: a vLLM engine steps on one)"
        + _unset(
            placed,
            f"one per CPU (up to {MAX_CHOSEN_REPLICAS}) where inference costs over {REPLICAS_ABOVE:g}x "
            "env stepping, else 1",
            "1",
            unset="0",
        ),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgerl",
        formatter_class=_FMT,
        description="Online RL for robots with batched edge inference over gRPC.",
    )
    parser.add_argument(
        "--version", action="version", version=f"edgerl {importlib.metadata.version('edgerl')}"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "serve",
        formatter_class=_FMT,
        help="run the edge server",
        description="Serve a policy on gRPC until SIGINT, SIGTERM or SIGHUP (graceful shutdown).",
    )
    p.add_argument(
        "--env", help=f"gymnasium id whose spaces the policy serves (default: {DEFAULT_ENV}{_OR_CHECKPOINTS})"
    )
    p.add_argument(
        "--seed", type=NON_NEGATIVE_INT, default=0, help="seed of the initial weights and of action sampling"
    )
    _add_policy(p, checkpoint=True)
    _add_replicas(p)
    p.add_argument("--host", default=_DEFAULT_SERVER.host, help="address to bind (loopback by default)")
    p.add_argument("--port", type=PORT, default=_DEFAULT_SERVER.port, help="TCP port (0: pick a free one)")
    _add_batching(p)
    p.add_argument(
        "--max-queue-rows",
        type=WIRE_COUNT,
        default=_DEFAULT_SERVER.max_queue_rows,
        help="most rows queued at once; beyond it RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-message-bytes",
        type=bounded(int, 1024, GRPC_INT_MAX),
        default=_DEFAULT_SERVER.max_message_bytes,
        help="largest message accepted or sent (bytes); a weight publish may hold the served weights "
        "as FLOAT64 beyond it",
    )
    p.add_argument(
        "--max-envs-per-stream",
        type=WIRE_COUNT,
        default=_DEFAULT_SERVER.max_envs_per_stream,
        help="most envs one stream may declare",
    )
    p.add_argument(
        "--max-streams",
        type=WIRE_COUNT,
        default=_DEFAULT_SERVER.max_streams,
        help="most Act streams open at once (gRPC and --local-socket together), and most gRPC Act "
        "streams waiting for their hello; a stream beyond either is refused with UNAVAILABLE, which "
        "clients retry with backoff",
    )
    p.add_argument(
        "--hello-timeout-s",
        type=NON_NEGATIVE,
        default=_DEFAULT_SERVER.hello_timeout_s,
        help="refuse an Act stream that has not sent its hello this long after its start, with "
        "DEADLINE_EXCEEDED (0: no limit)",
    )
    p.add_argument(
        "--grace-s",
        type=NON_NEGATIVE,
        default=_DEFAULT_SERVER.grace_s,
        help="on shutdown, time the batches in flight may take, and then the streams' last answers (s); "
        "requests that no batch took by then get UNAVAILABLE",
    )
    p.add_argument(
        "--keepalive-s",
        type=bounded(float, 0.0, MAX_KEEPALIVE_S),
        default=_DEFAULT_SERVER.keepalive_s,
        help="ping a connection that has been silent this long (s), and close it when a ping goes "
        f"unanswered for {_DEFAULT_SERVER.keepalive_timeout_s:g} s: the streams of a robot whose link "
        "died without closing end then (0: off)",
    )
    p.add_argument(
        "--stats-every-s",
        type=NON_NEGATIVE,
        default=10.0,
        help="print a line on what the server did this often (streams, rows/s, batch size, queue "
        "wait, inference time, policy version, refusals); idle spells print nothing (0: never)",
    )
    add_metrics_options(p, _SERVER_COUNTERS, host="--host's")
    p.add_argument("--tls-cert", default="", help="PEM certificate chain of the server (enables TLS)")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default="", help="PEM CA that client certificates must chain to (mTLS)")
    p.add_argument("--tokens", default="", help="TOML file of caller tokens; every call then needs one")
    _add_local_socket(
        p,
        "also serve the Act stream without gRPC on this Unix socket, to sim workers on this machine "
        "(edgerl sim --local-socket PATH); empty: none",
    )
    _add_common(p)

    p = sub.add_parser(
        "sim",
        formatter_class=_FMT,
        help="run sim workers against a server",
        description="Start sim worker processes that stream to an edge server.",
    )
    p.add_argument("--server", default="", help="edge server address, host:port (or --local-socket)")
    _add_local_socket(
        p,
        "stream over the local Act socket of a server on this machine (its --local-socket) instead "
        "of gRPC to --server",
    )
    _add_env(p, envs=32)
    _add_workers(p, workers=1)
    add_client_security(p)
    p.add_argument(
        "--steps", type=NON_NEGATIVE_INT, default=0, help="stop after this many env steps (0: never)"
    )
    p.add_argument(
        "--seconds",
        type=NON_NEGATIVE,
        default=0.0,
        help="stop this long after the first env step (0: never); until the server answers, the "
        "workers wait for it, retrying with backoff",
    )
    add_metrics_options(p, _SIM_FIGURES, host=_DEFAULT_SERVER.host)
    _add_common(p)

    p = sub.add_parser(
        "rollout",
        formatter_class=_FMT,
        help="server + sim workers on loopback",
        description="Start an edge server and sim workers on loopback, show live steps/s, then a summary.",
    )
    _add_env(p, envs=64, checkpoint=True)
    _add_policy(p, checkpoint=True)
    _add_replicas(p, PLACE)
    _add_workers(p, workers=DEFAULT_WORKERS, placed=PLACE)
    p.add_argument(
        "--place",
        nargs="?",
        const=PLACE_RULE,
        choices=[PLACE_RULE, PLACE_TRIAL],
        default=None,
        help="choose the placement options left unset (--worker-cpus, --network-process, --backfill-envs, "
        f"--replicas) as bench throughput does: '{PLACE_RULE}' from a ~{PLACING_WARMUP_S + PLACING_S:g} s "
        f"in-process run before the server starts; '{PLACE_TRIAL}' also runs the rule's two ways off "
        f"the workers, where it leaves two, on the server (4 or 8 runs of ~{TRIAL_WARMUP_S + TRIAL_S:g} s) "
        f"and keeps the faster (default: off; alone: {PLACE_RULE})",
    )
    _add_batching(p)
    p.add_argument("--seconds", type=NON_NEGATIVE, default=30.0, help="run time (0: until --steps or Ctrl-C)")
    p.add_argument(
        "--steps", type=NON_NEGATIVE_INT, default=0, help="stop after this many env steps (0: no limit)"
    )
    p.add_argument(
        "--transport",
        choices=["grpc", "local"],
        default="grpc",
        help="how the workers reach the server: its gRPC port, or its local Act socket (no gRPC; "
        "faster on one machine, see edgerl bench throughput's async_local)",
    )
    add_metrics_options(p, f"{_SERVER_COUNTERS}, then {_SIM_FIGURES}", host=_LOOPBACK_WORDS)
    add_json_option(p, "also write the summary as JSON")
    _add_common(p)

    bench = sub.add_parser("bench", formatter_class=_FMT, help="benchmarks (JSON output)")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = bsub.add_parser(
        "throughput",
        formatter_class=_FMT,
        help="env steps/s: in-process vs unary RPC vs streaming edge server",
        description="Env steps/s of sync_inprocess, sync_unary, async_stream (gRPC) and async_local "
        "(the local Act socket) side by side in one run (same env, policy and env count). The "
        "placement options left unset (--network-process, --worker-cpus, --replicas, --backfill-envs) "
        "are chosen from how the first in-process run's time splits between env stepping and "
        "inference.",
    )
    _add_env(p, envs=64)
    _add_policy(p)
    p.add_argument("--seconds", type=POSITIVE, default=10.0, help="measured time per mode and repeat (s)")
    p.add_argument("--warmup-s", type=NON_NEGATIVE, default=2.0, help="unmeasured warm-up per mode (s)")
    p.add_argument("--repeats", type=COUNT, default=1, help="interleaved repeats; medians are reported")
    p.add_argument(
        "--workers", type=COUNT, default=DEFAULT_WORKERS, help="sim worker processes in async_stream"
    )
    p.add_argument(
        "--groups",
        type=NON_NEGATIVE_INT,
        default=0,
        help="env groups per worker in async_stream (0: one per policy replica for --policy llm, "
        "whose batch of all envs costs one engine less than two halves, else 2: double-buffered)",
    )
    _add_worker_placement(p, CHOSEN)
    _add_replicas(p, CHOSEN)
    p.add_argument(
        "--max-delay-us",
        type=WIRE_MICROSECONDS,
        default=_DEFAULT_SERVER.max_delay_us,
        help="edge server batching delay (microseconds)",
    )
    add_json_option(p, "write the result as JSON")
    _add_common(p)

    p = bsub.add_parser(
        "robot",
        formatter_class=_FMT,
        help="MuJoCo robots behind watchdogs: latency, fallbacks, tick jitter, server outage",
        description="Run --robots real-time MuJoCo robots at --hz against one edge server; measure "
        "end-to-end action latency, fallback rate and tick jitter, then kill the server for "
        "--kill-server-s and report how the robots rode through it; with network processes, "
        "kill and then stop theirs (--network-loss-s).",
    )
    p.add_argument("--robots", type=COUNT, default=100, help="robots in all")
    p.add_argument("--env", default="HalfCheetah-v5", help="MuJoCo task each robot simulates")
    _add_policy(p)
    p.add_argument("--chunk", type=COUNT, default=1, help="actions per policy answer (action chunks)")
    robot_cli.add_watchdog_arguments(p, estop_after=150, serves_policy=True)
    p.add_argument("--processes", type=COUNT, default=1, help="robot processes")
    p.add_argument("--robots-per-slot", type=COUNT, default=8, help="robots ticked back to back per process")
    p.add_argument(
        "--realtime-priority",
        type=NON_NEGATIVE_INT,
        default=0,
        help="SCHED_FIFO priority of the control threads (0: off)",
    )
    p.add_argument(
        "--control-cpu",
        default="auto",
        help='CPUs of the control threads, one per process ("1", "2,3"); "auto": the last CPUs, one per '
        "process, if some are left for the server and the network processes, which run on the others; "
        '"off": no pinning',
    )
    p.add_argument("--warmup-s", type=NON_NEGATIVE, default=3.0, help="unmeasured warm-up (s)")
    p.add_argument("--seconds", type=POSITIVE, default=20.0, help="steady-state measurement (s)")
    p.add_argument(
        "--sync-loop-s", type=NON_NEGATIVE, default=5.0, help="also time a synchronous control loop (0: skip)"
    )
    p.add_argument(
        "--baseline-s",
        type=NON_NEGATIVE,
        default=5.0,
        help="first time the robots in a plain loop without watchdog or gRPC: the machine's own "
        "tick jitter (0: skip)",
    )
    p.add_argument("--kill-server-s", type=NON_NEGATIVE, default=2.0, help="outage phase length (0: skip it)")
    p.add_argument(
        "--network-loss-s",
        type=NON_NEGATIVE,
        default=2.0,
        help="with network processes, last: kill each robot process's network process (SIGKILL), then "
        "stop the new one (SIGSTOP), and watch the robots this long after each (0: skip it)",
    )
    p.add_argument(
        "--network-spare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep a spare network process per robot process, to take over from a lost one at once",
    )
    robot_cli.add_fault_arguments(p)
    p.add_argument("--seed", type=NON_NEGATIVE_INT, default=0, help="seeds the robots and the policy")
    add_json_option(p, "write the result as JSON")
    _add_common(p)

    p = bsub.add_parser(
        "learn",
        formatter_class=_FMT,
        help="return and env steps/s of full training runs over seeds",
        description="Train N seeds end to end (fresh server, workers and trainer each) and "
        "summarise return, steps/s, wall time and staleness; --sync adds the lockstep baseline.",
    )
    _add_train_options(p, steps_help="env steps per seed (default: 1,000,000 for MuJoCo locomotion")
    p.add_argument("--seeds", type=COUNT, default=3, help="seeds to run (seed, seed+1, ...)")
    p.add_argument(
        "--sync", action="store_true", help="also run every seed in synchronous mode, side by side"
    )
    add_json_option(p, "write the result as JSON")
    _add_common(p)

    p = sub.add_parser(
        "robot",
        formatter_class=_FMT,
        help="run robots behind the safety watchdog against an edge server",
        description="Drive --robots instances of --robot at --hz: the watchdog applies fresh policy "
        "actions and fallbacks otherwise, streams observations to --server, and tells the server "
        "which steps used a fallback. Ctrl-C stops; SIGUSR1 (kill -USR1 PID) is the operator's "
        "reset of the robots' latched e-stops. At start it asks the server (Describe) for its "
        "action chunk and checks that its policy is for the robots: their observation and action "
        "shapes, and their env where both name one (a MujocoRobot does). "
        "Exit status 1 when it is not (no robot starts) or when its control loop failed (its last "
        "ticks ramp the robots to their stop action), "
        f"{robot_cli.ESTOPPED_STATUS} when a robot ended e-stopped, "
        f"{robot_cli.RECORDING_FAILED_STATUS} when none did but its --record bag failed (a full disk).",
    )
    robot_cli.add_arguments(p)
    add_client_security(p)
    _add_common(p)

    p = sub.add_parser(
        "describe",
        formatter_class=_FMT,
        help="what an edge server serves: spaces, env, policy version, limits (JSON)",
        description="Ask an edge server's Describe (and with --stats its Stats) and print them as "
        "JSON: what a robot or sim worker is checked against before its stream opens. Exit status "
        "1 when the server cannot be asked within --timeout-s.",
    )
    p.add_argument("--server", default="127.0.0.1:50051", help="edge server address host:port")
    p.add_argument("--stats", action="store_true", help="also the server's counters (Stats)")
    p.add_argument(
        "--timeout-s", type=POSITIVE, default=5.0, help="how long to wait for the server to answer (s)"
    )
    add_json_option(p, "also write the result as JSON to this file")
    add_client_security(p)
    _add_common(p)

    p = sub.add_parser(
        "bag",
        formatter_class=_FMT,
        help="ROS 2 bags of robot sessions: summarise, import as transitions, repair",
        description="Work with bags written by edgerl robot --record.",
    )
    bag = p.add_subparsers(dest="bag", required=True, metavar="ACTION")
    q = bag.add_parser("info", formatter_class=_FMT, help="summarise a bag (JSON)")
    q.add_argument("path", help="bag folder")
    _add_common(q)
    q = bag.add_parser(
        "import",
        formatter_class=_FMT,
        help="turn a bag into trainer transitions",
        description="Write the bag's transitions as one edgerl.v1.TransitionBatch message "
        "(the segments the Learner stream carries); load them with "
        "edgerl.robot_client.bags.load_transitions.",
    )
    q.add_argument("path", help="bag folder")
    q.add_argument("--out", required=True, type=output_file, help="output file (required)")
    q.add_argument("--segment-steps", type=COUNT, default=32, help="transitions per segment")
    _add_common(q)
    q = bag.add_parser(
        "repair",
        formatter_class=_FMT,
        help="save what can be read of a recording that was never closed (JSON)",
        description="Write a new bag with every whole chunk of a recording whose disk filled (its "
        ".mcap file cut short, no metadata.yaml), less the last ticks that lack a message.",
    )
    q.add_argument("path", help="bag folder")
    q.add_argument("--out", required=True, help="new bag folder (required)")
    _add_common(q)
    q = bag.add_parser("msg", formatter_class=_FMT, help="print the edgerl_msgs/msg/Step definition")
    _add_common(q)

    p = sub.add_parser(
        "certs",
        formatter_class=_FMT,
        help="make a test CA, server and client certificates and tokens",
        description="Write ca.pem, server.pem/.key, client.pem/.key and tokens.toml into DIR, for "
        "trying TLS, mutual TLS and tokens on one machine (use your own PKI in production).",
    )
    p.add_argument("dir", help="output folder")
    p.add_argument(
        "--hosts", default="localhost,127.0.0.1", help="comma-separated names and IPs the server cert covers"
    )
    _add_common(p)

    p = sub.add_parser(
        "train",
        formatter_class=_FMT,
        help="train a policy: edge server + sim workers + PPO trainer on loopback",
        description="Train with PPO through the edge server. With no option: a short "
        f"{DEMO_ENV} demo that learns in a few minutes. Settings come from the defaults, "
        "then the config file (--config, or the tuned one shipped for --env), then flags, then --set.",
    )
    _add_train_options(p, steps_help="env steps to learn from (default: 100,000, or the env's config file")
    p.add_argument("--sync", action="store_true", help="synchronous lockstep baseline (staleness 0)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir from its last checkpoint, with its own settings (its "
        "config.json; options given again win, e.g. a larger --steps)",
    )
    add_metrics_options(
        p,
        f"{_SERVER_COUNTERS}, the learner's among them, then the sim workers' (edgerl_sim_*) and "
        "the trainer's (edgerl_train_*: its counters and its last update's scalars, as in metrics.jsonl)",
        host=_LOOPBACK_WORDS,
    )
    add_json_option(p, "also write the summary as JSON")
    _add_common(p)
    return parser


def _add_train_options(p: argparse.ArgumentParser, steps_help: str) -> None:
    s = argparse.SUPPRESS  # unset flags fall through to the config file
    p.add_argument("--env", default=s, help=f"gymnasium id of the task (default: {DEMO_ENV})")
    p.add_argument(
        "--envs", type=COUNT, default=s, help="envs in total (default: 16, or the env's config file)"
    )
    p.add_argument("--steps", type=COUNT, default=s, help=steps_help + ")")
    p.add_argument(
        "--seed", type=NON_NEGATIVE_INT, default=s, help="first seed: weights, envs, sampling (default: 0)"
    )
    p.add_argument(
        "--policy",
        default=s,
        choices=[*sorted(POLICY_PRESETS), LLM_PRESET],
        help="network preset (default: mlp-small, CleanRL's 64x64), or llm: a language model "
        "served by vLLM, trained over its action tokens (pip install edgerl[llm])",
    )
    p.add_argument(
        "--model",
        default=s,
        help="local model folder of --policy llm (default: a small random Llama built on first use)",
    )
    p.add_argument(
        "--segment-steps",
        type=COUNT,
        default=s,
        help="rollout length per env per update; batch = envs x segment steps (default: 32)",
    )
    p.add_argument("--workers", type=COUNT, default=s, help="sim worker processes (default: 1)")
    p.add_argument(
        "--config",
        metavar="TOML",
        default=s,
        help="config file (default: launch/configs/ENV.toml, or ENV-llm.toml with --policy llm)",
    )
    p.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override any setting, e.g. ppo.learning_rate=1e-3 (repeatable)",
    )
    p.add_argument("--run-dir", default=s, help="output folder (default: runs/ENV-sSEED-TIME)")


def _train_config(a: argparse.Namespace) -> RunConfig:
    names = ("envs", "steps", "seed", "policy", "model", "segment_steps", "workers")
    flags = {k: getattr(a, k, None) for k in names}
    flags["run_dir"] = getattr(a, "run_dir", None)
    if getattr(a, "sync", False) and a.command == "train":
        flags["sync"] = True
    resume = None
    if getattr(a, "resume", False):
        if not flags["run_dir"]:
            raise ValueError("--resume needs --run-dir (the run to continue)")
        resume = flags["run_dir"]
    env, file = getattr(a, "env", None), getattr(a, "config", None)
    cfg, sources = load_config(env, file, flags, a.set, resume=resume)
    print(f"edgerl: config from {' < '.join(sources)}", file=sys.stderr)
    return cfg


def _train(a: argparse.Namespace) -> int:
    from edgerl.launch.train import run_training

    cfg = _train_config(a)
    summary = run_training(
        cfg,
        resume=a.resume,
        log_level=a.log_level,
        metrics_port=a.metrics_port,
        metrics_host=a.metrics_host,
    )
    return _report(summary, a.json)


def _bench_learn(a: argparse.Namespace) -> int:
    from edgerl.launch import bench_learn as bl

    cfg = _train_config(a)
    if getattr(a, "steps", None) is None and cfg.env != DEMO_ENV:
        cfg = dataclasses.replace(cfg, steps=1_000_000)
    result = bl.run(cfg, a.seeds, with_sync=a.sync, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(bl.format_table(result), file=sys.stderr)
    print(jsonout.dumps(result))
    if a.json:
        jsonout.write_json(result, a.json)
    return 0


def _served_policy(a: argparse.Namespace) -> tuple[PolicySpec, str]:
    """The policy ``serve`` or ``rollout`` serves, and its weights in words: fresh weights of
    ``--policy`` for ``--env``, or the weights of ``--checkpoint``, whose env, policy and base
    model fill the options not given (:func:`_served_options`).

    Raises:
        ValueError: the env is unknown, or naming the option that the checkpoint cannot serve.
    """
    return _policy_of(a, _served_options(a))


def _served_options(a: argparse.Namespace) -> CheckpointInfo | None:
    """Read ``--checkpoint`` (None without one) and set on ``a`` the env, policy and base model
    that it or the defaults give where the options were not given.

    Raises:
        ValueError: the env is unknown, or naming the option that the checkpoint cannot serve.
    """
    from edgerl.sim.envs import env_spec

    info = read_checkpoint(a.checkpoint) if a.checkpoint else None
    a.env = a.env or (info and info.env) or DEFAULT_ENV
    a.policy = a.policy or (info and info.policy) or "mlp"
    spec = env_spec(a.env)  # an unknown env is refused here, before a server process starts
    if info is None:
        return None
    info.check_serves(a.env, a.policy, spec.obs_shape, spec.act_shape)
    if info.kind == LLM_KIND:
        a.model = a.model or info.model
        if a.model and not os.path.isdir(a.model):
            raise FileNotFoundError(f"--model {a.model}: no such folder (the checkpoint's base model)")
    return info


def _policy_of(a: argparse.Namespace, info: CheckpointInfo | None) -> tuple[PolicySpec, str]:
    """The policy of ``a``'s settled options (:func:`_served_options`) with the weights of
    ``info``, and those weights in words."""
    if info is None:
        return PolicySpec.from_options(a, replicas=a.replicas), f"policy {a.policy}, fresh weights"
    policy = PolicySpec.from_options(a, replicas=a.replicas, checkpoint=info.path)
    return policy, f"policy {a.policy}, version {info.version} from {info.path}"


def _serve(a: argparse.Namespace) -> int:
    from edgerl.edge_server.server import serve_until_signal
    from edgerl.launch.processes import build_server

    cfg = config_from_args(ServerConfig, a)
    policy, weights = _served_policy(a)
    server = build_server(policy, cfg)

    def say_ready(_: asyncio.Future[int]) -> None:
        metrics = f"\nedgerl: metrics on {server.metrics_url}" if server.metrics else ""
        print(f"edgerl: serving {a.env} on {server.address}\nedgerl: {weights}{metrics}", flush=True)

    async def main() -> None:
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(say_ready)
        await serve_until_signal(
            server,
            ready,
            STOP_SIGNALS,
            report_every_s=a.stats_every_s,
            report=lambda line: print(f"edgerl: {line}", flush=True),
        )

    asyncio.run(main())
    return 0


def _worker_config(a: argparse.Namespace, server: str, local_socket: str = "") -> SimWorkerConfig:
    return SimWorkerConfig(
        server=server,
        env_name=a.env,
        num_envs=a.envs,
        groups=_groups(a),
        seed=a.seed,
        timeout_s=a.timeout_s,
        max_steps=getattr(a, "steps", 0),
        security=client_security(a) if hasattr(a, "tls_ca") else None,
        network_process=a.network_process,
        network_cpus=tuple(sorted(other_cpus(_worker_cpus(a)) or ())) if a.network_process else (),
        local_socket=local_socket,
    )


def _groups(a: argparse.Namespace) -> int:
    """Env groups per sim worker for ``--groups`` (0: chosen by envs per worker)."""
    return fleet_groups(a.groups, a.envs - (a.backfill_envs or 0), a.workers)


def _worker_cpus(a: argparse.Namespace) -> list[int]:
    return kept_cpus(a.worker_cpus, a.workers, "--worker-cpus")


def _fleet(a: argparse.Namespace, server: str, local_socket: str = "") -> WorkerFleet:
    return WorkerFleet(
        _worker_config(a, server, local_socket),
        a.workers,
        log_level=a.log_level,
        worker_cpus=_worker_cpus(a),
        backfill_envs=a.backfill_envs,
    )


def _sim(a: argparse.Namespace) -> int:
    if bool(a.server) == bool(a.local_socket):
        raise ValueError("sim: give one of --server ADDR (gRPC) and --local-socket PATH")
    figures = FleetFigures(run_metrics.fleet_info(a.env, a.envs, a.workers))
    metrics_host = a.metrics_host or _DEFAULT_SERVER.host
    # the metrics port first: one that is taken ends the command before a worker starts
    with run_metrics.serving(metrics_host, a.metrics_port, "", figures.exposition, _say):
        # The server is the user's to start: its workers retry until it is up, or fail after
        # give_up_after_s without a working stream. No limit of the command's own.
        summary = _watch_fleet(a, a.server, a.local_socket, figures, start_timeout_s=None)
    return _report(summary, None)


def _say(line: str) -> None:
    print(f"edgerl: {line}", flush=True)


def _watch_fleet(
    a: argparse.Namespace, server: str, local_socket: str, figures: FleetFigures, **options: Any
) -> dict[str, Any]:
    """Run the fleet of ``a`` against ``server`` (or ``local_socket``) and show its progress until
    it is done (:func:`~edgerl.launch.rollout.watch`, given ``options``), its figures for
    ``GET /metrics`` in ``figures``; returns the summary."""
    from edgerl.launch.rollout import watch

    with _fleet(a, server, local_socket) as fleet:
        figures.attach(fleet)
        return watch(
            fleet, seconds=a.seconds, steps=a.steps, desc=f"{a.env} x{a.envs}", look=figures.look, **options
        )


def _rollout(a: argparse.Namespace) -> int:
    from edgerl.launch.rollout import place, placement_summary, try_placements

    # before the server starts (and before --place measures)
    check_fleet(
        a.envs,
        a.workers,
        _groups(a),
        max_envs_per_stream=ServerConfig.max_envs_per_stream,
        backfill_envs=a.backfill_envs or 0,
    )
    if a.worker_cpus is not None:
        kept_cpus(a.worker_cpus, a.workers, "--worker-cpus")  # fails naming the option
    info = _served_options(a)
    measured, candidates = place(a, _groups(a), _say)
    policy, weights = _policy_of(a, info)
    # a folder for the local Act socket only: a gRPC rollout leaves nothing behind in /tmp
    local_dir = local_socket_folder("edgerl-rollout-") if a.transport == "local" else None
    local = os.path.join(local_dir.name, LOCAL_SOCKET_NAME) if local_dir else ""
    cfg = ServerConfig(
        port=0,
        max_batch_size=a.max_batch_size,
        max_delay_us=a.max_delay_us,
        local_socket=local,
        # the server's own metrics endpoint on loopback, for the command's to fetch when scraped
        metrics_port=None if a.metrics_port is None else 0,
    )
    server = ServerProcess(policy, cfg, log_level=a.log_level, cpus=other_cpus(_worker_cpus(a)))
    figures = FleetFigures(run_metrics.fleet_info(a.env, a.envs, a.workers))
    with local_dir or contextlib.nullcontext(), server:
        via = f"its local socket {local}" if local else "gRPC"
        print(
            f"edgerl: edge server on {server.address} ({weights}); {a.workers} worker(s), "
            f"{a.envs} envs of {a.env} over {via}",
            flush=True,
        )
        metrics_host = a.metrics_host or cfg.host
        with run_metrics.serving(metrics_host, a.metrics_port, server.metrics_url, figures.exposition, _say):
            tried = try_placements(a, candidates, server.address, _say)
            before = server_stats(server.address) if candidates else None
            summary = _watch_fleet(a, server.address, local, figures, check=server.check)
        summary["placement"] = placement_summary(a, measured, tried)
        after = server_stats(server.address)
        # after a trial, what the run added (its largest batch stays the server's largest)
        summary["server"] = after if before is None else {**after, **mode_stats(None, before, after)}
    return _report(summary, a.json)


def _report(summary: dict[str, Any], json_path: str | None) -> int:
    """Print a run summary; also write it as JSON when asked."""
    from edgerl.launch.rollout import format_summary

    print(format_summary(summary))
    if json_path:
        jsonout.write_json(summary, json_path)
    return 0


def _robot(a: argparse.Namespace) -> int:
    code: int = robot_cli.run(a, client_security(a))
    return code


def _describe(a: argparse.Namespace) -> int:
    from edgerl.robot_client.client import describe_server

    try:
        result = describe_server(a.server, client_security(a), a.timeout_s, stats=a.stats)
    except errors.EdgeRLError as exc:
        print(f"edgerl: error: could not ask {a.server} ({exc})", file=sys.stderr)
        return 1
    print(jsonout.dumps(result, indent=2))
    if a.json:
        jsonout.write_json(result, a.json)
    return 0


def _bag(a: argparse.Namespace) -> int:
    from edgerl.launch.progress import advance, step_bar
    from edgerl.robot_client import bags

    if a.bag == "msg":
        print(bags.STEP_MSG, end="")
        return 0
    if a.bag == "repair":
        print(jsonout.dumps(bags.repair_bag(a.path, a.out), indent=2))
        return 0
    bar = step_bar(f"bag {a.bag}", None, unit="msg")

    def progress(read: int, total: int) -> None:
        bar.total = total
        advance(bar, read)

    with bar:
        if a.bag == "info":
            info = bags.bag_info(a.path, progress)
        else:
            segments = bags.iter_segments(a.path, a.segment_steps, progress)
            n_segments, rows = bags.save_transitions(segments, a.out)
    if a.bag == "info":
        print(jsonout.dumps(info, indent=2))
    else:
        print(f"edgerl: {rows} transitions in {n_segments} segments -> {a.out}")
    return 0


def _certs(a: argparse.Namespace) -> int:
    from edgerl.launch.certs import make_dev_pki

    pki = make_dev_pki(a.dir, tuple(h.strip() for h in a.hosts.split(",") if h.strip()))
    print(f"edgerl: wrote {pki.ca}, {pki.server_cert}, {pki.client_cert} (+ keys) and {pki.tokens}")
    print(
        f"  edgerl serve --tls-cert {pki.server_cert} --tls-key {pki.server_key} "
        f"--tls-client-ca {pki.ca} --tokens {pki.tokens}"
    )
    print(
        f"  EDGERL_TOKEN=<robot token from {pki.tokens.name}> edgerl robot --tls-ca {pki.ca} "
        f"--tls-cert {pki.client_cert} --tls-key {pki.client_key}"
    )
    return 0


def _bench_robot(a: argparse.Namespace) -> int:
    from edgerl.launch import bench_robot as br

    cfg = config_from_args(
        br.BenchRobotConfig,
        a,
        duration_s=a.seconds,
        fallback=Fallback(a.fallback),
        log_level="ERROR" if a.log_level == "WARNING" else a.log_level,
    )
    result = br.run_bench_robot(cfg, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(jsonout.dumps(result, indent=2))
    if a.json:
        jsonout.write_json(result, a.json)
    return 0


def _bench_throughput(a: argparse.Namespace) -> int:
    from edgerl.launch import bench_throughput as bt

    cfg = config_from_args(bt.ThroughputConfig, a)
    result = bt.run(cfg, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(bt.format_table(result), file=sys.stderr)
    print(jsonout.dumps(result))
    if a.json:
        jsonout.write_json(result, a.json)
    return 0


_COMMANDS = {
    "serve": _serve,
    "sim": _sim,
    "rollout": _rollout,
    "train": _train,
    "robot": _robot,
    "describe": _describe,
    "certs": _certs,
    "bag": _bag,
}
_BENCHES = {"throughput": _bench_throughput, "learn": _bench_learn, "robot": _bench_robot}


#: The commands that start processes through multiprocessing (its resource tracker with them).
_SPAWNING = ("sim", "rollout", "train", "bench")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_metrics_options(parser, args)
    configure_logging(args.log_level)
    command = _BENCHES[args.bench] if args.command == "bench" else _COMMANDS[args.command]
    if args.command in _SPAWNING:
        start_resource_tracker()
    try:
        # SIGTERM stops a command as Ctrl-C does, its servers and workers shut down cleanly
        with on_stop_signals(signal.default_int_handler):
            return command(args)
    except KeyboardInterrupt:  # where the command does not finish its work on Ctrl-C
        print("edgerl: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as exc:  # bad option values or config files
        print(f"edgerl: error: {str(exc).strip(chr(34))}", file=sys.stderr)
        return 2
    except (
        BindError,
        ServerStartError,
        ServerLostError,
        WorkerError,
        errors.EdgeRLError,
        RunFilesError,
    ) as exc:
        # a process failed, as it said, or a call to a server did (its status and message), or a
        # run's file could not be written; a note says how to go on (train: the checkpoint to
        # resume from)
        print(f"edgerl: error: {exc}{''.join(getattr(exc, '__notes__', ()))}", file=sys.stderr)
        return 1
    except OSError as exc:  # a file the command writes (--json, --out): a full disk, a folder made read-only
        print(f"edgerl: error: {exc}", file=sys.stderr)
        return 1
