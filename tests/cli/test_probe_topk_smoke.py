"""The top-k probe's own check (`--smoke`: tiny shapes under the Triton interpreter) passes with the
Triton and numpy the `[test]` extra installs, so the GPU run that uses the probe does not die in it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_probe_topk_smoke_mode_passes():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "probe_topk.py"), "--smoke"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "smoke N2" in result.stdout and "WRONG" not in result.stdout and "ERROR" not in result.stdout
