"""Ragged MQA logits in Triton: the function of backends/reference/ragged_mqa_logits.py, same arguments.

    logits[m, s] = sum_h w[m, h] * relu(q[m, h] . k[s]) * scale[s]   for ks[m] <= s < ke[m]
                 = -inf                                               otherwise

Grid: one program per tile of BLOCK_Q consecutive query rows, launched last tile first (in a causal
request the last rows see the most keys, so the longest programs start first and the tail is short).
A program scores the key blocks of [min ks, max ke) of its rows: keys [BLOCK_K, D] are the dot's M and
q^T [D, BLOCK_Q * H] its N (rows x heads, as in the paged kernel), so the relu-weighted head sum stays
inside a thread and its quad. Every other column of its rows gets -inf from wide stores that read
nothing (unless clean_logits=False). K rows outside [min ks, max ke) are never read; docs/internal/triton-notes.md
has the design and the measurements. NaN follows the paged kernel's rule (a NaN q or key byte, a NaN weight or a
non-finite key scale makes the logits it touches NaN), so top-k never selects such a key.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from backends.triton.fp8_mode import Fp8Mode, fp8_mode
from backends.triton.paged_mqa_logits import NAN_BY_HARDWARE, _is_nan_byte, nan_bytes_mode
from dispatch.contract import DtypeMismatchError, LayoutError, fp8_dtype_of, readable_width


@triton.jit
def _ragged_mqa_logits_kernel(
    q_ptr,  # fp8 [M, H, D], D contiguous
    k_ptr,  # fp8 [S, D], D contiguous
    s_ptr,  # fp32 [S]
    w_ptr,  # fp32 [M, H], H contiguous
    ks_ptr,  # int32 [M]
    ke_ptr,  # int32 [M]
    out_ptr,  # fp32 [M, S], S contiguous
    rows,
    keys,
    stride_q_row,
    stride_q_head,
    stride_k_row,
    stride_w_row,
    stride_out_row,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FILL: tl.constexpr,
    PRODUCT_SCALE: tl.constexpr,
    CLEAN: tl.constexpr,  # write -inf in the columns no block of this tile scores
    NAN_BYTES: tl.constexpr,  # the paged kernel's NaN-byte check (NAN_BY_HARDWARE: the dot sees NaN itself)
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    row = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = row < rows
    # Ranges are clipped to the buffer, so a bad ks / ke can never make the kernel read outside k.
    ks = tl.maximum(tl.load(ks_ptr + row, mask=row_ok, other=0), 0)
    ke = tl.minimum(tl.load(ke_ptr + row, mask=row_ok, other=0), keys)
    live = row_ok & (ke > ks)
    lo = tl.min(tl.where(live, ks, keys), axis=0)
    hi = tl.max(tl.where(live, ke, 0), axis=0)
    # Columns [col_lo, col_hi) are scored block by block; all others are only written.
    col_lo = tl.where(hi > lo, (lo // BLOCK_K) * BLOCK_K, 0)
    col_hi = tl.where(hi > lo, tl.minimum(tl.cdiv(hi, BLOCK_K) * BLOCK_K, keys), 0)

    # q rows are row-major (i * H + h); rows past M load zeros and carry zero weight.
    qh = tl.arange(0, BLOCK_Q * H)
    q_row = tile * BLOCK_Q + qh // H
    q_head = qh % H
    dim = tl.arange(0, D)
    q = tl.load(
        q_ptr + q_row[:, None].to(tl.int64) * stride_q_row + q_head[:, None] * stride_q_head + dim[None, :],
        mask=(q_row < rows)[:, None],
        other=0.0,
    )
    w = tl.load(w_ptr + q_row.to(tl.int64) * stride_w_row + q_head, mask=q_row < rows, other=0.0) * PRODUCT_SCALE
    if NAN_BYTES != NAN_BY_HARDWARE:
        w = tl.where(tl.max(_is_nan_byte(q, NAN_BYTES), axis=1) > 0, float("nan"), w)
    # Transposed once, outside the loop (inside it Triton re-stores the tile to shared memory each step).
    q_t = tl.trans(q)

    out_rows = out_ptr + row.to(tl.int64) * stride_out_row
    kk = tl.arange(0, BLOCK_K)
    for start in range(col_lo, col_hi, BLOCK_K):
        col = start + kk
        readable = (col >= lo) & (col < hi)
        k = tl.load(k_ptr + col[:, None].to(tl.int64) * stride_k_row + dim[None, :], mask=readable[:, None], other=0.0)
        scale = tl.load(s_ptr + col, mask=readable, other=0.0)
        scale = tl.fma(scale, 0.0, scale)  # the paged kernel's NaN rule: a non-finite scale becomes NaN
        scores = tl.dot(k, q_t)  # [BLOCK_K, BLOCK_Q * H], fp32 accumulation
        scores = tl.maximum(scores, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]
        logits = tl.sum(tl.reshape(scores, (BLOCK_K, BLOCK_Q, H)), axis=2) * scale[:, None]
        if NAN_BYTES != NAN_BY_HARDWARE:
            logits = tl.where(tl.max(_is_nan_byte(k, NAN_BYTES), axis=1)[:, None] > 0, float("nan"), logits)
        # A select, not a multiply: a key outside one row's range may belong to another request and
        # hold anything, NaN included.
        visible = (col[:, None] >= ks[None, :]) & (col[:, None] < ke[None, :])
        logits = tl.where(visible, logits, float("-inf"))
        tl.store(out_rows[None, :] + col[:, None], logits, mask=row_ok[None, :] & (col < keys)[:, None])

    if CLEAN:
        neg_inf = tl.full((BLOCK_Q, FILL), float("-inf"), tl.float32)
        ff = tl.arange(0, FILL)
        for start in range(0, col_lo, FILL):
            col = start + ff
            tl.store(out_rows[:, None] + col[None, :], neg_inf, mask=row_ok[:, None] & (col < col_lo)[None, :])
        for start in range(col_hi, keys, FILL):
            col = start + ff
            tl.store(out_rows[:, None] + col[None, :], neg_inf, mask=row_ok[:, None] & (col < keys)[None, :])


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """`rows`: query rows per program (x H heads is the dot's N); `keys`: keys per dot (its M);
    `fill`: columns per -inf store; then warps and pipeline depth."""

    rows: int = 4
    keys: int = 64
    fill: int = 1024
    num_warps: int = 4
    num_stages: int = 3


def default_config(device: torch.device) -> LaunchConfig:
    """docs/internal/triton-notes.md ("Ragged MQA logits") has the reasoning and the measurements behind
    the GPU choice."""
    if device.type != "cuda":
        # The interpreter pays per program and per step: few, large ones.
        return LaunchConfig(rows=8, keys=64, fill=256, num_warps=4, num_stages=1)
    return LaunchConfig(rows=4, keys=64, fill=1024, num_warps=4, num_stages=3)


def triton_ragged_mqa_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    scales: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    clean_logits: bool = True,
    fnuz_mode: Fp8Mode | None = None,
    config: LaunchConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 logits [M, S], -inf outside each row's [ks, ke). No host-device sync.

    With clean_logits=False (DeepGEMM's flag, same meaning) only the key blocks a row tile scores are
    written (-inf outside each row's range there); the other columns keep what `out` held: for a
    top-k that reads only [ks, ke), at M * S * 4 fewer bytes written.

    The fp8 dtype is q's (k must match). `fnuz_mode` overrides fnuz_mode_for_here() for e4m3fnuz
    inputs; `config` overrides default_config; `out` is a preallocated result (any row stride, unit
    column stride; every element is written).
    """
    rows, heads, head_dim, keys = _check(q, k, scales, weights, ks, ke)
    mode = fp8_mode(fp8_dtype_of(q.dtype, "q"), fnuz_mode)
    if out is None:
        # Rows 16-byte aligned and the last row's tail inside the storage (ROW_UNIT_FLOATS): the engines'
        # top-k kernels load 16 bytes at a time and would otherwise need a copy of the logits.
        out = torch.empty(rows, readable_width(keys), dtype=torch.float32, device=q.device)[:, :keys]
    elif out.dtype != torch.float32 or tuple(out.shape) != (rows, keys) or out.stride(1) != 1 or out.device != q.device:
        raise LayoutError(f"out must be fp32 [{rows}, {keys}] with unit column stride on {q.device}; got "
                          f"{out.dtype} {list(out.shape)}, strides {out.stride()} on {out.device}")
    if out.numel() == 0:
        return out
    cfg = config or default_config(q.device)
    if not (_pow2(cfg.rows) and _pow2(cfg.keys) and _pow2(cfg.fill) and cfg.keys >= 16):
        raise ValueError(f"{cfg}: rows, keys and fill must be powers of two, keys >= 16")
    block_q = min(cfg.rows, triton.next_power_of_2(rows))
    view = mode.torch_view_dtype
    _ragged_mqa_logits_kernel[(triton.cdiv(rows, block_q),)](
        q.view(view),
        k.view(view),
        scales,
        weights,
        ks,
        ke,
        out,
        rows,
        keys,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        weights.stride(0),
        out.stride(0),
        H=heads,
        D=head_dim,
        BLOCK_Q=block_q,
        BLOCK_K=cfg.keys,
        FILL=cfg.fill,
        PRODUCT_SCALE=mode.product_scale,
        CLEAN=bool(clean_logits),
        NAN_BYTES=nan_bytes_mode(mode),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _check(q, k, scales, weights, ks, ke) -> tuple[int, int, int, int]:
    """Shapes, strides, dtypes and devices, from metadata only (no tensor value is read)."""
    if q.dim() != 3:
        raise LayoutError(f"q must be [M, H, D]; got {list(q.shape)}")
    rows, heads, head_dim = q.shape
    fp8_dtype_of(q.dtype, "q")
    if k.dtype != q.dtype:
        raise DtypeMismatchError(f"k has dtype {k.dtype} but q has {q.dtype}; quantise both to one fp8 dtype")
    if q.stride(2) != 1:
        raise LayoutError(f"q must be contiguous along D; got strides {q.stride()}")
    if not (_pow2(heads) and _pow2(head_dim) and heads >= 16 and head_dim >= 32):
        raise LayoutError(f"q: H={heads} and D={head_dim} must be powers of two, H >= 16, D >= 32")
    if k.dim() != 2 or k.shape[1] != head_dim or k.stride(1) != 1:
        raise LayoutError(f"k must be [S, D={head_dim}] contiguous along D; got {list(k.shape)}, strides {k.stride()}")
    keys = k.shape[0]
    if keys * max(k.stride(0), 1) >= 2**31:
        raise LayoutError(f"k spans {keys} rows of stride {k.stride(0)}: past the kernel's 32-bit key indexing")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (keys,) or scales.stride(0) != 1:
        raise LayoutError(f"scales must be contiguous fp32 [S={keys}]; got {scales.dtype} {list(scales.shape)}, "
                          f"strides {scales.stride()}")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (rows, heads) or weights.stride(1) != 1:
        raise LayoutError(f"weights must be fp32 [M={rows}, H={heads}] contiguous along H; got {weights.dtype} "
                          f"{list(weights.shape)}, strides {weights.stride()}")
    for name, bound in (("ks", ks), ("ke", ke)):
        if bound.dtype != torch.int32 or tuple(bound.shape) != (rows,) or bound.stride(0) != 1:
            raise LayoutError(f"{name} must be contiguous int32 [M={rows}]; got {bound.dtype} {list(bound.shape)}, "
                              f"strides {bound.stride()}")
    devices = {t.device for t in (q, k, scales, weights, ks, ke)}
    if len(devices) != 1:
        raise LayoutError(f"q, k, scales, weights, ks and ke must be on one device; got {sorted(map(str, devices))}")
    return rows, heads, head_dim, keys


def _pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0
