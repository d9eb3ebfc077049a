"""The event loop of edgerl's own processes: uvloop where it is installed.

Edge servers, sim workers and network processes spend much of each message in
the event loop's own machinery (callbacks, futures, the self-pipe that wakes
the loop from other threads). uvloop runs that machinery in C; gRPC's asyncio
API runs on it unchanged. On the reference 2-core machine it took the
server's CPU time per 32-row request from 380-389 to 356-361 us (``mlp-small``,
2 alternated runs each), and ``edgerl bench throughput --policy mlp-large``
from 19.9-20.1k to 20.5-20.8k env steps/s (2 alternated runs each).

``EDGERL_EVENT_LOOP=asyncio`` keeps the standard loop (for debugging, or to
compare); ``uvloop`` requires it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")

EVENT_LOOP_ENV = "EDGERL_EVENT_LOOP"
"""Environment variable choosing the loop: ``uvloop`` (the default where installed) or
``asyncio``."""


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of the chosen event loop; None for asyncio's default.

    Raises:
        ValueError: ``EDGERL_EVENT_LOOP`` names another loop.
        ImportError: it asks for uvloop, which is not installed.
    """
    choice = os.environ.get(EVENT_LOOP_ENV, "")
    if choice not in ("", "uvloop", "asyncio"):
        raise ValueError(f"{EVENT_LOOP_ENV}={choice!r}: choose uvloop or asyncio")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    """``asyncio.run(coro)`` on the chosen event loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coro)
