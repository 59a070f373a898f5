"""The two Indexer methods the plugin replaces, with SGLang's signatures and return conventions.

`_get_topk_paged` (decode, target_verify, draft_extend) and `_get_topk_ragged` (extend) receive Q
already quantised by SGLang (RoPE, Hadamard rotation, act_quant; or its fused kernel) with the Q
scale folded into the weights, and return what SGLang's own return: int32 [tokens, index_topk], -1
padded, tokens past the batch's real ones (attention-TP or max-len padding) all -1, and the indices in
the convention SGLang's topk_transform gives them: with SGLANG_DSA_FUSE_TOPK on (and the metadata not
forcing it off) physical KV slots for PAGED (page_table_1's) and ragged-KV positions for RAGGED;
otherwise positions in the request. Everything between is dispatch's: the plan's decisions, the
logits and top-k backends they name, the per-layer K buffer viewed in place."""

from __future__ import annotations

import torch

from dispatch.engines.sglang import plans
from dispatch.engines.sglang.session import session
from dispatch.contract.errors import LayoutError

HEAD_DIM_WITH_SCALE = 132  # 128 fp8 key bytes + one fp32 scale per token


def kv_cache_view(buffer: torch.Tensor) -> torch.Tensor:
    """SGLang's per-layer index-K buffer uint8 [pages, 64 * 132] as dispatch's [pages, 64, 1, 132]: a
    view of the same bytes (64 x 128 key bytes then 64 fp32 scales per page is dispatch's layout)."""
    if buffer.dim() != 2 or buffer.dtype != torch.uint8 or buffer.shape[1] != plans.PAGE_SIZE * HEAD_DIM_WITH_SCALE:
        raise LayoutError(
            f"SGLang's index-K buffer is a {buffer.dtype} tensor of shape {list(buffer.shape)}; expected uint8 "
            f"[pages, {plans.PAGE_SIZE * HEAD_DIM_WITH_SCALE}]"
        )
    return buffer.view(buffer.shape[0], plans.PAGE_SIZE, 1, HEAD_DIM_WITH_SCALE)


def fused_transform(metadata) -> bool:
    """Whether SGLang's topk_transform would return transformed indices for this metadata (its rule)."""
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_DSA_FUSE_TOPK.get()) and not metadata.force_unfused_topk


def _padded(result: torch.Tensor, rows: int) -> torch.Tensor:
    """SGLang's padding rule: rows past the real tokens are all -1."""
    if result.shape[0] >= rows:
        return result
    pad = result.new_full((rows - result.shape[0], result.shape[1]), -1)
    return torch.cat([result, pad], dim=0)


def get_topk_paged(self, forward_batch, layer_id, q_fp8, weights, metadata):
    """Replaces Indexer._get_topk_paged."""
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    attn = metadata.attn_metadata
    tokens = sum(metadata.get_dsa_extend_len_cpu())  # the real tokens, from SGLang's host metadata
    batch_size = attn.cache_seqlens_int32.shape[0]
    if batch_size == 0 or tokens == 0:
        return q_fp8.new_full((q_fp8.shape[0], self.index_topk), -1, dtype=torch.int32)
    next_n = tokens // batch_size
    to_slots = fused_transform(metadata)
    step = session().step(self.index_topk, to_slots=to_slots)
    plan = plans.PLANS.get(attn) or plans.plan_paged(step, attn, forward_batch.forward_mode, next_n)
    if plan.next_n != next_n:
        raise LayoutError(
            f"the batch's plan was built for next_n {plan.next_n}; SGLang's metadata holds {tokens} tokens over "
            f"{batch_size} requests (next_n {next_n})"
        )
    if self.num_init_tokens or self.num_local_tokens:
        raise LayoutError(
            "the dispatch plugin does not serve an indexer with forced init/local tokens "
            f"(num_init_tokens={self.num_init_tokens}, num_local_tokens={self.num_local_tokens})"
        )
    kv_cache = kv_cache_view(self._get_index_k_read_buffer(get_token_to_kv_pool(), layer_id))
    result = step.select_quantised(plan, q_fp8[:tokens], weights[:tokens].squeeze(-1), kv_cache)
    return _padded(result, q_fp8.shape[0])


def get_topk_ragged(self, enable_dual_stream, forward_batch, layer_id, q_fp8, weights, metadata, topk_result=None):
    """Replaces Indexer._get_topk_ragged (extend batches without speculation)."""
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    if topk_result is None:
        topk_result = torch.full((q_fp8.shape[0], self.index_topk), -1, device=q_fp8.device, dtype=torch.int32)
    attn = metadata.attn_metadata
    if attn.real_page_table.shape[0] == 0:
        return topk_result
    fused = fused_transform(metadata)
    paged_slots = fused and metadata.topk_transform_method == TopkTransformMethod.PAGED
    step = session().step(self.index_topk, to_slots=paged_slots)
    plan = plans.PLANS.get(attn) or plans.plan_extend(step, attn, forward_batch)
    if self.num_init_tokens or self.num_local_tokens:
        raise LayoutError(
            "the dispatch plugin does not serve an indexer with forced init/local tokens "
            f"(num_init_tokens={self.num_init_tokens}, num_local_tokens={self.num_local_tokens})"
        )
    tokens = plan.total_tokens
    kv_cache = kv_cache_view(self._get_index_k_read_buffer(get_token_to_kv_pool(), layer_id))
    positions = step.select_quantised(plan, q_fp8[:tokens], weights[:tokens].squeeze(-1), kv_cache)
    if fused and not paged_slots:
        # RAGGED: SGLang's indices address the batch's keys laid end to end, request after request.
        offsets = plan.metadata.key_offsets[plan.metadata.row_request.long()]
        positions = torch.where(positions >= 0, positions + offsets[:, None], positions)
    topk_result[:tokens] = positions
    return topk_result
