"""NaN in every column of the rows the page guard poisoned, and nothing else written: what a paged
logits backend still owes the top-k when asked for no -inf tail (clean_logits=False). DeepGEMM scores
a poisoned token through the guard's safe table (block 0), so its row must be overwritten; the
masking pass that does it with the tail reads and writes every logit, this launch one word per row.
One program per row: an unpoisoned row's program loads its length and exits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dispatch.contract import LayoutError


@triton.jit
def _nan_poisoned_rows_kernel(lens_ptr, out_ptr, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if tl.load(lens_ptr + row) < 0:  # the guard's mark: -1 for a poisoned token
        out_row = out_ptr + row.to(tl.int64) * stride_out
        offs = tl.arange(0, BLOCK)
        nan = tl.full((BLOCK,), float("nan"), tl.float32)
        for start in range(0, width, BLOCK):
            tl.store(out_row + start + offs, nan, mask=start + offs < width)


def nan_poisoned_rows(logits: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Write NaN across row r of fp32 logits [rows, W] wherever lens.flatten()[r] < 0, in place; returns
    logits. No host-device sync."""
    rows = logits.shape[0] if logits.dim() == 2 else -1
    if logits.dtype != torch.float32 or rows < 0 or logits.stride(1) != 1:
        raise LayoutError(f"logits must be fp32 [rows, W] with unit column stride; got {logits.dtype} "
                          f"{list(logits.shape)}, strides {list(logits.stride())}")
    if lens.dtype != torch.int32 or lens.numel() != rows or not lens.is_contiguous() or lens.device != logits.device:
        raise LayoutError(f"lens must be contiguous int32 with one entry per logits row ({rows}) on "
                          f"{logits.device}; got {lens.dtype} {list(lens.shape)} on {lens.device}")
    if rows and logits.shape[1]:
        _nan_poisoned_rows_kernel[(rows,)](lens, logits, logits.stride(0), logits.shape[1], BLOCK=1024, num_warps=4)
    return logits
