"""The Learner service on a real server: segments to a real trainer feed, weights back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from edgerl.edge_server.backend import publish_limit
from edgerl.edge_server.policy import TorchPolicyBackend, check_fits
from edgerl.edge_server.server import LEARNER_SERVICE_NAME
from edgerl.edge_server.transitions import TransitionConfig
from edgerl.models import build_policy
from edgerl.proto import tensors
from edgerl.proto.keepalive import MAX_KEEPALIVE_S
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.proto.v1 import edge_pb2_grpc as pb_grpc
from edgerl.robot_client import errors
from edgerl.robot_client.client import EdgeClient
from edgerl.robot_client.sim_worker import SimWorker, SimWorkerConfig
from edgerl.sim.envs import env_spec
from edgerl.trainer.feed import (
    TransitionFeed,
    publish_deadline_s,
    publish_weights,
    weights_parts,
    weights_request,
)
from edgerl.trainer.segments import segment_key
from tests.helpers import (
    FAULT_MESSAGE,
    Link,
    act_once,
    free_port,
    inject_fault,
    run,
    run_without_errors,
    run_without_warnings,
    running_server,
    waited,
)

ENV = "InvertedPendulum-v5"


def _backend(seed: int = 0) -> TorchPolicyBackend:
    spec = env_spec(ENV)
    net = build_policy("mlp-small", spec.obs_shape[0], spec.act_shape[0], seed=seed)
    return TorchPolicyBackend(net, spec.act_low, spec.act_high, seed=seed, compute_values=True)


async def _in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


@contextlib.asynccontextmanager
async def _sim(address: str, seed: int, num_envs: int = 4) -> AsyncIterator[SimWorker]:
    """A sim worker of ``num_envs`` envs stepping against ``address`` on this loop during the
    block; stopped, its run awaited, and closed at its end."""
    worker = SimWorker(SimWorkerConfig(server=address, env_name=ENV, num_envs=num_envs, seed=seed))
    stop = threading.Event()
    sim = asyncio.ensure_future(worker.run(stop.is_set))
    try:
        yield worker
    finally:
        stop.set()
        await sim
        worker.close()


def test_trainer_takes_segments_and_a_publish_changes_the_served_version() -> None:
    async def main() -> None:
        learner = TransitionConfig(segment_steps=8)
        async with running_server(_backend(), learner=learner) as server:
            feed = TransitionFeed(server.address, window_steps=64).start()
            try:
                async with _sim(server.address, seed=1):
                    segs = await _in_thread(feed.take, 64)
                    assert sum(len(s.rewards) for s in segs) >= 64
                    assert {len(s.rewards) for s in segs} == {8}
                    assert len({segment_key(s) for s in segs}) == len(segs)
                    assert all(v == 0 for s in segs for v in s.policy_versions)
                    assert any(v != 0.0 for s in segs for v in s.values)  # the served critic ran
                    feed.ack(max(s.seq for s in segs))

                    # Publish different weights as version 1: served actions change and carry it.
                    obs = np.zeros((1, 4), np.float32)
                    async with EdgeClient(server.address) as client:
                        before = await client.act(obs)
                        channel = grpc.insecure_channel(server.address)
                        stub = pb_grpc.LearnerStub(channel)
                        other = _backend(seed=7).policy.state_dict()
                        resp = await _in_thread(publish_weights, stub, other, 1)
                        assert resp.applied and resp.policy_version == 1
                        after = await client.act(obs)
                        assert after.policy_version == 1 and before.policy_version == 0
                        assert (await client.describe()).policy_version == 1
                        # Versions never go back.
                        with pytest.raises(
                            errors.FailedPreconditionError, match="greater than the served version 1"
                        ):
                            await _in_thread(publish_weights, stub, other, 1)
                        bad = dict(other)
                        bad["critic.0.weight"] = bad["critic.0.weight"][:, :2]
                        with pytest.raises(errors.InvalidArgumentError, match=r"critic.0.weight"):
                            await _in_thread(publish_weights, stub, bad, 2)
                        nan = dict(other)
                        nan["actor_mean.0.weight"] = nan["actor_mean.0.weight"].clone()
                        nan["actor_mean.0.weight"][0, 0] = float("nan")
                        with pytest.raises(errors.InvalidArgumentError, match=r"actor_mean.0.weight.*NaN"):
                            await _in_thread(publish_weights, stub, nan, 2)
                        assert (await client.describe()).policy_version == 1
                        channel.close()
                    # New segments carry the new version after the publish.
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:
                        more = await _in_thread(feed.take, 32)
                        feed.ack(max(s.seq for s in more))
                        if any(v == 1 for s in more for v in s.policy_versions):
                            break
                    else:
                        pytest.fail("no transition stamped with version 1 arrived")
            finally:
                await _in_thread(feed.close)  # the server runs on this loop
            st = await _stats(server.address)
            assert st.transitions > 64 and st.segments_acked > 8
            assert st.weight_publishes == 1

    run(main())


def test_the_server_lets_go_of_closed_sessions_past_max_closed_sessions_and_counts_them() -> None:
    """Each sim fleet start and robot host start makes new sessions; the counters of the closed
    ones were kept for good. Past ``max_closed_sessions`` the longest closed ones go, and
    ``Stats.sessions_forgotten`` says how many went."""

    async def main() -> None:
        learner = TransitionConfig(segment_steps=4, max_closed_sessions=1)
        async with running_server(_backend(), learner=learner) as server:
            async with EdgeClient(server.address) as client:
                for name in ("a", "b", "c"):
                    stream = await client.open_stream(session_id=name, num_envs=1, obs_shape=[4])
                    await stream.send([0], np.zeros((1, 4), np.float32), [0.0], [False], [False])
                    await stream.recv()
                    await stream.close()
                    assert await waited(lambda: server.servicer.active_streams == 0, 10)
                st = await client.stats()
                store = server.store
                assert st.sessions_forgotten == 2 and store is not None and list(store._sessions) == ["c"]

    run(main())


async def _stats(address: str) -> pb.StatsResponse:
    async with EdgeClient(address) as client:
        return await client.stats()


def test_segments_resent_after_a_trainer_reconnect_are_taken_once() -> None:
    async def main() -> None:
        async with running_server(_backend(), learner=TransitionConfig(segment_steps=4)) as server:
            feed = TransitionFeed(server.address, window_steps=64).start()
            try:
                async with _sim(server.address, seed=2):
                    first = await _in_thread(feed.take, 16)  # taken, not acknowledged
                    while feed.received_steps < 64:  # the rest of the window arrives, unacknowledged
                        await asyncio.sleep(0.05)
                    assert feed._call is not None
                    feed._call.cancel()  # the stream breaks; the feed reconnects
                    while feed.reconnects == 0 or feed.dedupe.duplicates == 0:
                        await asyncio.sleep(0.05)
                    feed.ack(max(s.seq for s in first))
                    rest = await _in_thread(feed.take, 64)
            finally:
                await _in_thread(feed.close)
            keys = [segment_key(s) for s in first + rest]
            assert len(keys) == len(set(keys))  # every transition taken once
            assert feed.reconnects >= 1
            assert feed.dedupe.duplicates >= 1  # the server did re-send the unacknowledged ones
            assert server.store is not None and server.store.counters.segments_resent >= 1

    run(main())


@pytest.mark.parametrize("failure", ["reset", "silent"])
def test_a_trainer_whose_link_breaks_goes_on_taking_segments(failure: str) -> None:
    """The trainer has a full window of segments and its link to the server breaks: reset, or
    gone silent (a link that died without closing). It takes and acknowledges them all; the
    acknowledgements go down with the stream. Before, a silent link held the trainer for ever:
    waiting for segments it sends nothing TCP could time out on (0 reconnects in 15 s). Its
    channel now pings the server, which takes the pings of an idle stream (its default policy
    ended the connection after three), and takes an unanswered ping for a dead connection. And
    before, after either break, the trainer stalled for good: the server sent the window's
    segments again, the trainer dropped them as duplicates and never acknowledged them again,
    and nothing more came. The new stream's first acknowledgement now covers them, and they
    are not sent again."""

    async def main() -> None:
        async with running_server(_backend(), learner=TransitionConfig(segment_steps=4)) as server:
            async with Link(server.port) as link:
                feed = TransitionFeed(
                    f"127.0.0.1:{link.port}", window_steps=64, keepalive_s=0.6, keepalive_timeout_s=0.5
                ).start()
                taken = 0

                async def take(steps: int) -> None:
                    nonlocal taken
                    deadline = time.monotonic() + 15.0
                    goal = taken + steps
                    while taken < goal:
                        segs = await _in_thread(feed.take, 4, lambda: time.monotonic() > deadline)
                        assert segs is not None, f"{taken} steps taken, then none in 15 s"
                        feed.ack(max(seg.seq for seg in segs))
                        taken += sum(len(seg.rewards) for seg in segs)

                try:
                    async with _sim(server.address, seed=2):
                        await take(100)
                        assert await waited(lambda: feed.queued_steps == 64, 10.0), feed.queued_steps
                        if failure == "silent":  # idle first, with a full window: pings only, all taken
                            await asyncio.sleep(5.0)
                            assert feed.reconnects == 0
                        link.cut() if failure == "reset" else link.go_silent()
                        await take(64)  # the window, at hand: its acknowledgements are lost
                        await take(200)
                finally:
                    await _in_thread(feed.close)
                assert feed.reconnects >= 1

    run(main())


def test_a_feeds_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match=r"^window_steps must be >= 1, got 0$"):
        TransitionFeed("127.0.0.1:1", window_steps=0)
    for every, timeout in ((0.0, 10.0), (10.0, -1.0), (float("nan"), 10.0), (1e300, 10.0)):
        with pytest.raises(
            ValueError, match=rf"^keepalive_s must be in \(0, {MAX_KEEPALIVE_S}\] and keepalive_"
        ):
            TransitionFeed("127.0.0.1:1", window_steps=64, keepalive_s=every, keepalive_timeout_s=timeout)


def test_a_trainer_whose_stream_a_second_trainer_took_over_fails_with_aborted() -> None:
    """Two trainers against one server: the newer takes the transition stream over, and the
    older one's stream ends with ABORTED saying why, which its feed raises. It ended with OK:
    the older trainer reconnected, took the stream back, and the two took turns for good (23
    reconnects each in 3 s), each training on about half of the transitions."""

    async def main() -> None:
        async with running_server(_backend(), learner=TransitionConfig(segment_steps=4)) as server:
            older = TransitionFeed(server.address, window_steps=64, trainer_id="older").start()
            newer: TransitionFeed | None = None
            try:
                async with _sim(server.address, seed=2):
                    await _in_thread(older.take, 16)
                    newer = TransitionFeed(server.address, window_steps=64, trainer_id="newer").start()
                    deadline = time.monotonic() + 30.0

                    def late() -> bool:
                        return time.monotonic() > deadline

                    with pytest.raises(errors.AbortedError) as info:  # or take() gives None at the deadline
                        while await _in_thread(older.take, 4, late) is not None:
                            pass
                    assert info.value.details == (
                        "a newer trainer stream took the transitions over (is a second trainer "
                        "connected to this server?)"
                    )
                    for _ in range(3):  # the newer one takes on
                        taken = await _in_thread(newer.take, 16)
                        newer.ack(max(seg.seq for seg in taken))
                    assert (older.reconnects, newer.reconnects) == (0, 0)
            finally:
                await _in_thread(older.close)
                if newer is not None:
                    await _in_thread(newer.close)

    run(main())


def test_acks_given_just_before_close_reach_the_server() -> None:
    """close() ends the request stream and lets the server read it to the end instead of
    cancelling the call under the last acknowledgement; a feed whose server never answers
    is cancelled after its grace."""

    async def main() -> None:
        async with running_server(_backend(), learner=TransitionConfig(segment_steps=4)) as server:
            store = server.store
            assert store is not None
            async with _sim(server.address, seed=4):
                for _ in range(5):
                    feed = TransitionFeed(server.address, window_steps=64).start()
                    segs = await _in_thread(feed.take, 8)
                    last = max(s.seq for s in segs)
                    feed.ack(last)
                    # at once, the ack still queued; off this loop, which the server runs on
                    await _in_thread(feed.close)
                    assert feed._call.code() == grpc.StatusCode.OK  # the server ended it, not a cancel
                    assert store.counters.segments_acked == last  # seqs start at 1, acked in order

        # a port where nothing listens: the call waits for a server
        feed = TransitionFeed(f"127.0.0.1:{free_port()}", window_steps=64).start()
        feed.ack(0)
        t0 = time.monotonic()
        feed.close(grace_s=0.5)
        assert 0.5 <= time.monotonic() - t0 < 5.0
        assert not feed._thread.is_alive()

    run(main())


def test_backpressure_holds_envs_when_no_trainer_takes_transitions() -> None:
    async def main() -> None:
        learner = TransitionConfig(segment_steps=4, max_pending_steps=16)
        async with running_server(_backend(), learner=learner) as server:
            cfg = SimWorkerConfig(server=server.address, env_name=ENV, num_envs=4, seed=3, timeout_s=60)
            worker = SimWorker(cfg)
            stop = threading.Event()
            sim = asyncio.ensure_future(worker.run(stop.is_set))
            await asyncio.sleep(2.0)
            st = await _stats(server.address)
            assert st.transitions_pending == 16  # full, and no further
            assert worker.progress.steps <= 16 + 4 + 4  # pending + open rows + one answered step
            assert st.backpressure_wait_us > 500_000
            stop.set()
            assert server.store is not None
            server.store.ack(0, 1 << 20)  # let the worker finish its step
            server.store.take_sendable()
            server.store.ack(server.store.next_seq - 1, 1 << 20)
            await asyncio.wait_for(sim, 30)
            worker.close()

    run(main())


def test_a_backlog_goes_out_in_messages_that_fit_and_an_ack_of_an_unsent_segment_is_refused() -> None:
    """Segments held while no trainer was connected go out at once, split into messages of at
    most half of ``max_message_bytes``, every one in seq order; acking a seq never sent ends
    the trainer's stream with INVALID_ARGUMENT naming ``acked_seq``."""

    async def main() -> None:
        learner = TransitionConfig(segment_steps=2)
        async with running_server(_backend(), learner=learner, max_message_bytes=4096) as server:
            store = server.store
            assert store is not None
            # 40 segments of 2 steps, ~9 KiB: more than one message
            async with _sim(server.address, seed=1):
                assert await waited(lambda: store.next_seq > 40, timeout_s=30), store.next_seq
            # its close cuts the envs' last, short segments
            assert await waited(lambda: not server.servicer.active_streams, timeout_s=10)
            held = store.next_seq - 1
            async with grpc.aio.insecure_channel(server.address) as channel:
                call = pb_grpc.LearnerStub(channel).StreamTransitions(timeout=30)
                await call.write(pb.TransitionAck(acked_seq=0, window_steps=1 << 20, trainer_id="test"))
                seqs: list[int] = []
                sizes: list[int] = []
                while len(seqs) < held:
                    batch = await call.read()
                    seqs += [seg.seq for seg in batch.segments]
                    sizes.append(sum(seg.ByteSize() for seg in batch.segments))
                assert seqs == list(range(1, held + 1))  # all, once, in order
                assert len(sizes) > 1 and max(sizes) <= 2048, sizes
                await call.write(pb.TransitionAck(acked_seq=held + 5, window_steps=1 << 20))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call.read()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == f"acked_seq: {held + 5} was never sent (last segment is {held})"

    run(main())


