"""The wheel a user installs works away from the checkout: built from a copy of the tree, installed
into a fresh virtual environment, run from another directory; so does the README's editable install.
(The venv sees the system site-packages so torch and pydantic need no download; the wheel goes in
with --no-deps.)"""

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

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.install

# What belongs in a checkout and not in a build's input: caches, builds, the repository itself.
_NOT_SOURCE = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", ".hypothesis", ".*")


def _run(argv: list, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the checkout (links kept as links), so building writes nothing into the real one."""
    copy = tmp_path_factory.mktemp("source") / "dispatch"
    shutil.copytree(ROOT, copy, symlinks=True, ignore=_NOT_SOURCE)
    return copy


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
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
    assert "dispatch/engines/vllm/plugin.py" in names
    assert "backends/cuda_topk/radix_select.cu" in names  # cuda.radix compiles it at first use
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "[vllm.general_plugins]\ndispatch = dispatch.engines.vllm.plugin:register" in entry_points


def fresh_venv(folder: Path) -> Path:
    """A new venv that sees this interpreter's packages (torch, pydantic) but not this checkout."""
    venv = folder / "venv"
    # --without-pip: the venv uses this interpreter's pip and setuptools, not older bundled copies
    # (an editable build runs in the venv, and needs a setuptools that reads SPDX licenses).
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], cwd=folder)
    python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    # When these tests run inside a venv, --system-site-packages reaches the base interpreter, not
    # this one: hand the new venv this interpreter's site-packages (after its own, so the install wins).
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], folder).stdout.strip()
    Path(purelib, "outer-site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


# Runs in the installed environment: where the packages came from, then the CLI's commands in-process
# (one torch import instead of one per command), as JSON for the test to read.
_IN_THE_INSTALL = """
import contextlib, io, json, os, sys
import backends, dispatch
from dispatch.cli.commands import main

def run(argv, **env):
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    for name in env:
        del os.environ[name]
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}

print(json.dumps({
    "files": [dispatch.__file__, backends.__file__],
    "explain": run(["explain", "--op", "all", "--json"]),
    "validate": run(["validate"]),
    "missing": run(["validate"], DISPATCH_REGISTRY=sys.argv[1]),
}))
"""


def check_installed(python: Path, installed_under: Path, folder: Path) -> str:
    """From a directory outside both trees: the install is what imports, and explain and validate work."""
    elsewhere = folder / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISPATCH_", "PYTHON"))}
    missing_file = elsewhere / "cluster.yaml"
    report = json.loads(_run([str(python), "-c", _IN_THE_INSTALL, str(missing_file)], elsewhere, env).stdout)

    assert all(path.startswith(str(installed_under)) for path in report["files"]), report["files"]
    assert report["explain"]["code"] == 0, report["explain"]["err"]
    decisions = json.loads(report["explain"]["out"])["decisions"]
    assert [d["op"] for d in decisions] == ["paged_mqa_logits", "indexer_q_quant", "topk"] and all(d["backend"] for d in decisions)
    assert report["validate"]["code"] == 0 and report["validate"]["out"].startswith("ok: "), report["validate"]
    missing = report["missing"]
    assert missing["code"] == 2 and "Traceback" not in missing["err"]
    assert f"{missing_file}: no registry file there (DISPATCH_REGISTRY)" in missing["err"]
    assert f"the packaged default is {installed_under}" in missing["err"]

    # The commands as a user types them: `python -m dispatch` and the console script.
    text = _run([str(python), "-m", "dispatch", "explain", "--op", "all"], elsewhere, env).stdout
    assert "registry.yaml:" in text and "indexer_q_quant for" in text  # the packaged file, with the rule's line
    script = python.parent / ("dispatch.exe" if os.name == "nt" else "dispatch")
    assert _run([str(script), "--version"], elsewhere, env).stdout.startswith("dispatch (dispatch-dsa 0.1")
    return text


def test_explain_and_validate_from_an_installed_wheel(wheel, tmp_path):
    python = fresh_venv(tmp_path)
    _run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], cwd=tmp_path)
    text = check_installed(python, tmp_path / "venv", tmp_path)
    assert str(tmp_path / "venv") in text  # the registry read is the wheel's own copy


def test_explain_and_validate_from_an_editable_install(source, tmp_path):
    # The README's first command: `pip install -e .`, then explain from anywhere.
    python = fresh_venv(tmp_path)
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", "-e", str(source)], cwd=tmp_path)
    check_installed(python, source, tmp_path)
