"""Packaging and dependency direction."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(folder: str) -> set[str]:
    names: set[str] = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return names


FOLDERS = ("proto", "edge_server", "robot_client", "sim", "trainer", "watchdog", "launch", "models")


def _outside_repo(code: str, tmp_path: Path) -> str:
    """Run Python where the repository is not on sys.path: only what is installed is visible."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    return out.stdout


def test_folders_install_under_edgerl_only(tmp_path: Path) -> None:
    code = (
        "import importlib, importlib.util, json\n"
        f"folders = {FOLDERS!r}\n"
        "top = {f: getattr(importlib.util.find_spec(f), 'origin', None) for f in folders}\n"
        "sub = {f: importlib.import_module('edgerl.' + f).__file__ for f in folders}\n"
        "print(json.dumps([top, sub]))"
    )
    top, sub = json.loads(_outside_repo(code, tmp_path))
    for folder in FOLDERS:
        assert not str(top[folder] or "").startswith(str(ROOT)), f"top-level {folder} is ours"
        assert sub[folder] == str(ROOT / folder / "__init__.py")


def test_dependencies_point_one_way() -> None:
    assert all(n.startswith("edgerl.watchdog") for n in _imports("watchdog") if n.startswith("edgerl"))
    assert not any(n.startswith(("grpc", "edgerl.proto", "edgerl.robot_client")) for n in _imports("sim"))
    assert not any(n.startswith("edgerl.trainer") for n in _imports("edge_server"))
    assert not any(n.startswith("edgerl.edge_server") for n in _imports("trainer"))
    assert all(n.startswith("edgerl.models.") for n in _imports("models") if n.startswith("edgerl"))


def test_sim_workers_do_not_import_torch() -> None:
    code = "import sys, edgerl.robot_client.sim_worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_generated_code_is_up_to_date() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "edgerl.proto.generate", "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr


def test_stale_generated_code_is_found_and_regenerated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--check`` fails on a copy of the generated code that one edit made stale, naming the
    file and its diff, and writes nothing; the plain command rewrites it, after which the check
    passes."""
    import shutil

    from edgerl.proto import generate

    checked_in, out = generate.OUTPUT_DIR, tmp_path / "v1"
    shutil.copytree(checked_in, out)
    stub = out / "edge_pb2.pyi"
    stub.write_text(stub.read_text().replace("class ActRequest(", "class ActRequestEdited("))
    edited = stub.read_text()
    monkeypatch.setattr(generate, "OUTPUT_DIR", out)
    assert generate.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "-class ActRequestEdited(" in err and "+class ActRequest(" in err
    assert err.splitlines()[-1] == "stale generated code: edge_pb2.pyi; run `python -m edgerl.proto.generate`"
    assert stub.read_text() == edited
    assert generate.main([]) == 0
    assert capsys.readouterr().out == f"wrote 1 file(s) under {out}\n"
    assert stub.read_text() == (checked_in / "edge_pb2.pyi").read_text()
    assert generate.main(["--check"]) == 0
