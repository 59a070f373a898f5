"""An extend batch's ragged metadata on a GPU in one launch: what dispatch.step.extend_batch.build_ragged_metadata's
device path computes with ~50 torch ops (each a launch, 5-10 us of the H200 host's time), computed by one
Triton kernel, value for value.

A kernel of the library, not of a plugin: every extend plan on a GPU needs it, whichever backends are
decided, so it lives with the step that builds the plan (triton is optional: without it the step's torch
ops compute the same). It imports the contract only, as a backend would.

Every program needs the batch's request offsets (prefix sums over the B requests) to find the request of
its rows and keys; programs cannot wait on one another, so each recomputes them, B at a time in steps
of REQUESTS_PER_STEP (B is small next to M and S). The request of index i is then the count of requests
whose clamped start is <= i, less one (the starts are sorted, and request 0 starts at 0): the same as
the torch path's searchsorted over the ends, clamped to the last request. The request's own values are
read in the same pass by packing (request, value) into one int64 and taking the max: the requests that
pass the test are a prefix, and the largest request id wins.

The checks are the torch path's: lengths are read in 64 bits and a negative one counts as 0; offsets
are clamped to the host totals before narrowing; lengths that are negative or disagree with the totals
flag BAD_LENGTH and make every gather slot -1; a page entry outside [0, limit) (the pool, and the
int32 room of its slots) or a key past the table's width is slot -1. The kernel reads only the tensors
it is handed, within their shapes.

    int32 [6, M]: row_request, ks and ke relative to each row's chunk window, ke - ks, then the rows'
    own ks and ke;  then slots [S];  key_offsets [B + 1];  length_flags [1];  and the plan's error flags
    [1], born equal to the length flags.  One int32 buffer holds them all (one allocation, one launch,
    the views from one split): each torch call costs the GPU host 3-30 us.

The chunks' windows (dispatch.contract.extend_plan.row_chunks, computed on the host from the host
lengths) reach the kernel as up to MAX_SHIFTS scalar arguments, each a row where the window's first key
changes and that key: the row's shift is the last such key at or before it. So every chunk's ks / ke,
lengths and page rows are views of the one buffer, whatever the chunk count (before, every chunk cost an
unbind, one past key 0 a subtraction, and the chunks three splits: torch calls of 3-10 us each on the
H200's host). A plan whose windows change more often takes shifts of 0 (the relative rows then equal the
rows' own) and its chunks past key 0 subtract their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

# From the modules, not the package: its names load lazily, each looked up at a cost on every plan.
from dispatch.contract.bounds import BAD_LENGTH
from dispatch.contract.extend_plan import Chunk, ChunkTensors, HostRanges, RaggedMetadata, row_chunks

if TYPE_CHECKING:
    from dispatch.contract import ExtendBatch

INDICES_PER_PROGRAM = 256  # rows or keys of one program
REQUESTS_PER_STEP = 16  # requests per step of a program's pass over the offsets
# The kernel's shift arguments. A tight chunk's window starts at its first row's request's first key, so
# the start moves only where a chunk begins in another request: any chunking of up to 9 requests fits.
MAX_SHIFTS = 8
# A shift argument no row reaches: its row (the high 32 bits) is past every row (M <= MAX_KEYS = 2^30).
NO_SHIFT = (2**31 - 1) << 32


@triton.jit
def _after_shift(shift, index, packed):
    """Rows at or past the packed (row << 32 | key) take its key as their shift; the others keep theirs.
    (tl.cast first: the interpreter passes a small argument as int32, whatever its annotation.)"""
    packed = tl.cast(packed, tl.int64)
    return tl.where(index >= (packed >> 32).to(tl.int32), (packed & 0xFFFFFFFF).to(tl.int32), shift)


# The shifts are runtime int64 whatever their value: specialised (a value of 1, or one divisible by 16,
# is a variant of its own) every new chunk layout would compile the kernel again.
@triton.jit(do_not_specialize=[f"shift_{i}" for i in range(MAX_SHIFTS)])
def _ragged_metadata_kernel(
    prefix_ptr,  # int32 [B]: any values
    extend_ptr,  # int32 [B]: any values
    table_ptr,  # int32 [B, P]
    out_ptr,  # int32 [6 * M + S + B + 3], laid out as the module's docstring says
    requests,  # B
    rows,  # M: the host's total_tokens
    keys,  # S: the host's total_keys
    pages,  # P
    limit,  # a page entry must lie in [0, limit)
    stride_prefix,
    stride_extend,
    stride_table_row,
    stride_table_col,
    row_programs,  # programs [0, row_programs) take rows; the rest take keys
    # (first row << 32) | key: from that row on, ks / ke are relative to that key (NO_SHIFT: unused),
    # in row order; MAX_SHIFTS of them
    shift_0: tl.int64, shift_1: tl.int64, shift_2: tl.int64, shift_3: tl.int64,
    shift_4: tl.int64, shift_5: tl.int64, shift_6: tl.int64, shift_7: tl.int64,
    BLOCK: tl.constexpr,
    REQUESTS_PER_STEP: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    PAGE_SHIFT: tl.constexpr,  # log2(BLOCK_KV)
    BAD_LENGTH: tl.constexpr,
):
    pid = tl.program_id(0)
    # The outputs' places in the buffer, in 64 bits: 6 * M + S passes int32 for S near MAX_KEYS. (tl.cast,
    # not .to: an argument equal to 1 reaches the kernel as a constant.)
    rows64 = tl.cast(rows, tl.int64)
    ranges_ptr = out_ptr + rows64  # relative ks [M], relative ke [M], ke - ks [M], then ks [M] and ke [M]
    slots_ptr = out_ptr + 6 * rows64
    key_offsets_ptr = slots_ptr + keys
    length_flags_ptr = key_offsets_ptr + requests + 1
    on_rows = pid < row_programs
    first = tl.where(on_rows, pid, pid - row_programs) * BLOCK
    index = first + tl.arange(0, BLOCK)  # rows or keys, by on_rows
    count = tl.zeros((BLOCK,), tl.int32)  # requests whose start is <= index
    start = tl.zeros((BLOCK,), tl.int32)  # the found request's first key
    packed = tl.full((BLOCK,), -1, tl.int64)  # rows: (request << 32) | (key end - row end + 1) of it
    row_carry = tl.zeros((), tl.int64)
    key_carry = tl.zeros((), tl.int64)
    negative = tl.zeros((), tl.int32)
    for step in range(0, requests, REQUESTS_PER_STEP):
        request = step + tl.arange(0, REQUESTS_PER_STEP)
        live = request < requests
        new = tl.load(extend_ptr + request.to(tl.int64) * stride_extend, mask=live, other=0).to(tl.int64)
        cached = tl.load(prefix_ptr + request.to(tl.int64) * stride_prefix, mask=live, other=0).to(tl.int64)
        negative |= tl.max(((new < 0) | (cached < 0)).to(tl.int32), axis=0)
        new = tl.maximum(new, 0)
        owned = new + tl.maximum(cached, 0)
        row_end = tl.cumsum(new, axis=0) + row_carry
        key_end = tl.cumsum(owned, axis=0) + key_carry
        # Clamped to the totals before narrowing: still sorted, and every search lands on a request.
        row_start32 = tl.minimum(row_end - new, rows).to(tl.int32)
        key_start32 = tl.minimum(key_end - owned, keys).to(tl.int32)
        row_end32 = tl.minimum(row_end, rows).to(tl.int32)
        key_end32 = tl.minimum(key_end, keys).to(tl.int32)
        if pid == 0:
            tl.store(key_offsets_ptr + 1 + request, key_end32, mask=live)
        row_carry += tl.sum(new, axis=0)
        key_carry += tl.sum(owned, axis=0)
        own_start = tl.where(on_rows, row_start32, key_start32)
        below = live[None, :] & (own_start[None, :] <= index[:, None])  # [BLOCK, REQUESTS_PER_STEP]
        count += tl.sum(below.to(tl.int32), axis=1)
        start = tl.maximum(start, tl.max(tl.where(below, key_start32[None, :], 0), axis=1))
        # key end - row end + 1 is >= 1 (keys >= rows, and a request's keys include its rows) but not
        # sorted over the requests: taken at the largest request that passes, by the packed max.
        tail = (key_end32 - row_end32 + 1).to(tl.int64) | (request.to(tl.int64) << 32)
        packed = tl.maximum(packed, tl.max(tl.where(below, tail[None, :], -1), axis=1))
    fault = (negative > 0) | (row_carry != rows) | (key_carry != keys)
    if pid == 0:
        tl.store(key_offsets_ptr, 0)
        tl.store(length_flags_ptr, tl.where(fault, BAD_LENGTH, 0))
        tl.store(length_flags_ptr + 1, tl.where(fault, BAD_LENGTH, 0))  # the plan's error flags, from them
    owner = tl.maximum(count - 1, 0)
    if on_rows:
        live_row = index < rows
        ks = tl.minimum(tl.maximum(start, 0), keys)
        ke = tl.minimum(tl.maximum((packed & 0xFFFFFFFF).to(tl.int32) + index, 0), keys)
        shift = tl.zeros((BLOCK,), tl.int32)
        shift = _after_shift(shift, index, shift_0)
        shift = _after_shift(shift, index, shift_1)
        shift = _after_shift(shift, index, shift_2)
        shift = _after_shift(shift, index, shift_3)
        shift = _after_shift(shift, index, shift_4)
        shift = _after_shift(shift, index, shift_5)
        shift = _after_shift(shift, index, shift_6)
        shift = _after_shift(shift, index, shift_7)
        tl.store(out_ptr + index, owner, mask=live_row)
        tl.store(ranges_ptr + index, ks - shift, mask=live_row)
        tl.store(ranges_ptr + rows64 + index, ke - shift, mask=live_row)
        tl.store(ranges_ptr + 2 * rows64 + index, ke - ks, mask=live_row)
        tl.store(ranges_ptr + 3 * rows64 + index, ks, mask=live_row)
        tl.store(ranges_ptr + 4 * rows64 + index, ke, mask=live_row)
    else:
        live_key = index < keys
        position = index - start  # >= 0: a key's request starts at or before it
        page = position >> PAGE_SHIFT
        has_page = live_key & (page < pages) & (owner < requests)  # a batch of no requests has no keys
        entry = tl.load(table_ptr + owner.to(tl.int64) * stride_table_row + page.to(tl.int64) * stride_table_col,
                        mask=has_page, other=-1)
        inside = has_page & (entry >= 0) & (entry < tl.where(fault, 0, limit))
        slot = tl.where(inside, entry * BLOCK_KV + (position & (BLOCK_KV - 1)), -1)
        tl.store(slots_ptr + index, slot, mask=live_key)


@dataclasses.dataclass(frozen=True)
class DeviceRaggedMetadata:
    """The kernel's outputs: views of one int32 buffer."""

    ranges: torch.Tensor  # int32 [2, M]: ks, ke
    gather_slots: torch.Tensor  # int32 [S]
    row_request: torch.Tensor  # int32 [M]
    key_offsets: torch.Tensor  # int32 [B + 1]
    length_flags: torch.Tensor  # int32 [1]
    error_flags: torch.Tensor  # int32 [1]: the plan's, born equal to length_flags (a word of its own)
    chunks: tuple[ChunkTensors, ...] = ()  # the chunks asked for, their tensors views of the buffer


