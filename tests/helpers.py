"""Shared test helpers: test policies, a server started on port 0, a random training batch."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest

from edgerl.edge_server.backend import PolicyBackend, PolicyResult
from edgerl.edge_server.server import EdgeServer, ServerConfig
from edgerl.edge_server.transitions import StreamHandle, TransitionStore
from edgerl.edge_server.validation import StreamSpec, check_hello
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.robot_client import errors, netproc
from edgerl.robot_client.client import Actions, EdgeClient
from edgerl.robot_client.security import ClientSecurity
from edgerl.robot_client.sim_worker import SimWorker
from edgerl.trainer.segments import Batch


@contextlib.contextmanager
def unclosed_resources() -> Iterator[list[str]]:
    """The messages of the ResourceWarnings raised inside the block or by a collection at its
    end (an object dropped there unclosed): the list it yields is filled when the block ends."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield found
        gc.collect()
    found += [str(w.message) for w in caught if w.category is ResourceWarning]


class EchoPolicy(PolicyBackend):
    """Action = first act_dim observation entries, log-prob = row sum: lets a test check that
    every env received the answer computed from its own observation. With ``fail_on``, a
    forward pass over a batch holding that value raises (a model that breaks on some input)."""

    name = "echo"

    def __init__(
        self, obs_dim: int, act_dim: int, delay_s: float = 0.0, fail_on: float | None = None
    ) -> None:
        super().__init__((obs_dim,), (act_dim,), -np.ones(act_dim), np.ones(act_dim))
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.batch_sizes: list[int] = []

    def infer(self, obs: np.ndarray) -> PolicyResult:
        self.batch_sizes.append(obs.shape[0])
        if self.fail_on is not None and (obs == self.fail_on).any():
            raise RuntimeError(f"cannot act on {self.fail_on:g}")
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow model, like Gymnasium's SlowEnv
        act_dim = self.act_shape[0]
        return PolicyResult(
            actions=np.ascontiguousarray(obs[:, :act_dim], dtype=np.float32),
            log_probs=obs.sum(1).astype(np.float32),
        )


class GatedPolicy(EchoPolicy):
    """The echo policy whose forward passes wait while :attr:`gate` is clear (30 s at most): a
    model that hangs, or a server that stalls (its host paused, a model loading), until the test
    lets it go. The gate starts clear unless ``open``; :attr:`entered` is set once a forward pass
    has come to it."""

    def __init__(self, obs_dim: int, act_dim: int, *, open: bool = False) -> None:
        super().__init__(obs_dim, act_dim)
        self.gate = threading.Event()
        if open:
            self.gate.set()
        self.entered = threading.Event()

    def infer(self, obs: np.ndarray) -> PolicyResult:
        self.entered.set()
        self.gate.wait(30)
        return super().infer(obs)

    def warmup(self, rows: int = 8) -> None:
        """Through an open gate; none at a closed one, where a server's start would wait for it."""
        if self.gate.is_set():
            super().warmup(rows)


class Link:
    """A TCP link to ``127.0.0.1:target_port`` that can go silent or be cut.

    After :meth:`go_silent` it still holds the connections open through it but delivers nothing
    on them either way, as a link that died without a FIN or RST does (a robot's power cut, a
    cable pulled, Wi-Fi out of range); new ones go through (the robot's next route), unless
    :attr:`mute_new` is set (from any thread): then they are accepted and go silent at once (a
    route still down).
    :meth:`cut` resets the connections through it, as a network error does; new ones go
    through.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._silent: set[asyncio.StreamWriter] = set()  # the writers of silenced connections
        self.mute_new = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Link:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        for writer in self._writers:
            writer.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def go_silent(self) -> None:
        """Deliver nothing more on the connections open now."""
        self._silent.update(self._writers)

    def cut(self) -> None:
        """Reset both ends of every connection through the link (on its event loop)."""
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]
        if self.mute_new:
            self._silent.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.get_running_loop().create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):  # cut
            while data := await src.read(65536):
                if dst not in self._silent:  # silent: read and dropped, so the sender's writes still succeed
                    dst.write(data)
                    await dst.drain()


def hellos_checked(monkeypatch: pytest.MonkeyPatch) -> list[pb.StreamHello]:
    """Every stream hello the server checks from now on, in order (for the test's duration)."""
    seen: list[pb.StreamHello] = []

    def spy(hello: pb.StreamHello, *args: Any) -> StreamSpec:
        seen.append(hello)
        return check_hello(hello, *args)

    monkeypatch.setattr("edgerl.edge_server.service.check_hello", spy)
    return seen


def request_numbers_taken(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[int]]:
    """Each env's request numbers (``StepObservation.obs_index``) as the transition store takes
    them in, in order, from now on; -1 for a row whose message gave none."""
    numbers: dict[int, list[int]] = {}
    observe = TransitionStore.observe

    def spy(self: TransitionStore, handle: StreamHandle, env_ids: np.ndarray, *args: Any, **kw: Any) -> None:
        index = kw["obs_index"]
        told = [-1] * len(env_ids) if index is None else index.tolist()
        for e, i in zip(env_ids.tolist(), told, strict=True):
            numbers.setdefault(e, []).append(i)
        observe(self, handle, env_ids, *args, **kw)

    monkeypatch.setattr(TransitionStore, "observe", spy)
    return numbers


@contextlib.asynccontextmanager
async def running_server(
    backend: PolicyBackend, *, env_name: str = "", **config: object
) -> AsyncIterator[EdgeServer]:
    """A real edge server on 127.0.0.1, port 0 (its policy for ``env_name``, where given)."""
    server = EdgeServer(backend, ServerConfig(port=0, **config), env_name=env_name)  # type: ignore[arg-type,unused-ignore]
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=1.0)


