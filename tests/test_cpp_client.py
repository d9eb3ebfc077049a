"""The C++ client (robot_client/cpp) built with CMake against the system gRPC, run against real servers."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from edgerl.edge_server.backend import PolicyResult
from edgerl.edge_server.service import EdgePolicyServicer
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


@pytest.mark.parametrize("watchdog", [False, True], ids=["plain", "watchdog"])
def test_a_hello_the_server_did_not_get_in_time_is_a_broken_stream(
    client: Path, monkeypatch: pytest.MonkeyPatch, watchdog: bool
) -> None:
    """The server refuses a stream whose hello it did not get within its ``hello_timeout_s``
    with DEADLINE_EXCEEDED (a link that went silent as the stream opened). Python's clients take
    that for a broken stream, as the watchdog's stream did; the plain loop took it for the
    server's last word and ended with ``ERROR 4``. Both now open a new stream, and the run goes
    on to its end."""
    refusals: list[str] = []
    overdue = EdgePolicyServicer.hello_overdue

    def first_only(self: EdgePolicyServicer, missing: str = "hello: no StreamHello") -> str:
        refusals.append(message := overdue(self, missing))
        self.hello_timeout_s = 10.0  # the next streams' hellos come in time
        return message

    monkeypatch.setattr(EdgePolicyServicer, "hello_overdue", first_only)
    mode = ("--watchdog", "--hz", "50") if watchdog else ("--hz", "100")
    # A limit of 1 us: the first stream is refused before its hello is read.
    with ServerThread(EchoPolicy(3, 2), hello_timeout_s=1e-6) as srv:
        out = _run(client, "--server", srv.address, "--steps", "50", *mode)
    lines = out.stdout.splitlines()
    assert refusals == ["hello: no StreamHello within 1e-06 s of the stream's start"]
    assert out.returncode == 0, out.stdout + out.stderr
    assert [line for line in lines if line.startswith("reconnect ")] == [f"reconnect 1 after 4 {refusals[0]}"]
    if watchdog:
        summary = _summary(out.stdout)
        assert summary["ticks"] == 50 - summary["loop_deadline_misses"] and summary["estops"] == 0, summary
        assert summary["policy_ticks"] >= 25, summary  # answers came on the second stream
    else:
        assert lines[-1] == "OK steps=50 version=0"
        assert [int(m.group(1)) for m in map(STEP.match, lines) if m] == list(range(50))


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


# -- the watchdog mode (--watchdog) ---------------------------------------------------------

TICK = re.compile(r"^tick (\d+) (policy|fallback|estop) version (\S+) age_ms (\S+) at_ms (\S+) action (.*)$")
SUMMARY = re.compile(
    r"^OK ticks=(\d+) policy_ticks=(\d+) fallbacks=(\d+) late_actions=(\d+) "
    r"loop_deadline_misses=(\d+) estops=(\d+) version=(\d+)$"
)


@dataclass
class Ticks:
    """The ticks a run of the watchdog mode printed, in order."""

    index: list[int]
    kind: list[str]
    at_ms: np.ndarray
    action: np.ndarray  # [ticks, act_dim]
    version: list[str]

    def runs_of(self, kind: str) -> list[tuple[int, int]]:
        """(first position, length) of each run of consecutive ticks of ``kind``."""
        runs: list[tuple[int, int]] = []
        for pos, k in enumerate(self.kind):
            if k != kind:
                continue
            if runs and runs[-1][0] + runs[-1][1] == pos:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((pos, 1))
        return runs


def _ticks(out: str) -> Ticks:
    matches = [m for m in map(TICK.match, out.splitlines()) if m]
    assert matches, out
    return Ticks(
        [int(m.group(1)) for m in matches],
        [m.group(2) for m in matches],
        np.array([float(m.group(5)) for m in matches]),
        np.array([m.group(6).split() for m in matches], float),
        [m.group(3) for m in matches],
    )


def _summary(out: str) -> dict[str, int]:
    m = SUMMARY.match(out.splitlines()[-1])
    assert m, out[-2000:]
    keys = ("ticks", "policy_ticks", "fallbacks", "late_actions", "loop_deadline_misses", "estops", "version")
    return dict(zip(keys, map(int, m.groups()), strict=True))


def _check_rate_limited(ticks: Ticks, max_delta: float) -> None:
    """Each tick's action under the echo policy: its target clamped to [-1, 1] and to within
    ``max_delta`` of the action before (zero before the first). A policy tick's target is the
    answer to the observation of the tick before (action k = obs k = sin(0.1 * tick + k)), a
    fallback's the action before (hold), an e-stop's the stop action (zero)."""
    prev = np.zeros(ticks.action.shape[1])
    for i, kind, action in zip(ticks.index, ticks.kind, ticks.action, strict=True):
        if kind == "policy":
            target = np.sin(0.1 * (i - 1) + np.arange(2))
        else:
            target = prev if kind == "fallback" else np.zeros(2)
        want = np.clip(target, np.maximum(prev - max_delta, -1), np.minimum(prev + max_delta, 1))
        np.testing.assert_allclose(action, want, atol=2e-5, err_msg=f"tick {i}")
        prev = action


def _check_rows(segments: list[pb.Segment], ticks: Ticks, breaks: int = 0) -> int:
    """The rows the server keeps are the observations of some of the ticks, in order, each with
    what the robot earned until the next row's tick: the rewards of the ticks that ran between
    (tick i's action earns i + 1), flagged fallback where one of them fell back. Returns how
    many rows there were.

    Across a break of the stream (at most ``breaks`` of them), a row may end sooner: where the
    request lost with the stream had reached the server (its answer was lost), it completed the
    row before, and the request sent again in its place, observed anew, was answered anew. The
    ticks between, on fallbacks, belong to no row."""
    assert segments
    obs = np.concatenate([tensors.decode(seg.obs) for seg in segments])
    rewards = [r for seg in segments for r in seg.rewards]
    fallback = [f for seg in segments for f in seg.fallback]
    episode = segments[0].episode
    assert all(seg.env_id == 0 and seg.episode == episode for seg in segments)
    ran = dict(zip(ticks.index, ticks.kind, strict=True))
    signals = np.sin(0.1 * np.arange(max(ran) + 1)[:, None] + np.arange(3))
    read_at = [int(np.argmin(np.abs(signals - row).max(1))) for row in obs]
    np.testing.assert_allclose(obs, signals[read_at], atol=1e-5)
    assert all(a < b for a, b in itertools.pairwise(read_at)), read_at
    cut_short = 0
    for j, (n, after) in enumerate(itertools.pairwise(read_at)):
        between = [i for i in range(n + 1, after + 1) if i in ran]
        ends = [k for k in range(1, len(between) + 1) if rewards[j] == sum(i + 1 for i in between[:k])]
        assert ends, (j, n, after, rewards[j])
        if ends[-1] < len(between):  # (the sums grow: at most one prefix matches)
            cut_short += 1
        assert fallback[j] == any(ran[i] != "policy" for i in between[: ends[-1]]), (j, n, after)
    assert cut_short <= breaks, cut_short
    return len(read_at)


def test_the_watchdog_checks_pass(client: Path) -> None:
    """watchdog.h's own checks (robot_client/cpp/watchdog_test.cc) on a clock they set."""
    out = subprocess.run([str(BUILD / "edgerl_watchdog_test")], check=False, capture_output=True, text=True)
    assert out.returncode == 0 and re.fullmatch(r"OK \d+ checks\n", out.stdout), out.stdout + out.stderr


def test_the_watchdog_loop_applies_each_answer_at_the_tick_after_its_observation(client: Path) -> None:
    """``--watchdog``: the loop ticks at 50 Hz and applies, at each tick, the answer to the
    observation of the tick before, clamped and rate-limited, or holds the action before where
    none came in time. The server keeps a row per request, each with the rewards of the ticks
    until the next one."""
    with ServerThread(EchoPolicy(3, 2), learner=TransitionConfig(segment_steps=8)) as srv:
        out = _run(client, "--server", srv.address, "--steps", "100", "--hz", "50", "--watchdog")
        dropped, segments = srv.lost_and_segments()
    assert out.returncode == 0, out.stdout + out.stderr
    ticks, summary = _ticks(out.stdout), _summary(out.stdout)
    assert len(ticks.index) == summary["ticks"] == 100 - summary["loop_deadline_misses"]
    assert all(a < b for a, b in itertools.pairwise(ticks.index))  # a tick skipped is one missed
    policy = ticks.kind.count("policy")
    assert (summary["policy_ticks"], summary["fallbacks"]) == (policy, len(ticks.kind) - policy)
    assert policy >= 80, out.stdout  # an echo on loopback answers in about a millisecond
    assert {v for v, k in zip(ticks.version, ticks.kind, strict=True) if k == "policy"} == {"0"}
    # The echo's action on [-1, 1]: rate-limited to 25 % of the range (0.5) per tick.
    _check_rate_limited(ticks, 0.5)
    assert dropped == 0
    assert _check_rows(segments, ticks) >= 75


class ChunkEcho(EchoPolicy):
    """Chunks of 4: action k of the answer to observation o is ``0.5 * o[:2] + 0.1 * k``."""

    chunk = 4

    def infer(self, obs: np.ndarray) -> PolicyResult:
        res = super().infer(obs)
        k = np.arange(self.chunk, dtype=np.float32)[None, :, None]
        return PolicyResult(actions=0.5 * res.actions[:, None, :] + 0.1 * k, log_probs=res.log_probs)


def _chunk_actions_used(ticks: Ticks) -> list[int]:
    """Which action of its chunk each policy tick applied, under :class:`ChunkEcho`: action k
    of the answer to the observation of tick i - 1 - k (exactly one k fits)."""
    used = []
    for i, kind, action in zip(ticks.index, ticks.kind, ticks.action, strict=True):
        if kind != "policy":
            continue
        chunks = [0.5 * np.sin(0.1 * (i - 1 - k) + np.arange(2)) + 0.1 * k for k in range(4)]
        ks = [k for k, want in enumerate(chunks) if np.allclose(action, want, atol=2e-5)]
        assert len(ks) == 1, (i, action)
        used.append(ks[0])
    return used


def test_the_watchdog_applies_an_answers_chunk_over_the_ticks_after_it(client: Path) -> None:
    """A server that answers in 30 ms with chunks of 4 actions, at 50 Hz: each answer comes
    after the tick its first action was meant for, and the ticks after it take the chunk's
    next actions (action k at the (k+1)-th tick after the observation), so that the loop
    stays on policy actions, where answers of one action would all be stale."""
    with ServerThread(ChunkEcho(3, 2, delay_s=0.03)) as srv:
        args = ("--steps", "100", "--hz", "50", "--watchdog", "--deadline-ms", "100", "--max-delta", "2")
        out = _run(client, "--server", srv.address, *args)
    assert out.returncode == 0, out.stdout + out.stderr
    used = _chunk_actions_used(_ticks(out.stdout))
    assert len(used) >= 80, out.stdout
    assert set(used) <= {1, 2, 3}, used  # never action 0: 30 ms is past the next tick


def test_the_watchdog_asks_for_the_next_chunk_when_half_of_the_one_held_is_left(client: Path) -> None:
    """With chunks of 4 (``Describe``'s ``action_chunk``) the controller takes edgerl robot's
    defaults: a deadline of the chunk's span (80 ms at 50 Hz) and a refill level of half the
    chunk. It asked at every tick before; now once every two ticks, on policy actions all
    along."""
    with ServerThread(ChunkEcho(3, 2)) as srv:
        args = ("--steps", "100", "--hz", "50", "--watchdog", "--max-delta", "2")
        out = _run(client, "--server", srv.address, *args)
        requests = srv.in_loop(lambda: srv.server.batcher.stats.requests if srv.server else -1)
    assert out.returncode == 0, out.stdout + out.stderr
    banner = "watchdog hz 50 deadline_ms 80 refill_at 2 chunk 4 fallback hold estop_after 50"
    assert banner in out.stdout.splitlines(), out.stdout[:500]
    ticks = _ticks(out.stdout)
    used = _chunk_actions_used(ticks)
    assert len(used) >= 90 and used.count(0) >= 40 and used.count(1) >= 40, used
    assert isinstance(requests, int) and 45 <= requests <= 55, requests  # one every two ticks


def test_the_watchdog_holds_on_late_answers_and_latches_an_estop_until_reset(client: Path) -> None:
    """The server turns slower than the 20 ms deadline midway: its answers are dropped as late,
    the loop holds the last action, and after ``--estop-after`` fallbacks in a row it latches an
    e-stop, ramping to the stop action at ``--max-delta`` per tick. Once the server is fast
    again, the e-stop stays until the operator's reset (SIGUSR1); then policy actions apply
    again, ramping up from the stop action."""
    policy = EchoPolicy(3, 2)
    args = ("--steps", "200", "--hz", "50", "--watchdog", "--estop-after", "10", "--max-delta", "0.1")
    with ServerThread(policy, learner=TransitionConfig(segment_steps=8)) as srv:
        cmd = [str(client), "--server", srv.address, *args]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None
            lines = [_line_at_tick(proc.stdout, 40)]
            policy.delay_s = 0.04  # twice the deadline
            lines.append(_line_at_tick(proc.stdout, 80))
            policy.delay_s = 0.0
            lines.append(_line_at_tick(proc.stdout, 120))
            proc.send_signal(signal.SIGUSR1)
            out, err = _rest(proc)
        dropped, segments = srv.lost_and_segments()
    out = "".join(lines) + out
    assert proc.returncode == 0, out + err
    ticks, summary = _ticks(out), _summary(out)
    assert summary["estops"] == 1 and summary["late_actions"] >= 5, summary
    before, after = out.split("estop reset\n")  # one reset
    reset = len(_ticks(before).index)  # the position of the first tick after it
    first = ticks.kind.index("estop")
    assert ticks.index[first] >= 40 and set(ticks.kind[first:reset]) == {"estop"}  # latched until reset
    assert ticks.index[reset - 1] - 80 >= 35  # the server was fast again for 35 ticks and more
    assert ticks.kind[first - 9 : first] == ["fallback"] * 9 and ticks.kind[first - 10] == "policy"
    assert ticks.kind[:40].count("policy") >= 30, out
    assert "estop" not in ticks.kind[reset:] and ticks.kind[reset:].count("policy") >= 50, after
    _check_rate_limited(ticks, 0.1)  # the e-stop ramps to zero
    assert np.all(ticks.action[reset - 1] == 0)  # at the stop action when reset
    assert dropped == 0 and _check_rows(segments, ticks) >= 100


def _lines_until(stdout: Any, last: Callable[[str], bool]) -> str:
    """The lines the client prints, read as they come, until one that is ``last``."""
    seen = []
    for line in stdout:
        seen.append(line)
        if last(line):
            return "".join(seen)
    raise AssertionError("".join(seen))


def _rest(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """What the client prints after the lines read with :func:`_lines_until`, to its end, and
    its stderr. (``communicate()`` reads the pipe itself, and would miss the lines those reads
    left in the file's buffer.)"""
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.wait(timeout=60)
    return out, err


def _line_at_tick(stdout: Any, tick: int) -> str:
    """The lines the client prints until that of tick ``tick`` or a later one."""

    def at(line: str) -> bool:
        m = TICK.match(line)
        return m is not None and int(m.group(1)) >= tick

    return _lines_until(stdout, at)


def test_the_watchdog_loop_ticks_on_through_an_outage_and_resumes(
    client: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's connection goes silent midway. The loop never waits for it: it ticks on
    at 50 Hz on fallbacks while the network thread finds the answer overdue and opens a new
    stream, which resumes the session; policy actions come back, and the server keeps every
    row, each with the rewards of all the ticks until the next (those of the outage too)."""

    def go_silent(srv: ServerThread, link: Link) -> None:
        time.sleep(1.0)
        srv.in_loop(link.go_silent)

    args = ("--steps", "150", "--hz", "50", "--watchdog", "--answer-timeout-s", "0.3", "--estop-after", "0")
    run = _through_link(client, monkeypatch, go_silent, *args)
    assert run.returncode == 0, run.out + run.err
    assert run.reconnects() == ["reconnect 1 after 4 no answer within 0.3 s"], run.out
    ticks = _ticks(run.out)
    assert np.diff(ticks.at_ms).max() < 200, ticks.at_ms  # no tick waited for the network
    outage = max(n for _, n in ticks.runs_of("fallback"))
    assert outage >= 10, ticks.kind  # 0.3 s and more of fallbacks: 15 ticks
    assert ticks.kind[-30:].count("policy") >= 20, ticks.kind
    _check_rate_limited(ticks, 0.5)
    assert run.dropped == 0 and _check_rows(run.segments, ticks, breaks=1) >= 100
    tracker = EpisodeTracker()
    assemble(run.segments, None, tracker)
    assert tracker.cut == 0
    assert len(run.hellos) == 2 and run.hellos[1] == (True, True), run.hellos
    assert {b - a for a, b in itertools.pairwise(run.numbers)} <= {0, 1}, run.numbers


def test_the_watchdog_stops_safely_when_the_server_is_gone(client: Path) -> None:
    """The server goes away for good: the network thread retries for ``--reconnect-s``, the
    loop ticking on meanwhile; then the watchdog latches an e-stop, which a reset does not end
    (no policy is there), the loop ramps to the stop action, and the run ends there with the
    stream's status."""
    args = ("--steps", "500", "--hz", "50", "--watchdog", "--reconnect-s", "0.5", "--max-delta", "0.02")
    with ServerThread(EchoPolicy(3, 2)) as srv:
        cmd = [str(client), "--server", srv.address, *args]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None
            seen = _line_at_tick(proc.stdout, 20)
            srv.kill()
            seen += _lines_until(proc.stdout, lambda line: line.startswith("estop the stream ended: 14 "))
            proc.send_signal(signal.SIGUSR1)  # while it ramps down (0.02 a tick)
            out, err = _rest(proc)
    out = seen + out
    assert proc.returncode == 1 and out.splitlines()[-1].startswith("ERROR 14 "), out + err
    assert out.count("estop the stream ended: 14 ") == 1, out
    assert "estop reset refused: the stream has ended\n" in out and "estop reset\n" not in out, out
    ticks = _ticks(out)
    first = ticks.kind.index("estop")
    assert set(ticks.kind[first:]) == {"estop"} and np.all(ticks.action[-1] == 0)
    assert ticks.index[-1] < 200  # it ended once stopped, not at --steps
    assert np.diff(ticks.at_ms).max() < 200, ticks.at_ms  # the retries held no tick
    assert ticks.at_ms[first] - ticks.at_ms[ticks.kind.index("fallback", 20)] >= 400  # 0.5 s of retries
    _check_rate_limited(ticks, 0.02)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--watchdog"], "--watchdog needs --hz > 0 (the control rate)"),
        (["--hz", "50", "--deadline-ms", "5"],
         "--deadline-ms is an option of --watchdog, which is not given"),
        (["--hz", "50", "--watchdog", "--fallback", "brake"], "--fallback must be hold or zero, got 'brake'"),
        (["--hz", "50", "--watchdog", "--deadline-ms", "0"], "--deadline-ms must be > 0"),
        (["--hz", "50", "--refill-at", "2"], "--refill-at is an option of --watchdog, which is not given"),
        (["--hz", "50", "--watchdog", "--refill-at", "1.5"], "--refill-at: expected a whole number, got 1.5"),
        (["--hz", "50", "--watchdog", "--estop-after", "-1"],
         "--estop-after must be a number in [0, 2147483647], got -1"),
        (["--hz", "50", "--metrics-port", "0"],
         "--metrics-port is an option of --watchdog, which is not given"),
        (["--hz", "50", "--watchdog", "--metrics-host", "0.0.0.0"],
         "--metrics-host is the address of --metrics-port, which is not given"),
        (["--hz", "50", "--watchdog", "--metrics-port", "65536"],
         "--metrics-port must be a number in [0, 65535], got 65536"),
        (["--hz", "50", "--watchdog", "--metrics-port", "0", "--metrics-host", "10.255.255.1"],
         "--metrics-port: cannot listen on 10.255.255.1:0: Cannot assign requested address"),
    ],
)  # fmt: skip
def test_a_bad_watchdog_option_is_refused_naming_it(client: Path, args: list[str], error: str) -> None:
    out = _run(client, "--server", "127.0.0.1:1", *args)
    assert out.returncode == 2 and out.stderr == f"edgerl_cpp_client: {error}\n", out.stderr
    assert out.stdout == ""


def test_a_metrics_port_in_use_is_refused_before_the_server_is_asked(client: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _run(client, "--server", "127.0.0.1:1", "--hz", "50", "--watchdog", "--metrics-port", str(port))
    error = f"edgerl_cpp_client: --metrics-port: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert out.returncode == 2 and out.stderr == error, out.stderr
    assert out.stdout == ""  # no server asked: its address has none


def test_the_watchdog_serves_its_figures_on_metrics_as_edgerl_robot_names_them(client: Path) -> None:
    """``--metrics-port``: the loop's and the stream's figures for Prometheus, under the names,
    types and labels of ``edgerl robot``'s (the session's name as ``robot``), so that the
    project's Grafana dashboard and alerting rules cover a C++ controller: each robot figure they
    query is served. Scraped mid-run, the counters agree with each other and with the run's end."""
    from edgerl.launch.robot import ROBOT_METRICS, ROBOT_TIMES, STREAM_METRICS
    from tests.test_metrics import queried_names, scrape

    session = 'arm "left" 1'  # a label value with quotes and spaces
    args = ["--server", "", "--steps", "150", "--hz", "50", "--watchdog", "--session", session]
    with ServerThread(EchoPolicy(3, 2)) as srv:
        args[1] = srv.address
        with subprocess.Popen(
            [str(client), *args, "--metrics-port", "0"], stdout=subprocess.PIPE, text=True
        ) as proc:
            try:
                assert proc.stdout is not None
                first = proc.stdout.readline()
                bound = re.fullmatch(r"metrics (http://127\.0\.0\.1:\d+/metrics)\n", first)
                assert bound, first
                url = bound.group(1)
                for line in proc.stdout:
                    if line.startswith("tick 60 "):
                        break
                status, headers, body = scrape(url)
                elsewhere = scrape(url.replace("/metrics", "/other"))[0], scrape(url, "POST")[0]
                rest = proc.stdout.read()
                assert proc.wait(timeout=60) == 0, rest
            finally:
                proc.kill()
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4"), headers
    assert elsewhere == (404, 405)
    got: dict[str, float] = {}
    kinds: dict[str, str] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            assert isinstance(sample, Sample)
            robot = sample.labels.pop("robot", None)
            assert robot == (None if sample.name.startswith("edgerl_robot_stream_") else session), sample
            got[sample.name + "".join(f"/{v}" for v in sample.labels.values())] = sample.value
            kinds[sample.name] = family.type
    python = {name: kind for _, name, kind, _ in (*ROBOT_METRICS, *STREAM_METRICS)}
    python.update({name: "gauge" for _, name, _ in ROBOT_TIMES})
    not_here = {  # a Python robot host's own: its episodes, its shared stream, its network process
        "edgerl_robot_episodes_total",
        "edgerl_robot_stream_messages_total",
        "edgerl_robot_network_restarts_total",
    }
    assert kinds == {name: kind for name, kind in python.items() if name not in not_here}
    assert queried_names(robots=True) <= set(kinds)
    summary = _summary(first + rest)
    ticks = got["edgerl_robot_ticks_total"]
    assert 60 <= ticks <= summary["ticks"]
    assert ticks == got["edgerl_robot_policy_ticks_total"] + got["edgerl_robot_fallbacks_total"]
    assert got["edgerl_robot_answers_total"] <= got["edgerl_robot_requests_total"] <= ticks
    assert got["edgerl_robot_requests_total"] <= got["edgerl_robot_answers_total"] + 1  # one in flight
    assert got["edgerl_robot_answers_total"] >= 50  # an echo on loopback answers in about a millisecond
    assert got["edgerl_robot_estopped"] == got["edgerl_robot_estops_total"] == 0
    assert got["edgerl_robot_policy_version"] == 0 and got["edgerl_robot_stream_up"] == 1
    assert got["edgerl_robot_stream_reconnects_total"] == 0
    for name in ("tick_jitter", "action_age", "latency"):
        p50, p99 = got[f"edgerl_robot_{name}_seconds/0.5"], got[f"edgerl_robot_{name}_seconds/0.99"]
        assert 0 <= p50 <= p99 < 1.0, (name, p50, p99)
    # an action is applied at the tick after its observation: its age is at least the answer's
    assert got["edgerl_robot_action_age_seconds/0.5"] >= got["edgerl_robot_latency_seconds/0.5"]
