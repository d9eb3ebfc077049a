"""Trainer checkpoints served by ``edgerl serve --checkpoint`` / ``edgerl rollout --checkpoint``:
what a checkpoint says it holds, the options it refuses, and a real server on its weights."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edgerl.launch.checkpoints import read_checkpoint
from edgerl.launch.processes import PolicySpec, build_backend
from edgerl.models import GaussianMLPPolicy, build_policy, gaussian_log_prob
from edgerl.robot_client.client import EdgeClient
from edgerl.sim.envs import env_spec
from edgerl.trainer.config import TrainerConfig
from edgerl.trainer.runfiles import RunFilesError, os_error, writing
from edgerl.trainer.trainer import MetricsLog, Trainer, load_payload
from tests.helpers import EDGERL, random_batch, serving

CHEETAH = env_spec("HalfCheetah-v5")  # 17 observation values, 6 action values


def _trained(run_dir: Path, *, run_info: dict[str, str] | None, updates: int = 2) -> Trainer:
    """A trainer on HalfCheetah-sized ``mlp-small`` that made ``updates`` updates (one version
    each) on random batches and saved a checkpoint after each."""
    config = TrainerConfig(batch_steps=64, minibatch_size=32, epochs=1, keep_checkpoints=5)
    net = build_policy("mlp-small", 17, 6, seed=0)
    trainer = Trainer(config, net, "unused:0", run_dir, tensorboard=False, run_info=run_info)
    rng = np.random.default_rng(0)
    for _ in range(updates):
        trainer.update(random_batch(rng, 64, 17, 6))
        trainer.state.version += 1  # what a publish does
        trainer.save_checkpoint()
    return trainer


RUN_INFO = {"env": "HalfCheetah-v5", "policy": "mlp-small", "model": ""}


def test_a_checkpoint_that_cannot_be_written_fails_naming_it_and_the_last_one_stands(tmp_path: Path) -> None:
    """A checkpoint written to a full disk (``/dev/full``: every write fails with ENOSPC) is one
    error naming it, not ``torch.save``'s ``RuntimeError: [enforce fail at
    inline_container.cc:672]``, and leaves neither its half-written file nor a changed link."""
    trainer = _trained(tmp_path / "run", run_info=RUN_INFO, updates=2)
    folder = tmp_path / "run" / "checkpoints"
    before = sorted(p.name for p in folder.iterdir())
    (folder / "ckpt-00000003.tmp").symlink_to("/dev/full")
    trainer.state.version = 3
    with pytest.raises(
        RunFilesError, match=r"^cannot write .*/ckpt-00000003\.pt: \[Errno 28\] No space left on device$"
    ):
        trainer.save_checkpoint()
    assert sorted(p.name for p in folder.iterdir()) == before
    assert (folder / "latest.pt").readlink() == Path("ckpt-00000002.pt")
    assert read_checkpoint(str(tmp_path / "run")).version == 2


def test_metrics_that_cannot_be_written_fail_once_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    metrics = MetricsLog(tmp_path, tensorboard=False)
    with pytest.raises(RunFilesError, match=r"^cannot write .*/metrics\.jsonl: \[Errno 28\] No space left"):
        metrics.write(1, {"losses/value": 1.0})
    metrics.close()  # said once: the run's own error stands


def test_writing_names_the_system_error_behind_a_failed_write_and_lets_others_through() -> None:
    def chained() -> None:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("basic_ios::clear: iostream error") from None

    assert os_error(ValueError("bad")) is None
    with pytest.raises(RunFilesError, match=r"^cannot write f\.pt: \[Errno 28\] No space left on device$"):
        with writing("f.pt"):
            chained()  # as torch.save reports it: the OSError is the RuntimeError's context
    with pytest.raises(ValueError, match=r"^bad$"):
        with writing("f.pt"):
            raise ValueError("bad")


def test_a_run_folder_serves_its_newest_checkpoint_and_says_what_it_holds(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _trained(run, run_info=RUN_INFO, updates=3)
    info = read_checkpoint(str(run))
    assert Path(info.path) == run / "checkpoints" / "ckpt-00000003.pt"  # the newest of three
    assert (info.kind, info.version, info.env, info.policy) == ("mlp", 3, "HalfCheetah-v5", "mlp-small")
    assert (info.obs_dim, info.act_dim) == (17, 6)
    older = read_checkpoint(str(run / "checkpoints" / "ckpt-00000001.pt"))  # a file: that one
    assert older.version == 1 and older.env == "HalfCheetah-v5"


def test_a_copied_run_without_its_latest_link_serves_and_resumes_its_newest(tmp_path: Path) -> None:
    """``rsync -r`` leaves out the ``latest.pt`` link; the checkpoints folder itself is also taken."""
    trainer = _trained(tmp_path / "run", run_info=RUN_INFO, updates=3)
    folder = tmp_path / "run" / "checkpoints"
    (folder / "latest.pt").unlink()
    for path in (tmp_path / "run", folder):
        info = read_checkpoint(str(path))
        assert (Path(info.path).name, info.version) == ("ckpt-00000003.pt", 3), path
    resumed = Trainer(
        trainer.config, build_policy("mlp-small", 17, 6), "unused:0", tmp_path / "run", resume=True
    )
    assert resumed.state.version == 3


def test_a_checkpoint_from_before_the_run_was_recorded_names_its_preset_by_its_sizes(tmp_path: Path) -> None:
    _trained(tmp_path / "run", run_info=None)
    info = read_checkpoint(str(tmp_path / "run"))
    assert (info.env, info.policy, info.version) == ("", "mlp-small", 2)
    info.check_serves("HalfCheetah-v5", "mlp-small", CHEETAH.obs_shape, CHEETAH.act_shape)
    hopper = env_spec("Hopper-v5")  # no env recorded: the spaces still have to fit
    with pytest.raises(ValueError, match=r"--env Hopper-v5: its observations have shape \[11\]; .* has 17"):
        info.check_serves("Hopper-v5", "mlp-small", hopper.obs_shape, hopper.act_shape)


def test_options_the_checkpoint_cannot_serve_are_refused_naming_them(tmp_path: Path) -> None:
    _trained(tmp_path / "run", run_info=RUN_INFO)
    info = read_checkpoint(str(tmp_path / "run"))
    shapes = (CHEETAH.obs_shape, CHEETAH.act_shape)
    with pytest.raises(
        ValueError, match=r"^--env Ant-v5: checkpoint .*ckpt-00000002.pt was trained on HalfCheetah"
    ):
        info.check_serves("Ant-v5", "mlp-small", *shapes)
    with pytest.raises(ValueError, match=r"^--policy mlp: checkpoint .* holds policy 'mlp-small'"):
        info.check_serves("HalfCheetah-v5", "mlp", *shapes)
    with pytest.raises(ValueError, match=r"^--policy llm: checkpoint .* holds policy 'mlp-small'"):
        info.check_serves("HalfCheetah-v5", "llm", *shapes)
    # a checkpoint of no preset's sizes, from before runs were recorded, names no policy but its kind
    unnamed = dataclasses.replace(info, env="", policy="")
    with pytest.raises(ValueError, match=r"^--policy llm: checkpoint .* holds policy kind 'mlp'$"):
        unnamed.check_serves("HalfCheetah-v5", "llm", *shapes)
    with pytest.raises(ValueError, match=r"ckpt-00000002\.pt: holds a mlp policy, not a llm policy$"):
        load_payload(info.path, "llm")


def test_paths_that_hold_no_checkpoint_say_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        read_checkpoint(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="a folder without checkpoints/"):
        read_checkpoint(str(tmp_path))
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(
        ValueError, match=r"notes\.pt: not a trainer checkpoint \(not a torch.save zip archive\)$"
    ):
        read_checkpoint(str(text))
    cut = tmp_path / "cut.pt"  # a copy cut short: its zip directory, at the end, is gone
    torch.save({"policy": {}, "state": {}}, cut)
    cut.write_bytes(cut.read_bytes()[:-100])
    with pytest.raises(
        ValueError, match=r"cut\.pt: not a trainer checkpoint \(not a torch.save zip archive\)$"
    ):
        read_checkpoint(str(cut))
    other_zip = tmp_path / "notes.zip"  # a zip, but not torch.save's: torch's first line says why
    with zipfile.ZipFile(other_zip, "w") as archive:
        archive.writestr("notes.txt", "not a checkpoint\n")
    with pytest.raises(
        ValueError,
        match=r"notes\.zip: not a trainer checkpoint \(\[enforce fail .* in a subdirectory: notes\.txt\)$",
    ):
        read_checkpoint(str(other_zip))
    weights_only = tmp_path / "weights.pt"
    torch.save(build_policy("mlp-small", 17, 6).state_dict(), weights_only)
    with pytest.raises(
        ValueError, match=r"weights.pt: not a trainer checkpoint \(no policy weights and state\)"
    ):
        read_checkpoint(str(weights_only))


class _RunsCode:
    """Unpickled by a full unpickler, it creates ``marker``: what a hostile checkpoint could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_a_checkpoint_that_would_run_code_is_refused_unread(tmp_path: Path) -> None:
    trainer = _trained(tmp_path / "run", run_info=RUN_INFO)
    newest = read_checkpoint(str(tmp_path / "run")).path
    payload = torch.load(newest, weights_only=True)  # what the trainer wrote reads as plain data
    marker = tmp_path / "ran"
    torch.save({**payload, "extra": _RunsCode(marker)}, newest)
    with pytest.raises(ValueError, match=r"GLOBAL .*could run code when read: refused$"):
        read_checkpoint(str(tmp_path / "run"))  # edgerl serve / rollout --checkpoint
    with pytest.raises(ValueError, match="could run code when read: refused"):
        Trainer(trainer.config, build_policy("mlp-small", 17, 6), "unused:0", tmp_path / "run", resume=True)
    assert not marker.exists()


