"""The ``machine`` block of the benches' JSON: what they ran on and how fast the CPU was."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import pytest
import torch

from edgerl.launch import machine


def test_gemm_ms_is_in_milliseconds_and_puts_torchs_thread_count_back() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ms = machine.gemm_ms(repeats=50)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    # 32 x 1040 x 1040 multiply-adds: 0.01 ms would be 7 TFLOP/s on one core, 100 ms a tenth
    # of a GFLOP/s. Outside, the figure is in the wrong unit.
    assert 0.01 < ms < 100.0
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        machine.gemm_ms(repeats=0)


def test_cpu_model_is_the_kernels_name_for_the_cpu() -> None:
    model = machine.cpu_model()
    if Path("/proc/cpuinfo").exists():
        names = {
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        }
        if names:
            assert model in names
            return
    assert model  # elsewhere: the platform's word, or "unknown"


def test_machine_info_holds_the_timings_given() -> None:
    info = machine.machine_info(before=0.5, after=0.75)
    assert info["gemm_32x1040_ms"] == {"before": 0.5, "after": 0.75}
    assert info["cpus"] == os.cpu_count()
    assert info["platform"] == platform.platform()
    assert info["python"] == sys.version.split()[0]
    assert info["cpu_model"] == machine.cpu_model()
    assert json.loads(json.dumps(info, allow_nan=False)) == info  # standard JSON as it stands


def test_cpu_meter_gives_each_process_its_share_of_a_core() -> None:
    """A process spinning on one thread used about one core, a sleeping one about none; one that
    ended meanwhile, or an id no process has, gives None rather than a number."""
    import subprocess
    import time

    spin = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for code in (spin, "import time; time.sleep(30)")]
    ends = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    try:
        time.sleep(0.3)  # past the interpreters' start
        gone = 2**22 + 1  # above Linux's largest process id: no process has it
        meter = machine.CpuMeter([p.pid for p in procs] + [ends.pid, gone])
        time.sleep(1.0)
        ends.wait(5.0)
        spinning, sleeping, ended, none = meter.cores()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert spinning is not None and sleeping is not None
    # the spinner had a core of its own for most of the second (2 CPUs, the test mostly asleep)
    assert 0.5 < spinning <= 1.1
    assert 0.0 <= sleeping < 0.05
    assert (ended, none) == (None, None)


def test_descendants_are_children_and_their_children() -> None:
    import subprocess
    import time

    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10.0
        while not (found := machine.descendants([child.pid])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(found) == 1  # the grandchild
        grandchild = found[0]
        parent = int(Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert parent == child.pid
        assert {child.pid, grandchild} <= set(machine.descendants([os.getpid()]))
        assert machine.descendants([grandchild]) == []
    finally:
        for pid in machine.descendants([child.pid]):
            os.kill(pid, 9)
        child.kill()
        child.wait()
