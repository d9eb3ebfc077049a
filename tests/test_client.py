"""The streaming client and sim worker against a real server."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from edgerl.edge_server.server import EdgeServer, ServerConfig
from edgerl.edge_server.transitions import StreamHandle, TransitionConfig, TransitionStore
from edgerl.proto import frames
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.robot_client import client as client_module
from edgerl.robot_client import errors, netproc
from edgerl.robot_client.client import EdgeClient
from edgerl.robot_client.netproc import HUNG_AFTER_S
from edgerl.robot_client.sim_worker import ENDING_GRACE_S, SimWorker, SimWorkerConfig
from edgerl.trainer.segments import EpisodeTracker, assemble
from tests.helpers import (
    EchoPolicy,
    GatedPolicy,
    ServerThread,
    Spawned,
    first_spawn_runs_on,
    free_port,
    nothing_left_for_a_later_loop,
    refused_hellos,
    request_numbers_taken,
    run,
    running_server,
    stepping,
    steps_on,
    wait_until,
    waited,
)


def test_error_types_carry_their_grpc_code() -> None:
    class Fake(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self) -> str:
            return "queue full"

    err = errors.from_grpc(Fake())
    assert isinstance(err, errors.ResourceExhaustedError)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(err) == "RESOURCE_EXHAUSTED: queue full"


def _worker(server: str, **fields: Any) -> SimWorker:
    """A sim worker of InvertedPendulum-v5 envs (unless ``env_name`` says otherwise) against ``server``."""
    fields.setdefault("env_name", "InvertedPendulum-v5")
    return SimWorker(SimWorkerConfig(server=server, **fields))


def _store_of(server: ServerThread) -> TransitionStore:
    assert server.server is not None and server.server.store is not None
    return server.server.store


def _segments_taken(server: ServerThread) -> list[pb.Segment]:
    """The segments the server holds for a trainer, taken as one with an unbounded window takes
    them (call it on the server's loop)."""
    store = _store_of(server)
    store.ack(0, 1 << 30)
    return store.take_sendable()


def _worker_on(transport: str, address: str, path: str, session_id: str, **fields: Any) -> SimWorker:
    """A sim worker of 4 envs on ``transport``: its stream its own or a network process's (both to
    ``address``), or on the local socket at ``path``; quick to reconnect."""
    return _worker(
        "" if path else address,
        num_envs=4,
        session_id=session_id,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
        network_process=transport == "network-process",
        local_socket=path,
        **fields,
    )


@pytest.mark.parametrize("network_process", [False, True], ids=["stream-on-worker", "network-process"])
def test_sim_worker_runs_real_envs_through_the_server(network_process: bool) -> None:
    async def main() -> None:
        async with running_server(EchoPolicy(4, 1)) as server:
            worker = _worker(
                server=f"127.0.0.1:{server.port}",
                num_envs=6,
                groups=2,
                max_steps=600,
                network_process=network_process,
            )
            progress = await worker.run()
            worker.close()
            stats = server.batcher.stats
        assert progress.steps == 600
        # Every step answered, plus at most the last sends, in flight at the end: closing the
        # stream cancels what is unanswered, and a last send can go before the server reads it
        # (on a loaded machine 5 of 20 runs lost one), or stay in the network process.
        assert 600 <= stats.rows <= 600 + 6
        # Echoing the first observation entry as the action pushes the cart the way it leans: episodes end.
        assert len(progress.episode_returns) > 0
        assert all(length >= 1 for length in progress.episode_lengths)
        assert progress.reconnects == 0

    run(main())


@pytest.mark.parametrize("network_process", [False, True], ids=["stream-on-worker", "network-process"])
def test_worker_reconnects_with_backoff_until_the_server_comes_up(network_process: bool) -> None:
    async def main() -> None:
        port = free_port()
        worker = _worker(
            server=f"127.0.0.1:{port}",
            num_envs=4,
            max_steps=200,
            timeout_s=1.0,
            backoff_initial_s=0.05,
            backoff_max_s=0.2,
            network_process=network_process,
        )
        task = asyncio.ensure_future(worker.run())
        await asyncio.sleep(1.5)  # nothing listens yet: the worker keeps retrying
        assert not task.done()
        assert worker.progress.reconnects >= 1
        server = EdgeServer(EchoPolicy(4, 1), ServerConfig(port=port))
        await server.start()
        try:
            progress = await asyncio.wait_for(task, 60)
        finally:
            await server.stop(0.5)
            worker.close()
        assert progress.steps == 200

    run(main())


@pytest.mark.parametrize("network_process", [False, True], ids=["stream-on-worker", "network-process"])
def test_a_sim_worker_rides_through_server_restarts(network_process: bool) -> None:
    """A server that stops, gracefully (what is in flight answered, the rest refused with
    UNAVAILABLE) or at once, and comes back on its port: each time the worker's stream ends
    with a failure it retries, and the worker reconnects with backoff and steps on."""
    with ServerThread(EchoPolicy(4, 1)) as server:
        worker = _worker(
            server.address,
            num_envs=8,
            backoff_initial_s=0.05,
            backoff_max_s=0.2,
            network_process=network_process,
        )
        with stepping(worker) as result:
            for grace_s in (0.5, 0.0, 0.5, 0.0):
                assert steps_on(worker, 200)
                server.kill(grace_s)
                time.sleep(0.2)
                server.restart()
            assert steps_on(worker, 200)
    assert "error" not in result, result
    assert result["progress"].reconnects >= 4


def test_closing_a_stream_whose_read_was_cancelled_with_a_write_in_flight_ends_quietly() -> None:
    """A cancelled read cancels its gRPC call, and gRPC then fails the write still in flight
    with asyncio.CancelledError, as it fails a later read. close() raised it: a sim worker
    stopped while it waited for an answer ended its thread with CancelledError and no progress
    (a CI run of test_sync_mode_goes_on_through_a_sim_workers_broken_streams). A 16 MB message
    keeps the write in flight; a read then reads the call's status, and the task goes on."""
    obs_dim, limit = 4_000_000, 64 * 1024 * 1024

    async def main() -> None:
        async with running_server(EchoPolicy(obs_dim, 1), max_message_bytes=limit) as server:
            async with EdgeClient(server.address, max_message_bytes=limit) as client:
                in_flight = 0
                for i in range(3):
                    stream = await client.open_stream(session_id=f"s{i}", num_envs=1, obs_shape=(obs_dim,))
                    await stream.send([0], np.ones((1, obs_dim), np.float32), np.zeros(1), [False], [False])
                    in_flight += stream._write is not None and not stream._write.done()
                    reader = asyncio.ensure_future(stream.recv())
                    await asyncio.sleep(0)  # the read starts
                    reader.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await reader
                    with pytest.raises(errors.RpcError) as ended:  # the call's status, not its end
                        await stream.recv()
                    assert ended.value.code == grpc.StatusCode.CANCELLED
                    await stream.close()
                assert in_flight >= 1  # else the test tested nothing
                assert await client.wait_ready(timeout_s=5)  # the client serves on

    run(main())


@pytest.mark.parametrize("transport", ["stream-on-worker", "network-process", "local-socket"])
def test_a_sim_worker_says_mid_episode_to_a_server_that_restarted_and_its_episodes_are_marked_joined(
    transport: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A restarted server knows no session: the worker's envs are mid-episode, and it says so on
    every stream after its first (``StreamHello.mid_episode``, or the local socket's settings).
    The new server numbers those episodes from its clock and marks them joined midway, so that
    the trainer neither drops their segments as ones it took before nor logs their tails as
    whole episodes."""
    hellos: list[tuple[str, bool]] = []
    open_stream = TransitionStore.open_stream

    def spy(
        self: TransitionStore, session_id: str, num_envs: int, *, mid_episode: bool = False, resumes: bool
    ) -> StreamHandle:
        hellos.append((session_id, mid_episode))
        assert resumes  # as every sim worker's stream does
        return open_stream(self, session_id, num_envs, mid_episode=mid_episode, resumes=resumes)

    monkeypatch.setattr(TransitionStore, "open_stream", spy)
    path = str(tmp_path / "act.sock") if transport == "local-socket" else ""
    learner = TransitionConfig(segment_steps=4)
    with ServerThread(EchoPolicy(4, 1), learner=learner, local_socket=path) as server:
        worker = _worker_on(transport, server.address, path, "mid")
        with stepping(worker) as result:
            assert steps_on(worker, 100)
            server.kill()
            time.sleep(0.2)
            restarted_us = time.time_ns() // 1000
            server.restart()
            assert steps_on(worker, 100)

            segments = server.in_loop(lambda: _segments_taken(server))
    assert "error" not in result, result
    assert hellos[0] == ("mid", False) and len(hellos) >= 2, hellos  # its envs had just been reset
    assert all(mid for _, mid in hellos[1:]), hellos
    assert isinstance(segments, list) and segments
    first_of_env: dict[int, pb.Segment] = {}
    for seg in segments:
        first_of_env.setdefault(seg.env_id, seg)
    assert sorted(first_of_env) == [0, 1, 2, 3]
    for seg in first_of_env.values():
        assert seg.joined_mid_episode and seg.episode >= restarted_us, seg


def _follows(seg: pb.Segment) -> tuple[int, int]:
    """The identity (episode, t) of the row after the segment's last."""
    episode, t = seg.episode, seg.t
    for reset in seg.autoreset:
        episode, t = (episode + 1, 0) if reset else (episode, t + 1)
    return episode, t


BREAKS = ["stream-on-worker", "network-process", "local-socket"]


@contextlib.contextmanager
def _breakable(
    transport: str, tmp_path: Path, learner: TransitionConfig
) -> Iterator[tuple[ServerThread, SimWorker, Callable[[], None]]]:
    """A server collecting transitions (``learner``) and a sim worker of 4 envs on ``transport``,
    with a ``cut()`` that breaks the worker's stream while the server lives on: its connection
    reset on the way, or its local socket closed by the server."""
    path = str(tmp_path / "act.sock") if transport == "local-socket" else ""
    with ServerThread(EchoPolicy(4, 1), learner=learner, local_socket=path) as server, server.link() as link:
        worker = _worker_on(transport, f"127.0.0.1:{link.port}", path, "breaks")

        def cut() -> None:
            if path:
                assert server.server is not None and server.server.local is not None
                for stream in list(server.server.local.streams):
                    stream.abort()
            else:
                link.cut()

        def cut_now() -> None:
            server.in_loop(cut)

        yield server, worker, cut_now


@pytest.mark.parametrize("transport", BREAKS)
def test_a_sim_worker_whose_stream_breaks_loses_no_step_to_a_server_that_lives_on(
    transport: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's stream breaks four times, each time with the groups' messages or answers in
    flight. Before, the server counted each step it had answered and not seen the reward of as
    lost, and the trainer cut its episode, though the worker had either stepped with that answer
    or would send the same observation again. The worker resumes (``StreamHello.resumes``): no
    step is lost, each env's segments follow one another without a gap, and no episode is cut.
    Each env's messages are numbered 0, 1, 2, ... (``StepObservation.obs_index``), and one sent
    again on a new stream keeps its number."""
    numbers = request_numbers_taken(monkeypatch)
    with _breakable(transport, tmp_path, TransitionConfig(segment_steps=4)) as (server, worker, cut):
        with stepping(worker) as result:
            for _ in range(4):
                assert steps_on(worker, 100)
                cut()
            assert steps_on(worker, 100)
            dropped, segments = server.lost_and_segments()
    assert "error" not in result, result
    assert result["progress"].reconnects >= 4
    _assert_no_step_lost(dropped, segments, numbers)


def _assert_no_step_lost(dropped: int, segments: list[pb.Segment], numbers: dict[int, list[int]]) -> None:
    """The server lost no step of the 4 envs of a worker whose streams broke: each env's segments
    follow one another without a gap, no episode is cut, and each env's requests are numbered
    0, 1, 2, ... (one sent again on a new stream keeping its number), over 100 steps at least."""
    assert dropped == 0
    last: dict[int, pb.Segment] = {}
    for seg in segments:
        if seg.env_id in last:
            assert (seg.episode, seg.t) == _follows(last[seg.env_id]), (last[seg.env_id], seg)
        last[seg.env_id] = seg
    assert sorted(last) == [0, 1, 2, 3]
    tracker = EpisodeTracker()
    assemble(segments, None, tracker)
    assert tracker.cut == 0 and tracker.log.count > 0
    assert sorted(numbers) == [0, 1, 2, 3]
    for sent in numbers.values():
        assert sent[0] == 0 and all(b - a in (0, 1) for a, b in itertools.pairwise(sent)), sent
        assert len(set(sent)) >= 100 // 4


@pytest.mark.parametrize(
    ("transport", "failure"),
    [(t, "silent") for t in BREAKS if t != "local-socket"] + [(t, "stall") for t in BREAKS],
)
def test_a_sim_worker_whose_answers_are_overdue_opens_a_new_stream_and_loses_no_step(
    transport: str, failure: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's connection goes silent (a link that died without closing it: the stream
    neither answers nor fails), or the server stalls for three times the worker's ``timeout_s``.
    Before, the first overdue answer ended the worker with DEADLINE_EXCEEDED (``edgerl sim``
    exiting with an error), as a robot host or the C++ client would not. The worker now takes an
    overdue answer for a broken stream: it opens a new one on a new connection, resuming, and
    steps on as soon as an answer comes in time; the server loses no step."""
    timeout_s = 0.5
    numbers = request_numbers_taken(monkeypatch)
    backend = GatedPolicy(4, 1, open=True)  # a server that stalls while its gate is clear
    path = str(tmp_path / "act.sock") if transport == "local-socket" else ""
    learner = TransitionConfig(segment_steps=4)
    with ServerThread(backend, learner=learner, local_socket=path) as server, server.link() as link:
        worker = _worker_on(transport, f"127.0.0.1:{link.port}", path, "overdue", timeout_s=timeout_s)
        with stepping(worker) as result:
            assert steps_on(worker, 100)
            if failure == "silent":
                server.in_loop(link.go_silent)  # new connections go through
            else:
                backend.gate.clear()
                time.sleep(3 * timeout_s)
                backend.gate.set()
            assert steps_on(worker, 100)
            dropped, segments = server.lost_and_segments()
    assert "error" not in result, result
    assert result["progress"].reconnects >= 1
    _assert_no_step_lost(dropped, segments, numbers)


@pytest.mark.parametrize("transport", BREAKS)
def test_sync_mode_goes_on_through_a_sim_workers_broken_streams(transport: str, tmp_path: Path) -> None:
    """Sync mode: 4 actions per env per version, and the trainer (played here on the server's
    loop) publishes once it has every env's 4 rows. The worker's stream breaks five times. Before,
    a break could stop the run for good: an env's action admitted and its row never completed
    stayed in its quota, leaving it a row short; and the worker sent its groups again in a fixed
    order, so one at its quota could wait ahead of the other's step that the batch still needed
    (the answers come in order), as could a network process's message joining both. The batch
    never filled, and nothing was published again."""
    learner = TransitionConfig(segment_steps=4, sync_env_steps=4)
    with _breakable(transport, tmp_path, learner) as (server, worker, cut):
        rows = 0

        def publishes() -> int:
            nonlocal rows
            store = _store_of(server)
            rows += sum(len(seg.rewards) for seg in _segments_taken(server))
            while rows >= 4 * 4:
                rows -= 4 * 4
                store.published()
            return store.counters.weight_publishes

        def published() -> int:
            count = server.in_loop(publishes)
            assert isinstance(count, int)
            return count

        def published_to(target: int) -> Callable[[], bool]:
            return lambda: published() >= target

        with stepping(worker) as result:
            for _ in range(5):
                assert wait_until(published_to(published() + 5), timeout_s=20.0, poll_s=0.02)
                cut()
    assert "error" not in result, result
    assert result["progress"].reconnects >= 4


@pytest.mark.parametrize(
    ("sig", "message"),
    [
        (signal.SIGKILL, r"the sim worker's network process ended \(exit code -9\); a new one starts now"),
        # the process hangs: its heartbeats stop, and after HUNG_AFTER_S it is killed
        (
            signal.SIGSTOP,
            r"the sim worker's network process said nothing for 0\.\ds, heartbeats included: killed as hung; "
            r"a new one starts now",
        ),
    ],
    ids=["killed", "hung"],
)
def test_a_sim_worker_replaces_a_network_process_that_dies_or_hangs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, sig: signal.Signals, message: str
) -> None:
    """The worker, waiting on its network process for actions, does not wait for good: it reports
    the loss, starts a new process at once (the first ran for over a second) and steps on."""
    spawned: list[tuple[float, subprocess.Popen[bytes]]] = []
    spawn = netproc.spawn

    def spy(cpus: tuple[int, ...] = ()) -> tuple[socket.socket, subprocess.Popen[bytes]]:
        sock, proc = spawn(cpus)
        spawned.append((time.monotonic(), proc))
        return sock, proc

    monkeypatch.setattr(netproc, "spawn", spy)

    async def main() -> None:
        async with running_server(EchoPolicy(4, 1)) as server:
            address = f"127.0.0.1:{server.port}"
            worker = _worker(server=address, num_envs=4, timeout_s=0.5, network_process=True)
            stop = False
            task = asyncio.ensure_future(worker.run(lambda: stop))
            assert await waited(lambda: worker.progress.steps >= 100, 30), "no steps"
            ((started, first),) = spawned
            await asyncio.sleep(max(0.0, started + netproc.RESTART_DELAY_S + 0.1 - time.monotonic()))
            steps = worker.progress.steps
            os.kill(first.pid, sig)
            lost = time.monotonic()
            assert await waited(lambda: worker.progress.steps >= steps + 100, 30), "no steps after the loss"
            took = time.monotonic() - lost
            assert not task.done()
            stop = True
            progress = await asyncio.wait_for(task, 30)
            worker.close()
        assert first.poll() == -signal.SIGKILL  # killed, not left stopped behind
        assert len(spawned) == 2 and spawned[1][0] - lost < HUNG_AFTER_S + 1.0  # replaced at once
        assert progress.reconnects == 1
        assert took < HUNG_AFTER_S + 5.0  # found, replaced, reconnected and stepping
        assert re.search(message, caplog.text), caplog.text

    run(main())


def test_a_sim_worker_kills_a_network_process_that_closes_its_socket_but_runs_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A process whose socket closed is of no more use: the worker gives it ENDING_GRACE_S to
    exit, kills it, and steps on with a new one, instead of waiting on it for seconds."""
    spawned: Spawned = []
    monkeypatch.setattr(netproc, "spawn", first_spawn_runs_on(spawned))

    async def main() -> None:
        async with running_server(EchoPolicy(4, 1)) as server:
            address = f"127.0.0.1:{server.port}"
            worker = _worker(server=address, num_envs=2, max_steps=50, network_process=True)
            progress = await asyncio.wait_for(worker.run(), 30)
            worker.close()
        assert progress.steps == 50 and progress.reconnects == 1

    run(main())
    (started, runs_on), (restarted, _) = spawned
    assert runs_on.returncode == -signal.SIGKILL
    # killed within the grace, and the next process started RESTART_DELAY_S after the first
    assert restarted - started < netproc.RESTART_DELAY_S + ENDING_GRACE_S + 0.5, restarted - started
    killed = r"process closed its socket but still ran 0\.2s later: killed; a new one starts in 0\.\d\ds"
    assert re.search(killed, caplog.text), caplog.text


def test_a_sim_worker_whose_network_process_keeps_ending_gives_up_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Network processes that end as they start are replaced a second apart, not in a tight loop,
    until the worker has had no stream for ``give_up_after_s``: it gives up, saying why."""
    started: list[float] = []

    def failing(cpus: tuple[int, ...] = ()) -> tuple[socket.socket, subprocess.Popen[bytes]]:
        started.append(time.monotonic())
        parent, child = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
        child.close()
        return parent, proc

    monkeypatch.setattr(netproc, "spawn", failing)

    async def main() -> None:
        async with running_server(EchoPolicy(4, 1)) as server:
            worker = _worker(
                server=f"127.0.0.1:{server.port}", num_envs=2, network_process=True, give_up_after_s=2.5
            )
            gave_up = r"no working stream to 127\.0\.0\.1:\d+ for 2s \(the sim worker's network process ended"
            with pytest.raises(errors.ServerUnavailableError, match=gave_up):
                await asyncio.wait_for(worker.run(), 30)
            worker.close()

    run(main())
    gaps = [b - a for a, b in itertools.pairwise(started)]
    assert len(started) >= 2 and all(gap >= netproc.RESTART_DELAY_S - 0.01 for gap in gaps), gaps


def test_a_sim_worker_keeps_a_network_process_whose_server_answers_late() -> None:
    """Each forward pass takes 0.9 s, within the stream's timeout: for longer than HUNG_AFTER_S at
    a time the worker hears only its network process's heartbeats, and that is enough."""
    delay_s = 0.9
    assert delay_s > HUNG_AFTER_S

    async def main() -> None:
        async with running_server(EchoPolicy(4, 1, delay_s=delay_s)) as server:
            worker = _worker(
                server=f"127.0.0.1:{server.port}",
                num_envs=4,
                groups=2,
                max_steps=12,
                timeout_s=3.0,
                network_process=True,
            )
            progress = await asyncio.wait_for(worker.run(), 60)
            worker.close()
        assert progress.steps == 12 and progress.reconnects == 0

    run(main())


def _unserved_worker(network_process: bool, **timing: float) -> SimWorker:
    """A worker of 2 envs against a port nothing listens on."""
    return _worker(server=f"127.0.0.1:{free_port()}", num_envs=2, network_process=network_process, **timing)


@pytest.mark.parametrize("network_process", [False, True], ids=["stream-on-worker", "network-process"])
def test_worker_gives_up_after_its_budget(network_process: bool) -> None:
    async def main() -> None:
        worker = _unserved_worker(
            network_process, timeout_s=0.3, backoff_initial_s=0.05, backoff_max_s=0.1, give_up_after_s=1.0
        )
        gave_up = r"no working stream to 127\.0\.0\.1:\d+ for 1s"
        with pytest.raises(errors.ServerUnavailableError, match=gave_up):
            await asyncio.wait_for(worker.run(), 30)
        worker.close()

    run(main())


@pytest.mark.parametrize("network_process", [False, True], ids=["stream-on-worker", "network-process"])
def test_worker_gives_up_on_a_server_whose_answers_are_always_late(network_process: bool) -> None:
    """Each forward pass takes 1.5 s, five times the worker's timeout: every stream's first answer
    is overdue, and the worker opens another until ``give_up_after_s`` has passed without an answer
    in time, then names the last failure."""

    async def main() -> None:
        async with running_server(EchoPolicy(4, 1, delay_s=1.5)) as server:
            worker = _worker(
                f"127.0.0.1:{server.port}",
                num_envs=4,
                timeout_s=0.3,
                backoff_initial_s=0.05,
                backoff_max_s=0.1,
                give_up_after_s=2.0,
                network_process=network_process,
            )
            gave_up = (
                r"^UNAVAILABLE: no working stream to 127\.0\.0\.1:\d+ for 2s "
                r"\(no answer to step 0 within 0\.3s\)$"
            )
            try:
                with pytest.raises(errors.ServerUnavailableError, match=gave_up):
                    await asyncio.wait_for(worker.run(), 30)
            finally:
                worker.close()
            assert worker.progress.reconnects >= 2 and worker.progress.steps == 0

    run(main())


@pytest.mark.parametrize("network_process", [False, True], ids=["stream-on-worker", "network-process"])
def test_a_worker_waiting_for_an_absent_server_stops_when_told(network_process: bool) -> None:
    async def main() -> None:
        # Each connection attempt may take 30 s and each reconnect delay 20 s: a stop must not wait.
        worker = _unserved_worker(network_process, timeout_s=30.0, backoff_initial_s=20.0, backoff_max_s=20.0)
        stop = False
        task = asyncio.ensure_future(worker.run(lambda: stop))
        try:
            await asyncio.sleep(1.0)  # connecting, or (network process) retrying
            assert not task.done()
            stop = True
            told = time.monotonic()
            progress = await asyncio.wait_for(task, 30)
            assert time.monotonic() - told < 5.0  # not a connection attempt's 30 s
            assert progress.steps == 0
        finally:
            worker.close()

    run(main())


def _network_processes() -> int:
    """This process's children that run a network process."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue
        count += ppid == os.getpid() and b"edgerl.robot_client.netproc" in cmdline
    return count


def test_cancelling_a_network_process_worker_ends_its_network_process() -> None:
    async def main() -> None:
        worker = _worker(
            server=f"127.0.0.1:{free_port()}",  # nothing listens: the worker waits for a stream
            num_envs=2,
            backoff_initial_s=0.05,
            backoff_max_s=0.1,
            network_process=True,
        )
        task = asyncio.ensure_future(worker.run())
        await asyncio.sleep(1.0)
        assert _network_processes() == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 10
        while _network_processes() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert _network_processes() == 0
        worker.close()

    run(main())


def test_network_process_worker_raises_what_the_server_refused() -> None:
    """A refusal is no outage: the worker stops with the named error instead of reconnecting."""

    async def main() -> None:
        async with running_server(EchoPolicy(4, 1)) as server:  # 4-dim observations
            worker = _worker(
                server=f"127.0.0.1:{server.port}",
                env_name="HalfCheetah-v5",  # 17-dim observations
                num_envs=2,
                network_process=True,
            )
            with pytest.raises(
                errors.PolicyMismatchError, match=r"serves observations of shape \(4,\), HalfCheetah-v5"
            ):
                await asyncio.wait_for(worker.run(), 30)
            worker.close()
        assert worker.progress.steps == 0

    run(main())


def test_a_failure_reported_by_name_is_the_same_named_error() -> None:
    from edgerl.robot_client import netproc

    for sent in (
        errors.ServerUnavailableError("gone"),
        errors.PermissionDeniedError("no"),
        errors.PolicyMismatchError("the server answers actions of shape (3,), HalfCheetah-v5 takes (6,)"),
        errors.ProtocolError("an answer out of order"),
        errors.EdgeRLError("x"),
    ):
        epoch, got = netproc.decode_down(frames.split_frames(bytearray(netproc.encode_down(7, sent)))[0])
        assert epoch == 7 and type(got) is type(sent) and str(got) == str(sent)


def test_recv_deadline_raises_deadline_exceeded() -> None:
    async def main() -> None:
        async with running_server(EchoPolicy(4, 1, delay_s=1.0), max_delay_us=0) as server:
            async with EdgeClient(f"127.0.0.1:{server.port}") as client:
                stream = await client.open_stream(session_id="slow", num_envs=1, obs_shape=(4,))
                await stream.send([0], np.zeros((1, 4)), [0.0], [False], [False])
                with pytest.raises(errors.DeadlineExceededError, match=r"no answer to step 0 within 0\.2s"):
                    await stream.recv(timeout_s=0.2)
                await stream.close()

    run(main())


def test_a_refusal_that_meets_writes_in_flight_reads_as_the_servers_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A double-buffered worker sends its two groups' steps right after its hello. When a server
    refuses the hello and ends the stream at once (edgerl's waits for the client to go quiet,
    another server may not), those writes are still in flight, and gRPC's asyncio client puts
    its own bare INTERNAL over the server's status (grpc/grpc#36066): the caller read "Internal
    error from Core", and a sim worker gave up on a refusal it could have named, or on a
    restarting server it could have ridden through. The server's status is kept."""
    from edgerl.edge_server import service

    monkeypatch.setattr(service, "ENDING_MAX_S", 0.0)  # the stream ends at once
    refusal = "InvalidArgumentError: INVALID_ARGUMENT: hello.obs_shape: server serves [4], got [5]"

    def raced(got: list[tuple[str, grpc.StatusCode, str]]) -> bool:
        """Whether the race happened: what the caller read is the status gRPC overwrote."""
        return any(details == "Internal error from Core" for _, _, details in got)

    async def main() -> list[tuple[str, grpc.StatusCode, str]]:
        got: list[tuple[str, grpc.StatusCode, str]] = []
        async with running_server(EchoPolicy(4, 1)) as server:
            # The race comes in runs: from none to 20 of 30 streams, on a busy machine none
            # in a third of the tries. More streams, until it came.
            while len(got) < 600 and not raced(got):
                got += await refused_hellos(server.address, 5, 30)
        return got

    got: list[tuple[str, grpc.StatusCode, str]] = run(main())  # type: ignore[assignment]
    assert [raised for raised, _, _ in got] == [refusal] * len(got)
    assert raced(got), f"no stream of {len(got)} met the race"


def test_a_stream_that_grpc_ended_with_its_own_bare_internal_reads_as_unavailable() -> None:
    """A server stopped at once with a write of the client's in flight: gRPC's asyncio client
    may end the call with its bare INTERNAL from the start, holding no status of the server's (2
    in 150 kill-and-restart cycles of a sim worker; no loopback setup here brings it on at will).
    The sim worker took it for a refusal and gave up on a server it could have ridden through
    (test_a_sim_worker_rides_through_server_restarts, once in 57 runs). It is a broken
    stream, retried with backoff; any other status keeps its own name."""
    broke = client_module._stream_error(grpc.StatusCode.INTERNAL, "Internal error from Core")
    assert isinstance(broke, errors.ServerUnavailableError)
    assert "write in flight" in str(broke) and "grpc/grpc#36066" in str(broke)
    failed = client_module._stream_error(grpc.StatusCode.INTERNAL, "policy forward pass failed: boom")
    assert type(failed) is errors.RpcError and failed.code == grpc.StatusCode.INTERNAL
    refused = client_module._stream_error(grpc.StatusCode.INVALID_ARGUMENT, "hello.obs_shape: ...")
    assert isinstance(refused, errors.InvalidArgumentError)


def test_sending_beyond_max_inflight_or_receiving_with_none_in_flight_is_refused_client_side() -> None:
    async def main() -> None:
        async with running_server(EchoPolicy(4, 1)) as server:
            async with EdgeClient(f"127.0.0.1:{server.port}") as client:
                stream = await client.open_stream(session_id="x", num_envs=1, obs_shape=(4,), max_inflight=1)
                await stream.send([0], np.zeros((1, 4)), [0.0], [False], [False])
                with pytest.raises(errors.EdgeRLError, match="max_inflight is 1"):
                    await stream.send([0], np.zeros((1, 4)), [0.0], [False], [False])
                assert (await stream.recv()).actions.shape == (1, 1)  # the first is answered
                with pytest.raises(errors.EdgeRLError, match=r"recv\(\) with no message in flight"):
                    await stream.recv()  # which would wait forever
                await stream.close()

    run(main())


def test_a_send_on_a_stream_the_server_ended_raises_its_status() -> None:
    """A send after the server ended the stream went nowhere without a word (the refusal came at
    a later recv), and one after a recv had raised it read as too many messages in flight."""

    async def main() -> None:
        async with running_server(EchoPolicy(4, 1)) as server:
            async with EdgeClient(f"127.0.0.1:{server.port}") as client:
                stream = await client.open_stream(session_id="x", num_envs=1, obs_shape=(5,), max_inflight=1)
                assert await waited(stream._call.done, 5.0)  # the hello was refused
                for _ in range(2):  # before a recv has raised the refusal, and after
                    with pytest.raises(errors.InvalidArgumentError, match=r"hello\.obs_shape"):
                        await stream.send([0], np.zeros((1, 5)), [0.0], [False], [False])
                assert stream.inflight == 0
                await stream.close()
                stream = await client.open_stream(session_id="y", num_envs=1, obs_shape=(5,), max_inflight=1)
                await stream.send([0], np.zeros((1, 5)), [0.0], [False], [False])  # in flight
                with pytest.raises(errors.InvalidArgumentError, match=r"hello\.obs_shape"):
                    await stream.recv()
                with pytest.raises(errors.InvalidArgumentError, match=r"hello\.obs_shape"):
                    await stream.send([0], np.zeros((1, 5)), [0.0], [False], [False])
                await stream.close()

    run(main())


SIM_SETTINGS: dict[str, tuple[dict[str, Any], str]] = {
    "num_envs": ({"num_envs": 0}, "num_envs must be >= 1, got 0"),
    "groups": ({"num_envs": 2, "groups": 3}, "groups must be in [1, num_envs=2], got 3"),
    "timeout_s": ({"timeout_s": 0.0}, "timeout_s must be > 0, got 0.0"),
    "max_steps": ({"max_steps": -1}, "max_steps must be >= 0, got -1"),
    "backoff": (
        {"backoff_initial_s": 2.0, "backoff_max_s": 1.0},
        "need 0 < backoff_initial_s <= backoff_max_s <= 2147483",
    ),
    "backoff_max_s": ({"backoff_max_s": 1e9}, "need 0 < backoff_initial_s <= backoff_max_s <= 2147483"),
}


@pytest.mark.parametrize("field", list(SIM_SETTINGS))
def test_a_bad_sim_worker_setting_is_refused_naming_it(field: str) -> None:
    setting, message = SIM_SETTINGS[field]
    with pytest.raises(ValueError, match=re.escape(message)):
        SimWorkerConfig(server="127.0.0.1:1", **setting)


def test_wait_ready_gives_up_leaving_nothing_pending_for_a_later_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A wait that timed out must not complete later into its closed event loop (grpc/grpc#26887:
    a connectivity watch given up on does, and the next loop using gRPC logs "Event loop is
    closed")."""

    async def no_server() -> None:
        async with EdgeClient("127.0.0.1:1") as client:
            await client.wait_ready(timeout_s=0.5)

    with nothing_left_for_a_later_loop(caplog):
        t0 = time.monotonic()
        with pytest.raises(
            errors.ServerUnavailableError, match=re.escape("no server at 127.0.0.1:1 within 0.5s")
        ):
            asyncio.run(no_server())  # the loop ends with the wait it gave up on
        assert time.monotonic() - t0 > 0.45


def test_wait_ready_ended_by_should_stop_returns_false_leaving_nothing_pending(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def stopped() -> bool:
        stop_at = time.monotonic() + 0.6
        async with EdgeClient("127.0.0.1:1") as client:
            return await client.wait_ready(timeout_s=30.0, should_stop=lambda: time.monotonic() > stop_at)

    with nothing_left_for_a_later_loop(caplog):
        t0 = time.monotonic()
        assert asyncio.run(stopped()) is False
        assert 0.55 < time.monotonic() - t0 < 5.0  # told at 0.6 s, not at the 30 s timeout


def test_wait_ready_returns_once_the_server_serves() -> None:
    async def main() -> None:
        port = free_port()  # for a server that comes up late
        async with EdgeClient(f"127.0.0.1:{port}") as client:
            waiting = asyncio.ensure_future(client.wait_ready(timeout_s=20))
            await asyncio.sleep(0.5)
            assert not waiting.done()  # nobody serves yet
            server = EdgeServer(EchoPolicy(4, 1), ServerConfig(port=port))
            await server.start()
            try:
                await asyncio.wait_for(waiting, 10)  # ready (raises if it gave up)
            finally:
                await server.stop()

    run(main())
