"""The two ceilings a roofline needs, measured in the same run as the kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch.bench.timing import time_cuda


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float  # device-to-device copy, bytes read + written
    fp8_flops_per_s: float  # torch._scaled_mm, e4m3fn x e4m3fn -> bf16

    def as_dict(self) -> dict[str, float]:
        return {"copy_GBps": self.copy_bytes_per_s / 1e9, "fp8_TFLOPs": self.fp8_flops_per_s / 1e12}


def measure_ceilings(device: str = "cuda") -> Ceilings:
    n = 8192
    return Ceilings(
        copy_bytes_per_s=measure_copy_bandwidth(device),
        fp8_flops_per_s=2.0 * n**3 / _fp8_matmul_seconds(n, device),
    )


def measure_copy_bandwidth(device: str = "cuda") -> float:
    """Bytes per second of a device-to-device copy, read and write counted."""
    elements = 1 << 30  # 1 GiB each way: far past the L2
    return 2 * elements / _copy_seconds(elements, device)


def _copy_seconds(elements: int, device: str) -> float:
    src = torch.empty(elements, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return time_cuda(lambda: dst.copy_(src), repeats=20)


def _fp8_matmul_seconds(n: int, device: str) -> float:
    a = (torch.randn(n, n, device=device) * 0.1).to(torch.float8_e4m3fn)
    b = (torch.randn(n, n, device=device) * 0.1).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    return time_cuda(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), repeats=20)
