"""The local Act socket: a real server, real Unix sockets, real MuJoCo envs behind a sim worker."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import socket
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from edgerl.edge_server.policy import TorchPolicyBackend
from edgerl.edge_server.transitions import TransitionConfig
from edgerl.edge_server.validation import InvalidRequestError, StreamSpec, check_rows
from edgerl.models import build_policy
from edgerl.proto import frames
from edgerl.proto.v1 import edge_pb2_grpc as pb_grpc
from edgerl.robot_client import errors
from edgerl.robot_client.client import EdgeClient
from edgerl.robot_client.keeper import StreamSettings
from edgerl.robot_client.sim_worker import SimWorker, SimWorkerConfig, _LocalEnd
from edgerl.sim.envs import env_spec
from tests.helpers import (
    EchoPolicy,
    ServerThread,
    act_once,
    inject_fault,
    on_session,
    run,
    run_without_warnings,
    running_server,
    serving,
    stepping,
    steps_on,
    wait_until,
    waited,
)

OBS, ACT = 3, 2
_Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def _settings(num_envs: Any = 4, obs_shape: list[Any] | None = None, **more: Any) -> bytes:
    fields = {"session_id": "local-test", "num_envs": num_envs, "obs_shape": obs_shape or [OBS], **more}
    return frames.frame(frames.CONFIG + json.dumps(fields).encode())


def _rows(
    ids: list[int], obs: np.ndarray | None = None, flags: np.ndarray | None = None, reward: float = 1.0
) -> frames.ObsRows:
    n = len(ids)
    if obs is None:
        obs = np.arange(n * OBS, dtype=np.float32).reshape(n, OBS) + 10 * ids[0]
    return frames.ObsRows(
        np.asarray(ids, np.int32),
        obs,
        np.full(n, reward, np.float32),
        np.zeros((n, 3), np.uint8) if flags is None else flags,
        np.zeros(n, np.uint64),
    )


async def _read(reader: asyncio.StreamReader) -> bytes:
    (n,) = frames.LENGTH.unpack(await reader.readexactly(frames.LENGTH.size))
    return await reader.readexactly(n)


@contextlib.asynccontextmanager
async def _connected(path: str, settings: bytes | None = None, greet: bool = True) -> AsyncIterator[_Stream]:
    """A connection to the local socket, closed at the end; with ``greet``, a stream the server
    accepted (``settings`` sent, its ``U`` frame read)."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        if greet:
            writer.write(_settings() if settings is None else settings)
            assert (await _read(reader))[:1] == frames.UP
        yield reader, writer
    finally:
        writer.close()


async def _ask(stream: _Stream, ids: list[int], epoch: int = 1) -> frames.AnswerRows:
    reader, writer = stream
    rows = _rows(ids)
    writer.write(frames.encode_obs(epoch, rows))
    answer = frames.decode_answer(await _read(reader))
    np.testing.assert_array_equal(answer.actions, rows.obs[:, :ACT])  # EchoPolicy: its own row's
    return answer


async def _refusal(reader: asyncio.StreamReader) -> tuple[str, str]:
    """The status name and message of the ``D`` frame that ends a stream (then EOF)."""
    payload = await _read(reader)
    if payload[:1] == frames.UP:  # the settings were good; what came after them was not
        payload = await _read(reader)
    assert payload[:1] == frames.DOWN
    _, code, details = frames.decode_failure(payload)
    assert await reader.read() == b""  # the server closed the socket
    return code, details


def test_local_stream_answers_every_frame_in_order_from_its_own_rows(tmp_path: Path) -> None:
    async def main() -> None:
        backend = EchoPolicy(OBS, ACT)
        backend.version = 5
        path = str(tmp_path / "act.sock")
        async with running_server(backend, local_socket=path) as server, _connected(path) as (reader, writer):
            sent = [_rows([0, 1]), _rows([2, 3]), _rows([0, 1], np.full((2, OBS), -1, np.float32))]
            for rows in sent:  # all in flight at once: answered in the order sent
                writer.write(frames.encode_obs(7, rows))
            for rows in sent:
                answer = frames.decode_answer(await _read(reader))
                assert (answer.epoch, answer.policy_version) == (7, 5)
                np.testing.assert_array_equal(answer.actions, rows.obs[:, :ACT])
                np.testing.assert_allclose(answer.log_probs, rows.obs.sum(1))
            assert server.servicer.active_streams == 1
            assert server.batcher.stats.requests == 3
            writer.close()
            await writer.wait_closed()
            # the server sees the close on its next loop turn
            assert await waited(lambda: server.servicer.active_streams == 0, timeout_s=1)

    run(main())