def test_an_asyncio_trainer_whose_ack_is_refused_reads_the_refusal_with_acks_still_in_flight() -> None:
    """A trainer on ``grpc.aio`` that writes more acks right after one the server refuses: the
    server drops them until the trainer is quiet, then ends the stream, so the trainer reads the
    refusal, not gRPC's INTERNAL "Internal error from Core" (grpc/grpc#36066; 52 times in 100
    when the stream ended at once)."""

    async def main() -> list[tuple[grpc.StatusCode, str]]:
        got = []
        async with running_server(_backend(), learner=TransitionConfig(segment_steps=2)) as server:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.LearnerStub(channel)
                for _ in range(100):
                    call = stub.StreamTransitions(timeout=10)
                    first = pb.TransitionAck(acked_seq=5, window_steps=1 << 20, trainer_id="aio")
                    ack = pb.TransitionAck(acked_seq=5, window_steps=1 << 20)
                    last: asyncio.Future[None] | None = None
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        for message in (first, ack, ack):
                            await call.write(message)
                        last = asyncio.ensure_future(call.write(ack))
                        await call.read()
                    if last is not None:
                        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                            await last
                    got.append((await call.code(), await call.details()))
        return got

    refusal = (grpc.StatusCode.INVALID_ARGUMENT, "acked_seq: 5 was never sent (last segment is 0)")
    assert run(main()) == [refusal] * 100


