"""The indexer step as a serving engine calls it, shaped like SGLang's init_forward_metadata /
_get_topk_paged pair: `plan` once per batch, then `select` in every layer (Q quant, logits, top-k).

Paged batches (decode, target_verify, draft_extend: a PagedBatch) score the paged cache; extend
(extend) batches (an ExtendBatch) gather their keys and score them ragged, chunked to a logits byte
budget (dispatch/step/extend_plan.py). The same pair serves both; the plan says which step runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.errors import LayoutError
from dispatch.step.extend_plan import ExtendPlan, build_extend_plan
from dispatch.contract.key import Fp8Dtype
from dispatch.contract.ops import gather_keys, indexer_q_quant, paged_mqa_logits, ragged_mqa_logits, topk, topk_rows
from dispatch.step.paged_plan import PagedBatch, PagedPlan, build_plan
from dispatch.step.extend_batch import DEFAULT_LOGITS_BYTES, ExtendBatch
from dispatch.contract.rope import RopeSpec

DEFAULT_INDEX_TOPK = 2048


def check_paged_q(plan: PagedPlan, q: torch.Tensor) -> None:
    """An engine holding q as [B, N, H, D] would otherwise meet an opaque torch error deep inside the
    Q-quant backend (wrapped in a BackendError); say here which tensor is wrong and what is expected."""
    tokens = plan.batch_size * plan.next_n
    if q.dim() != 3 or q.shape[0] != tokens:
        raise LayoutError(
            f"q has shape {list(q.shape)}; IndexerStep.select expects q [tokens, H, D] with tokens = B*N = "
            f"{plan.batch_size}*{plan.next_n} = {tokens} (flatten a [B, N, H, D] q with q.flatten(0, 1))"
        )


@dataclass(frozen=True)
class IndexerStep:
    """Everything about the indexer that is fixed for a model: the dispatcher and the Q settings."""

    dispatcher: Dispatcher
    kv_fp8_dtype: Fp8Dtype | torch.dtype
    rope: RopeSpec
    softmax_scale: float
    head_scale: float
    index_topk: int = DEFAULT_INDEX_TOPK  # keys kept per token (DeepSeek V3.2's index_topk)
    # Return physical KV slots (page_table[b, i // block] * block + i % block) instead of positions,
    # as sparse attention reads them next; fused into the top-k backend.
    transform_to_slots: bool = False
    # Extend batches: each chunk's fp32 logits [rows, keys] stay under this many bytes (vLLM's default).
    logits_byte_budget: int = DEFAULT_LOGITS_BYTES

    def warm(self) -> list:
        """The slow first-use work of the backends this machine's decisions may pick (cuda.radix's nvcc
        build), now: call it once before capturing CUDA graphs (CapturedIndexerStep does). A backend that
        fails to warm up raises BackendError naming it (dispatch.deciding.warming)."""
        from dispatch.deciding.warming import warm_for

        return warm_for(self.dispatcher)

    def plan(self, batch: PagedBatch | ExtendBatch) -> PagedPlan | ExtendPlan:
        """Once per batch: decide, and build the decided layout's tensors (no host-device sync). An
        ExtendBatch gets an ExtendPlan: the ragged step's decisions, metadata and chunks."""
        if isinstance(batch, ExtendBatch):
            return build_extend_plan(
                self.dispatcher, batch, kv_fp8_dtype=self.kv_fp8_dtype, logits_byte_budget=self.logits_byte_budget
            )
        return build_plan(self.dispatcher, batch, kv_fp8_dtype=self.kv_fp8_dtype)

    def select(
        self,
        plan: PagedPlan | ExtendPlan,
        q: torch.Tensor,
        weights: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Per layer: quantise q [T, H, D], score every visible cached key, keep the top-k per token:
        int32 [T, index_topk], -1 past what a token sees; each step through the plan's decision for it.
        T is B*N for a paged plan, the batch's new tokens M (request after request) for an extend plan;
        positions are then relative to each request's first key (or physical slots with transform_to_slots)."""
        if isinstance(plan, ExtendPlan):
            self._check_extend_inputs(plan, q, kv_cache)
            return self._select_extend(
                plan, kv_cache,
                lambda rows: self._quantise(plan, q[rows], weights[rows], positions[rows], cos_sin_cache),
            )
        check_paged_q(plan, q)
        q_fp8, folded = self._quantise(plan, q, weights, positions, cos_sin_cache)
        return self.select_quantised(plan, q_fp8, folded, kv_cache)

    def select_quantised(
        self, plan: PagedPlan | ExtendPlan, q_fp8: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """`select` for a Q the engine has already quantised (SGLang rotates Q by a Hadamard transform
        between RoPE and its quantiser; vLLM hands its op fp8 Q): q_fp8 [T, H, D] in the plan's fp8 dtype
        (the K cache's; the backends refuse another), weights fp32 [T, H] with the Q scale folded in.
        Logits and top-k as in `select`, through the plan's decisions; the plan's Q-quant decision is unused."""
        if isinstance(plan, ExtendPlan):
            self._check_extend_inputs(plan, q_fp8, kv_cache)
            return self._select_extend(plan, kv_cache, lambda rows: (q_fp8[rows], weights[rows]))
        check_paged_q(plan, q_fp8)
        # The top-k reads only each token's visible keys, so the logits need no -inf tail.
        logits = paged_mqa_logits(plan, q_fp8, kv_cache, weights, clean_logits=False)
        return topk(plan, logits, self.index_topk, transform_to_slots=self.transform_to_slots, block_size=kv_cache.shape[1])

    def _quantise(self, plan, q, weights, positions, cos_sin_cache) -> tuple[torch.Tensor, torch.Tensor]:
        return indexer_q_quant(
            plan,
            q,
            weights,
            positions,
            cos_sin_cache,
            rope=self.rope,
            softmax_scale=self.softmax_scale,
            head_scale=self.head_scale,
        )

    @staticmethod
    def _check_extend_inputs(plan: ExtendPlan, q: torch.Tensor, kv_cache: torch.Tensor) -> None:
        rows = plan.total_tokens
        if q.dim() != 3 or q.shape[0] != rows:
            raise LayoutError(f"q has shape {list(q.shape)}; the extend plan expects [M={rows}, H, D]")
        if kv_cache.dim() != 4 or kv_cache.shape[1] != plan.block_kv:
            raise LayoutError(
                f"kv_cache has shape {list(kv_cache.shape)}; the extend plan's pages hold block_kv={plan.block_kv}"
            )

    def _select_extend(self, plan: ExtendPlan, kv_cache, quantised_rows) -> torch.Tensor:
        return select_extend(plan, kv_cache, quantised_rows, self.index_topk, transform_to_slots=self.transform_to_slots)


def select_extend(plan: ExtendPlan, kv_cache: torch.Tensor, quantised_rows, k: int, *,
                  transform_to_slots: bool = False) -> torch.Tensor:
    """The extend step after planning: gather this layer's K (the cache differs per layer), then per chunk
    of query rows: Q quant (quantised_rows(rows) -> (q_fp8, folded weights), rows a slice of the plan's
    M) -> ragged logits over the chunk's key window -> top-k over each row's [ks, ke). int32 [M, k].
    The logits are asked for without the -inf fill (clean_logits=False): the top-k reads only [ks, ke).
    IndexerStep and the vLLM plugin, which writes the result into vLLM's buffer, both run it."""
    keys, scales = gather_keys(plan, kv_cache)
    out = torch.empty(plan.total_tokens, k, dtype=torch.int32, device=kv_cache.device)
    transform = {"page_table": plan.page_table, "block_size": plan.block_kv} if transform_to_slots else {}
    for chunk in plan.chunks:
        q_fp8, folded = quantised_rows(chunk.rows)
        logits = ragged_mqa_logits(
            plan, q_fp8, keys[chunk.keys], scales[chunk.keys], folded, chunk.ks, chunk.ke, clean_logits=False
        )
        page_rows = {"page_rows": chunk.page_rows} if transform_to_slots else {}
        out[chunk.rows] = topk_rows(plan, logits, chunk.lengths, k, starts=chunk.ks, **transform, **page_rows)
    return out
