"""gRPC keepalive options, set the same way by the server and the clients."""

from __future__ import annotations


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
