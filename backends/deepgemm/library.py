"""The one place deep_gemm is imported. Nothing imports it at module load: the packaged builds link
libtorch and load CUDA libraries, which fails or is slow where they cannot run.

A build works only with the torch whose headers it was compiled against (it calls libtorch's inline
accessors). On torch 2.11 + CUDA 13 (H200, 2026-11-29): sgl-deep-gemm 0.1.3 to 0.1.5 and
tokenspeed-deepgemm 2.3.0 to 2.5.0.post20260629 run; later builds of either were compiled for a newer torch.
"""

from __future__ import annotations

import importlib
from types import ModuleType

MODULE_NAME = "deep_gemm"


def import_deep_gemm() -> ModuleType:
    """The deep_gemm module. Raises ImportError (or OSError) when it is missing or fails to load."""
    return importlib.import_module(MODULE_NAME)


def version_of(module: ModuleType) -> str:
    return str(getattr(module, "__version__", "") or "(version unknown)")
