"""The op `indexer_q_quant`: RoPE on the indexer's Q, a power-of-two scale per head vector, the fp8
store, and the scale folded into the head weights. Everything the op is: its call convention, its
layout, its input and output checks, and the host-side call through a plan's decision."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from dispatch.contract.calling import call_backend
from dispatch.contract.errors import LayoutError
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.key import Fp8Dtype
from dispatch.contract.layout import Layout
from dispatch.contract.ops.op_contract import EXTEND_STEP, PAGED_STEP, OpContract
from dispatch.contract.output_checks import check_output, check_pair
from dispatch.contract.rope import RopeSpec

if TYPE_CHECKING:  # torch is imported where it is used: the contract (and `validate`) loads without it
    import torch


class IndexerQQuantRun(Protocol):
    """run(q, weights, positions, cos_sin_cache, *, fp8_dtype, rope, softmax_scale, head_scale,
    error_flags) -> (q fp8 [T, H, D], fp32 weights [T, H]). fp8_dtype comes from the decision's key,
    never from the backend. Numerics are the engines': the RoPE output rounded to bf16 before the amax,
    the weight folded as w * scale * softmax_scale * head_scale one fp32 product at a time. A head
    vector with NaN or inf after RoPE gets the format's NaN byte and a NaN folded weight; a position
    outside the cos/sin cache is never read, poisons its token the same way and ORs BAD_POSITION into
    error_flags (the plan's int32 [1]; a torch reference raises IndexBoundsError instead)."""

    def __call__(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        *,
        fp8_dtype: Fp8Dtype,
        rope: RopeSpec,
        softmax_scale: float,
        head_scale: float,
        error_flags: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


CONTRACT = OpContract(
    run=IndexerQQuantRun,
    layouts=(Layout.TOKENS,),
    summary="RoPE, power-of-two scale, fp8 store, scale folded into weights",
    name="indexer_q_quant",
    steps=(PAGED_STEP, EXTEND_STEP),
    stage=0,
)


def indexer_q_quant(
    plan,
    q: torch.Tensor,
    weights: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    rope: RopeSpec,
    softmax_scale: float,
    head_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise per-token q [T, H, D] through the plan's decided backend, into the plan's fp8 dtype."""
    import torch


    decision = plan.decision(CONTRACT.op)
    check_q_quant_inputs(q, weights, positions, cos_sin_cache, plan.error_flags)
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


def check_q_quant_inputs(q, weights, positions, cos_sin_cache, error_flags=None) -> None:
    """Raise LayoutError naming the tensor for anything the Q-quant contract (IndexerQQuantRun) refuses:
    exact shapes (no broadcast of weights [1, H] or positions [1] over the tokens), dtypes, one device.
    Shared by every Q-quant backend, so the reference refuses what the kernels refuse."""
    import torch

    if q.dim() != 3:
        raise LayoutError(f"indexer_q_quant expects q [T, H, D]; got q {list(q.shape)}")
    tokens, heads, head_dim = q.shape
    if tuple(weights.shape) != (tokens, heads):
        raise LayoutError(f"indexer_q_quant expects weights [{tokens}, {heads}]; got {list(weights.shape)}")
    if tuple(positions.shape) != (tokens,):
        raise LayoutError(f"indexer_q_quant expects positions [{tokens}]; got {list(positions.shape)}")
    if cos_sin_cache.dim() != 2:
        raise LayoutError(f"indexer_q_quant expects cos_sin_cache [max_pos, rot_dim]; got {list(cos_sin_cache.shape)}")
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim % 2 or not 0 < rot_dim <= head_dim:
        raise LayoutError(f"cos_sin_cache rot_dim {rot_dim} must be even and in 2..{head_dim} (the head dim)")
    if positions.dtype not in (torch.int32, torch.int64):
        raise LayoutError(f"indexer_q_quant expects int32 or int64 positions; got {positions.dtype}")
    if error_flags is not None and (error_flags.dtype != torch.int32 or error_flags.numel() < 1):
        raise LayoutError(
            f"error_flags must be an int32 tensor of one element; got {error_flags.dtype} {list(error_flags.shape)}"
        )
    named = [("weights", weights), ("positions", positions), ("cos_sin_cache", cos_sin_cache)]
    for name, tensor in named + ([("error_flags", error_flags)] if error_flags is not None else []):
        if tensor.device != q.device:
            raise LayoutError(f"{name} is on {tensor.device} but q is on {q.device}")
