"""What the indexer needs for an extend (prefill) batch, built from what an engine knows about it.

An extend batch is B requests; request r has prefix_lens[r] keys already cached and extend_lens[r] new
tokens, whose keys the engine has written to the paged cache before the indexer runs (as SGLang and
vLLM do). The indexer gathers every request's keys into one contiguous buffer, request after request:
request r owns keys [off_r, off_r + prefix_r + extend_r) of it. Its new token j is one query row and
sees ks = off_r, ke = off_r + prefix_r + j + 1 (its prefix and its own request's tokens 0..j).

build_ragged_metadata is pure torch on the batch's device and never waits on it: row and key counts
come from the host totals engines keep. Per-request host lengths (optional) make the row chunks tight
and let the lengths be validated; without them chunks span the whole key buffer.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import torch

from dispatch.contract.bounds import BAD_LENGTH
from dispatch.contract.errors import LayoutError

# vLLM's VLLM_SPARSE_INDEXER_MAX_LOGITS_MB default: the fp32 logits of one chunk stay under 512 MiB.
DEFAULT_LOGITS_BYTES = 512 * 1024 * 1024
_FP32 = 4


@dataclasses.dataclass(frozen=True)
class ExtendBatch:
    """An extend batch as an engine holds it. Tensors on the batch's device; totals on the host."""

    prefix_lens: torch.Tensor  # int32 [B]: keys already cached
    extend_lens: torch.Tensor  # int32 [B]: new tokens (their keys are cached too, before the indexer)
    page_table: torch.Tensor  # int32 [B, P]: logical page -> physical block of the cache
    total_tokens: int  # M = sum(extend_lens)
    total_keys: int  # S = sum(prefix_lens + extend_lens)
    block_kv: int = 64
    host_prefix_lens: tuple[int, ...] | None = None
    host_extend_lens: tuple[int, ...] | None = None
    # Blocks in the engine's KV pool (as ForwardBatch.num_kv_blocks): given, a page entry outside it
    # becomes gather slot -1 (refused by the reference gather, poisoned and flagged BAD_PAGE on the GPU).
    num_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        _check_batch(self)

    @classmethod
    def from_lengths(
        cls,
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        page_table: torch.Tensor,
        *,
        block_kv: int = 64,
        num_kv_blocks: int | None = None,
    ) -> ExtendBatch:
        """A batch from host lengths (one copy to the page table's device); totals computed here."""
        prefix, extend = tuple(int(n) for n in prefix_lens), tuple(int(n) for n in extend_lens)
        device = page_table.device
        return cls(
            prefix_lens=torch.tensor(prefix, dtype=torch.int32).to(device),
            extend_lens=torch.tensor(extend, dtype=torch.int32).to(device),
            page_table=page_table,
            total_tokens=sum(extend),
            total_keys=sum(prefix) + sum(extend),
            block_kv=block_kv,
            host_prefix_lens=prefix,
            host_extend_lens=extend,
            num_kv_blocks=num_kv_blocks,
        )

    @property
    def num_requests(self) -> int:
        return self.prefix_lens.shape[0]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Query rows [row_begin, row_end) scored against gathered keys [key_begin, key_end) only.

    The chunk's kernel call takes k[key_begin:key_end] and ks / ke shifted by -key_begin; its logits
    are [rows, key_end - key_begin] fp32.
    """

    row_begin: int
    row_end: int
    key_begin: int
    key_end: int

    @property
    def rows(self) -> slice:
        return slice(self.row_begin, self.row_end)

    @property
    def keys(self) -> slice:
        return slice(self.key_begin, self.key_end)

    @property
    def logits_bytes(self) -> int:
        return (self.row_end - self.row_begin) * (self.key_end - self.key_begin) * _FP32


@dataclasses.dataclass(frozen=True)
class RaggedMetadata:
    """Per-batch tensors of the ragged logits step (built once per batch, shared by every layer)."""

    ks: torch.Tensor  # int32 [M]: first visible gathered key of each query row
    ke: torch.Tensor  # int32 [M]: one past its last visible key
    gather_slots: torch.Tensor  # int32 [S]: physical cache slot of each gathered key (-1: page table too short)
    row_request: torch.Tensor  # int32 [M]: request of each query row
    key_offsets: torch.Tensor  # int32 [B + 1]: request r owns gathered keys [key_offsets[r], key_offsets[r + 1])
    total_tokens: int
    total_keys: int
    # Where the batch had host lengths: its per-request offsets, from which any row's ks / ke is computed
    # on the host without a per-row list (the plan is on the engine's critical path every batch).
    host_ranges: HostRanges | None = None
    # int32 [1]: BAD_LENGTH where lengths on the device were negative or disagreed with the host totals
    # (every gather slot is then -1); None where the host checked the lengths (dispatch/contract/bounds.py).
    length_flags: torch.Tensor | None = None

    def chunk_ranges(self, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """ks / ke of the chunk's rows, relative to its first key (device ops, no sync)."""
        return self.ks[chunk.rows] - chunk.key_begin, self.ke[chunk.rows] - chunk.key_begin

    def chunks(self, byte_budget: int = DEFAULT_LOGITS_BYTES) -> list[Chunk]:
        """Consecutive query-row chunks whose [rows, keys] fp32 logits fit `byte_budget` bytes each.

        With host ranges a chunk's keys are exactly [ks of its first row, ke of its last row) (both
        grow with the row); without them every chunk spans all S keys. LayoutError if one row alone
        does not fit.
        """
        if byte_budget <= 0:
            raise LayoutError(f"byte_budget must be > 0; got {byte_budget}")
        rows, keys = self.total_tokens, self.total_keys
        if rows == 0:
            return []
        if self.host_ranges is None:
            per_chunk = byte_budget // (max(keys, 1) * _FP32)
            if per_chunk == 0:
                raise LayoutError(
                    f"one query row's logits over all {keys} gathered keys take {keys * _FP32} bytes, more than "
                    f"the budget of {byte_budget}; pass host lengths for tighter chunks or raise the budget"
                )
            return [Chunk(begin, min(begin + per_chunk, rows), 0, keys) for begin in range(0, rows, per_chunk)]
        return _tight_chunks(self.host_ranges, rows, byte_budget)

    @property
    def host_ks(self) -> tuple[int, ...] | None:
        """Every row's ks on the host (built on request: O(M) Python, for tests and tools)."""
        return None if self.host_ranges is None else tuple(self.host_ranges.at(r)[0] for r in range(self.total_tokens))

    @property
    def host_ke(self) -> tuple[int, ...] | None:
        return None if self.host_ranges is None else tuple(self.host_ranges.at(r)[1] for r in range(self.total_tokens))


