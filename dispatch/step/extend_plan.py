"""The per-batch plan of an extend batch (dispatch.contract.ExtendPlan): one decision per op of the
ragged step and the ragged metadata, built once per batch from an ExtendBatch and carried into every
layer's call.

The step per layer (IndexerStep.select): gather this layer's K through the plan's slots, then per
query-row chunk: Q quant -> ragged logits over the chunk's key window -> top-k over each row's
[ks, ke). The chunks keep each chunk's fp32 logits under `logits_byte_budget` bytes; their per-row
tensors (ranges relative to the chunk's window, top-k starts and lengths, page rows) are built here,
once per batch, without waiting on the device.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from dispatch.contract.extend_batch import ExtendBatch
# The plan types live in the contract (a backend reads them); named here too, where the step builds them.
from dispatch.contract.extend_plan import DEFAULT_LOGITS_BYTES, Chunk, ChunkTensors, ExtendPlan, RaggedMetadata
from dispatch.contract.key import Arch, Fp8Dtype, ForwardMode, Op
from dispatch.step.extend_batch import build_ragged_metadata
from dispatch.step.paged_plan import EXTEND_STEP_OPS, decider, dispatch_key, key_fp8_dtype, prepare_states
from dispatch.step.ragged_on_host import arange_on_host

if TYPE_CHECKING:
    from dispatch.deciding.dispatcher import Dispatcher


def build_extend_plan(
    dispatcher: "Dispatcher",
    batch: ExtendBatch,
    *,
    kv_fp8_dtype: Fp8Dtype | torch.dtype,
    logits_byte_budget: int = DEFAULT_LOGITS_BYTES,
    arch: Arch | str | None = None,
    pinned: dict[Op, str] | None = None,
    allow_disabled: bool = False,
    prepare: bool = True,
) -> ExtendPlan:
    """Decide every op of EXTEND_STEP_OPS for this batch and build its ragged metadata and chunks.
    No host-device sync: row and key counts come from the batch's host totals (and its host lengths,
    when given, for tight chunks). LayoutError when one query row's logits alone pass the budget.

    `kv_fp8_dtype` is the K cache's fp8 dtype and becomes the key's, as in build_plan; `pinned` and
    `allow_disabled` as there; `prepare=False` skips the backends' per-batch state (a what-if)."""
    key = dispatch_key(arch or dispatcher.target_arch, ForwardMode.EXTEND, 1, key_fp8_dtype(kv_fp8_dtype))
    # The declared request count picks a measured band (shapes `R=<n>`), as B does in build_plan; a batch
    # of no requests has no size to choose by.
    decide = decider(dispatcher, key, pinned, allow_disabled, batch.num_requests or None)
    decisions = {op: decide(op) for op in EXTEND_STEP_OPS}
    metadata = build_ragged_metadata(batch)
    plan = ExtendPlan(
        key=key,
        decisions=decisions,
        metadata=metadata,
        chunks=chunk_tensors(metadata, metadata.chunks(logits_byte_budget)),
        page_table=batch.page_table,
        block_kv=batch.block_kv,
        logits_byte_budget=logits_byte_budget,
    )
    if not prepare:
        return plan
    states = prepare_states(decisions, plan)
    return dataclasses.replace(plan, states=states) if states else plan


def chunk_tensors(metadata: RaggedMetadata, chunks: list[Chunk]) -> tuple[ChunkTensors, ...]:
    """Every chunk's per-row tensors, as views of per-batch ones. The plan is built every batch on the
    host's critical path: the work must not grow with the chunk count (tests/step/test_plan_host_cost.py).
    With the metadata on the CPU, the chunks' ranges and lengths are one [3, M] int32 array in a few numpy
    calls and their page rows views of the metadata's; on a device, the top-k lengths ke - ks once for all
    rows (a shift does not change them) and the ranges relative to each chunk's window in one subtraction
    per chunk that starts past key 0 (a chunk at key 0 views the metadata's own): device ops, no sync."""
    if not chunks:
        return ()
    if metadata.row_request.device.type == "cpu":
        return _chunk_tensors_on_host(metadata, chunks)
    return chunk_tensors_from_ranges(metadata, chunks)


