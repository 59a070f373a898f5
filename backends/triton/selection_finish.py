"""The top-k contract's finish of an engine kernel's raw selection, in one launch: what
backends/adapted_topk.finish does with five to eight torch ops (each a pass over [rows, k]), which at
extend sizes (4096 x 2048) cost more than the engines' kernels themselves.

For each slot of raw int32 [rows, k] (positions relative to starts[r], -1 for none): keep p when
0 <= p < lengths[r] and logits[r, starts[r] + p] is not NaN, else -1; with a page table, p becomes
page_table[page_rows[r], p // block_size] * block_size + p % block_size (the page index clamped to the
table, so nothing outside it is read). Written in place over `raw`. One program per (row, block of k).

It follows the engine kernel that wrote `raw`, launched with PDL where the GPU has it
(backends/shared/dependent_launch.py): its programs start while that kernel finishes and wait for it
before the first read. The page lookup does not wait for the NaN test: both loads depend on the
position alone, so they are in flight together (the NaN mask is applied to the result).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.triton.dependent_launch import pdl_options, wait_previous_then_launch_next

BLOCK = 1024


@triton.jit
def _finish_kernel(raw_ptr, logits_ptr, lens_ptr, starts_ptr, table_ptr, table_rows_ptr, k, stride_raw,
                   stride_logits, stride_table, table_width, block_size, HAS_STARTS: tl.constexpr,
                   HAS_TABLE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_previous_then_launch_next(PDL)  # every program, before any read: raw is the previous kernel's output
    row = tl.program_id(0)
    slots = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_k = slots < k
    raw_row = raw_ptr + row.to(tl.int64) * stride_raw
    p = tl.load(raw_row + slots, mask=in_k, other=-1)
    length = tl.load(lens_ptr + row)
    start = tl.load(starts_ptr + row) if HAS_STARTS else 0
    in_row = in_k & (p >= 0) & (p < length)
    value = tl.load(logits_ptr + row.to(tl.int64) * stride_logits + start + p, mask=in_row, other=0.0)
    if HAS_TABLE:
        table_row = tl.load(table_rows_ptr + row).to(tl.int64)
        page = tl.minimum(p // block_size, table_width - 1)
        physical = tl.load(table_ptr + table_row * stride_table + page, mask=in_row, other=0)
        p = physical * block_size + p % block_size
    keep = in_row & (value == value)  # NaN is never selected
    tl.store(raw_row + slots, tl.where(keep, p, -1), mask=in_k)


def finish_in_place(raw: torch.Tensor, logits: torch.Tensor, lengths: torch.Tensor, *,
                    starts: torch.Tensor | None = None, page_table: torch.Tensor | None = None,
                    page_rows: torch.Tensor | None = None, block_size: int = 64) -> torch.Tensor:
    """`raw` finished in place (see the module docstring) and returned. Inputs are the adapter's own,
    already checked (check_topk_inputs) and lengths clamped to each row's window."""
    rows, k = raw.shape
    if rows == 0 or k == 0:
        return raw
    has_table = page_table is not None
    grid = (rows, triton.cdiv(k, BLOCK))
    _finish_kernel[grid](
        raw, logits, lengths, starts if starts is not None else lengths, page_table if has_table else raw,
        page_rows if has_table else lengths, k, raw.stride(0), logits.stride(0),
        page_table.stride(0) if has_table else 0, page_table.shape[1] if has_table else 1, block_size,
        HAS_STARTS=starts is not None, HAS_TABLE=has_table, BLOCK=BLOCK, num_warps=4, **pdl_options(raw.device),
    )
    return raw
