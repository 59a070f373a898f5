"""The extend plan a backend reads: the ragged metadata of an extend batch (RaggedMetadata, with its host
offsets HostRanges and its logits chunks Chunk), each chunk's per-row tensors (ChunkTensors) and the
plan (ExtendPlan). Frozen values; dispatch/step/ builds them (build_ragged_metadata, build_extend_plan).

The chunking is a rule of the metadata: consecutive query rows whose fp32 logits over their key window
fit a byte budget, computed on the host from the host lengths (RaggedMetadata.chunks).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dispatch.contract.bounds import new_error_flags
from dispatch.contract.decision import Decision
from dispatch.contract.errors import LayoutError
from dispatch.contract.key import DispatchKey, Op
from dispatch.contract.plan import DecidedPlan

# vLLM's VLLM_SPARSE_INDEXER_MAX_LOGITS_MB default: the fp32 logits of one chunk stay under 512 MiB.
DEFAULT_LOGITS_BYTES = 512 * 1024 * 1024
_FP32 = 4


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

    @functools.cached_property
    def ke_base(self) -> tuple[int, ...]:
        """Per request q, ke of its row i (i counted over the batch) less i: its keys up to its own
        position, plus one, i.e. key_offsets[q + 1] - row_offsets[q + 1] + 1."""
        return tuple(k - r + 1 for k, r in zip(self.key_offsets[1:], self.row_offsets[1:]))

    def row_ranges(self, rows: int) -> np.ndarray:
        """int32 [2, M]: every row's ks and ke (M = `rows`, the offsets' last row offset): one repeat of
        the requests' ks and ke less the row index by their new tokens, plus the row index."""
        offsets, keys = self.row_offsets, self.key_offsets
        ke_base = self.ke_base
        per_request = np.array([keys[:-1], ke_base], dtype=np.int32).reshape(2, len(ke_base))
        ranges = np.repeat(per_request, [b - a for a, b in zip(offsets, offsets[1:])], axis=1)
        ranges[1] += np.arange(rows, dtype=np.int32)
        return ranges

    def at(self, row: int) -> tuple[int, int]:
        """(ks, ke) of query row `row`: its request's first key, and one past its own position."""
        # The last request starting at or before `row`: requests with no new tokens share the next one's start.
        request = bisect.bisect_right(self.row_offsets, row) - 1
        first = self.key_offsets[request]
        return first, first + self.prefix[request] + row - self.row_offsets[request] + 1

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
    # int32 [2, M]: every row's ks and ke, as built; None where the host lengths give them on request
    # (the `ranges` property): the step reads its chunks' own, and the plan is on every batch's critical
    # path, so the host path does not write two rows of M that no backend reads there.
    row_ranges: torch.Tensor | None = None

    @functools.cached_property
    def ranges(self) -> torch.Tensor:
        """int32 [2, M]: ks and ke as the rows of one tensor, so a chunk's ranges shift in one op."""
        if self.row_ranges is not None:
            return self.row_ranges
        return torch.from_numpy(self.host_ranges.row_ranges(self.total_tokens))

    @property
    def ks(self) -> torch.Tensor:
        """int32 [M]: the first visible gathered key of each query row."""
        return self.ranges[0]

    @property
    def ke(self) -> torch.Tensor:
        """int32 [M]: one past each query row's last visible key."""
        return self.ranges[1]

    def chunk_ranges(self, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """ks / ke of the chunk's rows, relative to its first key (device ops, no sync)."""
        return self.ks[chunk.rows] - chunk.key_begin, self.ke[chunk.rows] - chunk.key_begin

    def chunks(self, byte_budget: int = DEFAULT_LOGITS_BYTES) -> list[Chunk]:
        """Consecutive query-row chunks whose [rows, keys] fp32 logits fit `byte_budget` bytes each
        (row_chunks of this metadata's host ranges and totals)."""
        return row_chunks(self.host_ranges, self.total_tokens, self.total_keys, byte_budget)

    @property
    def host_ks(self) -> tuple[int, ...] | None:
        """Every row's ks on the host (built on request: O(M) Python, for tests and tools)."""
        return None if self.host_ranges is None else tuple(self.host_ranges.at(r)[0] for r in range(self.total_tokens))

    @property
    def host_ke(self) -> tuple[int, ...] | None:
        return None if self.host_ranges is None else tuple(self.host_ranges.at(r)[1] for r in range(self.total_tokens))


def row_chunks(host_ranges: HostRanges | None, rows: int, keys: int,
               byte_budget: int = DEFAULT_LOGITS_BYTES) -> list[Chunk]:
    """Consecutive query-row chunks whose [rows, keys] fp32 logits fit `byte_budget` bytes each.

    With host ranges a chunk's keys are exactly [ks of its first row, ke of its last row) (both grow
    with the row); without them every chunk spans all `keys` keys. LayoutError if one row alone does
    not fit. (A function of the host facts alone, so the step can chunk before any tensor exists.)
    """
    if byte_budget <= 0:
        raise LayoutError(f"byte_budget must be > 0; got {byte_budget}")
    if rows == 0:
        return []
    if host_ranges is None:
        per_chunk = byte_budget // (max(keys, 1) * _FP32)
        if per_chunk == 0:
            raise LayoutError(
                f"one query row's logits over all {keys} gathered keys take {keys * _FP32} bytes, more than "
                f"the budget of {byte_budget}; pass host lengths for tighter chunks or raise the budget"
            )
        return [Chunk(begin, min(begin + per_chunk, rows), 0, keys) for begin in range(0, rows, per_chunk)]
    return _tight_chunks(host_ranges, rows, byte_budget)


def _tight_chunks(ranges: HostRanges, rows: int, budget: int) -> list[Chunk]:
    """Greedy: each chunk takes as many rows as fit, a chunk's cost being rows x (ke[last] - ks[first]).
    Along one request's rows ke grows by one a row, so the rows a chunk can take while its last row is in
    request q solve n * (n + c) <= budget / 4 (an isqrt); it goes on into the next request only when it
    takes all of q's rows. Host arithmetic over requests and chunks, no search over rows: the plan is
    built every batch on the engine's critical path (so the loop keeps its values in locals)."""
    cells = budget // _FP32  # n * width * 4 <= budget, in whole fp32 cells
    row_offsets, key_offsets = ranges.row_offsets, ranges.key_offsets
    ke_base = ranges.ke_base  # ke of row i of request q is ke_base[q] + i
    chunks, begin, request = [], 0, 0
    while begin < rows:
        while row_offsets[request + 1] <= begin:
            request += 1
        first = key_offsets[request]
        own = ke_base[request] + begin - first  # the keys row `begin` alone sees
        if own > cells:
            raise LayoutError(
                f"query row {begin} sees {own} keys: its logits alone take {own * _FP32} bytes, more than the "
                f"budget of {budget}"
            )
        end, last_ke, q = begin, 0, request
        while end < rows:
            q_begin, q_end = row_offsets[q], row_offsets[q + 1]
            if q_end == q_begin:  # no rows: the chunk passes over it
                q += 1
                continue
            base = ke_base[q]
            most = _most_rows(base + begin - 1 - first, cells)  # width of n rows ending in q: n + that
            if most <= max(begin, q_begin) - begin:  # not even q's first row
                break
            end = min(begin + most, q_end)
            last_ke = base + end - 1
            if end < q_end:
                break
            q += 1
        chunks.append(Chunk(begin, end, first, last_ke))
        begin = end
    return chunks


def _most_rows(c: int, cells: int) -> int:
    """The largest n >= 0 with n * (n + c) <= cells (c >= 0)."""
    n = (math.isqrt(c * c + 4 * cells) - c) // 2
    while (n + 1) * (n + 1 + c) <= cells:
        n += 1
    while n and n * (n + c) > cells:
        n -= 1
    return n


@dataclass(frozen=True)
class ChunkTensors:
    """One chunk of query rows and what its logits and top-k calls take, built once per batch."""

    chunk: Chunk
    ks: torch.Tensor  # int32 [rows]: each row's first visible key, relative to the chunk's window
    ke: torch.Tensor  # int32 [rows]: one past its last
    lengths: torch.Tensor  # int32 [rows]: ke - ks, the top-k's visible lengths (its starts are ks)
    page_rows: torch.Tensor  # int32 [rows]: the request of each row, i.e. its row of the page table

    @property
    def rows(self) -> slice:
        return self.chunk.rows

    @property
    def keys(self) -> slice:
        return self.chunk.keys


@dataclass(frozen=True, eq=False)
class ExtendPlan(DecidedPlan):
    """Decisions plus the ragged metadata. Backends read only this; nothing re-derives the path."""

    key: DispatchKey
    decisions: Mapping[Op, Decision]  # one per op of EXTEND_STEP_OPS
    metadata: RaggedMetadata
    chunks: tuple[ChunkTensors, ...]
    page_table: torch.Tensor  # int32 [B, P]: each request's pages, for the slot transform
    block_kv: int
    logits_byte_budget: int
    states: Mapping[Op, Any] = field(default_factory=dict)  # per op, its backend's prepare(plan), if any
    # int32 [1] on the batch's device (dispatch/contract/bounds.py bits): the GPU gather ORs BAD_PAGE for a slot
    # outside the cache, Q quant BAD_POSITION for a position outside the cos/sin cache.
    error_flags: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.error_flags is None:
            flags = self.metadata.length_flags
            flags = new_error_flags(self.page_table.device) if flags is None else flags.clone()
            object.__setattr__(self, "error_flags", flags)

    kind = "extend plan"

    @property
    def ragged_logits(self) -> Decision:
        return self.decision(Op.RAGGED_MQA_LOGITS)

    @property
    def total_tokens(self) -> int:
        return self.metadata.total_tokens

    @property
    def total_keys(self) -> int:
        return self.metadata.total_keys

    @property
    def peak_logits_bytes(self) -> int:
        """The largest chunk's fp32 logits: what the budget bounds."""
        return max((c.chunk.logits_bytes for c in self.chunks), default=0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key.as_dict(),
            "requests": self.page_table.shape[0],
            "total_tokens": self.total_tokens,
            "total_keys": self.total_keys,
            "block_kv": self.block_kv,
            "logits_byte_budget": self.logits_byte_budget,
            "peak_logits_bytes": self.peak_logits_bytes,
            "chunks": [dataclasses.asdict(c.chunk) for c in self.chunks],
            "decisions": {op.value: decision.as_dict() for op, decision in self.decisions.items()},
        }
