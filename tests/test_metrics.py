"""The Prometheus endpoints: ``GET /metrics`` beside the edge server's gRPC, and in ``edgerl robot``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from edgerl.edge_server import metrics
from edgerl.edge_server.policy import TorchPolicyBackend
from edgerl.edge_server.server import BindError, EdgeServer, ServerConfig, package_version
from edgerl.launch import run_metrics
from edgerl.launch.cli import main as edgerl_main
from edgerl.launch.processes import PolicySpec, ServerProcess, WorkerFleet
from edgerl.launch.run_metrics import FleetFigures, TrainerFigures, scalar_name
from edgerl.models import build_policy
from edgerl.proto.v1 import edge_pb2 as pb
from edgerl.robot_client.client import EdgeClient
from edgerl.robot_client.sim_worker import SimWorkerConfig
from edgerl.sim.envs import env_spec
from edgerl.trainer.trainer import TrainerState
from tests.helpers import (
    EDGERL,
    EchoPolicy,
    ServerThread,
    act_once,
    free_port,
    run,
    running_server,
    serving,
    wait_until,
)

STATS_FIELDS = [f.name for f in pb.StatsResponse.DESCRIPTOR.fields]
HALF_CHEETAH = env_spec("HalfCheetah-v5")


def samples(text: str) -> dict[tuple[str, str], float]:
    """Each sample of an exposition, parsed by Prometheus's own client: (name, quantile) -> value."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert isinstance(s, Sample)
            out[s.name, s.labels.get("quantile", "")] = s.value
    return out


def families(text: str) -> dict[str, str]:
    """Each family of an exposition and its type, as Prometheus's client parses them."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_every_stats_field_is_a_sample_of_a_family() -> None:
    lines = [
        (fam.name + sample.suffix, sample.quantile) for fam in metrics.FAMILIES for sample in fam.samples
    ]
    assert len(set(lines)) == len(lines)
    taken = {sample.field for fam in metrics.FAMILIES for sample in fam.samples}
    assert taken == set(STATS_FIELDS)  # a new Stats field needs a family
    names = [fam.name for fam in metrics.FAMILIES]
    assert len(set(names)) == len(names)
    for fam in metrics.FAMILIES:
        assert fam.kind in ("counter", "gauge", "summary")
        assert fam.name.endswith("_total") == (fam.kind == "counter"), fam.name
        assert "_us" not in fam.name and fam.name.startswith("edgerl_")  # seconds, as Prometheus has it
        seconds = [s.scale == 1e-6 for s in fam.samples if s.suffix != "_count"]
        assert all(seconds) == ("_seconds" in fam.name) == any(seconds), fam.name
    summaries = {
        fam.name: [s.field for s in fam.samples] for fam in metrics.FAMILIES if fam.kind == "summary"
    }
    assert summaries == {
        "edgerl_queue_wait_seconds": [
            "queue_wait_us_p50",
            "queue_wait_us_p99",
            "queue_wait_us_sum",
            "requests",
        ],
        "edgerl_inference_seconds": ["inference_us_p50", "inference_us_p99", "inference_us_sum", "batches"],
    }


def test_the_exposition_carries_each_stats_value_as_prometheus_parses_it() -> None:
    stats = pb.StatsResponse(**{name: 1000 * (i + 1) + 7 for i, name in enumerate(STATS_FIELDS)})
    info = {"version": "1.2.3", "env": 'odd "env"\\ with\nnewline', "backend": "mlp"}
    text = metrics.exposition(stats, learner=True, info=info)
    got = samples(text)
    for fam in metrics.FAMILIES:
        for sample in fam.samples:
            want = getattr(stats, sample.field) * sample.scale
            assert got[fam.name + sample.suffix, sample.quantile] == pytest.approx(want), fam.name
    assert got["edgerl_queue_wait_seconds", "0.99"] == pytest.approx(stats.queue_wait_us_p99 / 1e6)
    assert got["edgerl_queue_wait_seconds_sum", ""] == pytest.approx(stats.queue_wait_us_sum / 1e6)
    assert got["edgerl_queue_wait_seconds_count", ""] == stats.requests
    assert got["edgerl_inference_seconds_count", ""] == stats.batches
    assert got["edgerl_backpressure_wait_seconds_total", ""] == pytest.approx(
        stats.backpressure_wait_us / 1e6
    )
    (info_family,) = [f for f in text_string_to_metric_families(text) if f.name == "edgerl_server_info"]
    assert info_family.samples[0].labels == info  # quotes, backslashes and newlines come back as sent
    kinds = families(text)
    assert kinds["edgerl_rows"] == "counter"  # the parser strips _total from a counter's family
    assert (kinds["edgerl_active_streams"], kinds["edgerl_queue_wait_seconds"]) == ("gauge", "summary")

    served_alone = samples(metrics.exposition(stats, learner=False, info=info))
    learner_names = {fam.name for fam in metrics.FAMILIES if fam.learner}
    assert learner_names and not learner_names & {name for name, _ in served_alone}
    assert ("edgerl_rows_total", "") in served_alone


DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json"
ALERTS = DASHBOARD.with_name("prometheus-alerts.yml")


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def queried_names(*, robots: bool) -> set[str]:
    """The metric names that the Grafana dashboard's queries and the alerting rules use: those of
    ``edgerl robot`` or the others."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    exprs += [rule["expr"] for rule in alert_rules()]
    names = {name for expr in exprs for name in re.findall(r"\bedgerl_[a-z0-9_]+", expr)}
    return {name for name in names if name.startswith("edgerl_robot_") == robots}