def test_a_trainer_gone_with_segments_unread_is_let_go_quietly_and_its_segments_resent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A trainer that goes away (a crash, a kill) while the server's writes of its segments wait
    for HTTP/2 flow control: gRPC logged "ExecuteBatchError raised in core by servicer method",
    with a traceback, for a fault of the server's own, 5 times in 5 until write_message. Now its
    stream ends without a word, and the next trainer gets every segment it left unacknowledged."""

    async def main() -> None:
        async with running_server(_backend(), learner=TransitionConfig()) as server:
            store = server.store
            assert store is not None
            # 150 segments, ~1.5 KiB each: more than the trainer's 64 KiB window takes
            async with _sim(server.address, seed=3, num_envs=16):
                assert await waited(lambda: store.next_seq > 150, timeout_s=60), store.next_seq
                # with BDP probing off, the trainer's window stays at HTTP/2's initial 64 KiB
                channel = grpc.aio.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)])
                call = pb_grpc.LearnerStub(channel).StreamTransitions()
                await call.write(pb.TransitionAck(acked_seq=0, window_steps=1 << 20, trainer_id="gone"))
                await asyncio.sleep(0.3)  # the server writes until the window is full
                await channel.close(grace=None)
                await asyncio.sleep(0.3)  # the server learns that the trainer is gone
                async with grpc.aio.insecure_channel(server.address) as again:
                    call = pb_grpc.LearnerStub(again).StreamTransitions(timeout=30)
                    await call.write(pb.TransitionAck(acked_seq=0, window_steps=1 << 20, trainer_id="next"))
                    seqs: list[int] = []
                    while len(seqs) < 150:
                        seqs += [seg.seq for seg in (await call.read()).segments]
                    assert seqs[:150] == list(range(1, 151))  # none acknowledged: all resent, in order
            assert store.counters.segments_resent >= 1

    run_without_warnings(main(), caplog)


def test_a_fault_of_the_server_on_the_trainer_stream_ends_it_with_internal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception the server does not expect while it takes the trainer's acks ends the
    trainer's stream with INTERNAL naming it, where the stream once ended with OK as if all
    was well (and a trainer reconnected, to fail the same way, without a word of why)."""
    from edgerl.edge_server.transitions import TransitionStore

    inject_fault(TransitionStore, "ack", lambda *_: True, monkeypatch)

    async def main() -> None:
        async with running_server(_backend(), learner=TransitionConfig(segment_steps=2)) as server:
            async with grpc.aio.insecure_channel(server.address) as channel:
                call = pb_grpc.LearnerStub(channel).StreamTransitions(timeout=30)
                await call.write(pb.TransitionAck(acked_seq=0, window_steps=1 << 20, trainer_id="test"))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call.read()
            assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INTERNAL, FAULT_MESSAGE)
            await act_once(server.address, np.zeros((2, *env_spec(ENV).obs_shape), np.float32))  # served on

    with caplog.at_level(logging.ERROR, logger="edgerl.edge_server.learner"):
        run(main())
    failed = [r for r in caplog.records if r.getMessage() == "trainer stream of generation 1 failed"]
    assert len(failed) == 1 and failed[0].exc_info is not None


