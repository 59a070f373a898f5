"""How a kernel reads fp8 bytes: which Triton dtype the dot sees and what the product is scaled by.

e4m3fnuz has no tensor-core support outside gfx94x, but a valid fnuz byte read as e4m3fn is exactly
twice its fnuz value (same bits, bias 8 vs 7), so a product of two fnuz operands read as e4m3fn is
exactly 4x the fnuz product. The only byte that differs beyond the factor is 0x80 (fnuz NaN, fn -0),
which a valid fnuz tensor never holds.
"""

from __future__ import annotations

import enum
import functools

import torch

from dispatch.contract import Fp8Dtype, rocm_gcn_arch


class Fp8Mode(str, enum.Enum):
    E4M3FN = "e4m3fn"  # OCP bytes, tl.float8e4nv
    FNUZ_NATIVE = "fnuz_native"  # fnuz bytes, tl.float8e4b8; compiles only for gfx94x (and the interpreter)
    FNUZ_EMULATED = "fnuz_emulated"  # fnuz bytes read as e4m3fn, products scaled by 1/4

    @property
    def torch_view_dtype(self) -> torch.dtype:
        """The dtype the kernel's pointers carry; Triton maps it to the dot's fp8 type."""
        return torch.float8_e4m3fnuz if self is Fp8Mode.FNUZ_NATIVE else torch.float8_e4m3fn

    @property
    def product_scale(self) -> float:
        return 0.25 if self is Fp8Mode.FNUZ_EMULATED else 1.0


@functools.lru_cache(maxsize=1)
def fnuz_mode_for_here() -> Fp8Mode:
    """Native fnuz only where the hardware has it (ROCm gfx94x); emulated on NVIDIA and the CPU."""
    return Fp8Mode.FNUZ_NATIVE if rocm_gcn_arch().startswith("gfx94") else Fp8Mode.FNUZ_EMULATED


def fp8_mode(fp8_dtype: Fp8Dtype, fnuz_mode: Fp8Mode | None = None) -> Fp8Mode:
    """The mode for a cache of `fp8_dtype`; `fnuz_mode` overrides the machine's choice for fnuz."""
    if Fp8Dtype(fp8_dtype) is Fp8Dtype.E4M3FN:
        return Fp8Mode.E4M3FN
    mode = fnuz_mode_for_here() if fnuz_mode is None else Fp8Mode(fnuz_mode)
    if mode is Fp8Mode.E4M3FN:
        raise ValueError("fnuz_mode must be `fnuz_native` or `fnuz_emulated` for an e4m3fnuz cache")
    return mode
