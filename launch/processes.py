"""Start the edge server and sim workers as separate processes on loopback.

Processes are spawned (never forked: torch and gRPC hold threads), the
server reports its bound port through a pipe, and every process shuts down
gracefully on ``stop()`` (:data:`OWNER_STOP` for the server, a shared flag
for workers) before being killed as a last resort. Ctrl-C, SIGTERM and a
terminal's hangup are the command's alone (:func:`owned_by_parent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, NamedTuple

from edgerl.edge_server.metrics import host_port, url_of
from edgerl.edge_server.server import BindError, ServerConfig
from edgerl.proto.settings import UNIX_PATH_MAX, check_finite
from edgerl.robot_client.keeper import host_session_id
from edgerl.robot_client.sim_worker import SimWorkerConfig
from edgerl.sim.episodes import EpisodeLog
from edgerl.watchdog.sched import (
    STOP_SIGNALS,
    idle_priority,
    leave_stop_signals,
    no_wakeup_preemption,
    thread_ids,
)

log = logging.getLogger(__name__)


LOCAL_SOCKET_NAME = "act.sock"
"""The name of the local Act socket in the folder :func:`local_socket_folder` makes."""


def local_socket_folder(prefix: str) -> tempfile.TemporaryDirectory[str]:
    """A new folder for a local Act socket, in the temporary folder (``$TMPDIR``), or in /tmp
    where the socket's path there would be longer than a Unix socket takes."""
    base = tempfile.gettempdir()
    longest = os.path.join(base, prefix + "x" * 8, LOCAL_SOCKET_NAME)  # 8: the random part's length
    if len(os.fsencode(longest)) > UNIX_PATH_MAX:
        base = "/tmp"
    return tempfile.TemporaryDirectory(prefix=prefix, dir=base)


#: What a bad option value or config file raises; the command line reports it in one line.
USER_ERRORS = (ValueError, KeyError, FileNotFoundError)

_CTX = mp.get_context("spawn")

#: Episodes per message on a sim worker's episode queue. A message (a 4-byte header and the
#: pickle, 16 bytes an episode: 2,068 bytes in all) then stays under PIPE_BUF (4,096 bytes on
#: Linux): the pipe takes it whole or not at all, and a worker killed while it writes one leaves no
#: half message for the fleet to wait for the rest of.
EPISODES_PER_MESSAGE = 128

#: The longest error line a sim worker sends its fleet, in characters: at 4 bytes a character at
#: most, its message too stays under PIPE_BUF.
MAX_SAID_CHARS = 1000


def configure_logging(level: str = "WARNING") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # vLLM configures its own loggers (INFO by default) when it is imported.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", level.upper())


@contextlib.contextmanager
def on_signals(signals: Iterable[int], handler: Callable[[int, Any], Any]) -> Iterator[None]:
    """Call ``handler`` on each of ``signals`` in this block, then restore the handlers that
    were there. Signals reach only the main thread; run in another (a command embedded in a
    program), it installs nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker, if it is not running yet, deaf to a terminal's
    hangup as it is to SIGINT and SIGTERM. Ignored here while the tracker starts, SIGHUP stays
    ignored in it: else the hangup that stops a command as Ctrl-C does (:data:`STOP_SIGNALS`)
    ended the tracker, which the command's next queue or process started again, printing
    multiprocessing's traceback of a resource it did not know. Call it before the command
    spawns anything, in the main thread."""
    from multiprocessing import resource_tracker

    if threading.current_thread() is not threading.main_thread():
        resource_tracker.ensure_running()
        return
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, previous)


def on_stop_signals(handler: Callable[[int, Any], Any]) -> contextlib.AbstractContextManager[None]:
    """Call ``handler`` on each of :data:`STOP_SIGNALS` in this block (:func:`on_signals`): a
    command stopped any of these ways stops as cleanly as on Ctrl-C."""
    return on_signals(STOP_SIGNALS, handler)


def parse_cpus(spec: str, name: str) -> tuple[int, ...]:
    """``"0,2"`` -> ``(0, 2)``; ``""`` -> ``()``."""
    try:
        return tuple(int(c) for c in spec.split(",")) if spec else ()
    except ValueError:
        raise ValueError(f'{name}: expected CPU numbers like "0,1", got {spec!r}') from None


def kept_cpus(spec: str, count: int, name: str) -> list[int]:
    """CPUs kept for ``count`` busy processes, one each; [] for none.

    ``spec`` is "off" (none), "auto" (the last ``count`` CPUs of this process, if at least one
    is left for the others) or ``count`` distinct CPU numbers ("1", "2,3").

    Raises:
        ValueError: ``spec`` is none of these (the message names ``name``).
    """
    allowed = sorted(os.sched_getaffinity(0))
    if spec == "off":
        return []
    if spec == "auto":
        return allowed[-count:] if len(allowed) > count else []
    cpus = list(parse_cpus(spec, f'{name} ("auto", "off" or CPUs)'))
    if len(cpus) != count or len(set(cpus)) != count or not set(cpus) <= set(allowed):
        raise ValueError(f"{name} needs {count} distinct CPUs of {allowed} (one per process), got {spec!r}")
    return cpus


