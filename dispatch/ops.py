"""Each op called through the plan's decision for it. The call conventions a backend's `run`
follows are the Protocols in dispatch.contract; every call goes through dispatch.calling.call_backend,
so a backend's own failure surfaces as BackendError naming what chose it."""

from __future__ import annotations

from typing import Any

import torch

from dispatch.calling import call_backend
from dispatch.key import Op
from dispatch.kv_cache import BLOCK_KV
from dispatch.plan import IndexerPlan
from dispatch.rope import RopeSpec


def indexer_q_quant(
    plan: IndexerPlan,
    q: torch.Tensor,
    weights: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    rope: RopeSpec,
    softmax_scale: float,
    head_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise per-token q [B*N, H, D] through the plan's decided backend, into the plan's fp8 dtype."""
    decision = plan.decision(Op.INDEXER_Q_QUANT)
    return call_backend(
        decision,
        q,
        weights,
        positions,
        cos_sin_cache,
        fp8_dtype=decision.key.fp8_dtype,
        rope=rope,
        softmax_scale=softmax_scale,
        head_scale=head_scale,
        error_flags=plan.error_flags,
    )


def paged_mqa_logits(plan: IndexerPlan, q_tokens: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor) -> Any:
    """Paged MQA logits through the plan's decided backend; q_tokens is per-token fp8 [B*N, H, D]."""
    return call_backend(plan.decision(Op.PAGED_MQA_LOGITS), plan, plan.q_in_layout(q_tokens), kv_cache, weights)


def topk(
    plan: IndexerPlan,
    logits: torch.Tensor,
    k: int,
    *,
    transform_to_slots: bool = False,
    block_size: int = BLOCK_KV,
    sorted: bool = False,
) -> torch.Tensor:
    """int32 [B*N, k]: each token's top-k visible key positions through the plan's decided backend,
    over the plan's per-token visible lengths; -1 past what a token sees. With `transform_to_slots`
    each position becomes its physical KV slot through the plan's block table (pages of `block_size`)."""
    transform = {}
    if transform_to_slots:
        transform = {"page_table": plan.block_table, "page_rows": plan.page_rows, "block_size": block_size}
    return call_backend(plan.decision(Op.TOPK), logits, plan.token_lengths, k, sorted=sorted, **transform)