def build_ragged_metadata(batch: ExtendBatch, *, host_checked: bool | None = None) -> RaggedMetadata:
    """ks / ke, gather slots, row requests and key offsets for `batch`; device ops only, no sync.

    Lengths on the CPU were checked where the batch was built. Lengths on a GPU are not read: a negative
    one is taken as 0, rows and keys are assigned by searching the offsets (never by trusting a count),
    and if the lengths disagree with the host totals every gather slot is -1 and BAD_LENGTH is flagged,
    so nothing is read or written outside a tensor and nothing wrong is selected. Page entries are
    checked in 64-bit, before the slots narrow to int32: one outside the pool (or past int32) is -1.

    `host_checked` (default: whether the lengths are on the CPU, where _check_batch read them) False runs
    the device path's guards on any device, which is how the CPU tests exercise them."""
    device = batch.prefix_lens.device
    requests = batch.num_requests
    on_host = device.type == "cpu" if host_checked is None else host_checked
    prefix = batch.prefix_lens.long()
    extend = batch.extend_lens.long()
    if not on_host:
        prefix, extend = prefix.clamp(min=0), extend.clamp(min=0)
    totals = prefix + extend
    key_offsets = torch.zeros(requests + 1, dtype=torch.long, device=device)
    torch.cumsum(totals, 0, out=key_offsets[1:])
    row_offsets = torch.zeros(requests + 1, dtype=torch.long, device=device)
    torch.cumsum(extend, 0, out=row_offsets[1:])
    last = max(requests - 1, 0)

    rows = torch.arange(batch.total_tokens, device=device)
    row_request = torch.searchsorted(row_offsets[1:], rows, right=True).clamp_(max=last)
    token = rows - row_offsets[row_request]
    ks = key_offsets[row_request]
    ke = ks + prefix[row_request] + token + 1

    keys = torch.arange(batch.total_keys, device=device)
    key_request = torch.searchsorted(key_offsets[1:], keys, right=True).clamp_(max=last)
    position = keys - key_offsets[key_request]
    page = position // batch.block_kv
    pages = batch.page_table.shape[1]
    block = batch.page_table[key_request, page.clamp(max=max(pages - 1, 0))].long()
    # A key past the table's width has no page; an entry outside the pool names none. Either is slot -1,
    # which the gather refuses (reference) or poisons and flags (GPU). int32 slots hold at most 2^31.
    pool = batch.num_kv_blocks if batch.num_kv_blocks is not None else (2**31 - 1) // batch.block_kv
    valid = (page < pages) & (block >= 0) & (block < pool)
    length_flags = None
    if not on_host:
        fault = (batch.prefix_lens < 0).any() | (batch.extend_lens < 0).any()
        fault = fault | (row_offsets[-1] != batch.total_tokens) | (key_offsets[-1] != batch.total_keys)
        valid = valid & ~fault
        length_flags = (fault.to(torch.int32) * BAD_LENGTH).reshape(1)
        ks, ke = ks.clamp(0, batch.total_keys), ke.clamp(0, batch.total_keys)
    slots = torch.where(valid, block * batch.block_kv + position % batch.block_kv, -1)

    host_ranges = None
    if batch.host_prefix_lens is not None and batch.host_extend_lens is not None:
        host_ranges = HostRanges.of(batch.host_prefix_lens, batch.host_extend_lens)
    return RaggedMetadata(
        ks=ks.to(torch.int32),
        ke=ke.to(torch.int32),
        gather_slots=slots.to(torch.int32),
        row_request=row_request.to(torch.int32),
        key_offsets=key_offsets.to(torch.int32),
        total_tokens=batch.total_tokens,
        total_keys=batch.total_keys,
        host_ranges=host_ranges,
        length_flags=length_flags,
    )


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


