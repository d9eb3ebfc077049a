"""Settings that no run could use are refused at once, naming the field: a float that is NaN or
infinite, a keepalive time beyond gRPC's, a Unix socket path longer than Linux takes, a server
address that no server can have.

``nan <= 0`` is False, so a range check alone lets NaN through; these tests find the settings
classes (the dataclasses of edgerl with a ``__post_init__``) themselves, so that a new class
or field is covered without being listed here.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import pkgutil
import re
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgerl.launch.cli import main
from edgerl.proto.keepalive import MAX_KEEPALIVE_S, check_keepalive
from edgerl.proto.settings import GRPC_INT_MAX, GRPC_MAX_S, UNIX_PATH_MAX
from tests.helpers import EchoPolicy, run, running_server

PACKAGES = ("proto", "edge_server", "robot_client", "sim", "trainer", "watchdog", "launch", "models")
REQUIRED = {"server": "127.0.0.1:1"}
"""Values of the fields that have no default."""


def _settings_classes() -> list[type[Any]]:
    found: list[type[Any]] = []
    for package in PACKAGES:
        for module in pkgutil.iter_modules(importlib.import_module(f"edgerl.{package}").__path__):
            if module.name == "__main__":
                continue
            mod = importlib.import_module(f"edgerl.{package}.{module.name}")
            found += [
                obj
                for obj in vars(mod).values()
                if isinstance(obj, type)
                and dataclasses.is_dataclass(obj)
                and obj.__module__ == mod.__name__
                and "__post_init__" in vars(obj)
            ]
    return found


def _float_fields() -> list[tuple[type[Any], str, bool]]:
    """(class, field, whether it is a tuple) for every field whose type names float."""
    return [
        (cls, f.name, str(f.type).startswith("tuple"))
        for cls in _settings_classes()
        for f in dataclasses.fields(cls)
        if "float" in str(f.type)
    ]


FLOAT_FIELDS = _float_fields()


def test_the_settings_classes_are_found() -> None:
    names = {cls.__name__ for cls in _settings_classes()}
    assert {
        "ServerConfig",
        "TransitionConfig",
        "TrainerConfig",
        "WatchdogConfig",
        "RobotRunnerConfig",
    } <= names
    assert {"SimWorkerConfig", "LinkFaults", "ThroughputConfig", "BenchRobotConfig", "RunConfig"} <= names
    fields = {(cls.__name__, name) for cls, name, _ in FLOAT_FIELDS}
    assert {("WatchdogConfig", "deadline_s"), ("TrainerConfig", "learning_rate")} <= fields
    assert ("WatchdogConfig", "safe_pose") in fields  # a tuple of floats
    assert len(fields) >= 40


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    ("cls", "name", "is_tuple"), FLOAT_FIELDS, ids=[f"{c.__name__}.{n}" for c, n, _ in FLOAT_FIELDS]
)
def test_a_float_setting_that_is_not_a_finite_number_is_refused_naming_it(
    cls: type[Any], name: str, is_tuple: bool, bad: float
) -> None:
    required = {k: v for k, v in REQUIRED.items() if k in {f.name for f in dataclasses.fields(cls)}}
    cls(**required)  # valid as it is
    value: Any = (0.0, bad) if is_tuple else bad
    with pytest.raises(ValueError, match=rf"^{name} must be ") as refused:
        cls(**required, **{name: value})
    assert str(refused.value).endswith(f"got {value}")


def test_keepalive_settings_stop_where_grpc_does() -> None:
    check_keepalive(MAX_KEEPALIVE_S, MAX_KEEPALIVE_S, off=False)  # 2,147,483,000 ms: under 2**31
    check_keepalive(0.0, 1.0, off=True)
    refused = [(MAX_KEEPALIVE_S + 1, 1.0, True), (1.0, MAX_KEEPALIVE_S + 1, True), (0.0, 1.0, False)]
    refused += [(math.nan, 1.0, True), (1.0, math.nan, False), (1e300, 1.0, True), (-1.0, 1.0, True)]
    for every_s, timeout_s, off in refused:
        with pytest.raises(
            ValueError, match=rf"^keepalive_s must be in .* {re.escape(f'got {every_s} and {timeout_s}')}$"
        ):
            check_keepalive(every_s, timeout_s, off=off)


def _numbers_of_constructors() -> dict[str, tuple[Any, str]]:
    from edgerl.models.llm import ObsActionCodec
    from edgerl.robot_client.client import EdgeClient
    from edgerl.sim.robot import MujocoRobot
    from edgerl.trainer.segments import EnvStates

    bounds = np.ones(2, np.float32)
    return {
        "EdgeClient.timeout_s": (lambda x: EdgeClient("127.0.0.1:1", timeout_s=x), "timeout_s"),
        "MujocoRobot.hz": (lambda x: MujocoRobot(hz=x), "hz"),
        "ObsActionCodec.obs_clip": (lambda x: ObsActionCodec(-bounds, bounds, obs_clip=x), "obs_clip"),
        "EnvStates.idle_s": (lambda x: EnvStates(idle_s=x), "idle_s"),
    }


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("which", list(_numbers_of_constructors()))
def test_a_constructor_refuses_a_number_that_is_not_finite_naming_it(which: str, bad: float) -> None:
    make, name = _numbers_of_constructors()[which]
    with pytest.raises(ValueError, match=rf"^{name} must be a finite number (>|>=) 0, got {bad}$"):
        make(bad)


def test_a_unix_socket_path_longer_than_linux_takes_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from edgerl.edge_server.server import ServerConfig
    from edgerl.robot_client.sim_worker import SimWorkerConfig

    prefix = f"/tmp/edgerl-{os.getpid()}-"
    longest = prefix + "s" * (UNIX_PATH_MAX - len(prefix))

    async def serve_the_longest() -> None:  # it binds, and a client reaches it
        async with running_server(EchoPolicy(3, 2), local_socket=longest):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(longest)
        assert not os.path.exists(longest)  # removed at stop

    run(serve_the_longest())
    one_more = longest + "s"
    error = f"local_socket: {one_more} is 108 bytes long, and the path of a Unix socket takes at most 107"
    for make in (
        lambda: ServerConfig(local_socket=one_more),
        lambda: SimWorkerConfig("", local_socket=one_more),
    ):
        with pytest.raises(ValueError) as refused:
            make()
        assert str(refused.value).startswith(error)
    with pytest.raises(SystemExit) as exit_:  # a sim worker would wait for a server there for good
        main(["sim", "--local-socket", one_more])
    assert exit_.value.code == 2
    assert f"error: argument --local-socket: {error[len('local_socket: ') :]}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "target",
    [
        "127.0.0.1:1",
        "localhost:65535",
        "[::1]:50051",
        "robot-7",
        "::1",
        "[::1]",
        "dns:///host:443",
        "unix:/tmp/x.sock",
        "unix:///tmp/x.sock",
    ],
)
def test_a_server_address_a_server_can_have_goes_to_grpc_as_it_is(target: str) -> None:
    from edgerl.robot_client.security import check_target

    check_target(target)  # a port of gRPC's choosing (443), or the scheme's own form


@pytest.mark.parametrize(
    ("target", "error"),
    [
        ("", "server: no address; expected host:port"),
        ("127.0.0.1:0", "server: the port of '127.0.0.1:0' is not a number in [1, 65535]"),
        ("127.0.0.1:99999", "server: the port of '127.0.0.1:99999' is not a number in [1, 65535]"),
        ("robot-7:http", "server: the port of 'robot-7:http' is not a number in [1, 65535]"),
        ("[::1]:", "server: the port of '[::1]:' is not a number in [1, 65535]"),
        (":50051", "server: ':50051' has no host; expected host:port"),  # gRPC connects nowhere
        (
            "http://127.0.0.1:50051",  # gRPC resolved it as a host name, and retried it for good
            "server: 'http://127.0.0.1:50051' is a URL; expected host:port (gRPC takes no http:// scheme)",
        ),
        (
            "grpc://robot-7:50051",
            "server: 'grpc://robot-7:50051' is a URL; expected host:port (gRPC takes no grpc:// scheme)",
        ),
    ],
)
def test_a_server_address_no_server_can_have_is_refused_before_anything_retries_it(
    target: str, error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgerl.robot_client.client import EdgeClient
    from edgerl.robot_client.runner import RobotRunnerConfig
    from edgerl.robot_client.sim_worker import SimWorkerConfig

    makers: list[Callable[[], object]] = [
        lambda: RobotRunnerConfig(target),
        lambda: SimWorkerConfig(target),
        lambda: EdgeClient(target),
    ]
    for make in makers:
        with pytest.raises(ValueError) as refused:
            make()
        assert str(refused.value) == error
    if target:  # `edgerl sim` without --server asks for --server or --local-socket
        for command in ("sim", "robot", "describe"):
            assert main([command, "--server", target]) == 2  # no worker, robot or call retrying it
            assert capsys.readouterr().err == f"edgerl: error: {error}\n"


def test_grpc_options_stop_at_a_c_int_and_a_server_and_client_at_it_serve() -> None:
    from edgerl.robot_client.client import EdgeClient

    for kwargs, error in (
        (
            {"max_message_bytes": GRPC_INT_MAX + 1},
            f"max_message_bytes must be in [1024, {GRPC_INT_MAX}], got ",
        ),
        ({"max_message_bytes": 0}, f"max_message_bytes must be in [1024, {GRPC_INT_MAX}], got 0"),
        (
            {"reconnect_backoff_max_s": 1e9},
            f"reconnect_backoff_max_s must be in (0, {GRPC_MAX_S}], got 1000000000.0",
        ),
        (
            {"reconnect_backoff_max_s": math.nan},
            f"reconnect_backoff_max_s must be in (0, {GRPC_MAX_S}], got nan",
        ),
    ):
        with pytest.raises(ValueError) as refused:  # an OverflowError out of gRPC, or a client refusing all
            EdgeClient("127.0.0.1:1", **kwargs)
        assert str(refused.value).startswith(error)

    async def at_the_limits() -> None:
        async with running_server(EchoPolicy(3, 2), max_message_bytes=GRPC_INT_MAX) as server:
            client = EdgeClient(
                server.address, max_message_bytes=GRPC_INT_MAX, reconnect_backoff_max_s=GRPC_MAX_S
            )
            async with client:
                answer = await client.act(np.ones((4, 3), np.float32))
        assert answer.actions.shape == (4, 2)

    run(at_the_limits())


def test_a_local_socket_folder_is_made_in_tmp_where_tmpdir_is_too_long_for_a_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgerl.launch.processes import LOCAL_SOCKET_NAME, local_socket_folder

    long_dir = tmp_path / ("t" * 100)
    long_dir.mkdir()
    short_dir = tempfile.mkdtemp(dir="/tmp")
    try:
        for tmpdir, expected in ((str(long_dir), "/tmp"), (short_dir, short_dir)):
            monkeypatch.setattr(tempfile, "tempdir", tmpdir)  # as $TMPDIR would
            with local_socket_folder("edgerl-test-") as folder:
                assert os.path.dirname(folder) == expected
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
                    server.bind(os.path.join(folder, LOCAL_SOCKET_NAME))  # the server's bind
    finally:
        os.rmdir(short_dir)
