"""The op `topk`: per logits row, the positions of its k largest visible logits (or their physical KV
slots), -1 padded. Everything the op is: its call convention, its layout, its input and output checks,
and the host-side calls through a plan's decision."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from dispatch.contract.calling import call_backend
from dispatch.contract.key import Op
from dispatch.contract.kv_cache import BLOCK_KV
from dispatch.contract.layout import Layout
from dispatch.contract.ops.op_contract import EXTEND_STEP, PAGED_STEP, OpContract
from dispatch.contract.output_checks import check_output

if TYPE_CHECKING:  # torch is imported where it is used: the contract (and `validate`) loads without it
    import torch


class TopkRun(Protocol):
    """run(logits, lengths, k, *, starts, page_table, page_rows, block_size, sorted) -> int32 [rows, k].

    logits fp32 [rows, W] (last dim contiguous); row r's visible keys are columns starts[r] ..
    starts[r] + lengths[r] - 1 (starts None: 0), and nothing outside them is read. Output: positions
    relative to starts[r] of the k largest visible logits, -1 past the number selectable; a NaN is
    never selected, -inf is. With page_table [P, M] and page_rows [rows], each position p becomes the
    physical KV slot page_table[page_rows[r], p // block_size] * block_size + p % block_size.
    sorted=True orders each row by value, descending, -1s last. A top-k backend with `prepare(plan)`
    (a routing plan built once per batch from the plan's token lengths) also receives that state as
    `state=`; without it (a call outside a plan) the run builds what it needs itself."""

    def __call__(
        self,
        logits: torch.Tensor,
        lengths: torch.Tensor,
        k: int,
        *,
        starts: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None,
        page_rows: torch.Tensor | None = None,
        block_size: int = BLOCK_KV,
        sorted: bool = False,
    ) -> torch.Tensor: ...


CONTRACT = OpContract(
    run=TopkRun,
    layouts=(Layout.ROWS,),
    summary="the k largest visible logits per row, -1 padded",
    op=Op.TOPK,
    steps=(PAGED_STEP, EXTEND_STEP),
    stage=2,
)


def topk(plan, logits: torch.Tensor, k: int, *, transform_to_slots: bool = False, block_size: int = BLOCK_KV,
         sorted: bool = False) -> torch.Tensor:
    """int32 [B*N, k]: each token's top-k visible key positions through a paged plan's decided backend,
    over the plan's per-token visible lengths; -1 past what a token sees. With `transform_to_slots`
    each position becomes its physical KV slot through the plan's block table (pages of `block_size`)."""
    transform = {}
    if transform_to_slots:
        transform = {"page_table": plan.block_table, "page_rows": plan.page_rows}
    return topk_rows(plan, logits, plan.token_lengths, k, block_size=block_size, sorted=sorted, **transform)


def topk_rows(
    plan,
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
    """int32 [rows, k]: the top-k op on explicit rows (TopkRun) through the plan's decided backend:
    row r sees columns starts[r] .. starts[r] + lengths[r] - 1."""
    import torch

    from dispatch.contract.input_checks import check_topk_inputs

    decision = plan.decision(Op.TOPK)
    check_topk_inputs(logits, lengths, k, starts=starts, page_table=page_table, page_rows=page_rows,
                      block_size=block_size)
    optional = {name: value for name, value in (("starts", starts), ("page_table", page_table),
                                                 ("page_rows", page_rows)) if value is not None}
    if page_table is not None:
        optional["block_size"] = block_size
    state = plan.state_of(Op.TOPK)
    if state is not None:  # a top-k backend with prepare(plan) gets the batch's state it built
        optional["state"] = state
    out = call_backend(decision, logits, lengths, k, sorted=sorted, **optional)
    check_output(decision, "indices", out, (logits.shape[0], k), torch.int32, logits.device)
    return out