def test_local_stream_reassembles_frames_longer_than_one_read(tmp_path: Path) -> None:
    rows_per_frame = 32
    obs_size = frames.RECV_BYTES // (4 * rows_per_frame) + 50  # O frames of over 64 KiB

    async def main() -> None:
        path = str(tmp_path / "act.sock")
        settings = _settings(num_envs=64, obs_shape=[obs_size])
        async with (
            running_server(EchoPolicy(obs_size, ACT), local_socket=path) as server,
            _connected(path, settings) as (reader, writer),
        ):
            rng = np.random.default_rng(0)
            shape = (rows_per_frame, obs_size)
            sent = [
                _rows(list(range(lo, lo + rows_per_frame)), rng.standard_normal(shape, np.float32))
                for lo in (0, rows_per_frame)
            ]
            data = b"".join(frames.encode_obs(3, rows) for rows in sent)
            assert len(data) > 2 * frames.RECV_BYTES
            writer.write(data)  # both frames at once
            for answered in sent:
                answer = frames.decode_answer(await _read(reader))
                np.testing.assert_array_equal(answer.actions, answered.obs[:, :ACT])
            for at in range(0, len(data), 10_000):  # then in pieces that end inside frames
                writer.write(data[at : at + 10_000])
                await writer.drain()
                await asyncio.sleep(0.002)
            for answered in sent:
                answer = frames.decode_answer(await _read(reader))
                np.testing.assert_array_equal(answer.actions, answered.obs[:, :ACT])
            assert server.batcher.stats.rows == 4 * rows_per_frame

    run(main())


def test_local_and_grpc_streams_share_the_batcher(tmp_path: Path) -> None:
    async def main() -> None:
        backend = EchoPolicy(OBS, ACT, delay_s=0.2)
        path = str(tmp_path / "act.sock")
        async with (
            running_server(backend, local_socket=path, max_delay_us=100_000) as server,
            _connected(path) as stream,
        ):
            grpc_answer = asyncio.ensure_future(act_once(f"127.0.0.1:{server.port}", _rows([0, 1]).obs))
            while server.batcher.queued_rows < 2:  # it waits for the local stream, also open
                await asyncio.sleep(0.005)
            await _ask(stream, [0, 1, 2])
            await grpc_answer
            assert 5 in backend.batch_sizes  # one forward pass took both transports' rows

    run(main())


def test_an_idle_backfill_stream_is_not_waited_for_over_either_transport(tmp_path: Path) -> None:
    """A batch waits up to max_delay_us (here 5 s) while an open stream may still send, unless
    that stream is a backfill stream (settings ``backfill``, ``StreamHello.backfill``)."""

    async def main() -> None:
        path = str(tmp_path / "act.sock")
        async with (
            running_server(EchoPolicy(OBS, ACT), local_socket=path, max_delay_us=5_000_000) as server,
            # an idle backfill stream on the local socket: a gRPC stream's step goes at once
            _connected(path, _settings(backfill=True)),
        ):
            address = f"127.0.0.1:{server.port}"
            answer = await asyncio.wait_for(act_once(address, _rows([0, 1]).obs), 2.0)
            assert answer.queue_wait_us < 1_000_000
            # an idle backfill stream over gRPC: a local stream's step goes at once
            async with EdgeClient(address) as client, _connected(path) as local:
                idle = await client.open_stream(session_id="idle", num_envs=2, obs_shape=[OBS], backfill=True)
                await asyncio.wait_for(_ask(local, [0, 1, 2]), 2.0)  # far below the 5 s delay
                # an idle stream that is no backfill stream is waited for
                assert server.batcher.waited_streams == 1  # the local stream only
                plain = await client.open_stream(session_id="plain", num_envs=2, obs_shape=[OBS])
                while server.batcher.waited_streams < 2:  # its hello is read
                    await asyncio.sleep(0.005)
                waiting = asyncio.ensure_future(_ask(local, [3]))
                await asyncio.sleep(0.3)
                assert not waiting.done()
                await plain.close()  # one stream fewer to wait for: the step goes
                await asyncio.wait_for(waiting, 2.0)
                await idle.close()

    run(main())


