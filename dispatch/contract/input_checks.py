"""What a backend checks before it launches: the tensors it is handed against its plan's tag (logits),
or against the op's call convention (top-k). Shared by every backend of an op, so they refuse alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dispatch.contract.errors import DtypeMismatchError, LayoutError
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.layout import Layout, rows_and_tokens

if TYPE_CHECKING:
    from dispatch.step.plan import IndexerPlan


def check_logits_inputs(
    plan: IndexerPlan,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    *,
    consumes: Layout | None = None,
) -> None:
    """Raise LayoutError / DtypeMismatchError naming the tensor, the expected and the actual shape.

    `consumes` is the layout the calling backend runs: a plan tagged for another layout is refused
    even where its shapes happen to fit (B equal to next_n, say)."""
    layout = plan.layout
    if consumes is not None and layout is not consumes:
        raise LayoutError(
            f"backend consumes layout `{consumes.value}`; the plan is tagged `{layout.value}` "
            f"(backend `{plan.logits.backend}`, {plan.logits.chosen_by})"
        )
    rows, tokens = rows_and_tokens(layout, plan.batch_size, plan.next_n)
    tag = f"layout `{layout.value}` (decided by {plan.logits.rule}, backend `{plan.logits.backend}`)"
    if q.dim() != 4 or tuple(q.shape[:2]) != (rows, tokens):
        raise LayoutError(f"{tag} expects q [{rows}, {tokens}, H, D]; got q {list(q.shape)}")
    heads, head_dim = q.shape[2], q.shape[3]
    _expect(tag, "context_lens", plan.context_lens, (rows, tokens))
    if plan.block_table.dim() != 2 or plan.block_table.shape[0] != rows:
        raise LayoutError(f"{tag} expects block_table [{rows}, M]; got {list(plan.block_table.shape)}")
    _expect(tag, "weights", weights, (rows * tokens, heads))
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != head_dim + 4:
        raise LayoutError(
            f"{tag} expects kv_cache [num_blocks, block_kv, 1, D+4={head_dim + 4}]; got {list(kv_cache.shape)}"
        )
    if kv_cache.dtype != torch.uint8:
        raise LayoutError(f"kv_cache has dtype {kv_cache.dtype}; expected torch.uint8 (fp8 values + fp32 scales)")
    block_kv = max(kv_cache.shape[1], 1)
    pages = -(-plan.max_context_len // block_kv)
    if plan.block_table.shape[1] < pages:
        raise LayoutError(
            f"block_table has {plan.block_table.shape[1]} pages of {block_kv}, fewer than "
            f"max_context_len={plan.max_context_len} needs ({pages}): the page table must cover max_seq_len"
        )
    pool = plan.num_kv_blocks
    if pool is not None and kv_cache.shape[0] < pool:
        raise LayoutError(
            f"kv_cache has {kv_cache.shape[0]} blocks, fewer than the pool of {pool} the batch's page table "
            "was checked against (ForwardBatch.num_kv_blocks): every layer's cache must hold the whole pool"
        )
    expected_q = torch_dtype(plan.fp8_dtype)
    if q.dtype != expected_q:
        raise DtypeMismatchError(
            f"q has dtype {q.dtype} but the plan's K cache is {plan.fp8_dtype.value} ({expected_q}); "
            "quantise Q through the plan so both use the same fp8 dtype"
        )


def _expect(tag: str, name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise LayoutError(f"{tag} expects {name} {list(shape)}; got {list(tensor.shape)}")


def check_topk_inputs(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    starts: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    page_rows: torch.Tensor | None = None,
    block_size: int = 64,
) -> None:
    """Raise LayoutError naming the tensor for anything the top-k contract (dispatch.contract.TopkRun)
    refuses. Lengths and starts are checked against the logits' width only where that needs no device
    sync (host tensors); a kernel clamps its reads to the width anyway."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise LayoutError(f"top-k expects fp32 logits [rows, W]; got {logits.dtype} {list(logits.shape)}")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise LayoutError(f"top-k expects logits with a contiguous last dim; got strides {list(logits.stride())}")
    rows, width = logits.shape
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise LayoutError(f"top-k expects k an integer >= 1; got {k!r}")
    _expect_rows("lengths", lengths, rows)
    if starts is not None:
        _expect_rows("starts", starts, rows)
    if (page_table is None) != (page_rows is None):
        raise LayoutError("top-k's page transform needs both page_table and page_rows, or neither")
    if page_table is not None:
        if page_table.dim() != 2 or page_table.shape[1] == 0 or page_table.dtype != torch.int32:
            raise LayoutError(f"top-k expects an int32 page_table [P, M]; got {page_table.dtype} {list(page_table.shape)}")
        _expect_rows("page_rows", page_rows, rows)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise LayoutError(f"top-k expects block_size an integer >= 1; got {block_size!r}")
    if lengths.device.type == "cpu" and rows:
        first = starts if starts is not None else torch.zeros_like(lengths)
        if bool((lengths < 0).any()) or bool((first < 0).any()):
            raise LayoutError("top-k lengths and starts must be >= 0")
        end = int((first.long() + lengths.long()).max())
        if end > width:
            raise LayoutError(f"top-k starts + lengths reach column {end}; the logits are {width} wide")


def _expect_rows(name: str, tensor: torch.Tensor, rows: int) -> None:
    if tensor.dim() != 1 or tensor.shape[0] != rows or tensor.dtype != torch.int32:
        raise LayoutError(f"top-k expects {name} int32 [{rows}]; got {tensor.dtype} {list(tensor.shape)}")


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


def check_q_quant_inputs(q, weights, positions, cos_sin_cache, error_flags=None) -> None:
    """Raise LayoutError naming the tensor for anything the Q-quant contract (IndexerQQuantRun) refuses:
    exact shapes (no broadcast of weights [1, H] or positions [1] over the tokens), dtypes, one device.
    Shared by every Q-quant backend, so the reference refuses what the kernels refuse."""
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
