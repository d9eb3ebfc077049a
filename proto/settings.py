"""Checks that the settings classes of edgerl make the same way (the watchdog, which imports
nothing else of edgerl, makes its own)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

GRPC_INT_MAX = 2**31 - 1
"""The largest number gRPC takes for an option, a C int: a message size in bytes, a time in
milliseconds (one more, and the channel or server fails with an OverflowError)."""
GRPC_MAX_S = GRPC_INT_MAX // 1000
"""The longest time a gRPC option takes, in whole seconds (2,147,483 s, about 24.8 days)."""


UINT32_MAX = 2**32 - 1
"""The largest count a ``uint32`` field of the wire carries (``ServerLimits``' counts)."""
UINT64_MAX = 2**64 - 1
"""The largest number a ``uint64`` field of the wire carries (``ServerLimits.max_delay_us``)."""


def check_wire_int(name: str, value: int, top: int = UINT32_MAX) -> None:
    """Refuse a setting larger than its field on the wire carries: protobuf refused it only when
    the server built its ``Describe`` answer, with ``Value out of range: <value>``, naming nothing.

    Raises:
        ValueError: naming ``name``.
    """
    if value > top:
        raise ValueError(f"{name} must be at most {top}, got {value}")


def check_backoff(initial_s: float, max_s: float) -> None:
    """Refuse a reconnect backoff that does not grow from ``initial_s`` to ``max_s`` within what
    gRPC takes (:data:`GRPC_MAX_S`).

    Raises:
        ValueError: naming ``backoff_initial_s`` and ``backoff_max_s``.
    """
    if not 0 < initial_s <= max_s <= GRPC_MAX_S:
        raise ValueError(f"need 0 < backoff_initial_s <= backoff_max_s <= {GRPC_MAX_S}")


def check_message_bytes(value: int) -> None:
    """Refuse a ``max_message_bytes`` below 1 KiB or above what gRPC takes (a C int).

    Raises:
        ValueError: naming ``max_message_bytes``.
    """
    if not 1024 <= value <= GRPC_INT_MAX:
        raise ValueError(f"max_message_bytes must be in [1024, {GRPC_INT_MAX}], got {value}")


def check_finite(config: Any) -> None:
    """Refuse a NaN or an infinity in any float field of the dataclass ``config``, or in a tuple
    of floats, naming the field.

    Range checks alone let NaN through (``nan <= 0`` is False), and a NaN setting then does
    what no number would: a NaN learning rate makes NaN weights, an ``asyncio.timeout`` of NaN
    seconds expires at once. Infinity is refused as well: a time that means never or off is 0
    where a setting has one, and gRPC takes its times as C ints of milliseconds.

    Raises:
        ValueError: ``<field> must be a finite number, got <value>``.
    """
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ValueError(f"{f.name} must be a finite number, got {value}")


UNIX_PATH_MAX = 107
"""The longest path of a Unix socket on Linux (bytes: ``sun_path`` holds 108 with the final NUL)."""


def socket_path_problem(path: str) -> str | None:
    """What is wrong with ``path`` as the path of a Unix socket, if anything: a path longer than
    the system takes, which a server cannot bind, and where a client would wait for good."""
    size = len(os.fsencode(path))
    if size <= UNIX_PATH_MAX:
        return None
    return (
        f"{path} is {size} bytes long, and the path of a Unix socket takes at most {UNIX_PATH_MAX} "
        "(choose a shorter one, in /tmp say)"
    )


def check_socket_path(name: str, path: str) -> None:
    """Refuse a Unix socket path that :func:`socket_path_problem` finds wrong.

    Raises:
        ValueError: naming the setting ``name``.
    """
    problem = socket_path_problem(path)
    if problem:
        raise ValueError(f"{name}: {problem}")
