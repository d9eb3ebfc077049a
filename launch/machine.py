"""What a benchmark ran on, and how fast the CPU was while it ran.

The machines edgerl is measured on are shared, and their speed is not fixed: one day the
same 32-row product with a 1040 x 1040 layer (the hidden layer of the ``mlp-large``
preset) took 0.55 ms, another day 0.8-1.2 ms. The figures of two runs on such days do not
compare. So every bench's JSON carries, under ``machine``, the time of that product before
and after its runs (``gemm_32x1040_ms``): a reader can tell which runs came from the same
kind of day, and whether the speed changed during one.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GEMM_ROWS = 32
GEMM_WIDTH = 1040
GEMM_REPEATS = 400


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (``/proc/cpuinfo``), else the platform's
    word for the processor, else ``"unknown"``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or "unknown"


def gemm_ms(repeats: int = GEMM_REPEATS) -> float:
    """The median time, in milliseconds, of one ``[32, 1040] x [1040, 1040]`` product with a
    bias (``torch.addmm``) on one thread: the ``mlp-large`` preset's hidden layer on the rows
    of one sim worker's env group. Takes about ``repeats`` of them (0.2-0.5 s at 400); torch's
    thread count is put back afterwards.

    Raises:
        ValueError: ``repeats`` is under 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(GEMM_ROWS, GEMM_WIDTH, generator=gen)
        w = torch.randn(GEMM_WIDTH, GEMM_WIDTH, generator=gen)
        b = torch.randn(GEMM_WIDTH, generator=gen)
        out = torch.empty(GEMM_ROWS, GEMM_WIDTH)
        for _ in range(min(repeats, 20)):  # warm: the weights into the cache, MKL's buffers made
            torch.addmm(b, x, w, out=out)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            torch.addmm(b, x, w, out=out)
            times.append(time.perf_counter_ns() - t0)
        return round(statistics.median(times) / 1e6, 4)
    finally:
        torch.set_num_threads(threads)


def machine_info(before: float, after: float) -> dict[str, Any]:
    """The ``machine`` block of a bench's JSON: CPUs, their model, platform, Python, and the
    :func:`gemm_ms` timings ``before`` and ``after`` the bench's runs."""
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "gemm_32x1040_ms": {"before": before, "after": after},
    }


@dataclass(frozen=True)
class SpeedProbe:
    """The machine's speed around a bench: :meth:`start` times the product before its runs,
    :meth:`machine` again after them, and gives the JSON's ``machine`` block."""

    before_ms: float

    @classmethod
    def start(cls, progress: Callable[[str], None]) -> SpeedProbe:
        """Time the product now, and say so through ``progress``."""
        ms = gemm_ms()
        what = f"a {GEMM_ROWS}-row product with a {GEMM_WIDTH}-wide layer"
        progress(f"machine: {what} in {ms:.3f} ms (one thread)")
        return cls(ms)

    def machine(self) -> dict[str, Any]:
        """:func:`machine_info` with the time taken at :meth:`start` and one taken now."""
        return machine_info(before=self.before_ms, after=gemm_ms())


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` past the command (which may hold spaces): the state
    first, then the parent's id; None where it cannot be read (the process is gone, say)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """Process ``pid``'s start time (clock ticks after boot) and the CPU seconds it has used, from
    ``/proc/PID/stat``; None where that cannot be read."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pids: list[int]) -> list[int]:
    """The processes started by those of ``pids``, and by those in turn, from ``/proc`` (empty
    where it cannot be read)."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for entry in entries:
        fields = _stat_fields(entry)
        if fields is None or len(fields) < 2:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out: list[int] = []
    todo = list(pids)
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return sorted(out)


BUSY_CORES = 0.9
"""A robot process that uses this much of a core is near its limit: on the reference machine one
of 100 HalfCheetah robots at 50 Hz used 0.73-0.75 of a core in a quiet spell and 0.84-0.93 in a
noisy one; at 1.0 (the machine 2-3x slower) 22-45 % of its ticks fell back, the server idle
three quarters of the time."""


def busy_text(who: str, cpu: float, robots: int, hz: float, advice: str) -> str:
    """What to tell the operator of ``who``, a robot process that used ``cpu`` of a core (at least
    :data:`BUSY_CORES`) for ``robots`` robots at ``hz``, with ``advice`` on what to change."""
    return (
        f"{who} used {cpu:.2f} of a core: {robots} robot(s) at {hz:g} Hz are near its limit on this "
        f"machine, so its ticks run late and its robots fall back whatever the server does ({advice})"
    )


class CpuMeter:
    """How busy some processes were from its start to :meth:`cores`: each one's CPU seconds per
    second of wall time, where 1.0 is one whole core (a process of several busy threads can use
    more). A process is measured only where it is the same at both ends: not one that ended, nor
    another that took its id meanwhile."""

    def __init__(self, pids: list[int]) -> None:
        self._t0 = time.monotonic()
        self._start = [(pid, _proc_stat(pid)) for pid in pids]

    def cores(self) -> list[float | None]:
        """Each process's cores used since the start, rounded to 0.001; None for one that could
        not be read at either end."""
        seconds = max(time.monotonic() - self._t0, 1e-9)
        out: list[float | None] = []
        for pid, start in self._start:
            now = _proc_stat(pid)
            if start is None or now is None or now[0] != start[0]:
                out.append(None)
            else:
                out.append(round((now[1] - start[1]) / seconds, 3))
        return out
