"""The wheel a user installs works away from the checkout: built from a copy of the tree, installed
into a fresh virtual environment, run from another directory. (The venv sees the system site-packages
so torch and pydantic need no download; the wheel goes in with --no-deps.)"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.install

# What belongs in a checkout and not in a build's input: caches, builds, the repository itself.
_NOT_SOURCE = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", ".hypothesis", ".*")


def _run(argv: list, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source") / "dispatch"
    shutil.copytree(ROOT, source, symlinks=True, ignore=_NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)], cwd=out)
    (built,) = out.glob("dispatch_dsa-*.whl")
    return built


def test_the_wheel_holds_the_runtime_and_the_registry(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    packaged = zipfile.ZipFile(wheel).read("dispatch/registry.yaml")
    assert packaged == (ROOT / "registry.yaml").read_bytes()  # the top-level file, not a copy that drifts
    assert "dispatch/py.typed" in names
    top_level = {name.split("/")[0] for name in names}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"dispatch", "backends"}
    assert not [name for name in names if "/tune_" in name or name.startswith("tests/")]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata


def test_explain_and_validate_from_an_installed_wheel(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], cwd=tmp_path)
    python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    # When these tests run inside a venv, --system-site-packages reaches the base interpreter, not
    # this one: hand the new venv this interpreter's site-packages (after its own, so the wheel wins).
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).stdout.strip()
    Path(purelib, "outer-site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISPATCH_", "PYTHON"))}

    where = _run([str(python), "-c", "import dispatch, backends; print(dispatch.__file__); print(backends.__file__)"], elsewhere, env)
    assert all(line.startswith(str(venv)) for line in where.stdout.split()), where.stdout

    explained = _run([str(python), "-m", "dispatch", "explain", "--op", "all", "--json"], elsewhere, env)
    decisions = json.loads(explained.stdout)
    assert [d["op"] for d in decisions] == ["paged_mqa_logits", "indexer_q_quant"]
    assert all(d["backend"] for d in decisions)
    text = _run([str(python), "-m", "dispatch", "explain", "--op", "all"], elsewhere, env).stdout
    assert "registry.yaml:" in text and str(venv) in text  # the packaged file, with its line

    validated = _run([str(python), "-m", "dispatch", "validate"], elsewhere, env)
    assert validated.stdout.startswith("ok: ") and str(venv) in validated.stdout

    missing = subprocess.run([str(python), "-m", "dispatch", "validate"], cwd=elsewhere, capture_output=True, text=True,
                             env={**env, "DISPATCH_REGISTRY": str(elsewhere / "cluster.yaml")}, timeout=120)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "cluster.yaml" in missing.stderr and "DISPATCH_REGISTRY" in missing.stderr and str(venv) in missing.stderr