def test_the_alerting_rules_are_prometheus_rules() -> None:
    rules = alert_rules()
    assert len(rules) >= 8 and len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"Edgerl[A-Za-z]+", rule["alert"])
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s")), rule["alert"]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
    # the robots' thresholds are the project's targets: fallbacks under 0.1 %, jitter p99 under 2 ms
    exprs = {r["alert"]: r["expr"] for r in rules}
    assert exprs["EdgerlRobotFallingBack"].endswith("> 0.001")
    assert exprs["EdgerlRobotTickJitter"] == 'edgerl_robot_tick_jitter_seconds{quantile="0.99"} > 0.002'


def test_the_grafana_dashboard_is_one_grafana_imports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "edgerl" and dashboard["schemaVersion"] >= 36
    (source,) = dashboard["templating"]["list"]
    assert (source["type"], source["query"], source["name"]) == ("datasource", "prometheus", "datasource")
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)  # Grafana keys panels by id
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 20 and {p["type"] for p in graphs} == {"timeseries"}
    for panel in graphs:
        where = panel["gridPos"]
        assert where["x"] + where["w"] <= 24 and where["h"] > 0, panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        assert all("edgerl_" in t["expr"] for t in panel["targets"]), panel["title"]
    # no two panels on one spot: each row of the grid filled left to right
    spots = [(p["gridPos"]["y"], p["gridPos"]["x"]) for p in panels]
    assert len(set(spots)) == len(spots)


def scrape(url: str, method: str = "GET") -> tuple[int, dict[str, str], str]:
    """Status, headers and body of one HTTP request."""
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


async def scraped(url: str, method: str = "GET") -> tuple[int, dict[str, str], str]:
    return await asyncio.get_running_loop().run_in_executor(None, scrape, url, method)


