"""Paged MQA logits in Triton: the function of backends/reference/paged_mqa_logits.py, same arguments.

    logits[r*N + j, k] = sum_h w[r*N + j, h] * relu(q[r, j, h] . K[k]) * s[k]   for k < ctx[r, j]
                       = -inf                                                    otherwise

Grid: persistent, a few programs per SM. The batch's length-balanced schedule
(backends/triton/paged_schedule.py, built once per batch) gives each program one contiguous range of
(work row, page) positions of equal cost, where a work row is up to TG tokens of one row; for each
work row its range touches, the program writes every logit column of those pages, -inf included, so
no reduction across programs is needed. Per step it loads PAGES pages of keys [T, D] and computes keys @ q^T -> [T, TG*H]
in one fp8 dot: tokens x heads is the dot's N, so the relu-weighted sum over heads stays inside a
thread and its quad rather than crossing warps (DeepGEMM's SM90 kernel has the same orientation).
q^T and the weights are loaded once per work row a program touches. Pages past every token's length are never read.

Bounds (dispatch/contract/bounds.py): the kernel reads the per-batch page guard's output
(backends/shared/page_guard.py), not the engine's table and lengths: a table whose every entry lies in
the cache, and lengths where a poisoned token (a needed page out of range, or a length past
max_context_len) has -1. The page loop's stores skip a poisoned token and a
last loop, empty unless a token of the program is poisoned, writes NaN across its row: the page loop
is the same code as without bounds checks. The guard runs once per batch, not per layer, and has set
the plan's error flag.

NaN: the relu keeps NaN (max.NaN: one FMNMX.NAN, as the plain max is one FMNMX), so a NaN q, key or
weight makes the logit NaN rather than vanishing in relu; a non-finite key scale becomes NaN through
fma(s, 0, s) (inf * 0 is NaN; one FFMA per scale); where the dot cannot see an fp8 NaN byte (fnuz
emulation, the interpreter) the kernel finds it itself (NAN_BY_HARDWARE below).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from backends.triton.dependent_launch import pdl_options, wait_previous_then_launch_next
from backends.triton.fp8_mode import Fp8Mode, fp8_mode
from backends.shared.page_guard import PageGuard, guard_pages
from backends.triton.paged_schedule import PagedSchedule, program_count, schedule_pages
from dispatch.contract import (
    Fp8Dtype,
    LayoutError,
    check_pages,
    debug_bounds_on,
    readable_width,
    scratch_error_flags,
    torch_dtype,
    triton_interpreter_on,
)


# Where the dot reads an fp8 NaN byte as a number, the kernel finds NaN bytes itself (q once per program,
# keys once per step): fnuz emulated through e4m3fn anywhere (fnuz NaN 0x80 reads as -0), and the
# interpreter, whose fp8 decoding has no NaN (e4m3fn 0x7F reads as 480, fnuz 0x80 as -0). GPUs decode
# e4m3fn NaN (and gfx94x fnuz NaN) in the dot itself, so their hot path pays nothing.
NAN_BY_HARDWARE: tl.constexpr = tl.constexpr(0)
NAN_E4M3FN_BYTES: tl.constexpr = tl.constexpr(1)
NAN_FNUZ_BYTE: tl.constexpr = tl.constexpr(2)


@triton.jit
def _is_nan_byte(x, NAN_BYTES: tl.constexpr):
    bits = x.to(tl.uint8, bitcast=True)
    if NAN_BYTES == NAN_E4M3FN_BYTES:
        nan = (bits & 0x7F) == 0x7F
    else:
        nan = bits == 0x80
    return nan.to(tl.int32)


def nan_bytes_mode(mode: Fp8Mode) -> int:
    """Which NaN-byte check the kernel needs for `mode` here (see NAN_BY_HARDWARE)."""
    if mode is Fp8Mode.FNUZ_EMULATED:
        return 2
    if not triton_interpreter_on():
        return 0
    return 1 if mode is Fp8Mode.E4M3FN else 2


@triton.jit
def _q_tile(q_ptr, w_ptr, row, first_tok, stride_q_row, stride_q_tok, stride_q_head, stride_w_row,
            N: tl.constexpr, TG: tl.constexpr, H: tl.constexpr, D: tl.constexpr, PRODUCT_SCALE: tl.constexpr,
            NAN_BYTES: tl.constexpr):
    # q^T [D, TG * H] and the weights [TG * H] of tokens [first_tok, first_tok + TG) of a row. q rows are
    # token-major (i * H + h); padded tokens load zeros and carry zero weight. Transposed here, outside
    # the page loop: Triton then stores q^T to shared memory once per segment; a tl.trans inside the
    # loop re-stores the whole tile every step.
    qk_row = tl.arange(0, TG * H)
    q_tok = first_tok + qk_row // H
    q_head = qk_row % H
    dim = tl.arange(0, D)
    q = tl.load(
        q_ptr + row * stride_q_row + q_tok[:, None] * stride_q_tok + q_head[:, None] * stride_q_head + dim[None, :],
        mask=(q_tok < N)[:, None],
        other=0.0,
    )
    w = tl.load(w_ptr + (row * N + q_tok) * stride_w_row + q_head, mask=q_tok < N, other=0.0) * PRODUCT_SCALE
    if NAN_BYTES != NAN_BY_HARDWARE:
        w = tl.where(tl.max(_is_nan_byte(q, NAN_BYTES), axis=1) > 0, float("nan"), w)
    return tl.trans(q), w


HIST_BINS = 2048  # bins of the first radix digit (11 bits)
_HIST_BINS: tl.constexpr = tl.constexpr(HIST_BINS)


@triton.jit
def _first_digit(x):
    # The top 11 bits of the order-preserving unsigned key of fp32 x (sign flipped for x >= 0, all bits
    # for x < 0): the first digit of an 11/11/10-bit radix select, as cuda.radix's first histogram has it.
    bits = x.to(tl.int32, bitcast=True)
    signed_key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (signed_key >> 21) + 1024


@triton.jit
def _score_and_store(keys, scale, q_t, w, col, col_end, ctx, live, out_rows, hist_rows,
                     T: tl.constexpr, TG: tl.constexpr, H: tl.constexpr, NAN_BYTES: tl.constexpr,
                     HIST: tl.constexpr):
    # Keys are the dot's M and tokens x heads its N: the head sum stays inside a thread and its quad
    # instead of crossing warps.
    scores = tl.dot(keys, q_t)  # [T, TG * H], fp32 accumulation
    scores = tl.maximum(scores, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]
    logits = tl.sum(tl.reshape(scores, (T, TG, H)), axis=2) * scale[:, None]
    if NAN_BYTES != NAN_BY_HARDWARE:
        logits = tl.where(tl.max(_is_nan_byte(keys, NAN_BYTES), axis=1)[:, None] > 0, float("nan"), logits)
    # A select, not a multiply: bytes past a length are garbage and may decode to NaN.
    logits = tl.where(col[:, None] < ctx[None, :], logits, float("-inf"))
    stored = live[None, :] & (col < col_end)[:, None]
    tl.store(out_rows[None, :] + col[:, None], logits, mask=stored)
    if HIST:
        # The first radix digit of every visible, non-NaN logit, counted per token row (issue 23 item 4:
        # what a histogram written here, instead of a top-k's own first pass, costs the logits).
        visible = stored & (col[:, None] < ctx[None, :]) & (logits == logits)
        tl.atomic_add(hist_rows[None, :] + _first_digit(logits), 1, mask=visible, sem="relaxed")


@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr,  # fp8 [R, N, H, D], D contiguous
    k_ptr,  # the cache's bytes as fp8, [num_blocks, BLOCK_KV * (D + 4)]
    s_ptr,  # the cache's scale words as fp32, starting at block 0's first scale
    w_ptr,  # fp32 [R * N, H]
    ctx_ptr,  # int32 [R, N]: the guard's lens (-1 for a poisoned token)
    table_ptr,  # int32 [R, M]: the guard's safe table (every entry inside the cache)
    bounds_ptr,  # int32 [P + 1, 2]: the schedule's (work row, page) cuts, one range per program
    out_ptr,  # fp32 [R * N, max_context_len]
    hist_ptr,  # int32 [R * N, HIST_BINS] with HIST (zeroed by the caller), else unused
    stride_q_row,
    stride_q_tok,
    stride_q_head,
    stride_w_row,
    stride_ctx_row,
    stride_table_row,
    stride_out_row,
    max_context_len,
    N: tl.constexpr,
    TG: tl.constexpr,  # tokens per work row: a power of two; N > TG makes ceil(N / TG) work rows a row
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    PAGES: tl.constexpr,
    PRODUCT_SCALE: tl.constexpr,
    NAN_BYTES: tl.constexpr,  # which fp8 bytes are NaN where the dot does not see it (see _nan_bytes)
    FILL: tl.constexpr,  # write -inf in the columns past the row's pages (clean_logits)
    HIST: tl.constexpr = False,  # also count each logit row's first radix digits into hist_ptr
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (backends/triton/dependent_launch.py)
):
    wait_previous_then_launch_next(PDL)  # every program, before any read: the Q quant's output and the guard's table
    GROUPS: tl.constexpr = (N + TG - 1) // TG
    num_pages = tl.cdiv(max_context_len, BLOCK_KV)
    program = tl.program_id(0)
    work_row = tl.load(bounds_ptr + program * 2)
    first_page = tl.load(bounds_ptr + program * 2 + 1)
    last_work_row = tl.load(bounds_ptr + program * 2 + 2)
    end_page = tl.load(bounds_ptr + program * 2 + 3)
    # One segment per work row the program's range touches: pages [first_page, segment_end) of it.
    while (work_row < last_work_row) | ((work_row == last_work_row) & (first_page < end_page)):
        segment_end = tl.where(work_row == last_work_row, end_page, num_pages)
        _work_row_segment(q_ptr, k_ptr, s_ptr, w_ptr, ctx_ptr, table_ptr, out_ptr, hist_ptr, stride_q_row, stride_q_tok,
                          stride_q_head, stride_w_row, stride_ctx_row, stride_table_row, stride_out_row,
                          max_context_len, num_pages, work_row // GROUPS, work_row % GROUPS, first_page,
                          segment_end, N, TG, H, D, BLOCK_KV, PAGES, PRODUCT_SCALE, NAN_BYTES, FILL, HIST)
        work_row += 1
        first_page = 0


@triton.jit
def _work_row_segment(q_ptr, k_ptr, s_ptr, w_ptr, ctx_ptr, table_ptr, out_ptr, hist_ptr, stride_q_row, stride_q_tok,
                      stride_q_head, stride_w_row, stride_ctx_row, stride_table_row, stride_out_row,
                      max_context_len, num_pages, row, group, page_begin, page_end,
                      N: tl.constexpr, TG: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_KV: tl.constexpr,
                      PAGES: tl.constexpr, PRODUCT_SCALE: tl.constexpr, NAN_BYTES: tl.constexpr,
                      FILL: tl.constexpr, HIST: tl.constexpr):
    # Up to TG tokens of one row, pages [page_begin, page_end): every logit column of that range is
    # written, -inf included (without FILL, the pages past the group's longest length are not), so no
    # reduction across programs is needed.
    T: tl.constexpr = PAGES * BLOCK_KV
    BLOCK_BYTES: tl.constexpr = BLOCK_KV * (D + 4)
    BLOCK_WORDS: tl.constexpr = BLOCK_BYTES // 4

    tok = group * TG + tl.arange(0, TG)
    tok_ok = tok < N
    ctx = tl.load(ctx_ptr + row * stride_ctx_row + tok, mask=tok_ok, other=0)
    # Pages past the group's longest length are skipped (a poisoned token's -1 reads none); the clip to
    # the output's width keeps every table read inside the guard's [R, ceil(width / BLOCK_KV)] table.
    valid_pages = tl.minimum(tl.cdiv(tl.max(ctx, axis=0), BLOCK_KV), num_pages)
    col_end = tl.minimum(page_end * BLOCK_KV, max_context_len)
    compute_end = tl.minimum(page_end, valid_pages)

    # A token the guard poisoned has length -1: the page loop and the -inf fill leave it alone (their
    # stores are masked by `live`), and the NaN loop at the end, empty unless a token is poisoned, writes
    # its row. So the page loop is the same code as without bounds checks.
    live = tok_ok & (ctx >= 0)  # [TG]
    poisoned = tok_ok & (ctx < 0)
    out_rows = out_ptr + (row * N + tok).to(tl.int64) * stride_out_row
    hist_rows = hist_ptr + (row * N + tok).to(tl.int64) * _HIST_BINS
    t = tl.arange(0, T)

    if page_begin < compute_end:
        dim = tl.arange(0, D)
        page_of_t = t // BLOCK_KV
        slot_of_t = t % BLOCK_KV
        q_t, w = _q_tile(q_ptr, w_ptr, row, group * TG, stride_q_row, stride_q_tok, stride_q_head, stride_w_row,
                         N, TG, H, D, PRODUCT_SCALE, NAN_BYTES)
        for page in range(page_begin, compute_end, PAGES):
            pages_here = page + page_of_t
            block = tl.load(table_ptr + row * stride_table_row + pages_here, mask=pages_here < valid_pages, other=0)
            block = block.to(tl.int64)
            keys = tl.load(k_ptr + (block * BLOCK_BYTES + slot_of_t * D)[:, None] + dim[None, :])
            scale = tl.load(s_ptr + block * BLOCK_WORDS + slot_of_t)
            scale = tl.fma(scale, 0.0, scale)  # a finite scale unchanged; inf * 0 makes inf (and NaN) NaN
            col = page * BLOCK_KV + t
            _score_and_store(keys, scale, q_t, w, col, col_end, ctx, live, out_rows, hist_rows, T, TG, H,
                             NAN_BYTES, HIST)
    # The columns no compute step wrote (the last step may run past compute_end; its select wrote
    # -inf there) get -inf without reading anything.
    if FILL:
        fill_begin = tl.maximum(page_begin, page_begin + tl.cdiv(compute_end - page_begin, PAGES) * PAGES)
        neg_inf = tl.full((TG, T), float("-inf"), tl.float32)
        for page in range(fill_begin, page_end, PAGES):
            col = page * BLOCK_KV + t
            tl.store(out_rows[:, None] + col[None, :], neg_inf, mask=live[:, None] & (col < col_end)[None, :])
    # Poisoned tokens: NaN in every column of the segment. No iteration when none is poisoned.
    nan_end = tl.where(tl.max(poisoned.to(tl.int32), axis=0) > 0, page_end, page_begin)
    nan = tl.full((TG, T), float("nan"), tl.float32)
    for page in range(page_begin, nan_end, PAGES):
        col = page * BLOCK_KV + t
        tl.store(out_rows[:, None] + col[None, :], nan, mask=poisoned[:, None] & (col < col_end)[None, :])


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Tuning knobs. `tokens`: most tokens of one row per work row (more take several); `pages`: 64-key
    pages per dot; `programs_per_sm`: the persistent grid (on the interpreter, the program count);
    then warps and pipeline depth."""

    tokens: int = 4
    pages: int = 1
    programs_per_sm: int = 2
    num_warps: int = 4
    num_stages: int = 2


