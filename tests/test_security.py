"""TLS, mutual TLS and caller tokens on a real server: accepted and rejected."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgerl.edge_server.auth import TokenAuthInterceptor, load_tokens, server_credentials
from edgerl.edge_server.server import ServerConfig
from edgerl.launch.certs import DevPki, make_dev_pki, new_token
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.proto.v1 import edge_pb2_grpc as pb_grpc
from edgerl.robot_client import errors
from edgerl.robot_client.client import EdgeClient, ServerInfo
from edgerl.robot_client.runner import RobotHost, RobotRunnerConfig
from edgerl.robot_client.security import ClientSecurity
from edgerl.trainer.feed import learner_channel, publish_weights
from edgerl.watchdog.watchdog import WatchdogConfig
from tests.helpers import EchoPolicy, ServerThread, act_once, run
from tests.test_robot import CounterRobot


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return make_dev_pki(tmp_path_factory.mktemp("pki"))


def _describe(address: str, security: ClientSecurity | None) -> int:
    async def go() -> int:
        async with EdgeClient(address, timeout_s=3.0, security=security) as c:
            info: ServerInfo = await c.describe()
            return int(info.obs_shape[0])

    return asyncio.run(asyncio.wait_for(go(), 30.0))


async def _one_step(address: str, security: ClientSecurity | None) -> np.ndarray:
    obs = np.ones((1, 3), np.float32)
    return (await act_once(address, obs, session_id="s", timeout_s=3.0, security=security)).actions


async def _act_status(address: str, security: ClientSecurity | None) -> grpc.StatusCode:
    """Final status of an Act stream that sends its hello (and nothing else)."""
    metadata = security.metadata() if security else ()
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.EdgePolicyStub(channel).Act(timeout=5.0, metadata=metadata)
        hello = pb.StreamHello(session_id="s", num_envs=1, obs_shape=[3])
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call.write(pb.ActRequest(hello=hello))
        code: grpc.StatusCode = await call.code()
        return code


def _step(address: str, security: ClientSecurity | None) -> np.ndarray:
    out: np.ndarray = np.asarray(run(_one_step(address, security)))
    return out


def test_tls_accepts_a_client_that_trusts_the_ca_and_refuses_plaintext(pki: DevPki) -> None:
    with ServerThread(EchoPolicy(3, 2), tls_cert=str(pki.server_cert), tls_key=str(pki.server_key)) as srv:
        assert _describe(srv.address, ClientSecurity(ca=str(pki.ca))) == 3
        with pytest.raises(errors.ServerUnavailableError):
            _describe(srv.address, None)


def test_mutual_tls_needs_a_client_certificate(pki: DevPki) -> None:
    cfg = {"tls_cert": str(pki.server_cert), "tls_key": str(pki.server_key), "tls_client_ca": str(pki.ca)}
    with ServerThread(EchoPolicy(3, 2), **cfg) as srv:
        mtls = ClientSecurity(ca=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key))
        assert _describe(srv.address, mtls) == 3
        np.testing.assert_allclose(_step(srv.address, mtls), [[1.0, 1.0]])
        with pytest.raises(errors.ServerUnavailableError):
            _describe(srv.address, ClientSecurity(ca=str(pki.ca)))  # TLS, but no client certificate


def test_tokens_missing_wrong_robot_and_trainer(pki: DevPki) -> None:
    from edgerl.edge_server.transitions import TransitionConfig

    with ServerThread(EchoPolicy(3, 2), tokens=str(pki.tokens), learner=TransitionConfig()) as srv:
        robot = ClientSecurity(token=pki.robot_token)
        trainer = ClientSecurity(token=pki.trainer_token)
        for bad in (None, ClientSecurity(token="not-a-valid-token-at-all")):
            with pytest.raises(errors.UnauthenticatedError, match="token"):
                _describe(srv.address, bad)
            assert run(_act_status(srv.address, bad)) == grpc.StatusCode.UNAUTHENTICATED
        assert _describe(srv.address, robot) == 3
        np.testing.assert_allclose(_step(srv.address, robot), [[1.0, 1.0]])

        channel = learner_channel(srv.address)
        stub = pb_grpc.LearnerStub(channel)
        with pytest.raises(errors.PermissionDeniedError, match="robot-1"):
            publish_weights(stub, {}, 1, security=robot)
        with pytest.raises(errors.PermissionDeniedError, match="robot-1"):  # in parts
            publish_weights(stub, {"w": np.zeros(300)}, 1, security=robot, part_bytes=1000)
        with pytest.raises(grpc.RpcError) as info:
            next(
                iter(stub.StreamTransitions(iter([pb.TransitionAck()]), metadata=robot.metadata(), timeout=3))
            )
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # the trainer's token passes authentication; the echo policy then refuses weights by itself
        with pytest.raises(errors.RpcError) as trainer_info:
            publish_weights(stub, {}, 1, security=trainer)
        assert trainer_info.value.code not in (
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED,
        )
        # health stays open for probes without credentials
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        channel.close()

        async def ready_without_a_token() -> None:  # wait_ready asks health: it needs no token
            async with EdgeClient(srv.address, timeout_s=3.0) as client:
                await client.wait_ready()

        run(ready_without_a_token())
        assert srv.server is not None and srv.server.auth is not None
        assert srv.server.auth.rejected_unauthenticated == 4
        assert srv.server.auth.rejected_permission == 3


def test_new_tokens_never_read_as_an_option() -> None:
    """A URL-safe token starts with "-" 1 time in 64; on a command line (``--token TOKEN``) such a
    token was taken for an option, and ``edgerl describe`` failed to parse its arguments."""
    tokens = {new_token() for _ in range(2000)}
    assert len(tokens) == 2000 and all(len(t) == 32 for t in tokens)
    assert not [t for t in tokens if t.startswith("-")]


def test_edgerl_describe_sends_its_token(pki: DevPki, capsys: pytest.CaptureFixture[str]) -> None:
    from edgerl.launch.cli import main

    with ServerThread(EchoPolicy(3, 2), tokens=str(pki.tokens)) as srv:
        assert main(["describe", "--server", srv.address, "--token", "not-a-valid-token-at-all"]) == 1
        assert capsys.readouterr().err.startswith(
            f"edgerl: error: could not ask {srv.address} (UNAUTHENTICATED"
        )
        assert main(["describe", "--server", srv.address, "--token", pki.robot_token]) == 0
        assert json.loads(capsys.readouterr().out)["describe"]["obs_shape"] == [3]


def test_edgerl_certs_writes_what_its_printed_commands_need(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``edgerl certs DIR --hosts NAME``, then its two printed commands' flags: a server with mutual
    TLS and tokens, and a client that verifies the server as NAME and takes its token from
    ``$EDGERL_TOKEN``."""
    from edgerl.launch.cli import main

    assert main(["certs", str(tmp_path / "pki"), "--hosts", "edge.local"]) == 0
    wrote, serve, robot = capsys.readouterr().out.splitlines()
    assert wrote.startswith(f"edgerl: wrote {tmp_path / 'pki' / 'ca.pem'}, "), wrote
    server = dict(re.findall(r"--(\S+) (\S+)", serve))
    client = dict(re.findall(r"--(\S+) (\S+)", robot))
    assert set(server) == {"tls-cert", "tls-key", "tls-client-ca", "tokens"}
    assert set(client) == {"tls-ca", "tls-cert", "tls-key"}
    assert all(Path(f).is_file() for f in [*server.values(), *client.values()])
    (robot_token,) = [t for t, caller in load_tokens(server["tokens"]).items() if caller.role == "robot"]
    monkeypatch.setenv("EDGERL_TOKEN", robot_token)
    settings = {k.replace("-", "_"): v for k, v in server.items()}
    with ServerThread(EchoPolicy(3, 2), **settings) as srv:
        flags = [f"--{k}={v}" for k, v in client.items()]
        assert main(["describe", "--server", srv.address, *flags, "--tls-server-name", "edge.local"]) == 0
        assert json.loads(capsys.readouterr().out)["describe"]["obs_shape"] == [3]
        # the certificate covers the hosts given, and no other name
        assert main(["describe", "--server", srv.address, *flags, "--tls-server-name", "localhost"]) == 1
        assert "UNAVAILABLE" in capsys.readouterr().err
        assert srv.server is not None and srv.server.auth is not None
        assert srv.server.auth.rejected_unauthenticated == 0  # the token came from the environment