_GOOD = _rows([0, 1])
_CASES = [
    ("first frame not settings", frames.encode_obs(1, _GOOD), "FAILED_PRECONDITION", "must be its settings"),
    ("settings not JSON", frames.frame(frames.CONFIG + b"{nope"), "INVALID_ARGUMENT", "settings: not JSON ("),
    (
        "settings not UTF-8",
        frames.frame(frames.CONFIG + b"\xff{}"),
        "INVALID_ARGUMENT",
        "settings: not JSON ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)",
    ),
    (  # the parser's RecursionError: once a fault of the server's own (INTERNAL, a traceback logged)
        "settings nested too deep",
        frames.frame(frames.CONFIG + b"[" * 4000),  # within max_message_bytes (4096)
        "INVALID_ARGUMENT",
        "settings: nested too deep to be read",
    ),
    (
        "settings not an object",
        frames.frame(frames.CONFIG + b"[4, 3]"),
        "INVALID_ARGUMENT",
        "settings: must be a JSON object, got list",
    ),
    (
        "settings missing num_envs",
        frames.frame(frames.CONFIG + b'{"session_id": "x"}'),
        "INVALID_ARGUMENT",
        "settings.num_envs: missing",
    ),
    (
        "num_envs not a number",
        _settings(num_envs="4"),
        "INVALID_ARGUMENT",
        "settings.num_envs: must be an integer, got '4'",
    ),
    (
        "num_envs past uint32",
        _settings(num_envs=1 << 40),
        "INVALID_ARGUMENT",
        "settings.num_envs: must be in [0, 4294967296), got 1099511627776",
    ),
    (
        "obs_shape of floats",
        _settings(obs_shape=[3.0]),
        "INVALID_ARGUMENT",
        "settings.obs_shape: must be a list of integers in [0, 4294967296), got [3.0]",
    ),
    (
        "session_id not a string",
        _settings(session_id=7),
        "INVALID_ARGUMENT",
        "settings.session_id: must be a string, got 7",
    ),
    (
        "backfill not a bool",
        _settings(backfill="yes"),
        "INVALID_ARGUMENT",
        "settings.backfill: must be true or false, got 'yes'",
    ),
    (
        "mid_episode not a bool",
        _settings(mid_episode=1),
        "INVALID_ARGUMENT",
        "settings.mid_episode: must be true or false, got 1",
    ),
    (
        "resumes not a bool",
        _settings(resumes="true"),
        "INVALID_ARGUMENT",
        "settings.resumes: must be true or false, got 'true'",
    ),
    ("obs shape of another env", _settings(obs_shape=[17]), "INVALID_ARGUMENT", "hello.obs_shape"),
    ("no session id", _settings(session_id=""), "INVALID_ARGUMENT", "hello.session_id"),
    (
        "another env's stream",  # the server's policy is for Toy-v0 (the good stream names it)
        _settings(env_name="Walker2d-v5"),
        "INVALID_ARGUMENT",
        "hello.env_name: the server serves a policy for Toy-v0, got Walker2d-v5",
    ),
    ("settings twice", _settings() + _settings(), "FAILED_PRECONDITION", "settings: sent twice"),
    ("unknown frame kind", _settings() + frames.frame(b"Z"), "INVALID_ARGUMENT", "frame: unknown kind"),
    (
        "truncated rows",
        _settings() + frames.frame(frames.encode_obs(1, _GOOD)[4:-5]),
        "INVALID_ARGUMENT",
        "rows: a malformed frame",
    ),
    (
        "NaN observation",
        _settings() + frames.encode_obs(1, _rows([0, 1], np.array([[0, 0, 0], [1, np.nan, 1]], np.float32))),
        "INVALID_ARGUMENT",
        "rows.obs: row 1 contains NaN or Inf",
    ),
    (
        "NaN reward",
        _settings() + frames.encode_obs(1, _rows([0, 1], reward=np.nan)),
        "INVALID_ARGUMENT",
        "rows.rewards: contains NaN or Inf",
    ),
    (
        "env id past num_envs",
        _settings() + frames.encode_obs(1, _rows([3, 4])),
        "INVALID_ARGUMENT",
        "rows.env_ids: ids must be in [0, num_envs=4), got 4",
    ),
    (
        "duplicate env id",
        _settings() + frames.encode_obs(1, _rows([1, 0, 1])),
        "INVALID_ARGUMENT",
        "rows.env_ids: duplicate env id",
    ),
    (
        "wrong obs size",
        _settings() + frames.encode_obs(1, _rows([0], np.zeros((1, 5), np.float32))),
        "INVALID_ARGUMENT",
        "rows.obs: expected 3 values per row",
    ),
    (
        "flag not 0/1",
        _settings() + frames.encode_obs(1, _rows([0], flags=np.array([[2, 0, 0]], np.uint8))),
        "INVALID_ARGUMENT",
        "rows.flags",
    ),
    (
        "obs_index past int64",
        _settings()
        + frames.encode_obs(1, dataclasses.replace(_rows([0, 1]), obs_index=np.array([1, 2**63], np.uint64))),
        "INVALID_ARGUMENT",
        "rows.obs_index: indices must be < 2**63, got 9223372036854775808",
    ),
    (
        "frame over max_message_bytes",
        _settings() + frames.LENGTH.pack(5000),
        "RESOURCE_EXHAUSTED",
        "frame: 5000 bytes, more than the server's max_message_bytes (4096)",
    ),
]


