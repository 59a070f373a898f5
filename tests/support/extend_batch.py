"""Test helper: a random extend batch over a paged cache, and its inputs to the ragged logits step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dispatch.contract.paged_cache import build_paged_kv_cache
from backends.reference.kv_gather import reference_gather_keys
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.key import FP8_MAX, Fp8Dtype
from dispatch.step.extend_batch import ExtendBatch, RaggedMetadata, build_ragged_metadata

# Page-table entries past a request's pages: an index far outside the cache, so a read through one fails.
POISON_BLOCK = 1 << 30


def unchecked_extend_batch(**fields) -> ExtendBatch:
    """What a GPU batch hands over: lengths the host never read (ExtendBatch's CPU checks skipped)."""
    batch = object.__new__(ExtendBatch)
    defaults = dict(block_kv=64, host_prefix_lens=None, host_extend_lens=None, num_kv_blocks=None)
    for name, value in {**defaults, **fields}.items():
        object.__setattr__(batch, name, value)
    return batch


@dataclass(frozen=True)
class ExtendCase:
    batch: ExtendBatch
    metadata: RaggedMetadata
    kv_cache: torch.Tensor  # uint8 [num_blocks, 64, 1, D + 4]
    keys: list[torch.Tensor]  # float keys [prefix + extend, D] per request (before quantisation)
    q: torch.Tensor  # fp8 [M, H, D], the cache's dtype
    weights: torch.Tensor  # fp32 [M, H]
    fp8_dtype: Fp8Dtype

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k [S, D], scales [S]) gathered by the reference."""
        return reference_gather_keys(self.kv_cache, self.metadata.gather_slots, self.fp8_dtype,
                           key_offsets=self.metadata.key_offsets)


def extend_case(
    prefix_lens: list[int],
    extend_lens: list[int],
    *,
    heads: int = 64,
    head_dim: int = 128,
    fp8_dtype: Fp8Dtype = Fp8Dtype.E4M3FN,
    device: str = "cpu",
    seed: int = 0,
) -> ExtendCase:
    gen = torch.Generator().manual_seed(seed)
    totals = [p + e for p, e in zip(prefix_lens, extend_lens)]
    keys = [torch.randn(total, head_dim, generator=gen) for total in totals]
    cache, table = build_paged_kv_cache(keys, fp8_dtype, extra_blocks=3, generator=gen)
    pages = max(table.shape[1], 1)
    poisoned = torch.full((len(totals), pages + 1), POISON_BLOCK, dtype=torch.int32)
    for request, total in enumerate(totals):
        used = math.ceil(total / 64)
        poisoned[request, :used] = table[request, :used]
    batch = ExtendBatch.from_lengths(prefix_lens, extend_lens, poisoned.to(device))
    fp8_max = FP8_MAX[fp8_dtype]
    rows = sum(extend_lens)
    q = (torch.randn(rows, heads, head_dim, generator=gen) * fp8_max / 3).clamp(-fp8_max, fp8_max)
    weights = torch.randn(rows, heads, generator=gen)
    return ExtendCase(
        batch=batch,
        metadata=build_ragged_metadata(batch),
        kv_cache=cache.to(device),
        keys=keys,
        q=q.to(torch_dtype(fp8_dtype)).to(device),
        weights=weights.to(device),
        fp8_dtype=fp8_dtype,
    )
