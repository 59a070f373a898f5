"""Each op called through the plan's decision for it. The call conventions a backend's `run`
follows are the Protocols in dispatch.contract; every call goes through dispatch.contract.calling.call_backend,
so a backend's own failure surfaces as BackendError naming what chose it."""

from __future__ import annotations

from typing import Any

import torch

from dispatch.contract.calling import call_backend
from dispatch.contract.errors import LayoutError
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.key import Op
from dispatch.contract.kv_cache import BLOCK_KV
from dispatch.contract.output_checks import check_output, check_pair
from dispatch.step.plan import IndexerPlan
from dispatch.contract.rope import RopeSpec


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
    out = call_backend(
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
    q_fp8, folded = check_pair(decision, out)
    check_output(decision, "q", q_fp8, tuple(q.shape), torch_dtype(decision.key.fp8_dtype), q.device)
    check_output(decision, "weights", folded, tuple(q.shape[:2]), torch.float32, q.device)
    return q_fp8, folded


def paged_mqa_logits(
    plan: IndexerPlan,
    q_tokens: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    *,
    clean_logits: bool = True,
) -> Any:
    """Paged MQA logits through the plan's decided backend; q_tokens is per-token fp8 [B*N, H, D].
    Without clean_logits the positions past a token's length are unspecified (a reader of only the
    visible keys, as the top-k op is, saves the backend the -inf fill)."""
    decision = plan.decision(Op.PAGED_MQA_LOGITS)
    out = call_backend(decision, plan, plan.q_in_layout(q_tokens), kv_cache, weights, clean_logits=clean_logits)
    rows = plan.batch_size * plan.next_n
    check_output(decision, "logits", out, (rows, plan.max_context_len), torch.float32, q_tokens.device,
                 min_columns=True)
    return out


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
        transform = {"page_table": plan.block_table, "page_rows": plan.page_rows}
    return topk_rows(plan, logits, plan.token_lengths, k, block_size=block_size, sorted=sorted, **transform)


def topk_rows(
    plan: Any,
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    starts: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    page_rows: torch.Tensor | None = None,
    block_size: int = BLOCK_KV,
    sorted: bool = False,
) -> torch.Tensor:
    """int32 [rows, k]: the top-k op on explicit rows (dispatch.contract.TopkRun) through the plan's
    decided backend: row r sees columns starts[r] .. starts[r] + lengths[r] - 1."""
    optional = {name: value for name, value in (("starts", starts), ("page_table", page_table),
                                                 ("page_rows", page_rows)) if value is not None}
    if page_table is not None:
        optional["block_size"] = block_size
    state = plan.state_of(Op.TOPK)
    if state is not None:  # a top-k backend with prepare(plan) gets the batch's state it built
        optional["state"] = state
    decision = plan.decision(Op.TOPK)
    out = call_backend(decision, logits, lengths, k, sorted=sorted, **optional)
    check_output(decision, "indices", out, (logits.shape[0], k), torch.int32, logits.device)
    return out


def ragged_mqa_logits(
    plan: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    scales: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    clean_logits: bool = True,
) -> torch.Tensor:
    """fp32 [M, S] ragged MQA logits (dispatch.contract.RaggedMqaLogitsRun) through the plan's decided
    backend; q fp8 [M, H, D] and k fp8 [S, D] must be in the plan's fp8 dtype (the K cache's)."""
    decision = plan.decision(Op.RAGGED_MQA_LOGITS)
    out = call_backend(
        decision, q, k, scales, weights, ks, ke, fp8_dtype=decision.key.fp8_dtype, clean_logits=clean_logits
    )
    check_output(decision, "logits", out, (q.shape[0], k.shape[0]), torch.float32, q.device)
    return out


def gather_keys(plan: Any, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k fp8 [S, D], scales fp32 [S]): one layer's keys of an extend plan's batch, gathered by the
    ragged logits backend's per-batch gather (dispatch.contract.RaggedKeyGather)."""
    decision = plan.decision(Op.RAGGED_MQA_LOGITS)
    gather = plan.state_of(Op.RAGGED_MQA_LOGITS)
    if gather is None:
        raise LayoutError(
            f"backend `{decision.backend}` gave the plan no K gather (its prepare); a ragged logits backend must"
        )
    keys, scales = check_pair(decision, call_backend(decision, kv_cache, entry=gather))
    total, head_dim = plan.total_keys, kv_cache.shape[-1] - 4
    check_output(decision, "gathered keys", keys, (total, head_dim), torch_dtype(decision.key.fp8_dtype),
                 kv_cache.device)
    check_output(decision, "gathered scales", scales, (total,), torch.float32, kv_cache.device)
    return keys, scales
