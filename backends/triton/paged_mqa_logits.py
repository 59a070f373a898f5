"""Paged MQA logits in Triton: the function of backends/reference/paged_mqa_logits.py, same arguments.

    logits[r*N + j, k] = sum_h w[r*N + j, h] * relu(q[r, j, h] . K[k]) * s[k]   for k < ctx[r, j]
                       = -inf                                                    otherwise

Grid: (rows, splits). A program owns one row's (request's) contiguous range of pages and writes every
logit column of that range, -inf included, so no reduction across programs is needed. Per step it
loads PAGES pages of keys [T, D] and computes keys @ q^T -> [T, N*H] in one fp8 dot: the tokens x heads
axis is the dot's N, so the relu-weighted sum over heads reduces along registers of one thread group
rather than across warps (the same orientation as DeepGEMM's SM90 kernel). The q tile [N*H, D] and
the weights are loaded once per program. Pages wholly past every token's length are not read.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from backends.triton.fp8_mode import Fp8Mode, fp8_mode
from dispatch.errors import LayoutError
from dispatch.fp8 import torch_dtype
from dispatch.key import Fp8Dtype


@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr,  # fp8 [R, N, H, D], D contiguous
    k_ptr,  # the cache's bytes as fp8, [num_blocks, BLOCK_KV * (D + 4)]
    s_ptr,  # the cache's scale words as fp32, starting at block 0's first scale
    w_ptr,  # fp32 [R * N, H]
    ctx_ptr,  # int32 [R, N]
    table_ptr,  # int32 [R, M]
    out_ptr,  # fp32 [R * N, max_context_len]
    stride_q_row,
    stride_q_tok,
    stride_q_head,
    stride_w_row,
    stride_ctx_row,
    stride_table_row,
    stride_out_row,
    max_context_len,
    pages_per_split,
    N: tl.constexpr,
    N_PAD: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    PAGES: tl.constexpr,
    PRODUCT_SCALE: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    T: tl.constexpr = PAGES * BLOCK_KV
    NH: tl.constexpr = N_PAD * H
    BLOCK_BYTES: tl.constexpr = BLOCK_KV * (D + 4)
    BLOCK_WORDS: tl.constexpr = BLOCK_BYTES // 4

    tok = tl.arange(0, N_PAD)
    tok_ok = tok < N
    ctx = tl.load(ctx_ptr + row * stride_ctx_row + tok, mask=tok_ok, other=0)
    num_pages = tl.cdiv(max_context_len, BLOCK_KV)
    # Pages past the longest token's length are skipped, and never looked up in the table (engines
    # pad tables with anything); a length past max_context_len is clipped to the output's width.
    valid_pages = tl.minimum(tl.cdiv(tl.max(ctx, axis=0), BLOCK_KV), num_pages)
    page_begin = split * pages_per_split
    page_end = tl.minimum(page_begin + pages_per_split, num_pages)
    col_end = tl.minimum(page_end * BLOCK_KV, max_context_len)
    compute_end = tl.minimum(page_end, valid_pages)

    # q rows are token-major (j * H + h); padded tokens load zeros and carry zero weight.
    qk_row = tl.arange(0, NH)
    q_tok = qk_row // H
    q_head = qk_row % H
    dim = tl.arange(0, D)
    q = tl.load(
        q_ptr + row * stride_q_row + q_tok[:, None] * stride_q_tok + q_head[:, None] * stride_q_head + dim[None, :],
        mask=(q_tok < N)[:, None],
        other=0.0,
    )
    w = tl.load(w_ptr + (row * N + q_tok) * stride_w_row + q_head, mask=q_tok < N, other=0.0) * PRODUCT_SCALE

    out_rows = out_ptr + (row * N + tok).to(tl.int64) * stride_out_row
    t = tl.arange(0, T)
    page_of_t = t // BLOCK_KV
    slot_of_t = t % BLOCK_KV
    for page in range(page_begin, compute_end, PAGES):
        pages_here = page + page_of_t
        block = tl.load(table_ptr + row * stride_table_row + pages_here, mask=pages_here < valid_pages, other=0)
        block = block.to(tl.int64)
        keys = tl.load(k_ptr + (block * BLOCK_BYTES + slot_of_t * D)[:, None] + dim[None, :])
        scale = tl.load(s_ptr + block * BLOCK_WORDS + slot_of_t)
        scores = tl.dot(keys, tl.trans(q))  # [T, N_PAD * H], fp32 accumulation
        scores = tl.maximum(scores, 0.0) * w[None, :]
        logits = tl.sum(tl.reshape(scores, (T, N_PAD, H)), axis=2) * scale[:, None]
        col = page * BLOCK_KV + t
        # A select, not a multiply: bytes past a length are garbage and may decode to NaN.
        logits = tl.where(col[:, None] < ctx[None, :], logits, float("-inf"))
        tl.store(out_rows[None, :] + col[:, None], logits, mask=tok_ok[None, :] & (col < col_end)[:, None])
    fill_begin = tl.maximum(page_begin, page_begin + tl.cdiv(compute_end - page_begin, PAGES) * PAGES)
    neg_inf = tl.full((N_PAD, T), float("-inf"), tl.float32)
    for page in range(fill_begin, page_end, PAGES):
        col = page * BLOCK_KV + t
        tl.store(out_rows[:, None] + col[None, :], neg_inf, mask=tok_ok[:, None] & (col < col_end)[None, :])


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Tuning knobs: pages per step (PAGES * 64 keys per dot), pages per program, warps, pipeline depth."""

    pages: int = 1
    pages_per_split: int = 32
    num_warps: int = 4
    num_stages: int = 2