async def act_once(
    address: str,
    obs: np.ndarray,
    *,
    session_id: str = "test",
    timeout_s: float = 30.0,
    security: ClientSecurity | None = None,
) -> Actions:
    """Open an Act stream for ``len(obs)`` envs, send one step, and return its answer."""
    n = len(obs)
    async with EdgeClient(address, timeout_s=timeout_s, security=security) as c:
        stream = await c.open_stream(session_id=session_id, num_envs=n, obs_shape=obs.shape[1:])
        await stream.send(list(range(n)), obs, np.zeros(n), [False] * n, [False] * n)
        answer = await stream.recv()
        await stream.close()
        return answer


async def refused_hellos(address: str, obs_dim: int, tries: int) -> list[tuple[str, grpc.StatusCode, str]]:
    """Open ``tries`` streams whose hello the server refuses (observations of ``obs_dim``, not
    the server's), each with two groups' steps sent right after it, as a double-buffered worker
    sends them. For each: the error :class:`EdgeClient` raised (its type and message), and the
    call's own status, which gRPC may have overwritten (grpc/grpc#36066)."""
    got = []
    async with EdgeClient(address) as client:
        for _ in range(tries):
            stream = await client.open_stream(
                session_id="s", num_envs=2, obs_shape=(obs_dim,), max_inflight=2
            )
            raised = "nothing"
            try:
                for ids in ([0], [1]):
                    await stream.send(ids, np.zeros((1, obs_dim)), [0.0], [False], [False])
                await stream.recv()
            except errors.EdgeRLError as exc:
                raised = f"{type(exc).__name__}: {exc}"
            got.append((raised, await stream._call.code(), await stream._call.details()))
            await stream.close()
    return got


T = TypeVar("T")

EDGERL = [sys.executable, "-m", "edgerl.launch"]
"""The ``edgerl`` command in this interpreter, wherever its console script is."""


def file_size_limited(limit: int, command: list[str]) -> list[str]:
    """``command`` run with files that cannot grow past ``limit`` bytes: a write past it fails with
    EFBIG (SIGXFSZ, which would kill the process, is ignored): a full disk, for its files alone."""
    code = (
        "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); "
        "os.execv(sys.argv[2], sys.argv[2:])"
    )
    return [sys.executable, "-c", code, str(limit), *command]