def _tight_chunks(ranges: HostRanges, rows: int, budget: int) -> list[Chunk]:
    """Greedy: each chunk takes as many rows as fit. ks and ke never decrease along the rows, so a
    chunk's cost (rows x (ke[last] - ks[first])) only grows with its last row and bisect finds it."""
    chunks, begin = [], 0
    while begin < rows:
        first, own_end = ranges.at(begin)
        if (own_end - first) * _FP32 > budget:
            raise LayoutError(
                f"query row {begin} sees {own_end - first} keys: its logits alone take "
                f"{(own_end - first) * _FP32} bytes, more than the budget of {budget}"
            )

        def fits(end: int) -> bool:
            return (end - begin) * (ranges.at(end - 1)[1] - first) * _FP32 <= budget

        # The largest end in (begin, rows] that fits: bisect over a monotone predicate.
        end = begin + bisect.bisect_left(range(begin + 1, rows + 1), True, key=lambda e: not fits(e))
        chunks.append(Chunk(begin, end, first, ranges.at(end - 1)[1]))
        begin = end
    return chunks


def _check_batch(batch: ExtendBatch) -> None:
    """Shapes, dtypes, devices and (where the host has them) lengths; the error names the request."""
    prefix, extend, table = batch.prefix_lens, batch.extend_lens, batch.page_table
    for name, lens in (("prefix_lens", prefix), ("extend_lens", extend)):
        if lens.dtype != torch.int32 or lens.dim() != 1:
            raise LayoutError(f"{name} must be int32 [B]; got {lens.dtype} {list(lens.shape)}")
    requests = prefix.shape[0]
    if extend.shape[0] != requests:
        raise LayoutError(f"extend_lens has {extend.shape[0]} requests, prefix_lens {requests}")
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != requests:
        raise LayoutError(f"page_table must be int32 [B={requests}, P]; got {table.dtype} {list(table.shape)}")
    if len({prefix.device, extend.device, table.device}) != 1:
        raise LayoutError(f"prefix_lens, extend_lens and page_table must be on one device; got "
                          f"{prefix.device}, {extend.device}, {table.device}")
    if not (isinstance(batch.block_kv, int) and batch.block_kv > 0 and batch.block_kv & (batch.block_kv - 1) == 0):
        raise LayoutError(f"block_kv must be a power of two; got {batch.block_kv!r}")
    host_prefix, host_extend = batch.host_prefix_lens, batch.host_extend_lens
    if (host_prefix is None) != (host_extend is None):
        raise LayoutError("host_prefix_lens and host_extend_lens come together or not at all")
    if host_prefix is not None and (len(host_prefix) != requests or len(host_extend) != requests):
        raise LayoutError(f"host lengths have {len(host_prefix)} / {len(host_extend)} requests; the tensors {requests}")
    capacity = table.shape[1] * batch.block_kv
    for request, (cached, new) in enumerate(zip(host_prefix or (), host_extend or ())):
        if cached < 0 or new < 0:
            raise LayoutError(f"request {request}: prefix_len={cached}, extend_len={new}; lengths must be >= 0")
        if cached + new > capacity:
            raise LayoutError(f"request {request}: {cached} + {new} keys need more than the page table's "
                              f"{table.shape[1]} pages of {batch.block_kv}")
    for name in ("total_tokens", "total_keys"):
        value = getattr(batch, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise LayoutError(f"{name} must be a host int >= 0; got {value!r}")
    if batch.total_keys < batch.total_tokens:
        raise LayoutError(f"total_keys={batch.total_keys} < total_tokens={batch.total_tokens}: every new token "
                          f"is a key too")
    if requests == 0 and batch.total_keys:
        raise LayoutError(f"a batch of no requests has no keys; got total_keys={batch.total_keys}")
    blocks = batch.num_kv_blocks
    if blocks is not None and (not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0):
        raise LayoutError(f"num_kv_blocks must be a host int >= 0 (the pool's block count); got {blocks!r}")
    if host_prefix is not None and (sum(host_extend) != batch.total_tokens
                                    or sum(host_prefix) + sum(host_extend) != batch.total_keys):
        raise LayoutError(f"totals disagree with the lengths: total_tokens={batch.total_tokens} (lengths say "
                          f"{sum(host_extend)}), total_keys={batch.total_keys} (lengths say "
                          f"{sum(host_prefix) + sum(host_extend)})")
    if prefix.device.type == "cpu":  # reading them costs no sync: check what the device path could only flag
        _check_host_tensors(batch, prefix.tolist(), extend.tolist())


def _check_host_tensors(batch: ExtendBatch, prefix: list[int], extend: list[int]) -> None:
    """The CPU tensors' lengths: non-negative, equal to the host lengths when given, summing to the totals."""
    for request, (cached, new) in enumerate(zip(prefix, extend)):
        if cached < 0 or new < 0:
            raise LayoutError(f"request {request}: prefix_lens[{request}]={cached}, extend_lens[{request}]={new}; "
                              "lengths must be >= 0")
    if batch.host_prefix_lens is not None and (
        tuple(prefix) != tuple(batch.host_prefix_lens) or tuple(extend) != tuple(batch.host_extend_lens)
    ):
        raise LayoutError("the prefix_lens / extend_lens tensors disagree with host_prefix_lens / host_extend_lens")
    if sum(extend) != batch.total_tokens or sum(prefix) + sum(extend) != batch.total_keys:
        raise LayoutError(f"totals disagree with the length tensors: total_tokens={batch.total_tokens} (extend_lens "
                          f"sum to {sum(extend)}), total_keys={batch.total_keys} (prefix_lens + extend_lens sum to "
                          f"{sum(prefix) + sum(extend)})")