def test_robots_run_over_mutual_tls_with_a_token(pki: DevPki) -> None:
    cfg = {
        "tls_cert": str(pki.server_cert),
        "tls_key": str(pki.server_key),
        "tls_client_ca": str(pki.ca),
        "tokens": str(pki.tokens),
    }
    sec = ClientSecurity(str(pki.ca), str(pki.client_cert), str(pki.client_key), pki.robot_token)
    with ServerThread(EchoPolicy(3, 2), **cfg) as srv:
        run_cfg = RobotRunnerConfig(srv.address, WatchdogConfig(hz=50.0, max_delta=1e6), security=sec)
        with RobotHost([CounterRobot()], run_cfg) as host:
            time.sleep(1.0)
            (s,) = host.stats()
    assert s["ticks"] >= 45 and s["fallbacks"] <= 2


_TOKEN = "0123456789abcdefXYZ"
_ENTRY = '[[token]]\nname = "{}"\nrole = "{}"\ntoken = "{}"\n'
BAD_TOKEN_FILES = {
    "role": (_ENTRY.format("a", "admin", _TOKEN), "token[0].role: expected one of"),
    "token": (_ENTRY.format("a", "robot", "short"), "token[0].token: needs at least 16 characters"),
    "name": (_ENTRY.format("", "robot", _TOKEN), "token[0].name: missing"),
    "duplicate": (
        _ENTRY.format("a", "robot", _TOKEN) + _ENTRY.format("a", "robot", _TOKEN[::-1]),
        "token[1]: duplicate name or token ('a')",
    ),
    "no entries": ("[server]\n", "has no [[token]] entries"),
    "not toml": ("[[token]\n", "is not TOML: "),
}