def test_a_version_past_int64_is_refused_and_the_largest_one_reaches_every_side(tmp_path: Path) -> None:
    """Versions are signed 64-bit integers on the local socket's frames and in the trainer's
    arrays. A publish of 2**63 was once applied, and every local stream then failed with
    INTERNAL (its answer could not be packed): now it is refused naming ``version``, and
    2**63 - 1 is served, stamped on a local stream's answers and on the trainer's segments."""
    from edgerl.proto import frames
    from edgerl.trainer.segments import EpisodeTracker, assemble

    largest = 2**63 - 1

    async def read_frame(reader: asyncio.StreamReader) -> bytes:
        (n,) = frames.LENGTH.unpack(await reader.readexactly(frames.LENGTH.size))
        return await reader.readexactly(n)

    async def main() -> None:
        path = str(tmp_path / "act.sock")
        learner = TransitionConfig(segment_steps=2)
        async with running_server(_backend(), learner=learner, local_socket=path) as server:
            backend = server.servicer.backend
            state = _backend(seed=5).policy.state_dict()
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.LearnerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.PublishWeights(weights_request(state, largest + 1))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert info.value.details() == f"version: at most 2**63 - 1 ({largest}), got {largest + 1}"
                assert backend.version == 0
                assert (await stub.PublishWeights(weights_request(state, largest))).applied
            reader, writer = await asyncio.open_unix_connection(path)
            try:
                settings = {"session_id": "big", "num_envs": 2, "obs_shape": list(env_spec(ENV).obs_shape)}
                writer.write(frames.frame(frames.CONFIG + json.dumps(settings).encode()))
                assert (await read_frame(reader))[:1] == frames.UP
                obs = np.zeros((2, *env_spec(ENV).obs_shape), np.float32)
                rows = frames.ObsRows(
                    np.arange(2, dtype=np.int32),
                    obs,
                    np.ones(2, np.float32),
                    np.zeros((2, 3), np.uint8),
                    np.zeros(2, np.uint64),
                )
                versions = []
                for epoch in range(4):  # two segments of two steps per env
                    writer.write(frames.encode_obs(epoch, rows))
                    versions.append(frames.decode_answer(await read_frame(reader)).policy_version)
            finally:
                writer.close()
            assert versions == [largest] * 4
            async with grpc.aio.insecure_channel(server.address) as channel:
                call = pb_grpc.LearnerStub(channel).StreamTransitions(timeout=30)
                await call.write(pb.TransitionAck(acked_seq=0, window_steps=1 << 20, trainer_id="test"))
                batch = assemble(list((await call.read()).segments), None, EpisodeTracker())
            assert len(batch.versions) >= 2 and batch.versions.tolist() == [largest] * len(batch.versions)

    run(main())
    spec = env_spec(ENV)  # nor can a server start at a version past it (a checkpoint's)
    net = build_policy("mlp-small", spec.obs_shape[0], spec.act_shape[0])
    with pytest.raises(ValueError, match=rf"version must be in \[0, 2\*\*63 - 1\], got {largest + 1}$"):
        TorchPolicyBackend(net, spec.act_low, spec.act_high, version=largest + 1)


