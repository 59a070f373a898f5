"""Programmatic dependent launch for dispatch's Triton kernels (the rule: backends/shared/dependent_launch.py).

A kernel takes `PDL: tl.constexpr` and calls `wait_previous_then_launch_next(PDL)` first; its launch passes
`**pdl_options(device)`, which sets that constexpr and Triton's `launch_pdl` option from one value. The two
must agree: a kernel launched with PDL that did not wait could read its inputs before they are written.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from backends.shared.dependent_launch import dependent_launch


@triton.jit
def wait_previous_then_launch_next(PDL: tl.constexpr):
    """Every program, before its first read: wait for the kernel before this one, then let the next launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_options(device: torch.device) -> dict[str, bool]:
    """The launch's PDL constexpr and Triton's `launch_pdl` option, both from triton_dependent_launch."""
    on = triton_dependent_launch(device)
    return {"PDL": on, "launch_pdl": on}


def triton_dependent_launch(device: torch.device) -> bool:
    """dependent_launch, for a Triton kernel: also needs a Triton whose CUDA launcher takes the `launch_pdl`
    option and has `gdc_wait` (3.6 and 3.9 do; the package accepts Triton from 3.2, asked here rather
    than by version)."""
    return dependent_launch(device) and _triton_has_pdl()


@functools.cache
def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return ("launch_pdl" in {field.name for field in dataclasses.fields(CUDAOptions)}
            and hasattr(tl.extra.cuda, "gdc_wait"))
