"""build_ragged_metadata's path for a batch whose lengths are on the CPU and were checked where the batch
was built (ExtendBatch._check_batch): the same values as the general path, computed in numpy on the
host, a handful of calls whatever the batch's shape.

The plan is built every batch on the engine's critical path, and a torch call on a CPU costs 5-15 us of
dispatch (issue 24, item 5; docs/benchmarks.md) where numpy's costs about 1 us, so the per-request values
come from the host lengths in plain ints and every per-row and per-key array is one `repeat` of them:
- the rows' requests are one repeat of 0..B-1 by the requests' new tokens; a row of request r has
  ks = key_offsets[r] and ke = ke_base[r] + its row index, which no backend reads on this path (the
  chunks carry their own): with host lengths the metadata builds them when first asked for
  (HostRanges.row_ranges), without, they are one repeat of [2, B] values and one add of the row index;
- a key's slot is its page's first slot plus its offset in the page, and the batch's keys are its
  requests' pages in order, so every slot is one repeat of a per-page value (page base less the page's
  first gathered key) by the page's key count, plus the key's index (where every request but the last
  fills its pages, a repeat by block_kv, cut at S). A page entry outside the pool, or whose slots would
  pass int32, or past the table's width, makes each of its keys -1. Entries are compared against the
  pool as they are read (int32 against a Python int: exact), before any slot is formed.
- numpy's calls, not torch's: besides their cost, torch splits an op of more than 32K elements over
  its threads, and on a loaded host (its other cores busy) each such op waited 8-20 ms for them.
The arrays become tensors without a copy (torch.from_numpy).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from dispatch.contract.extend_plan import HostRanges

_ARANGE: list[np.ndarray] = [np.arange(1024, dtype=np.int32)]


def arange_on_host(count: int) -> np.ndarray:
    """0..count-1 int32, a view of a cached array (read only: never written through, never handed out)."""
    cached = _ARANGE[0]
    if cached.shape[0] < count:
        cached = np.arange(max(count, 2 * cached.shape[0]), dtype=np.int32)
        cached.flags.writeable = False
        _ARANGE[0] = cached
    return cached[:count]


_ARANGE[0].flags.writeable = False


def ragged_fields_on_host(batch, limit: int) -> dict:
    """The RaggedMetadata fields of an ExtendBatch whose lengths were checked on this host (the caller,
    dispatch/step/extend_batch.py, builds the metadata from them). `limit`: a page entry must lie in
    [0, limit), the pool and the int32 room of its slots.

    With host lengths the rows' ks / ke are left to the metadata, built on request from them (no backend
    reads them on this path: the chunks carry their own, dispatch/step/extend_plan.py), so only the
    rows' requests are written here; without, they are built now from the tensors' lengths."""
    rows, keys = batch.total_tokens, batch.total_keys
    if batch.host_prefix_lens is not None and batch.host_extend_lens is not None:
        host_ranges = HostRanges.of(batch.host_prefix_lens, batch.host_extend_lens)
    else:  # the tensors' lengths, read where the batch was built: reading them again costs no sync
        host_ranges = None
    offsets = host_ranges or HostRanges.of(batch.prefix_lens.tolist(), batch.extend_lens.tolist())
    key_offsets, row_offsets = offsets.key_offsets, offsets.row_offsets
    requests = len(key_offsets) - 1
    new_tokens = [b - a for a, b in zip(row_offsets, row_offsets[1:])]
    row_request = torch.from_numpy(arange_on_host(requests).repeat(new_tokens))
    # Without host lengths the rows' ks / ke are built now, by the same rule, from the tensors' lengths.
    row_ranges = None if host_ranges is not None else torch.from_numpy(offsets.row_ranges(rows))
    return dict(
        gather_slots=slots_on_host(batch.page_table.numpy(), batch.block_kv, limit, key_offsets, keys),
        row_request=row_request,
        key_offsets=torch.from_numpy(np.array(key_offsets, dtype=np.int32)),
        total_tokens=rows,
        total_keys=keys,
        host_ranges=host_ranges,
        length_flags=None,
        row_ranges=row_ranges,
    )


def slots_on_host(table: np.ndarray, block_kv: int, limit: int, key_offsets: tuple[int, ...],
                  keys: int) -> torch.Tensor:
    """int32 [S]: each gathered key's cache slot, -1 where its page entry is no block of the pool.
    `key_offsets`: the requests' offsets [B + 1] on the host; `table`: int32 [B, P]."""
    if keys == 0:
        return torch.empty(0, dtype=torch.int32)
    counts = [b - a for a, b in zip(key_offsets, key_offsets[1:])]
    pages_of = [-(-n // block_kv) for n in counts]
    requests, width = table.shape
    if max(pages_of) > width:  # only lengths never checked against the table: the missing pages are no block
        table = np.pad(table, ((0, 0), (0, max(pages_of) - width)), constant_values=-1)
        width = table.shape[1]
    first_page = list(itertools.accumulate(pages_of, initial=0))
    pages = first_page[-1]
    # Per page t of request r (pages request after request): its entry's flat index in the table,
    # r * P + t - first_page[r] (and, below, its first gathered key).
    first_entry = np.array([r * width - first_page[r] for r in range(requests)], dtype=np.int64)
    page_index = arange_on_host(pages)
    entry = table.reshape(-1).take(first_entry.repeat(pages_of) + page_index)
    unsigned = entry.view(np.uint32)  # a negative entry reads as 2^31 or more, past every limit
    all_inside = unsigned.max() < limit  # one reduction; the mask only where some entry is outside
    # The page's first slot less its first key's index, so that adding a key's index gives its slot (an
    # entry inside gives a value in (-2^31, 2^31); one outside may wrap: its keys become -1 below). Page t
    # of request r starts at gathered key t * block_kv + key_offsets[r] - block_kv * first_page[r].
    value = entry - page_index
    value *= block_kv
    if all(n % block_kv == 0 for n in counts[:-1]):
        # Every request but the last fills its pages: page t starts at key t * block_kv, and every page
        # holds block_kv keys but the last, cut at S.
        page_keys = block_kv
    else:
        value -= np.array([k - block_kv * f for k, f in zip(key_offsets[:-1], first_page)],
                          dtype=np.int64).repeat(pages_of)
        page_keys = np.full(pages, block_kv)
        page_keys[[f - 1 for f, n in zip(first_page[1:], pages_of) if n]] = [n - block_kv * (p - 1) for n, p in
                                                                             zip(counts, pages_of) if p]
    # numpy, never a torch op: torch splits an op past 32K elements over its threads, and on a loaded
    # host (its other cores busy) each such op waited 8-20 ms for them (docs/benchmarks.md "Host time").
    slots = value.repeat(page_keys)[:keys]  # (the method: np.repeat is a Python wrapper of it)
    slots += arange_on_host(keys)
    if not all_inside:  # hostile or stale entries only: their keys are no slot
        slots[(unsigned >= limit).repeat(page_keys)[:keys]] = -1
    return torch.from_numpy(slots)