def default_config(n_pad: int, device: torch.device) -> LaunchConfig:
    """Per padded next_n; see NOTES.md for the measurements behind the choice."""
    if device.type != "cuda":
        # The interpreter pays per program and per step: few, large ones.
        return LaunchConfig(pages=2, pages_per_split=64, num_warps=4, num_stages=1)
    if n_pad == 1:
        return LaunchConfig(pages=2, pages_per_split=32, num_warps=4, num_stages=3)
    if n_pad <= 4:
        return LaunchConfig(pages=2, pages_per_split=32, num_warps=8, num_stages=2)
    return LaunchConfig(pages=1, pages_per_split=32, num_warps=8, num_stages=2)


def paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    fp8_dtype: Fp8Dtype = Fp8Dtype.E4M3FN,
    *,
    fnuz_mode: Fp8Mode | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """fp32 logits [rows * N, max_context_len], -inf past each token's length. No host-device sync."""
    mode = fp8_mode(fp8_dtype, fnuz_mode)
    rows, next_n, heads, head_dim = _check(q, kv_cache, weights, context_lens, block_table, max_context_len, fp8_dtype)
    num_blocks, block_kv = kv_cache.shape[0], kv_cache.shape[1]
    out = torch.empty((rows * next_n, max_context_len), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    n_pad = triton.next_power_of_2(next_n)
    cfg = config or default_config(n_pad, q.device)
    if cfg.pages_per_split % cfg.pages:
        raise ValueError(f"pages_per_split {cfg.pages_per_split} is not a multiple of pages {cfg.pages}")
    flat = kv_cache.view(num_blocks, -1)
    keys = flat.view(mode.torch_view_dtype)
    scales = flat[:, block_kv * head_dim :].view(torch.float32)
    num_pages = triton.cdiv(max_context_len, block_kv)
    grid = (rows, triton.cdiv(num_pages, cfg.pages_per_split))
    _paged_mqa_logits_kernel[grid](
        q.view(mode.torch_view_dtype),
        keys,
        scales,
        weights,
        context_lens,
        block_table,
        out,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        weights.stride(0),
        context_lens.stride(0),
        block_table.stride(0),
        out.stride(0),
        max_context_len,
        cfg.pages_per_split,
        N=next_n,
        N_PAD=n_pad,
        H=heads,
        D=head_dim,
        BLOCK_KV=block_kv,
        PAGES=cfg.pages,
        PRODUCT_SCALE=mode.product_scale,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _check(q, kv_cache, weights, context_lens, block_table, max_context_len, fp8_dtype) -> tuple[int, int, int, int]:
    """Shapes, strides, dtypes and devices, from metadata only (no tensor value is read)."""
    if q.dim() != 4:
        raise LayoutError(f"q must be [R, N, H, D]; got {list(q.shape)}")
    rows, next_n, heads, head_dim = q.shape
    if q.dtype != torch_dtype(fp8_dtype):
        raise LayoutError(f"q has dtype {q.dtype}; expected {torch_dtype(fp8_dtype)} for a {Fp8Dtype(fp8_dtype).value} cache")
    if q.stride(3) != 1:
        raise LayoutError(f"q must be contiguous along D; got strides {q.stride()}")
    if not (_pow2(heads) and _pow2(head_dim) and heads >= 16 and head_dim >= 32):
        raise LayoutError(f"H={heads} and D={head_dim} must be powers of two, H >= 16, D >= 32")
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != head_dim + 4:
        raise LayoutError(f"kv_cache must be [num_blocks, block_kv, 1, D+4={head_dim + 4}]; got {list(kv_cache.shape)}")
    if kv_cache.dtype != torch.uint8 or not kv_cache.is_contiguous():
        raise LayoutError(f"kv_cache must be contiguous uint8; got {kv_cache.dtype}, strides {kv_cache.stride()}")
    block_kv = kv_cache.shape[1]
    if not (_pow2(block_kv) and block_kv >= 16):
        raise LayoutError(f"block_kv={block_kv} must be a power of two >= 16")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (rows * next_n, heads) or weights.stride(1) != 1:
        raise LayoutError(
            f"weights must be fp32 [R*N={rows * next_n}, H={heads}] contiguous along H; "
            f"got {weights.dtype} {list(weights.shape)}, strides {weights.stride()}"
        )
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (rows, next_n) or context_lens.stride(1) != 1:
        raise LayoutError(
            f"context_lens must be int32 [R={rows}, N={next_n}] contiguous along N; "
            f"got {context_lens.dtype} {list(context_lens.shape)}, strides {context_lens.stride()}"
        )
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != rows:
        raise LayoutError(f"block_table must be int32 [R={rows}, M]; got {block_table.dtype} {list(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise LayoutError(f"block_table must be contiguous along M; got strides {block_table.stride()}")
    if not isinstance(max_context_len, int) or max_context_len < 0:
        raise ValueError(f"max_context_len must be a host int >= 0; got {max_context_len!r}")
    if block_table.shape[1] * block_kv < max_context_len:
        raise LayoutError(
            f"block_table has {block_table.shape[1]} pages of {block_kv}, fewer than max_context_len={max_context_len} needs"
        )
    devices = {t.device for t in (q, kv_cache, weights, context_lens, block_table)}
    if len(devices) != 1:
        raise LayoutError(f"all tensors must be on one device; got {sorted(str(d) for d in devices)}")
    return rows, next_n, heads, head_dim


def _pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0
