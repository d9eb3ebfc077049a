"""The C++ client (robot_client/cpp) built with CMake against the system gRPC, run against real servers."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from edgerl.edge_server.transitions import TransitionConfig
from edgerl.launch.certs import DevPki, make_dev_pki
from edgerl.proto import tensors
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.trainer.segments import EpisodeTracker, assemble
from tests.helpers import EchoPolicy, Link, ServerThread, hellos_checked, request_numbers_taken

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


@dataclass
class Resumed:
    """What a run of the client through a :class:`Link` left: its stdout and stderr, what the
    server counted lost and holds for a trainer, each stream's hello (``mid_episode``,
    ``resumes``) and the numbers of the requests the server took in (``obs_index``), in order."""

    returncode: int
    out: str
    err: str
    dropped: int
    segments: list[pb.Segment]
    hellos: list[tuple[bool, bool]]
    numbers: list[int]

    def reconnects(self) -> list[str]:
        return [line for line in self.out.splitlines() if line.startswith("reconnect ")]

    def assert_every_step_kept(self, steps: int, *, joined: bool = False) -> None:
        """Every step answered once and in order; the server lost none, and each row carries
        its own action's reward (step k's action earns k + 1) and observation. ``joined``: the
        server (restarted) joined the episode midway, at the step its first row shows."""
        lines = self.out.splitlines()
        assert self.returncode == 0 and lines[-1] == f"OK steps={steps} version=0", self.out + self.err
        assert [int(m.group(1)) for m in map(STEP.match, lines) if m] == list(range(steps))
        assert self.dropped == 0 and self.segments
        episode = self.segments[0].episode
        rewards: list[float] = []
        obs: list[np.ndarray] = []
        for seg in self.segments:
            assert seg.env_id == 0 and (seg.episode, seg.t) == (episode, len(rewards)), seg
            assert seg.joined_mid_episode == joined, seg
            rewards += seg.rewards
            obs.append(tensors.decode(seg.obs))
        first = int(rewards[0]) - 1  # the step of the first row
        assert (first > 0) == joined and len(rewards) >= 0.75 * (steps - first)
        assert rewards == list(range(first + 1, first + 1 + len(rewards)))
        k = np.arange(first, first + len(rewards))[:, None]
        np.testing.assert_allclose(np.concatenate(obs), np.sin(0.1 * k + np.arange(3)), atol=1e-5)
        tracker = EpisodeTracker()
        assemble(self.segments, None, tracker)
        assert tracker.cut == 0
        # Every stream after the first resumed mid-episode; each request went numbered.
        hellos = self.hellos
        assert len(hellos) >= 2 and hellos[0] == (False, True) and set(hellos[1:]) == {(True, True)}, hellos
        assert self.numbers and self.numbers[0] == 0, self.numbers
        assert {b - a for a, b in itertools.pairwise(self.numbers)} <= {0, 1}, self.numbers


def _through_link(
    client: Path,
    monkeypatch: pytest.MonkeyPatch,
    disturb: Callable[[ServerThread, Link], None],
    *args: str,
    delay_s: float = 0.0,
    direct: bool = False,
) -> Resumed:
    """Run the client (``args`` added) through a link to a server that keeps transitions (or
    to the server itself, ``direct``), ``disturb`` them meanwhile, and take what the run left
    (the server's counts: the last server's, where ``disturb`` restarted it)."""
    hellos = hellos_checked(monkeypatch)
    numbers = request_numbers_taken(monkeypatch)
    policy = EchoPolicy(3, 2, delay_s=delay_s)
    with ServerThread(policy, learner=TransitionConfig(segment_steps=8)) as srv, srv.link() as link:
        address = srv.address if direct else f"127.0.0.1:{link.port}"
        cmd = [str(client), "--server", address, *args]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
            disturb(srv, link)
            out, err = proc.communicate(timeout=60)
        dropped, segments = srv.lost_and_segments()
    said = [(h.mid_episode, h.resumes) for h in hellos]
    return Resumed(proc.returncode, out, err, dropped, segments, said, numbers.get(0, []))


def test_a_broken_stream_resumes_and_loses_no_step(client: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's connection is reset four times on the way (a relay). Before, the client
    stopped at the first break with ``ERROR 14``. It now opens a new stream that resumes the
    session: every step is answered once and in order, the server loses none of the episode's
    steps, and each row carries its own action's reward, with the request whose answer was
    lost sent again under its number."""

    def cut_four_times(srv: ServerThread, link: Link) -> None:
        for _ in range(4):
            time.sleep(0.3)
            srv.in_loop(link.cut)

    # Inference takes most of each 10 ms tick, so most cuts find a request at the server and
    # lose its answer: that request goes again.
    run = _through_link(client, monkeypatch, cut_four_times, "--steps", "200", "--hz", "100", delay_s=0.009)
    run.assert_every_step_kept(200)
    reconnects = run.reconnects()
    assert len(reconnects) >= 4 and all(" after 14 " in line for line in reconnects), reconnects
    assert len(run.hellos) >= 5
    assert 0 in {b - a for a, b in itertools.pairwise(run.numbers)}, run.numbers  # one sent again


