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

from backends.triton.fp8_mode import Fp8Mode, fp8_mode
from dispatch.detect import triton_interpreter_on
from dispatch.errors import LayoutError
from dispatch.fp8 import torch_dtype
from dispatch.key import FP8_MAX, Fp8Dtype
from dispatch.rope import RopeSpec

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
def _to_fp8(y, STORE: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr):
    # One return statement: the compiler types every return of a function, pruned branches included.
    if STORE == STORE_FNUZ_EMULATED:
        y = y * 2.0
    if ROUND_IN_SOFTWARE:
        if STORE == STORE_FNUZ_NATIVE:
            y = _round_to_fp8_grid(y, -10)  # fnuz subnormals step by 2^-10
        else:
            y = _round_to_fp8_grid(y, -9)  # e4m3fn subnormals step by 2^-9
    if STORE == STORE_FNUZ_NATIVE:
        out = y.to(tl.float8e4b8)
    elif STORE == STORE_E4M3FN:
        out = y.to(tl.float8e4nv)
    else:
        out = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        out = tl.where(out == 0x80, tl.zeros_like(out), out)
    return out


@triton.jit
def _indexer_q_quant_kernel(
    q_ptr, w_ptr, pos_ptr, cs_ptr, q_out_ptr, w_out_ptr,
    num_tokens, num_heads,
    stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_pos, stride_cst, stride_csd,
    weight_factor,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, ROT_START: tl.constexpr, REST_START: tl.constexpr,
    INTERLEAVED: tl.constexpr, FP8_MAX_EXP: tl.constexpr, FP8_MAX_MANT: tl.constexpr,
    STORE: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HALF_BLOCK: tl.constexpr, REST_BLOCK: tl.constexpr,
):
    # One program quantises a [BLOCK_T, BLOCK_H] block of head vectors. Each vector is handled as
    # its rotary pairs (x1, x2) and the rest, so every load and store is contiguous and RoPE is the
    # reference's formula: no gather for the partner element.
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token_ok = tokens < num_tokens
    w_ok = token_ok[:, None] & (heads < num_heads)[None, :]
    vector_ok = w_ok[:, :, None]
    rows = q_ptr + tokens[:, None, None] * stride_qt + heads[None, :, None] * stride_qh
    vectors = tokens[:, None] * num_heads + heads[None, :]
    out_rows = q_out_ptr + vectors[:, :, None] * HEAD_DIM

    halves = tl.arange(0, HALF_BLOCK)
    half_ok = halves < HALF
    positions = tl.load(pos_ptr + tokens * stride_pos, mask=token_ok, other=0).to(tl.int64)
    cs_ptrs = cs_ptr + positions[:, None] * stride_cst + halves[None, :] * stride_csd
    cs_ok = token_ok[:, None] & half_ok[None, :]
    cos = tl.load(cs_ptrs, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
    sin = tl.load(cs_ptrs + HALF * stride_csd, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]

    if INTERLEAVED:
        pair_dims = tl.arange(0, 2 * HALF_BLOCK)
        pair_ok = vector_ok & (pair_dims < 2 * HALF)[None, None, :]
        pairs = tl.load(rows + (ROT_START + pair_dims)[None, None, :] * stride_qd, mask=pair_ok, other=0.0)
        x1, x2 = tl.split(tl.reshape(pairs.to(tl.float32), (BLOCK_T, BLOCK_H, HALF_BLOCK, 2)))
    else:
        rot_ok = vector_ok & half_ok[None, None, :]
        x1 = tl.load(rows + (ROT_START + halves)[None, None, :] * stride_qd, mask=rot_ok, other=0.0)
        x2 = tl.load(rows + (ROT_START + HALF + halves)[None, None, :] * stride_qd, mask=rot_ok, other=0.0)
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    amax = tl.maximum(tl.max(tl.abs(out1), axis=2), tl.max(tl.abs(out2), axis=2))
    if REST_BLOCK > 0:
        rest_dims = tl.arange(0, REST_BLOCK)
        rest_ok = vector_ok & (rest_dims < HEAD_DIM - 2 * HALF)[None, None, :]
        rest = tl.load(rows + (REST_START + rest_dims)[None, None, :] * stride_qd, mask=rest_ok, other=0.0)
        rest = rest.to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(rest), axis=2))

    scale, inv_scale = _power_of_two_scale(amax, FP8_MAX_EXP, FP8_MAX_MANT)
    inv_scale = inv_scale[:, :, None]
    # |x| * inv_scale <= FP8_MAX by the choice of scale, so no clamp is needed before the casts.
    if INTERLEAVED:
        rotated = tl.reshape(tl.join(out1, out2), (BLOCK_T, BLOCK_H, 2 * HALF_BLOCK))
        tl.store(out_rows + ROT_START + pair_dims[None, None, :],
                 _to_fp8(rotated * inv_scale, STORE, ROUND_IN_SOFTWARE), mask=pair_ok)
    else:
        tl.store(out_rows + ROT_START + halves[None, None, :],
                 _to_fp8(out1 * inv_scale, STORE, ROUND_IN_SOFTWARE), mask=rot_ok)
        tl.store(out_rows + ROT_START + HALF + halves[None, None, :],
                 _to_fp8(out2 * inv_scale, STORE, ROUND_IN_SOFTWARE), mask=rot_ok)
    if REST_BLOCK > 0:
        tl.store(out_rows + REST_START + rest_dims[None, None, :],
                 _to_fp8(rest * inv_scale, STORE, ROUND_IN_SOFTWARE), mask=rest_ok)

    w = tl.load(w_ptr + tokens[:, None] * stride_wt + heads[None, :] * stride_wh, mask=w_ok).to(tl.float32)
    tl.store(w_out_ptr + vectors, w * scale * weight_factor, mask=w_ok)


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
    fnuz_mode: Fp8Mode | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], weights [T, H] -> (q fp8 [T, H, D], fp32 weights [T, H]), as the torch reference.

    `fnuz_mode` (fnuz_native / fnuz_emulated) overrides the machine's choice for e4m3fnuz: native on
    ROCm gfx94x only."""
    block_t, block_h, num_warps = launch_config(*q.shape[:2]) if q.dim() == 3 else (1, 1, 1)
    return launch(
        q, weights, positions, cos_sin_cache,
        fp8_dtype=fp8_dtype, rope=rope, weight_factor=softmax_scale * head_scale,
        mode=fp8_mode(fp8_dtype, fnuz_mode), round_in_software=triton_interpreter_on(),
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


def launch(q, weights, positions, cos_sin_cache, *, fp8_dtype, rope, weight_factor, mode,
           round_in_software, block_t, block_h, num_warps):
    """Check the inputs, then run the kernel with an explicit fp8 mode and launch config (the tuner
    calls this directly)."""
    _check(q, weights, positions, cos_sin_cache)
    fp8_dtype = Fp8Dtype(fp8_dtype)
    tokens, heads, head_dim = q.shape
    rot_dim = cos_sin_cache.shape[-1]
    emulated = mode is Fp8Mode.FNUZ_EMULATED
    q_out = torch.empty((tokens, heads, head_dim), dtype=torch.uint8 if emulated else torch_dtype(fp8_dtype),
                        device=q.device)
    w_out = torch.empty((tokens, heads), dtype=torch.float32, device=q.device)
    if tokens and heads:
        max_exp, max_mant = _exponent_and_mantissa(FP8_MAX[fp8_dtype])
        grid = (triton.cdiv(tokens, block_t), triton.cdiv(heads, block_h))
        _indexer_q_quant_kernel[grid](
            q, weights, positions, cos_sin_cache, q_out, w_out,
            tokens, heads, *q.stride(), *weights.stride(), positions.stride(0), *cos_sin_cache.stride(),
            weight_factor,
            HEAD_DIM=head_dim, HALF=rot_dim // 2,
            ROT_START=0 if rope.at_head else head_dim - rot_dim, REST_START=rot_dim if rope.at_head else 0,
            INTERLEAVED=rope.interleaved, FP8_MAX_EXP=max_exp, FP8_MAX_MANT=max_mant,
            STORE=_STORE[mode], ROUND_IN_SOFTWARE=round_in_software,
            BLOCK_T=block_t, BLOCK_H=block_h, HALF_BLOCK=triton.next_power_of_2(rot_dim // 2),
            REST_BLOCK=triton.next_power_of_2(head_dim - rot_dim) if head_dim > rot_dim else 0,
            num_warps=num_warps,
        )
    return (q_out.view(torch.float8_e4m3fnuz) if emulated else q_out), w_out


def _exponent_and_mantissa(value: float) -> tuple[int, int]:
    """The unbiased exponent and the 23 mantissa bits of `value` as an fp32 (a normal number)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((bits >> 23) & 0xFF) - 127, bits & 0x7FFFFF


def _check(q, weights, positions, cos_sin_cache) -> None:
    if q.dim() != 3:
        raise LayoutError(f"indexer_q_quant expects q [T, H, D]; got q {list(q.shape)}")
    tokens, heads, head_dim = q.shape
    if tuple(weights.shape) != (tokens, heads):
        raise LayoutError(f"indexer_q_quant expects weights [{tokens}, {heads}]; got {list(weights.shape)}")
    if tuple(positions.shape) != (tokens,):
        raise LayoutError(f"indexer_q_quant expects positions [{tokens}]; got {list(positions.shape)}")
    if cos_sin_cache.dim() != 2:
        raise LayoutError(f"indexer_q_quant expects cos_sin_cache [max_pos, rot_dim]; got {list(cos_sin_cache.shape)}")
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim % 2 or not 0 < rot_dim <= head_dim:
        raise LayoutError(f"cos_sin_cache rot_dim {rot_dim} must be even and in 2..{head_dim} (the head dim)")
    for name, tensor in (("weights", weights), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if tensor.device != q.device:
            raise LayoutError(f"{name} is on {tensor.device} but q is on {q.device}")
