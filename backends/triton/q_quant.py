"""Indexer Q quantisation as one fused Triton kernel: RoPE on the rotary part, amax over the head
vector, a power-of-two scale, fp8 store, and the scale folded into the head weights.

Bit-exact with backends/reference/q_quant.py: the scale is built from amax's bits (no log2, no
division), q is multiplied by the exact reciprocal power of two, and the fp8 rounding is
round-to-nearest-even on every path (the hardware cast on GPUs, software rounding under the
interpreter, whose own cast is wrong). One caveat: with a bf16 or fp16 q and cos_sin cache the RoPE
products are exact in fp32, so the FMA contraction the GPU compiler may apply cannot change a bit;
with an fp32 cache a contracted product can differ by one fp32 ulp, which (rarely) moves an fp8
value to the neighbouring code.

fp8 storage, chosen by the `STORE` constexpr:
- e4m3fn: tl.float8e4nv.
- fnuz native: tl.float8e4b8, the gfx94x (MI300) path. Triton 3.6 on NVIDIA refuses to compile it.
- fnuz emulated, for NVIDIA and the CPU: an fnuz byte is the e4m3fn byte of 2x for |x| <= 224
  (same bits, exponent bias 8 instead of 7), except that fnuz has no -0: e4m3fn's 0x80 becomes 0x00.
  NaN is not carried over (0x7F/0xFF are numbers in fnuz); the scale keeps finite inputs finite.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from backends.triton.dependent_launch import pdl_options, wait_previous_then_launch_next
from backends.triton.fp8_mode import Fp8Mode, fp8_mode
from dispatch.contract import (
    BAD_POSITION,
    FP8_MAX,
    Fp8Dtype,
    RopeSpec,
    check_positions,
    debug_bounds_on,
    scratch_error_flags,
    torch_dtype,
    triton_interpreter_on,
)

STORE_E4M3FN: tl.constexpr = tl.constexpr(0)
STORE_FNUZ_NATIVE: tl.constexpr = tl.constexpr(1)
STORE_FNUZ_EMULATED: tl.constexpr = tl.constexpr(2)
_STORE = {Fp8Mode.E4M3FN: 0, Fp8Mode.FNUZ_NATIVE: 1, Fp8Mode.FNUZ_EMULATED: 2}


@triton.jit
def _power_of_two_scale(amax, FP8_MAX_EXP: tl.constexpr, FP8_MAX_MANT: tl.constexpr):
    # The smallest 2^e with a <= FP8_MAX * 2^e, from the bits of a = max(amax, 1e-4) (a normal float):
    # e = exp(a) - exp(FP8_MAX), plus one when a's mantissa exceeds FP8_MAX's. tl.log2 is
    # approximate and fp32 division may be, so neither is used.
    bits = tl.maximum(amax, 1e-4).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - FP8_MAX_EXP + ((bits & 0x7FFFFF) > FP8_MAX_MANT).to(tl.int32)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv_scale = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return scale, inv_scale


@triton.jit
def _round_to_fp8_grid(y, QUANTUM_MIN_EXP: tl.constexpr):
    # Round fp32 y to the nearest (ties to even) value with 3 mantissa bits and a quantum no finer
    # than 2^QUANTUM_MIN_EXP (the subnormal step), by adding and subtracting 1.5 * 2^23 * quantum.
    # Needed only where the fp8 cast itself does not round correctly: the Triton interpreter (3.9)
    # rounds ties away from zero and drops the mantissa carry (1.97 -> 1.0), triton-lang/triton#8322.
    bits = y.to(tl.int32, bitcast=True)
    quantum_exp = tl.maximum(((bits >> 23) & 0xFF) - 127 - 3, QUANTUM_MIN_EXP)
    magic = (((quantum_exp + 23 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (tl.abs(y) + magic) - magic
    return tl.where(bits < 0, -rounded, rounded)


@triton.jit
def _to_fp8(y, poisoned, STORE: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr):
    # One return statement: the compiler types every return of a function, pruned branches included.
    # `poisoned` vectors get the format's NaN byte (e4m3fn 0x7F, fnuz 0x80) whatever y holds.
    if STORE == STORE_FNUZ_EMULATED:
        y = y * 2.0
    if ROUND_IN_SOFTWARE:
        if STORE == STORE_FNUZ_NATIVE:
            y = _round_to_fp8_grid(y, -10)  # fnuz subnormals step by 2^-10
        else:
            y = _round_to_fp8_grid(y, -9)  # e4m3fn subnormals step by 2^-9
    if STORE == STORE_FNUZ_NATIVE:
        bits = y.to(tl.float8e4b8).to(tl.uint8, bitcast=True)
        out = tl.where(poisoned, 0x80, bits).to(tl.uint8).to(tl.float8e4b8, bitcast=True)
    elif STORE == STORE_E4M3FN:
        bits = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        out = tl.where(poisoned, 0x7F, bits).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        # fnuz has no -0 (e4m3fn's 0x80 becomes 0x00), and 0x80 is its NaN.
        bits = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        out = tl.where(poisoned, 0x80, tl.where(bits == 0x80, 0, bits)).to(tl.uint8)
    return out


@triton.jit
def _round_to_bf16(y, IN_SOFTWARE: tl.constexpr):
    # fp32 -> nearest bf16 (ties to even) -> fp32, as the engines store their RoPE output. The
    # interpreter's own cast truncates, so there the rounding is done on the bits (NaN kept as is).
    if IN_SOFTWARE:
        bits = y.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        out = tl.where(y != y, y, rounded)
    else:
        out = y.to(tl.bfloat16).to(tl.float32)
    return out


@triton.jit
def _magnitude(x):
    # |x|, with NaN and +-inf as +inf (|x| <= FLT_MAX is false for exactly those): one max over a head
    # vector then gives both its amax and whether it holds a non-finite value, where tl.max alone
    # would drop a NaN on GPUs. One reduction instead of a max and a count.
    magnitude = tl.abs(x)
    return tl.where(magnitude <= 3.4028234663852886e38, magnitude, float("inf"))


@triton.jit
def _indexer_q_quant_kernel(
    q_ptr,  # bf16/fp16/fp32 [T, H, D], any strides
    weights_ptr,  # any float [T, H]
    positions_ptr,  # int32/int64 [T]
    cos_sin_ptr,  # float [max_pos, rot_dim]: cos in the first half, sin in the second
    q_out_ptr,  # fp8 (or uint8 for emulated fnuz) [T, H, D], contiguous
    weights_out_ptr,  # fp32 [T, H], contiguous
    error_flags_ptr,  # int32 [1]: BAD_POSITION is ORed in when a position is outside the cos/sin cache
    num_tokens,
    num_heads,
    max_pos,  # rows of the cos/sin cache: a position must lie in [0, max_pos)
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_w_token,
    stride_w_head,
    stride_pos,
    stride_cs_pos,
    stride_cs_dim,
    softmax_scale,
    head_scale,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rot_dim // 2: the rotary pairs per head
    ROT_START: tl.constexpr,  # first rotary dim (0: rotary at the head; D - rot_dim: at the tail)
    REST_START: tl.constexpr,  # first non-rotary dim
    INTERLEAVED: tl.constexpr,  # GPT-J pairs (2i, 2i+1); else NeoX halves (i, i + HALF)
    FP8_MAX_EXP: tl.constexpr,  # FP8_MAX's unbiased fp32 exponent
    FP8_MAX_MANT: tl.constexpr,  # FP8_MAX's 23 fp32 mantissa bits
    STORE: tl.constexpr,  # STORE_E4M3FN, STORE_FNUZ_NATIVE or STORE_FNUZ_EMULATED
    ROUND_IN_SOFTWARE: tl.constexpr,  # the interpreter: round to bf16 and fp8 on the bits
    BAD_POSITION: tl.constexpr,  # the error-flag bit
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # heads per program
    HALF_BLOCK: tl.constexpr,  # HALF rounded up to a power of two
    REST_BLOCK: tl.constexpr,  # D - rot_dim rounded up to a power of two (0: no rest)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (backends/triton/dependent_launch.py)
):
    wait_previous_then_launch_next(PDL)  # every program, before any read
    # One program quantises a [BLOCK_T, BLOCK_H] block of head vectors. Each vector is handled as
    # its rotary pairs (x1, x2) and the rest, so every load and store is contiguous and RoPE is the
    # reference's formula: no gather for the partner element.
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token_ok = tokens < num_tokens
    w_ok = token_ok[:, None] & (heads < num_heads)[None, :]
    vector_ok = w_ok[:, :, None]
    rows = q_ptr + tokens[:, None, None] * stride_q_token + heads[None, :, None] * stride_q_head
    vectors = tokens[:, None] * num_heads + heads[None, :]
    out_rows = q_out_ptr + vectors[:, :, None] * HEAD_DIM

    # A position outside the cos/sin cache is never followed: its token's vectors are poisoned below.
    positions = tl.load(positions_ptr + tokens * stride_pos, mask=token_ok, other=0).to(tl.int64)
    position_ok = (positions >= 0) & (positions < max_pos)
    bad_positions = tl.sum((token_ok & ~position_ok).to(tl.int32), axis=0)
    tl.atomic_or(error_flags_ptr, BAD_POSITION, mask=bad_positions > 0)
    halves = tl.arange(0, HALF_BLOCK)
    half_ok = halves < HALF
    cs_ptrs = cos_sin_ptr + positions[:, None] * stride_cs_pos + halves[None, :] * stride_cs_dim
    cs_ok = (token_ok & position_ok)[:, None] & half_ok[None, :]
    cos = tl.load(cs_ptrs, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
    sin = tl.load(cs_ptrs + HALF * stride_cs_dim, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]

    if INTERLEAVED:
        pair_dims = tl.arange(0, 2 * HALF_BLOCK)
        pair_ok = vector_ok & (pair_dims < 2 * HALF)[None, None, :]
        pairs = tl.load(rows + (ROT_START + pair_dims)[None, None, :] * stride_q_dim, mask=pair_ok, other=0.0)
        x1, x2 = tl.split(tl.reshape(pairs.to(tl.float32), (BLOCK_T, BLOCK_H, HALF_BLOCK, 2)))
    else:
        rot_ok = vector_ok & half_ok[None, None, :]
        x1 = tl.load(rows + (ROT_START + halves)[None, None, :] * stride_q_dim, mask=rot_ok, other=0.0)
        x2 = tl.load(rows + (ROT_START + HALF + halves)[None, None, :] * stride_q_dim, mask=rot_ok, other=0.0)
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
    # The engines (vLLM V3.2 and V4, SGLang) round the RoPE output to bf16 before the amax and the
    # division; doing the same keeps every fp8 byte and scale equal to theirs.
    out1 = _round_to_bf16(x1 * cos - x2 * sin, ROUND_IN_SOFTWARE)
    out2 = _round_to_bf16(x2 * cos + x1 * sin, ROUND_IN_SOFTWARE)
    amax = tl.maximum(tl.max(_magnitude(out1), axis=2), tl.max(_magnitude(out2), axis=2))
    if REST_BLOCK > 0:
        rest_dims = tl.arange(0, REST_BLOCK)
        rest_ok = vector_ok & (rest_dims < HEAD_DIM - 2 * HALF)[None, None, :]
        rest = tl.load(rows + (REST_START + rest_dims)[None, None, :] * stride_q_dim, mask=rest_ok, other=0.0)
        rest = rest.to(tl.float32)
        amax = tl.maximum(amax, tl.max(_magnitude(rest), axis=2))
    # A vector with NaN or inf (amax +inf) cannot be quantised; nor can one whose position is bad.
    poisoned = (amax > 3.4028234663852886e38) | ~position_ok[:, None]  # [BLOCK_T, BLOCK_H]

    scale, inv_scale = _power_of_two_scale(amax, FP8_MAX_EXP, FP8_MAX_MANT)
    scale = tl.where(poisoned, float("nan"), scale)
    inv_scale = inv_scale[:, :, None]
    poisoned = poisoned[:, :, None]
    # |x| * inv_scale <= FP8_MAX by the choice of scale, so no clamp is needed before the casts.
    if INTERLEAVED:
        rotated = tl.reshape(tl.join(out1, out2), (BLOCK_T, BLOCK_H, 2 * HALF_BLOCK))
        tl.store(out_rows + ROT_START + pair_dims[None, None, :],
                 _to_fp8(rotated * inv_scale, poisoned, STORE, ROUND_IN_SOFTWARE), mask=pair_ok)
    else:
        tl.store(out_rows + ROT_START + halves[None, None, :],
                 _to_fp8(out1 * inv_scale, poisoned, STORE, ROUND_IN_SOFTWARE), mask=rot_ok)
        tl.store(out_rows + ROT_START + HALF + halves[None, None, :],
                 _to_fp8(out2 * inv_scale, poisoned, STORE, ROUND_IN_SOFTWARE), mask=rot_ok)
    if REST_BLOCK > 0:
        tl.store(out_rows + REST_START + rest_dims[None, None, :],
                 _to_fp8(rest * inv_scale, poisoned, STORE, ROUND_IN_SOFTWARE), mask=rest_ok)

    # Folded in the engines' order, one fp32 product at a time: w * scale * softmax_scale * head_scale.
    w = tl.load(weights_ptr + tokens[:, None] * stride_w_token + heads[None, :] * stride_w_head, mask=w_ok)
    tl.store(weights_out_ptr + vectors, w.to(tl.float32) * scale * softmax_scale * head_scale, mask=w_ok)


def triton_indexer_q_quant(
    q: torch.Tensor,
    weights: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    fp8_dtype: Fp8Dtype,
    rope: RopeSpec,
    softmax_scale: float,
    head_scale: float,
    error_flags: torch.Tensor | None = None,
    fnuz_mode: Fp8Mode | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], weights [T, H] -> (q fp8 [T, H, D], fp32 weights [T, H]), as the torch reference.

    A head vector with NaN or inf (after RoPE), or whose token's position is outside the cos/sin cache,
    gets NaN fp8 bytes and a NaN folded weight; a bad position also sets BAD_POSITION in `error_flags`
    (int32 [1], the plan's; a per-device scratch word when None). `fnuz_mode` (fnuz_native / fnuz_emulated)
    overrides the machine's choice for e4m3fnuz: native on ROCm gfx94x only."""
    block_t, block_h, num_warps = launch_config(*q.shape[:2]) if q.dim() == 3 else (1, 1, 1)
    return launch(
        q, weights, positions, cos_sin_cache,
        fp8_dtype=fp8_dtype, rope=rope, softmax_scale=softmax_scale, head_scale=head_scale,
        error_flags=error_flags, mode=fp8_mode(fp8_dtype, fnuz_mode), round_in_software=triton_interpreter_on(),
        block_t=block_t, block_h=block_h, num_warps=num_warps,
    )