def test_a_publish_overtaken_by_a_newer_one_sent_beside_it_is_refused_and_the_version_never_goes_back() -> (
    None
):
    """Publishes of versions v+2 and v+1 sent at once: each was checked against the served
    version when it arrived and swapped in after, so v+1 overwrote v+2 and the served version
    went back (20 times in 20 such pairs). The check is made again where the swaps run, one at
    a time: the older one is refused, or it went first and the newer one follows it."""
    not_newer = re.compile(r"version: must be greater than the served version (\d+), got (\d+)")

    async def main() -> None:
        async with running_server(_backend(), learner=TransitionConfig()) as server:
            backend = server.servicer.backend
            state = _backend(seed=5).policy.state_dict()
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.LearnerStub(channel)
                for newer in range(2, 41, 2):
                    answers = await asyncio.gather(
                        stub.PublishWeights(weights_request(state, newer)),
                        stub.PublishWeights(weights_request(state, newer - 1)),
                        return_exceptions=True,
                    )
                    assert backend.version == newer  # the newer one is served, whatever the order
                    assert isinstance(answers[0], pb.PublishWeightsResponse) and answers[0].applied
                    older = answers[1]
                    if isinstance(older, grpc.aio.AioRpcError):  # it came second
                        assert older.code() == grpc.StatusCode.FAILED_PRECONDITION
                        match = not_newer.fullmatch(older.details() or "")
                        assert match is not None and match.groups() == (str(newer), str(newer - 1))
                    else:  # it came first
                        assert isinstance(older, pb.PublishWeightsResponse) and older.applied

    run(main())


def test_weight_sync_interval_skips_versions_and_learner_is_discoverable() -> None:
    async def main() -> None:
        learner = TransitionConfig(weight_sync_interval=2)
        async with running_server(_backend(), learner=learner) as server:
            channel = grpc.insecure_channel(server.address)
            stub = pb_grpc.LearnerStub(channel)
            state = _backend(seed=5).policy.state_dict()
            r1 = await _in_thread(publish_weights, stub, state, 1)
            r2 = await _in_thread(publish_weights, stub, state, 2)
            assert (r1.applied, r1.policy_version) == (False, 0)
            assert (r2.applied, r2.policy_version) == (True, 2)
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health = health_pb2_grpc.HealthStub(channel)
            req = health_pb2.HealthCheckRequest(service=LEARNER_SERVICE_NAME)
            ok = await _in_thread(lambda: health.Check(req, timeout=5))
            assert ok.status == health_pb2.HealthCheckResponse.SERVING
            channel.close()

    run(main())


_Changes = dict[str, tuple[int | None, float]]


def _spoiled(state: dict[str, Any], changes: _Changes) -> dict[str, Any]:
    """``state`` with, for each name of ``changes``, the tensor's entry ``index`` (of the flat
    tensor; None: every entry) set to ``value``."""
    out = {k: v.clone() for k, v in state.items()}
    for name, (index, value) in changes.items():
        out[name].view(-1)[slice(None) if index is None else index] = value
    return out


def _overflowing(head: str) -> _Changes:
    """Changes that make ``head``'s output overflow on any observation: the last hidden layer at
    tanh's 1 (its biases large), the output layer's weights near float32's largest."""
    return {f"{head}.2.bias": (None, 50.0), f"{head}.4.weight": (None, 3e38)}


NO_FINITE_ACTIONS: dict[str, tuple[_Changes, str]] = {  # finite weights of which no finite actions come
    "negative variance": (
        {"obs_norm.var": (2, -1.0)},
        r"^weights\['obs_norm\.var'\]: a variance must be >= 0 \(the observations are divided by "
        r"sqrt\(var \+ eps\)\), got -1\.0 at index 2$",
    ),
    "std overflows": (
        {"actor_log_std": (0, 100.0)},
        r"^weights\['actor_log_std'\]: the action std exp\(log_std\) must be finite, got log_std 100\.0 "
        r"at index 0$",
    ),
    "actions overflow": (
        _overflowing("actor_mean"),
        r"^weights: the policy's action means on its mean observation are not finite \(-?inf at index 0\)$",
    ),
    "values overflow": (
        _overflowing("critic"),
        r"^weights: the policy's values on its mean observation are not finite \(-?inf at index 0\)$",
    ),
}


@pytest.mark.parametrize("case", list(NO_FINITE_ACTIONS))
def test_a_publish_of_weights_that_cannot_give_finite_actions_is_refused_the_served_stay(case: str) -> None:
    """Weights that pass every check of their own (finite, of the right names and shapes) of which
    the policy still cannot give finite actions: before, the server swapped them in and sent its
    clients NaN or Inf actions (a sim's envs stepped on NaN; a robot's watchdog fell back on every
    answer). Now the publish is refused naming the tensor, and the served weights stay."""
    changes, message = NO_FINITE_ACTIONS[case]

    async def main() -> None:
        async with running_server(_backend(), learner=TransitionConfig()) as server:
            backend = server.servicer.backend
            assert isinstance(backend, TorchPolicyBackend)
            obs = np.full((3, *env_spec(ENV).obs_shape), 0.5, np.float32)
            served = backend._served.forward(obs)[0]
            state = _backend(seed=5).policy.state_dict()
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.LearnerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.PublishWeights(weights_request(_spoiled(state, changes), 1))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert re.match(message, info.value.details() or ""), info.value.details()
                assert backend.version == 0
                np.testing.assert_array_equal(backend._served.forward(obs)[0], served)
                answer = await act_once(server.address, obs)
                assert np.isfinite(answer.actions).all() and answer.policy_version == 0
                assert (await stub.PublishWeights(weights_request(state, 1))).applied  # a good one is taken

    run(main())
    spec = env_spec(ENV)  # nor does a server start with them (a checkpoint's)
    net = build_policy("mlp-small", spec.obs_shape[0], spec.act_shape[0])
    net.load_state_dict(_spoiled(net.state_dict(), changes))
    with pytest.raises(ValueError, match=message):
        TorchPolicyBackend(net, spec.act_low, spec.act_high, compute_values=True)


