"""The event loop of edgerl's processes: uvloop by default, the standard loop on request."""

import asyncio
import sys

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


def test_without_uvloop_the_standard_loop_runs_unless_uvloop_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now fails
    monkeypatch.delenv(eventloop.EVENT_LOOP_ENV, raising=False)
    assert eventloop.loop_factory() is None
    monkeypatch.setenv(eventloop.EVENT_LOOP_ENV, "uvloop")
    with pytest.raises(ImportError):
        eventloop.loop_factory()