def other_cpus(cpus: Sequence[int]) -> frozenset[int] | None:
    """This process's CPUs but ``cpus``, for the server and network processes (None: any)."""
    return frozenset(os.sched_getaffinity(0)) - set(cpus) if cpus else None


LLM_PRESET = "llm"
LLM_DTYPES = ("float32", "bfloat16", "float16", "auto")
"""Engine dtypes of the ``llm`` preset (``auto``: the model's own)."""


def check_dtype(dtype: str, preset: str) -> None:
    """Raise ValueError naming ``dtype`` unless it is an engine dtype that ``preset`` can run."""
    if dtype not in LLM_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(LLM_DTYPES)}")
    if dtype != "float32" and preset != LLM_PRESET:
        raise ValueError(f"dtype: {dtype!r} is for policy {LLM_PRESET!r}; the MLP presets run float32")


@dataclass(frozen=True)
class PolicySpec:
    """Which policy a server process builds."""

    env_name: str = "HalfCheetah-v5"
    """Gymnasium id whose spaces the policy is built for."""
    preset: str = "mlp"
    """Network preset (see ``edgerl.models.POLICY_PRESETS``)."""
    seed: int = 0
    """Seed of the initial weights and of action sampling."""
    torch_threads: int = 1
    """Threads torch may use for inference."""
    compute_values: bool = False
    """Evaluate the critic with each batch, so transitions carry the served value."""
    checkpoint: str = ""
    """Start from this trainer checkpoint (weights and version) instead of fresh weights."""
    chunk: int = 1
    """Actions per observation (action chunks of this length when > 1)."""
    model: str = ""
    """Local model folder for the ``llm`` preset; empty: the small random Llama built on first use."""
    log_std_init: float = 0.0
    """Initial log-std of an MLP preset's action noise (the trainer's initial weights must agree)."""
    dtype: str = "float32"
    """Engine dtype of the ``llm`` preset (``LLM_DTYPES``); float32 keeps the served log-probs
    equal to the trainer's float32 recomputation, bfloat16 is faster on CPUs with AMX and on GPUs."""
    replicas: int = 1
    """Copies of the policy, each in a process of its own, taking batches side by side
    (:class:`~edgerl.edge_server.replicas.ReplicatedBackend`); 1: in the server's process."""

    def __post_init__(self) -> None:
        check_finite(self)
        check_dtype(self.dtype, self.preset)
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")

    @classmethod
    def from_options(cls, opts: Any, **fields: Any) -> PolicySpec:
        """The policy that ``opts`` (parsed CLI options or a benchmark config) names by its
        ``env``, ``policy``, ``seed``, ``torch_threads``, ``model`` and ``dtype``; plus ``fields``."""
        return cls(
            opts.env, opts.policy, opts.seed, opts.torch_threads, model=opts.model, dtype=opts.dtype, **fields
        )


def build_mlp(policy: PolicySpec, spec: Any) -> Any:
    """The fresh :class:`~edgerl.models.GaussianMLPPolicy` of ``policy`` for the env ``spec``.

    The server and the trainer both build their initial weights here, so they agree.
    """
    from edgerl.models import build_policy

    if len(spec.obs_shape) != 1 or len(spec.act_shape) != 1:
        raise ValueError(f"{policy.env_name}: the MLP policy needs flat observations and actions")
    return build_policy(
        policy.preset,
        spec.obs_shape[0],
        spec.act_shape[0] * policy.chunk,
        seed=policy.seed,
        log_std_init=policy.log_std_init,
    )


def llm_model_dir(policy: PolicySpec) -> str:
    """The model folder of an ``llm`` policy: ``policy.model``, or the small random Llama of its seed."""
    from edgerl.models.llm import tiny_llm

    return policy.model or str(tiny_llm(policy.seed))


