"""The indexer step as a serving engine calls it, shaped like SGLang's init_forward_metadata /
_get_topk_paged pair: `plan` once per batch, then `select` in every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch.dispatcher import Dispatcher
from dispatch.key import Fp8Dtype
from dispatch.ops import paged_mqa_logits, quantize_q
from dispatch.plan import ForwardBatch, IndexerPlan, build_plan
from dispatch.rope import RopeSpec

DEFAULT_TOPK = 2048


def topk_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [rows, k]: each row's top-k key positions, best first; masked or missing slots are -1."""
    rows, width = logits.shape
    take = min(k, width)
    values, indices = torch.topk(logits, take, dim=-1)
    indices = indices.to(torch.int32).masked_fill_(torch.isneginf(values), -1)
    if take == k:
        return indices
    return torch.cat([indices, indices.new_full((rows, k - take), -1)], dim=-1)


@dataclass(frozen=True)
class IndexerStep:
    """Everything about the indexer that is fixed for a model: the dispatcher and the Q settings."""

    dispatcher: Dispatcher
    kv_fp8_dtype: Fp8Dtype | torch.dtype
    rope: RopeSpec
    softmax_scale: float
    head_scale: float
    topk: int = DEFAULT_TOPK

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
        """Per layer: quantise q [B*N, H, D], score every visible cached key, keep the top-k per token."""
        q_fp8, folded = quantize_q(
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
        return topk_indices(logits, self.topk)