def test_weights_of_another_dtype_are_cast_and_values_past_the_served_dtype_are_refused() -> None:
    """A trainer that sends FLOAT64 (numpy's default) is served as the module's float32. A finite
    float64 past float32's range would be cast to Inf: before, 1e300 in the first layer's bias of
    the value head was swapped in (its tanh hid it from the forward-pass check) and the module
    held Inf. Now the publish is refused naming the tensor and the entry, and the served weights
    stay."""

    async def main() -> None:
        async with running_server(_backend(), learner=TransitionConfig()) as server:
            backend = server.servicer.backend
            assert isinstance(backend, TorchPolicyBackend)
            state = _backend(seed=5).policy.state_dict()
            as_float64 = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.LearnerStub(channel)
                request = weights_request(as_float64, 1)
                assert request.tensors["critic.0.bias"].dtype == pb.FLOAT64
                assert (await stub.PublishWeights(request)).applied
                served = backend.policy.state_dict()
                assert all(served[k].dtype == v.dtype for k, v in state.items())
                assert all(torch.equal(served[k], v) for k, v in state.items())  # exact in float64

                past = _spoiled(as_float64, {"critic.0.bias": (7, 1e300)})
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.PublishWeights(weights_request(past, 2))
                assert (info.value.code(), info.value.details()) == (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "weights['critic.0.bias']: 1e+300 at index 7 is past the range of float32 "
                    "(1 such values in all)",
                )
                assert backend.version == 1
                assert all(bool(torch.isfinite(v).all()) for v in backend.policy.state_dict().values())

    run(main())


@pytest.mark.parametrize(
    ("value", "dtype", "refused"),
    [
        (np.array([1.0, -1e300]), torch.float32, "-1e+300 at index 1 is past the range of float32"),
        (np.array([[0, 70000]]), torch.float16, "70000 at index [0, 1] is past the range of float16"),
        (np.array([-(2**63)]), torch.float16, "-9223372036854775808 at index 0 is past the range of float16"),
        (np.array([3.4e38], np.float32), torch.bfloat16, "is past the range of bfloat16"),
        (np.array([3.38e38], np.float32), torch.bfloat16, None),  # rounds to bfloat16's largest
        (np.array([255, 0], np.uint8), torch.float16, None),
        (np.array([1e300]), torch.float64, None),
    ],
)
def test_check_fits_refuses_exactly_the_values_a_cast_makes_inf(
    value: np.ndarray, dtype: torch.dtype, refused: str | None
) -> None:
    if refused is None:
        check_fits("w", value, dtype)  # taken: the cast keeps every value finite
        assert bool(torch.from_numpy(value).to(dtype).isfinite().all())
    else:
        with pytest.raises(ValueError, match=re.escape("weights['w']: ") + r".*" + re.escape(refused)):
            check_fits("w", value, dtype)


def test_weights_past_max_message_bytes_are_published_and_every_other_request_keeps_the_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A trainer's weights may be larger than ``max_message_bytes``, which bounds what a client
    sends on the Act path: ``mlp-large``'s (17.5 MB as float32) were refused with the default
    4 MiB, and ``edgerl train --policy mlp-large`` failed at its first publish. Here ``mlp-small``
    (37 KB) against 16 KiB: the publish is taken, also as FLOAT64, while every other method's
    requests past 16 KiB are refused with RESOURCE_EXHAUSTED naming the limit, and the server
    serves on."""
    limit = 16 * 1024
    obs_dim = env_spec(ENV).obs_shape[0]
    message = re.compile(r"^request: [\d,]+ bytes, more than max_message_bytes \(16,384\)$")

    async def main() -> None:
        backend = _backend()
        assert backend.weights_values == sum(v.numel() for v in backend.policy.state_dict().values())
        async with running_server(backend, learner=TransitionConfig(), max_message_bytes=limit) as server:
            state = _backend(seed=5).policy.state_dict()
            as_float64 = {k: v.double() for k, v in state.items()}
            assert weights_request(state, 1).ByteSize() > 2 * limit
            async with grpc.aio.insecure_channel(server.address) as ch, EdgeClient(server.address) as client:
                stub = pb_grpc.LearnerStub(ch)
                assert (await stub.PublishWeights(weights_request(state, 1))).applied
                assert (await stub.PublishWeights(weights_request(as_float64, 2))).applied
                assert backend.version == 2

                healthy = await client.open_stream(session_id="healthy", num_envs=1, obs_shape=(obs_dim,))
                too_large = np.zeros((1, limit // 4 + 1), np.float32)  # > 16 KiB in one request
                refusals = []
                act = pb_grpc.EdgePolicyStub(ch).Act(timeout=10)
                await act.write(
                    pb.ActRequest(hello=pb.StreamHello(session_id="big", num_envs=1, obs_shape=[obs_dim]))
                )
                await act.write(
                    pb.ActRequest(step=pb.StepObservation(seq=0, env_ids=[0], obs=tensors.encode(too_large)))
                )
                with pytest.raises(grpc.aio.AioRpcError) as streamed:
                    await act.read()
                refusals.append(streamed.value)
                unary = pb.ActUnaryRequest(obs=tensors.encode(too_large))
                with pytest.raises(grpc.aio.AioRpcError) as called:
                    await pb_grpc.EdgePolicyStub(ch).ActUnary(unary, timeout=10)
                refusals.append(called.value)
                acks = stub.StreamTransitions(timeout=10)
                await acks.write(pb.TransitionAck(trainer_id="t" * limit))
                with pytest.raises(grpc.aio.AioRpcError) as acked:
                    await acks.read()
                refusals.append(acked.value)
                for refusal in refusals:
                    assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert message.match(refusal.details() or ""), refusal.details()
                obs = np.ones((1, obs_dim), np.float32)
                await healthy.send([0], obs, np.zeros(1), np.zeros(1, bool), np.zeros(1, bool))
                assert (await healthy.recv()).policy_version == 2  # the server serves on
                await healthy.close()

    run_without_errors(main(), caplog)


def _part(**fields: Any) -> pb.WeightsPart:
    return pb.WeightsPart(**fields)


def _layout_of(parts: list[pb.WeightsPart], name: str, **fields: Any) -> list[pb.WeightsPart]:
    """``parts`` with the layout's tensor ``name`` set to a Tensor of ``fields``."""
    first = pb.WeightsPart()
    first.CopyFrom(parts[0])
    first.layout[name].CopyFrom(pb.Tensor(**fields))
    return [first, *parts[1:]]