def launch_config(num_tokens: int, num_heads: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, num_warps). The interpreter pays per operation, not per element, so there
    a program takes as many head vectors as is reasonable."""
    if triton_interpreter_on():
        block_h = triton.next_power_of_2(max(num_heads, 1))
        return min(triton.next_power_of_2(max(num_tokens, 1)), max(1, 4096 // block_h)), block_h, 1
    # Swept on the H200 (tune_q_quant.py, 2026-11-29): (1, 32, 4) was fastest for both rope styles.
    return 1, 32, 4


def launch(q, weights, positions, cos_sin_cache, *, fp8_dtype, rope, softmax_scale, head_scale, error_flags, mode,
           round_in_software, block_t, block_h, num_warps):
    """Check the inputs, then run the kernel with an explicit fp8 mode and launch config (the tuner
    calls this directly)."""
    _check(q, weights, positions, cos_sin_cache, error_flags)
    if error_flags is None:
        error_flags = scratch_error_flags(q.device)
    fp8_dtype = Fp8Dtype(fp8_dtype)
    tokens, heads, head_dim = q.shape
    rot_dim = cos_sin_cache.shape[-1]
    emulated = mode is Fp8Mode.FNUZ_EMULATED
    q_out = torch.empty((tokens, heads, head_dim), dtype=torch.uint8 if emulated else torch_dtype(fp8_dtype),
                        device=q.device)
    w_out = torch.empty((tokens, heads), dtype=torch.float32, device=q.device)
    if tokens and heads:
        max_exp, max_mant = _FP8_MAX_BITS[fp8_dtype]
        grid = (triton.cdiv(tokens, block_t), triton.cdiv(heads, block_h))
        _indexer_q_quant_kernel[grid](
            q_ptr=q,
            weights_ptr=weights,
            positions_ptr=positions,
            cos_sin_ptr=cos_sin_cache,
            q_out_ptr=q_out,
            weights_out_ptr=w_out,
            error_flags_ptr=error_flags,
            num_tokens=tokens,
            num_heads=heads,
            max_pos=cos_sin_cache.shape[0],
            stride_q_token=q.stride(0),
            stride_q_head=q.stride(1),
            stride_q_dim=q.stride(2),
            stride_w_token=weights.stride(0),
            stride_w_head=weights.stride(1),
            stride_pos=positions.stride(0),
            stride_cs_pos=cos_sin_cache.stride(0),
            stride_cs_dim=cos_sin_cache.stride(1),
            softmax_scale=softmax_scale,
            head_scale=head_scale,
            HEAD_DIM=head_dim,
            HALF=rot_dim // 2,
            ROT_START=0 if rope.at_head else head_dim - rot_dim,
            REST_START=rot_dim if rope.at_head else 0,
            INTERLEAVED=rope.interleaved,
            FP8_MAX_EXP=max_exp,
            FP8_MAX_MANT=max_mant,
            STORE=_STORE[mode],
            ROUND_IN_SOFTWARE=round_in_software,
            BAD_POSITION=BAD_POSITION,
            BLOCK_T=block_t,
            BLOCK_H=block_h,
            HALF_BLOCK=triton.next_power_of_2(rot_dim // 2),
            REST_BLOCK=triton.next_power_of_2(head_dim - rot_dim) if head_dim > rot_dim else 0,
            num_warps=num_warps,
            **pdl_options(q.device),
        )
    return (q_out.view(torch.float8_e4m3fnuz) if emulated else q_out), w_out


def _exponent_and_mantissa(value: float) -> tuple[int, int]:
    """The unbiased exponent and the 23 mantissa bits of `value` as an fp32 (a normal number)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((bits >> 23) & 0xFF) - 127, bits & 0x7FFFFF


# Computed once: the launch path is on every layer's host time.
_FP8_MAX_BITS = {dtype: _exponent_and_mantissa(value) for dtype, value in FP8_MAX.items()}


def _check(q, weights, positions, cos_sin_cache, error_flags) -> None:
    # The op's checks ran before this run (dispatch/contract/ops/q_quant.py); a debug run also reads
    # every position on the host, to raise where the kernel would only flag.
    if debug_bounds_on():
        check_positions(positions, cos_sin_cache.shape[0])