@pytest.mark.parametrize("case", list(BAD_TOKEN_FILES))
def test_tokens_file_errors_name_the_entry(case: str, tmp_path: Path) -> None:
    text, message = BAD_TOKEN_FILES[case]
    f = tmp_path / "t.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=f"^tokens: {re.escape(str(f))} {re.escape(message)}"):
        load_tokens(f)


def test_a_missing_tokens_file_or_an_empty_token_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^tokens: no file .*/missing\.toml$"):
        load_tokens(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match=r"^tokens: at least one is needed$"):
        TokenAuthInterceptor({})


def test_tls_settings_are_checked() -> None:
    """Settings that cannot go together are refused naming the fields and their flags."""
    for settings, said in [
        ({"tls_cert": "a.pem"}, "got only tls_cert"),
        ({"tls_key": "a.key"}, "got only tls_key"),
    ]:
        with pytest.raises(ValueError) as refused:
            ServerConfig(**settings)  # type: ignore[arg-type]
        assert str(refused.value) == f"tls_cert and tls_key go together (--tls-cert, --tls-key), {said}"
    with pytest.raises(ValueError, match=r"^tls_client_ca \(mutual TLS\) needs tls_cert and tls_key$"):
        ServerConfig(tls_client_ca="ca.pem")
    for client, said in [({"cert": "c.pem"}, "the cert"), ({"key": "c.key"}, "the key")]:
        with pytest.raises(ValueError) as refused:
            ClientSecurity(**client)
        assert str(refused.value) == f"tls cert and key go together (--tls-cert, --tls-key), got only {said}"
    with pytest.raises(ValueError) as refused:
        ClientSecurity(cert="c.pem", key="c.key")
    assert (
        str(refused.value) == "a client certificate (mutual TLS) needs the server's CA (ca, --tls-ca) as well"
    )


def test_missing_tls_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tls ca: no file"):
        ClientSecurity(ca=str(tmp_path / "nope.pem")).channel_credentials()
    key = tmp_path / "server.key"
    key.write_text("not checked before the certificate is found")
    with pytest.raises(ValueError, match="tls_cert: no file"):
        server_credentials(str(tmp_path / "nope.pem"), str(key))
    asyncio.set_event_loop(None)


def test_a_folder_edgerl_certs_cannot_write_ends_it_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A file a command cannot write (here a folder under a device) is one line and exit code 1,
    where it was a traceback."""
    from edgerl.launch.cli import main

    assert main(["certs", "/dev/full/pki"]) == 1
    assert capsys.readouterr().err == "edgerl: error: [Errno 20] Not a directory: '/dev/full/pki'\n"
