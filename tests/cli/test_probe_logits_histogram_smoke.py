"""The logits-histogram probe's own check (`--smoke`: one tiny shape under the Triton interpreter) passes,
and its histogram is exact, so the GPU run that measures issue 23's item 4 does not die in it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_probe_logits_histogram_smoke_mode_passes():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "probe_logits_histogram.py"), "--smoke"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "B3 N2 L512" in result.stdout and result.stdout.rstrip().endswith("exact")
