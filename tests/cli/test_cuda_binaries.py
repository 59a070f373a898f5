"""tools/cuda_binaries.py: PATH first, then Triton's bundled copy; without either, None (or a SystemExit
naming the tool where a tool needs Triton's copy)."""

import sys

import pytest

from tools import cuda_binaries


def test_path_comes_before_the_bundled_copy(tmp_path, monkeypatch):
    tool = tmp_path / "cuobjdump"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cuda_binaries.find("cuobjdump") == str(tool)


def test_without_triton_nothing_is_bundled(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.setenv("PATH", "")
    assert cuda_binaries.bundled("cuobjdump") is None
    assert cuda_binaries.find("cuobjdump") is None
    with pytest.raises(SystemExit, match="cuobjdump"):
        cuda_binaries.require_bundled("cuobjdump")


def test_a_tool_triton_does_not_bundle_is_none():
    assert cuda_binaries.bundled("no-such-cuda-tool") is None