async def raw(port: int, data: bytes, *, read: bool = True) -> bytes:
    """What the metrics port answers to ``data`` sent as is, read to its end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10) if read else b""
    writer.close()
    await writer.wait_closed()
    return answer


def test_a_real_server_serves_its_stats_counters_on_get_metrics() -> None:
    spec = HALF_CHEETAH
    net = build_policy("mlp-small", spec.obs_shape[0], spec.act_shape[0], seed=1)
    backend = TorchPolicyBackend(net, spec.act_low, spec.act_high)

    async def main() -> None:
        async with running_server(backend, env_name="HalfCheetah-v5", metrics_port=0) as server:
            assert server.metrics_port > 0 and server.metrics_port != server.port
            assert server.metrics_url == f"http://127.0.0.1:{server.metrics_port}/metrics"
            await act_once(server.address, np.zeros((3, 17), np.float32))
            await act_once(server.address, np.ones((5, 17), np.float32), session_id="other")
            status, headers, body = await scraped(server.metrics_url)
            assert status == 200
            assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            got = samples(body)
            assert got["edgerl_requests_total", ""] == 2
            assert got["edgerl_rows_total", ""] == 8
            assert got["edgerl_active_streams", ""] == 0
            assert got["edgerl_inference_seconds", "0.5"] > 0
            assert got["edgerl_queue_wait_seconds_count", ""] == 2  # one per request
            assert got["edgerl_inference_seconds_count", ""] == got["edgerl_batches_total", ""]
            # the sums count every request and batch (all of them still in the windows here)
            st = server.batcher.stats
            assert got["edgerl_queue_wait_seconds_sum", ""] == pytest.approx(sum(st.queue_wait_us) / 1e6)
            assert got["edgerl_inference_seconds_sum", ""] == pytest.approx(sum(st.inference_us) / 1e6)
            assert got["edgerl_inference_seconds_sum", ""] > 0
            assert ("edgerl_transitions_total", "") not in got  # no learner here
            (info,) = [f for f in text_string_to_metric_families(body) if f.name == "edgerl_server_info"]
            assert info.samples[0].labels == {
                "version": package_version(),
                "env": "HalfCheetah-v5",
                "backend": backend.name,
            }
            async with EdgeClient(server.address) as client:  # a stream open while it is scraped
                await client.open_stream(session_id="open", num_envs=2, obs_shape=(17,))
                assert samples((await scraped(server.metrics_url))[2])["edgerl_active_streams", ""] == 1
            head = await scraped(server.metrics_url, "HEAD")
            assert head[0] == 200 and head[2] == "" and int(head[1]["Content-Length"]) > 1000

    run(main())


def test_bad_requests_get_their_status_and_the_server_serves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "READ_TIMEOUT_S", 0.3)
    obs = np.zeros((2, 4), np.float32)

    async def main() -> None:
        async with running_server(EchoPolicy(obs_dim=4, act_dim=2), metrics_port=0) as server:
            base = server.metrics_url.removesuffix("/metrics")
            status, _, body = await scraped(base + "/")
            assert (status, body) == (404, "no / here: the metrics are at /metrics\n")
            status, headers, body = await scraped(server.metrics_url, "POST")
            assert (status, headers["Allow"], body) == (405, "GET, HEAD", "method POST: only GET and HEAD\n")
            port = server.metrics_port
            answer = await raw(port, b"nonsense\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
            assert answer.endswith(b"expected 'GET /metrics HTTP/1.1'\n")
            big = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * metrics.MAX_HEAD_BYTES + b"\r\n\r\n"
            answer = await raw(port, big)
            assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
            assert answer.endswith(b"request line and headers over 8192 bytes\n")
            start = time.monotonic()  # a client that connects and sends nothing is let go
            assert await raw(port, b"GET /metrics HTTP/1.1\r\n") == b""
            assert 0.25 < time.monotonic() - start < 5
            await raw(port, b"GET /met", read=False)  # one that goes away mid-request
            await act_once(server.address, obs)  # gRPC is served meanwhile ...
            got = samples((await scraped(server.metrics_url))[2])  # ... and so is the next scrape
            assert got["edgerl_requests_total", ""] == 1

    run(main())


def test_a_scrape_that_fails_is_a_500_naming_why_and_the_next_is_served(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with running_server(EchoPolicy(obs_dim=4, act_dim=2), metrics_port=0) as server:
            stats = server.servicer.stats
            calls = iter([RuntimeError("a counter broke")])

            def failing_once() -> pb.StatsResponse:
                fault = next(calls, None)
                if fault is not None:
                    raise fault
                return stats()

            monkeypatch.setattr(server.servicer, "stats", failing_once)
            with caplog.at_level(logging.ERROR, logger="edgerl.edge_server.metrics"):
                status, _, body = await scraped(server.metrics_url)
            assert (status, body) == (500, "rendering the metrics failed: RuntimeError: a counter broke\n")
            assert "metrics: rendering failed" in caplog.text and "a counter broke" in caplog.text
            assert (await scraped(server.metrics_url))[0] == 200

    run(main())


def test_a_taken_metrics_port_is_a_bind_error_and_nothing_is_held() -> None:
    async def main() -> None:
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        grpc_port = free_port()
        config = ServerConfig(port=grpc_port, metrics_port=taken.getsockname()[1])
        server = EdgeServer(EchoPolicy(obs_dim=4, act_dim=2), config)
        with pytest.raises(
            BindError,
            match=r"could not bind the metrics port 127\.0\.0\.1:\d+: the port is in use \(--metrics-port 0",
        ):
            await server.start()
        taken.close()
        assert server.batcher.closing  # its inference thread stopped
        again = EdgeServer(EchoPolicy(obs_dim=4, act_dim=2), ServerConfig(port=grpc_port))
        assert await again.start() == grpc_port  # the gRPC port was never bound
        assert again.metrics is None and again.metrics_url == "" and again.metrics_port == 0
        await again.stop(grace_s=0)

        # the metrics port bound, the gRPC port taken: the metrics port is let go too
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = ServerConfig(port=taken.getsockname()[1], metrics_port=0)
        server = EdgeServer(EchoPolicy(obs_dim=4, act_dim=2), config)
        with pytest.raises(BindError, match=r"could not bind 127\.0\.0\.1:\d+: the port is in use"):
            await server.start()
        taken.close()
        assert server.metrics_port > 0
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", server.metrics_port)

    run(main())


def test_stopping_the_server_closes_the_metrics_port_with_a_connection_open() -> None:
    async def main() -> None:
        server = EdgeServer(EchoPolicy(obs_dim=4, act_dim=2), ServerConfig(port=0, metrics_port=0))
        await server.start()
        port = server.metrics_port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\n")  # and not the rest: its handler waits
        await writer.drain()
        start = time.monotonic()
        await server.stop(grace_s=0.5)
        assert time.monotonic() - start < metrics.READ_TIMEOUT_S / 2
        assert await asyncio.wait_for(reader.read(), 5) == b""  # its connection ended, unanswered
        writer.close()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)

    run(main())


def test_the_metrics_port_is_checked_with_the_config() -> None:
    with pytest.raises(ValueError, match=r"metrics_port must be in \[0, 65535\], got 70000"):
        ServerConfig(metrics_port=70000)
    assert ServerConfig().metrics_port is None  # off by default
    with pytest.raises(
        ValueError, match="metrics_port and port are both 50051: the metrics need a port of their own"
    ):
        ServerConfig(port=50051, metrics_port=50051)
    assert ServerConfig(port=0, metrics_port=0).metrics_port == 0  # each a free port of its own


def test_the_metrics_bind_a_host_of_their_own_where_asked() -> None:
    async def main() -> None:
        config = ServerConfig(port=0, metrics_port=0, metrics_host="127.0.0.2")  # loopback, another address
        server = EdgeServer(EchoPolicy(obs_dim=4, act_dim=2), config)
        await server.start()
        try:
            assert server.address.startswith("127.0.0.1:")
            assert server.metrics_url == f"http://127.0.0.2:{server.metrics_port}/metrics"
            assert (await scraped(server.metrics_url))[0] == 200
            with pytest.raises(ConnectionRefusedError):  # not on the gRPC port's host
                await asyncio.open_connection("127.0.0.1", server.metrics_port)
        finally:
            await server.stop(grace_s=0)
        config = ServerConfig(port=0, metrics_port=0, metrics_host="192.0.2.1")  # TEST-NET-1: no one's
        server = EdgeServer(EchoPolicy(obs_dim=4, act_dim=2), config)
        with pytest.raises(
            BindError, match=r"192\.0\.2\.1 is not an address of this machine \(--metrics-host\)"
        ):
            await server.start()

    run(main())
    with pytest.raises(ValueError, match=r"metrics_host is '0\.0\.0\.0' but metrics_port is None"):
        ServerConfig(metrics_host="0.0.0.0")


@pytest.mark.parametrize(
    "command", ["serve", "rollout", "train", "robot --server 127.0.0.1:1", "sim --server 127.0.0.1:1"]
)
def test_metrics_host_without_a_metrics_port_is_refused(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        edgerl_main([*command.split(), "--metrics-host", "0.0.0.0"])
    assert exit_.value.code == 2
    assert "error: argument --metrics-host: needs --metrics-port" in capsys.readouterr().err


def test_a_server_process_comes_back_on_its_metrics_port() -> None:
    server = ServerProcess(
        PolicySpec("InvertedPendulum-v5", "mlp-small"), ServerConfig(port=0, metrics_port=0)
    )
    with server:
        port = server.metrics_port
        assert port > 0 and server.metrics_url == f"http://127.0.0.1:{port}/metrics"
        asyncio.run(act_once(server.address, np.zeros((2, 4), np.float32)))
        assert samples(scrape(server.metrics_url)[2])["edgerl_requests_total", ""] == 1
        server.kill()
        with pytest.raises(OSError):
            scrape(server.metrics_url)
        server.start()
        assert server.metrics_port == port  # where the scrape config points
        assert samples(scrape(server.metrics_url)[2])["edgerl_requests_total", ""] == 0  # a new process
    plain = ServerProcess(PolicySpec("InvertedPendulum-v5", "mlp-small"))
    with plain:
        assert (plain.metrics_port, plain.metrics_url) == (0, "")


def scrape_until(
    url: str, proc: subprocess.Popen[Any], ready: Callable[[dict[tuple[str, str], float]], bool]
) -> dict[tuple[str, str], float]:
    """The first scrape of ``url`` whose samples are ``ready``, while ``proc`` runs (60 s at most)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the command ended before its counters were scraped"
        with contextlib.suppress(OSError):
            status, _, body = scrape(url)
            if status == 200 and ready(got := samples(body)):
                return got
        time.sleep(0.2)
    raise AssertionError(f"{url}: not ready in 60 s")