def _nan_in(parts: list[pb.WeightsPart], name: str) -> list[pb.WeightsPart]:
    at = next(i for i, p in enumerate(parts) if p.name == name)
    data = np.frombuffer(parts[at].data, np.float32).copy()
    data[3] = np.nan
    return [*parts[:at], _part(name=name, data=data.tobytes()), *parts[at + 1 :]]


def _without(parts: list[pb.WeightsPart], name: str) -> list[pb.WeightsPart]:
    first = pb.WeightsPart()
    first.CopyFrom(parts[0])
    del first.layout[name]
    return [first, *(p for p in parts[1:] if p.name != name)]


BAD_PUBLISHES: dict[str, tuple[Any, grpc.StatusCode, str]] = {
    "no message": (
        lambda p: [],
        grpc.StatusCode.INVALID_ARGUMENT,
        r"part 0: the stream ended before it \(the ",
    ),
    "data in the first": (
        lambda p: [_part(version=1, name="critic.4.bias", data=b"1234"), *p[1:]],
        grpc.StatusCode.INVALID_ARGUMENT,
        r"part 0: holds the version and layout, no data \(it names tensor 'critic.4.bias' and holds 4 "
        r"bytes\)$",
    ),
    "the served version": (
        lambda p: [_part(version=0), *p[1:]],
        grpc.StatusCode.FAILED_PRECONDITION,
        r"version: must be greater than the served version 0, got 0$",
    ),
    "a layout past the limit": (  # refused before the server allocates a byte of it
        lambda p: _layout_of(p, "huge", dtype=pb.FLOAT32, shape=[10**6, 10**4]),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        r"layout: 40,000,\d{3},\d{3} bytes of weights, more than max_weights_bytes \(1,\d{3},\d{3}\)$",
    ),
    "data in the layout": (
        lambda p: _layout_of(p, "critic.4.bias", dtype=pb.FLOAT32, shape=[1], data=b"1234"),
        grpc.StatusCode.INVALID_ARGUMENT,
        r"layout\['critic.4.bias'\].data: a layout holds no data \(4 bytes\); they follow in parts$",
    ),
    "an unknown dtype": (
        lambda p: _layout_of(p, "critic.4.bias", dtype=99, shape=[1]),
        grpc.StatusCode.INVALID_ARGUMENT,
        r"layout\['critic.4.bias'\].dtype: unsupported dtype 99$",
    ),
    "a part of no tensor": (
        lambda p: [*p, _part(name="critic.9.bias", data=b"1234")],
        grpc.StatusCode.INVALID_ARGUMENT,
        r"part \d+.name: 'critic.9.bias' is not in the layout$",
    ),
    "a part past its tensor": (
        lambda p: [*p, _part(name="critic.4.bias", data=b"1234")],
        grpc.StatusCode.INVALID_ARGUMENT,
        r"part \d+.data: 8 bytes of 'critic.4.bias', whose layout holds 4$",
    ),
    "a part missing": (
        lambda p: p[:-1],
        grpc.StatusCode.INVALID_ARGUMENT,
        r"layout\['critic.4.bias'\]: 0 of its 4 bytes came before the stream ended \(1 tensor\(s\) short\)$",
    ),
    "NaN": (
        lambda p: _nan_in(p, "critic.2.weight"),
        grpc.StatusCode.INVALID_ARGUMENT,
        r"layout\['critic.2.weight'\]: contains NaN or Inf$",
    ),
    "a tensor missing": (
        lambda p: _without(p, "critic.2.bias"),
        grpc.StatusCode.INVALID_ARGUMENT,
        r"weights: missing \['critic.2.bias'\], unknown \[\]$",
    ),
}