@pytest.mark.parametrize("route_down_s", [0.0, 1.2], ids=["new-route", "route-down"])
def test_an_overdue_answer_ends_the_stream_and_a_new_connection_resumes(
    client: Path, monkeypatch: pytest.MonkeyPatch, route_down_s: float
) -> None:
    """The client's connection goes silent (a link that died without closing it). Before, the
    client waited for the answer until the stream's hour-long deadline. Now the answer is
    overdue after ``--answer-timeout-s``: the client cancels the stream, opens a new one on a
    new connection (the old one is dead, and a new channel would otherwise share it), and
    resumes without losing a step. Where the route stays down a while (new connections go
    silent too), opening a stream is bounded the same way, not by gRPC's 20 s connect timeout."""

    def go_silent(srv: ServerThread, link: Link) -> None:
        time.sleep(0.3)
        link.mute_new = route_down_s > 0
        srv.in_loop(link.go_silent)
        time.sleep(route_down_s)
        link.mute_new = False

    args = ("--steps", "100", "--hz", "100", "--answer-timeout-s", "0.5")
    t0 = time.monotonic()
    run = _through_link(client, monkeypatch, go_silent, *args)
    took_s = time.monotonic() - t0
    run.assert_every_step_kept(100)
    reconnects = run.reconnects()
    if not route_down_s:
        assert reconnects == ["reconnect 1 after 4 no answer within 0.5 s"], run.out + run.err
    else:
        assert len(reconnects) >= 2 and all(" after 4 " in line for line in reconnects), reconnects
        assert took_s < 10, took_s  # 1 s of steps, 1.5-2.5 s of outage


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


@pytest.mark.parametrize(
    ("option", "value", "error"),
    [
        ("--answer-timeout-s", "0", "--answer-timeout-s must be > 0"),
        ("--reconnect-s", "-1", "--reconnect-s must be a number in [0, 1000000000], got -1"),
        # std::stod alone said "stod", took "5x" for 5, and let NaN, infinity and any rate through
        ("--hz", "abc", "--hz: expected a number, got 'abc'"),
        ("--steps", "5x", "--steps: expected a number, got '5x'"),
        ("--steps", "2.5", "--steps: expected a whole number, got 2.5"),
        ("--hz", "nan", "--hz must be a number in [0, 10000], got nan"),
        ("--hz", "-5", "--hz must be a number in [0, 10000], got -5"),
        ("--answer-timeout-s", "inf", "--answer-timeout-s must be a number in [0, 1000000000], got inf"),
    ],
)
def test_a_bad_number_is_refused_naming_its_option(client: Path, option: str, value: str, error: str) -> None:
    out = _run(client, "--server", "127.0.0.1:1", option, value)
    assert out.returncode == 2 and out.stderr == f"edgerl_cpp_client: {error}\n", out.stderr
    assert out.stdout == ""  # refused before any connection


def test_a_restarted_server_is_joined_mid_episode(client: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server stops for 0.7 s and comes back on its port (an upgrade): the client retries
    with backoff while nothing listens, then resumes, and the new server, which holds nothing of
    the session, marks the episode as joined midway and keeps every step from there."""

    def restart(srv: ServerThread, link: Link) -> None:
        time.sleep(0.3)
        srv.kill()
        time.sleep(0.7)
        srv.restart()

    run = _through_link(client, monkeypatch, restart, "--steps", "150", "--hz", "100", direct=True)
    run.assert_every_step_kept(150, joined=True)
    reconnects = run.reconnects()
    assert len(reconnects) >= 2 and all(" after 14 " in line for line in reconnects), reconnects
