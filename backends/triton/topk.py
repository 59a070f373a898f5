"""Top-k of the indexer's logits in Triton: a lengths-aware sampled bracket select, split over many
programs per row, with an exact radix fallback. Three launches, no host sync (four with sorted=True).
This file holds the bracket and split kernels and the host side; the finish and sort kernels are in
topk_finish.py, the pieces both use in topk_keys.py.

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
call at its shape allocates nothing. Design notes and the numbers behind them: docs/internal/triton-notes.md.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from backends.triton.topk_finish import _finish_kernel, _sort_kernel
from backends.triton.topk_keys import (
    ROW_STRIDE_NOT_SPECIALISED,
    _candidate,
    _fine_window,
    _ordered_key,
    _row_window,
    _sample_window,
)
from dispatch.contract import LayoutError, triton_interpreter_on


@triton.jit(do_not_specialize=ROW_STRIDE_NOT_SPECIALISED)
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


@triton.jit(do_not_specialize=ROW_STRIDE_NOT_SPECIALISED)
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
# memory latency (reasoned, docs/internal/triton-notes.md; the probe sweeps the chunk).
# The split's chunk: 1024 keys with 4 warps. Measured against 2048 with 8 (the earlier default at
# large shapes) on the H200, 2026-11-30 12:20 UTC (tools/probe_topk.py, graph-replayed): 82.8 vs 87.4
# us at 512 rows x 49K, 33.7 vs 35.1 at 128 x 49K; 1024 was already the default at 64 x 12K.
SPLIT_BLOCK = 1024


def launch_config(rows: int, width: int, k: int = 2048, interpreted: bool | None = None) -> dict:
    """Launch parameters (see `launch`). The split's chunk is one tile (tiles = 1: a second tile held
    in flight lifts the split from ~80 to ~125 registers at sm_90, a third of the programs an SM) of
    SPLIT_BLOCK keys; a thread holds one column of lanes = 8 keys. The interpreter pays per operation, not
    per element, so there tiles are as large as the row allows (`interpreted` None: whether
    TRITON_INTERPRET is on here). The finish is two-level (fine = 1024 bins, ties = 32: docs/internal/triton-notes.md,
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
        out = _sort(logits, out, starts, page_table, page_rows, block_size, width, k, finish_warps)
    return out


def _sort(logits, out, starts, page_table, page_rows, block_size, width, k, num_warps):
    """The chosen positions in descending order of value, -1s last, then the page transform (the
    kernels left the positions untransformed when sorted=True)."""
    rows = out.shape[0]
    with_pages = page_table is not None
    # Slots past the width are -1 already (and stay last), so only min(k, W) are ordered. One
    # program holds them in registers; past SORT_MAX the torch post-pass orders them instead.
    sort_width = triton.next_power_of_2(max(min(k, width), 1))
    if sort_width > SORT_MAX:
        out = _sort_descending(logits, out, starts)
        return _page_transform(out, page_table, page_rows, block_size) if with_pages else out
    dummy = out
    page_args = (page_table if with_pages else dummy, page_table.stride(0) if with_pages else 0,
                 page_rows if with_pages else dummy, page_rows.stride(0) if with_pages else 0)
    table_rows, table_pages = (page_table.shape[0], page_table.shape[1]) if with_pages else (1, 0)
    _sort_kernel[(rows,)](logits, logits.stride(0), starts if starts is not None else dummy,
                          starts.stride(0) if starts is not None else 0, out, *page_args, width,
                          table_rows, table_pages, k, min(k, width), HAS_STARTS=starts is not None,
                          HAS_PAGES=with_pages, BLOCK_SIZE=block_size, KP=sort_width, num_warps=num_warps)
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


class Scratch(NamedTuple):
    """The top-k's per-row scratch. Nothing needs initialising: the bracket kernel zeroes the
    counters and the histograms; only written entries are read."""

    counts: torch.Tensor  # int64 [rows]: above | candidates << 32, the split's packed slot counter
    bracket: torch.Tensor  # fp32 [rows, 2]: t_lo, t_hi
    cand: torch.Tensor  # int64 [rows, cap]: the candidate lists (key << 32 | position)
    window: torch.Tensor  # fp32 [rows, 2]: the fine bins' lo and inv_width
    hist: torch.Tensor  # int32 [rows, max(fine, 1)]: the fine bins' counts
    ties: torch.Tensor  # int64 [rows, ties]: the threshold bin's entries


def _workspace(device: torch.device, rows: int, cap: int, fine: int = 0, ties: int = 1) -> Scratch:
    """Views of the cached scratch for `rows` rows."""
    if device.type == "cuda" and device.index is None:  # one cache entry per GPU, however it is named
        device = torch.device("cuda", torch.cuda.current_device())
    return Scratch(*(t[:rows] for t in _scratch(device, triton.next_power_of_2(rows), cap, fine, ties)))


@functools.lru_cache(maxsize=None)
def _scratch(device: torch.device, rows: int, cap: int, fine: int, ties: int) -> Scratch:
    # Cached and never freed: a CUDA graph captured with these addresses stays valid. Power-of-two
    # row buckets bound the number of entries (the total is at most twice the largest).
    return Scratch(counts=torch.empty(rows, dtype=torch.int64, device=device),
                   bracket=torch.empty((rows, 2), dtype=torch.float32, device=device),
                   cand=torch.empty((rows, cap), dtype=torch.int64, device=device),
                   window=torch.empty((rows, 2), dtype=torch.float32, device=device),
                   hist=torch.empty((rows, max(fine, 1)), dtype=torch.int32, device=device),
                   ties=torch.empty((rows, ties), dtype=torch.int64, device=device))


def _check(logits, lengths, k, starts, page_table, page_rows, block_size) -> tuple[int, int]:
    """What this kernel adds to the op's checks (run by the host before it, dispatch/contract/ops/top_k.py):
    one device, and a page table contiguous along its pages (a row is read as a flat array)."""
    if page_table is not None and page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise LayoutError(f"page_table must be contiguous along its pages; got strides {list(page_table.stride())}")
    tensors = [t for t in (logits, lengths, starts, page_table, page_rows) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise LayoutError(f"top-k tensors must be on one device; got {sorted(str(t.device) for t in tensors)}")
    return logits.shape


def _pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0
