"""Test helper: a random paged batch, and its expected logits computed without the plan's layout code."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch.contract.paged_cache import build_paged_kv_cache
from backends.reference.paged_mqa_logits import reference_paged_mqa_logits
from dispatch.contract.fp8 import fp8_dtype_of
from dispatch.contract.key import Fp8Dtype


@dataclass(frozen=True)
class PagedCase:
    seq_lens: torch.Tensor  # int32 [B]: total length L, drafts included
    page_table: torch.Tensor  # int32 [B, M]
    kv_cache: torch.Tensor  # uint8 [num_blocks, 64, 1, D + 4]
    q_tokens: torch.Tensor  # fp8 [B*N, H, D], request-major, in the cache's fp8 dtype
    weights: torch.Tensor  # fp32 [B*N, H]
    next_n: int

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())


def paged_batch(
    seq_lens: list[int], next_n: int, *, heads: int = 32, head_dim: int = 32, device: str = "cpu", seed: int = 0
) -> PagedCase:
    generator = torch.Generator().manual_seed(seed)
    keys = [torch.randn(length, head_dim, generator=generator) for length in seq_lens]
    kv_cache, page_table = build_paged_kv_cache(keys, Fp8Dtype.E4M3FN, extra_blocks=2, generator=generator)
    tokens = len(seq_lens) * next_n
    q = torch.randn(tokens, heads, head_dim, generator=generator).to(torch.float8_e4m3fn)
    weights = torch.randn(tokens, heads, generator=generator)
    return PagedCase(
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        page_table=page_table.to(device),
        kv_cache=kv_cache.to(device),
        q_tokens=q.to(device),
        weights=weights.to(device),
        next_n=next_n,
    )


def expected_logits(batch: PagedCase) -> torch.Tensor:
    """Every token scored on its own, with the causal length L - N + j + 1 spelled out per token."""
    lens, tables = [], []
    for request, length in enumerate(batch.seq_lens.tolist()):
        for j in range(batch.next_n):
            lens.append([max(length - batch.next_n + j + 1, 0)])
            tables.append(batch.page_table[request])
    device = batch.q_tokens.device
    return reference_paged_mqa_logits(
        batch.q_tokens[:, None],
        batch.kv_cache,
        batch.weights,
        torch.tensor(lens, dtype=torch.int32, device=device),
        torch.stack(tables),
        batch.max_seq_len,
        fp8_dtype_of(batch.q_tokens.dtype, "q"),
    )
