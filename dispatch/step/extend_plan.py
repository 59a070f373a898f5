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

from typing import TYPE_CHECKING

import torch

from dispatch.contract.extend_batch import ExtendBatch
# The plan types live in the contract (a backend reads them); named here too, where the step builds them.
from dispatch.contract.extend_plan import DEFAULT_LOGITS_BYTES, Chunk, ChunkTensors, ExtendPlan, RaggedMetadata
from dispatch.contract.key import Arch, Fp8Dtype, ForwardMode, Op
from dispatch.step.extend_batch import build_ragged_metadata, one_launch, page_limit
from dispatch.step.extend_on_host import chunk_views, metadata_and_chunks_on_host
from dispatch.step.paged_plan import EXTEND_STEP_OPS, decide_ops, dispatch_key, key_fp8_dtype, prepare_states

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
    decisions = decide_ops(dispatcher, key, EXTEND_STEP_OPS, pinned, allow_disabled, batch.num_requests or None)
    metadata, chunks, error_flags = _metadata_and_chunks(batch, logits_byte_budget)
    states: dict[Op, object] = {}
    plan = ExtendPlan(
        key=key,
        decisions=decisions,
        metadata=metadata,
        chunks=chunks,
        page_table=batch.page_table,
        block_kv=batch.block_kv,
        logits_byte_budget=logits_byte_budget,
        states=states,
        error_flags=error_flags,
    )
    if prepare:
        # Filled in once the backends have prepared from the plan: rebuilding the frozen plan around them
        # (dataclasses.replace) cost the host ~3 us a batch.
        states.update(prepare_states(decisions, plan))
    return plan


def _metadata_and_chunks(batch: ExtendBatch, budget: int):
    """(metadata, its chunks' tensors, the plan's error flags or None for a fresh word): on a CUDA device
    with Triton, the chunks first (from the host lengths), then one launch writes the metadata, every
    chunk's ks / ke relative to its window, the rows' ke - ks and the flags, all views of one buffer;
    on the CPU with host lengths, one pass of host arithmetic; else build_ragged_metadata's path for the
    batch's device and the chunks' views of it."""
    launch = one_launch(batch)
    if launch is not None:
        metadata, out = launch(batch, budget)
        return metadata, out.chunks, out.error_flags
    if batch.host_prefix_lens is not None and batch.prefix_lens.device.type == "cpu":
        return (*metadata_and_chunks_on_host(batch, page_limit(batch), budget), None)
    metadata = build_ragged_metadata(batch)
    return metadata, chunk_tensors(metadata, metadata.chunks(budget)), None


def chunk_tensors(metadata: RaggedMetadata, chunks: list[Chunk]) -> tuple[ChunkTensors, ...]:
    """Every chunk's per-row tensors, as views of per-batch ones. The plan is built every batch on the
    host's critical path: the work must not grow with the chunk count (tests/step/test_plan_host_cost.py).
    With the metadata on the CPU, the chunks' page rows, ranges and lengths are views of one [4, M] int32
    array written in a few numpy calls (extend_on_host.chunk_views); on a device, the top-k lengths
    ke - ks once for all rows (a shift does not change them) and the ranges relative to each chunk's
    window in one subtraction per chunk that starts past key 0 (a chunk at key 0 views the metadata's
    own): device ops, no sync."""
    if not chunks:
        return ()
    if metadata.row_request.device.type == "cpu":
        return _chunk_tensors_on_host(metadata, chunks)
    return chunk_tensors_from_ranges(metadata, chunks)


def chunk_tensors_from_ranges(metadata: RaggedMetadata, chunks: list[Chunk]) -> tuple[ChunkTensors, ...]:
    """The device form, from the metadata's rows' ks / ke (any device: tests hold it equal to the host
    form and to the one launch's views)."""
    # Each torch call costs a GPU host 3-8 us: one split per per-row tensor whatever the chunk count (none
    # for one chunk), then per chunk its pair's unbind and, past key 0, one subtraction.
    if not chunks:
        return ()
    ranges = metadata.ranges
    ks, ke = ranges.unbind()
    lengths = torch.sub(ke, ks)
    sizes = [c.row_end - c.row_begin for c in chunks]
    one = len(chunks) == 1
    pairs = (ranges,) if one else ranges.split_with_sizes(sizes, 1)
    lengths = (lengths,) if one else lengths.split_with_sizes(sizes)
    page_rows = (metadata.row_request,) if one else metadata.row_request.split_with_sizes(sizes)
    out = []
    for chunk, pair, chunk_lengths, rows in zip(chunks, pairs, lengths, page_rows):
        chunk_ks, chunk_ke = (pair - chunk.key_begin if chunk.key_begin else pair).unbind()
        out.append(ChunkTensors(chunk=chunk, ks=chunk_ks, ke=chunk_ke, lengths=chunk_lengths, page_rows=rows))
    return tuple(out)


def _chunk_tensors_on_host(metadata: RaggedMetadata, chunks: list[Chunk]) -> tuple[ChunkTensors, ...]:
    """The CPU form: with host lengths, views of one [4, M] array (extend_on_host.chunk_views, whose
    page rows equal the metadata's row requests); without, every chunk spans all keys from key 0, so
    it views the metadata's own rows."""
    if metadata.host_ranges is not None:
        return chunk_views(metadata.host_ranges, chunks, metadata.total_tokens)[1]
    lengths = metadata.ke - metadata.ks
    return tuple(ChunkTensors(chunk=c, ks=metadata.ks[c.rows], ke=metadata.ke[c.rows], lengths=lengths[c.rows],
                              page_rows=metadata.row_request[c.rows]) for c in chunks)
