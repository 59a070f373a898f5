"""SGLang's top-k kernels behind dispatch's top-k contract (dispatch.contract.TopkRun), called through
their public Python entry points as sglang 0.5.23 and sglang-kernel 0.4.10 ship them.

Top-k v2 (`sglang.kernels.ops.attention.dsv4.topk`, JIT-compiled by SGLang with tvm-ffi), what SGLang's
DSA indexer runs on CUDA:
- `plan_topk_v2(seq_lens) -> int32 [rows + 1, 2]`: routes the few very long rows to 8-CTA clusters.
  Built once per batch (this backend's prepare, over the plan's token lengths) and refreshed in place
  for CUDA graphs; a call outside a plan builds it itself (one small extra launch).
- `topk_transform_paged_v2(scores, seq_lens, page_tables | None, out [rows, k], page_size, metadata,
  out_raw_indices=None)`: row r's top-k of scores[r, :seq_lens[r]], -1 padded, unordered; with a page
  table [rows, M] (one row per score row) and a power-of-two page size it can also write the physical
  slots; this adapter asks for the positions alone, since the finish (one pass that also applies the
  NaN rule) maps them through dispatch's [P, M] table and page_rows at no extra read. Its host checks: fp32, unit column stride, a row
  stride that is a multiple of 4 floats (16-byte loads), 0 < k <= 2048, metadata [rows + 1, 2].
- `topk_transform_ragged_v2(scores, seq_lens, out_offsets=, out_indices=, row_starts=)`: row r's
  top-k of scores[r, ks : ks + seq_lens[r]] written as position + out_offsets[r] (-1 padded); for a row
  longer than k it writes its padding value (a quiet NaN in 0.5.23's `topk_impl.cuh`) into the <= 3
  columns ahead of an unaligned window (its 16-byte read base pulls them in), which this adapter puts
  back, so the caller's logits come out unchanged.
Both read seq_lens as uint32 and trust them: lengths are clamped to each row's window first.

sgl-kernel's `fast_topk_v2(score, lengths, topk, row_starts=None)`: the older AOT kernel (one 1024-thread
CTA per row, fp16 histogram then 8-bit refinements); asserts topk == 2048; positions relative to
row_starts; a row no longer than k gets 0 .. len - 1 without its values being read.

NaN: all three rank a NaN above +inf; the common finish (backends/adapted_topk.py) turns a selected NaN
into -1. sorted=True is a torch sort after the kernel (the paged transform then runs in torch too).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from backends.adapted_topk import CallLimits, aligned_rows, clamped_lengths, finish

V2_MAX_K = 2048
FAST_TOPK_K = 2048
# topk_v2's scores are read 16 bytes at a time: the row stride must be a multiple of 4 floats.
V2_ROW_MULTIPLE = 4

V2_PAGED = CallLimits("sglang.topk_v2", k_max=V2_MAX_K)
V2_RAGGED = CallLimits("sglang.topk_v2.ragged", k_max=V2_MAX_K, row_starts=True)
# Its candidate buffer holds 8K entries a refinement round and is clamped, not grown: on the H200
# (2026-12-01) 2 of 256 rows 49K-98K wide came out wrong (B=64 N=4 L~64K) while every row up to 49K
# wide was exact, so wider rows are refused rather than answered wrongly.
FAST_TOPK_MAX_WIDTH = 49152
FAST_TOPK = CallLimits("sglang.fast_topk", k_values=frozenset({FAST_TOPK_K}), row_starts=True,
                       width_max=FAST_TOPK_MAX_WIDTH,
                       width_reason="its clamped candidate buffer lost keys on rows this long on the H200")


@dataclass(frozen=True)
class V2Plan:
    """The v2 kernel's routing plan for one batch, over the plan's token lengths (clamped to its width)."""

    metadata: torch.Tensor  # int32 [rows + 1, 2]
    lengths: torch.Tensor  # the clamped lengths it was built from, int32 [rows]
    source_ptr: int  # where the plan's own token lengths live: a call over other lengths plans itself
    width: int


def prepare_v2(module: ModuleType, plan) -> V2Plan:
    """Once per batch: plan_topk_v2 over the plan's token lengths, cut to its logits' width (the plan's
    one launch wrote them so where it ran: no clamp on the host's path then)."""
    lengths = plan.readable_token_lengths()
    # (token_lengths is a view of context_lens: the same address, without a reshape on the host's path)
    return V2Plan(module.plan_topk_v2(lengths), lengths, plan.context_lens.data_ptr(), plan.max_context_len)


def refresh_v2(captured: V2Plan, fresh: V2Plan) -> None:
    """A CUDA graph replays the captured plan's addresses: write the fresh batch's plan into them."""
    captured.metadata.copy_(fresh.metadata)
    captured.lengths.copy_(fresh.lengths)


def run_v2_paged(module: ModuleType, logits, lengths, k, *, starts=None, page_table=None, page_rows=None,
                 block_size=64, sorted=False, state: V2Plan | None = None, engine: bool = False):
    """The contract's call; `engine=True` (the backend's `engine_run`) returns the kernel's own positions as
    SGLang gets them, without the finish: a selected NaN stays, no sort, no page transform."""
    rows, width = logits.shape
    V2_PAGED.check(rows, k, starts=starts is not None)
    if rows == 0 or width == 0:
        return _none_selected(rows, k, logits.device)
    scores = aligned_rows(logits, V2_ROW_MULTIPLE)
    ours = state is not None and state.source_ptr == lengths.data_ptr() and state.width == width
    lens = state.lengths if ours else clamped_lengths(scores, lengths, None)
    metadata = state.metadata if ours else module.plan_topk_v2(lens)
    raw = torch.empty(rows, k, dtype=torch.int32, device=logits.device)
    # The kernel's own page transform is not used: the finish turns a selected NaN into -1 and maps the
    # positions through the table in the same pass, so asking the kernel for slots would only add a write.
    module.topk_transform_paged_v2(scores, lens, None, raw, block_size, metadata)
    if engine:
        return raw
    return finish(scores, lens, raw, page_table=page_table, page_rows=page_rows, block_size=block_size,
                  sorted=sorted)


def run_v2_ragged(module: ModuleType, logits, lengths, k, *, starts=None, page_table=None, page_rows=None,
                  block_size=64, sorted=False):
    rows, width = logits.shape
    V2_RAGGED.check(rows, k, starts=starts is not None)
    if rows == 0 or width == 0:
        return _none_selected(rows, k, logits.device)
    scores = aligned_rows(logits, V2_ROW_MULTIPLE)
    # Its matcher takes row_starts int32 and contiguous only; a strided view of an engine's starts is copied.
    first = torch.zeros_like(lengths) if starts is None else starts.to(torch.int32).contiguous()
    lens = clamped_lengths(scores, lengths, first)
    # The kernel masks the <= 3 columns between each window's 16-byte-aligned base and its start.
    ahead = ((first // V2_ROW_MULTIPLE) * V2_ROW_MULTIPLE).long()[:, None] + torch.arange(
        V2_ROW_MULTIPLE, device=logits.device)
    ahead = ahead.clamp(max=width - 1)
    kept = torch.gather(scores, 1, ahead)
    out = torch.empty(rows, k, dtype=torch.int32, device=logits.device)
    module.topk_transform_ragged_v2(scores, lens, out_offsets=torch.zeros_like(lens), out_indices=out,
                                    row_starts=first)
    scores.scatter_(1, ahead, kept)
    return finish(scores, lens, out, page_table=page_table, page_rows=page_rows, block_size=block_size,
                  sorted=sorted, starts=first)


def run_fast_topk(module: ModuleType, logits, lengths, k, *, starts=None, page_table=None, page_rows=None,
                  block_size=64, sorted=False):
    rows, width = logits.shape
    FAST_TOPK.check(rows, k, starts=starts is not None, width=width)
    if rows == 0 or width == 0:
        return _none_selected(rows, k, logits.device)
    first = None if starts is None else starts.to(torch.int32).contiguous()  # the kernel reads row_starts[row]
    lens = clamped_lengths(logits, lengths, first)
    positions = module.fast_topk_v2(logits, lens, k, row_starts=first)
    return finish(logits, lens, positions, page_table=page_table, page_rows=page_rows, block_size=block_size,
                  sorted=sorted, starts=first)


def _none_selected(rows: int, k: int, device) -> torch.Tensor:
    return torch.full((rows, k), -1, dtype=torch.int32, device=device)

