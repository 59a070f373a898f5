"""Indexer Q quantisation in plain torch: RoPE on the rotary part, a power-of-two scale per token and
head, fp8 store, and the scale folded into the head weights."""

from __future__ import annotations

import math

import torch

from dispatch.fp8 import torch_dtype
from dispatch.key import FP8_MAX, Fp8Dtype
from dispatch.rope import RopeSpec


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """RoPE on fp32 x [T, H, D]. cos_sin_cache [max_pos, rot_dim] holds cos in its first half, sin in its second."""
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
    result = x.clone()
    result[..., start : start + rot_dim] = rotated
    return result


def power_of_two_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """2^ceil(log2(max(amax, 1e-4) / fp8_max)), exactly, on any device.

    With amax = m_a * 2^e_a and fp8_max = m_f * 2^e_f (mantissas in [0.5, 1)), the ratio lies in
    (2^(e_a - e_f - 1), 2^(e_a - e_f)] when m_a <= m_f, else one binade up. Comparing mantissas avoids
    log2 and division, whose rounding differs between devices (CUDA's log2 is not exact at powers of two).
    """
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] (any float dtype), weights [T, H] -> (q fp8 [T, H, D], fp32 weights [T, H])."""
    fp8_max = FP8_MAX[Fp8Dtype(fp8_dtype)]
    rotated = apply_rope(q.float(), positions, cos_sin_cache, rope)
    scale = power_of_two_scale(rotated.abs().amax(dim=-1), fp8_max)
    # Clamp before the cast: torch casts out-of-range values to fnuz NaN instead of saturating.
    q_fp8 = (rotated / scale[..., None]).clamp(-fp8_max, fp8_max).to(torch_dtype(fp8_dtype))
    weights_out = weights.float() * scale * (softmax_scale * head_scale)
    return q_fp8, weights_out