def _as_numpy(value: Any) -> Any:
    """``value`` with every tensor a numpy array and every int a numpy int64: what a checkpoint
    written or edited with numpy holds."""
    if isinstance(value, torch.Tensor):
        return value.numpy().copy()
    if isinstance(value, int) and not isinstance(value, bool):
        return np.int64(value)
    if isinstance(value, dict):
        return {key: _as_numpy(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_as_numpy(item) for item in value)
    return value


def _rewrite_pickle(path: Path, old: bytes, new: bytes) -> None:
    """Replaces ``old`` by ``new`` in the pickle of the torch.save archive at ``path`` (one that
    holds no tensors, whose records then need no alignment)."""
    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    (pickled,) = [name for name in entries if name.endswith("/data.pkl")]
    assert old in entries[pickled]
    entries[pickled] = entries[pickled].replace(old, new)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)


@pytest.mark.parametrize("numpy_names", ["numpy 2", "numpy 1"])
def test_a_checkpoint_holding_numpy_values_serves_and_resumes(tmp_path: Path, numpy_names: str) -> None:
    trainer = _trained(tmp_path / "run", run_info=RUN_INFO)
    newest = read_checkpoint(str(tmp_path / "run")).path
    payload = torch.load(newest, weights_only=True)
    torch.save(_as_numpy(payload), newest)
    if numpy_names == "numpy 1":  # numpy 1 pickled its arrays and scalars from numpy.core
        _rewrite_pickle(Path(newest), b"numpy._core.multiarray", b"numpy.core.multiarray")
    info = read_checkpoint(str(tmp_path / "run"))
    assert (info.version, info.env, info.obs_dim, info.act_dim) == (2, "HalfCheetah-v5", 17, 6)

    resumed = Trainer(
        trainer.config, build_policy("mlp-small", 17, 6), "unused:0", tmp_path / "run", resume=True
    )
    assert resumed.state == trainer.state and type(resumed.state.version) is int
    trained = trainer.policy.module.state_dict()
    for name, weight in resumed.policy.module.state_dict().items():
        torch.testing.assert_close(weight, trained[name], rtol=0, atol=0, msg=name)
    backend, _ = build_backend(PolicySpec("HalfCheetah-v5", "mlp-small", checkpoint=newest))
    try:
        assert backend.version == 2
    finally:
        backend.close()


