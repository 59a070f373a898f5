"""Paged MQA logits in plain torch, with DeepGEMM's argument convention.

    logits[r*N + j, k] = sum_h w[r*N + j, h] * relu(q[r, j, h] . K[k]) * s[k]   for k < ctx[r, j]
                       = -inf                                                    otherwise

The same function serves both layouts: native passes q [B, N, H, D] with ctx [B, N]; flatten passes
q [B*N, 1, H, D] with ctx [B*N, 1] and a block table repeated per token.
"""

from __future__ import annotations

import math

import torch

from dispatch.kv_cache import split_kv_cache
from dispatch.key import Fp8Dtype


def reference_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    fp8_dtype: Fp8Dtype = Fp8Dtype.E4M3FN,
) -> torch.Tensor:
    """fp32 logits [rows * N, max_context_len], -inf at every position past a token's length."""
    rows, next_n, heads, head_dim = q.shape
    block_kv = kv_cache.shape[1]
    keys, scales = split_kv_cache(kv_cache, fp8_dtype)
    pages = math.ceil(max_context_len / block_kv)
    positions = torch.arange(max_context_len, device=q.device)
    out = torch.full((rows * next_n, max_context_len), float("-inf"), dtype=torch.float32, device=q.device)
    # Pages past a request's length may point anywhere (padding); clamp so the gather stays in bounds.
    table = block_table[:, :pages].long().clamp(0, keys.shape[0] - 1)
    for row in range(rows):
        k = keys[table[row]].reshape(-1, head_dim)[:max_context_len].float()
        s = scales[table[row]].reshape(-1)[:max_context_len]
        scores = torch.relu(torch.einsum("nhd,td->nht", q[row].float(), k))
        w = weights[row * next_n : (row + 1) * next_n].float()
        logits = torch.einsum("nht,nh->nt", scores, w) * s
        visible = positions[None, :] < context_lens[row].view(next_n, 1)
        out[row * next_n : (row + 1) * next_n] = torch.where(visible, logits, float("-inf"))
    return out