def chunk_shifts(chunks: Sequence[Chunk]) -> tuple[tuple[int, int], ...] | None:
    """(first row, key) at each chunk whose window starts at another key than the chunk before it
    (the first: than key 0), in row order; None where there are more than the kernel's MAX_SHIFTS."""
    shifts, key = [], 0
    for chunk in chunks:
        if chunk.key_begin != key:
            key = chunk.key_begin
            shifts.append((chunk.row_begin, key))
    return tuple(shifts) if len(shifts) <= MAX_SHIFTS else None


def ragged_metadata_on_device(
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    page_table: torch.Tensor,
    total_tokens: int,
    total_keys: int,
    block_kv: int,
    num_kv_blocks: int | None,
    chunks: Sequence[Chunk] = (),
) -> DeviceRaggedMetadata:
    """One allocation, one launch, one split (and, for several chunks, one view of all rows' requests);
    no sync. The caller has checked shapes, dtypes, devices, block_kv (a power of two) and the totals
    (host ints, total_keys <= 2^30, total_keys >= total_tokens): ExtendBatch does. `chunks`: the plan's
    row chunks (consecutive, covering the rows), whose tensors come back as views of the buffer."""
    requests, pages = page_table.shape
    rows, keys = total_tokens, total_keys
    limit = (2**31 - 1) // block_kv
    if num_kv_blocks is not None:
        limit = min(limit, num_kv_blocks)
    shifts = chunk_shifts(chunks)
    packed = [(row << 32) | key for row, key in shifts or ()]
    out = torch.empty(6 * rows + keys + requests + 3, dtype=torch.int32, device=page_table.device)
    # (plain integer division, not triton.cdiv: a constexpr function, whose call costs the host ~2 us)
    row_programs = -(-rows // INDICES_PER_PROGRAM)
    grid = (max(row_programs - (-keys // INDICES_PER_PROGRAM), 1),)
    _ragged_metadata_kernel[grid](
        prefix_lens, extend_lens, page_table, out,
        requests, rows, keys, pages, limit,
        prefix_lens.stride(0), extend_lens.stride(0), page_table.stride(0), page_table.stride(1),
        row_programs,
        *packed, *[NO_SHIFT] * (MAX_SHIFTS - len(packed)),
        BLOCK=INDICES_PER_PROGRAM,
        REQUESTS_PER_STEP=REQUESTS_PER_STEP,
        BLOCK_KV=block_kv,
        PAGE_SHIFT=block_kv.bit_length() - 1,
        BAD_LENGTH=BAD_LENGTH,
    )
    # One split for every view: per chunk its page rows, relative ks, relative ke and lengths (parts c,
    # n + c, 2n + c, 3n + c), then the rows' own ks / ke, the slots, the offsets and the two flags words.
    sizes = [c.row_end - c.row_begin for c in chunks] or [rows]
    n = len(sizes)
    parts = out.split_with_sizes(sizes * 4 + [2 * rows, keys, requests + 1, 1, 1])
    ranges, slots, key_offsets, length_flags, error_flags = parts[4 * n:]
    return DeviceRaggedMetadata(
        ranges=ranges.view(2, rows), gather_slots=slots,
        row_request=parts[0] if n == 1 else out.narrow(0, 0, rows),
        key_offsets=key_offsets, length_flags=length_flags, error_flags=error_flags,
        chunks=tuple(_chunk_views(chunks, parts, shifts is not None)))


def _chunk_views(chunks: Sequence[Chunk], parts: Sequence[torch.Tensor], shifted: bool):
    """Each chunk's ChunkTensors from the split's parts. Not `shifted` (more windows than MAX_SHIFTS, so
    the kernel shifted none): a chunk past key 0 subtracts its first key from its ks and ke, 2 torch ops."""
    n = len(chunks)
    for i, chunk in enumerate(chunks):
        ks, ke = parts[n + i], parts[2 * n + i]
        if not shifted and chunk.key_begin:
            ks, ke = ks - chunk.key_begin, ke - chunk.key_begin
        yield ChunkTensors(chunk=chunk, ks=ks, ke=ke, lengths=parts[3 * n + i], page_rows=parts[i])


def ragged_metadata_in_one_launch(batch: "ExtendBatch") -> RaggedMetadata:
    """build_ragged_metadata's device path (lengths the host never read) as one kernel launch: the same
    RaggedMetadata, field for field (tests/step/test_ragged_metadata_kernel.py)."""
    return metadata_in_one_launch(batch)[0]


def metadata_in_one_launch(batch: "ExtendBatch", byte_budget: int | None = None) -> tuple[RaggedMetadata,
                                                                                          DeviceRaggedMetadata]:
    """The RaggedMetadata, and the launch's outputs it views (with the plan's error flags, which
    build_extend_plan takes as they are instead of copying the length flags). With `byte_budget`, the
    outputs' chunks are the plan's (row_chunks of the host lengths and totals: LayoutError, before any
    launch, when one row's logits alone pass the budget), every chunk's tensors views of the buffer."""
    host_ranges = None
    if batch.host_prefix_lens is not None and batch.host_extend_lens is not None:
        host_ranges = HostRanges.of(batch.host_prefix_lens, batch.host_extend_lens)
    chunks = () if byte_budget is None else row_chunks(host_ranges, batch.total_tokens, batch.total_keys, byte_budget)
    out = ragged_metadata_on_device(batch.prefix_lens, batch.extend_lens, batch.page_table, batch.total_tokens,
                                    batch.total_keys, batch.block_kv, batch.num_kv_blocks, chunks)
    metadata = RaggedMetadata(
        gather_slots=out.gather_slots,
        row_request=out.row_request,
        key_offsets=out.key_offsets,
        total_tokens=batch.total_tokens,
        total_keys=batch.total_keys,
        host_ranges=host_ranges,
        length_flags=out.length_flags,
        row_ranges=out.ranges,
    )
    return metadata, out