def test_an_object_array_holding_code_is_still_refused_unread(tmp_path: Path) -> None:
    _trained(tmp_path / "run", run_info=RUN_INFO)
    newest = read_checkpoint(str(tmp_path / "run")).path
    payload = torch.load(newest, weights_only=True)
    marker = tmp_path / "ran"
    torch.save({**payload, "extra": np.array([_RunsCode(marker)], dtype=object)}, newest)
    with pytest.raises(ValueError, match=r"GLOBAL .*could run code when read: refused$"):
        read_checkpoint(str(tmp_path / "run"))
    assert not marker.exists()


def test_the_backend_serves_the_checkpoint_s_weights_and_version(tmp_path: Path) -> None:
    trainer = _trained(tmp_path / "run", run_info=RUN_INFO)
    path = read_checkpoint(str(tmp_path / "run")).path
    backend, _ = build_backend(PolicySpec("HalfCheetah-v5", "mlp-small", checkpoint=path))
    fresh, _ = build_backend(PolicySpec("HalfCheetah-v5", "mlp-small"))
    try:
        assert backend.version == 2 and fresh.version == 0
        obs = torch.from_numpy(np.random.default_rng(1).normal(size=(4, 17)).astype(np.float32))
        served = backend.infer(obs.numpy())

        def log_prob(module: GaussianMLPPolicy) -> np.ndarray:  # of the served actions, under module
            with torch.no_grad():
                mean, log_std = module.distribution(obs)
                return gaussian_log_prob(mean, log_std, torch.from_numpy(served.actions)).numpy()

        trained = trainer.policy.module
        assert isinstance(trained, GaussianMLPPolicy)
        np.testing.assert_allclose(served.log_probs, log_prob(trained), rtol=1e-5, atol=1e-5)
        untrained = build_policy("mlp-small", 17, 6, seed=0)  # where the trainer started
        assert np.abs(served.log_probs - log_prob(untrained)).max() > 1e-3  # 100x the match's tolerance
    finally:
        backend.close()
        fresh.close()
    with pytest.raises(ValueError, match=r"do not fit policy 'mlp' on HalfCheetah-v5 \(size mismatch"):
        build_backend(PolicySpec("HalfCheetah-v5", "mlp", checkpoint=path))


