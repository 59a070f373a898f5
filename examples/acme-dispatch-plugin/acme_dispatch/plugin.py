"""Registers `acme.chunked`: paged MQA logits in the native layout, computed a chunk of requests at a
time with dense torch ops. A real plugin would call its own kernel here; the contract is the same."""

from __future__ import annotations

import torch

from dispatch.contract import (
    ALL_ARCHS,
    PAGED_MODES,
    Backend,
    Layout,
    Op,
    Support,
    hookimpl,
    split_kv_cache,
)

CHUNK = 8


def run(plan, q, kv_cache, weights, *, clean_logits=True):  # writes -inf past lengths either way
    # The host ran the op's input checks against Layout.NATIVE before this call.
    batch, next_n, heads, head_dim = q.shape
    num_blocks, block_kv = kv_cache.shape[:2]
    keys, scales = split_kv_cache(kv_cache, plan.fp8_dtype)  # [num_blocks, block_kv, D], [num_blocks, block_kv]
    pages = -(-plan.max_context_len // block_kv)
    table = plan.block_table[:, :pages].long().clamp(0, num_blocks - 1)
    out = torch.empty(batch * next_n, plan.max_context_len, dtype=torch.float32, device=q.device)
    positions = torch.arange(plan.max_context_len, device=q.device)
    for start in range(0, batch, CHUNK):
        rows = slice(start, min(start + CHUNK, batch))
        k = keys[table[rows]].flatten(1, 2)[:, : plan.max_context_len].float()  # [b, T, D]
        s = scales[table[rows]].flatten(1)[:, : plan.max_context_len]  # [b, T]
        scores = torch.relu(torch.einsum("bnhd,btd->bnht", q[rows].float(), k))
        w = weights.view(batch, next_n, heads)[rows]
        logits = torch.einsum("bnht,bnh->bnt", scores, w) * s[:, None, :]
        visible = positions < plan.context_lens[rows][..., None]
        out.view(batch, next_n, -1)[rows] = torch.where(visible, logits, float("-inf"))
    return out


@hookimpl
def register_backends(register):
    register(
        Backend(
            name="acme.chunked",
            op=Op.PAGED_MQA_LOGITS,
            layout=Layout.NATIVE,
            supports=Support(archs=ALL_ARCHS, forward_modes=PAGED_MODES),
            run=run,
            version="0.1.0",
            description="example third-party plugin: chunked dense torch",
        )
    )