def default_config(next_n: int, device: torch.device) -> LaunchConfig:
    """Per next_n; docs/internal/triton-notes.md has the measurements behind each choice."""
    if device.type != "cuda":
        # The interpreter pays per program and per step: few, large ones.
        return LaunchConfig(tokens=8, pages=2, programs_per_sm=4, num_warps=4, num_stages=1)
    if next_n == 1:
        # Memory-bound: 64-key steps, 4 warps (79 registers), a deep pipeline and 6 programs an SM for
        # bytes in flight.
        return LaunchConfig(tokens=1, pages=1, programs_per_sm=6, num_warps=4, num_stages=6)
    if next_n == 2:
        # 2 tokens x 64 heads as the dot's N: 154 registers, so three programs an SM, each 6 stages deep.
        return LaunchConfig(tokens=2, pages=1, programs_per_sm=3, num_warps=4, num_stages=6)
    # One warpgroup per 64-key page, up to 4 tokens x 64 heads as the dot's N (255 registers, two
    # programs per SM). The table lookup takes pipeline stages: 5 stages leave 3 page buffers.
    return LaunchConfig(tokens=4, pages=1, programs_per_sm=2, num_warps=4, num_stages=5)


def triton_paged_mqa_logits(
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
    out: torch.Tensor | None = None,
    error_flags: torch.Tensor | None = None,
    guard: PageGuard | None = None,
    schedule: PagedSchedule | None = None,
    clean_logits: bool = True,
    histogram: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 logits [rows * N, max_context_len], -inf past each token's length (with clean_logits; without
    it the pages past a token group's longest length are left unwritten). No host-device sync.

    A token whose length passes max_context_len, or that needs a page-table entry outside
    [0, num_blocks), gets an all-NaN row, and BAD_PAGE / LENGTH_PAST_BOUND is ORed into `error_flags`
    (int32 [1], the plan's; a per-device scratch word when None). `guard` is this batch's page guard
    (backends/shared/page_guard.py), launched once per batch by the plan; without one this call
    launches a guard first (one small extra launch). `schedule` is this batch's length-balanced
    schedule (backends/triton/paged_schedule.py), built by the plan for `config`; without one this call
    builds it first (one more small launch). `fnuz_mode` overrides fnuz_mode_for_here() for
    an e4m3fnuz cache; `config` overrides default_config; `out` is a preallocated result (with clean_logits
    every element is written, so it needs no initialisation).

    `histogram` (int32 [rows * N, HIST_BINS], zeroed by the caller) also gets, per logit row, the count
    of its visible non-NaN logits by first radix digit (_first_digit): the measurement of issue 23's
    item 4, what a top-k's first pass would cost inside this kernel (tools/probe_logits_histogram.py).
    """
    mode = fp8_mode(fp8_dtype, fnuz_mode)
    rows, next_n, heads, head_dim = _check(q, kv_cache, weights, context_lens, block_table, max_context_len, fp8_dtype)
    num_blocks, block_kv = kv_cache.shape[0], kv_cache.shape[1]
    shape = (rows * next_n, max_context_len)
    if out is None:
        # Rows start 16-byte aligned (the width padded to ROW_UNIT_FLOATS, a view of the first W): the
        # engines' top-k kernels load 16 bytes at a time and would otherwise need a copy of the logits.
        out = torch.empty(shape[0], readable_width(shape[1]), dtype=torch.float32, device=q.device)[:, : shape[1]]
    elif out.dtype != torch.float32 or tuple(out.shape) != shape or out.stride(1) != 1 or out.device != q.device:
        raise LayoutError(f"out must be fp32 {list(shape)} contiguous along columns on {q.device}; got "
                          f"{out.dtype} {list(out.shape)}, strides {out.stride()} on {out.device}")
    if error_flags is None:
        error_flags = scratch_error_flags(q.device)
    elif error_flags.dtype != torch.int32 or error_flags.numel() < 1 or error_flags.device != q.device:
        raise LayoutError(f"error_flags must be int32 with one element on {q.device}; got {error_flags.dtype} "
                          f"{list(error_flags.shape)} on {error_flags.device}")
    if debug_bounds_on():
        check_pages(context_lens, block_table, num_blocks, max_context_len, block_kv)
    if guard is None:
        guard = guard_pages(context_lens, block_table, num_blocks, max_context_len, block_kv, error_flags)
    else:
        _check_guard(guard, context_lens, max_context_len, kv_cache)
    if histogram is not None and (histogram.dtype != torch.int32 or tuple(histogram.shape) != (shape[0], HIST_BINS)
                                  or not histogram.is_contiguous() or histogram.device != q.device):
        raise LayoutError(f"histogram must be contiguous int32 [{shape[0]}, {HIST_BINS}] on {q.device}; got "
                          f"{histogram.dtype} {list(histogram.shape)}, strides {histogram.stride()} on {histogram.device}")
    if out.numel() == 0:
        return out
    cfg = config or default_config(next_n, q.device)
    tokens = work_row_tokens(cfg, next_n)
    if schedule is None:
        schedule = schedule_for(context_lens, max_context_len, block_kv, cfg)
    elif not schedule.matches(context_lens, tokens, max_context_len, block_kv):
        raise LayoutError(
            f"the paged schedule was built for lens {list(schedule.context_lens.shape)}, {schedule.tokens} tokens a "
            f"work row, width {schedule.width}; this call has lens {list(context_lens.shape)}, {tokens} tokens, "
            f"width {max_context_len}"
        )
    flat = kv_cache.view(num_blocks, -1)
    keys = flat.view(mode.torch_view_dtype)
    scales = flat[:, block_kv * head_dim :].view(torch.float32)
    _paged_mqa_logits_kernel[(schedule.programs,)](
        q.view(mode.torch_view_dtype),
        keys,
        scales,
        weights,
        guard.lens,
        guard.safe_table,
        schedule.bounds,
        out,
        out if histogram is None else histogram,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        weights.stride(0),
        guard.lens.stride(0),
        guard.safe_table.stride(0),
        out.stride(0),
        max_context_len,
        N=next_n,
        TG=tokens,
        H=heads,
        D=head_dim,
        BLOCK_KV=block_kv,
        PAGES=cfg.pages,
        PRODUCT_SCALE=mode.product_scale,
        NAN_BYTES=nan_bytes_mode(mode),
        FILL=clean_logits,
        HIST=histogram is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_options(q.device),
    )
    return out


def schedule_for(context_lens: torch.Tensor, max_context_len: int, block_kv: int,
                 config: LaunchConfig | None = None) -> PagedSchedule:
    """The batch's length-balanced schedule for `config` (default_config when None), cut now: what the
    backends' prepare keeps per batch and a direct call without one builds for itself."""
    next_n = context_lens.shape[1]
    config = config or default_config(next_n, context_lens.device)
    programs = program_count(context_lens.device, config.programs_per_sm)
    return schedule_pages(context_lens, work_row_tokens(config, next_n), programs, max_context_len, block_kv)


def work_row_tokens(config: LaunchConfig, next_n: int) -> int:
    """Tokens of one row per work row: the config's, at most next_n rounded up to a power of two."""
    if not _pow2(config.tokens) or not _pow2(config.pages) or config.programs_per_sm < 1:
        raise ValueError(f"{config}: tokens and pages must be powers of two, programs_per_sm >= 1")
    return min(triton.next_power_of_2(next_n), config.tokens)


def _check_guard(guard: PageGuard, context_lens: torch.Tensor, max_context_len: int, kv_cache: torch.Tensor) -> None:
    """The guard must be this batch's (its shapes) and cover this cache (host-side: shapes only)."""
    pages = triton.cdiv(max_context_len, kv_cache.shape[1])
    if (tuple(guard.lens.shape) != tuple(context_lens.shape) or tuple(guard.safe_table.shape) != (context_lens.shape[0], pages)
            or guard.max_context_len != max_context_len or guard.lens.device != context_lens.device):
        raise LayoutError(
            f"the page guard was built for lens {list(guard.lens.shape)}, table {list(guard.safe_table.shape)}, "
            f"max_context_len={guard.max_context_len}; this call has lens {list(context_lens.shape)}, "
            f"max_context_len={max_context_len} ({pages} pages)"
        )
    guard.for_cache(kv_cache)


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