def test_edgerl_rollout_serves_its_servers_counters_while_it_runs(tmp_path: Path) -> None:
    out = tmp_path / "rollout.json"
    command = [*EDGERL, "rollout", "--env", "InvertedPendulum-v5", "--envs", "8", "--workers", "1",
               "--seconds", "8", "--metrics-port", "0", "--json", str(out)]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("edgerl: edge server on 127.0.0.1:")
        line = proc.stdout.readline().strip()
        assert re.fullmatch(r"edgerl: metrics on http://127\.0\.0\.1:\d+/metrics", line), line
        url = line.split()[-1]
        got = scrape_until(
            url,
            proc,
            lambda got: got["edgerl_requests_total", ""] >= 50 and ("edgerl_sim_episodes_total", "") in got,
        )
        proc.stdout.read()
        assert proc.wait(timeout=120) == 0
    summary = json.loads(out.read_text())
    served = summary["server"]
    assert 50 <= got["edgerl_requests_total", ""] < served["requests"]  # live, then the run went on
    assert got["edgerl_failed_requests_total", ""] == served["failed_requests"] == 0
    assert ("edgerl_transitions_total", "") not in got  # a rollout does not learn
    # the sim workers' figures after the server's: one worker, its steps live
    assert got["edgerl_sim_workers_running", ""] == 1
    assert 0 < got["edgerl_sim_env_steps_total", ""] < summary["env_steps"]
    assert got["edgerl_sim_episodes_total", ""] <= summary["episodes"]
    with pytest.raises(OSError):  # the run ended: its server's port with it
        scrape(url)


