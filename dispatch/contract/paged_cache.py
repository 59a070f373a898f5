"""The one builder of paged fp8 K caches and their page tables, for tests, `bench`, the tuners and
`explain --seq-lens`: each request's keys packed into shuffled physical blocks."""

from __future__ import annotations

import torch

from dispatch.contract.key import Fp8Dtype
from dispatch.contract.kv_cache import BLOCK_KV, quantize_keys, split_kv_cache


def pages_of(lengths: list[int], block_kv: int = BLOCK_KV) -> list[int]:
    return [-(-length // block_kv) for length in lengths]


def page_table_for(
    lengths: list[int],
    *,
    block_kv: int = BLOCK_KV,
    physical: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """int32 [B, max_pages]: request b's pages are the next pages_of(lengths)[b] entries of `physical`
    (default: blocks 0, 1, 2, ... in order); unused entries point at block 0, as engines' padded tables do."""
    pages = pages_of(lengths, block_kv)
    total = sum(pages)
    if physical is None:
        physical = torch.arange(total, dtype=torch.int32)
    table = torch.zeros(len(lengths), max(max(pages, default=0), 1), dtype=torch.int32)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(pages, dtype=torch.long))
    starts = torch.tensor([0] + pages[:-1], dtype=torch.long).cumsum(0)
    columns = torch.arange(total) - torch.repeat_interleave(starts, torch.tensor(pages, dtype=torch.long))
    table[rows, columns] = physical[:total].to(torch.int32).cpu()
    return table.to(device)


def build_paged_kv_cache(
    keys_per_request: list[torch.Tensor],
    fp8_dtype: Fp8Dtype,
    *,
    block_kv: int = BLOCK_KV,
    extra_blocks: int = 0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each request's float keys [L_b, D] into a paged fp8 cache with shuffled physical blocks.

    Returns (kv_cache uint8 [num_blocks, block_kv, 1, D + 4], block_table int32 [B, max_blocks]) on the
    keys' device. Physical block 0 is left as random bytes and is the padding target of the table;
    `extra_blocks` adds more unused random blocks, so a kernel that reads past a request's pages is
    caught. `generator` (on the keys' device) draws the shuffle and the garbage.
    """
    head_dim = keys_per_request[0].shape[-1]
    device = keys_per_request[0].device
    lengths = [k.shape[0] for k in keys_per_request]
    pages = pages_of(lengths, block_kv)
    num_blocks = sum(pages) + extra_blocks + 1
    cache = torch.randint(
        0, 256, (num_blocks, block_kv * (head_dim + 4)), dtype=torch.uint8, generator=generator, device=device
    )
    order = torch.randperm(num_blocks - 1, generator=generator, device=device) + 1
    block_table = page_table_for(lengths, block_kv=block_kv, physical=order, device=device)
    values_view, scales_view = split_kv_cache(cache.view(num_blocks, block_kv, 1, head_dim + 4), fp8_dtype)
    first = 0
    for keys, count in zip(keys_per_request, pages):
        # One request at a time, all its pages at once: padded to whole pages, written through its blocks.
        if count == 0:
            continue
        values, scales = quantize_keys(keys, fp8_dtype)
        blocks = order[first : first + count].long()
        first += count
        filled = keys.shape[0]
        padded_values = values_view[blocks].reshape(count * block_kv, head_dim)
        padded_scales = scales_view[blocks].reshape(count * block_kv)
        padded_values[:filled] = values
        padded_scales[:filled] = scales
        values_view[blocks] = padded_values.view(count, block_kv, head_dim)
        scales_view[blocks] = padded_scales.view(count, block_kv)
    return cache.view(num_blocks, block_kv, 1, head_dim + 4), block_table