def chunk_tensors_from_ranges(metadata: RaggedMetadata, chunks: list[Chunk]) -> tuple[ChunkTensors, ...]:
    """The device form, from the metadata's rows' ks / ke (any device: tests hold it equal to the host form)."""
    # Each torch call costs a GPU host 3-8 us: one split per per-row tensor whatever the chunk count,
    # then per chunk its pair's unbind and, past key 0, one subtraction.
    ranges = metadata.ranges
    ks, ke = ranges.unbind()
    sizes = [c.row_end - c.row_begin for c in chunks]
    pairs = ranges.split_with_sizes(sizes, 1)
    lengths = torch.sub(ke, ks).split_with_sizes(sizes)
    page_rows = metadata.row_request.split_with_sizes(sizes)
    out = []
    for chunk, pair, chunk_lengths, rows in zip(chunks, pairs, lengths, page_rows):
        chunk_ks, chunk_ke = (pair - chunk.key_begin if chunk.key_begin else pair).unbind()
        out.append(ChunkTensors(chunk=chunk, ks=chunk_ks, ke=chunk_ke, lengths=chunk_lengths, page_rows=rows))
    return tuple(out)


def _chunk_tensors_on_host(metadata: RaggedMetadata, chunks: list[Chunk]) -> tuple[ChunkTensors, ...]:
    """The CPU form, from the host lengths: a row of request r in a chunk whose window starts at key b has
    ks = key_offsets[r] - b, ke = ke_base[r] - b + i and ke - ks = ke_base[r] - key_offsets[r] + i (i its
    row index), so every chunk's rows are one repeat of per-(request, chunk) values [3, pieces] by the
    pieces' row counts, plus one add of the row index: numpy calls whose count grows with neither the rows
    nor the chunks, each row of M written once. The page rows are the metadata's row requests. Each
    chunk's tensors are views, from one split per row."""
    ranges = metadata.host_ranges
    if ranges is None:  # no host lengths: every chunk spans all keys, from key 0, so the metadata's own rows
        lengths = metadata.ke - metadata.ks
        return tuple(ChunkTensors(chunk=c, ks=metadata.ks[c.rows], ke=metadata.ke[c.rows], lengths=lengths[c.rows],
                                  page_rows=metadata.row_request[c.rows]) for c in chunks)
    row_offsets, key_offsets = ranges.row_offsets, ranges.key_offsets
    values, counts, request = ([], [], []), [], 0
    for chunk in chunks:  # pieces: a chunk's rows cut at request boundaries (at most B + chunks of them)
        row = chunk.row_begin
        while row < chunk.row_end:
            while row_offsets[request + 1] <= row:
                request += 1
            end = min(chunk.row_end, row_offsets[request + 1])
            first, ke_base = key_offsets[request], key_offsets[request + 1] - row_offsets[request + 1] + 1
            values[0].append(first - chunk.key_begin)
            values[1].append(ke_base - chunk.key_begin)
            values[2].append(ke_base - first)
            counts.append(end - row)
            row = end
    rows = np.array(values, dtype=np.int32).repeat(counts, axis=1)  # [3, M]: ks, ke, lengths less i (the method: no wrapper)
    rows[1:] += arange_on_host(metadata.total_tokens)
    sizes = [c.row_end - c.row_begin for c in chunks]
    # split_with_sizes, not Tensor.split: that is a Python wrapper costing as much again per call.
    ks, ke, lengths = (row.split_with_sizes(sizes) for row in torch.from_numpy(rows).unbind())
    page_rows = metadata.row_request.split_with_sizes(sizes)
    return tuple(ChunkTensors(chunk=c, ks=a, ke=b, lengths=n, page_rows=p)
                 for c, a, b, n, p in zip(chunks, ks, ke, lengths, page_rows))