@contextlib.contextmanager
def serving(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``edgerl serve --port 0 ARGS`` running: yields its process and its first line of output
    ("edgerl: serving ENV on ADDRESS"). After the block the server gets SIGTERM, and the test
    fails unless it exits 0 within 60 s; a block that stopped it checks its exit itself, and a
    block that raised kills it."""
    command = [*EDGERL, "serve", "--port", "0", *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        try:
            yield proc, proc.stdout.readline()
        except BaseException:
            proc.kill()
            raise
        if proc.poll() is None:
            proc.terminate()
            assert proc.wait(timeout=60) == 0


Spawned = list[tuple[float, subprocess.Popen[bytes]]]


def first_spawn_runs_on(spawned: Spawned) -> Callable[..., tuple[socket.socket, subprocess.Popen[bytes]]]:
    """A stand-in for ``netproc.spawn`` whose first process holds no end of its socket (which reads
    as closed at once) and sleeps on; later ones are real network processes. Each start is recorded
    in ``spawned`` as (time, process)."""
    spawn = netproc.spawn

    def first_runs_on(cpus: tuple[int, ...] = ()) -> tuple[socket.socket, subprocess.Popen[bytes]]:
        if spawned:
            sock, proc = spawn(cpus)
        else:
            sock, child = socket.socketpair()
            sock.setblocking(False)
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            child.close()
        spawned.append((time.monotonic(), proc))
        return sock, proc

    return first_runs_on


def child_pids(pid: int) -> list[int]:
    """The ids of process ``pid``'s children (Linux's ``/proc/PID/task/PID/children``)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def spawned_children(pid: int) -> list[int]:
    """The children of process ``pid`` that multiprocessing spawned (a command's server and
    workers; not its resource tracker)."""
    spawned = []
    for child in child_pids(pid):
        with contextlib.suppress(OSError):  # ended meanwhile
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                spawned.append(child)
    return spawned


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie that its new parent has not reaped has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_until(condition: Callable[[], T], timeout_s: float, poll_s: float = 0.1) -> T:
    """Calls ``condition`` every ``poll_s`` until it returns a true value or ``timeout_s`` passed,
    and returns its last value: the caller asserts on it, or on what the wait was for."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return value


async def waited(condition: Callable[[], T], timeout_s: float, poll_s: float = 0.01) -> T:
    """``wait_until`` inside an event loop: polls without blocking it, so that the server or
    worker the condition waits on runs meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
    return value


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on (for a server that comes up late, or never)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(coro: object, timeout_s: float = 120.0) -> object:
    """Run a coroutine to completion with a hard timeout."""

    async def bounded() -> object:
        return await asyncio.wait_for(coro, timeout_s)  # type: ignore[arg-type]

    return asyncio.run(bounded())


def run_without_warnings(
    coro: object, caplog: pytest.LogCaptureFixture, level: int = logging.WARNING
) -> None:
    """:func:`run` ``coro``, then assert that nothing was logged at ``level`` or above (by edgerl,
    gRPC or asyncio): for a case the server must take in its stride (:func:`run_without_errors`
    for one it may warn of). Earlier tests' gRPC leftovers are taken first
    (:func:`take_earlier_leftovers`)."""
    take_earlier_leftovers(caplog)
    with caplog.at_level(logging.WARNING):
        run(coro)
    faults = [r for r in caplog.records if r.levelno >= level]
    assert faults == [], [r.getMessage() for r in faults]


def run_without_errors(coro: object, caplog: pytest.LogCaptureFixture) -> None:
    """:func:`run_without_warnings` at ERROR: warnings may be logged, errors not."""
    run_without_warnings(coro, caplog, logging.ERROR)


