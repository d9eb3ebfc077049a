"""The ``edgerl`` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence

from edgerl.edge_server.models import POLICY_PRESETS
from edgerl.edge_server.server import ServerConfig
from edgerl.launch.processes import PolicySpec, ServerProcess, WorkerFleet, configure_logging, server_stats
from edgerl.robot_client.sim_worker import SimWorkerConfig


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """States each option's default (not for required ones) with room for long metavars."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=48)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.required else super()._get_help_string(action)


_FMT = _Formatter
_DEFAULT_SERVER = ServerConfig()
#: One core for the edge server, the rest for env stepping (measured best on 2 cores:
#: a second worker process costs more in contention than it adds in stepping).
DEFAULT_WORKERS = max(1, (os.cpu_count() or 2) - 1)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level"
    )


def _add_env(p: argparse.ArgumentParser, envs: int) -> None:
    p.add_argument("--env", default="HalfCheetah-v5", help="gymnasium id of the envs")
    p.add_argument("--envs", type=int, default=envs, help="number of envs in total")
    p.add_argument("--seed", type=int, default=0, help="env i is seeded seed+i; also seeds the policy")


def _add_policy(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policy",
        default="mlp",
        choices=sorted(POLICY_PRESETS),
        help="policy network preset (mlp-large: inference costs about as much as env stepping)",
    )
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads for inference")


def _add_batching(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=_DEFAULT_SERVER.max_batch_size,
        help="most observation rows per forward pass",
    )
    p.add_argument(
        "--max-delay-us",
        type=int,
        default=_DEFAULT_SERVER.max_delay_us,
        help="longest the oldest queued request waits for a fuller batch (microseconds)",
    )


def _add_workers(p: argparse.ArgumentParser, workers: int) -> None:
    p.add_argument(
        "--workers", type=int, default=workers, help="sim worker processes (envs are split evenly)"
    )
    p.add_argument(
        "--groups",
        type=int,
        default=2,
        help="env groups per worker with one message in flight each (2 = double-buffered)",
    )
    p.add_argument(
        "--timeout-s", type=float, default=10.0, help="deadline for each answer from the server (s)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgerl",
        formatter_class=_FMT,
        description="Online RL for robots with batched edge inference over gRPC.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "serve",
        formatter_class=_FMT,
        help="run the edge server",
        description="Serve a policy on gRPC until SIGINT/SIGTERM (graceful shutdown).",
    )
    p.add_argument("--env", default="HalfCheetah-v5", help="gymnasium id whose spaces the policy serves")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of action sampling")
    _add_policy(p)
    p.add_argument("--host", default=_DEFAULT_SERVER.host, help="address to bind (loopback by default)")
    p.add_argument("--port", type=int, default=_DEFAULT_SERVER.port, help="TCP port (0: pick a free one)")
    _add_batching(p)
    p.add_argument(
        "--max-queue-rows",
        type=int,
        default=_DEFAULT_SERVER.max_queue_rows,
        help="most rows queued at once; beyond it RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=_DEFAULT_SERVER.max_message_bytes,
        help="largest message accepted or sent (bytes)",
    )
    p.add_argument(
        "--max-envs-per-stream",
        type=int,
        default=_DEFAULT_SERVER.max_envs_per_stream,
        help="most envs one stream may declare",
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=_DEFAULT_SERVER.grace_s,
        help="on shutdown, time in-flight work may take (s)",
    )
    _add_common(p)

    p = sub.add_parser(
        "sim",
        formatter_class=_FMT,
        help="run sim workers against a server",
        description="Start sim worker processes that stream to an edge server.",
    )
    p.add_argument("--server", required=True, help="edge server address, host:port (required)")
    _add_env(p, envs=32)
    _add_workers(p, workers=1)
    p.add_argument("--steps", type=int, default=0, help="stop after this many env steps (0: never)")
    p.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: never)")
    _add_common(p)

    p = sub.add_parser(
        "rollout",
        formatter_class=_FMT,
        help="server + sim workers on loopback",
        description="Start an edge server and sim workers on loopback, show live steps/s, then a summary.",
    )
    _add_env(p, envs=64)
    _add_policy(p)
    _add_workers(p, workers=DEFAULT_WORKERS)
    _add_batching(p)
    p.add_argument("--seconds", type=float, default=30.0, help="run time (0: until --steps or Ctrl-C)")
    p.add_argument("--steps", type=int, default=0, help="stop after this many env steps (0: no limit)")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    _add_common(p)

    bench = sub.add_parser("bench", formatter_class=_FMT, help="benchmarks (JSON output)")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = bsub.add_parser(
        "throughput",
        formatter_class=_FMT,
        help="env steps/s: in-process vs unary RPC vs streaming edge server",
        description="Env steps/s of sync_inprocess, sync_unary and async_stream side by "
        "side in one run (same env, policy and env count).",
    )
    _add_env(p, envs=64)
    _add_policy(p)
    p.add_argument("--seconds", type=float, default=10.0, help="measured time per mode and repeat (s)")
    p.add_argument("--warmup-s", type=float, default=2.0, help="unmeasured warm-up per mode (s)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats; medians are reported")
    p.add_argument(
        "--workers", type=int, default=DEFAULT_WORKERS, help="sim worker processes in async_stream"
    )
    p.add_argument("--groups", type=int, default=2, help="env groups per worker in async_stream")
    p.add_argument(
        "--max-delay-us",
        type=int,
        default=_DEFAULT_SERVER.max_delay_us,
        help="edge server batching delay (microseconds)",
    )
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    _add_common(p)
    return parser


