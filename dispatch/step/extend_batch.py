"""What the indexer needs for an extend batch, built from what an engine knows about it.

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

import dataclasses
import math
from collections.abc import Sequence

import torch

from dispatch.contract.bounds import BAD_LENGTH
from dispatch.contract.errors import LayoutError
from dispatch.step.ragged_on_host import HostRanges, ragged_fields_on_host

# vLLM's VLLM_SPARSE_INDEXER_MAX_LOGITS_MB default: the fp32 logits of one chunk stay under 512 MiB.
DEFAULT_LOGITS_BYTES = 512 * 1024 * 1024
_FP32 = 4
MAX_KEYS = 2**30  # gathered keys: int32 ks / ke, and ks + a row index, never wrap (141 GB of fp8 keys)


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
    # Blocks in the engine's KV pool (as PagedBatch.num_kv_blocks): given, a page entry outside it
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
    # int32 [2, M]: ks and ke as the rows of one tensor (ks and ke are its views), so a chunk's ranges
    # shift in one op (dispatch.step.extend_plan.chunk_tensors).
    ranges: torch.Tensor | None = None

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
    checked against the pool before any slot is formed: one outside it (or whose slot would pass int32)
    is -1.

    `host_checked` (default: whether the lengths are on the CPU, where _check_batch read them) False runs
    the device path's guards on any device, which is how the CPU tests exercise them.

    Engines build this every batch on the host's critical path, and on a GPU each torch op costs the host
    a launch, so the work is laid out for few ops: per-request values [B] are built first and every
    per-row and per-key tensor takes one gather of them; the page table is turned into slot bases once
    per entry [B, P] rather than once per key; counted by tests/step/test_plan_host_cost.py."""
    device = batch.prefix_lens.device
    requests, rows, keys = batch.num_requests, batch.total_tokens, batch.total_keys
    on_host = device.type == "cpu" if host_checked is None else host_checked
    if on_host and device.type == "cpu":  # checked lengths on this host: fewer, cheaper ops (issue 24)
        return RaggedMetadata(**ragged_fields_on_host(batch, _page_limit(batch)))
    if not on_host and device.type == "cuda":  # the same values in one launch, not ~35 (issue 24)
        try:
            from backends.triton.ragged_metadata import ragged_metadata_in_one_launch
        except ModuleNotFoundError as error:  # triton is optional: the torch ops below compute the same
            if error.name != "triton":
                raise
        else:
            return ragged_metadata_in_one_launch(batch)
    # [2, B] in 64 bits: each request's new tokens, and its keys (prefix + new); offsets are their sums.
    lengths = torch.stack((batch.extend_lens, batch.prefix_lens)).long()
    if not on_host:
        lengths.clamp_(min=0)
    lengths[1].add_(lengths[0])  # (not `+=`: on a subscript that writes back with a second op)
    offsets = torch.nn.functional.pad(lengths.cumsum(1), (1, 0))  # [2, B + 1], from 0
    # Narrowed only once bounded: offsets past the totals (garbage device lengths) stop at them, which
    # keeps them sorted, so every search below still lands on a request.
    row_offsets = offsets[0].clamp(max=rows).to(torch.int32)
    key_offsets = offsets[1].clamp(max=keys).to(torch.int32)
    # Row i of request r sees ks = key_offsets[r] and ke = i + 1 + key_offsets[r + 1] - row_offsets[r + 1]
    # (its request's first key, its prefix, and its own tokens 0..j).
    bases = torch.stack((key_offsets[:-1], key_offsets[1:] - row_offsets[1:] + 1))  # [2, B]
    exact = on_host and device.type == "cpu"  # counts checked on this host: repeat by them directly
    row_index = torch.arange(rows, dtype=torch.int32, device=device)
    # repeat_interleave of the counts alone gives the request ids, and is the fastest form on a CPU.
    row_request = (torch.repeat_interleave(lengths[0], output_size=rows).to(torch.int32) if exact
                   else _request_of(row_offsets, row_index, requests))
    ranges = bases.index_select(1, row_request)
    ranges[1].add_(row_index)
    if not on_host:
        ranges.clamp_(0, keys)

    key_index = torch.arange(keys, dtype=torch.int32, device=device)
    key_request = (torch.repeat_interleave(lengths[1], output_size=keys) if exact
                   else _request_of(key_offsets, key_index, requests))
    position = key_index.sub_(key_offsets.index_select(0, key_request))  # >= 0: a key's request starts at or before it
    length_flags = None
    fault = None
    if not on_host:
        negative = (torch.stack((batch.extend_lens, batch.prefix_lens)).amin() < 0) if requests else False
        fault = negative | (offsets[0, -1] != rows) | (offsets[1, -1] != keys)
        length_flags = fault.to(torch.int32).mul_(BAD_LENGTH).reshape(1)
    slot_bases = _slot_bases(batch, fault)  # [B, P + 1]: column P is the no-page sentinel
    width = slot_bases.shape[1]
    page = (position >> (batch.block_kv.bit_length() - 1)).clamp_(max=width - 1)
    entry = torch.add(page, key_request, alpha=width)
    slots = slot_bases.view(-1).index_select(0, entry).add_(position & (batch.block_kv - 1)).clamp_(min=-1)

    host_ranges = None
    if batch.host_prefix_lens is not None and batch.host_extend_lens is not None:
        host_ranges = HostRanges.of(batch.host_prefix_lens, batch.host_extend_lens)
    return RaggedMetadata(
        ks=ranges[0],
        ke=ranges[1],
        gather_slots=slots,
        row_request=row_request,
        key_offsets=key_offsets,
        total_tokens=rows,
        total_keys=keys,
        host_ranges=host_ranges,
        length_flags=length_flags,
        ranges=ranges,
    )


