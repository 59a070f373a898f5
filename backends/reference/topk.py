"""Top-k of each logits row over its visible keys, in plain torch (the contract: dispatch.contract.TopkRun).

Row r sees the columns starts[r] .. starts[r] + lengths[r] - 1. A NaN is never selected (it counts as
not visible); -inf is a visible number and is selected after every finite value. One stable two-key
sort does it without a loop over rows: first by visibility, then, stably, by value, so that among equal
values (-inf included) a visible column always comes before one that is not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dispatch.contract import ALL_ARCHS, BLOCK_KV, Backend, Layout, Op, Support

if TYPE_CHECKING:  # torch is imported where it runs: registering the reference must not (plugin.py)
    import torch


def topk_indices(
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
    """int32 [rows, k]: positions (relative to starts[r]) of each row's k largest visible logits,
    best first, -1 past the number selectable; physical KV slots instead when page_table is given."""
    import torch

    rows, width = logits.shape
    first = torch.zeros_like(lengths) if starts is None else starts
    columns = torch.arange(width, device=logits.device)
    begin, end = first.long()[:, None], (first.long() + lengths.long())[:, None]
    visible = (columns >= begin) & (columns < end) & ~torch.isnan(logits)
    # Invisible columns become -inf so they sort last among values; the first sort puts visible
    # columns ahead, and the stable value sort keeps that order between equal values.
    values = torch.where(visible, logits, float("-inf"))
    by_visibility = torch.sort(visible.to(torch.int8), dim=1, descending=True, stable=True).indices
    by_value = torch.sort(values.gather(1, by_visibility), dim=1, descending=True, stable=True).indices
    order = by_visibility.gather(1, by_value)[:, : min(k, width)]
    selectable = visible.sum(dim=1, keepdim=True)
    slot = torch.arange(order.shape[1], device=logits.device)
    positions = torch.where(slot < selectable, order - begin, -1)
    if page_table is not None:
        positions = _to_slots(positions, page_table, page_rows, block_size)
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    out[:, : order.shape[1]] = positions.to(torch.int32)
    return out


def _to_slots(positions: torch.Tensor, page_table: torch.Tensor, page_rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """page_table[page_rows[r], p // block_size] * block_size + p % block_size; -1 stays -1, and so is
    every position the table cannot map (the Triton kernel's rule): a page row outside [0, P), a page
    past the table's width, a negative entry. Nothing is clamped onto another row or page."""
    import torch

    rows_in_table, width = page_table.shape
    row = page_rows.long()[:, None]
    page = positions.clamp(min=0) // block_size
    mapped = (positions >= 0) & (row >= 0) & (row < rows_in_table) & (page < width)
    table_rows = page_table.long()[row.clamp(0, rows_in_table - 1).squeeze(1)]  # [rows, M]
    entry = table_rows.gather(1, page.clamp(max=width - 1))
    slots = entry * block_size + positions.clamp(min=0) % block_size
    return torch.where(mapped & (entry >= 0), slots, -1)


BACKENDS = (
    Backend(
        name="torch.reference",
        op=Op.TOPK,
        layout=Layout.ROWS,
        supports=Support(archs=ALL_ARCHS),
        run=topk_indices,
        description="plain torch two-key stable sort: visible first, then by value; NaN never selected",
    ),
)
