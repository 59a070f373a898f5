"""One layer of vLLM's indexer through dispatch's plans: paged logits and top-k for the decode part,
K gather, ragged logits and top-k for each extend part, written into vLLM's `topk_indices_buffer`
as vLLM writes it (int32 [:T, :topk], each index a position in its request, -1 padded).

Q arrives as vLLM holds it: fp8 with the Q scale folded into the head weights (what vLLM's fused Q
kernels hand the op), or bf16 with what the quantiser needs (`QuantiseArgs`), quantised through the
plan into the K cache's fp8 dtype. An fp8 Q of another dtype than the cache's is refused, never scored."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch.contract.errors import DtypeMismatchError, LayoutError
from dispatch.contract.fp8 import torch_dtype
from dispatch.engines.indexer_step import select_extend
from dispatch.contract.ops import indexer_q_quant, paged_mqa_logits, topk
from dispatch.contract.rope import RopeSpec

from dispatch.engines.vllm.forward_plan import ForwardPlans


@dataclass(frozen=True)
class QuantiseArgs:
    """What quantising a bf16 Q needs: per-token positions [T], the cos/sin cache and the scales."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    rope: RopeSpec
    softmax_scale: float
    head_scale: float


def paged_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's per-layer indexer cache uint8 [blocks, 64, 132] as dispatch's [blocks, 64, 1, 132]: a
    view of the same bytes (the layouts are one: 64 x 128 key bytes, then 64 fp32 scales a block)."""
    if kv_cache.dim() != 3 or kv_cache.dtype != torch.uint8:
        raise LayoutError(
            f"vLLM's indexer kv_cache is {kv_cache.dtype} {list(kv_cache.shape)}; expected uint8 [blocks, 64, 132]"
        )
    return kv_cache.unsqueeze(-2)


def write_topk(
    plans: ForwardPlans,
    q: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_indices_buffer: torch.Tensor,
    topk_tokens: int,
    *,
    quantise: QuantiseArgs | None = None,
) -> torch.Tensor:
    """Score this layer and write each token's top-k into topk_indices_buffer[:T, :topk_tokens]."""
    kv = paged_view(kv_cache)
    _check_q(plans, q, quantise)
    if plans.decode is not None:
        rows = slice(0, plans.decode_tokens)
        q_fp8, folded = _quantised(plans.decode, q, weights, rows, quantise)
        logits = paged_mqa_logits(plans.decode, q_fp8, kv, folded, clean_logits=False)
        topk_indices_buffer[rows, :topk_tokens] = topk(plans.decode, logits, topk_tokens, block_size=kv.shape[1])
    for part in plans.extend_parts:
        start = part.rows.start  # the part's rows within this forward's tokens

        def quantised_rows(rows: slice, plan=part.plan, start=start):
            return _quantised(plan, q, weights, slice(start + rows.start, start + rows.stop), quantise)

        topk_indices_buffer[part.rows, :topk_tokens] = select_extend(part.plan, kv, quantised_rows, topk_tokens)
    return topk_indices_buffer


def _check_q(plans: ForwardPlans, q: torch.Tensor, quantise: QuantiseArgs | None) -> None:
    if not plans.plans:
        return
    cache_dtype = torch_dtype(plans.plans[0].fp8_dtype)
    if q.dtype == torch.bfloat16:
        if quantise is None:
            raise LayoutError("a bf16 q needs QuantiseArgs (positions, cos/sin cache, RoPE, scales) to be quantised")
        return
    if q.dtype != cache_dtype:
        raise DtypeMismatchError(
            f"vLLM handed q_quant as {q.dtype}, but the indexer K cache holds {cache_dtype}: Q must be "
            "quantised into the cache's fp8 dtype (hand the plugin bf16 Q to have it quantised so)"
        )


def _quantised(plan, q, weights, rows: slice, quantise: QuantiseArgs | None):
    if q.dtype != torch.bfloat16:
        return q[rows], weights[rows]
    return indexer_q_quant(
        plan, q[rows], weights[rows], quantise.positions[rows], quantise.cos_sin_cache,
        rope=quantise.rope, softmax_scale=quantise.softmax_scale, head_scale=quantise.head_scale,
    )
