"""The paged fp8 K cache in DeepGEMM's layout: how keys are quantised into it and read back.

Layout: uint8 [num_blocks, block_kv, 1, D + 4], block-major. The first block_kv * D bytes of a block
are the fp8 keys (token-major), the next block_kv * 4 bytes the fp32 per-token scales. Engines and
every kernel here use pages of BLOCK_KV tokens. dispatch.contract.paged_cache builds such caches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.key import FP8_MAX, Fp8Dtype

if TYPE_CHECKING:  # torch is imported where it is used: the plugin contract (and `validate`) loads without it
    import torch

# Tokens per KV page: what the plans, the kernels, the schedules and the benchmarks assume.
BLOCK_KV = 64


def split_kv_cache(kv_cache: torch.Tensor, fp8_dtype: Fp8Dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the cache as (fp8 keys [num_blocks, block_kv, D], fp32 scales [num_blocks, block_kv])."""
    import torch

    num_blocks, block_kv, _, row_bytes = kv_cache.shape
    head_dim = row_bytes - 4
    flat = kv_cache.view(num_blocks, block_kv * row_bytes)
    keys = flat[:, : block_kv * head_dim].view(torch_dtype(fp8_dtype)).view(num_blocks, block_kv, head_dim)
    scales = flat[:, block_kv * head_dim :].view(torch.float32).view(num_blocks, block_kv)
    return keys, scales


def quantize_keys(keys: torch.Tensor, fp8_dtype: Fp8Dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 quantisation of float keys [T, D]: (fp8 values [T, D], fp32 scales [T])."""
    fp8_max = FP8_MAX[Fp8Dtype(fp8_dtype)]
    keys = keys.float()
    scales = keys.abs().amax(dim=-1).clamp(min=1e-4) / fp8_max
    # Clamp before the cast: torch casts out-of-range values to fnuz NaN instead of saturating.
    values = (keys / scales[:, None]).clamp(-fp8_max, fp8_max).to(torch_dtype(fp8_dtype))
    return values, scales
