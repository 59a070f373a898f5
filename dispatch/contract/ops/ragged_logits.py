"""The op `ragged_mqa_logits`: fp32 logits of each query row over its key range [ks, ke) of one
contiguous key buffer (the extend step), and the per-batch K gather that fills that buffer from the
paged cache. Everything the op is: its call convention, its layout, its input and output checks, and
the host-side calls through a plan's decision."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from dispatch.contract.calling import call_backend
from dispatch.contract.errors import DtypeMismatchError, LayoutError
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.key import Fp8Dtype
from dispatch.contract.layout import Layout
from dispatch.contract.ops.op_contract import EXTEND_STEP, OpContract
from dispatch.contract.output_checks import check_output, check_pair

if TYPE_CHECKING:  # torch is imported where it is used: the contract (and `validate`) loads without it
    import torch


class RaggedMqaLogitsRun(Protocol):
    """run(q, k, scales, weights, ks, ke, *, fp8_dtype, clean_logits=True) -> fp32 logits [M, S].

    DeepGEMM's fp8_mqa_logits convention: q fp8 [M, H, D], k fp8 [S, D] (keys gathered into one
    contiguous buffer) with fp32 scales [S], weights fp32 [M, H], ks / ke int32 [M]; row m sees keys
    [ks[m], ke[m]) and logits[m, s] = sum_h w[m, h] * relu(q[m, h] . k[s]) * scales[s] there. Every
    other column is -inf; with clean_logits=False (DeepGEMM's flag) those columns are unspecified
    (garbage, NaN included), which a top-k that reads only [ks, ke) never sees. fp8_dtype is the
    decision's key's (the K cache's): the run is handed q and k that passed check_ragged_logits_inputs
    against it. The result may have a row stride wider than S (last dim contiguous).

    A ragged backend's `prepare(plan)` returns the batch's RaggedKeyGather (below): how it wants its
    k buffer filled from the paged cache, once per layer, from slots built once per batch."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        scales: torch.Tensor,
        weights: torch.Tensor,
        ks: torch.Tensor,
        ke: torch.Tensor,
        *,
        fp8_dtype: Fp8Dtype,
        clean_logits: bool = True,
    ) -> torch.Tensor: ...


class RaggedKeyGather(Protocol):
    """gather(kv_cache) -> (k fp8 [S, D] in the plan's fp8 dtype, contiguous; scales fp32 [S]).

    What a ragged logits backend's prepare(plan) returns: the batch's keys copied out of one layer's
    paged cache (uint8 [num_blocks, block_kv, 1, D + 4]) through the plan's gather_slots. A slot
    outside the cache is never read: a GPU gather poisons that key (NaN scale) and sets the plan's
    error_flags; a torch reference raises LayoutError naming the request."""

    def __call__(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


CONTRACT = OpContract(
    run=RaggedMqaLogitsRun,
    layouts=(Layout.RAGGED,),
    summary="fp32 logits of each query row over its key range [ks, ke)",
    name="ragged_mqa_logits",
    steps=(EXTEND_STEP,),
    stage=1,
)


def ragged_mqa_logits(plan, q: torch.Tensor, k: torch.Tensor, scales: torch.Tensor, weights: torch.Tensor,
                      ks: torch.Tensor, ke: torch.Tensor, *, clean_logits: bool = True) -> torch.Tensor:
    """fp32 [M, S] ragged MQA logits (RaggedMqaLogitsRun) through the plan's decided backend; q fp8
    [M, H, D] and k fp8 [S, D] must be in the plan's fp8 dtype (the K cache's)."""
    import torch


    decision = plan.decision(CONTRACT.op)
    fp8_dtype = decision.key.fp8_dtype
    check_ragged_logits_inputs(q, k, scales, weights, ks, ke, fp8_dtype=fp8_dtype)
    out = call_backend(decision, q, k, scales, weights, ks, ke, fp8_dtype=fp8_dtype, clean_logits=clean_logits)
    check_output(decision, "logits", out, (q.shape[0], k.shape[0]), torch.float32, q.device)
    return out


def gather_keys(plan, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k fp8 [S, D], scales fp32 [S]): one layer's keys of an extend plan's batch, gathered by the
    ragged logits backend's per-batch gather (RaggedKeyGather)."""
    import torch

    decision = plan.decision(CONTRACT.op)
    gather = plan.state_of(CONTRACT.op)
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


def check_ragged_logits_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    scales: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    fp8_dtype,
) -> None:
    """Raise LayoutError / DtypeMismatchError naming the tensor for anything the ragged logits contract
    (dispatch.contract.RaggedMqaLogitsRun) refuses. `fp8_dtype` is the decision's key's, i.e. the K
    cache's: a Q quantised into another dtype is refused here, as check_logits_inputs does in decode.
    Metadata only: no tensor value is read, so nothing waits on the device."""
    import torch

    expected = torch_dtype(fp8_dtype)
    for name, tensor in (("q", q), ("k", k)):
        if tensor.dtype != expected:
            raise DtypeMismatchError(
                f"{name} has dtype {tensor.dtype} but the plan's K cache is {getattr(fp8_dtype, 'value', fp8_dtype)} "
                f"({expected}); quantise Q through the plan so both use the same fp8 dtype"
            )
    if q.dim() != 3:
        raise LayoutError(f"layout `ragged` expects q [M, H, D]; got q {list(q.shape)}")
    rows, heads, head_dim = q.shape
    if k.dim() != 2 or k.shape[1] != head_dim:
        raise LayoutError(f"layout `ragged` expects k [S, D={head_dim}]; got k {list(k.shape)}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (k.shape[0],):
        raise LayoutError(f"layout `ragged` expects fp32 scales [S={k.shape[0]}]; got {scales.dtype} {list(scales.shape)}")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (rows, heads):
        raise LayoutError(
            f"layout `ragged` expects fp32 weights [M={rows}, H={heads}]; got {weights.dtype} {list(weights.shape)}"
        )
    for name, bound in (("ks", ks), ("ke", ke)):
        if bound.dtype != torch.int32 or tuple(bound.shape) != (rows,):
            raise LayoutError(f"layout `ragged` expects {name} int32 [M={rows}]; got {bound.dtype} {list(bound.shape)}")
