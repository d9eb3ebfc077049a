"""The C++ client (robot_client/cpp) built with CMake against the system gRPC, run against real servers."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgerl.edge_server.transitions import StreamHandle, TransitionConfig, TransitionStore
from edgerl.edge_server.validation import StreamSpec, check_hello
from edgerl.launch.certs import DevPki, make_dev_pki
from edgerl.proto import tensors
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.trainer.segments import EpisodeTracker, assemble
from tests.helpers import EchoPolicy, ServerThread

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "cpp"
STEP = re.compile(r"^step (\d+) version (\d+) obs (.*) action (.*) queue_wait_us \d+$")


def _toolchain_missing() -> str:
    for tool in ("cmake", "g++", "protoc", "grpc_cpp_plugin"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    if not Path("/usr/include/grpcpp/grpcpp.h").exists() and not Path("/usr/local/include/grpcpp").exists():
        return "gRPC C++ headers not found"
    return ""


@pytest.fixture(scope="module")
def client() -> Path:
    missing = _toolchain_missing()
    if missing:
        if os.environ.get("EDGERL_REQUIRE_CPP"):
            pytest.fail(f"C++ client toolchain: {missing} (make cpp-deps installs it)")
        pytest.skip(f"C++ client toolchain: {missing} (make cpp-deps installs it)")
    subprocess.run(
        ["cmake", "-S", str(ROOT / "robot_client" / "cpp"), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release"],
        check=True,
        capture_output=True,
    )
    subprocess.run(["cmake", "--build", str(BUILD), "-j2"], check=True, capture_output=True)
    exe = BUILD / "edgerl_cpp_client"
    assert exe.exists()
    return exe


def _run(exe: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(exe), *args], check=False, capture_output=True, text=True, timeout=60)


def test_round_trip_echo(client: Path) -> None:
    with ServerThread(EchoPolicy(3, 2)) as srv:
        out = _run(client, "--server", srv.address, "--steps", "20", "--hz", "100")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("server ") and "obs_dim 3 act_dim 2" in lines[0]
    steps = [STEP.match(line) for line in lines[1:-1]]
    assert len(steps) == 20 and all(steps)
    for i, m in enumerate(steps):
        assert m is not None and int(m.group(1)) == i
        obs = np.array(m.group(3).split(), float)
        action = np.array(m.group(4).split(), float)
        np.testing.assert_allclose(obs, np.sin(0.1 * i + np.arange(3)), atol=1e-5)
        np.testing.assert_allclose(action, obs[:2], atol=1e-5)  # the echo policy's answer
    assert lines[-1] == "OK steps=20 version=0"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return make_dev_pki(tmp_path_factory.mktemp("pki"))


def test_token_and_mutual_tls(client: Path, pki: DevPki) -> None:
    cfg = {
        "tls_cert": str(pki.server_cert),
        "tls_key": str(pki.server_key),
        "tls_client_ca": str(pki.ca),
        "tokens": str(pki.tokens),
    }
    tls = ["--ca", str(pki.ca), "--cert", str(pki.client_cert), "--key", str(pki.client_key)]
    with ServerThread(EchoPolicy(3, 2), **cfg) as srv:
        ok = _run(client, "--server", srv.address, "--steps", "3", "--token", pki.robot_token, *tls)
        no_token = _run(client, "--server", srv.address, "--steps", "3", *tls)
        plaintext = _run(client, "--server", srv.address, "--steps", "3", "--token", pki.robot_token)
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1] == "OK steps=3 version=0", ok.stdout
    assert no_token.returncode == 1 and no_token.stdout.startswith("ERROR 16 ")  # UNAUTHENTICATED
    assert plaintext.returncode == 1 and plaintext.stdout.startswith("ERROR 14 ")  # UNAVAILABLE


def test_bad_option_is_named(client: Path) -> None:
    out = _run(client, "--frobnicate")
    assert out.returncode == 2 and "unknown option --frobnicate" in out.stderr


def test_a_broken_stream_resumes_and_loses_no_step(client: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's connection is reset four times on the way (a relay). Before, the client
    stopped at the first break with ``ERROR 14``. It now opens a new stream that resumes the
    session: every step is answered once and in order, the server loses none of the episode's
    steps, and each row carries its own action's reward (step k's action earns k + 1), with
    the request whose answer was lost sent again under its number."""
    hellos: list[tuple[bool, bool]] = []
    numbers: list[int] = []
    observe = TransitionStore.observe

    def hello_spy(hello: pb.StreamHello, *args: Any) -> StreamSpec:
        hellos.append((hello.mid_episode, hello.resumes))
        return check_hello(hello, *args)

    def observe_spy(
        self: TransitionStore, handle: StreamHandle, env_ids: np.ndarray, *args: Any, **kw: Any
    ) -> None:
        index = kw["obs_index"]
        numbers.extend([] if index is None else index.tolist())
        observe(self, handle, env_ids, *args, **kw)

    monkeypatch.setattr("edgerl.edge_server.service.check_hello", hello_spy)
    monkeypatch.setattr(TransitionStore, "observe", observe_spy)
    # Inference takes most of each 10 ms tick, so most cuts find a request at the server and
    # lose its answer: that request goes again.
    policy = EchoPolicy(3, 2, delay_s=0.009)
    with ServerThread(policy, learner=TransitionConfig(segment_steps=8)) as srv, srv.link() as link:
        cmd = [str(client), "--server", f"127.0.0.1:{link.port}", "--steps", "200", "--hz", "100"]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
            for _ in range(4):
                time.sleep(0.3)
                srv.in_loop(link.cut)
            out, err = proc.communicate(timeout=60)

        dropped, segments = srv.lost_and_segments()
    assert proc.returncode == 0, out + err
    lines = out.splitlines()
    assert lines[-1] == "OK steps=200 version=0", out
    steps = [int(m.group(1)) for m in map(STEP.match, lines) if m]
    assert steps == list(range(200))  # each answered once, in order
    reconnects = [line for line in lines if line.startswith("reconnect ")]
    assert len(reconnects) >= 4 and all(" after 14 " in line for line in reconnects), reconnects
    assert dropped == 0
    rewards: list[float] = []
    obs: list[np.ndarray] = []
    for seg in segments:
        assert seg.env_id == 0 and (seg.episode, seg.t) == (0, len(rewards)), seg
        rewards += seg.rewards
        obs.append(tensors.decode(seg.obs))
    assert len(rewards) >= 150 and rewards == list(range(1, len(rewards) + 1))
    k = np.arange(len(rewards))[:, None]
    np.testing.assert_allclose(np.concatenate(obs), np.sin(0.1 * k + np.arange(3)), atol=1e-5)
    tracker = EpisodeTracker()
    assemble(segments, None, tracker)
    assert tracker.cut == 0
    # Every stream after the first resumed mid-episode; each request went numbered.
    assert len(hellos) >= 5 and hellos[0] == (False, True) and set(hellos[1:]) == {(True, True)}, hellos
    diffs = [b - a for a, b in itertools.pairwise(numbers)]
    assert numbers and numbers[0] == 0 and set(diffs) == {0, 1}, numbers  # a request sent again: 0


def test_without_reconnects_a_broken_stream_ends_the_run(client: Path) -> None:
    """``--reconnect-s 0``: the first break ends the run with the stream's status."""
    with ServerThread(EchoPolicy(3, 2)) as srv, srv.link() as link:
        cmd = [str(client), "--server", f"127.0.0.1:{link.port}", "--steps", "200", "--hz", "100",
               "--reconnect-s", "0"]  # fmt: skip
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
            time.sleep(0.3)
            srv.in_loop(link.cut)
            out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, out + err
    assert out.splitlines()[-1].startswith("ERROR 14 ") and "reconnect " not in out, out
