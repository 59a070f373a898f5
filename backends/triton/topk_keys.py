"""The Triton top-k's shared pieces: order-preserving integer keys of fp32 logits, the packed
(key, position) candidate, linear value bins and the sampled bracket window, a row's window and its
page-table row, and a position's KV slot. Used by the bracket and split kernels (topk.py) and the
finish and sort kernels (topk_finish.py)."""

from __future__ import annotations

import triton
import triton.language as tl

# The row-streaming kernels (bracket, split, finish) are compiled without assuming anything of the
# logits' row stride. Triton otherwise specialises a stride divisible by 16 (DeepGEMM's 256-aligned
# output, any padded engine buffer), vectorises the loads, and the split's [rows, lanes] tile then
# goes through shared memory: sm_90 SASS 392 -> 784 instructions (6 -> 24 barriers) for the split,
# 9912 -> 11144 for the finish, and top-k 27 -> 49 us at B=128 N=1 L~32K on the H200 (2026-11-30).
ROW_STRIDE_NOT_SPECIALISED = ["stride_row"]


@triton.jit
def _ordered_key(x):
    # fp32 bits -> int32 whose signed order is the float order (-inf lowest, +inf highest): negative
    # floats get their magnitude bits flipped. Signed keys keep every shift and compare in int32,
    # where Triton and its interpreter agree.
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _candidate(key, pos):
    # One int64 per candidate, key in the high half and position in the low, so a single store
    # writes both.
    return (key.to(tl.int64) << 32) | pos.to(tl.int64)


@triton.jit
def _linear_bin(x, lo, inv_width, BINS: tl.constexpr):
    # Monotone non-decreasing in x: a subtraction of and a multiplication by finite constants, then
    # a clamp. Out-of-window values pile into the end bins, which only costs speed. inv_width is
    # finite and > 0 (the host of this function guarantees it), so t is never NaN for a non-NaN x.
    t = (x - lo) * inv_width
    return tl.where(t > 0, tl.where(t < BINS - 1, t, BINS - 1), 0.0).to(tl.int32)


@triton.jit
def _key_value(key):
    # The inverse of _ordered_key (the same bit flip: it keeps the sign bit, so it undoes itself).
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _fine_window(e_lo, e_hi, FINE: tl.constexpr):
    """FINE linear bins over the bracket's finite edges e_lo <= e_hi: (lo, inv_width) for _linear_bin,
    inv_width finite and > 0 whatever the edges. Linear in the value, not in the key: the ordered key
    is logarithmic in the magnitude, and a bracket around 0 would pile its keys into a few key bins."""
    inv_width = FINE / (e_hi - e_lo)
    return e_lo, tl.where((e_hi > e_lo) & (inv_width < 1e30), inv_width, 1e30)


