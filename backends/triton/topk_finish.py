"""The Triton top-k's per-row finish and sort kernels (launched by topk.py after the bracket and the
split): the two-level finish over the candidate list (fine value bins, the threshold bin's entries
ranked pairwise or by radix rounds), the exact radix select over the list or the row where the
bracket did not hold, rows of length <= k, the fused page transform, and the descending sort."""

from __future__ import annotations

import triton
import triton.language as tl

from backends.triton.topk_keys import (
    ROW_STRIDE_NOT_SPECIALISED,
    _candidate,
    _key_value,
    _linear_bin,
    _ordered_key,
    _page_row,
    _row_window,
    _slot_value,
    _threshold_bin,
)


# The finish also leaves the candidate lists' stride unspecialised: specialised (cap = 8192 is
# divisible by 16) it compiled to 106 registers, 10696 SASS instructions and 216 barriers at sm_90
# instead of 78 / 9968 / 159 (Triton 3.6, tools/probe_topk.py --resources), and the finish took 21.4 /
# 9.0 / 6.4 us instead of 18.0 / 7.6 / 4.5 at the probe's three shapes (H200, 13:09 and 14:14 UTC
# 2026-11-30; docs/internal/triton-notes.md "Round 6").
FINISH_NOT_SPECIALISED = ROW_STRIDE_NOT_SPECIALISED + ["stride_cand"]


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


@triton.jit(do_not_specialize=FINISH_NOT_SPECIALISED)
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
