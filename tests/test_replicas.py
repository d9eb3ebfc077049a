"""Policy replicas, each in a process of its own, behind a real edge server."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edgerl.edge_server.replicas import ReplicaError, ReplicatedBackend
from edgerl.launch.processes import (
    OWNER_STOP,
    PolicySpec,
    ServerProcess,
    build_backend,
    build_replica,
)
from edgerl.robot_client.client import EdgeClient
from edgerl.watchdog.sched import STOP_SIGNALS
from tests.helpers import (
    ServerThread,
    act_once,
    broken_pid_echo,
    child_pids,
    pid_echo_built_in,
    serving,
    slow_pid_echo,
    wait_until,
)

OBS = np.random.default_rng(0).normal(size=(5, 17)).astype(np.float32)


async def _one_step(address: str, name: str, after_s: float) -> tuple[float, float]:
    """One 3-env step on a stream of its own, opened ``after_s`` from now; the answering pid and when."""
    await asyncio.sleep(after_s)  # the first batch has left when the second comes
    answer = await act_once(address, np.ones((3, 4), np.float32), session_id=name)
    return float(answer.log_probs[0]), time.monotonic()


def test_replicas_answer_the_batches_of_two_streams_side_by_side() -> None:
    backend = ReplicatedBackend(slow_pid_echo, 2)  # each batch takes 1 s
    assert (backend.name, backend.pipeline_depth, backend.replicas) == ("echo-x2", 2, 2)
    with ServerThread(backend) as srv:  # which closes the backend (its replica processes) at the end

        async def both() -> tuple[tuple[float, float], tuple[float, float]]:
            return await asyncio.gather(_one_step(srv.address, "a", 0.0), _one_step(srv.address, "b", 0.3))

        t0 = time.monotonic()
        answers = asyncio.run(both())
    pids = {pid for pid, _ in answers}
    assert len(pids) == 2 and os.getpid() not in pids  # two replica processes answered
    # side by side: both within 1.3 s of batches and a margin, where one after the other takes 2 s
    assert max(t for _, t in answers) - t0 < 1.9
    with pytest.raises(ReplicaError, match="closed"):  # the server's end closed its backend
        backend.infer(np.ones((3, 4), np.float32))


def test_replicas_sample_their_own_noise_and_take_weights_together() -> None:
    policy = PolicySpec("HalfCheetah-v5", "mlp", seed=3)
    single, _ = build_backend(policy)
    first = single.infer(OBS).actions
    backend, _ = build_backend(PolicySpec("HalfCheetah-v5", "mlp", seed=3, replicas=2))
    try:
        # replica 0 is the unreplicated policy; replica 1 has the same weights, other noise
        np.testing.assert_array_equal(backend.infer(OBS).actions, first)
        assert not np.allclose(backend.infer(OBS).actions, first, atol=1e-3)
        # new weights with no noise to speak of: every replica answers the same means
        weights = {k: v.detach().numpy().copy() for k, v in single.policy.state_dict().items()}
        assert backend.weights_values == single.weights_values == sum(w.size for w in weights.values())
        weights["actor_log_std"][:] = -30.0
        weights["actor_mean.0.bias"] += 0.5
        backend.load_weights(weights, 7)
        single.load_weights(weights, 7)
        with torch.no_grad():
            means = single.policy.distribution(torch.from_numpy(OBS))[0].numpy()
        for _ in range(2):  # one call per replica
            np.testing.assert_allclose(backend.infer(OBS).actions, means, atol=1e-5)
        assert backend.version == 7
        with pytest.raises(KeyError, match="missing"):
            backend.load_weights({"actor_log_std": weights["actor_log_std"]}, 8)
        assert backend.version == 7  # refused before any replica changed
        np.testing.assert_allclose(backend.infer(OBS).actions, means, atol=1e-5)
    finally:
        backend.close()
        single.close()
    with pytest.raises(ReplicaError, match=r"no policy replica is alive \(closed\)"):
        backend.infer(OBS)


def test_a_replica_that_dies_is_dropped_and_one_that_cannot_build_fails_the_start() -> None:
    backend = ReplicatedBackend(functools.partial(slow_pid_echo, delay_s=0.0), 2)
    try:
        backend._replicas[0].proc.kill()
        obs = np.ones((2, 4), np.float32)
        with pytest.raises(ReplicaError, match="policy replica 0 exited"):
            for _ in range(2):  # the queue hands out replica 0 first
                backend.infer(obs)
        assert backend.replicas == 1
        pids = {float(backend.infer(obs).log_probs[0]) for _ in range(3)}
        assert pids == {float(backend._replicas[1].proc.pid)}  # the other serves on
        backend._replicas[1].proc.kill()
        with pytest.raises(ReplicaError, match="policy replica 1 exited"):
            backend.infer(obs)
        with pytest.raises(ReplicaError, match=r"no policy replica is alive$"):
            backend.infer(obs)  # fails at once rather than waiting for a replica
    finally:
        backend.close()
    bad = functools.partial(build_replica, PolicySpec("NoSuchEnv-v0", "mlp"))
    with pytest.raises(
        ReplicaError, match=r"policy replica [01] failed to build its backend: .*NoSuchEnv-v0"
    ):
        ReplicatedBackend(bad, 2)


def test_a_replica_that_does_not_build_in_time_fails_the_start_and_is_killed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from edgerl.edge_server import replicas

    monkeypatch.setattr(replicas, "STOP_TIMEOUT_S", 1.0)  # the stop it cannot hear, shortened
    started: list[Any] = []
    real = replicas._Replica.__init__

    def keep(self: Any, *args: Any) -> None:
        real(self, *args)
        started.append(self)

    monkeypatch.setattr(replicas._Replica, "__init__", keep)
    t0 = time.monotonic()
    with pytest.raises(ReplicaError, match=r"^policy replica 0 did not start within 0\.5s$"):
        ReplicatedBackend(functools.partial(pid_echo_built_in, build_s=60.0), 2, start_timeout_s=0.5)
    assert time.monotonic() - t0 < 10.0  # neither waits out its minute
    assert len(started) == 2 and all(r.proc.returncode == -signal.SIGKILL for r in started)
    killed = [r.getMessage() for r in caplog.records if "killing it" in r.getMessage()]
    assert killed == [f"policy replica {i} did not stop within 1s; killing it" for i in (0, 1)]
    with pytest.raises(ValueError, match=r"^replicas must be >= 1, got 0$"):
        ReplicatedBackend(slow_pid_echo, 0)


def test_new_weights_skip_a_replica_that_died_and_fail_when_none_is_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend, _ = build_backend(PolicySpec("HalfCheetah-v5", "mlp", seed=3, replicas=2))
    try:
        single, _ = build_backend(PolicySpec("HalfCheetah-v5", "mlp", seed=3))
        weights = {k: v.detach().numpy().copy() for k, v in single.policy.state_dict().items()}
        single.close()
        weights["actor_log_std"][:] = -30.0
        backend._replicas[1].proc.kill()
        backend._replicas[1].proc.wait()
        backend.load_weights(weights, 5)
        assert backend.version == 5 and backend.replicas == 1  # the one alive took them
        assert "policy replica 1 exited; 1 of 2 serve on" in caplog.messages
        # the dead one, still in the queue of free replicas, is not handed to a batch (it was,
        # and failed the batch with "exited")
        first = backend.infer(OBS).actions
        np.testing.assert_allclose(backend.infer(OBS).actions, first, atol=1e-5)  # no noise left
        backend._replicas[0].proc.kill()
        backend._replicas[0].proc.wait()
        with pytest.raises(ReplicaError, match=r"^no policy replica is alive$"):
            backend.load_weights(weights, 6)
        assert backend.version == 5
    finally:
        backend.close()


def test_a_forward_pass_that_raises_in_a_replica_fails_its_caller_and_the_replica_serves_on() -> None:
    backend = ReplicatedBackend(broken_pid_echo, 1)
    pid = backend._replicas[0].proc.pid
    try:
        with pytest.raises(RuntimeError, match=r"^cannot act on 1$"):  # as the replica raised it
            backend.infer(np.ones((2, 4), np.float32))
        # an error that cannot travel back is named in one that can
        named = "policy replica: RuntimeError('cannot act on 2') (cannot pickle '_thread.lock' object)"
        with pytest.raises(RuntimeError, match=f"^{re.escape(named)}$"):
            backend.infer(np.full((2, 4), 2.0, np.float32))
        assert backend.replicas == 1  # neither failure cost the replica its place
        assert backend.infer(np.zeros((3, 4), np.float32)).log_probs.tolist() == [pid] * 3
    finally:
        backend.close()
    backend.close()  # a second close does nothing
    assert backend._replicas[0].proc.returncode == 0


def test_edgerl_serve_with_replicas_serves_and_stops_them_on_sigint() -> None:
    with serving("--replicas", "2") as (proc, line):
        assert "serving HalfCheetah-v5 on" in line, line
        address = line.split()[-1]
        children = child_pids(proc.pid)
        assert len(children) == 2  # one process per replica

        async def act() -> tuple[str, Any]:
            async with EdgeClient(address, timeout_s=30.0) as c:
                backend = (await c.describe()).backend
            return backend, await act_once(address, OBS, session_id="x")

        backend, answer = asyncio.run(act())
        assert backend == "torch-mlp-x2" and answer.actions.shape == (5, 6)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]  # stopped with the server


def test_replicas_leave_ctrl_c_sigterm_and_a_hangup_to_their_server() -> None:
    """Ctrl-C, a terminal's hangup, and the SIGTERM of ``timeout`` or ``systemctl stop``, reach
    every process of ``edgerl serve --replicas N`` at once. The server answers them by finishing
    its running batches, on its replicas, then closing them: a replica that ended on the signal at
    once failed those batches."""
    backend, _ = build_backend(PolicySpec("InvertedPendulum-v5", "mlp-small", replicas=2))
    assert isinstance(backend, ReplicatedBackend)
    procs = [r.proc for r in backend._replicas]
    try:
        for proc in procs:
            for sig in STOP_SIGNALS:
                proc.send_signal(sig)
        time.sleep(0.5)
        assert [proc.poll() for proc in procs] == [None, None]
        obs = np.zeros((3, 4), np.float32)
        assert [backend.infer(obs).actions.shape for _ in procs] == [(3, 1), (3, 1)]  # one call each
    finally:
        backend.close()
    assert [proc.returncode for proc in procs] == [0, 0]  # closed by their server, not by a signal


@pytest.mark.parametrize("how", ["stop", "signal"])
def test_a_standby_server_stopped_before_activation_closes_its_backend(how: str) -> None:
    """The robot bench's spare server waits built and warm; stopped before it is activated (the
    bench interrupted, or its outage cut short) it closes its backend: here the replica processes,
    for a vLLM backend its engine and weights folder. So it does on the signal it sends itself once
    its parent is gone; the SIGTERM a process manager sends every process of the bench (or
    Ctrl-C, or a hangup) is the bench's, and the server and its replicas wait for it."""
    server = ServerProcess(PolicySpec("InvertedPendulum-v5", "mlp-small", replicas=2))
    server.start(standby=True)
    proc = server._proc
    try:
        replicas = child_pids(proc.pid)
        assert len(replicas) == 2
        if how == "signal":
            for pid in (proc.pid, *replicas):
                for sig in STOP_SIGNALS:
                    os.kill(pid, sig)
            proc.join(1.0)
            assert proc.exitcode is None and all(Path(f"/proc/{r}").exists() for r in replicas)
            os.kill(proc.pid, OWNER_STOP)
            proc.join(60)
    finally:
        server.stop()
    assert proc.exitcode == 0  # it closed its backend and ended, not killed by the signal

    def alive() -> list[int]:
        return [r for r in replicas if Path(f"/proc/{r}").exists()]

    assert wait_until(lambda: not alive(), timeout_s=10), alive()
