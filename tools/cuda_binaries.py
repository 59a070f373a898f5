"""Where the tools find CUDA's binary utilities (cuobjdump, nvdisasm): Triton ships copies with its NVIDIA
backend, so a machine with Triton and no CUDA toolkit can still read the cubins it builds."""

from __future__ import annotations

import shutil
from pathlib import Path


def bundled(tool: str) -> str | None:
    """Triton's bundled copy of `tool`, or None (no Triton, or a build without it). A cubin Triton compiled
    is read by the copy of the same toolkit release."""
    try:
        import triton  # noqa: PLC0415 - only for the folder of its bundled binaries
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    return str(path) if path.is_file() else None


def find(tool: str) -> str | None:
    """`tool` from PATH (the toolkit nvcc comes from), else Triton's bundled copy, else None."""
    return shutil.which(tool) or bundled(tool)


def require_bundled(tool: str) -> str:
    """Triton's bundled `tool`, or a SystemExit naming what is missing."""
    path = bundled(tool)
    if path is None:
        raise SystemExit(f"needs Triton's bundled {tool} (triton/backends/nvidia/bin/{tool}): not found")
    return path
