"""gRPC keepalive options, set the same way by the server and the clients."""

from __future__ import annotations

from edgerl.proto.settings import GRPC_MAX_S

MAX_KEEPALIVE_S = GRPC_MAX_S
"""The longest keepalive time or timeout (seconds, about 24.8 days): gRPC takes its options as C
ints of milliseconds."""


def check_keepalive(every_s: float, timeout_s: float, *, off: bool) -> None:
    """Refuse keepalive settings outside what gRPC accepts; ``off``: an ``every_s`` of 0 turns
    the pings off.

    Raises:
        ValueError: naming ``keepalive_s`` and ``keepalive_timeout_s``, also for NaN.
    """
    every_ok = (every_s >= 0 if off else every_s > 0) and every_s <= MAX_KEEPALIVE_S
    if not (every_ok and 0 < timeout_s <= MAX_KEEPALIVE_S):
        every = f"[0, {MAX_KEEPALIVE_S}] (0: off)" if off else f"(0, {MAX_KEEPALIVE_S}]"
        raise ValueError(
            f"keepalive_s must be in {every} and keepalive_timeout_s in (0, {MAX_KEEPALIVE_S}], "
            f"got {every_s} and {timeout_s}"
        )


def keepalive_options(every_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """Options that ping the peer after ``every_s`` seconds without a ping or data, and close the
    connection when a ping goes unanswered for ``timeout_s`` seconds."""
    timeout_ms = round(timeout_s * 1000)
    return [
        ("grpc.keepalive_time_ms", round(every_s * 1000)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # what gRPC 1.85 times an unanswered ping by (its default, 60 s, wins otherwise)
        ("grpc.http2.ping_timeout_ms", timeout_ms),
    ]
