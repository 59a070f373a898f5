"""vLLM's top-k kernels behind dispatch's top-k contract (dispatch.contract.TopkRun), called as vLLM
0.33.0's indexer calls them (`model_executor/layers/indexer_topk.py`, `_custom_ops.py`): through the
`torch.ops._C` ops its `vllm._C` extension registers.

- `persistent_topk(logits, lengths, out [rows, k], workspace uint8 >= 1 MiB, k, max_seq_len)`: picks
  per batch between a sampled cutoff, a filtered select and rows split over CTAs. k in {512, 1024,
  2048}; lengths int32, one per row (a [rows] tensor is read as per-row lengths); max_seq_len is the
  host bound of every length (gates the long-row kernels and clamps each length): the logits' width.
- `cooperative_topk(...)`, the same arguments: one thread-block cluster per row with TMA loads, for at
  most 64 rows (vLLM's AUTO_COOPERATIVE_MAX_ROWS), a row stride of a multiple of 4 floats and 16-byte
  aligned rows, SM90 and SM100 (not the SM12x family). k in {512, 1024, 2048}. It loads each row in
  float4 units, up to its length rounded up to 4 (aligned_rows keeps that inside the tensor).
- `top_k_per_row_decode(logits, next_n, seq_lens, out, rows, stride0, stride1, k)`: called with next_n 1
  and per-row lengths, so row r sees columns 0 .. lengths[r] - 1;
  `top_k_per_row_prefill(logits, row_starts, row_ends, out, rows, stride0, stride1, k)`: row r sees
  [row_starts[r], row_ends[r]) and gets positions relative to row_starts[r] (request-relative, as
  vLLM's sparse attention reads them).
- `vllm.auto`: vLLM's own "auto" resolution (`SparseIndexerTopk._resolve_auto`), per call: cooperative
  for <= 64 rows whose stride is a multiple of 4 floats, else persistent, else (k not one they are built
  for) per-row. vLLM never copies logits to align them, so neither does its auto here.

vLLM fills its top-k buffer with -1 before these run, so the adapter hands them a -1-filled output. The
radix kernels' workspace is scratch, as vLLM's workspace manager hands it (uninitialised, shared):
persistent_topk touches it only on its rows-split-over-CTAs path (at most 32 rows on the H200), whose
row states it zeroes itself (a stream-ordered memset), and cooperative_topk (rows x 2048 x 8 bytes, so
1 MiB holds 64 rows) writes its tie buffer before reading it, so it is allocated, not filled.
max_seq_len is the logits' width: vLLM passes the batch's longest length, which is the width of the
[rows, max_context_len] logits dispatch's paged plans hand it (a wider buffer would send
persistent_topk down its long-row kernels for short rows: slower, still exact).
Lengths are clamped to each row's window first (the kernels trust them). NaN ranks above +inf in
their radix keys; the common finish (backends/adapted_topk.py) turns a selected NaN into -1, and
applies sorted=True and the page transform as torch ops. Every run here also takes `engine=True` (the
backend's `engine_run`, for bench): the kernel's own output as vLLM gets it, without that finish.
"""

from __future__ import annotations

import torch

from backends.adapted_topk import CallLimits, aligned_rows, clamped_lengths, finish

RADIX_K = frozenset({512, 1024, 2048})
PER_ROW_MAX_K = 2048
COOPERATIVE_MAX_ROWS = 64
COOPERATIVE_ROW_MULTIPLE = 4
# RADIX_TOPK_WORKSPACE_SIZE in vLLM's indexer_topk.py; the kernels check it.
WORKSPACE_BYTES = 1024 * 1024

PERSISTENT = CallLimits("vllm.persistent_topk", k_values=RADIX_K)
COOPERATIVE = CallLimits("vllm.cooperative_topk", k_values=RADIX_K, rows_max=COOPERATIVE_MAX_ROWS)
PER_ROW = CallLimits("vllm.top_k_per_row", k_max=PER_ROW_MAX_K, row_starts=True)
AUTO = CallLimits("vllm.auto", k_max=PER_ROW_MAX_K)


def run_persistent(ops, logits, lengths, k, **options):
    return _radix(ops.persistent_topk, PERSISTENT, logits, lengths, k, **options)


def run_cooperative(ops, logits, lengths, k, **options):
    return _radix(ops.cooperative_topk, COOPERATIVE, logits, lengths, k, row_multiple=COOPERATIVE_ROW_MULTIPLE,
                  **options)


def run_auto(ops, logits, lengths, k, **options):
    """vLLM's "auto" chain (SparseIndexerTopk._resolve_auto): the first of cooperative, persistent,
    per-row whose limits the call meets; cooperative only on rows it loads as they are."""
    starts = options.get("starts") is not None
    AUTO.check(logits.shape[0], k, starts=starts)
    if COOPERATIVE.why_not(logits.shape[0], k, starts=starts) is None and _cooperative_loads(logits):
        return run_cooperative(ops, logits, lengths, k, **options)
    if PERSISTENT.why_not(logits.shape[0], k, starts=starts) is None:
        return run_persistent(ops, logits, lengths, k, **options)
    return run_per_row(ops, logits, lengths, k, **options)


def _cooperative_loads(logits) -> bool:
    """vLLM's `_cooperative_constraints` on the logits (a row stride of a multiple of 4 floats), with the
    16-byte aligned base its TMA loads assume (vLLM's own buffer always has one)."""
    return logits.stride(0) % COOPERATIVE_ROW_MULTIPLE == 0 and logits.data_ptr() % 16 == 0


def run_per_row(ops, logits, lengths, k, *, starts=None, page_table=None, page_rows=None, block_size=64,
                sorted=False, engine=False):
    rows, width = logits.shape
    PER_ROW.check(rows, k, starts=starts is not None)
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    if rows == 0 or width == 0:
        return out
    first = None if starts is None else starts.to(torch.int32).contiguous()  # the kernel reads rowStarts[row]
    lens = clamped_lengths(logits, lengths, first)
    if first is None:
        ops.top_k_per_row_decode(logits, 1, lens, out, rows, logits.stride(0), logits.stride(1), k)
    else:
        ops.top_k_per_row_prefill(logits, first, first + lens, out, rows, logits.stride(0), logits.stride(1), k)
    if engine:
        return out
    return finish(logits, lens, out, page_table=page_table, page_rows=page_rows, block_size=block_size,
                  sorted=sorted, starts=first)


def _radix(kernel, limits: CallLimits, logits, lengths, k, *, starts=None, page_table=None, page_rows=None,
           block_size=64, sorted=False, row_multiple: int = 1, engine=False):
    rows, width = logits.shape
    limits.check(rows, k, starts=starts is not None)
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    if rows == 0 or width == 0:  # the kernels require max_seq_len > 0
        return out
    scores = aligned_rows(logits, row_multiple)
    lens = clamped_lengths(scores, lengths, None)
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=logits.device)  # the kernels' scratch
    kernel(scores, lens, out, workspace, k, width)  # width: the host bound of every (clamped) length
    if engine:
        return out
    return finish(scores, lens, out, page_table=page_table, page_rows=page_rows, block_size=block_size,
                  sorted=sorted)
