"""build_ragged_metadata's path for a batch whose lengths are on the CPU and were checked where the batch
was built (ExtendBatch._check_batch): the same values as the general path, in fewer and cheaper torch ops.

Measured on a loaded 2-core x86 CPU (issue 24, item 5; docs/benchmarks.md): at M = 16K, S = 64K the
general path's time went to per-key gathers (index_select, ~80-100 us per 64K), an add of int32 and
int64 (~150 us: the type promotion copies), a [2, B] gather along its inner dimension (~170 us) and
arange (~45 us). Here, with the lengths known valid:
- every tensor is int32 (the totals are at most 2^30), so no op promotes;
- the rows' ks / ke are two 1-D gathers written straight into the [2, M] result;
- a key's slot is its page's base plus its offset in the page, and a request's keys are its pages in
  order, so every request's slots are one broadcast add of [B, pages, 1] + [block_kv] and the batch's
  are those rows cut to each request's length and concatenated (when the padding to the longest
  request stays small; else the per-key gathers, without the promotions);
- the per-request offsets come from the host lengths, into one tensor (B values, where torch ops on
  [B] tensors cost more in calls than in arithmetic);
- the index ranges are views of a cached arange.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import torch

# The broadcast form computes B x (longest request's pages) x block_kv slots and keeps S of them: used
# while that is at most this many times S, and B views to concatenate stay few.
DENSE_WASTE = 2
DENSE_REQUESTS = 64
_ARANGE: dict[torch.dtype, torch.Tensor] = {}


def _arange(count: int, dtype: torch.dtype) -> torch.Tensor:
    """0..count-1 on the CPU, a view of a cached tensor (read only: never written through)."""
    cached = _ARANGE.get(dtype)
    if cached is None or cached.shape[0] < count:
        cached = torch.arange(max(count, 2 * (0 if cached is None else cached.shape[0]), 1024), dtype=dtype)
        _ARANGE[dtype] = cached
    return cached[:count]


def ragged_fields_on_host(batch, slot_bases: torch.Tensor) -> dict:
    """The RaggedMetadata fields of an ExtendBatch (dispatch/step/extend_batch.py, which builds the metadata
    from them; this module imports nothing of it) whose lengths were checked on this host.
    `slot_bases`: dispatch.step.extend_batch._slot_bases(batch, None), int32 [B, P + 1]."""
    requests, rows, keys = batch.num_requests, batch.total_tokens, batch.total_keys
    if batch.host_prefix_lens is not None and batch.host_extend_lens is not None:
        host_ranges = HostRanges.of(batch.host_prefix_lens, batch.host_extend_lens)
    else:  # the tensors' lengths, read where the batch was built: reading them again costs no sync
        host_ranges = None
    offsets = host_ranges or HostRanges.of(batch.prefix_lens.tolist(), batch.extend_lens.tolist())
    # The per-request values on the host (B entries, one tensor), not in torch ops over [B] tensors, each
    # of which costs more than the arithmetic: key offsets [B + 1], and the ke base of each request.
    # Row i of request r: ks = key_offsets[r], ke = i + 1 + key_offsets[r + 1] - row_offsets[r + 1].
    key_offsets_list, row_offsets_list = offsets.key_offsets, offsets.row_offsets
    ke_base = [k - r + 1 for k, r in zip(key_offsets_list[1:], row_offsets_list[1:])]
    per_request = torch.tensor([key_offsets_list, [*ke_base, 0]], dtype=torch.int32)  # [2, B + 1]
    key_offsets = per_request[0]
    row_request = torch.repeat_interleave(batch.extend_lens, output_size=rows)  # int32 (its counts' dtype)

    ranges = torch.empty((2, rows), dtype=torch.int32)
    torch.index_select(key_offsets[:-1], 0, row_request, out=ranges[0])
    torch.index_select(per_request[1, :-1], 0, row_request, out=ranges[1])
    ranges[1].add_(_arange(rows, torch.int32))

    counts = [k - j for j, k in zip(key_offsets_list, key_offsets_list[1:])]
    slots = _slots(batch, slot_bases, counts, key_offsets, requests, keys)
    return dict(
        ks=ranges[0],
        ke=ranges[1],
        gather_slots=slots,
        row_request=row_request,
        key_offsets=key_offsets,
        total_tokens=rows,
        total_keys=keys,
        host_ranges=host_ranges,
        length_flags=None,
        ranges=ranges,
    )


def _slots(batch, slot_bases: torch.Tensor, counts: list[int], key_offsets: torch.Tensor,
           requests: int, keys: int) -> torch.Tensor:
    """int32 [S]: each gathered key's cache slot, -1 where its page entry is no block of the pool.
    `counts`: each request's keys, on the host."""
    block_kv = batch.block_kv
    if keys == 0:
        return torch.empty(0, dtype=torch.int32)
    pages = -(-max(counts) // block_kv)  # past the table's P only where no host lengths were checked
    width = slot_bases.shape[1]  # P + 1: column P is the no-page sentinel
    if pages < width and requests <= DENSE_REQUESTS and requests * pages * block_kv <= DENSE_WASTE * keys:
        every = slot_bases[:, :pages, None] + _arange(block_kv, torch.int32)  # [B, pages, block_kv]
        every = every.view(requests, pages * block_kv).clamp_(min=-1)
        return torch.cat([every[r, :n] for r, n in enumerate(counts)])
    key_request = torch.repeat_interleave(batch.prefix_lens + batch.extend_lens, output_size=keys)  # int32
    position = _arange(keys, torch.int32) - key_offsets.index_select(0, key_request)
    page = (position >> (block_kv.bit_length() - 1)).clamp_(max=width - 1)  # past the table: the sentinel
    entry = torch.add(page, key_request, alpha=width)
    return slot_bases.view(-1).index_select(0, entry).add_(position & (block_kv - 1)).clamp_(min=-1)


@dataclasses.dataclass(frozen=True)
class HostRanges:
    """A batch's host lengths as offsets: row r's ks / ke in O(log B), with no per-row list."""

    row_offsets: tuple[int, ...]  # B + 1: request q owns rows [row_offsets[q], row_offsets[q + 1])
    key_offsets: tuple[int, ...]  # B + 1: and gathered keys [key_offsets[q], key_offsets[q + 1])
    prefix: tuple[int, ...]

    @classmethod
    def of(cls, prefix: Sequence[int], extend: Sequence[int]) -> HostRanges:
        rows, keys = [0], [0]
        for cached, new in zip(prefix, extend):
            rows.append(rows[-1] + new)
            keys.append(keys[-1] + cached + new)
        return cls(tuple(rows), tuple(keys), tuple(prefix))

    def at(self, row: int) -> tuple[int, int]:
        """(ks, ke) of query row `row`: its request's first key, and one past its own position."""
        # The last request starting at or before `row`: requests with no new tokens share the next one's start.
        request = bisect.bisect_right(self.row_offsets, row) - 1
        first = self.key_offsets[request]
        return first, first + self.prefix[request] + row - self.row_offsets[request] + 1
