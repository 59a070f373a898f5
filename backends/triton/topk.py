"""Top-k of the indexer's logits in Triton: a lengths-aware sampled bracket select, split over many
programs per row, with an exact radix fallback. Three launches, no host sync (four with sorted=True):

1. bracket (one program per row): SAMPLE keys in runs of 8 spread over the row give a linear bin
   window and, from the sample's histogram, a value bracket [t_lo, t_hi] that holds the k-th largest
   key with high probability (Z standard deviations of the sample count either side). It also zeroes
   the row's packed counter (above | candidates << 32) and its fine histogram, and stores the fine
   bins' window (FINE linear bins over the bracket's finite edges).
2. split (rows x chunks programs, the one pass over the logits): each program classifies its chunk of
   BLOCK * TILES keys, tile by tile: keys above t_hi go straight to the output, keys inside the
   bracket to the row's capped candidate list (one int64: order-preserving key << 32 | position).
   A tile takes its slots with ONE 64-bit atomic add of both counts on the row's counter (the old
   value is the base) plus each key's rank in the tile; slots at or past k (output) or CAP (list) are
   counted but not written. Many independent programs per SM keep many loads in flight, which one
   program walking a whole row could not.
3. finish (one program per row): rows of length <= k write their non-NaN positions then -1. Else, if
   the counts show the bracket held (above <= k <= above + candidates, candidates <= CAP), two
   levels: each candidate is counted into its fine bin (one atomic add into the row's histogram),
   one scan finds the bin b holding the (k - above)-th largest, a compaction writes every candidate
   of the bins above b, and b's own few entries are ranked pairwise (at most TIES; past that, radix
   rounds over b's entries only). If the bracket did not hold (the sample misjudged the row, NaN hid
   keys, or the list overflowed), radix rounds run over the row itself: exact whatever the data, a
   few more passes over that row only. Correctness never depends on the sample or the bins, only
   speed. With a page table, the output prefix written by the split is turned into KV slots here (and
   the finish's own stores go through the table). FINE = 0 keeps round 2's finish (radix rounds over
   the whole list) for A/B measurements.
4. sort (sorted=True only, one program per row): the k chosen (key, position) pairs packed into int64
   and sorted descending with tl.sort, -1s last, then the page transform.
NaN fails every bracket compare and is no radix entry, so it is never selected; -inf is an ordinary
(lowest) key. Scratch (counters, brackets, candidate lists, fine windows and histograms, threshold
bins' entries) is a per-device workspace cached by (rows rounded up to a power of two, CAP, FINE,
TIES) and never freed, so a CUDA graph captured after one eager
call at its shape allocates nothing. Design notes and the numbers behind them: NOTES.md.
"""

from __future__ import annotations

import functools

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


@triton.jit
def _bracket_kernel(
    logits_ptr, stride_row, lengths_ptr, stride_len, starts_ptr, stride_start, bracket_ptr, counts_ptr,
    window_ptr, hist_ptr, width, k,
    HAS_STARTS: tl.constexpr, BINS: tl.constexpr, SAMPLE: tl.constexpr, Z: tl.constexpr, FINE: tl.constexpr,
):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    start, n = _row_window(row64, lengths_ptr, stride_len, starts_ptr, stride_start, width, HAS_STARTS)
    tl.store(counts_ptr + row64, tl.zeros((), tl.int64))
    if n > k:
        src = logits_ptr + row64 * stride_row + start
        t_lo, t_hi, e_lo, e_hi = _sample_window(src, n, k, BINS, SAMPLE, Z)
        tl.store(bracket_ptr + 2 * row64, t_lo)
        tl.store(bracket_ptr + 2 * row64 + 1, t_hi)
        if FINE > 0:
            # The finish's fine bins: their window over the bracket, and the row's histogram zeroed.
            fine_lo, fine_inv = _fine_window(e_lo, e_hi, FINE)
            tl.store(window_ptr + 2 * row64, fine_lo)
            tl.store(window_ptr + 2 * row64 + 1, fine_inv)
            tl.store(hist_ptr + row64 * FINE + tl.arange(0, FINE), tl.zeros((FINE,), tl.int32))