def test_edgerl_sim_serves_its_workers_figures_while_it_runs() -> None:
    spec = env_spec("InvertedPendulum-v5")
    backend = TorchPolicyBackend(build_policy("mlp-small", 4, 1, seed=1), spec.act_low, spec.act_high)
    with ServerThread(backend, env_name="InvertedPendulum-v5") as server:
        command = [*EDGERL, "sim", "--server", server.address, "--env", "InvertedPendulum-v5", "--envs", "4",
                   "--workers", "2", "--seconds", "6", "--metrics-port", "0"]  # fmt: skip
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            assert re.fullmatch(r"edgerl: metrics on http://127\.0\.0\.1:\d+/metrics", line), line
            url = line.split()[-1]
            got = scrape_until(url, proc, lambda got: got.get(("edgerl_sim_episodes_total", ""), 0) >= 1)
            body = scrape(url)[2]
            printed = proc.stdout.read()
            assert proc.wait(timeout=120) == 0
        served = server.in_loop(lambda: server.server.servicer.stats() if server.server else None)
    assert not any(name.startswith("edgerl_requests") for name, _ in got)  # its server is not its own
    assert got["edgerl_sim_workers_running", ""] == 2
    steps = labelled(body, "edgerl_sim_env_steps_total")
    assert set(steps) == {(("worker", "0"),), (("worker", "1"),)} and min(steps.values()) > 0
    (info,) = [f for f in text_string_to_metric_families(body) if f.name == "edgerl_sim_info"]
    assert info.samples[0].labels == {"env": "InvertedPendulum-v5", "envs": "4", "workers": "2"}
    summary = dict(
        row.split(maxsplit=1) for row in printed.splitlines() if row.startswith(("env_steps", "episodes"))
    )
    assert sum(steps.values()) <= int(summary["env_steps"])  # scraped mid-run
    assert got["edgerl_sim_episodes_total", ""] <= int(summary["episodes"])
    assert isinstance(served, pb.StatsResponse) and served.rows >= int(summary["env_steps"])
    with pytest.raises(OSError):  # the command ended: its metrics port with it
        scrape(url)


