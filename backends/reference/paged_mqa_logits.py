"""Paged MQA logits in plain torch, with DeepGEMM's argument convention.

    logits[r*N + j, k] = sum_h w[r*N + j, h] * relu(q[r, j, h] . K[k]) * s[k]   for k < ctx[r, j]
                       = -inf                                                    otherwise

The same function serves both layouts: native passes q [B, N, H, D] with ctx [B, N]; flatten passes
q [B*N, 1, H, D] with ctx [B*N, 1] and a block table repeated per token.

Bounds are checked on the host, where the check is free: a length past max_context_len, or a page-table
entry outside [0, num_blocks) that a visible key needs, raises IndexBoundsError naming the row (the
request in the native layout), token, entry and bound; nothing is clamped. Entries no token needs are
padding and may hold anything. NaN: a NaN q, key or weight makes the logit NaN (relu keeps NaN), and a
non-finite key scale is made NaN, as in the Triton kernel.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dispatch.contract import ALL_ARCHS, PAGED_MODES, Backend, Fp8Dtype, Layout, Op, Support, split_kv_cache

if TYPE_CHECKING:  # torch is imported where it runs: registering the reference must not (plugin.py)
    import torch


def reference_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    fp8_dtype: Fp8Dtype = Fp8Dtype.E4M3FN,
    *,
    num_kv_blocks: int | None = None,
) -> torch.Tensor:
    """fp32 logits [rows * N, max_context_len], -inf at every position past a token's length.

    `num_kv_blocks` (the engine's pool, PagedBatch.num_kv_blocks) is what table entries are checked
    against, as the page guard does; None: the cache's own block count."""
    import torch

    from dispatch.contract import check_pages

    rows, next_n, heads, head_dim = q.shape
    block_kv = kv_cache.shape[1]
    keys, scales = split_kv_cache(kv_cache, fp8_dtype)
    num_blocks = keys.shape[0] if num_kv_blocks is None else min(num_kv_blocks, keys.shape[0])
    check_pages(context_lens, block_table, num_blocks, max_context_len, block_kv)
    pages = math.ceil(max_context_len / block_kv)
    positions = torch.arange(max_context_len, device=q.device)
    out = torch.full((rows * next_n, max_context_len), float("-inf"), dtype=torch.float32, device=q.device)
    if num_blocks == 0:
        return out  # every length is 0 (check_pages passed), so every position is masked
    # Entries still out of range are padding no visible key needs (check_pages passed): block 0 stands
    # in, and the mask below hides what it scores.
    table = block_table[:, :pages].long()
    table = torch.where((table >= 0) & (table < num_blocks), table, 0)
    for row in range(rows):
        k = keys[table[row]].reshape(-1, head_dim)[:max_context_len].float()
        s = scales[table[row]].reshape(-1)[:max_context_len]
        s = torch.where(torch.isfinite(s), s, float("nan"))
        scores = torch.relu(torch.einsum("nhd,td->nht", q[row].float(), k))
        w = weights[row * next_n : (row + 1) * next_n].float()
        logits = torch.einsum("nht,nh->nt", scores, w) * s
        visible = positions[None, :] < context_lens[row].view(next_n, 1)
        out[row * next_n : (row + 1) * next_n] = torch.where(visible, logits, float("-inf"))
    return out


def run_paged_mqa_logits(plan, q, kv_cache, weights, *, clean_logits=True):
    # Both reference backends run the same function, which reads the layout from the tensors' tag. It
    # writes the -inf tail whatever clean_logits says (the flag permits skipping it, never requires it).
    # The inputs passed the op's checks before this run (dispatch/contract/ops/paged_logits.py).
    return reference_paged_mqa_logits(
        q, kv_cache, weights, plan.context_lens, plan.block_table, plan.max_context_len, plan.fp8_dtype,
        num_kv_blocks=plan.num_kv_blocks,
    )


BACKENDS = tuple(
    Backend(
        name=name,
        op=Op.PAGED_MQA_LOGITS,
        layout=layout,
        supports=Support(archs=ALL_ARCHS, forward_modes=PAGED_MODES),
        run=run_paged_mqa_logits,
        description=f"plain torch, {layout.value} layout; slow, exact fp32 on fp8 inputs",
    )
    for name, layout in (("torch.reference", Layout.NATIVE), ("torch.reference.flatten", Layout.FLATTEN))
)
