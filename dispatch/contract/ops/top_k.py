"""The op `topk`: per logits row, the positions of its k largest visible logits (or their physical KV
slots), -1 padded. Everything the op is: its call convention, its layout, its input and output checks,
and the host-side calls through a plan's decision."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from dispatch.contract.calling import call_backend
from dispatch.contract.errors import LayoutError
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
    name="topk",
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


    decision = plan.decision(CONTRACT.op)
    check_topk_inputs(logits, lengths, k, starts=starts, page_table=page_table, page_rows=page_rows,
                      block_size=block_size)
    optional = {name: value for name, value in (("starts", starts), ("page_table", page_table),
                                                 ("page_rows", page_rows)) if value is not None}
    if page_table is not None:
        optional["block_size"] = block_size
    state = plan.state_of(CONTRACT.op)
    if state is not None:  # a top-k backend with prepare(plan) gets the batch's state it built
        optional["state"] = state
    out = call_backend(decision, logits, lengths, k, sorted=sorted, **optional)
    check_output(decision, "indices", out, (logits.shape[0], k), torch.int32, logits.device)
    return out


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
    import torch

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
    import torch

    if tensor.dim() != 1 or tensor.shape[0] != rows or tensor.dtype != torch.int32:
        raise LayoutError(f"top-k expects {name} int32 [{rows}]; got {tensor.dtype} {list(tensor.shape)}")
