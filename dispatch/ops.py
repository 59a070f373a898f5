"""The call convention of each op, as a backend's `run` receives it.

paged_mqa_logits:  run(plan, q, kv_cache, weights) -> fp32 logits [B*N, plan.max_context_len]
    q is fp8 in plan.layout (native [B, N, H, D]; flatten [B*N, 1, H, D]), kv_cache uint8
    [num_blocks, block_kv, 1, D + 4], weights fp32 [B*N, H]. The run checks its inputs with
    dispatch.checks.check_logits_inputs and writes -inf at every position past a token's length.

indexer_q_quant:   run(q, weights, positions, cos_sin_cache, *, fp8_dtype, rope, softmax_scale,
                       head_scale, error_flags) -> (q fp8 [T, H, D], fp32 weights [T, H])
    fp8_dtype comes from the decision's key, never from the backend; error_flags is the plan's int32 [1]
    flag word (dispatch/bounds.py). The RoPE output is rounded to bf16 before the amax, as the engines do.

Bounds and NaN (dispatch/bounds.py): a backend never follows an out-of-range page or position; it makes
the affected token's logits row NaN and sets the plan's error flag (a torch reference raises
IndexBoundsError instead). A NaN or inf in a q head vector makes its folded weight NaN; a NaN key, or a
non-finite key scale, makes that key's logit NaN.

A backend that raises (a kernel launch failure, a missing symbol) surfaces as BackendError naming the
backend, op, key and rule, chained to the original. The project's own errors (LayoutError and
DtypeMismatchError from a backend's input checks) and CUDA out-of-memory pass through unchanged.
There is no fallback to another backend.
"""

from __future__ import annotations

from typing import Any

import torch

from dispatch.backend_call import call_backend
from dispatch.plan import IndexerPlan
from dispatch.rope import RopeSpec


def quantize_q(
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
    return call_backend(
        plan.q_quant,
        q,
        weights,
        positions,
        cos_sin_cache,
        fp8_dtype=plan.q_quant.key.fp8_dtype,
        rope=rope,
        softmax_scale=softmax_scale,
        head_scale=head_scale,
        error_flags=plan.error_flags,
    )


def paged_mqa_logits(plan: IndexerPlan, q_tokens: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor) -> Any:
    """Paged MQA logits through the plan's decided backend; q_tokens is per-token fp8 [B*N, H, D]."""
    return call_backend(plan.logits, plan, plan.q_in_layout(q_tokens), kv_cache, weights)
