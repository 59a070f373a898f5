"""Gather a batch's keys out of the paged indexer cache into one contiguous buffer, in plain torch.

The cache is uint8 [num_blocks, block_kv, 1, D + 4], block-major (kv_cache.py). Gathered key i is the
cache's physical slot slots[i] = block * block_kv + offset; the result is (fp8 k [S, D], fp32 scales
[S]), what the ragged logits kernels take. A slot outside the cache is an error here, never clamped.
"""

from __future__ import annotations

import dataclasses

from typing import TYPE_CHECKING

from dispatch.contract import Fp8Dtype, LayoutError, split_kv_cache

if TYPE_CHECKING:  # torch is imported where it runs: registering the reference must not (plugin.py)
    import torch


def reference_gather_keys(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    fp8_dtype: Fp8Dtype = Fp8Dtype.E4M3FN,
    *,
    key_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k fp8 [S, D], scales fp32 [S]) for int32 slots [S].

    `key_offsets` (int [B + 1], request r owns gathered keys [offsets[r], offsets[r + 1])) only makes
    the error for a bad slot name its request.
    """
    import torch

    keys, scales = split_kv_cache(kv_cache, fp8_dtype)
    num_blocks, block_kv, head_dim = keys.shape
    num_slots = num_blocks * block_kv
    slots_host = slots.long().cpu()
    bad = ((slots_host < 0) | (slots_host >= num_slots)).nonzero().flatten()
    if bad.numel():
        position = int(bad[0])
        where = f"gathered key {position}"
        if key_offsets is not None:
            request = int(torch.searchsorted(key_offsets.long().cpu(), position, right=True)) - 1
            where += f" (request {request}, its key {position - int(key_offsets[request])})"
        slot = int(slots_host[position])
        # -1 is what the plan's metadata writes for a key whose page entry is outside the pool (or past
        # int32), past the table's width, or whose batch's lengths were inconsistent (dispatch/step/extend_batch.py).
        why = "no valid page: its page-table entry is outside the pool or past the table" if slot == -1 \
            else f"outside the cache's [0, {num_slots})"
        raise LayoutError(f"{where} maps to slot {slot}, {why} ({num_blocks} blocks of {block_kv}); "
                          f"{bad.numel()} bad slot(s) in all")
    index = slots.long()
    return keys.reshape(num_slots, head_dim)[index], scales.reshape(num_slots)[index]


@dataclasses.dataclass(frozen=True)
class ReferenceKeyGather:
    """An extend plan's K gather in plain torch (dispatch.contract.RaggedKeyGather): the batch's slots,
    bound once per batch, applied to each layer's cache. A bad slot raises, naming its request."""

    slots: torch.Tensor
    key_offsets: torch.Tensor
    fp8_dtype: Fp8Dtype

    @classmethod
    def for_plan(cls, plan) -> "ReferenceKeyGather":
        return cls(plan.metadata.gather_slots, plan.metadata.key_offsets, plan.fp8_dtype)

    def __call__(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, scales = reference_gather_keys(kv_cache, self.slots, self.fp8_dtype, key_offsets=self.key_offsets)
        return keys.contiguous(), scales.contiguous()