@pytest.mark.parametrize("command", ["sim --server 127.0.0.1:1 --envs 2", "rollout --envs 2 --seconds 5"])
def test_a_taken_metrics_port_ends_sim_and_rollout_with_its_reason(command: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [*EDGERL, *command.split(), "--env", "InvertedPendulum-v5", "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"edgerl: error: could not bind the metrics port 127.0.0.1:{port}: the port is in use "
        "(--metrics-port 0 picks a free one)"
    )
    assert "env_steps" not in out.stdout  # no run


def test_edgerl_train_serves_the_learners_counters_while_it_runs(tmp_path: Path) -> None:
    port, out, err = free_port(), tmp_path / "train.json", tmp_path / "stderr.txt"
    url = f"http://127.0.0.1:{port}/metrics"
    command = [*EDGERL, "train", "--envs", "4", "--segment-steps", "16", "--steps", "4000", "--run-dir",
               str(tmp_path / "run"), "--metrics-port", str(port), "--json", str(out)]  # fmt: skip
    with err.open("w") as stderr, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr) as proc:
        got = scrape_until(url, proc, lambda got: got.get(("edgerl_train_updates_total", ""), 0) >= 2)
        assert proc.wait(timeout=600) == 0
    summary = json.loads(out.read_text())
    assert f"edgerl: metrics on {url}" in err.read_text().splitlines()
    publishes = got["edgerl_weight_publishes_total", ""]
    assert got["edgerl_policy_version", ""] == publishes <= summary["policy_version"]
    # each publish follows a batch of 4 x 16 transitions the trainer acknowledged
    assert got["edgerl_transitions_total", ""] >= 64 * publishes
    assert got["edgerl_segments_acked_total", ""] >= 4 * publishes
    with pytest.raises(OSError):
        scrape(url)
    assert got["edgerl_sim_workers_running", ""] == 1  # the sim workers' figures
    assert 0 < got["edgerl_sim_env_steps_total", ""] <= summary["worker_steps"][0]
    queried = queried_names(robots=False)  # the dashboard's and alerts' others: all a training run's
    assert len(queried) >= 25 and queried <= {name for name, _ in got}, queried - {name for name, _ in got}
    # the trainer's figures are those of one update: its line in metrics.jsonl
    updates = int(got["edgerl_train_updates_total", ""])
    assert 2 <= updates <= summary["updates"] and updates <= publishes + 1  # the scrape's two parts
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    logged = json.loads(lines[updates - 1])
    assert got["edgerl_train_env_steps_total", ""] == logged["global_step"] == 64 * updates
    assert logged["time"] <= got["edgerl_train_last_update_timestamp_seconds", ""] <= logged["time"] + 5
    shown = {key: value for key, value in logged.items() if key not in ("global_step", "time")}
    assert {"losses/approx_kl", "staleness/lag_mean", "charts/policy_version"} <= shown.keys()
    for key, value in shown.items():
        name = scalar_name(key)
        if key.startswith("server/"):
            assert (name, "") not in got  # the server's families carry them
        elif value is None:  # NaN in the file is null
            assert math.isnan(got[name, ""]), key
        else:
            assert got[name, ""] == value, key