def test_a_server_that_cannot_load_the_checkpoint_fails_its_rollout_in_one_line(tmp_path: Path) -> None:
    """A checkpoint that says it holds ``mlp`` but holds ``mlp-small`` weights passes the command's
    checks (the env and spaces fit); the server process then fails to load it, and says why."""
    _trained(tmp_path / "run", run_info={**RUN_INFO, "policy": "mlp"})
    out = subprocess.run(
        [*EDGERL, "rollout", "--checkpoint", str(tmp_path / "run"), "--envs", "2", "--seconds", "5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    line = out.stderr.splitlines()[-1]
    assert line.startswith("edgerl: error: edge server failed to start: ValueError: checkpoint "), line
    assert "its weights do not fit policy 'mlp' on HalfCheetah-v5 (size mismatch" in line, line


def test_edgerl_serve_serves_a_run_folder_with_its_env_policy_and_version(tmp_path: Path) -> None:
    _trained(tmp_path / "run", run_info=RUN_INFO)
    refused = subprocess.run(
        [*EDGERL, "serve", "--port", "0", "--checkpoint", str(tmp_path / "run"), "--env", "Hopper-v5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith("ckpt-00000002.pt was trained on HalfCheetah-v5"), refused.stderr

    with serving("--checkpoint", str(tmp_path / "run")) as (proc, first):
        assert proc.stdout is not None
        second = proc.stdout.readline()
        assert first.startswith("edgerl: serving HalfCheetah-v5 on "), first  # the checkpoint's env
        assert second.startswith("edgerl: policy mlp-small, version 2 from "), second

        async def describe() -> tuple[int, tuple[int, ...]]:
            async with EdgeClient(first.split()[-1], timeout_s=30.0) as client:
                info = await client.describe()
            return info.policy_version, info.obs_shape

        assert asyncio.run(describe()) == (2, (17,))