# A slot base no page has: int32's least, so adding an offset within a page stays negative and clamping
# at -1 turns every key without a page into slot -1.
_NO_SLOT = -(2**31)


def _request_of(offsets: torch.Tensor, index: torch.Tensor, requests: int) -> torch.Tensor:
    """The request owning each row or key, by searching the offsets [B + 1] (any values: the result is
    a request, clamped to the last one)."""
    found = torch.searchsorted(offsets[1:], index, right=True, out_int32=True)
    return found.clamp_(max=max(requests - 1, 0))


def _slot_bases(batch: ExtendBatch, fault: torch.Tensor | None) -> torch.Tensor:
    """int32 [B, P + 1]: each page entry's first cache slot, or _NO_SLOT where the entry is outside the
    pool, its slots would pass int32, or (`fault`, on the device) the batch's lengths cannot be trusted;
    column P, for keys past the table's width, is _NO_SLOT."""
    limit = _page_limit(batch)
    if fault is not None:
        limit = torch.where(fault, 0, limit)
    table = batch.page_table
    inside = (table >= 0) & (table < limit)
    bases = torch.where(inside, table * batch.block_kv, _NO_SLOT)
    return torch.nn.functional.pad(bases, (0, 1), value=_NO_SLOT)


def _page_limit(batch: ExtendBatch) -> int:
    """A page entry must lie in [0, limit): a block of the pool (where its size is known) whose slots
    stay within int32."""
    limit = (2**31 - 1) // batch.block_kv
    return limit if batch.num_kv_blocks is None else min(limit, batch.num_kv_blocks)


def _tight_chunks(ranges: HostRanges, rows: int, budget: int) -> list[Chunk]:
    """Greedy: each chunk takes as many rows as fit, a chunk's cost being rows x (ke[last] - ks[first]).
    Along one request's rows ke grows by one a row, so the rows a chunk can take while its last row is in
    request q solve n * (n + c) <= budget / 4 (an isqrt); it goes on into the next request only when it
    takes all of q's rows. Host arithmetic over requests and chunks, no search over rows: the plan is
    built every batch on the engine's critical path."""
    cells = budget // _FP32  # n * width * 4 <= budget, in whole fp32 cells
    row_offsets, key_offsets, prefix = ranges.row_offsets, ranges.key_offsets, ranges.prefix
    chunks, begin, request = [], 0, 0
    while begin < rows:
        while row_offsets[request + 1] <= begin:
            request += 1
        first = key_offsets[request]
        own = _ke_base(ranges, request) + begin - first  # the keys row `begin` alone sees
        if own > cells:
            raise LayoutError(
                f"query row {begin} sees {own} keys: its logits alone take {own * _FP32} bytes, more than the "
                f"budget of {budget}"
            )
        end, last_ke, q = begin, 0, request
        while end < rows:
            if row_offsets[q + 1] == row_offsets[q]:  # no rows: the chunk passes over it
                q += 1
                continue
            base = _ke_base(ranges, q)  # ke of row i of request q is base + i
            most = _most_rows(base + begin - 1 - first, cells)  # width of n rows ending in q: n + that
            if most <= max(begin, row_offsets[q]) - begin:  # not even q's first row
                break
            end = min(begin + most, row_offsets[q + 1])
            last_ke = base + end - 1
            if end < row_offsets[q + 1]:
                break
            q += 1
        chunks.append(Chunk(begin, end, first, last_ke))
        begin = end
    return chunks


def _ke_base(ranges: HostRanges, request: int) -> int:
    """ke of row i of `request` is this plus i: its request's keys up to its own position, plus one."""
    return ranges.key_offsets[request] + ranges.prefix[request] - ranges.row_offsets[request] + 1


def _most_rows(c: int, cells: int) -> int:
    """The largest n >= 0 with n * (n + c) <= cells (c >= 0)."""
    n = (math.isqrt(c * c + 4 * cells) - c) // 2
    while (n + 1) * (n + 1 + c) <= cells:
        n += 1
    while n and n * (n + c) > cells:
        n -= 1
    return n


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
    if batch.total_keys > MAX_KEYS:
        raise LayoutError(f"total_keys={batch.total_keys} is past {MAX_KEYS}: a row's ks / ke and a key's index "
                          "are int32, with room for a row's offset added")
    if batch.total_keys < batch.total_tokens:
        raise LayoutError(f"total_keys={batch.total_keys} < total_tokens={batch.total_tokens}: every new token "
                          f"is a key too")
    if requests == 0 and batch.total_keys:
        raise LayoutError(f"a batch of no requests has no keys; got total_keys={batch.total_keys}")
    blocks = batch.num_kv_blocks
    # The same bound as PagedBatch's: page entries are int32, so a larger pool cannot be indexed.
    if blocks is not None and (not isinstance(blocks, int) or isinstance(blocks, bool) or not 0 <= blocks < 2**31):
        raise LayoutError(f"num_kv_blocks must be a host int >= 0 and at most {2**31 - 1} (the pool's block "
                          f"count; page entries are int32); got {blocks!r}")
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