def _serve(a: argparse.Namespace) -> int:
    from edgerl.edge_server.server import serve_until_signal
    from edgerl.launch.processes import build_server

    cfg = ServerConfig(
        host=a.host,
        port=a.port,
        max_batch_size=a.max_batch_size,
        max_delay_us=a.max_delay_us,
        max_queue_rows=a.max_queue_rows,
        max_message_bytes=a.max_message_bytes,
        max_envs_per_stream=a.max_envs_per_stream,
        grace_s=a.grace_s,
    )
    server = build_server(PolicySpec(a.env, a.policy, a.seed, a.torch_threads), cfg)

    async def main() -> None:
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(lambda f: print(f"edgerl: serving {a.env} on {server.address}", flush=True))
        await serve_until_signal(server, ready)

    asyncio.run(main())
    return 0


def _worker_config(a: argparse.Namespace, server: str) -> SimWorkerConfig:
    return SimWorkerConfig(
        server=server,
        env_name=a.env,
        num_envs=a.envs,
        groups=a.groups,
        seed=a.seed,
        timeout_s=a.timeout_s,
        max_steps=getattr(a, "steps", 0),
    )


def _sim(a: argparse.Namespace) -> int:
    from edgerl.launch.rollout import format_summary, watch

    with WorkerFleet(_worker_config(a, a.server), a.workers, log_level=a.log_level) as fleet:
        summary = watch(fleet, seconds=a.seconds, steps=a.steps, desc=f"{a.env} x{a.envs}")
    print(format_summary(summary))
    return 0


def _rollout(a: argparse.Namespace) -> int:
    from edgerl.launch.rollout import format_summary, watch

    policy = PolicySpec(a.env, a.policy, a.seed, a.torch_threads)
    cfg = ServerConfig(port=0, max_batch_size=a.max_batch_size, max_delay_us=a.max_delay_us)
    with ServerProcess(policy, cfg, log_level=a.log_level) as server:
        print(
            f"edgerl: edge server on {server.address}; {a.workers} worker(s), {a.envs} envs of {a.env}",
            flush=True,
        )
        with WorkerFleet(_worker_config(a, server.address), a.workers, log_level=a.log_level) as fleet:
            summary = watch(fleet, seconds=a.seconds, steps=a.steps, desc=f"{a.env} x{a.envs}")
        summary["server"] = server_stats(server.address)
    print(format_summary(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def _bench_throughput(a: argparse.Namespace) -> int:
    from edgerl.launch import bench_throughput as bt

    cfg = bt.ThroughputConfig(
        env=a.env,
        envs=a.envs,
        seconds=a.seconds,
        warmup_s=a.warmup_s,
        policy=a.policy,
        workers=a.workers,
        groups=a.groups,
        repeats=a.repeats,
        max_delay_us=a.max_delay_us,
        torch_threads=a.torch_threads,
        seed=a.seed,
    )
    result = bt.run(cfg, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(bt.format_table(result), file=sys.stderr)
    print(json.dumps(result))
    if a.json:
        bt.write_json(result, a.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "sim":
            return _sim(args)
        if args.command == "rollout":
            return _rollout(args)
        return _bench_throughput(args)
    except ValueError as exc:  # bad option values, e.g. from a config __post_init__
        print(f"edgerl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
