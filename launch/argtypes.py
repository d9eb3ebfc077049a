"""Option types for the command line: a number out of range, or a file that could not be written
at the end, is refused as argparse refuses a malformed value, naming the option (``argument
--envs: must be >= 1, got 0``) with exit status 2, before the command starts anything.

The configs behind the options check their fields as well, for callers of the Python API; these
types only make the command line's errors name the option and come before any process starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

from edgerl.proto.settings import UINT32_MAX, UINT64_MAX, socket_path_problem

_N = TypeVar("_N", int, float)
_C = TypeVar("_C")


def config_from_args(cls: type[_C], a: argparse.Namespace, **overrides: Any) -> _C:
    """A config dataclass from the parsed options named like its fields, then ``overrides``.

    Fields with no option keep their defaults; an option under another name, or one
    that needs converting, goes in ``overrides``.
    """
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{**{k: v for k, v in vars(a).items() if k in names}, **overrides})


def bounded(
    kind: Callable[[str], _N], low: _N, high: _N | None = None, *, above: bool = False
) -> Callable[[str], _N]:
    """An argparse ``type``: a number of ``kind`` at least ``low`` (above it with ``above``) and at
    most ``high``; NaN and infinity are refused."""
    name = getattr(kind, "__name__", "number")
    lo = _shown(low)
    bound = f"> {lo}" if above else f">= {lo}" if high is None else f"in [{lo}, {_shown(high)}]"

    def parse(text: str) -> _N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {name} value: {text!r}") from None
        low_ok = value > low if above else value >= low
        if not low_ok or (high is not None and not value <= high):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        if not math.isfinite(value):  # an option that means never or off takes 0
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        return value

    return parse


def _shown(bound: float) -> str:
    """A bound as a message gives it: an int whole (2**64 - 1 is 18446744073709551615), a float
    to 15 significant digits."""
    return str(bound) if isinstance(bound, int) else f"{bound:.15g}"


COUNT = bounded(int, 1)
"""An int >= 1: envs, workers, robots, repeats."""
NON_NEGATIVE_INT = bounded(int, 0)
"""An int >= 0: steps where 0 means no limit, counts where 0 means off."""
POSITIVE = bounded(float, 0.0, above=True)
"""A float > 0: a rate, a deadline, a measured time."""
NON_NEGATIVE = bounded(float, 0.0)
"""A float >= 0: a time where 0 means never or skip, an injected delay."""
PROBABILITY = bounded(float, 0.0, 1.0)
"""A float in [0, 1]."""
PORT = bounded(int, 0, 65535)
"""A TCP port; 0 picks a free one."""
WIRE_COUNT = bounded(int, 1, UINT32_MAX)
"""An int >= 1 that the wire carries as a ``uint32``: a server limit that ``Describe`` reports."""
WIRE_MICROSECONDS = bounded(int, 0, UINT64_MAX)
"""An int >= 0 that the wire carries as a ``uint64``: ``--max-delay-us``."""


def socket_path(text: str) -> str:
    """An argparse ``type``: the path of a Unix socket, refused where it is longer than the
    system takes (see :func:`~edgerl.proto.settings.socket_path_problem`)."""
    problem = socket_path_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def output_file(text: str) -> str:
    """An argparse ``type``: the path of a file the command writes when it ends (``--json``,
    ``--out``), in a folder that exists and that this user may write in, and not a folder itself:
    refused at once, not after a run of minutes or hours."""
    folder = os.path.dirname(text) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"no folder {folder} to write {os.path.basename(text)} in")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {folder} (permission denied)")
    return text


def add_json_option(parser: argparse.ArgumentParser, help: str) -> None:
    """``--json PATH``, the file a command writes its result to, checked by :func:`output_file`
    when the command line is read."""
    parser.add_argument("--json", metavar="PATH", type=output_file, help=help)


def add_metrics_options(parser: argparse.ArgumentParser, counters: str, *, host: str) -> None:
    """``--metrics-port PORT`` and ``--metrics-host HOST``: a ``GET /metrics`` endpoint of
    ``counters`` (what they are, in words). ``--metrics-host`` defaults to empty, which binds
    ``host`` (in words: ``127.0.0.1``, ``--host's``); :func:`check_metrics_options` refuses it
    without ``--metrics-port``."""
    parser.add_argument(
        "--metrics-port",
        type=PORT,
        default=None,
        metavar="PORT",
        help=f"also answer GET /metrics on this port of --metrics-host: {counters}, in Prometheus's "
        "text format, plain HTTP; 0: a free one (default: off)",
    )
    parser.add_argument(
        "--metrics-host",
        default="",
        metavar="HOST",
        help=f"address the metrics port binds (0.0.0.0: every interface) (default: {host})",
    )


def check_metrics_options(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse ``--metrics-host`` without ``--metrics-port`` (exit status 2), where it would bind
    nothing."""
    if getattr(a, "metrics_host", "") and getattr(a, "metrics_port", None) is None:
        parser.error("argument --metrics-host: needs --metrics-port (the metrics are off without one)")
