"""Top-k of the indexer's logits as one Triton kernel: a lengths-aware sampled bracket select with
an exact histogram fallback.

One program owns one row and reads only its visible columns [start, start + length):
- fast path, length <= k (or at most k non-NaN keys): the non-NaN positions in order, then -1;
- sample: SAMPLE keys in runs of 8 spread over the row give a linear bin window (mean and top of
  the sample) and, from the sample's histogram, a value bracket [t_lo, t_hi] that holds the k-th
  largest key with high probability (Z standard deviations of the sample count either side);
- split, the one pass over the row: keys above t_hi go straight to the output, keys inside the
  bracket are appended to a per-row candidate list as one int64 (order-preserving int32 key,
  position). A key's slot is a running count plus its rank in the tile (distinct slots; the order
  is free). If the counts show the bracket missed (more than k above, or fewer than k up to t_lo),
  the row falls back to an exact histogram of all keys over the window's bins, then splits again
  on the threshold bin: correct whatever the data, one more pass when the sample misjudged;
- refine: four 8-bit radix rounds over the candidates' keys find the exact k-th key T and how many
  keys equal to T are still needed; a last scan writes candidates above T and the first of those
  equal to T (ties: any index is fine).
NaN is in no bracket, bin count or list, so it is never selected; -inf is an ordinary (lowest) key.
With a page table the written value is the physical KV slot, computed at the store.
sorted=True orders the result afterwards with torch (descending value, -1 last). Design notes and
the numbers behind them: NOTES.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dispatch.detect import triton_interpreter_on
from dispatch.errors import LayoutError
from dispatch.input_checks import check_topk_inputs


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
    """From SAMPLE keys in runs of 8 spread over the row (few sectors): a linear bin window (lo,
    inv_width) from the sample's mean and top, and values t_lo <= t_hi such that [t_lo, t_hi] holds
    the k-th largest key with high probability (Z standard deviations of the sample count either
    side, resolved to the window's bin edges)."""
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
    # Bin edges as values; the end bins reach to -inf and +inf (NaN is outside any bracket).
    t_lo = tl.where(b_lo > 0, lo + b_lo.to(tl.float32) / inv_width, -float("inf"))
    t_hi = tl.where(b_hi < BINS - 1, lo + (b_hi + 1).to(tl.float32) / inv_width, float("inf"))
    return lo, inv_width, t_lo, t_hi


@triton.jit
def _histogram_pass(src, n, lo, inv_width, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """Exact bin counts of the row's non-NaN keys."""
    offs = tl.arange(0, BLOCK)
    hist = tl.zeros((BINS,), dtype=tl.int32)
    for t in range(0, n, BLOCK):
        idx = t + offs
        x = tl.load(src + idx, mask=idx < n, other=float("nan"))
        valid = x == x
        hist += tl.histogram(tl.where(valid, _linear_bin(x, lo, inv_width, BINS), 0), BINS)
        # Padding and NaN were counted in bin 0: take them out again.
        hist -= tl.where(tl.arange(0, BINS) == 0, BLOCK - tl.sum(valid.to(tl.int32), axis=0), 0)
    return hist


@triton.jit
def _split_pass(src, n, lo, inv_width, c_lo, c_hi, out_row, cand_list, k, pt_row, pages,
                HAS_PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr,
                LANES: tl.constexpr, BY_VALUE: tl.constexpr):
    """Keys above the bracket go to the output (slots past k are dropped: the caller then knows the
    bracket was wrong); keys inside it go to the candidate list. Returns both full counts. The
    bracket is [c_lo, c_hi] in values (BY_VALUE) or in bins of the (lo, inv_width) window. One scan
    of the packed flags gives both running slots (a tile has far fewer than 2^16 keys)."""
    # A tile is [LANES, BLOCK / LANES]: rows of adjacent keys (coalesced loads along axis 1), and the
    # LANES keys of a column held by one thread. Slots need only be distinct (the output order is
    # free), so a key's slot is its column's offset (a scan over BLOCK / LANES column totals, the
    # only cross-thread work) plus its rank inside the column (in-thread adds).
    idx0 = tl.arange(0, LANES)[:, None] * (BLOCK // LANES) + tl.arange(0, BLOCK // LANES)[None, :]
    out_next = 0
    cand_next = 0
    # The next tile is loaded before this one is worked on, so its latency hides behind the work.
    x_next = tl.load(src + idx0, mask=idx0 < n, other=float("nan"))
    for t in range(0, n, BLOCK):
        idx = t + idx0
        x = x_next
        x_next = tl.load(src + (idx + BLOCK), mask=idx + BLOCK < n, other=float("nan"))
        if BY_VALUE:
            # Value bounds: NaN fails every comparison, so it is in neither set.
            hi = x > c_hi
            mid = (x >= c_lo) & (x <= c_hi)
        else:
            # Bins, exactly as the histogram pass counted them.
            valid = x == x
            b = _linear_bin(x, lo, inv_width, BINS)
            hi = valid & (b > c_hi)
            mid = valid & (b >= c_lo) & (b <= c_hi)
        flags = hi.to(tl.int32) + (mid.to(tl.int32) << 16)
        column = tl.sum(flags, axis=0)
        packed = (tl.cumsum(column, axis=0) - column)[None, :] + tl.cumsum(flags, axis=0)
        out_slot = out_next + (packed & 0xFFFF) - 1
        cand_slot = cand_next + (packed >> 16) - 1
        emit = hi & (out_slot < k)
        tl.store(out_row + out_slot, _slot_value(idx, pt_row, pages, HAS_PAGES, BLOCK_SIZE, emit), mask=emit)
        tl.store(cand_list + cand_slot, _candidate(_ordered_key(x), idx), mask=mid)
        total = tl.sum(column, axis=0)
        out_next += total & 0xFFFF
        cand_next += total >> 16
    return out_next, cand_next


@triton.jit
def _write_all(src, n, out_row, k, pt_row, pages,
               HAS_PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Every non-NaN key is selected: its positions in order, then -1 up to k."""
    offs = tl.arange(0, BLOCK)
    written = 0
    for t in range(0, n, BLOCK):
        idx = t + offs
        x = tl.load(src + idx, mask=idx < n, other=float("nan"))
        valid = x == x
        slot = written + tl.cumsum(valid.to(tl.int32), axis=0) - 1
        tl.store(out_row + slot, _slot_value(idx, pt_row, pages, HAS_PAGES, BLOCK_SIZE, valid), mask=valid)
        written += tl.sum(valid.to(tl.int32), axis=0)
    for t in range(written, k, BLOCK):
        idx = t + offs
        tl.store(out_row + idx, tl.full((BLOCK,), -1, tl.int32), mask=idx < k)


@triton.jit
def _finish_from_candidates(cand_list, in_bin, above, out_row, k, pt_row, pages,
                            HAS_PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                            RADIX: tl.constexpr, NB: tl.constexpr, LANES: tl.constexpr):
    """The output holds `above` keys; the k - above largest of the candidates fill the rest. NB =
    max(2^RADIX, 32) histogram bins (Triton's ballot lowering wants at least a warp's worth)."""
    offs = tl.arange(0, BLOCK)
    # The candidates' smallest and largest keys: the digits they all share need no histogram (a
    # narrow bracket shares sign, exponent and often a few mantissa bits).
    kmin = tl.full((), 2147483647, tl.int32)
    kmax = tl.full((), -2147483648, tl.int32)
    for t in range(0, in_bin, BLOCK):
        idx = t + offs
        live = idx < in_bin
        key = (tl.load(cand_list + idx, mask=live, other=0) >> 32).to(tl.int32)
        kmin = tl.minimum(kmin, tl.min(tl.where(live, key, 2147483647), axis=0))
        kmax = tl.maximum(kmax, tl.max(tl.where(live, key, -2147483648), axis=0))
    # Radix rounds over the candidates' keys, RADIX bits at a time from the top (the top digit of a
    # signed key is biased by 2^(RADIX-1) so that digit order is key order): T, the k-th largest
    # key, and how many keys equal to T are still needed. Wider digits mean fewer rounds but a
    # costlier histogram per key when tl.histogram lowers to warp ballots (Triton before 3.7).
    need = k - above
    prefix = 0
    for r in tl.static_range(32 // RADIX):
        shift = 32 - RADIX * (r + 1)
        if (kmin >> shift) == (kmax >> shift):
            prefix = (kmin >> shift) << shift  # every candidate has these digits; none is above
        else:
            digits = tl.zeros((NB,), dtype=tl.int32)
            for t in range(0, in_bin, BLOCK):
                idx = t + offs
                live = idx < in_bin
                key = (tl.load(cand_list + idx, mask=live, other=0) >> 32).to(tl.int32)
                if r == 0:
                    d = (key >> shift) + (1 << (RADIX - 1))
                else:
                    live = live & ((key >> (shift + RADIX)) == (prefix >> (shift + RADIX)))
                    d = (key >> shift) & ((1 << RADIX) - 1)
                digits += tl.histogram(tl.where(live, d, 0), NB)
                digits -= tl.where(tl.arange(0, NB) == 0, BLOCK - tl.sum(live.to(tl.int32), axis=0), 0)
            db, d_above, _ = _threshold_bin(digits, need, NB)
            need -= d_above
            if r == 0:
                prefix = (db - (1 << (RADIX - 1))) << shift
            else:
                prefix = prefix | (db << shift)

    # Last scan: candidates above T, then the first `need` equal to T (ties: any index will do).
    # Column-major tiles as in the split pass; slots need only be distinct.
    idx0 = tl.arange(0, LANES)[:, None] * (BLOCK // LANES) + tl.arange(0, BLOCK // LANES)[None, :]
    gt_next = above
    eq_next = k - need
    for t in range(0, in_bin, BLOCK):
        idx = t + idx0
        live = idx < in_bin
        entry = tl.load(cand_list + idx, mask=live, other=0)
        key = (entry >> 32).to(tl.int32)
        gt = live & (key > prefix)
        eq = live & (key == prefix)
        flags = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
        column = tl.sum(flags, axis=0)
        packed = (tl.cumsum(column, axis=0) - column)[None, :] + tl.cumsum(flags, axis=0)
        eq_rank = eq_next + (packed >> 16) - 1
        slot = tl.where(gt, gt_next + (packed & 0xFFFF) - 1, eq_rank)
        take = (gt | (eq & (eq_rank < k))) & (slot < k)  # slot < k always holds; the mask keeps stores in bounds regardless
        pos = entry.to(tl.int32)  # the low half
        tl.store(out_row + slot, _slot_value(pos, pt_row, pages, HAS_PAGES, BLOCK_SIZE, take), mask=take)
        total = tl.sum(column, axis=0)
        gt_next += total & 0xFFFF
        eq_next += total >> 16


@triton.jit
def _topk_kernel(
    logits_ptr, stride_row, lengths_ptr, stride_len, starts_ptr, stride_start,
    out_ptr, cand_ptr, stride_cand, pt_ptr, stride_pt, page_rows_ptr, stride_page_rows,
    width, num_pt_rows, pages, k,
    HAS_STARTS: tl.constexpr, HAS_PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr, BINS: tl.constexpr, SAMPLE: tl.constexpr, Z: tl.constexpr, LANES: tl.constexpr,
    RADIX: tl.constexpr, RADIX_BINS: tl.constexpr,
):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    # Visible columns [start, start + n), clamped to the tensor: nothing outside it is ever read.
    start = 0
    if HAS_STARTS:
        start = tl.minimum(tl.maximum(tl.load(starts_ptr + row64 * stride_start), 0), width)
    n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row64 * stride_len), 0), width - start)
    src = logits_ptr + row64 * stride_row + start
    out_row = out_ptr + row64 * k
    cand_list = cand_ptr + row64 * stride_cand
    pt_row = pt_ptr
    if HAS_PAGES:
        page_row = tl.load(page_rows_ptr + row64 * stride_page_rows)
        # An out-of-table page row maps every position to -1 rather than reading outside the table.
        pages = tl.where((page_row >= 0) & (page_row < num_pt_rows), pages, 0)
        pt_row = pt_ptr + tl.minimum(tl.maximum(page_row, 0), num_pt_rows - 1).to(tl.int64) * stride_pt

    take_all = n <= k
    above = n * 0
    in_bin = n * 0
    if n > k:
        # Optimistic: bins from a sample, one pass over the row.
        lo, inv_width, t_lo, t_hi = _sample_window(src, n, k, BINS, SAMPLE, Z)
        above, in_bin = _split_pass(src, n, lo, inv_width, t_lo, t_hi, out_row, cand_list, k,
                                    pt_row, pages, HAS_PAGES, BLOCK_SIZE, BLOCK, BINS, LANES, True)
        if (above > k) | (above + in_bin < k):
            # The sample misjudged the row (or NaN hides keys): exact counts, then split again.
            tl.debug_barrier()  # the second split rewrites slots other threads wrote
            hist = _histogram_pass(src, n, lo, inv_width, BLOCK, BINS)
            take_all = tl.sum(hist, axis=0) <= k
            if tl.sum(hist, axis=0) > k:
                tb, _, _ = _threshold_bin(hist, k, BINS)
                above, in_bin = _split_pass(src, n, lo, inv_width, tb, tb, out_row, cand_list, k,
                                            pt_row, pages, HAS_PAGES, BLOCK_SIZE, BLOCK, BINS, LANES, False)
    if take_all:
        _write_all(src, n, out_row, k, pt_row, pages, HAS_PAGES, BLOCK_SIZE, BLOCK)
    else:
        tl.debug_barrier()  # the candidate list was written by other threads of this program
        _finish_from_candidates(cand_list, in_bin, above, out_row, k, pt_row, pages,
                                HAS_PAGES, BLOCK_SIZE, BLOCK, RADIX, RADIX_BINS, LANES)


def topk_indices(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    starts: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    page_rows: torch.Tensor | None = None,
    block_size: int = 64,
    sorted: bool = False,
) -> torch.Tensor:
    """int32 [rows, k]: positions (relative to starts) of each row's k largest visible non-NaN logits,
    -1 past the selectable count; physical KV slots with page_table. Never syncs the device."""
    config = launch_config(*logits.shape) if logits.dim() == 2 else launch_config(0, 0)
    return launch(logits, lengths, k, starts=starts, page_table=page_table, page_rows=page_rows,
                  block_size=block_size, sorted=sorted, **config)


def launch_config(rows: int, width: int) -> dict:
    """Tile and window parameters (see `launch`) and num_warps. One program serves one row, so many
    rows want small programs (several per SM hide each other's latency) and few rows want large
    ones. The interpreter pays per operation, not per element: there tiles are as large as the row
    allows."""
    if triton_interpreter_on():
        block = min(4096, max(256, triton.next_power_of_2(max(width, 1))))
        return {"block": block, "bins": 64, "sample": 1024, "z": 4.0, "lanes": 8, "radix": 8,
                "num_warps": 1}
    # Reasoned from sm_90 SASS (about 50 instructions per key per thread in the split pass; 80 and
    # 83 registers), not yet measured: tools/probe_topk.py sweeps these on the H200.
    if rows >= 256:
        return {"block": 2048, "bins": 64, "sample": 4096, "z": 4.0, "lanes": 8, "radix": 8, "num_warps": 8}
    return {"block": 4096, "bins": 64, "sample": 4096, "z": 4.0, "lanes": 8, "radix": 8, "num_warps": 16}


def launch(logits, lengths, k, *, starts=None, page_table=None, page_rows=None, block_size=64, sorted=False,
           block, bins, sample, z, lanes, radix, num_warps):
    """Check the inputs, then run the kernel with an explicit config (the probe calls this directly).

    block: keys per tile (a power of two, at most 2^15: the packed scan holds two 16-bit counts);
    bins: pass-1 bins (a power of two >= 32); lanes: keys per thread-column of a tile (a power of
    two dividing block); radix: bits per refine round (4 or 8); sample: keys sampled for the window (a power of two
    >= 8); z: the sampled bracket's half-width in standard deviations (huge: every key a
    candidate; very negative: the sample is always wrong and the exact histogram runs)."""
    if not (_pow2(block) and block <= 1 << 15 and _pow2(bins) and bins >= 32 and _pow2(sample) and sample >= 8
            and _pow2(lanes) and lanes < block and radix in (4, 8)):
        raise ValueError(f"block={block}, bins={bins}, sample={sample}, lanes={lanes}, radix={radix}: powers of "
                         "two, block <= 32768, bins >= 32, sample >= 8, lanes < block, radix 4 or 8")
    rows, width = _check(logits, lengths, k, starts, page_table, page_rows, block_size)
    out = torch.empty((rows, k), dtype=torch.int32, device=logits.device)
    if rows == 0:
        return out
    # Per-row candidate lists: never initialised, only the written prefix is read.
    cand = torch.empty((rows, max(width, 1)), dtype=torch.int64, device=logits.device)
    fuse_pages = page_table is not None and not sorted
    dummy = out  # stands in for absent optional tensors; never dereferenced (constexpr flags)
    _topk_kernel[(rows,)](
        logits, logits.stride(0), lengths, lengths.stride(0),
        starts if starts is not None else dummy, starts.stride(0) if starts is not None else 0,
        out, cand, cand.stride(0),
        page_table if fuse_pages else dummy, page_table.stride(0) if fuse_pages else 0,
        page_rows if fuse_pages else dummy, page_rows.stride(0) if fuse_pages else 0,
        width, page_table.shape[0] if fuse_pages else 1, page_table.shape[1] if fuse_pages else 0, k,
        HAS_STARTS=starts is not None, HAS_PAGES=fuse_pages, BLOCK_SIZE=block_size,
        BLOCK=block, BINS=bins, SAMPLE=sample, Z=z, LANES=lanes, RADIX=radix, RADIX_BINS=max(1 << radix, 32),
        num_warps=num_warps,
    )
    if sorted:
        out = _sort_descending(logits, out, starts)
        if page_table is not None:
            out = _page_transform(out, page_table, page_rows, block_size)
    return out


def _sort_descending(logits, out, starts):
    # Descending by value, -1 slots last: a stable sort by value, then a stable sort by validity.
    valid = out >= 0
    cols = out.clamp(min=0).long()
    if starts is not None:
        cols = cols + starts.long()[:, None]
    values = torch.where(valid, logits.gather(1, cols.clamp(max=max(logits.shape[1] - 1, 0))), float("-inf"))
    order = torch.sort(values, dim=1, descending=True, stable=True).indices
    out = out.gather(1, order)
    order = torch.sort((out >= 0).to(torch.int8), dim=1, descending=True, stable=True).indices
    return out.gather(1, order)


def _page_transform(out, page_table, page_rows, block_size):
    valid = out >= 0
    pos = out.clamp(min=0).long()
    table_rows = page_table[page_rows.long()]
    slots = table_rows.gather(1, (pos // block_size).clamp(max=page_table.shape[1] - 1)) * block_size + pos % block_size
    return torch.where(valid, slots, -1).to(torch.int32)


def _check(logits, lengths, k, starts, page_table, page_rows, block_size) -> tuple[int, int]:
    """The contract's checks (shared by every top-k backend), then what this kernel adds: one device,
    and a page table contiguous along its pages (a row is read as a flat array)."""
    check_topk_inputs(logits, lengths, k, starts=starts, page_table=page_table, page_rows=page_rows,
                      block_size=block_size)
    if page_table is not None and page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise LayoutError(f"page_table must be contiguous along its pages; got strides {list(page_table.stride())}")
    tensors = [t for t in (logits, lengths, starts, page_table, page_rows) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise LayoutError(f"top-k tensors must be on one device; got {sorted(str(t.device) for t in tensors)}")
    return logits.shape


def _pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0
