"""build_extend_plan's path for a batch whose lengths are on the CPU and on the host (ExtendBatch's
host_prefix_lens / host_extend_lens, checked where the batch was built): its ragged metadata and every
chunk's tensors in one pass, the same values as build_ragged_metadata + chunk_tensors compute in two
(tests/step/test_extend_on_host.py holds them equal).

The plan is built every batch on the engine's critical path, and on a CPU each torch call costs a few
us of dispatch and each numpy call about one (issue 24, item 5; docs/benchmarks.md "Host time"), so the
work is laid out for few calls whatever the chunk count: the chunks come first, from the host lengths
alone (row_chunks); then every per-row value the plan carries (the rows' requests, and their ks, ke and
ke - ks relative to their chunk's window) is one int32 [4, M] array, one `repeat` of per-piece values (a
piece: a chunk's rows within one request) plus one add of the row index; it becomes a tensor without a
copy, and every chunk's four tensors are views of it from one split. The slots are ragged_on_host's
(one repeat of per-page values plus the key index).
"""

from __future__ import annotations

import numpy as np
import torch

from dispatch.contract.extend_plan import Chunk, ChunkTensors, HostRanges, RaggedMetadata, row_chunks
from dispatch.step.ragged_on_host import arange_on_host, slots_on_host


def metadata_and_chunks_on_host(batch, limit: int, byte_budget: int) -> tuple[RaggedMetadata, tuple[ChunkTensors, ...]]:
    """The RaggedMetadata and the ChunkTensors of a CPU batch with host lengths. `limit`: a page entry
    must lie in [0, limit) (the pool and the int32 room of its slots). LayoutError (from row_chunks)
    when one query row's logits alone pass `byte_budget`."""
    host = HostRanges.of(batch.host_prefix_lens, batch.host_extend_lens)
    rows, keys = batch.total_tokens, batch.total_keys
    chunks = row_chunks(host, rows, keys, byte_budget)
    row_request, chunk_tensors = chunk_views(host, chunks, rows)
    metadata = RaggedMetadata(
        gather_slots=slots_on_host(batch.page_table.numpy(), batch.block_kv, limit, host.key_offsets, keys),
        row_request=row_request,
        key_offsets=torch.from_numpy(np.array(host.key_offsets, dtype=np.int32)),
        total_tokens=rows,
        total_keys=keys,
        host_ranges=host,  # the rows' absolute ks / ke wait until asked for: no backend reads them here
    )
    return metadata, chunk_tensors


def chunk_views(host: HostRanges, chunks: list[Chunk], rows: int) -> tuple[torch.Tensor, tuple[ChunkTensors, ...]]:
    """(row_request int32 [M], each chunk's ChunkTensors), all views of one int32 [4, M] array.

    A row i of request r in a chunk whose window starts at key b has page row r, ks = key_offsets[r] - b,
    ke = ke_base[r] - b + i and ke - ks = ke_base[r] - key_offsets[r] + i (HostRanges.ke_base), so the
    four rows are one repeat of per-piece values by the pieces' row counts, plus the row index on the
    last two."""
    row_offsets, key_offsets, ke_bases = host.row_offsets, host.key_offsets, host.ke_base
    pieces, counts, request = [], [], 0
    for chunk in chunks:  # pieces: a chunk's rows cut at request boundaries (at most B + chunks of them)
        row, shift = chunk.row_begin, chunk.key_begin
        while row < chunk.row_end:
            while row_offsets[request + 1] <= row:  # (requests of no rows own no piece)
                request += 1
            end = min(chunk.row_end, row_offsets[request + 1])
            first, ke_base = key_offsets[request], ke_bases[request]
            pieces.append((request, first - shift, ke_base - shift, ke_base - first))
            counts.append(end - row)
            row = end
    # [4, M], C-contiguous (repeat's result), from the pieces' [4, pieces]
    per_row = np.array(pieces, dtype=np.int32).reshape(len(counts), 4).T.repeat(counts, axis=1)
    per_row[2:] += arange_on_host(rows)
    row_request = torch.from_numpy(per_row[0])
    if not chunks:
        return row_request, ()
    sizes = [c.row_end - c.row_begin for c in chunks]
    # One split of the flat array: chunk c's page rows, ks, ke and lengths are parts c, n + c, 2n + c, 3n + c.
    # (split_with_sizes, not Tensor.split: that is a Python wrapper costing as much again per call.)
    parts = torch.from_numpy(per_row.reshape(-1)).split_with_sizes(sizes * 4)
    n = len(chunks)
    return row_request, tuple(ChunkTensors(chunk=c, ks=parts[n + i], ke=parts[2 * n + i], lengths=parts[3 * n + i],
                                           page_rows=parts[i]) for i, c in enumerate(chunks))
