"""A one-launch bounds guard for paged-logits kernels that cannot check indices themselves (DeepGEMM).

Per row it reads the lengths and the table entries within the logits' width, and writes
- a safe copy of those entries (an out-of-range entry becomes block 0, so the kernel never follows it),
- per token, the length to mask with (0 for a poisoned token) and the fill value (-inf, or NaN for a
  poisoned token), so the caller's one masking pass both hides positions past a length and poisons rows,
- BAD_PAGE / LENGTH_PAST_BOUND into the plan's error flags.
A token is poisoned when a page it needs is out of range or its length passes max_context_len, as in
the Triton logits kernel (backends/triton/paged_mqa_logits.py). No host-device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dispatch.bounds import BAD_PAGE, LENGTH_PAST_BOUND

SCAN_PAGES = 128


@triton.jit
def _page_guard_kernel(
    ctx_ptr,  # int32 [R, N]
    table_ptr,  # int32 [R, M], M >= pages
    safe_table_ptr,  # int32 [R, pages], contiguous
    mask_lens_ptr,  # int32 [R * N]: the length to mask with; 0 for a poisoned token
    fill_ptr,  # fp32 [R * N]: what masked positions get; NaN for a poisoned token
    error_flags_ptr,  # int32 [1]
    num_blocks,  # a table entry must lie in [0, num_blocks)
    max_context_len,
    pages,  # ceil(max_context_len / BLOCK_KV): the table columns a kernel may read
    stride_ctx_row,
    stride_table_row,
    N: tl.constexpr,
    N_BLOCK: tl.constexpr,  # N rounded up to a power of two
    BLOCK_KV: tl.constexpr,
    SCAN_PAGES: tl.constexpr,
    BAD_PAGE: tl.constexpr,
    LENGTH_PAST_BOUND: tl.constexpr,
):
    row = tl.program_id(0)
    tok = tl.arange(0, N_BLOCK)
    tok_ok = tok < N
    ctx = tl.load(ctx_ptr + row * stride_ctx_row + tok, mask=tok_ok, other=0)
    needed = tl.minimum(tl.cdiv(tl.maximum(ctx, 0), BLOCK_KV), pages)
    first_bad = tl.full((SCAN_PAGES,), 2**30, tl.int32)  # per lane, the lowest out-of-range page seen
    for first in range(0, pages, SCAN_PAGES):
        page = first + tl.arange(0, SCAN_PAGES)
        in_width = page < pages
        entry = tl.load(table_ptr + row * stride_table_row + page, mask=in_width, other=0)
        out_of_range = (entry < 0) | (entry >= num_blocks)
        tl.store(safe_table_ptr + row * pages + page, tl.where(out_of_range, 0, entry), mask=in_width)
        first_bad = tl.minimum(first_bad, tl.where(out_of_range, page, 2**30))
    page_fault = (needed > tl.min(first_bad, axis=0)).to(tl.int32)  # [N_BLOCK]: the token needs a bad page
    past_bound = tok_ok & (ctx > max_context_len)
    poisoned = tok_ok & ((page_fault > 0) | past_bound)
    tl.store(mask_lens_ptr + row * N + tok, tl.where(poisoned, 0, ctx), mask=tok_ok)
    tl.store(fill_ptr + row * N + tok, tl.where(poisoned, float("nan"), float("-inf")), mask=tok_ok)
    flags = tl.where(tl.max(page_fault, axis=0) > 0, BAD_PAGE, 0)
    flags |= tl.where(tl.max(past_bound.to(tl.int32), axis=0) > 0, LENGTH_PAST_BOUND, 0)
    tl.atomic_or(error_flags_ptr, flags, mask=flags != 0)


@dataclass(frozen=True)
class Guarded:
    safe_table: torch.Tensor  # int32 [R, pages]: every entry in [0, num_blocks)
    mask_lens: torch.Tensor  # int32 [R * N]
    fill: torch.Tensor  # fp32 [R * N]


def guard_pages(
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_blocks: int,
    max_context_len: int,
    block_kv: int,
    error_flags: torch.Tensor,
) -> Guarded:
    """One launch over the rows; see the module docstring."""
    rows, next_n = context_lens.shape
    pages = triton.cdiv(max_context_len, block_kv)
    device = context_lens.device
    guarded = Guarded(
        safe_table=torch.empty((rows, pages), dtype=torch.int32, device=device),
        mask_lens=torch.empty(rows * next_n, dtype=torch.int32, device=device),
        fill=torch.empty(rows * next_n, dtype=torch.float32, device=device),
    )
    if rows:
        _page_guard_kernel[(rows,)](
            ctx_ptr=context_lens,
            table_ptr=block_table,
            safe_table_ptr=guarded.safe_table,
            mask_lens_ptr=guarded.mask_lens,
            fill_ptr=guarded.fill,
            error_flags_ptr=error_flags,
            num_blocks=num_blocks,
            max_context_len=max_context_len,
            pages=pages,
            stride_ctx_row=context_lens.stride(0),
            stride_table_row=block_table.stride(0),
            N=next_n,
            N_BLOCK=triton.next_power_of_2(next_n),
            BLOCK_KV=block_kv,
            SCAN_PAGES=SCAN_PAGES,
            BAD_PAGE=BAD_PAGE,
            LENGTH_PAST_BOUND=LENGTH_PAST_BOUND,
        )
    return guarded