def labelled(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of family ``name`` in an exposition, by their labels (sorted pairs)."""
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


@contextlib.contextmanager
def command_metrics(server_url: str, own: Callable[[], str]) -> Iterator[str]:
    """A command's ``GET /metrics`` on a free loopback port for the block; yields its URL."""
    said: list[str] = []
    with run_metrics.serving("127.0.0.1", 0, server_url, own, said.append):
        (line,) = said
        assert line.startswith("metrics on http://127.0.0.1:")
        yield line.split()[-1]


def test_a_training_runs_figures_follow_its_servers_and_its_last_update() -> None:
    info = {"env": "InvertedPendulum-v5", "policy": "mlp-small", "mode": "async"}
    figures = TrainerFigures(info)
    with ServerThread(EchoPolicy(obs_dim=4, act_dim=1), metrics_port=free_port()) as server:
        assert server.server is not None
        server_url = server.server.metrics_url
        with command_metrics(server_url, figures.exposition) as url:
            status, _, body = scrape(url)
            assert status == 200
            got = samples(body)
            assert got["edgerl_requests_total", ""] == 0
            (served,) = [f for f in text_string_to_metric_families(body) if f.name == "edgerl_server_info"]
            assert served.samples[0].labels["backend"] == "echo"  # the server's exposition, then the run's
            assert labelled(body, "edgerl_train_info") == {tuple(sorted(info.items())): 1}
            assert not any(name.startswith("edgerl_train_") for name, _ in got if name != "edgerl_train_info")

            # a resumed run: its counters first appear at its checkpoint's values, not at 0
            state = TrainerState(version=2, updates=2, env_steps=128, masked_stale=5, masked_fallback=1,
                                 masked_autoreset=2, wall_s=9.5)  # fmt: skip
            figures.begin(state)
            got = samples(scrape(url)[2])
            assert got["edgerl_train_updates_total", ""] == 2
            assert got["edgerl_train_env_steps_total", ""] == 128
            assert ("edgerl_train_last_update_timestamp_seconds", "") not in got  # no update yet
            assert ("edgerl_train_losses_approx_kl", "") not in got

            state.version, state.updates, state.env_steps = 3, 3, 192
            scalars = {"losses/approx_kl": 0.0123, "losses/explained_variance": math.nan,
                       "charts/episodic_return": 41.5, "server/transitions_pending": 7.0}  # fmt: skip
            before = time.time()
            figures.on_update(state, scalars)
            state.updates = 4  # the trainer's next update, not yet handed over
            got = samples(scrape(url)[2])
            assert got["edgerl_train_updates_total", ""] == 3
            assert got["edgerl_train_env_steps_total", ""] == 192
            assert got["edgerl_train_masked_stale_total", ""] == 5
            assert got["edgerl_train_masked_fallback_total", ""] == 1
            assert got["edgerl_train_masked_autoreset_total", ""] == 2
            assert got["edgerl_train_losses_approx_kl", ""] == 0.0123
            assert math.isnan(got["edgerl_train_losses_explained_variance", ""])
            assert got["edgerl_train_charts_episodic_return", ""] == 41.5
            assert not any(name.startswith("edgerl_train_server") for name, _ in got)  # the server's own
            assert before <= got["edgerl_train_last_update_timestamp_seconds", ""] <= time.time()

            server.kill()  # the run's server is gone: the scrape says so, the endpoint serves on
            status, _, body = scrape(url)
            assert status == 500
            assert f"the server did not answer at {server_url}" in body
            server.restart()  # on the same metrics port
            got = samples(scrape(url)[2])
            assert (got["edgerl_requests_total", ""], got["edgerl_train_updates_total", ""]) == (0, 3)


def test_a_fleets_figures_count_each_workers_steps_and_its_episodes() -> None:
    info = {"env": "InvertedPendulum-v5", "envs": "4", "workers": "2"}
    figures = FleetFigures(info)
    with command_metrics("", figures.exposition) as url:  # no server of the command's own (edgerl sim)
        body = scrape(url)[2]
        assert [f.name for f in text_string_to_metric_families(body)] == ["edgerl_sim_info"]  # no fleet yet
        spec = env_spec("InvertedPendulum-v5")
        backend = TorchPolicyBackend(build_policy("mlp-small", 4, 1, seed=1), spec.act_low, spec.act_high)
        with ServerThread(backend, env_name="InvertedPendulum-v5") as server:
            config = SimWorkerConfig(server=server.address, env_name="InvertedPendulum-v5", num_envs=4)
            with WorkerFleet(config, 2) as fleet:
                figures.attach(fleet)
                steps = labelled(scrape(url)[2], "edgerl_sim_env_steps_total")
                assert set(steps) == {(("worker", "0"),), (("worker", "1"),)}
                assert ("edgerl_sim_workers_running", "") not in samples(scrape(url)[2])  # not looked at yet
                fleet.wait_started()

                def three_episodes() -> bool:
                    fleet.poll_episodes()
                    return fleet.episodes.count >= 3

                wait_until(three_episodes, 60)
                figures.look()
                got = samples(body := scrape(url)[2])
                steps = labelled(body, "edgerl_sim_env_steps_total")
                last = fleet.episodes.last_returns(20)  # as looked at: stopping takes the last ones in
                fleet.stop()
                assert all(steps[("worker", str(i)),] > 0 for i in range(2))
                assert sum(steps.values()) <= fleet.total_steps()  # live: the fleet went on after
                assert got["edgerl_sim_workers_running", ""] == 2
                assert got["edgerl_sim_episodes_total", ""] >= 3
                assert got["edgerl_sim_return_last20", ""] == pytest.approx(sum(last) / len(last))
                figures.look()  # the workers have stopped
                assert samples(scrape(url)[2])["edgerl_sim_workers_running", ""] == 0


def test_edgerl_serve_metrics_port_says_where_and_serves_prometheus() -> None:
    with serving("--metrics-port", "0", "--metrics-host", "127.0.0.2") as (proc, first):
        assert proc.stdout is not None
        assert first.startswith("edgerl: serving HalfCheetah-v5 on 127.0.0.1:")
        proc.stdout.readline()  # the policy line
        line = proc.stdout.readline().strip()
        assert line.startswith("edgerl: metrics on http://127.0.0.2:") and line.endswith("/metrics")
        url = line.split()[-1]
        asyncio.run(act_once(first.split()[-1], np.zeros((4, 17), np.float32)))
        status, _, body = scrape(url)
        assert status == 200
        got = samples(body)
        assert (got["edgerl_requests_total", ""], got["edgerl_rows_total", ""]) == (1, 4)
        assert got["edgerl_policy_version", ""] == 0


def test_a_robot_host_s_counters_are_labelled_by_robot_and_parse() -> None:
    from edgerl.launch.robot import ROBOT_METRICS, robot_exposition

    counters = [(key, name) for key, name, kind, _ in ROBOT_METRICS if kind == "counter"]
    gauges = [(key, name) for key, name, kind, _ in ROBOT_METRICS if kind == "gauge"]

    def robot(name: str, ticks: int, latency_ms: float) -> dict[str, object]:
        values = {key: ticks + i for i, (key, _) in enumerate(counters)}
        flags = {"estopped": ticks > 100, "policy_version": 7, "max_consecutive_fallbacks": 3}
        times = {
            f"{stem}_p{p}": latency_ms * p for stem in ("tick_jitter_ms", "action_age_ms") for p in (50, 99)
        }
        return {
            "robot": name,
            **values,
            **flags,
            **times,
            "latency_ms_p50": latency_ms,
            "latency_ms_p99": 2.0,
        }

    stats = [robot("arm-left", 10, 1.5), robot("", 200, float("nan"))]  # no name: its index
    stream = {"connected": False, "reconnects": 3, "messages": 123, "network_restarts": 1}
    got = {}
    for family in text_string_to_metric_families(robot_exposition(stats, stream)):
        for s in family.samples:
            got[s.name, s.labels.get("robot", ""), s.labels.get("quantile", "")] = s.value
    for i, (_, name) in enumerate(counters):
        assert (got[name, "arm-left", ""], got[name, "1", ""]) == (10 + i, 200 + i), name
    assert [got[name, "1", ""] for _, name in gauges] == [1, 7, 3]  # e-stopped: 1
    assert got["edgerl_robot_estopped", "arm-left", ""] == 0
    assert got["edgerl_robot_latency_seconds", "arm-left", "0.5"] == pytest.approx(0.0015)
    assert math.isnan(got["edgerl_robot_latency_seconds", "1", "0.5"])  # no answer yet
    assert got["edgerl_robot_tick_jitter_seconds", "arm-left", "0.99"] == pytest.approx(1.5 * 99 / 1e3)
    assert got["edgerl_robot_stream_up", "", ""] == 0
    assert got["edgerl_robot_stream_reconnects_total", "", ""] == 3
    assert got["edgerl_robot_network_restarts_total", "", ""] == 1


def _robot_backend() -> TorchPolicyBackend:
    spec = env_spec("InvertedPendulum-v5")
    net = build_policy("mlp-small", spec.obs_shape[0], spec.act_shape[0], seed=0)
    return TorchPolicyBackend(net, spec.act_low, spec.act_high)


def test_edgerl_robot_serves_its_robots_counters_while_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port, out = free_port(), tmp_path / "robot.json"
    url = f"http://127.0.0.1:{port}/metrics"
    scrapes: list[dict[tuple[str, str], float]] = []
    seen: set[str] = set()  # the names of every sample scraped

    def scraper() -> None:  # the command runs on the main thread (it takes signals)
        deadline = time.monotonic() + 60
        while len(scrapes) < 2 and time.monotonic() < deadline:
            time.sleep(0.3)
            with contextlib.suppress(OSError):
                status, _, body = scrape(url)
                seen.update(name for name, _ in samples(body))
                got = {
                    (s.name, s.labels.get("robot", "")): s.value
                    for f in text_string_to_metric_families(body)
                    for s in f.samples
                    if not s.labels.get("quantile")
                }
                if status == 200 and got[("edgerl_robot_ticks_total", "robot-1")] >= 10:
                    scrapes.append(got)

    thread = threading.Thread(target=scraper, daemon=True)
    with ServerThread(_robot_backend()) as srv:
        thread.start()
        code = edgerl_main(
            ["robot", "--server", srv.address, "--robots", "2", "--hz", "50", "--seconds", "3",
             "--robot-arg", "env=InvertedPendulum-v5", "--metrics-port", str(port), "--json", str(out)]
        )  # fmt: skip
    thread.join(10)
    assert code == 0
    assert f"edgerl robot: metrics on {url}" in capsys.readouterr().out.splitlines()
    assert len(scrapes) == 2, "no scrape mid-run"
    first, second = scrapes
    final = json.loads(out.read_text())
    for i, robot in enumerate(final["robots"]):
        name = f"robot-{i}"
        ticks = [first["edgerl_robot_ticks_total", name], second["edgerl_robot_ticks_total", name]]
        assert 10 <= ticks[0] < ticks[1] <= robot["ticks"]  # live counters, as the JSON's at the end
        assert first["edgerl_robot_estopped", name] == 0 and first["edgerl_robot_policy_version", name] == 0
    assert first["edgerl_robot_stream_up", ""] == 1
    with pytest.raises(OSError):  # the command ended: its port with it
        urllib.request.urlopen(url, timeout=5)
    shown = queried_names(robots=True)
    assert len(shown) >= 6 and shown <= seen, shown - seen  # the dashboard's and alerts' robot names


def test_edgerl_robot_with_a_taken_metrics_port_ends_before_a_robot_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with taken, ServerThread(_robot_backend()) as srv:
        code = edgerl_main(
            ["robot", "--server", srv.address, "--hz", "50", "--seconds", "30",
             "--robot-arg", "env=InvertedPendulum-v5", "--metrics-port", str(port)]
        )  # fmt: skip
        assert srv.server is not None and srv.server.servicer.stats().requests == 0  # never stepped
    assert code == 1
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == (
        f"edgerl robot: could not bind the metrics port 127.0.0.1:{port}: the port is in use "
        "(--metrics-port 0 picks a free one)"
    )
    assert "ticks" not in out
