"""The event loop of edgerl's processes: uvloop by default, the standard loop on request."""

import asyncio

import pytest
import uvloop

from edgerl.robot_client import eventloop


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_runs_on_uvloop_unless_asked_for_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(eventloop.EVENT_LOOP_ENV, raising=False)
    assert issubclass(eventloop.run(_loop_type()), uvloop.Loop)
    monkeypatch.setenv(eventloop.EVENT_LOOP_ENV, "asyncio")
    assert not issubclass(eventloop.run(_loop_type()), uvloop.Loop)
    monkeypatch.setenv(eventloop.EVENT_LOOP_ENV, "trio")
    with pytest.raises(ValueError, match="EDGERL_EVENT_LOOP='trio': choose uvloop or asyncio"):
        eventloop.run(_loop_type())