@pytest.mark.parametrize(("bad", "code", "message"), [c[1:] for c in _CASES], ids=[c[0] for c in _CASES])
def test_bad_frames_get_their_status_and_other_streams_are_served(
    tmp_path: Path, bad: bytes, code: str, message: str
) -> None:
    async def main() -> None:
        path = str(tmp_path / "act.sock")
        async with (
            running_server(
                EchoPolicy(OBS, ACT), env_name="Toy-v0", local_socket=path, max_message_bytes=4096
            ) as server,
            _connected(path, _settings(env_name="Toy-v0")) as good,
        ):
            await _ask(good, [0, 1])
            async with _connected(path, greet=False) as (reader, writer):
                writer.write(bad)
                got_code, details = await _refusal(reader)
            assert got_code == code
            assert message in details
            await _ask(good, [2, 3])  # the other local stream is still served...
            answer = await act_once(f"127.0.0.1:{server.port}", _GOOD.obs)  # ...and gRPC's
            np.testing.assert_array_equal(answer.actions, _GOOD.obs[:, :ACT])
            assert server.servicer.rejected_invalid == 1

    run(main())


def test_a_closed_local_streams_queued_rows_are_dropped_unrun(tmp_path: Path) -> None:
    """A client sends 4 requests and goes: the first is in a running batch, the other 3 queued.
    Before, the 3 went through a forward pass whose answers no one read (an overloaded server
    computing the rows of the streams it lost). Now they are dropped from the queue; the next
    stream is served at once (the batcher waits for no one it dropped: its delay is 10 s)."""

    async def main() -> None:
        path = str(tmp_path / "act.sock")
        policy = EchoPolicy(OBS, ACT, delay_s=0.3)
        async with running_server(policy, local_socket=path, max_delay_us=10_000_000) as server:
            async with _connected(path) as (_reader, writer):
                for i in range(4):
                    writer.write(frames.encode_obs(1, _rows([i])))
                await writer.drain()
                assert await waited(lambda: server.batcher.queued_rows == 3, 5.0)
            assert await waited(lambda: server.batcher.stats.dropped_rows == 3, 5.0)
            async with _connected(path) as stream:
                await asyncio.wait_for(_ask(stream, [0, 1]), 5.0)
            assert policy.batch_sizes[1:] == [1, 2] and server.batcher.queued_rows == 0  # after the warm-up

    run(main())