@triton.jit
def _split_kernel(
    logits_ptr, stride_row, lengths_ptr, stride_len, starts_ptr, stride_start, bracket_ptr, counts_ptr,
    out_ptr, cand_ptr, stride_cand, width, k, cap,
    HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr, LANES: tl.constexpr,
):
    """One chunk of BLOCK * TILES keys of one row: keys above the bracket to the output, keys inside
    it to the candidate list, both at slots from the row's counter."""
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    first = tl.program_id(1) * (BLOCK * TILES)
    start, n = _row_window(row64, lengths_ptr, stride_len, starts_ptr, stride_start, width, HAS_STARTS)
    if (n > k) & (first < n):
        src = logits_ptr + row64 * stride_row + start
        t_lo = tl.load(bracket_ptr + 2 * row64)
        t_hi = tl.load(bracket_ptr + 2 * row64 + 1)
        out_row = out_ptr + row64 * k
        cand_list = cand_ptr + row64 * stride_cand
        # A tile is [BLOCK / LANES, LANES]: columns of adjacent keys (coalesced loads along axis 0), and
        # the LANES keys of a row held by one thread. Slots need only be distinct (the output order is
        # free), so a key's slot is its row's offset (a scan over BLOCK / LANES row totals, the only
        # cross-thread work) plus its rank inside the row (in-thread adds). Axis 0 is the contiguous
        # one so that the scattered stores (no contiguity on either axis, which Triton's coalescing
        # orders axis 0 first) keep the loads' layout instead of a round trip through shared memory.
        idx0 = first + tl.arange(0, BLOCK // LANES)[:, None] + tl.arange(0, LANES)[None, :] * (BLOCK // LANES)
        x_next = tl.load(src + idx0, mask=idx0 < n, other=float("nan"))
        for i in tl.static_range(TILES):
            idx = idx0 + i * BLOCK
            x = x_next
            if i + 1 < TILES:
                # The next tile is requested before this one is worked on: its latency hides behind
                # the work and the atomic.
                x_next = tl.load(src + (idx + BLOCK), mask=idx + BLOCK < n, other=float("nan"))
            # Value bounds: NaN (and the padding past n) fails every comparison, so it is in neither set.
            hi = x > t_hi
            mid = (x >= t_lo) & (x <= t_hi)
            # One scan of packed flags gives both ranks (a tile has far fewer than 2^16 keys).
            flags = hi.to(tl.int32) + (mid.to(tl.int32) << 16)
            line = tl.sum(flags, axis=1)
            packed = (tl.cumsum(line, axis=0) - line)[:, None] + tl.cumsum(flags, axis=1)
            total = tl.sum(line, axis=0)
            # Both counts in one atomic: above in the low word, candidates in the high one (neither
            # reaches 2^31, so the low word never carries).
            add = (total & 0xFFFF).to(tl.int64) + ((total >> 16).to(tl.int64) << 32)
            base = tl.atomic_add(counts_ptr + row64, add, sem="relaxed")
            out_slot = (base & 0xFFFFFFFF).to(tl.int32) + (packed & 0xFFFF) - 1
            cand_slot = (base >> 32).to(tl.int32) + (packed >> 16) - 1
            tl.store(out_row + out_slot, idx, mask=hi & (out_slot < k))
            tl.store(cand_list + cand_slot, _candidate(_ordered_key(x), idx), mask=mid & (cand_slot < cap))


@triton.jit
def _entries(base, idx, count, key_min, key_max, FROM_ROW: tl.constexpr):
    """(key, position, live) of entries idx of a radix source: the row's logits themselves (NaN and
    idx >= count not live) or a candidate list of count packed entries; only keys inside [key_min,
    key_max] are live."""
    live = idx < count
    if FROM_ROW:
        x = tl.load(base + idx, mask=live, other=float("nan"))
        live = live & (x == x)
        key = _ordered_key(x)
        pos = idx
    else:
        entry = tl.load(base + idx, mask=live, other=0)
        key = (entry >> 32).to(tl.int32)
        pos = entry.to(tl.int32)  # the low half
    return key, pos, live & (key >= key_min) & (key <= key_max)


@triton.jit
def _select(base, count, above, key_min, key_max, out_row, k, pt_row, pages, FROM_ROW: tl.constexpr,
            HAS_PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
            RADIX: tl.constexpr, NB: tl.constexpr, LANES: tl.constexpr):
    """The output holds `above` keys; the k - above largest live entries of the source (those with keys
    in [key_min, key_max]) fill the rest (the caller guarantees there are at least that many).
    NB = max(2^RADIX, 32) histogram bins (Triton's ballot lowering wants at least a warp's worth)."""
    offs = tl.arange(0, BLOCK)
    # The entries' smallest and largest keys: the digits they all share need no histogram (a narrow
    # bracket shares sign, exponent and often a few mantissa bits).
    kmin = tl.full((), 2147483647, tl.int32)
    kmax = tl.full((), -2147483648, tl.int32)
    for t in range(0, count, BLOCK):
        key, _, live = _entries(base, t + offs, count, key_min, key_max, FROM_ROW)
        kmin = tl.minimum(kmin, tl.min(tl.where(live, key, 2147483647), axis=0))
        kmax = tl.maximum(kmax, tl.max(tl.where(live, key, -2147483648), axis=0))
    # Radix rounds RADIX bits at a time from the top (the top digit of a signed key is biased by
    # 2^(RADIX-1) so that digit order is key order): T, the k-th largest key, and how many keys
    # equal to T are still needed. Wider digits mean fewer rounds but a costlier histogram per key
    # when tl.histogram lowers to warp ballots (Triton before 3.7).
    need = k - above
    prefix = 0
    for r in tl.static_range(32 // RADIX):
        shift = 32 - RADIX * (r + 1)
        if (kmin >> shift) == (kmax >> shift):
            prefix = (kmin >> shift) << shift  # every entry has these digits; none is above
        else:
            digits = tl.zeros((NB,), dtype=tl.int32)
            for t in range(0, count, BLOCK):
                key, _, live = _entries(base, t + offs, count, key_min, key_max, FROM_ROW)
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

    # Last scan: entries above T, then the first `need` equal to T (ties: any index will do).
    # Tiles laid out as in the split (axis 0 contiguous, a thread's LANES entries along axis 1);
    # slots need only be distinct.
    idx0 = tl.arange(0, BLOCK // LANES)[:, None] + tl.arange(0, LANES)[None, :] * (BLOCK // LANES)
    gt_next = above
    eq_next = k - need
    for t in range(0, count, BLOCK):
        key, pos, live = _entries(base, t + idx0, count, key_min, key_max, FROM_ROW)
        gt = live & (key > prefix)
        eq = live & (key == prefix)
        flags = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
        line = tl.sum(flags, axis=1)
        packed = (tl.cumsum(line, axis=0) - line)[:, None] + tl.cumsum(flags, axis=1)
        eq_rank = eq_next + (packed >> 16) - 1
        slot = tl.where(gt, gt_next + (packed & 0xFFFF) - 1, eq_rank)
        take = (gt | (eq & (eq_rank < k))) & (slot < k)  # slot < k always holds; the mask keeps stores in bounds regardless
        tl.store(out_row + slot, _slot_value(pos, pt_row, pages, HAS_PAGES, BLOCK_SIZE, take), mask=take)
        total = tl.sum(line, axis=0)
        gt_next += total & 0xFFFF
        eq_next += total >> 16


@triton.jit
def _count_live(src, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    live = 0
    for t in range(0, n, BLOCK):
        x = tl.load(src + t + offs, mask=t + offs < n, other=float("nan"))
        live += tl.sum((x == x).to(tl.int32), axis=0)
    return live


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
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _crossing_bin(hist, total, need, NB: tl.constexpr):
    """For 1 <= need <= total = sum(hist), bins in ascending key order: the bin b holding the need-th
    largest entry, the entries in bins above b, and b's own. The one bin with at_or_above >= need >
    at_or_above - hist is b, so one scan and one (three-operand) reduction find all three."""
    at_or_above = total - tl.cumsum(hist, axis=0) + hist
    here = (at_or_above >= need) & (at_or_above - hist < need)
    return tl.reduce((tl.where(here, tl.arange(0, NB), 0), tl.where(here, at_or_above - hist, 0),
                      tl.where(here, hist, 0)), 0, _add3)


@triton.jit
def _rank_ties(ties_row, count, first, out_row, k, pt_row, pages,
               HAS_PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr, TIES: tl.constexpr):
    """The k - first largest of the count (<= TIES) packed entries at ties_row fill slots [first, k).
    Packed entries of one row are distinct (the position breaks ties between equal keys), so each
    entry's rank among them, counted pairwise, is a distinct slot offset: no scan, no rounds."""
    # The TIES x TIES pairs as one flat vector (a few a thread; a 2-D tile of row and column loads
    # gets a layout that holds a whole row a thread), summed per row after a reshape.
    pair = tl.arange(0, TIES * TIES)
    i = pair // TIES
    j = pair % TIES
    e_i = tl.load(ties_row + i, mask=i < count, other=0)
    e_j = tl.load(ties_row + j, mask=j < count, other=0)
    rank = tl.sum(tl.reshape(((e_j > e_i) & (j < count)).to(tl.int32), (TIES, TIES)), axis=1)
    mine = tl.arange(0, TIES)
    entry = tl.load(ties_row + mine, mask=mine < count, other=0)
    slot = first + rank
    take = (mine < count) & (slot < k)
    tl.store(out_row + slot, _slot_value(entry.to(tl.int32), pt_row, pages, HAS_PAGES, BLOCK_SIZE, take), mask=take)


@triton.jit
def _two_level(cand_list, count, above, out_row, k, window_row, hist_row, ties_row, pt_row, pages,
               HAS_PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr,
               FINE: tl.constexpr, TIES: tl.constexpr):
    """Slots [above, k) from the candidate list in one histogram and one compaction instead of radix
    rounds: the list's entries are counted into FINE linear bins over the bracket (one atomic add
    each, into the row's histogram the bracket kernel zeroed), one scan finds the bin b holding the
    (k - above)-th largest, every entry of a bin above b is written, and b's own entries (at most
    TIES) are ranked pairwise. Returns whether that finished the row; if b holds more than TIES
    entries (ties, or keys closer than the bins resolve), the caller's radix select takes b's entries
    (those with keys in [key_min, key_max]) with the output holding `first` keys."""
    lo = tl.load(window_row)
    inv_width = tl.load(window_row + 1)
    offs = tl.arange(0, BLOCK)
    for t in range(0, count, BLOCK):
        key, _, live = _entries(cand_list, t + offs, count, -2147483648, 2147483647, False)
        fine = _linear_bin(_key_value(key), lo, inv_width, FINE)
        tl.atomic_add(hist_row + fine, 1, mask=live, sem="relaxed")
    tl.debug_barrier()  # every add is done before any thread reads the histogram
    b, in_above, in_bin = _crossing_bin(tl.load(hist_row + tl.arange(0, FINE)), count, k - above, FINE)
    first = above + in_above
    # The compaction, laid out as the radix select's last scan: bins above b to the output, b's entries
    # to the row's ties scratch. The bins are computed as above, by the same code in this kernel.
    idx0 = tl.arange(0, BLOCK // LANES)[:, None] + tl.arange(0, LANES)[None, :] * (BLOCK // LANES)
    gt_next = above
    eq_next = 0
    for t in range(0, count, BLOCK):
        key, pos, live = _entries(cand_list, t + idx0, count, -2147483648, 2147483647, False)
        fine = _linear_bin(_key_value(key), lo, inv_width, FINE)
        gt = live & (fine > b)
        eq = live & (fine == b)
        flags = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
        line = tl.sum(flags, axis=1)
        packed = (tl.cumsum(line, axis=0) - line)[:, None] + tl.cumsum(flags, axis=1)
        slot = gt_next + (packed & 0xFFFF) - 1
        tl.store(out_row + slot, _slot_value(pos, pt_row, pages, HAS_PAGES, BLOCK_SIZE, gt), mask=gt & (slot < k))
        tie = eq_next + (packed >> 16) - 1
        tl.store(ties_row + tie, _candidate(key, pos), mask=eq & (tie < TIES))
        total = tl.sum(line, axis=0)
        gt_next += total & 0xFFFF
        eq_next += total >> 16
    done = in_bin <= TIES
    key_min = -2147483648
    key_max = 2147483647
    if done:
        tl.debug_barrier()  # the ties' stores are visible to every thread
        _rank_ties(ties_row, in_bin, first, out_row, k, pt_row, pages, HAS_PAGES, BLOCK_SIZE, TIES)
    else:
        # The bins are monotone in the key, so b's entries are exactly the list's entries with keys
        # between the smallest and the largest of b's.
        key_min = 2147483647
        key_max = -2147483648
        for t in range(0, count, BLOCK):
            key, _, live = _entries(cand_list, t + offs, count, -2147483648, 2147483647, False)
            eq = live & (_linear_bin(_key_value(key), lo, inv_width, FINE) == b)
            key_min = tl.minimum(key_min, tl.min(tl.where(eq, key, 2147483647), axis=0))
            key_max = tl.maximum(key_max, tl.max(tl.where(eq, key, -2147483648), axis=0))
    return done.to(tl.int32), first, key_min, key_max


@triton.jit
def _finish_kernel(
    logits_ptr, stride_row, lengths_ptr, stride_len, starts_ptr, stride_start, counts_ptr,
    out_ptr, cand_ptr, stride_cand, window_ptr, hist_ptr, ties_ptr, pt_ptr, stride_pt, page_rows_ptr,
    stride_page_rows, width, num_pt_rows, pages, k, cap,
    HAS_STARTS: tl.constexpr, HAS_PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr, LANES: tl.constexpr, RADIX: tl.constexpr, RADIX_BINS: tl.constexpr,
    FINE: tl.constexpr, TIES: tl.constexpr,
):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    start, n = _row_window(row64, lengths_ptr, stride_len, starts_ptr, stride_start, width, HAS_STARTS)
    src = logits_ptr + row64 * stride_row + start
    out_row = out_ptr + row64 * k
    pt_row, pages = _page_row(row64, pt_ptr, stride_pt, page_rows_ptr, stride_page_rows, num_pt_rows, pages,
                              HAS_PAGES)
    counts = tl.load(counts_ptr + row64)
    above = (counts & 0xFFFFFFFF).to(tl.int32)
    in_bracket = (counts >> 32).to(tl.int32)
    if n <= k:
        _write_all(src, n, out_row, k, pt_row, pages, HAS_PAGES, BLOCK_SIZE, BLOCK)
    elif (above <= k) & (above + in_bracket >= k) & (in_bracket <= cap):
        cand_list = cand_ptr + row64 * stride_cand
        # FINE = 0: radix rounds over the whole list (the round-2 finish, kept for A/B). Else the
        # two-level finish, whose radix rounds (if any) see one fine bin's keys only.
        done = 0
        first = above
        key_min = -2147483648
        key_max = 2147483647
        if FINE > 0:
            done, first, key_min, key_max = _two_level(
                cand_list, in_bracket, above, out_row, k, window_ptr + 2 * row64, hist_ptr + row64 * FINE,
                ties_ptr + row64 * TIES, pt_row, pages, HAS_PAGES, BLOCK_SIZE, BLOCK, LANES, FINE, TIES)
        if done == 0:
            _select(cand_list, in_bracket, first, key_min, key_max, out_row, k, pt_row, pages, False,
                    HAS_PAGES, BLOCK_SIZE, BLOCK, RADIX, RADIX_BINS, LANES)
        if HAS_PAGES:
            # The split wrote positions into slots [0, above); the select wrote the rest as slots.
            offs = tl.arange(0, BLOCK)
            for t in range(0, above, BLOCK):
                idx = t + offs
                live = idx < above
                pos = tl.load(out_row + idx, mask=live, other=0)
                tl.store(out_row + idx, _slot_value(pos, pt_row, pages, HAS_PAGES, BLOCK_SIZE, live), mask=live)
    else:
        # The sample misjudged the row, NaN hid keys, or the list overflowed: exact from the row.
        if _count_live(src, n, BLOCK) <= k:
            _write_all(src, n, out_row, k, pt_row, pages, HAS_PAGES, BLOCK_SIZE, BLOCK)
        else:
            _select(src, n, 0, -2147483648, 2147483647, out_row, k, pt_row, pages, True,
                    HAS_PAGES, BLOCK_SIZE, BLOCK, RADIX, RADIX_BINS, LANES)


@triton.jit
def _sort_kernel(
    logits_ptr, stride_row, starts_ptr, stride_start, out_ptr, pt_ptr, stride_pt, page_rows_ptr, stride_page_rows,
    width, num_pt_rows, pages, k, sort_k,
    HAS_STARTS: tl.constexpr, HAS_PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr, KP: tl.constexpr,
):
    """Orders one row's first sort_k = min(k, W) positions (the rest are -1) by value, descending,
    -1s last; then the page transform."""
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    start = 0
    if HAS_STARTS:
        start = tl.minimum(tl.maximum(tl.load(starts_ptr + row64 * stride_start), 0), width)
    out_row = out_ptr + row64 * k
    pt_row, pages = _page_row(row64, pt_ptr, stride_pt, page_rows_ptr, stride_page_rows, num_pt_rows, pages,
                              HAS_PAGES)
    offs = tl.arange(0, KP)
    pos = tl.load(out_row + offs, mask=offs < sort_k, other=-1)
    valid = pos >= 0
    x = tl.load(logits_ptr + row64 * stride_row + start + pos, mask=valid, other=0.0)
    # An empty slot sorts below every selectable key (-inf's key is above INT32_MIN); the low half
    # keeps the position (-1 included) through the sort.
    key = tl.where(valid, _ordered_key(x), -2147483648)
    packed = (key.to(tl.int64) << 32) | (pos.to(tl.int64) & 0xFFFFFFFF)
    pos = tl.sort(packed, descending=True).to(tl.int32)
    valid = pos >= 0
    tl.store(out_row + offs, _slot_value(pos, pt_row, pages, HAS_PAGES, BLOCK_SIZE, valid), mask=offs < sort_k)


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
    config = launch_config(*logits.shape, k) if logits.dim() == 2 else launch_config(0, 0, k)
    return launch(logits, lengths, k, starts=starts, page_table=page_table, page_rows=page_rows,
                  block_size=block_size, sorted=sorted, **config)


# Programs the split should give each SM at least: enough independent loads in flight to cover the
# memory latency (reasoned, NOTES.md; the probe sweeps the chunk).
# The split's chunk: 1024 keys with 4 warps. Measured against 2048 with 8 (the earlier default at
# large shapes) on the H200, 2026-11-30 12:20 UTC (tools/probe_topk.py, graph-replayed): 82.8 vs 87.4
# us at 512 rows x 49K, 33.7 vs 35.1 at 128 x 49K; 1024 was already the default at 64 x 12K.
SPLIT_BLOCK = 1024


def launch_config(rows: int, width: int, k: int = 2048, interpreted: bool | None = None) -> dict:
    """Launch parameters (see `launch`). The split's chunk is one tile (tiles = 1: a second tile held
    in flight lifts the split from ~80 to ~125 registers at sm_90, a third of the programs an SM) of
    SPLIT_BLOCK keys; a thread holds one column of lanes = 8 keys. The interpreter pays per operation, not
    per element, so there tiles are as large as the row allows (`interpreted` None: whether
    TRITON_INTERPRET is on here). The finish is two-level (fine = 1024 bins, ties = 32: NOTES.md,
    "Round 4"); fine = 0 selects round 2's radix finish."""
    if triton_interpreter_on() if interpreted is None else interpreted:
        block = min(4096, max(256, triton.next_power_of_2(max(width, 1))))
        return {"block": block, "tiles": 1, "lanes": 8, "bins": 64, "sample": 1024, "z": 4.0, "radix": 8,
                "cap": max(4 * k, 1024), "num_warps": 1, "finish_warps": 8, "fine": 256, "ties": 16}
    block = SPLIT_BLOCK
    return {"block": block, "tiles": 1, "lanes": 8, "bins": 64, "sample": 4096, "z": 4.0,
            "radix": 4, "cap": max(4 * k, 4096), "num_warps": block // 256, "finish_warps": 8, "fine": 1024,
            "ties": 32}


# The finish's tiles: a column of 8 keys a thread, so its tile follows its warps (2048 keys at 8).
FINISH_LANES = 8


def launch(logits, lengths, k, *, starts=None, page_table=None, page_rows=None, block_size=64, sorted=False,
           block, tiles, lanes, bins, sample, z, radix, cap, num_warps, finish_warps, fine, ties):
    """Check the inputs, then run the kernels with an explicit config (the probe calls this directly).

    block: keys per split tile (a power of two, at most 2^15: the packed scan
    holds two 16-bit counts); tiles: tiles per split program (its chunk is block * tiles keys); lanes:
    keys per thread-column of a tile (a power of two below block); bins: the sample's bins (a power of
    two >= 32); sample: keys sampled for the bracket (a power of two >= 8); z: the bracket's
    half-width in standard deviations (huge: every key a candidate, so the list overflows and the
    exact path runs; very negative: the bracket is one bin, usually wrong, same); radix: bits per
    refine round (4 or 8); cap: candidate list entries per row (>= 1); num_warps: the split's;
    finish_warps: the bracket's, the finish's (tiles of FINISH_LANES keys a thread) and the sort's;
    fine: the two-level finish's histogram bins (a power of two, or 0: radix rounds over the whole
    list); ties: the most entries of the threshold bin it ranks pairwise (a power of two; more go to
    radix rounds over that bin)."""
    if not (_pow2(block) and block <= 1 << 15 and tiles >= 1 and _pow2(bins) and bins >= 32 and _pow2(sample)
            and sample >= 8 and _pow2(lanes) and lanes < block and radix in (4, 8) and cap >= 1
            and (fine == 0 or _pow2(fine)) and _pow2(ties)):
        raise ValueError(f"block={block}, tiles={tiles}, bins={bins}, sample={sample}, lanes={lanes}, radix={radix}, "
                         f"cap={cap}, fine={fine}, ties={ties}: powers of two, block <= 32768, tiles >= 1, "
                         "bins >= 32, sample >= 8, lanes < block, radix 4 or 8, cap >= 1, fine 0 or a power of two")
    rows, width = _check(logits, lengths, k, starts, page_table, page_rows, block_size)
    out = torch.empty((rows, k), dtype=torch.int32, device=logits.device)
    if rows == 0:
        return out
    counts, bracket, cand, window, hist, tie_list = _workspace(logits.device, rows, cap, fine, ties)
    fuse_pages = page_table is not None and not sorted
    dummy = out  # stands in for absent optional tensors; never dereferenced (constexpr flags)
    row_args = (logits, logits.stride(0), lengths, lengths.stride(0),
                starts if starts is not None else dummy, starts.stride(0) if starts is not None else 0)
    has_starts = starts is not None
    _bracket_kernel[(rows,)](*row_args, bracket, counts, window, hist, width, k, HAS_STARTS=has_starts, BINS=bins,
                             SAMPLE=sample, Z=z, FINE=fine, num_warps=finish_warps)
    chunks = triton.cdiv(max(width, 1), block * tiles)
    _split_kernel[(rows, chunks)](*row_args, bracket, counts, out, cand, cand.stride(0), width, k, cap,
                                  HAS_STARTS=has_starts, BLOCK=block, TILES=tiles, LANES=lanes, num_warps=num_warps)
    page_args = (page_table if fuse_pages else dummy, page_table.stride(0) if fuse_pages else 0,
                 page_rows if fuse_pages else dummy, page_rows.stride(0) if fuse_pages else 0)
    table_rows, table_pages = (page_table.shape[0], page_table.shape[1]) if fuse_pages else (1, 0)
    _finish_kernel[(rows,)](*row_args, counts, out, cand, cand.stride(0), window, hist, tie_list, *page_args, width,
                            table_rows, table_pages, k, cap, HAS_STARTS=has_starts, HAS_PAGES=fuse_pages,
                            BLOCK_SIZE=block_size, BLOCK=FINISH_LANES * 32 * finish_warps, LANES=FINISH_LANES,
                            RADIX=radix, RADIX_BINS=max(1 << radix, 32), FINE=fine, TIES=ties, num_warps=finish_warps)
    if sorted:
        with_pages = page_table is not None
        # Slots past the width are -1 already (and stay last), so only min(k, W) are ordered. One
        # program holds them in registers; past SORT_MAX the torch post-pass orders them instead.
        sort_width = triton.next_power_of_2(max(min(k, width), 1))
        if sort_width > SORT_MAX:
            out = _sort_descending(logits, out, starts)
            return _page_transform(out, page_table, page_rows, block_size) if with_pages else out
        page_args = (page_table if with_pages else dummy, page_table.stride(0) if with_pages else 0,
                     page_rows if with_pages else dummy, page_rows.stride(0) if with_pages else 0)
        table_rows, table_pages = (page_table.shape[0], page_table.shape[1]) if with_pages else (1, 0)
        _sort_kernel[(rows,)](logits, logits.stride(0), row_args[4], row_args[5], out, *page_args, width,
                              table_rows, table_pages, k, min(k, width), HAS_STARTS=has_starts, HAS_PAGES=with_pages,
                              BLOCK_SIZE=block_size, KP=sort_width, num_warps=finish_warps)
    return out


# The most slots the sort kernel orders in one program's registers (int64 pairs; 8 warps: 32 a thread).
SORT_MAX = 8192


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


def _workspace(device: torch.device, rows: int, cap: int, fine: int = 0, ties: int = 1) -> tuple[torch.Tensor, ...]:
    """Views of the cached scratch for `rows` rows: packed counters int64 [rows], brackets fp32
    [rows, 2], candidate lists int64 [rows, cap], the fine bins' windows fp32 [rows, 2] (lo,
    inv_width), their histograms int32 [rows, max(fine, 1)], the threshold bins' entries
    int64 [rows, ties]. Nothing needs initialising (the bracket kernel zeroes the counters and
    histograms; only written entries are read)."""
    if device.type == "cuda" and device.index is None:  # one cache entry per GPU, however it is named
        device = torch.device("cuda", torch.cuda.current_device())
    return tuple(t[:rows] for t in _scratch(device, triton.next_power_of_2(rows), cap, fine, ties))


@functools.lru_cache(maxsize=None)
def _scratch(device: torch.device, rows: int, cap: int, fine: int, ties: int) -> tuple[torch.Tensor, ...]:
    # Cached and never freed: a CUDA graph captured with these addresses stays valid. Power-of-two
    # row buckets bound the number of entries (the total is at most twice the largest).
    return (torch.empty(rows, dtype=torch.int64, device=device),
            torch.empty((rows, 2), dtype=torch.float32, device=device),
            torch.empty((rows, cap), dtype=torch.int64, device=device),
            torch.empty((rows, 2), dtype=torch.float32, device=device),
            torch.empty((rows, max(fine, 1)), dtype=torch.int32, device=device),
            torch.empty((rows, ties), dtype=torch.int64, device=device))


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