def build_backend(policy: PolicySpec, sampling_seed: int | None = None) -> tuple[Any, Any]:
    """The policy backend ``policy`` names and the env's spaces (``EnvSpec``).

    ``llm``: a :class:`~edgerl.edge_server.llm_policy.VLLMPolicyBackend` on ``policy.model``
    (default: the small random Llama built on first use); otherwise a torch MLP preset,
    from ``policy.checkpoint`` when given. With ``policy.replicas > 1``, a
    :class:`~edgerl.edge_server.replicas.ReplicatedBackend` of them. Actions are sampled
    with ``sampling_seed`` (default: ``policy.seed``, which also seeds the weights).
    """
    import torch

    from edgerl.edge_server.policy import TorchPolicyBackend
    from edgerl.sim.envs import env_spec
    from edgerl.trainer.trainer import load_payload

    torch.set_num_threads(policy.torch_threads)
    spec = env_spec(policy.env_name)
    seed = policy.seed if sampling_seed is None else sampling_seed
    if policy.replicas > 1:
        from edgerl.edge_server.replicas import ReplicatedBackend

        # every replica builds the same policy: the small Llama is built here, once
        model = llm_model_dir(policy) if policy.preset == LLM_PRESET else policy.model
        one = replace(policy, replicas=1, model=model)
        return ReplicatedBackend(functools.partial(build_replica, one), policy.replicas), spec
    if policy.preset == LLM_PRESET:
        from edgerl.edge_server.llm_policy import VLLMPolicyBackend

        model = llm_model_dir(policy)
        llm = VLLMPolicyBackend(
            model,
            spec.obs_shape,
            spec.act_low,
            spec.act_high,
            chunk=policy.chunk,
            seed=seed,
            dtype=policy.dtype,  # type: ignore[arg-type]  # one of LLM_DTYPES (checked)
        )
        if policy.checkpoint:
            from edgerl.models.llm_actor_critic import served_weights

            payload = load_payload(policy.checkpoint, LLM_PRESET, mmap=True)
            weights = {k: v.numpy() for k, v in served_weights(payload["policy"]).items()}
            llm.load_weights(weights, int(payload["state"]["version"]))
        return llm, spec
    net = build_mlp(policy, spec)
    version = 0
    if policy.checkpoint:
        payload = load_payload(policy.checkpoint, "mlp", mmap=True)
        try:
            net.load_state_dict(payload["policy"])
        except RuntimeError as exc:  # another preset or env than the checkpoint's
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise ValueError(  # torch's first line only says that loading failed: name the first misfit
                f"checkpoint {policy.checkpoint}: its weights do not fit policy {policy.preset!r} "
                f"on {policy.env_name} ({lines[min(1, len(lines) - 1)]})"
            ) from None
        version = int(payload["state"]["version"])
    backend = TorchPolicyBackend(
        net,
        spec.act_low,
        spec.act_high,
        seed=seed,
        version=version,
        compute_values=policy.compute_values,
        chunk=policy.chunk,
    )
    return backend, spec


def build_replica(policy: PolicySpec, index: int) -> Any:
    """The backend of replica ``index`` of ``policy`` (``policy.replicas`` is 1), built in its
    process: the same weights in every replica, its own sampling seed (replica 0 that of
    ``policy``), so that replicas do not draw the same noise."""
    import numpy as np

    seed = int(np.random.SeedSequence([policy.seed, index]).generate_state(1)[0]) if index else policy.seed
    return build_backend(policy, sampling_seed=seed)[0]


#: How a command stops its edge server process (a graceful shutdown), and how a spawned process
#: whose parent died stops itself. Not SIGTERM: ``timeout``, ``kill -- -PGID`` and ``systemctl
#: stop`` send that one to every process of a command at once, and it is the command's to act on
#: (:func:`owned_by_parent`).
OWNER_STOP = signal.SIGUSR2

#: How long a process whose parent died has to end after its :data:`OWNER_STOP` before it SIGKILLs
#: itself.
ORPHAN_GRACE_S = 15.0


class OwnedProcess(multiprocessing.context.SpawnProcess):
    """A spawned process of a command, which leaves SIGTERM to the command
    (:func:`owned_by_parent`): :meth:`terminate` sends it :data:`OWNER_STOP` instead, the edge
    server's graceful stop and a sim worker's end. multiprocessing ends a command's daemonic
    processes with it at exit, where the command did not stop them itself (a command stopped
    while it waited for its server to start); with SIGTERM, which they ignore, the command's exit
    waited for them for good."""

    def terminate(self) -> None:
        if self.pid is not None and self.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(self.pid, OWNER_STOP)


def owned_by_parent() -> None:
    """Make this spawned process its parent's to stop, as multiprocessing's resource tracker is.

    It ignores :data:`STOP_SIGNALS`. A terminal's Ctrl-C and hangup, ``timeout``, ``kill --
    -PGID`` and ``systemctl stop`` send them to every process of a command at once, and the
    command answers them by stopping its workers, its trainer and then its server, in that
    order: a server or worker that ended on them at once failed the command before it was done
    with them (``edgerl train`` ended with status 1 on "the edge server process ended"). The
    parent stops it otherwise (the server with :data:`OWNER_STOP`, a worker through a shared
    flag), and it ends once the parent is gone (:func:`end_with_parent`)."""
    leave_stop_signals()
    end_with_parent()