class ServerThread:
    """A real edge server on its own event-loop thread, for tests whose clients block.

    ``kill()`` stops it at once (no grace) and ``restart()`` brings it back on the same port.
    It owns its backend, as ``edgerl serve`` does: ``close()`` (the end of a ``with``) stops the
    server, then closes the backend (its replica processes, its engine thread).
    """

    def __init__(self, backend: PolicyBackend, env_name: str = "", **config: object) -> None:
        import threading

        self.backend = backend
        self.env_name = env_name
        self.config = config
        self.port = 0
        self.server: EdgeServer | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _call(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(60)  # type: ignore[arg-type]

    def start(self) -> ServerThread:
        async def go() -> None:
            cfg = ServerConfig(port=self.port, **self.config)  # type: ignore[arg-type,unused-ignore]
            self.server = EdgeServer(self.backend, cfg, env_name=self.env_name)
            self.port = await self.server.start()

        self._call(go())
        return self

    @contextlib.contextmanager
    def link(self) -> Iterator[Link]:
        """A :class:`Link` to the server's port, on the server's loop, for the block (cut it with
        ``in_loop(link.cut)``)."""
        link = Link(self.port)
        self._call(link.__aenter__())
        try:
            yield link
        finally:
            self._call(link.__aexit__())

    def in_loop(self, fn: object) -> object:
        """Run ``fn()`` on the server's loop thread and return its result."""

        async def call() -> object:
            return fn()  # type: ignore[operator]

        return self._call(call())

    def lost_and_segments(self) -> tuple[int, list[pb.Segment]]:
        """The steps the server counted lost at disconnects (``transitions_dropped_disconnect``)
        and the segments it holds for a trainer, taken as one with an unbounded window takes them."""

        def taken() -> tuple[int, list[pb.Segment]]:
            assert self.server is not None and self.server.store is not None
            store = self.server.store
            store.ack(0, 1 << 30)
            return store.counters.transitions_dropped_disconnect, store.take_sendable()

        result = self.in_loop(taken)
        assert isinstance(result, tuple)
        return result

    def kill(self, grace_s: float = 0.0) -> None:
        """Stop the server: at once, or after ``grace_s`` for what is in flight."""
        if self.server is not None:
            self._call(self.server.stop(grace_s=grace_s))
            self.server = None

    def restart(self) -> None:
        self.start()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self.kill()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self._loop.close()
            self.backend.close()

    def __enter__(self) -> ServerThread:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def random_batch(
    rng: np.random.Generator,
    n: int,
    obs_dim: int,
    act_dim: int,
    *,
    versions: np.ndarray | None = None,
    fallback: np.ndarray | None = None,
    autoreset: np.ndarray | None = None,
) -> Batch:
    """``n`` random transitions of one segment (random observations, actions, log-probs, rewards)."""
    f, none = np.float32, np.zeros(n, bool)
    end = np.zeros(n, bool)
    end[-1] = True
    return Batch(
        obs_ext=rng.standard_normal((n + 1, obs_dim)).astype(f),
        obs_index=np.arange(n),
        next_index=np.arange(1, n + 1),
        actions=rng.standard_normal((n, act_dim)).astype(f),
        log_probs=rng.standard_normal(n).astype(f) - 2.0,
        served_values=np.zeros(n, f),
        versions=np.zeros(n, np.int64) if versions is None else versions,
        rewards=rng.standard_normal(n).astype(f),
        raw_rewards=np.zeros(n, f),
        terminated=none.copy(),
        truncated=none.copy(),
        fallback=none.copy() if fallback is None else fallback,
        autoreset=none.copy() if autoreset is None else autoreset,
        segment_end=end,
        last_seq=1,
    )


class PidEcho(EchoPolicy):
    """An :class:`EchoPolicy` whose log-probs are the answering process's pid: which replica answered."""

    def infer(self, obs: np.ndarray) -> PolicyResult:
        return PolicyResult(super().infer(obs).actions, np.full(len(obs), os.getpid(), np.float32))


class BrokenPidEcho(PidEcho):
    """A :class:`PidEcho` of 4 obs and 2 action dims that breaks on some input: a batch holding
    1 raises a RuntimeError, one holding 2 an error that does not pickle (it holds a lock)."""

    def __init__(self) -> None:
        super().__init__(4, 2, fail_on=1.0)

    def infer(self, obs: np.ndarray) -> PolicyResult:
        if (obs == 2.0).any():
            error = RuntimeError("cannot act on 2")
            error.lock = threading.Lock()  # type: ignore[attr-defined]
            raise error
        return super().infer(obs)


def broken_pid_echo(index: int) -> PolicyBackend:
    """A replica factory (picklable): a :class:`BrokenPidEcho`."""
    return BrokenPidEcho()


def slow_pid_echo(index: int, delay_s: float = 1.0) -> PolicyBackend:
    """A replica factory (picklable): a :class:`PidEcho` of 4 obs and 2 action dims taking ``delay_s``."""
    return PidEcho(4, 2, delay_s=delay_s)


def pid_echo_built_in(index: int, build_s: float) -> PolicyBackend:
    """A replica factory (picklable): a :class:`PidEcho` of 4 obs and 2 action dims that takes
    ``build_s`` to build (deaf to a stop meanwhile, as a backend loading weights is)."""
    time.sleep(build_s)
    return PidEcho(4, 2)


def _run_a_later_grpc_loop() -> None:
    """Collect garbage, then run an event loop that uses gRPC (a call to a port nobody serves,
    then half a second), as the next task of a process would. Where an earlier loop left a gRPC
    completion pending, it arrives now, into that closed loop, and asyncio logs "Event loop is
    closed" (grpc/grpc#26887). A call still open when its loop ended lets go of its operations
    when it is collected, which the cyclic collector may do at any time: collecting first makes
    such a call's completion arrive here."""
    gc.collect()

    async def later() -> None:
        async with EdgeClient("127.0.0.1:1", timeout_s=0.5) as client:
            with contextlib.suppress(errors.ServerUnavailableError):
                await client.describe()
        await asyncio.sleep(0.5)

    asyncio.run(later())


def take_earlier_leftovers(caplog: pytest.LogCaptureFixture) -> None:
    """Let what earlier tests' event loops left pending with gRPC arrive now, and empty the log:
    a test that asserts what was logged then counts its own records only. A gRPC completion of a
    call whose loop has closed arrives in the next loop that uses gRPC, which logs "Event loop is
    closed" at ERROR (grpc/grpc#26887): an earlier test's leftover once failed a test of the
    server's logs so."""
    _run_a_later_grpc_loop()
    caplog.clear()


@contextlib.contextmanager
def nothing_left_for_a_later_loop(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Assert that the block's event loops leave no gRPC completion pending: one that arrives
    after its loop has closed makes the next loop using gRPC log "Event loop is closed".

    Earlier tests' leftovers are taken first (:func:`take_earlier_leftovers`), so that only the
    block's own count; after the block a later loop runs again, and finds a call the block left
    open where it was left. The block may read ``caplog.text`` for its own records."""
    take_earlier_leftovers(caplog)
    yield
    _run_a_later_grpc_loop()
    assert "Event loop is closed" not in caplog.text


def check_machine_block(result: dict[str, Any]) -> None:
    """A bench's JSON carries the machine it ran on and the time of the ``mlp-large`` layer's
    32-row product before and after its runs."""
    block = result["machine"]
    assert block["cpus"] == os.cpu_count() and block["cpu_model"]
    gemm = block["gemm_32x1040_ms"]
    assert set(gemm) == {"before", "after"}
    # 0.01 ms would be 7 TFLOP/s on one core, 100 ms a tenth of a GFLOP/s: another unit
    assert all(math.isfinite(v) and 0.01 < v < 100.0 for v in gemm.values()), gemm


FAULT = "a fault of the server's own"
FAULT_MESSAGE = f"the server failed on this stream: RuntimeError: {FAULT}"
"""What a stream hears when a fault injected with :func:`inject_fault` hits it."""


def inject_fault(owner: Any, name: str, when: Callable[..., bool], monkeypatch: pytest.MonkeyPatch) -> str:
    """Make ``owner.name`` (a module's function, or a class's method) raise, as a bug of the
    server's would, on the calls whose arguments ``when`` accepts; returns :data:`FAULT_MESSAGE`."""
    real = getattr(owner, name)

    def faulty(*args: Any) -> Any:
        if when(*args):
            raise RuntimeError(FAULT)
        return real(*args)

    monkeypatch.setattr(owner, name, faulty)
    return FAULT_MESSAGE


def on_session(session_id: str) -> Callable[..., bool]:
    """A ``when`` of :func:`inject_fault`: the calls for the stream ``session_id``, named by the
    ``StreamSpec`` or transition-store ``StreamHandle`` among their arguments."""
    from edgerl.edge_server.transitions import StreamHandle
    from edgerl.edge_server.validation import StreamSpec

    def when(*args: Any) -> bool:
        specs = [a.session_id for a in args if isinstance(a, StreamSpec)]
        handles = [a.session.session_id for a in args if isinstance(a, StreamHandle)]
        return session_id in specs + handles

    return when


@contextlib.contextmanager
def stepping(worker: SimWorker) -> Iterator[dict[str, Any]]:
    """The worker on a thread of its own during the block (``run_blocking`` with a network process
    or the local socket, else ``run`` on an event loop of that thread, the stream on the worker),
    stopped and closed at its end; the dict it yields then holds the worker's ``progress``, or the
    ``error`` it raised."""
    stop = threading.Event()
    result: dict[str, Any] = {}
    cfg = worker.config

    def work() -> None:
        try:
            if cfg.network_process or cfg.local_socket:
                result["progress"] = worker.run_blocking(stop.is_set)
            else:
                result["progress"] = asyncio.run(worker.run(stop.is_set))
        except Exception as exc:  # for the test to report
            result["error"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join(30)
        worker.close()


def steps_on(worker: SimWorker, steps: int = 500) -> bool:
    """Whether the worker steps ``steps`` more env steps within 30 s."""
    before = worker.progress.steps
    return bool(wait_until(lambda: worker.progress.steps > before + steps, timeout_s=30.0, poll_s=0.02))
