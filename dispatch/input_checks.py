"""What a backend checks before it launches: the tensors it is handed against its plan's tag."""

from __future__ import annotations

import torch

from dispatch.errors import DtypeMismatchError, LayoutError
from dispatch.fp8 import torch_dtype
from dispatch.layout import Layout, rows_and_tokens
from dispatch.plan import IndexerPlan


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
    expected_q = torch_dtype(plan.fp8_dtype)
    if q.dtype != expected_q:
        raise DtypeMismatchError(
            f"q has dtype {q.dtype} but the plan's K cache is {plan.fp8_dtype.value} ({expected_q}); "
            "quantise Q through the plan so both use the same fp8 dtype"
        )


def _expect(tag: str, name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise LayoutError(f"{tag} expects {name} {list(shape)}; got {list(tensor.shape)}")