def end_with_parent(grace_s: float = ORPHAN_GRACE_S) -> None:
    """Have this spawned process end once the process that started it is gone, as its owner's
    ``stop()`` would end it: :data:`OWNER_STOP` to itself (the edge server's graceful shutdown; a
    sim worker, which handles no such signal, just ends), then SIGKILL if it is still there
    ``grace_s`` later. A thread waits for that on multiprocessing's parent sentinel, which reads
    end-of-file when the parent dies, however it dies. Without it the edge server and the sim
    workers of a command that was killed (SIGKILL: the OOM killer's way, which picks the largest
    process, often the trainer) ran on for good, orphans, a worker at a full core. Does nothing
    in a process that was not spawned."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.kill(os.getpid(), OWNER_STOP)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="edgerl-parent-watch", daemon=True).start()


def build_server(policy: PolicySpec, config: ServerConfig) -> Any:
    """An :class:`EdgeServer` serving the backend ``policy`` names."""
    from edgerl.edge_server.server import EdgeServer

    backend, spec = build_backend(policy)
    return EdgeServer(backend, config, env_name=policy.env_name, obs_low=spec.obs_low, obs_high=spec.obs_high)


def _server_main(
    policy: PolicySpec,
    config: ServerConfig,
    conn: mp.connection.Connection,
    log_level: str,
    *,
    go: mp.connection.Connection | None = None,
    cpus: frozenset[int] | None = None,
) -> None:
    from edgerl.edge_server.server import serve_until_signal

    if cpus:
        os.sched_setaffinity(0, cpus)  # before torch and gRPC start threads, which inherit it
    configure_logging(log_level)
    owned_by_parent()

    async def main() -> None:
        server = build_server(policy, config)
        if go is not None:  # standby: built and warm, bind only when told
            server.backend.warmup()
            if not await _standby(conn, go):  # stopped before it was activated
                server.backend.close()  # a vLLM engine's processes and weights folder with it
                return
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(lambda f: conn.send(Bound(f.result(), server.metrics_port)))
        await serve_until_signal(server, ready, signals=(OWNER_STOP,))

    with _reported(conn.send, quiet=(*USER_ERRORS, BindError)):
        asyncio.run(main())


async def _standby(conn: mp.connection.Connection, go: mp.connection.Connection) -> bool:
    """Tell the parent through ``conn`` that this server is on standby, then wait for
    :meth:`ServerProcess.activate` (True), or for :data:`OWNER_STOP` or the parent's end of ``go``
    closing (False)."""
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()
    loop.add_reader(go.fileno(), woken.set)
    loop.add_signal_handler(OWNER_STOP, woken.set)
    conn.send("standby")  # once OWNER_STOP is handled: the parent may stop it at once
    await woken.wait()
    loop.remove_reader(go.fileno())
    try:
        told = bool(go.poll()) and go.recv() == "go"
    except EOFError:  # the parent is gone, or closed its end
        told = False
    if told:  # serving: serve_until_signal takes OWNER_STOP over
        loop.remove_signal_handler(OWNER_STOP)
    # else OWNER_STOP stays handled (and ignored) while the backend closes
    return told


@contextlib.contextmanager
def _reported(report: Callable[[str], object], *, quiet: tuple[type[Exception], ...]) -> Iterator[None]:
    """Run a child process's work; an error it raises goes to the parent through ``report``, as
    one line. One of the ``quiet`` kinds (the user's: a bad option, an address, a refusal) then
    ends the process with status 1, as the parent reports it and a traceback adds nothing; any
    other is raised on, its traceback printed."""
    try:
        yield
    except Exception as exc:
        with contextlib.suppress(OSError):  # the parent may be gone
            report(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, quiet):
            sys.exit(1)
        raise


class Bound(NamedTuple):
    """What a server process tells its parent once it serves: its bound ports."""

    port: int
    metrics_port: int
    """0 where it serves no metrics."""


class ServerStartError(RuntimeError):
    """The edge server process did not start; the message is its own error."""


class WorkerError(RuntimeError):
    """A sim worker process ended with an error; the message holds what it said."""


class ServerLostError(RuntimeError):
    """The edge server process ended while it was in use (killed, e.g. by the OOM killer, or
    crashed), not stopped by its owner."""


def exit_words(code: int) -> str:
    """A process's exit code in words: ``exit code 3``, ``killed by SIGKILL``."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


class ServerProcess:
    """The edge server in its own process. ``with ServerProcess(...) as s: s.address``."""

    def __init__(
        self,
        policy: PolicySpec,
        config: ServerConfig | None = None,
        *,
        log_level: str = "WARNING",
        start_timeout_s: float = 120.0,
        cpus: frozenset[int] | None = None,
    ) -> None:
        """``cpus``: the CPUs the server runs on (None: any)."""
        self.policy = policy
        self.cpus = cpus
        self.config = config or ServerConfig(port=0)
        self.log_level = log_level
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.metrics_port = 0
        """The bound port of the server's ``GET /metrics`` (``config.metrics_port``); 0: none."""
        self._proc: Any = None
        self._go: Any = None
        self._ready: Any = None

    @property
    def address(self) -> str:
        return host_port(self.config.host, self.port)

    @property
    def metrics_url(self) -> str:
        """``http://HOST:PORT/metrics`` of the server's counters; empty where it serves none."""
        if not self.metrics_port:
            return ""
        return url_of(self.config.metrics_host or self.config.host, self.metrics_port)

    @property
    def pid(self) -> int | None:
        """The server process's id; None before :meth:`start` and after :meth:`stop`."""
        return None if self._proc is None else int(self._proc.pid)

    def start(self, *, standby: bool = False) -> str:
        """Start the server; after a :meth:`kill` or :meth:`stop` it comes back on the same port
        (and metrics port).

        With ``standby=True`` the process builds and warms the policy, then waits
        for :meth:`activate` before it binds: a restart that takes milliseconds.
        """
        config = self.config
        if self.port:  # back on the ports it had
            metrics_port = self.metrics_port or config.metrics_port
            config = dataclasses.replace(config, port=self.port, metrics_port=metrics_port)
        parent, child = _CTX.Pipe(duplex=False)
        go_recv, self._go = _CTX.Pipe(duplex=False) if standby else (None, None)
        self._proc = OwnedProcess(
            target=_server_main,
            args=(self.policy, config, child, self.log_level),
            kwargs={"go": go_recv, "cpus": self.cpus},
            name="edgerl-server",
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._ready = parent
        try:
            if standby:
                self._expect("standby")
                return self.address
            return self._wait_bound()
        except BaseException:  # Ctrl-C or SIGTERM while it starts, too: it is stopped, not left
            self.stop()
            raise

    def activate(self) -> str:
        """Bind a standby server (see :meth:`start`)."""
        if self._go is None:
            raise RuntimeError("activate() needs a server started with standby=True")
        self._go.send("go")
        self._go = None
        return self._wait_bound()

    def _expect(self, what: str) -> Any:
        if not self._ready.poll(self.start_timeout_s):
            self.stop()
            raise TimeoutError(f"edge server did not start within {self.start_timeout_s}s")
        msg = self._ready.recv()
        if (what == "standby" and msg != "standby") or (what == "bound" and not isinstance(msg, Bound)):
            self.stop()
            raise ServerStartError(f"edge server failed to start: {msg}")
        return msg

    def _wait_bound(self) -> str:
        self.port, self.metrics_port = self._expect("bound")
        return self.address

    def stop(self, timeout_s: float = 15.0) -> None:
        """:data:`OWNER_STOP` (graceful shutdown), then SIGKILL after ``timeout_s``."""
        proc, self._proc = self._proc, None
        standby = self._close_go()
        if proc is None:
            return
        if standby:  # told so by its pipe closing, it closes its backend and ends
            proc.join(timeout_s)
        if proc.is_alive():
            proc.terminate()  # OWNER_STOP
            proc.join(timeout_s)
        if proc.is_alive():
            log.warning("edge server did not stop within %.0fs; killing it", timeout_s)
            proc.kill()
            proc.join()

    def check(self, wait_s: float = 0.0) -> None:
        """Raise :class:`ServerLostError` if the server process, started and not stopped, has
        ended (waiting up to ``wait_s`` for it to end: a call that just failed may have seen it
        die before its exit code is known)."""
        proc = self._proc
        if proc is None:
            return
        if wait_s > 0:
            proc.join(wait_s)
        if proc.exitcode is not None:
            raise ServerLostError(f"the edge server process ended ({exit_words(proc.exitcode)})")

    def kill(self) -> None:
        """SIGKILL: the server dies as in a crash, with no graceful shutdown."""
        proc, self._proc = self._proc, None
        self._close_go()
        if proc is not None:
            proc.kill()
            proc.join()

    def _close_go(self) -> bool:
        """Close the pipe that activates a standby server; whether there was one."""
        go, self._go = self._go, None
        if go is not None:
            go.close()
        return go is not None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def server_stats(address: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The server's counters (``Stats`` RPC) as a JSON-ready dict."""
    from edgerl.robot_client.client import EdgeClient

    async def main() -> dict[str, Any]:
        async with EdgeClient(address, timeout_s=timeout_s) as client:
            st = await client.stats()
        return {
            "requests": st.requests,
            "batches": st.batches,
            "rows": st.rows,
            "mean_batch_rows": round(st.rows / max(1, st.batches), 1),
            "max_batch_rows": st.max_batch_rows,
            "queue_wait_us_p50": st.queue_wait_us_p50,
            "queue_wait_us_p99": st.queue_wait_us_p99,
            "inference_us_p50": st.inference_us_p50,
            "inference_us_p99": st.inference_us_p99,
            "queue_wait_us_sum": st.queue_wait_us_sum,
            "inference_us_sum": st.inference_us_sum,
            "rejected_queue_full": st.rejected_queue_full,
            "rejected_invalid": st.rejected_invalid,
            "rejected_streams": st.rejected_streams,
            "failed_requests": st.failed_requests,
            "policy_version": st.policy_version,
        }

    return asyncio.run(main())


def yield_helper_threads(keep: int, done: set[int]) -> None:
    """Give every thread of this process but ``keep`` (a native thread id) the SCHED_BATCH policy.

    A sim worker's core runs its env-stepping thread beside gRPC's I/O threads (the event
    engine's and the asyncio poller), which wake several times per message. As plain threads,
    each wake preempted the stepping thread: 6 involuntary switches per 64-step cycle of
    ``mlp-large``. A SCHED_BATCH thread keeps its fair share of the core but does not preempt
    on waking; it runs when the stepping thread waits for actions or uses up its slice. With
    ``mlp-large`` this gave 5-7 % more env steps/s (worker and server on a CPU each, 3
    alternated runs: 20.1-21.4k against 19.0-20.4k). SCHED_IDLE did about as well, but it
    would starve these threads beside any busy process (a trainer) allowed on the core.
    Threads in ``done`` are skipped, and each thread handled is added to it, so calling this
    again costs one directory listing.
    """
    for tid in thread_ids():
        if tid == keep or tid in done:
            continue
        done.add(tid)
        no_wakeup_preemption(tid)


def _worker_main(config: SimWorkerConfig, link: WorkerLink, stop: SharedFlag, log_level: str) -> None:
    """A sim worker's process. Its error, if it fails, goes to its ``link`` for the fleet to
    report (see :func:`_reported`)."""
    from edgerl.robot_client.errors import EdgeRLError

    with _reported(lambda line: link.say(f"{config.session_id}: {line}"), quiet=(*USER_ERRORS, EdgeRLError)):
        _run_worker(config, link, stop, log_level)


def _run_worker(config: SimWorkerConfig, link: WorkerLink, stop: SharedFlag, log_level: str) -> None:
    from edgerl.robot_client.sim_worker import SimWorker, WorkerProgress

    configure_logging(log_level)
    if config.cpus:  # before gRPC starts threads, which inherit it
        os.sched_setaffinity(0, config.cpus)
    if config.backfill:  # as the CPU affinity: every thread started later inherits it
        idle_priority()
    owned_by_parent()  # stopped through the shared flag
    progress = WorkerProgress()
    worker = SimWorker(config, progress)
    link.built.set()  # its envs are built: what it waits for now is its server

    def report() -> None:  # on the thread that steps the envs, the one that adds episodes
        link.steps.value = progress.steps
        if progress.episode_returns:  # sent, and no longer kept: a long run finishes millions
            link.send_episodes(progress.episode_returns, progress.episode_lengths)
            progress.episode_returns.clear()
            progress.episode_lengths.clear()

    async def main() -> None:
        stepping, helpers = threading.get_native_id(), set[int]()

        async def reporter() -> None:
            while True:
                report()
                if not config.backfill:  # its threads are all at idle priority already
                    yield_helper_threads(stepping, helpers)  # gRPC may start threads at any time
                await asyncio.sleep(0.2)

        task = asyncio.get_running_loop().create_task(reporter())
        try:
            await worker.run(stop.is_set)
        finally:
            task.cancel()
            report()

    try:
        if config.network_process or config.local_socket:
            worker.run_blocking(stop.is_set, report)
        else:
            asyncio.run(main())
    finally:
        worker.close()


class SharedFlag:
    """A flag that one process sets and others read, in shared memory and without a lock.

    A multiprocessing ``Event`` takes a lock to be read as well as set. A sim worker reads its stop
    flag at every step, and one killed meanwhile (SIGKILL: the OOM killer's way) held that lock for
    good: its fleet's ``stop()`` then waited for it forever."""

    def __init__(self) -> None:
        self._value = _CTX.RawValue(ctypes.c_bool, False)

    def set(self) -> None:
        self._value.value = True

    def is_set(self) -> bool:
        return bool(self._value.value)


class WorkerLink:
    """What one sim worker process shares with its fleet, none of it behind a lock that another
    process takes: a worker killed at any point (SIGKILL) leaves its fleet and the other workers
    nothing held. Its step count and its built flag are shared memory without a lock; its episodes
    and its error line go through queues of its own. (Workers once shared one episode queue, whose
    write lock a worker killed mid-write kept from the others.)"""

    def __init__(self) -> None:
        self.steps = _CTX.RawValue(ctypes.c_int64, 0)
        self.built = SharedFlag()  # set once its envs are built
        self._episodes: Any = _CTX.Queue()
        self._errors: Any = _CTX.SimpleQueue()  # what the worker said when it failed, one line

    def send_episodes(self, returns: Sequence[float], lengths: Sequence[int]) -> None:
        """Queue finished episodes for the fleet (the worker's side), in messages of at most
        :data:`EPISODES_PER_MESSAGE`."""
        episodes = [(float(r), int(n)) for r, n in zip(returns, lengths, strict=True)]
        for i in range(0, len(episodes), EPISODES_PER_MESSAGE):
            self._episodes.put(episodes[i : i + EPISODES_PER_MESSAGE])

    def take_episodes(self) -> list[tuple[float, int]]:
        """The episodes queued since the last call, as (return, length); never waits."""
        new: list[tuple[float, int]] = []
        while True:
            try:
                new.extend(self._episodes.get_nowait())
            except queue.Empty:
                return new

    def say(self, line: str) -> None:
        """Tell the fleet why the worker failed (the worker's side), in :data:`MAX_SAID_CHARS` at
        most: a longer line ends in ``...``."""
        if len(line) > MAX_SAID_CHARS:
            line = line[: MAX_SAID_CHARS - 3] + "..."
        self._errors.put(line)

    def said(self) -> list[str]:
        """What the worker said when it failed: one line, or none."""
        lines = []
        while not self._errors.empty():
            lines.append(self._errors.get())
        return lines


def fleet_groups(groups: int, num_envs: int, num_workers: int) -> int:
    """Env groups per sim worker for ``groups`` (``--groups``): as given, or for 0 two
    (double-buffered), one where a worker has a single env."""
    if groups:
        return groups
    return 2 if num_envs >= 2 * num_workers else 1


def largest_request(num_envs: int, num_workers: int, groups: int, backfill_envs: int = 0) -> int:
    """The most rows one step of a group of such a fleet holds (the backfill worker's is one
    group of all its envs): a server whose ``max_batch_size`` is as large takes each group's
    step in one message, and computes it in one forward pass."""
    per_stream = -(-(num_envs - backfill_envs) // num_workers)
    return max(-(-per_stream // groups), backfill_envs)


def check_fleet(
    num_envs: int,
    num_workers: int,
    groups: int,
    *,
    max_envs_per_stream: int = 0,
    backfill_envs: int = 0,
) -> None:
    """Raise ValueError, naming the options, unless ``num_workers`` sim workers can share
    ``num_envs`` envs, less ``backfill_envs`` for a backfill worker, with ``groups`` env groups
    each, and (``max_envs_per_stream`` > 0: the limit of the server a command starts itself)
    each worker's stream stays within the server's limit. (A group of more envs than the
    server's ``max_batch_size`` steps in several messages.) Commands call it before they start
    anything; :class:`WorkerFleet` checks again."""
    if num_workers < 1:
        raise ValueError(f"workers must be >= 1, got {num_workers}")
    if not 0 <= backfill_envs < num_envs:
        raise ValueError(f"backfill envs must be in [0, envs={num_envs}), got {backfill_envs}")
    envs = num_envs - backfill_envs
    if envs < num_workers * groups:
        less = f" less backfill envs ({num_envs} - {backfill_envs})" if backfill_envs else ""
        raise ValueError(f"envs{less} ({envs}) must be >= workers x groups ({num_workers} x {groups})")
    per_stream = -(-envs // num_workers)
    if 0 < max_envs_per_stream < max(per_stream, backfill_envs):
        if backfill_envs > per_stream:
            raise ValueError(
                f"backfill envs ({backfill_envs}) are all on one stream, and the server takes at "
                f"most {max_envs_per_stream} per stream"
            )
        raise ValueError(
            f"envs ({envs}) over workers ({num_workers}) puts {per_stream} envs on a worker's "
            f"stream, and the server takes at most {max_envs_per_stream} per stream: use workers >= "
            f"{-(-envs // max_envs_per_stream)}"
        )


class WorkerFleet:
    """``num_workers`` sim worker processes sharing ``num_envs`` envs between them, and with
    ``backfill_envs`` one more, a backfill worker, that steps those of them in the CPU time the
    others and the server leave idle."""

    def __init__(
        self,
        config: SimWorkerConfig,
        num_workers: int,
        *,
        log_level: str = "WARNING",
        worker_cpus: Sequence[int] = (),
        backfill_envs: int = 0,
    ) -> None:
        """``worker_cpus``: worker i runs on CPU ``worker_cpus[i % len(worker_cpus)]`` (empty: any);
        the backfill worker on this process's other CPUs (the server's), or on any where
        ``worker_cpus`` leaves none."""
        check_fleet(config.num_envs, num_workers, config.groups, backfill_envs=backfill_envs)
        self.config = config
        self.num_workers = num_workers
        self.log_level = log_level
        self.worker_cpus = tuple(worker_cpus)
        self.backfill_envs = backfill_envs
        self._stop = SharedFlag()
        self._links: list[WorkerLink] = []  # per worker, in worker order
        self._procs: list[Any] = []
        self.episodes = EpisodeLog()  # what the workers finished

    def _configs(self) -> list[SimWorkerConfig]:
        """Each worker's config, the backfill worker's last."""
        cfg = self.config
        envs = cfg.num_envs - self.backfill_envs
        bounds = [envs * i // self.num_workers for i in range(self.num_workers + 1)]
        # a fleet without a session id is its host and pid (pid.K for a process's later fleets):
        # two fleets against one server would otherwise share names and take each other's over
        name = cfg.session_id or host_session_id()

        def steps(n: int) -> int:  # a worker's share of max_steps, by its envs
            return cfg.max_steps * n // cfg.num_envs if cfg.max_steps else 0

        configs = [
            replace(
                cfg,
                num_envs=n,
                seed=cfg.seed + bounds[i],
                session_id=f"{name}/worker-{i}",
                max_steps=steps(n),
                cpus=(self.worker_cpus[i % len(self.worker_cpus)],) if self.worker_cpus else cfg.cpus,
            )
            for i, n in enumerate(b - a for a, b in itertools.pairwise(bounds))
        ]
        if self.backfill_envs:
            n = self.backfill_envs
            configs.append(
                replace(
                    cfg,
                    num_envs=n,
                    groups=1,
                    seed=cfg.seed + envs,
                    session_id=f"{name}/backfill",
                    max_steps=steps(n),
                    cpus=tuple(sorted(other_cpus(self.worker_cpus) or ())) or cfg.cpus,
                    network_process=False,  # its stream costs little CPU, and it gets what is left
                    network_cpus=(),
                    backfill=True,
                )
            )
        return configs

    def start(self) -> None:
        try:
            for i, wcfg in enumerate(self._configs()):
                link = WorkerLink()
                proc = OwnedProcess(
                    target=_worker_main,
                    args=(wcfg, link, self._stop, self.log_level),
                    name=f"edgerl-sim-{i}",
                    daemon=True,
                )
                proc.start()
                self._links.append(link)
                self._procs.append(proc)
        except BaseException:  # Ctrl-C or SIGTERM among the starts: those started are stopped
            self.stop()
            raise

    def total_steps(self) -> int:
        return sum(self.worker_steps())

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers started, in worker order."""
        return [int(p.pid) for p in self._procs]

    def alive(self) -> int:
        return sum(p.is_alive() for p in self._procs)

    def failed(self) -> list[int]:
        """Exit codes of workers that ended with an error."""
        return [p.exitcode for p in self._procs if p.exitcode not in (None, 0)]

    def check(self) -> None:
        """Raise :class:`WorkerError` if a worker ended with an error, with what it said."""
        codes = self.failed()
        if not codes:
            return
        said = [line for link in self._links for line in link.said()]
        ended = ", ".join(exit_words(code) for code in codes)
        which = "a sim worker process" if len(codes) == 1 else f"{len(codes)} sim worker processes"
        raise WorkerError(f"{which} ended ({ended})" + "".join(f"; {s}" for s in said))

    def poll_episodes(self) -> list[tuple[float, int]]:
        """Episodes finished since the last call, as (return, length)."""
        new = [episode for link in self._links for episode in link.take_episodes()]
        self.episodes.extend(new)
        return new

    def worker_steps(self) -> list[int]:
        """Env steps taken so far by each worker."""
        return [int(link.steps.value) for link in self._links]

    def wait_started(
        self,
        timeout_s: float | None = 120.0,
        *,
        every: bool = True,
        note_after_s: float = 3.0,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """Block until every worker (``every=False``: any worker) has stepped at least once, or
        ``should_stop()`` (a command's stop flag, set by Ctrl-C or SIGTERM).

        Against a server with admission control, wait for any worker only: the
        first one up can fill the server's window before the others connect, and
        then they step only once a trainer takes what is pending. Workers keep
        reconnecting to a server that is not up yet. Past ``note_after_s`` this says once, on
        stderr, what they wait for: workers that still build their envs (many envs take
        seconds), then the server (``note_after_s`` after the last worker's envs were built).

        Raises:
            WorkerError: a worker failed, or they had not started within ``timeout_s``
                (``None``: no limit).
        """
        start = time.monotonic()
        started = all if every else any
        noted: set[str] = set()  # the waits said once each: "build", then "server"
        built_at: float | None = None
        while not started(steps > 0 for steps in self.worker_steps()) and not should_stop():
            self.check()
            now = time.monotonic()
            building = sum(not link.built.is_set() for link in self._links)
            if not building and built_at is None:
                built_at = now
            what = (
                f"{building} of {self.num_workers} sim worker(s) to build their envs"
                if building
                else self._target()
            )
            if timeout_s is not None and now - start > timeout_s:
                raise WorkerError(
                    f"sim workers had not started within {timeout_s:g}s, waiting for {what}"
                    " (their warnings above say why)"
                )
            phase = "build" if building else "server"
            if phase not in noted and now - (built_at or start) > note_after_s:
                noted.add(phase)
                retry = "" if building else " (the workers retry with backoff)"
                print(f"edgerl: waiting for {what}{retry}", file=sys.stderr, flush=True)
            time.sleep(0.05)

    def _target(self) -> str:
        cfg = self.config
        return f"the local socket {cfg.local_socket}" if cfg.local_socket else f"the server at {cfg.server}"

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the workers (killed if they have not exited within ``timeout_s``) and collect the
        episodes they finished."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            # A worker exits only once the episodes it queued are read: its queue's feeder
            # thread waits on the full pipe. Unread since the start, they fill it in seconds
            # where episodes are short.
            while p.is_alive() and time.monotonic() < deadline:
                self.poll_episodes()
                p.join(0.05)
            if p.is_alive():
                p.kill()
                p.join()
        self.poll_episodes()

    def __enter__(self) -> WorkerFleet:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
