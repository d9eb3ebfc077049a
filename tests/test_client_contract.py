"""The streaming client against servers that break the wire contract.

Each server here is a real ``grpc.aio`` server on loopback implementing the
``EdgePolicy`` service (and the health service) itself, the way a server
written in another language could, with one deliberate fault. The client
must name what is wrong, with a named error, instead of handing its caller
actions that answer something else.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from edgerl.proto import tensors
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.proto.v1 import edge_pb2_grpc
from edgerl.robot_client import errors
from edgerl.robot_client.client import EdgeClient
from tests.helpers import act_once, run

OBS = 3
ACT = 2


def _answer(step: pb.StepObservation, *, seq: int | None = None) -> pb.ActResponse:
    rows = len(step.env_ids)
    return pb.ActResponse(
        seq=step.seq if seq is None else seq,
        env_ids=step.env_ids,
        actions=tensors.float32(np.zeros((rows, ACT), np.float32)),
        log_probs=[0.0] * rows,
    )


class ContractBreaker(edge_pb2_grpc.EdgePolicyServicer):
    """Answers each step of an Act stream with one fault, named by ``fault``."""

    def __init__(self, fault: str) -> None:
        self.fault = fault

    async def Act(  # noqa: N802 (the generated servicer's name)
        self, request_iterator: AsyncIterator[pb.ActRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ActResponse]:
        async for req in request_iterator:
            if req.HasField("hello"):
                continue
            step = req.step
            if self.fault == "out_of_order":
                yield _answer(step, seq=step.seq + 1)
            elif self.fault == "short_tensor":
                bad = _answer(step)
                bad.actions.data = bad.actions.data[:-1]
                yield bad
            elif self.fault == "unknown_dtype":
                bad = _answer(step)
                bad.actions.dtype = 99  # type: ignore[assignment]
                yield bad
            elif self.fault == "ends_ok":
                return  # status OK with the step unanswered
            elif self.fault == "aborts":
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full (4096 rows)")
            elif self.fault == "stops_reading":
                await asyncio.sleep(30)  # hung: takes no more messages, answers nothing
            else:
                raise AssertionError(self.fault)


@asynccontextmanager
async def contract_server(
    servicer: Any = None, *, health_status: Any = None
) -> AsyncIterator[tuple[str, Any]]:
    """A loopback server with ``servicer`` and, unless ``health_status`` is None, a health
    service reporting it for the whole server; yields its address and the health servicer."""
    server = grpc.aio.server()
    if servicer is not None:
        edge_pb2_grpc.add_EdgePolicyServicer_to_server(servicer, server)
    checker = None
    if health_status is not None:
        checker = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        await checker.set("", health_status)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", checker
    finally:
        await server.stop(None)


FAULTS: dict[str, tuple[type[errors.EdgeRLError], str]] = {
    "out_of_order": (errors.ProtocolError, "answer for step 1, expected 0"),
    "short_tensor": (
        errors.ProtocolError,
        "actions.data: 15 bytes do not match shape [2, 2] of FLOAT32 (16 bytes)",
    ),
    "unknown_dtype": (errors.ProtocolError, "actions.dtype: unsupported dtype 99"),
    "ends_ok": (errors.ProtocolError, "server closed the stream with messages unanswered"),
    "aborts": (errors.ResourceExhaustedError, "RESOURCE_EXHAUSTED: the queue is full (4096 rows)"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_answer_that_breaks_the_contract_is_a_named_error(fault: str) -> None:
    cls, message = FAULTS[fault]

    async def main() -> None:
        async with contract_server(ContractBreaker(fault)) as (address, _):
            with pytest.raises(errors.EdgeRLError) as info:
                await act_once(address, np.zeros((2, OBS), np.float32), session_id="s", timeout_s=5.0)
            assert type(info.value) is cls and str(info.value) == message

    run(main())


def test_a_server_that_stops_reading_fails_a_send_at_its_deadline_instead_of_hanging_it() -> None:
    """Once HTTP/2 flow control holds the client's writes, a send waits at most the stream's
    timeout for the one before it, then names the failure."""
    row = np.zeros((1, 65536), np.float32)  # 256 KiB a message

    async def main() -> None:
        async with contract_server(ContractBreaker("stops_reading")) as (address, _):
            async with EdgeClient(address, timeout_s=0.5) as client:
                stream = await client.open_stream(
                    session_id="s", num_envs=1024, obs_shape=row.shape[1:], max_inflight=1024
                )
                sent = 0
                t0 = time.monotonic()
                with pytest.raises(
                    errors.DeadlineExceededError, match=r"^DEADLINE_EXCEEDED: a write took over 0.5s$"
                ):
                    for i in range(400):  # 100 MiB, far beyond any window
                        await stream.send([i], row, [0.0], [False], [False])
                        sent += 1
                assert 1 <= sent < 400 and time.monotonic() - t0 < 30.0
                await stream.close()

    run(main())


def test_wait_ready_waits_while_the_server_is_not_serving() -> None:
    """NOT_SERVING (a server still loading its policy) is waited out, not taken for an answer."""

    async def main() -> None:
        async with contract_server(health_status=health_pb2.HealthCheckResponse.NOT_SERVING) as (
            address,
            checker,
        ):
            async with EdgeClient(address) as client:

                async def serve_later() -> None:
                    await asyncio.sleep(0.4)
                    await checker.set("", health_pb2.HealthCheckResponse.SERVING)

                later = asyncio.ensure_future(serve_later())
                t0 = time.monotonic()
                assert await client.wait_ready(timeout_s=10.0) is True
                assert 0.35 < time.monotonic() - t0 < 5.0
                await later
                # and a server that never serves is given up on at the timeout
                await checker.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                with pytest.raises(
                    errors.ServerUnavailableError, match=rf"^UNAVAILABLE: no server at {address} within 0.3s$"
                ):
                    await client.wait_ready(timeout_s=0.3)

    run(main())


def test_wait_ready_fails_at_once_on_a_server_without_the_health_service() -> None:
    """A server that answers, but not the health check, is not waited for until the timeout."""

    async def main() -> None:
        async with contract_server(ContractBreaker("aborts")) as (address, _):
            async with EdgeClient(address) as client:
                t0 = time.monotonic()
                with pytest.raises(errors.RpcError) as info:
                    await client.wait_ready(timeout_s=30.0)
                assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
                assert time.monotonic() - t0 < 5.0

    run(main())


def test_a_client_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match=re.escape("timeout_s must be a finite number > 0, got 0.0")):
        EdgeClient("127.0.0.1:1", timeout_s=0.0)
