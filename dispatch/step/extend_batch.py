"""What the indexer needs for an extend batch (its ragged metadata), built from what an engine knows
about it: the batch (dispatch.contract.ExtendBatch, whose docstring says which keys a row sees) into a
dispatch.contract.RaggedMetadata.

build_ragged_metadata never waits on the device: row and key counts come from the host totals engines
keep. Per-request host lengths (optional) make the row chunks tight and let the lengths be validated;
without them chunks span the whole key buffer. Three paths compute the same values: checked CPU lengths
in numpy (ragged_on_host.py), lengths on a GPU in one Triton launch (ragged_metadata_kernel.py), and the
torch ops below, on any device (the device path's guards, and where Triton is not installed).
"""

from __future__ import annotations

import functools

import torch

from dispatch.contract.bounds import BAD_LENGTH
# The batch and metadata types live in the contract (a backend reads them); named here too, where the
# step builds them.
from dispatch.contract.extend_batch import MAX_KEYS, ExtendBatch  # noqa: F401
from dispatch.contract.extend_plan import DEFAULT_LOGITS_BYTES, Chunk, HostRanges, RaggedMetadata  # noqa: F401
from dispatch.step.ragged_on_host import ragged_fields_on_host


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
        return RaggedMetadata(**ragged_fields_on_host(batch, page_limit(batch)))
    if not on_host and (launch := one_launch(batch)) is not None:  # the same values in one launch, not ~35
        return launch(batch)[0]
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
        gather_slots=slots,
        row_request=row_request,
        key_offsets=key_offsets,
        total_tokens=rows,
        total_keys=keys,
        host_ranges=host_ranges,
        length_flags=length_flags,
        row_ranges=ranges,
    )


def one_launch(batch: ExtendBatch):
    """For a batch on a CUDA device where Triton is installed, the kernel path's function
    (ragged_metadata_kernel.metadata_in_one_launch: the metadata and the launch's outputs, with a byte
    budget every chunk's tensors too); else None, and the torch ops of build_ragged_metadata compute
    the same."""
    return _kernel_path() if batch.prefix_lens.device.type == "cuda" else None


@functools.cache  # looked for once: a failed import searches the path again at every call
def _kernel_path():
    try:
        from dispatch.step.ragged_metadata_kernel import metadata_in_one_launch
    except ModuleNotFoundError as error:  # triton is optional
        if error.name != "triton":
            raise
        return None
    return metadata_in_one_launch


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
    limit = page_limit(batch)
    if fault is not None:
        limit = torch.where(fault, 0, limit)
    table = batch.page_table
    inside = (table >= 0) & (table < limit)
    bases = torch.where(inside, table * batch.block_kv, _NO_SLOT)
    return torch.nn.functional.pad(bases, (0, 1), value=_NO_SLOT)


def page_limit(batch: ExtendBatch) -> int:
    """A page entry must lie in [0, limit): a block of the pool (where its size is known) whose slots
    stay within int32."""
    limit = (2**31 - 1) // batch.block_kv
    return limit if batch.num_kv_blocks is None else min(limit, batch.num_kv_blocks)
