"""The indexer step as a serving engine calls it, shaped like SGLang's init_forward_metadata /
_get_topk_paged pair: `plan` once per batch, then `select` in every layer (Q quant, logits, top-k)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch.dispatcher import Dispatcher
from dispatch.key import Fp8Dtype
from dispatch.ops import indexer_q_quant, paged_mqa_logits, topk
from dispatch.plan import ForwardBatch, IndexerPlan, build_plan
from dispatch.rope import RopeSpec

DEFAULT_TOPK = 2048


@dataclass(frozen=True)
class IndexerStep:
    """Everything about the indexer that is fixed for a model: the dispatcher and the Q settings."""

    dispatcher: Dispatcher
    kv_fp8_dtype: Fp8Dtype | torch.dtype
    rope: RopeSpec
    softmax_scale: float
    head_scale: float
    topk: int = DEFAULT_TOPK
    # Return physical KV slots (page_table[b, i // block] * block + i % block) instead of positions,
    # as sparse attention reads them next; fused into the top-k backend.
    transform_to_slots: bool = False

    def plan(self, batch: ForwardBatch) -> IndexerPlan:
        """Once per batch: decide, and build the decided layout's tensors (no host-device sync)."""
        return build_plan(self.dispatcher, batch, kv_fp8_dtype=self.kv_fp8_dtype)

    def select(
        self,
        plan: IndexerPlan,
        q: torch.Tensor,
        weights: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Per layer: quantise q [B*N, H, D], score every visible cached key, keep the top-k per token:
        int32 [B*N, topk], -1 past what a token sees; each step through the plan's decision for it."""
        q_fp8, folded = indexer_q_quant(
            plan,
            q,
            weights,
            positions,
            cos_sin_cache,
            rope=self.rope,
            softmax_scale=self.softmax_scale,
            head_scale=self.head_scale,
        )
        logits = paged_mqa_logits(plan, q_fp8, kv_cache, folded)
        return topk(plan, logits, self.topk, transform_to_slots=self.transform_to_slots, block_size=kv_cache.shape[1])