def test_weights_published_in_parts_are_swapped_in_exactly_as_in_one_message() -> None:
    """gRPC's messages stop at 2 GiB, a 0.5 B-parameter model as float32: a trainer's weights past
    it could not be published. ``PublishWeightsStream`` takes them in parts (here of 1000 bytes:
    a 16 KiB layer in 17), as float32 and as FLOAT64, and ``publish_weights`` sends weights of more
    than ``part_bytes`` that way. ``Describe`` says how much a publish may carry."""

    async def main() -> None:
        backend = _backend()
        async with running_server(backend, learner=TransitionConfig()) as server:
            state = _backend(seed=5).policy.state_dict()
            as_float64 = {k: v.double() for k, v in state.items()}
            parts = list(weights_parts(state, 1, part_bytes=1000))
            assert len(parts) == 1 + sum(-(-v.numel() * v.element_size() // 1000) for v in state.values())
            async with grpc.aio.insecure_channel(server.address) as channel, EdgeClient(server.address) as c:
                assert (await c.describe()).max_weights_bytes == 8 * backend.weights_values + (1 << 20)
                stub = pb_grpc.LearnerStub(channel)
                answer = await stub.PublishWeightsStream(iter(parts))
                assert (answer.policy_version, answer.applied) == (1, True)
                assert all(torch.equal(backend.policy.state_dict()[k], v) for k, v in state.items())
                other = _backend(seed=6).policy.state_dict()
                sync_stub = pb_grpc.LearnerStub(grpc.insecure_channel(server.address))
                answer = await _in_thread(
                    lambda: publish_weights(
                        sync_stub, {k: v.double() for k, v in other.items()}, 2, part_bytes=1000
                    )
                )
                assert (answer.policy_version, answer.applied) == (2, True)
                assert all(torch.equal(backend.policy.state_dict()[k], v) for k, v in other.items())
                answer = await stub.PublishWeightsStream(weights_parts(as_float64, 3, part_bytes=1 << 20))
                assert answer.applied and backend.version == 3  # the whole of each tensor in one part

    run(main())


@pytest.mark.parametrize("case", list(BAD_PUBLISHES))
def test_a_publish_in_parts_that_is_wrong_is_refused_naming_the_part_and_the_served_weights_stay(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    spoil, code, message = BAD_PUBLISHES[case]

    async def main() -> None:
        backend = _backend()
        async with running_server(backend, learner=TransitionConfig()) as server:
            served = {k: v.clone() for k, v in backend.policy.state_dict().items()}
            state = _backend(seed=5).policy.state_dict()
            parts = list(weights_parts(state, 1, part_bytes=1000))
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.LearnerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.PublishWeightsStream(iter(spoil(parts)), timeout=10)
                assert info.value.code() == code
                assert re.match(message, info.value.details() or ""), info.value.details()
                assert backend.version == 0
                assert all(torch.equal(backend.policy.state_dict()[k], v) for k, v in served.items())
                answer = await act_once(server.address, np.zeros((1, 4), np.float32))
                assert answer.policy_version == 0  # the server serves on
                assert (
                    await stub.PublishWeightsStream(iter(parts), timeout=10)
                ).applied  # and takes a good one

    run_without_errors(main(), caplog)


def test_a_publish_in_parts_skipped_by_the_sync_interval_is_answered_without_its_data() -> None:
    async def main() -> None:
        backend = _backend()
        async with running_server(backend, learner=TransitionConfig(weight_sync_interval=2)) as server:
            state = _backend(seed=5).policy.state_dict()
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.LearnerStub(channel)
                skipped = await stub.PublishWeightsStream(
                    weights_parts(state, 1, part_bytes=1000), timeout=10
                )
                assert (skipped.policy_version, skipped.applied, backend.version) == (0, False, 0)
                taken = await stub.PublishWeightsStream(weights_parts(state, 2, part_bytes=1000), timeout=10)
                assert (taken.policy_version, taken.applied, backend.version) == (2, True, 2)

    run(main())


def test_the_deadline_of_a_publish_grows_with_its_weights() -> None:
    """A fixed 30 s cut off weights past ~4 GB over 1 Gbit/s Ethernet (2.3 GB took 4.6 s on
    loopback): the deadline allows for a transfer at 50 MB/s on top."""
    assert publish_deadline_s(0, 30.0) == 30.0
    assert publish_deadline_s(17_500_000, 30.0) == pytest.approx(30.35)  # mlp-large
    assert publish_deadline_s(14 * 10**9, 30.0) == pytest.approx(310.0)  # 7 B parameters as bfloat16


def test_weights_parts_checks_what_it_is_given_before_grpc_takes_its_messages() -> None:
    with pytest.raises(ValueError, match="part_bytes must be >= 1, got 0"):
        weights_parts({"w": np.zeros(3)}, 1, part_bytes=0)
    with pytest.raises(ValueError, match="has no wire form"):
        weights_parts({"w": np.zeros(3, np.complex64)}, 1)
    parts = list(weights_parts({"s": np.float64(2.5), "e": np.zeros((0, 3)), "b": np.ones(5, bool)}, 7, 2))
    assert [p.name for p in parts[1:]] == ["s"] * 4 + ["b"] * 3  # 2 bytes at most to a part; "e" has none
    assert all(len(p.data) <= 2 for p in parts[1:]) and b"".join(p.data for p in parts[5:]) == b"\x01" * 5
    assert np.frombuffer(b"".join(p.data for p in parts[1:5]), "<f8")[0] == 2.5
    assert sorted((k, list(t.shape), t.dtype) for k, t in parts[0].layout.items()) == sorted(
        [
            ("s", [], pb.FLOAT64),
            ("e", [0, 3], pb.FLOAT64),
            ("b", [5], pb.BOOL),
        ]
    )


def test_the_publish_limit_fits_the_largest_preset_as_float64_and_stops_at_grpcs() -> None:
    net = build_policy("mlp-large", 17, 6)
    values = sum(v.numel() for v in net.state_dict().values())
    as_float64 = weights_request({k: v.double() for k, v in net.state_dict().items()}, 1).ByteSize()
    assert 4 * 1024 * 1024 < as_float64 <= publish_limit(values, 4 * 1024 * 1024)
    assert publish_limit(0, 4 * 1024 * 1024) == 4 * 1024 * 1024  # a backend that takes no weights
    assert publish_limit(10**9, 4 * 1024 * 1024) == 2**31 - 1  # gRPC's largest


def test_publish_and_the_transition_feed_without_a_learner_are_unimplemented() -> None:
    async def main() -> None:
        async with running_server(_backend()) as server:
            channel = grpc.insecure_channel(server.address)
            with pytest.raises(errors.RpcError) as exc:
                await _in_thread(publish_weights, pb_grpc.LearnerStub(channel), {}, 1)
            assert exc.value.code == grpc.StatusCode.UNIMPLEMENTED
            channel.close()
            # A trainer's feed fails for good instead of waiting: take() raises what the server said.
            feed = TransitionFeed(server.address, window_steps=64).start()
            try:
                with pytest.raises(errors.RpcError) as failed:
                    await _in_thread(feed.take, 8)
                assert failed.value.code == grpc.StatusCode.UNIMPLEMENTED
                assert feed.reconnects == 0  # not retried
                with pytest.raises(ValueError, match=r"take\(65\): more than window_steps \(64\)"):
                    feed.take(65)  # the server never sends more unacknowledged: it would wait forever
            finally:
                await _in_thread(feed.close)

    run(main())
