"""The C++ client (robot_client/cpp) built with CMake against the system gRPC, run against real servers."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from edgerl.launch.certs import DevPki, make_dev_pki
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