@triton.jit
def _slot_value(pos, pt_row_ptr, pages, HAS_PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr, mask):
    # What is written for relative position pos: pos itself, or its physical KV slot.
    # One return statement: the compiler types every return, pruned branches included.
    value = pos
    if HAS_PAGES:
        page = pos // BLOCK_SIZE
        ok = mask & (page < pages)
        phys = tl.load(pt_row_ptr + page, mask=ok, other=-1)
        value = tl.where(ok & (phys >= 0), phys * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
    return value


@triton.jit
def _threshold_bin(hist, need, NB: tl.constexpr):
    # The highest bin b with (keys in bins >= b) >= need, the count of keys above it, and its size.
    bins = tl.arange(0, NB)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    b = tl.sum((at_or_above >= need).to(tl.int32), axis=0) - 1
    in_bin = tl.sum(tl.where(bins == b, hist, 0), axis=0)
    above = tl.sum(tl.where(bins > b, hist, 0), axis=0)
    return b, above, in_bin


@triton.jit
def _sample_window(src, n, k, BINS: tl.constexpr, SAMPLE: tl.constexpr, Z: tl.constexpr):
    """From SAMPLE keys in runs of 8 spread over the row (few sectors): a linear bin window from the
    sample's mean and top, and values t_lo <= t_hi such that [t_lo, t_hi] holds the k-th largest key
    with high probability (Z standard deviations of the sample count either side, resolved to the
    window's bin edges; an end bin's outer edge is -inf or +inf). Also the bracket's finite edges
    e_lo <= e_hi (the same, without the infinities)."""
    s = tl.arange(0, SAMPLE)
    at = (s // 8) * (n // (SAMPLE // 8)) + s % 8
    in_row = at < n
    sample = tl.load(src + at, mask=in_row, other=float("nan"))
    valid = sample == sample
    finite = tl.abs(sample) < float("inf")  # NaN compares false too
    # Clamped so that the sum cannot overflow; a window that far out only costs speed.
    clamped = tl.where(finite, tl.minimum(tl.maximum(sample, -1e30), 1e30), 0.0)
    count = tl.sum(finite.to(tl.int32), axis=0)
    top = tl.max(tl.where(finite, clamped, -float("inf")), axis=0)
    mean = tl.sum(clamped, axis=0) / tl.maximum(count, 1).to(tl.float32)
    spread = top - mean
    # For k well below the length the k-th largest lies between the mean and the top; the window
    # reaches a little past both. Anything outside piles into an end bin, which costs only speed.
    lo = mean - 0.5 * spread
    inv_width = BINS / tl.where(spread > 0, 1.75 * spread, 1.0)
    ok_window = (count > 0) & (inv_width > 0.0) & (inv_width < 1e30) & (tl.abs(lo) < 1e30)
    lo = tl.where(ok_window, lo, 0.0)
    inv_width = tl.where(ok_window, inv_width, 1.0)

    bins = tl.where(valid, _linear_bin(sample, lo, inv_width, BINS), 0)
    hist = tl.histogram(bins, BINS)
    hist -= tl.where(tl.arange(0, BINS) == 0, SAMPLE - tl.sum(valid.to(tl.int32), axis=0), 0)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    expect = k * tl.sum(in_row.to(tl.float32), axis=0) / n
    margin = Z * tl.sqrt(expect) + 1.0
    b_hi = tl.sum((at_or_above.to(tl.float32) > expect - margin).to(tl.int32), axis=0) - 1
    b_lo = tl.maximum(tl.sum((at_or_above.to(tl.float32) >= expect + margin).to(tl.int32), axis=0) - 1, 0)
    b_hi = tl.maximum(b_hi, b_lo)
    # Bin edges as values; the end bins reach to -inf and +inf (NaN is outside any bracket). The
    # finite edges (e_lo <= e_hi) are where the finish's fine bins go.
    e_lo = lo + b_lo.to(tl.float32) / inv_width
    e_hi = lo + (b_hi + 1).to(tl.float32) / inv_width
    t_lo = tl.where(b_lo > 0, e_lo, -float("inf"))
    t_hi = tl.where(b_hi < BINS - 1, e_hi, float("inf"))
    return t_lo, t_hi, e_lo, e_hi



@triton.jit
def _row_window(row64, lengths_ptr, stride_len, starts_ptr, stride_start, width, HAS_STARTS: tl.constexpr):
    # Visible columns [start, start + n), clamped to the tensor: nothing outside it is ever read.
    start = 0
    if HAS_STARTS:
        start = tl.minimum(tl.maximum(tl.load(starts_ptr + row64 * stride_start), 0), width)
    n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row64 * stride_len), 0), width - start)
    return start, n


@triton.jit
def _page_row(row64, pt_ptr, stride_pt, page_rows_ptr, stride_page_rows, num_pt_rows, pages,
              HAS_PAGES: tl.constexpr):
    # The row's page-table row and its page count; an out-of-table page row gets 0 pages, so every
    # position maps to -1 rather than reading outside the table.
    pt_row = pt_ptr
    if HAS_PAGES:
        page_row = tl.load(page_rows_ptr + row64 * stride_page_rows)
        pages = tl.where((page_row >= 0) & (page_row < num_pt_rows), pages, 0)
        pt_row = pt_ptr + tl.minimum(tl.maximum(page_row, 0), num_pt_rows - 1).to(tl.int64) * stride_pt
    return pt_row, pages
