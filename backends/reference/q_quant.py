"""Indexer Q quantisation in plain torch: RoPE on the rotary part, a power-of-two scale per token and
head, fp8 store, and the scale folded into the head weights.

Numerics are the engines' (vLLM V3.2 and V4, SGLang): the RoPE output is rounded to bf16 (the
activation dtype) before the amax and the division, and the weight is folded one fp32 product at a
time, w * scale * softmax_scale * head_scale. A head vector holding NaN or inf after RoPE cannot be
quantised: its fp8 bytes are the format's NaN and its folded weight is NaN, so every visible logit of
its token is NaN. A position outside the cos/sin cache raises IndexBoundsError (the GPU kernels
poison that token the same way and set a flag instead)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dispatch.contract import ALL_ARCHS, FP8_MAX, Backend, Fp8Dtype, Layout, Op, RopeSpec, Support, torch_dtype

if TYPE_CHECKING:  # torch is imported where it runs: registering the reference must not (plugin.py)
    import torch


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rope: RopeSpec,
    *,
    rotary_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """RoPE on fp32 x [T, H, D]. cos_sin_cache [max_pos, rot_dim] holds cos in its first half, sin in
    its second. `rotary_dtype` rounds the rotated dims to that dtype and back (the engines: bf16)."""
    import torch

    rot_dim = cos_sin_cache.shape[-1]
    half = rot_dim // 2
    cos_sin = cos_sin_cache[positions.long()].float()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    start = 0 if rope.at_head else x.shape[-1] - rot_dim
    part = x[..., start : start + rot_dim]
    if rope.interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
    else:
        x1, x2 = part[..., :half], part[..., half:]
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    rotated = torch.stack((out1, out2), dim=-1).flatten(-2) if rope.interleaved else torch.cat((out1, out2), dim=-1)
    if rotary_dtype is not None:
        rotated = rotated.to(rotary_dtype).float()
    result = x.clone()
    result[..., start : start + rot_dim] = rotated
    return result


def power_of_two_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """2^ceil(log2(max(amax, 1e-4) / fp8_max)), exactly, on any device.

    With amax = m_a * 2^e_a and fp8_max = m_f * 2^e_f (mantissas in [0.5, 1)), the ratio lies in
    (2^(e_a - e_f - 1), 2^(e_a - e_f)] when m_a <= m_f, else one binade up. Comparing mantissas avoids
    log2 and division, whose rounding differs between devices (CUDA's log2 is not exact at powers of two).
    """
    import torch

    amax_mantissa, amax_exponent = torch.frexp(amax.float().clamp(min=1e-4))
    max_mantissa, max_exponent = math.frexp(fp8_max)
    exponent = amax_exponent - max_exponent + (amax_mantissa > max_mantissa).to(amax_exponent.dtype)
    return torch.ldexp(torch.ones_like(amax_mantissa), exponent)


def reference_indexer_q_quant(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] (any float dtype), weights [T, H] -> (q fp8 [T, H, D], fp32 weights [T, H]).

    `error_flags` is accepted for the op's call convention and never written: a bad position raises."""
    import torch

    from dispatch.contract import check_positions

    check_positions(positions, cos_sin_cache.shape[0])
    fp8_max = FP8_MAX[Fp8Dtype(fp8_dtype)]
    # The engines keep their RoPE output in the activation dtype, bf16, before the amax and the division.
    rotated = apply_rope(q.float(), positions, cos_sin_cache, rope, rotary_dtype=torch.bfloat16)
    poisoned = ~torch.isfinite(rotated).all(dim=-1)  # [T, H]
    scale = power_of_two_scale(rotated.abs().amax(dim=-1), fp8_max).masked_fill(poisoned, float("nan"))
    # Clamp before the cast: torch casts out-of-range values to fnuz NaN instead of saturating.
    q_fp8 = (rotated / scale[..., None]).clamp(-fp8_max, fp8_max).to(torch_dtype(fp8_dtype))
    nan_byte = NAN_BYTE[Fp8Dtype(fp8_dtype)]
    q_fp8 = q_fp8.view(torch.uint8).masked_fill(poisoned[..., None], nan_byte).view(q_fp8.dtype)
    weights_out = weights.float() * scale * _fp32(softmax_scale) * _fp32(head_scale)
    return q_fp8, weights_out


# The byte a vector that cannot be quantised is stored as: e4m3fn's positive NaN, fnuz's only NaN.
NAN_BYTE = {Fp8Dtype.E4M3FN: 0x7F, Fp8Dtype.E4M3FNUZ: 0x80}


def _fp32(value: float) -> torch.Tensor:
    import torch

    # A 0-d fp32 tensor, so each product rounds to fp32 exactly as a kernel's fp32 scalar does.
    return torch.tensor(value, dtype=torch.float32)


BACKENDS = (
    Backend(
        name="torch.reference",
        op=Op.INDEXER_Q_QUANT,
        layout=Layout.TOKENS,
        supports=Support(archs=ALL_ARCHS),
        run=reference_indexer_q_quant,
        description="plain torch RoPE + power-of-two fp8 quantisation",
    ),
)
