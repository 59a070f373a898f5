"""The op `paged_mqa_logits`: fp32 logits of every visible cached key, read from the paged fp8 K cache
in place (decode, target_verify, draft_extend). Everything the op is: its call convention, its
layouts, its input and output checks, and the host-side call through a plan's decision."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from dispatch.contract.calling import call_backend
from dispatch.contract.errors import DtypeMismatchError, LayoutError
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.layout import Layout, rows_and_tokens
from dispatch.contract.ops.op_contract import PAGED_STEP, OpContract
from dispatch.contract.output_checks import check_output

if TYPE_CHECKING:  # torch is imported where it is used: the contract (and `validate`) loads without it
    import torch


class PagedMqaLogitsRun(Protocol):
    """run(plan, q, kv_cache, weights, *, clean_logits=True) -> fp32 logits [B*N, plan.max_context_len].

    q is fp8 in plan.layout (native [B, N, H, D]; flatten [B*N, 1, H, D]), kv_cache uint8
    [num_blocks, block_kv, 1, D + 4], weights fp32 [B*N, H]. The run is handed inputs that passed
    check_logits_inputs against its decision's layout and, with clean_logits, writes -inf at every
    position past a token's length; without it those positions are unspecified (a backend may still
    write -inf there): the indexer step asks for that, because its top-k never reads past a length.
    Bounds and NaN (dispatch/contract/bounds.py): it never follows a page-table entry outside
    [0, num_blocks) that a visible key needs; that token's row, like the row of a token whose length
    passes max_context_len, is NaN in every column, and the bit is ORed into plan.error_flags (a torch
    reference raises IndexBoundsError instead). A NaN q element or weight, a NaN key byte or a
    non-finite key scale makes the logits it touches NaN."""

    def __call__(
        self,
        plan,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        weights: torch.Tensor,
        *,
        clean_logits: bool = True,
    ) -> torch.Tensor: ...


CONTRACT = OpContract(
    run=PagedMqaLogitsRun,
    layouts=(Layout.NATIVE, Layout.FLATTEN),
    summary="fp32 logits of every visible cached key",
    name="paged_mqa_logits",
    steps=(PAGED_STEP,),
    stage=1,
)


def paged_mqa_logits(plan, q_tokens: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, *,
                     clean_logits: bool = True) -> torch.Tensor:
    """Paged MQA logits through the plan's decided backend; q_tokens is per-token fp8 [B*N, H, D].
    Without clean_logits the positions past a token's length are unspecified (a reader of only the
    visible keys, as the top-k op is, saves the backend the -inf fill)."""
    import torch


    decision = plan.decision(CONTRACT.op)
    q = plan.q_in_layout(q_tokens)
    check_logits_inputs(plan, q, kv_cache, weights, consumes=decision.layout)
    out = call_backend(decision, plan, q, kv_cache, weights, clean_logits=clean_logits)
    rows = plan.batch_size * plan.next_n
    check_output(decision, "logits", out, (rows, plan.max_context_len), torch.float32, q_tokens.device,
                 min_columns=True)
    return out


def check_logits_inputs(
    plan,  # a paged plan (dispatch.contract.PagedPlan)
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    *,
    consumes: Layout | None = None,
) -> None:
    """Raise LayoutError / DtypeMismatchError naming the tensor, the expected and the actual shape.

    `consumes` is the layout the calling backend runs: a plan tagged for another layout is refused
    even where its shapes happen to fit (B equal to next_n, say)."""
    import torch

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
            "was checked against (PagedBatch.num_kv_blocks): every layer's cache must hold the whole pool"
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