def test_a_failed_forward_pass_fails_its_local_stream_with_internal_and_the_others_go_on(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        path = str(tmp_path / "act.sock")
        async with (
            running_server(EchoPolicy(OBS, ACT, fail_on=666), local_socket=path, max_delay_us=0) as server,
            _connected(path) as good,
            _connected(path) as (reader, writer),
        ):
            await _ask(good, [0, 1])
            writer.write(frames.encode_obs(1, _rows([0, 1], np.full((2, OBS), 666, np.float32))))
            assert await _refusal(reader) == ("INTERNAL", "policy forward pass failed: cannot act on 666")
            await _ask(good, [2, 3])  # the other stream is still served
            assert server.servicer.stats().failed_requests == 1

    run(main())


@pytest.mark.parametrize("where", ["check_rows", "TransitionStore.record"])
def test_a_fault_of_the_server_on_one_local_stream_refuses_it_with_internal_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """As over gRPC: the stream hears INTERNAL and why, where its socket was once closed without
    a word (a fault while its frame is read: asyncio's end of a protocol whose ``data_received``
    raised) or it heard nothing more (a fault while its answer is written); the log says which
    stream failed, with the traceback."""
    from edgerl.edge_server import local
    from edgerl.edge_server.transitions import TransitionStore

    owner = local if where == "check_rows" else TransitionStore
    message = inject_fault(owner, where.removeprefix("TransitionStore."), on_session("faulty"), monkeypatch)

    async def main() -> None:
        path = str(tmp_path / "act.sock")
        async with (
            running_server(
                EchoPolicy(OBS, ACT), local_socket=path, learner=TransitionConfig(segment_steps=2)
            ) as server,
            _connected(path) as good,
            _connected(path, _settings(session_id="faulty")) as (reader, writer),
        ):
            await _ask(good, [0, 1])
            writer.write(frames.encode_obs(1, _rows([0, 1])))
            assert await _refusal(reader) == ("INTERNAL", message)
            for ids in ([2, 3], [0, 1], [2, 3]):
                await _ask(good, ids)  # the other stream is still served
            assert server.servicer.rejected_invalid == 0  # not the client's fault
            assert await waited(lambda: server.servicer.active_streams == 1, 5.0)

    with caplog.at_level(logging.ERROR, logger="edgerl.edge_server.local"):
        run(main())
    failed = [r for r in caplog.records if r.getMessage() == "local stream faulty failed"]
    assert len(failed) == 1 and failed[0].exc_info is not None


@pytest.mark.parametrize("how", ["rows_in_flight", "answers_unread"])
def test_a_client_gone_mid_stream_frees_its_stream_and_the_others_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A client that goes away (a crash, a kill) while the server still owes it answers: its rows
    in the forward pass (``rows_in_flight``), or answers it stopped reading, so that the server's
    writes back up and then fail with a broken pipe (``answers_unread``). Its stream is closed,
    its slots and its session are freed, nothing is logged as a fault, and the other stream is
    served throughout."""
    rows = 256  # a full batch per frame: the answers outgrow the socket's buffers in ~100 frames

    async def main() -> None:
        path = str(tmp_path / "act.sock")
        delay_s = 0.3 if how == "rows_in_flight" else 0.0
        async with (
            running_server(
                EchoPolicy(OBS, ACT, delay_s=delay_s), local_socket=path, learner=TransitionConfig()
            ) as server,
            _connected(path) as good,
        ):
            assert server.local is not None
            reader, writer = await asyncio.open_unix_connection(path)
            writer.write(_settings(session_id="gone", num_envs=rows))
            assert (await _read(reader))[:1] == frames.UP
            (gone,) = [s for s in server.local.streams if s._spec and s._spec.session_id == "gone"]
            if how == "rows_in_flight":
                half = rows // 2
                for lo in (0, half):
                    writer.write(frames.encode_obs(1, _rows(list(range(lo, lo + half)))))
                assert await waited(lambda: len(gone._pending) == 2, 5.0)  # in the forward pass
            else:
                assert gone._transport is not None
                stats = server.batcher.stats

                async def answered(requests: int) -> bool:
                    return await waited(lambda: stats.requests >= requests and not gone._pending, 5.0)

                for epoch in range(2000):
                    if gone._transport.get_write_buffer_size() > 0:  # the server's writes backed up
                        break
                    want = stats.requests + 1
                    writer.write(frames.encode_obs(epoch, _rows(list(range(rows)))))
                    await writer.drain()
                    assert await answered(want)
                else:
                    pytest.fail("the server's answers never backed up")
            assert server.servicer.active_streams == 2
            writer.transport.abort()  # gone without reading what the server sent
            assert await waited(lambda: server.servicer.active_streams == 1, 5.0)
            assert gone not in server.local.streams and len(server.local.streams) == 1
            assert server.servicer.streams_open == 1
            assert server.batcher.waited_streams == 1
            for ids in ([0, 1], [2, 3], [0, 1]):
                await _ask(good, ids)  # the other stream is served
            await asyncio.sleep(2 * delay_s)  # the gone stream's rows come out of the forward pass
            await _ask(good, [2, 3])
            assert server.servicer.rejected_invalid == 0

    run_without_warnings(main(), caplog)


def test_local_and_grpc_streams_count_together_against_max_streams(tmp_path: Path) -> None:
    async def main() -> None:
        path = str(tmp_path / "act.sock")
        async with running_server(EchoPolicy(OBS, ACT), local_socket=path, max_streams=2) as server:
            address = f"127.0.0.1:{server.port}"
            async with _connected(path) as local, EdgeClient(address) as client:
                remote = await client.open_stream(session_id="remote", num_envs=2, obs_shape=(OBS,))
                await remote.send([0, 1], _rows([0, 1]).obs, np.zeros(2), [False] * 2, [False] * 2)
                await remote.recv()
                async with _connected(path, greet=False) as (reader, writer):
                    writer.write(_settings(session_id="third"))
                    code, details = await _refusal(reader)
                assert code == "UNAVAILABLE"
                assert (
                    details
                    == "max_streams: 2 stream(s) open, the server takes at most 2; retry when one has ended"
                )
                with pytest.raises(errors.ServerUnavailableError, match="max_streams"):
                    await act_once(address, _rows([0]).obs, session_id="fourth")
                await _ask(local, [0, 1])  # both open streams are served
                await remote.send([0, 1], _rows([0, 1]).obs, np.zeros(2), [False] * 2, [False] * 2)
                await remote.recv()
                await remote.close()
                assert await waited(lambda: server.servicer.streams_open == 1, 5.0)
                async with _connected(path, _settings(session_id="fifth")) as fifth:  # its place
                    await _ask(fifth, [2, 3])
            assert await waited(lambda: server.servicer.streams_open == 0, 5.0)
            assert (server.servicer.rejected_streams, server.servicer.rejected_invalid) == (2, 0)

    run(main())


def test_a_local_stream_without_its_settings_is_refused_after_hello_timeout_s(tmp_path: Path) -> None:
    async def main() -> None:
        path = str(tmp_path / "act.sock")
        async with (
            running_server(EchoPolicy(OBS, ACT), local_socket=path, hello_timeout_s=0.3) as server,
            _connected(path) as good,
            _connected(path, greet=False) as (reader, _),
        ):
            code, details = await _refusal(reader)  # nothing sent
            assert code == "DEADLINE_EXCEEDED"
            assert details == "settings: no settings frame (C) within 0.3 s of the stream's start"
            await _ask(good, [0, 1])  # the stream that sent its settings is served
            assert server.servicer.rejected_invalid == 1

    run(main())


def test_local_streams_that_have_sent_no_settings_are_bounded_by_max_streams(tmp_path: Path) -> None:
    """A local connection that sends nothing waited for its settings until ``hello_timeout_s``,
    and nothing bounded how many did, as gRPC calls without their hello were not before. Now
    both count against one bound, ``max_streams``: a connection past it is refused at once
    with UNAVAILABLE naming the limit (and counted in ``rejected_streams``), and one is let in
    again as soon as a waiting one sends its settings or goes. Open streams are served on."""

    async def main() -> None:
        path = str(tmp_path / "act.sock")
        async with (
            running_server(
                EchoPolicy(OBS, ACT), local_socket=path, max_streams=3, hello_timeout_s=30.0
            ) as server,
            _connected(path) as good,
        ):
            servicer = server.servicer
            async with (
                grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch,
                _connected(path, greet=False) as (_, quiet_writer),
                _connected(path, greet=False) as gone,
            ):
                call = pb_grpc.EdgePolicyStub(ch).Act(timeout=30)  # a gRPC call without its hello
                assert await waited(lambda: servicer.streams_awaiting_hello == 3, 5.0)
                async with _connected(path, greet=False) as (reader, _):
                    code, details = await _refusal(reader)
                assert (code, details) == (
                    "UNAVAILABLE",
                    "max_streams: 3 stream(s) have sent no hello yet, the server waits for at most 3 "
                    "at once; retry when one has ended",
                )
                st = servicer.stats()
                assert (st.rejected_streams, st.rejected_invalid, st.streams_awaiting_hello) == (1, 0, 3)
                await _ask(good, [0, 1])  # an open stream is served on
                quiet_writer.write(_settings(session_id="late"))  # now an open stream
                gone[1].close()
                assert await waited(lambda: servicer.streams_awaiting_hello == 1, 5.0)
                async with _connected(path, _settings(session_id="let-in")) as let_in:
                    await _ask(let_in, [2, 3])
                call.cancel()
            assert await waited(lambda: servicer.streams_awaiting_hello == 0, 5.0)

    run(main())


def test_a_sim_worker_refused_for_max_streams_waits_and_steps_once_a_stream_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        path = str(tmp_path / "act.sock")
        async with running_server(_pendulum_backend(), local_socket=path, max_streams=1) as server:
            holder = await asyncio.open_unix_connection(path)
            holder[1].write(_settings(session_id="holder", obs_shape=[4]))
            assert (await _read(holder[0]))[:1] == frames.UP
            worker = _worker(path, max_steps=500)
            try:
                running = asyncio.ensure_future(worker.run())
                assert await waited(lambda: server.servicer.rejected_streams >= 2, 10.0)  # it retries
                assert worker.progress.steps == 0 and not running.done()
                holder[1].close()
                progress = await asyncio.wait_for(running, 60.0)
            finally:
                worker.close()
            assert progress.steps >= 500 and progress.reconnects >= 2
        assert "max_streams: 1 stream(s) open, the server takes at most 1" in caplog.text

    with caplog.at_level(logging.WARNING, logger="edgerl.robot_client.sim_worker"):
        run(main())


def test_local_stream_collects_the_same_transitions_as_the_act_rpc(tmp_path: Path) -> None:
    """The transition store sees a local stream's steps as it sees the Act RPC's."""

    async def stats(local: bool) -> dict[str, int]:
        path = str(tmp_path / "act.sock")
        cfg = TransitionConfig(segment_steps=2)
        async with running_server(EchoPolicy(OBS, ACT), local_socket=path, learner=cfg) as server:
            obs = _rows([0, 1]).obs
            if local:
                async with _connected(path, _settings(num_envs=2)) as stream:
                    for _ in range(5):
                        await _ask(stream, [0, 1])
            else:
                from edgerl.robot_client.client import EdgeClient

                async with EdgeClient(f"127.0.0.1:{server.port}") as client:
                    s = await client.open_stream(session_id="local-test", num_envs=2, obs_shape=(OBS,))
                    for _ in range(5):
                        await s.send([0, 1], obs, np.ones(2), [False] * 2, [False] * 2)
                        await s.recv()
            return server.servicer._transition_stats()

    async def main() -> None:
        over_grpc, over_local = await stats(False), await stats(True)
        assert over_local["transitions"] > 0
        assert over_local == over_grpc

    run(main())


def test_shutdown_answers_what_is_in_flight_then_closes_and_removes_the_socket(tmp_path: Path) -> None:
    async def main() -> None:
        path = str(tmp_path / "act.sock")
        async with (
            running_server(EchoPolicy(OBS, ACT, delay_s=0.3), local_socket=path) as server,
            _connected(path) as (reader, writer),
        ):
            writer.write(frames.encode_obs(1, _rows([0, 1])))
            await asyncio.sleep(0.1)  # in the forward pass
            stopping = asyncio.ensure_future(server.stop(grace_s=1.0))
            assert (await _read(reader))[:1] == frames.ANSWER  # the in-flight rows were answered
            await stopping
            assert await reader.read() == b""
            assert not os.path.exists(path)
            with pytest.raises(OSError):
                await asyncio.open_unix_connection(path)

    run(main())


def test_socket_is_private_and_a_stale_one_is_replaced(tmp_path: Path) -> None:
    async def main() -> None:
        path = str(tmp_path / "act.sock")
        async with running_server(EchoPolicy(OBS, ACT), local_socket=path):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            os.link(path, tmp_path / "stale.sock")  # a socket file no server listens on
        async with running_server(EchoPolicy(OBS, ACT), local_socket=str(tmp_path / "stale.sock")):
            async with _connected(str(tmp_path / "stale.sock")) as stream:
                await _ask(stream, [0])
        # a path that is not a socket is refused and left as it is: see test_server's
        # test_a_port_or_socket_that_cannot_be_bound_is_a_bind_error_and_the_server_holds_nothing

    run(main())


def test_check_rows_reads_runs_and_ids_out_of_order() -> None:
    spec = StreamSpec("s", "", num_envs=6, max_inflight=6)
    obs = check_rows(_rows([5, 0, 3]), spec, (OBS,), max_rows=8)
    assert obs.shape == (3, OBS)
    run = _rows([2, 3, 4])
    assert (check_rows(run, spec, (OBS,), max_rows=8) == run.obs).all()
    bad = (
        ([5, 0, 5], "duplicate env id"),
        ([0, 2, 2], "duplicate env id"),  # spans three ids, as a run would
        ([2, -1], r"\[0, num_envs=6\), got -1"),
        ([4, 5, 6], r"\[0, num_envs=6\), got 6"),  # a run past the stream's envs
    )
    for ids, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            check_rows(_rows(ids), spec, (OBS,), max_rows=8)
    with pytest.raises(InvalidRequestError, match="need 1 to 2 env ids"):
        check_rows(_rows([0, 1, 2]), spec, (OBS,), max_rows=2)


# -- a sim worker over the local socket: real MuJoCo envs ----------------------------------------
PENDULUM = "InvertedPendulum-v5"


def _pendulum_backend(version: int = 0) -> TorchPolicyBackend:
    spec = env_spec(PENDULUM)
    policy = build_policy("mlp", spec.obs_shape[0], spec.act_low.size, seed=0)
    return TorchPolicyBackend(policy, spec.act_low, spec.act_high, version=version)


def _worker(path: str, **more: Any) -> SimWorker:
    cfg = SimWorkerConfig(server="", env_name=PENDULUM, num_envs=8, groups=2, local_socket=path, **more)
    return SimWorker(cfg)


def test_sim_worker_steps_real_envs_over_the_local_socket(tmp_path: Path) -> None:
    async def main() -> None:
        path = str(tmp_path / "act.sock")
        async with running_server(_pendulum_backend(version=3), local_socket=path) as server:
            worker = _worker(path, max_steps=2000)
            try:
                progress = await worker.run()
            finally:
                worker.close()
            assert progress.steps >= 2000
            assert progress.last_policy_version == 3
            assert len(progress.episode_returns) > 0  # the random policy drops the pendulum
            stats = server.batcher.stats
            assert stats.rows >= 2000 and stats.max_batch_rows == 4  # one group of 4 per request
            assert server.servicer.rejected_invalid == 0

    run(main())


def test_sim_worker_waits_for_the_server_and_rides_through_a_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "act.sock")
    worker = _worker(path, backoff_initial_s=0.05, backoff_max_s=0.2)
    with stepping(worker) as result:
        time.sleep(0.5)  # no server yet: the worker retries
        assert worker.progress.steps == 0
        with ServerThread(_pendulum_backend(), local_socket=path) as server:
            assert steps_on(worker)
            server.kill()
            time.sleep(0.3)
            server.restart()
            assert steps_on(worker)
    assert "error" not in result, result
    assert result["progress"].reconnects >= 2  # before the server came, and at the restart


def test_sim_worker_rides_through_a_server_process_killed_without_a_word(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``edgerl serve`` killed (SIGKILL: its streams get no goodbye, its socket file stays): the
    worker finds its socket closed under it, says so, and steps on with the server started in
    its place, which replaces the stale socket file."""
    path = str(tmp_path / "act.sock")
    command = ["--env", PENDULUM, "--local-socket", path]
    worker = _worker(path, backoff_initial_s=0.05, backoff_max_s=0.2)
    with stepping(worker) as result:
        with serving(*command) as (first, _):
            assert steps_on(worker)
            first.kill()
            first.wait(timeout=60)
        assert os.path.exists(path)  # left behind
        with serving(*command):
            assert steps_on(worker)
    assert "error" not in result, result
    # EOF, or ECONNRESET where the server died with bytes of the worker's unread
    closed = [f"the server closed the local socket {path}", f"the local socket {path} failed"]
    lost = "|".join(map(re.escape, closed))
    assert re.search(rf"stream to {re.escape(path)} failed \(({lost})", caplog.text), caplog.text


def test_worker_end_reassembles_answers_longer_than_one_read(tmp_path: Path) -> None:
    rows_per_frame = 32
    act = frames.RECV_BYTES // (4 * rows_per_frame) + 50  # each A frame spans two reads
    path = str(tmp_path / "act.sock")
    settings = StreamSettings("", "local-test", 2 * rows_per_frame, (act,), 5.0, 0.05, 0.5)
    with ServerThread(EchoPolicy(act, act), local_socket=path):
        end = _LocalEnd(path, settings, lambda: False)
        try:
            up = _next_frame(end)
            assert up[:1] == frames.UP
            epoch = frames.decode_state(up)
            rng = np.random.default_rng(0)
            sent = [
                _rows(
                    list(range(lo, lo + rows_per_frame)),
                    rng.standard_normal((rows_per_frame, act), np.float32),
                )
                for lo in (0, rows_per_frame)
            ]
            for rows in sent:  # both in flight: their answers arrive back to back
                end.send(epoch, rows)
            for rows in sent:
                payload = _next_frame(end)
                assert len(payload) > frames.RECV_BYTES
                answer = frames.decode_answer(payload)
                assert answer.epoch == epoch
                np.testing.assert_array_equal(answer.actions, rows.obs)
        finally:
            end.close()


def _next_frame(end: _LocalEnd) -> bytes:
    payload = wait_until(lambda: end.receive(0.1), timeout_s=10.0, poll_s=0.0)  # receive waits
    assert payload, "no frame within 10 s"
    return payload


def test_sim_worker_fails_on_a_refusal_and_gives_up_on_answers_always_late(tmp_path: Path) -> None:
    """A refusal ends the worker at once. An answer overdue ends its stream, and the worker opens
    another, until ``give_up_after_s`` has passed without an answer in time (before, the first
    overdue answer ended the worker)."""

    async def main() -> None:
        path = str(tmp_path / "act.sock")
        async with running_server(EchoPolicy(OBS, ACT), local_socket=path):
            worker = _worker(path)  # the pendulum's 4 observations, not the server's 3
            try:
                with pytest.raises(errors.InvalidArgumentError, match=r"hello\.obs_shape"):
                    await worker.run()
            finally:
                worker.close()
        async with running_server(EchoPolicy(4, 1, delay_s=1.5), local_socket=path):
            worker = _worker(path, timeout_s=0.3, backoff_initial_s=0.05, give_up_after_s=2.0)
            where = re.escape(path)
            gave_up = rf"^UNAVAILABLE: no working stream to {where} for 2s \(no answer within 0\.3s\)$"
            try:
                with pytest.raises(errors.ServerUnavailableError, match=gave_up):
                    await worker.run()
            finally:
                worker.close()
            assert worker.progress.reconnects >= 2  # a stream, its answer overdue, and another

    run(main())


def test_sim_worker_gives_up_on_a_socket_that_never_accepts_its_settings(tmp_path: Path) -> None:
    path = str(tmp_path / "mute.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind(path)
        mute.listen()  # connections wait in the backlog: nothing ever answers
        worker = _worker(path, timeout_s=0.3, backoff_initial_s=0.05, give_up_after_s=1.0)
        try:
            give_up = time.monotonic() + 10.0  # without the deadline, it would wait for ever
            gave_up = r"no working stream to .* for 1s \(no answer within 0\.3s\)"
            with pytest.raises(errors.ServerUnavailableError, match=gave_up):
                worker.run_blocking(lambda: time.monotonic() > give_up)
            assert worker.progress.reconnects >= 2  # each connection given its time, then another
        finally:
            worker.close()


def test_local_socket_and_network_process_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="local_socket and network_process exclude each other"):
        SimWorkerConfig(server="", local_socket="/tmp/x.sock", network_process=True)
