"""What this machine is, in the key's terms: its arch (CUDA capability, ROCm gcnArchName, else cpu)
and its platform fp8 dtype. Both can be overridden by the caller or the environment."""

from __future__ import annotations

import functools
import os

from dispatch.contract.errors import InvalidKeyError
from dispatch.contract.key import Arch, Fp8Dtype, parse_enum

# CUDA compute capability major -> arch family the kernels are built for. sm_103 (B300) runs sm100
# code; sm_121 (DGX Spark) runs sm120 code; 8.0 / 8.6 / 8.7 (A100, A10, Orin) have no fp8 tensor cores.
_CUDA_MAJOR = {8: Arch.SM80, 9: Arch.SM90, 10: Arch.SM100, 12: Arch.SM120}
# Capabilities that are their own arch within a major: 8.9 (Ada: L40S, L4, RTX 4090) has fp8 tensor cores.
_CUDA_EXACT = {(8, 9): Arch.SM89}
_ROCM_PREFIX = {"gfx942": Arch.GFX942, "gfx950": Arch.GFX950}


@functools.lru_cache(maxsize=1)
def detect_arch() -> Arch:
    """This machine's arch; DISPATCH_ARCH overrides it. cpu when torch sees no GPU."""
    override = os.environ.get("DISPATCH_ARCH")
    if override:
        return parse_enum(Arch, override, "DISPATCH_ARCH")
    try:
        import torch
    except ImportError:
        return Arch.CPU
    if not torch.cuda.is_available():
        return Arch.CPU
    if getattr(torch.version, "hip", None):
        gcn = rocm_gcn_arch()
        if gcn not in _ROCM_PREFIX:
            raise InvalidKeyError(f"ROCm GPU `{gcn}` is not a known arch; set DISPATCH_ARCH to one of gfx942, gfx950")
        return _ROCM_PREFIX[gcn]
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if props.major not in _CUDA_MAJOR:
        raise InvalidKeyError(
            f"CUDA capability {props.major}.{props.minor} is not a known arch; set DISPATCH_ARCH to one of "
            + ", ".join(a.value for a in Arch)
        )
    return cuda_arch(props.major, props.minor)


def cuda_arch(major: int, minor: int) -> Arch:
    """The arch of a CUDA compute capability (the caller has checked the major is known)."""
    return _CUDA_EXACT.get((major, minor), _CUDA_MAJOR[major])


def rocm_gcn_arch() -> str:
    """The ROCm GPU's gcnArchName without its feature flags ("gfx942:sramecc+:xnack-" -> "gfx942");
    '' on CUDA or without a GPU."""
    import torch

    if not getattr(torch.version, "hip", None) or not torch.cuda.is_available():
        return ""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(props, "gcnArchName", "").split(":")[0]


def platform_fp8_dtype(arch: Arch) -> Fp8Dtype:
    """The fp8 dtype a platform's K cache uses: e4m3fnuz on gfx94x (MI300), OCP e4m3fn elsewhere.
    DISPATCH_FP8_DTYPE overrides it."""
    override = os.environ.get("DISPATCH_FP8_DTYPE")
    if override:
        return parse_enum(Fp8Dtype, override, "DISPATCH_FP8_DTYPE")
    return native_fp8_dtype(arch)


def native_fp8_dtype(arch: Arch) -> Fp8Dtype:
    """The platform fp8 dtype of `arch`, whatever the environment says."""
    return Fp8Dtype.E4M3FNUZ if arch is Arch.GFX942 else Fp8Dtype.E4M3FN


def gpu_name() -> str:
    """The GPU's marketing name ('' on a CPU-only machine), for cluster matching and reports."""
    try:
        import torch
    except ImportError:
        return ""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else ""


def triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def dependent_launch_switched_off() -> bool:
    """DISPATCH_PDL=0: dispatch's kernels launch without programmatic dependent launch (read here, once for
    the backends that launch and for bench's report of how they did)."""
    return os.environ.get("DISPATCH_PDL") == "0"
