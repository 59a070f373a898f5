"""The paged fp8 K cache in DeepGEMM's layout, built from float keys and read back.

Layout: uint8 [num_blocks, block_kv, 1, D + 4], block-major. The first block_kv * D bytes of a block
are the fp8 keys (token-major), the next block_kv * 4 bytes the fp32 per-token scales.
"""

from __future__ import annotations

import math

import torch

from dispatch.fp8 import torch_dtype
from dispatch.key import FP8_MAX, Fp8Dtype

BLOCK_KV = 64


def split_kv_cache(kv_cache: torch.Tensor, fp8_dtype: Fp8Dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the cache as (fp8 keys [num_blocks, block_kv, D], fp32 scales [num_blocks, block_kv])."""
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


def build_paged_kv_cache(
    keys_per_request: list[torch.Tensor],
    fp8_dtype: Fp8Dtype,
    *,
    block_kv: int = BLOCK_KV,
    extra_blocks: int = 0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each request's float keys [L_b, D] into a paged fp8 cache with shuffled physical blocks.

    Returns (kv_cache uint8 [num_blocks, block_kv, 1, D + 4], block_table int32 [B, max_blocks]).
    Unused table entries point at block 0, as engines' padded tables do; `extra_blocks` adds unused
    physical blocks filled with random bytes so a kernel that reads past a request's pages is caught.
    """
    head_dim = keys_per_request[0].shape[-1]
    device = keys_per_request[0].device
    pages = [math.ceil(k.shape[0] / block_kv) for k in keys_per_request]
    max_blocks = max(max(pages), 1)
    num_blocks = sum(pages) + extra_blocks + 1
    # Physical block 0 is left as garbage and used as the padding target of the block table.
    cache = torch.randint(0, 256, (num_blocks, block_kv * (head_dim + 4)), dtype=torch.uint8, generator=generator)
    cache = cache.to(device)
    order = torch.randperm(num_blocks - 1, generator=generator).to(device) + 1
    block_table = torch.zeros(len(keys_per_request), max_blocks, dtype=torch.int32, device=device)
    values_view, scales_view = split_kv_cache(cache.view(num_blocks, block_kv, 1, head_dim + 4), fp8_dtype)
    next_free = 0
    for request, keys in enumerate(keys_per_request):
        values, scales = quantize_keys(keys, fp8_dtype)
        for page in range(pages[request]):
            block = int(order[next_free])
            next_free += 1
            block_table[request, page] = block
            rows = slice(page * block_kv, min((page + 1) * block_kv, keys.shape[0]))
            count = rows.stop - rows.start
            values_view[block, :count] = values[rows]
            scales_view[block, :count] = scales[rows]
    return cache.view(num_blocks, block_kv, 1, head_dim + 4), block_table
