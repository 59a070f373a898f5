"""The torch reference kernels against computations written independently: python loops over tokens
and keys that read the paged cache byte by byte (block table -> block -> byte offsets), fp8 decoded
from its bit fields, and RoPE as complex multiplication."""

from __future__ import annotations

import cmath
import math
import struct
import zlib

import pytest
import torch

from dispatch.contract.paged_cache import build_paged_kv_cache
from dispatch.contract.kv_cache import quantize_keys, split_kv_cache
from backends.reference.paged_mqa_logits import reference_paged_mqa_logits
from backends.reference.q_quant import apply_rope, reference_indexer_q_quant
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.key import FP8_MAX, Fp8Dtype
from dispatch.contract.rope import RopeSpec

TOLERANCE = 1e-5  # ||out - ref|| / ||ref|| over visible positions: fp32 accumulation of exact fp8 products
DTYPES = [Fp8Dtype.E4M3FN, Fp8Dtype.E4M3FNUZ]


def fp8_decode_table(fp8_dtype: Fp8Dtype) -> torch.Tensor:
    """float64 [256]: the value of each fp8 byte, from sign / 4-bit exponent / 3-bit mantissa."""
    fnuz = fp8_dtype is Fp8Dtype.E4M3FNUZ
    bias = 8 if fnuz else 7
    values = []
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
        if (fnuz and byte == 0x80) or (not fnuz and exponent == 0xF and mantissa == 0x7):
            values.append(math.nan)
        elif exponent == 0:
            values.append(sign * mantissa / 8 * 2.0 ** (1 - bias))
        else:
            values.append(sign * (1 + mantissa / 8) * 2.0 ** (exponent - bias))
    return torch.tensor(values, dtype=torch.float64)


def decode(raw: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[raw.view(torch.uint8).long()]


@pytest.mark.parametrize("fp8_dtype", DTYPES)
def test_fp8_decode_table_agrees_with_torch(fp8_dtype):
    # The loop reference below decodes bytes by hand; make sure the hand decoding is right.
    table = fp8_decode_table(fp8_dtype)
    everything = torch.arange(256, dtype=torch.uint8).view(torch_dtype(fp8_dtype)).double()
    assert torch.equal(torch.isnan(table), torch.isnan(everything))
    finite = ~torch.isnan(table)
    assert torch.equal(table[finite], everything[finite])
    assert table[finite].abs().max() == {Fp8Dtype.E4M3FN: 448.0, Fp8Dtype.E4M3FNUZ: 240.0}[fp8_dtype]


# --- the paged cache, read by hand ------------------------------------------------------------------


def read_cached_key(cache: torch.Tensor, block: int, offset: int, table: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(float64 key [D], fp32 scale) of token `offset` of physical `block`, straight from the bytes."""
    _, block_kv, _, row_bytes = cache.shape
    head_dim = row_bytes - 4
    data = cache[block].reshape(-1)  # block-major: block_kv*D value bytes, then block_kv*4 scale bytes
    values = data[offset * head_dim : (offset + 1) * head_dim]
    scale_at = block_kv * head_dim + offset * 4
    (scale,) = struct.unpack("<f", bytes(data[scale_at : scale_at + 4].tolist()))
    return decode(values, table), scale


def loop_logits(q, cache, weights, context_lens, block_table, max_len, fp8_dtype) -> torch.Tensor:
    """logits[r*N + j, k] = sum_h w * relu(q . K[k]) * s[k] for k < ctx[r, j], one token and one key at a time."""
    table = fp8_decode_table(fp8_dtype)
    rows, next_n = q.shape[:2]
    block_kv = cache.shape[1]
    q_values = decode(q, table)
    out = torch.full((rows * next_n, max_len), -math.inf, dtype=torch.float64)
    for row in range(rows):
        for token in range(next_n):
            w = weights[row * next_n + token].double()
            for k in range(int(context_lens[row, token])):
                block = int(block_table[row, k // block_kv])
                key, scale = read_cached_key(cache, block, k % block_kv, table)
                out[row * next_n + token, k] = float((torch.relu(q_values[row, token] @ key) * w).sum()) * scale
    return out


def causal_lengths(seq_lens: list[int], next_n: int) -> list[list[int]]:
    return [[max(length - next_n + j + 1, 0) for j in range(next_n)] for length in seq_lens]


def random_fp8(shape, fp8_dtype, generator) -> torch.Tensor:
    fp8_max = FP8_MAX[fp8_dtype]
    return (torch.randn(shape, generator=generator) * fp8_max / 3).clamp(-fp8_max, fp8_max).to(torch_dtype(fp8_dtype))


def relative_error(out: torch.Tensor, ref: torch.Tensor, visible: torch.Tensor) -> float:
    difference, size = (out.double()[visible] - ref[visible]).norm(), ref[visible].norm()
    # every visible logit can be 0 (relu of negative scores); then the difference itself must be 0
    return float(difference / size) if size > 0 else float(difference)


SHAPES = [
    # (seq_lens, next_n, heads, head_dim, block_kv)
    ([1], 1, 4, 16, 64),
    ([70, 3, 129], 2, 4, 32, 64),
    ([17, 64, 2, 33], 4, 8, 16, 16),
    ([40, 8, 25], 3, 2, 64, 8),
    ([9, 31], 8, 3, 16, 4),
]


@pytest.mark.parametrize("fp8_dtype", DTYPES)
@pytest.mark.parametrize("layout", ["native", "flatten"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{s[0]}-N{s[1]}-H{s[2]}-D{s[3]}-blk{s[4]}")
def test_paged_mqa_logits_against_the_loop(shape, layout, fp8_dtype):
    seq_lens, next_n, heads, head_dim, block_kv = shape
    seed = zlib.crc32(repr((seq_lens, next_n, layout, fp8_dtype.value)).encode())
    generator = torch.Generator().manual_seed(seed)
    keys = [
        torch.randn(length, head_dim, generator=generator) * (1 + 4 * torch.rand(1, generator=generator))
        for length in seq_lens
    ]
    cache, pages = build_paged_kv_cache(keys, fp8_dtype, block_kv=block_kv, extra_blocks=2, generator=generator)
    batch = len(seq_lens)
    q = random_fp8((batch, next_n, heads, head_dim), fp8_dtype, generator)
    weights = torch.randn(batch * next_n, heads, generator=generator)
    lens = causal_lengths(seq_lens, next_n)
    if layout == "native":
        context_lens = torch.tensor(lens, dtype=torch.int32)
        block_table = pages
    else:
        q = q.reshape(batch * next_n, 1, heads, head_dim)
        context_lens = torch.tensor([[v] for row in lens for v in row], dtype=torch.int32)
        block_table = torch.stack([pages[r] for r in range(batch) for _ in range(next_n)])
    max_len = max(seq_lens)

    out = reference_paged_mqa_logits(q, cache, weights, context_lens, block_table, max_len, fp8_dtype)
    ref = loop_logits(q, cache, weights, context_lens, block_table, max_len, fp8_dtype)

    assert out.shape == (batch * next_n, max_len) and out.dtype == torch.float32
    assert not torch.isnan(out).any()
    visible = torch.arange(max_len)[None, :] < context_lens.reshape(-1, 1)
    assert torch.equal(torch.isneginf(out), ~visible)  # the mask, exactly
    assert torch.isfinite(out[visible]).all()
    assert visible.any()
    assert relative_error(out, ref, visible) < TOLERANCE


def test_tokens_shorter_than_next_n_are_fully_masked():
    generator = torch.Generator().manual_seed(11)
    keys = [torch.randn(2, 16, generator=generator), torch.randn(6, 16, generator=generator)]
    cache, pages = build_paged_kv_cache(keys, Fp8Dtype.E4M3FN, block_kv=4, generator=generator)
    q = random_fp8((2, 4, 2, 16), Fp8Dtype.E4M3FN, generator)
    weights = torch.randn(8, 2, generator=generator)
    context_lens = torch.tensor(causal_lengths([2, 6], 4), dtype=torch.int32)
    assert context_lens.tolist() == [[0, 0, 1, 2], [3, 4, 5, 6]]
    out = reference_paged_mqa_logits(q, cache, weights, context_lens, pages, 6, Fp8Dtype.E4M3FN)
    assert torch.isneginf(out[:2]).all()
    assert torch.isneginf(out[2, 1:]).all() and torch.isfinite(out[2, :1]).all()
    assert torch.isfinite(out[7]).all()


# --- building the cache --------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", DTYPES)
def test_paged_cache_bytes_hold_the_quantised_keys(fp8_dtype):
    generator = torch.Generator().manual_seed(21)
    lengths, head_dim, block_kv = [5, 16, 17, 1], 8, 4
    keys = [torch.randn(n, head_dim, generator=generator) * 10 for n in lengths]
    cache, pages = build_paged_kv_cache(keys, fp8_dtype, block_kv=block_kv, extra_blocks=3, generator=generator)
    table = fp8_decode_table(fp8_dtype)
    fp8_max = FP8_MAX[fp8_dtype]

    page_counts = [math.ceil(n / block_kv) for n in lengths]
    assert cache.shape == (sum(page_counts) + 3 + 1, block_kv, 1, head_dim + 4) and cache.dtype == torch.uint8
    assert pages.shape == (4, max(page_counts)) and pages.dtype == torch.int32
    used = [int(pages[r, p]) for r, count in enumerate(page_counts) for p in range(count)]
    assert len(set(used)) == len(used) and 0 not in used  # distinct physical blocks; block 0 is padding
    assert all(int(pages[r, p]) == 0 for r, count in enumerate(page_counts) for p in range(count, pages.shape[1]))

    for request, original in enumerate(keys):
        for position in range(lengths[request]):
            block = int(pages[request, position // block_kv])
            values, scale = read_cached_key(cache, block, position % block_kv, table)
            expected_scale = float(original[position].abs().max()) / fp8_max
            assert scale == pytest.approx(expected_scale, rel=1e-6)
            assert values.abs().max() == fp8_max  # the largest element lands on the top of the range
            dequantised = values * scale
            error = (dequantised - original[position].double()).norm() / original[position].double().norm()
            assert error < 2**-4


@pytest.mark.parametrize("fp8_dtype", DTYPES)
def test_split_kv_cache_views_the_bytes(fp8_dtype):
    generator = torch.Generator().manual_seed(22)
    cache, _ = build_paged_kv_cache(
        [torch.randn(7, 16, generator=generator)], fp8_dtype, block_kv=4, generator=generator
    )
    values, scales = split_kv_cache(cache, fp8_dtype)
    assert values.shape == (cache.shape[0], 4, 16) and values.dtype == torch_dtype(fp8_dtype)
    assert scales.shape == (cache.shape[0], 4) and scales.dtype == torch.float32
    table = fp8_decode_table(fp8_dtype)
    for block in range(cache.shape[0]):
        for offset in range(4):
            key, scale = read_cached_key(cache, block, offset, table)
            assert torch.equal(decode(values[block, offset], table), key) or torch.isnan(key).any()
            assert struct.pack("<f", float(scales[block, offset])) == struct.pack("<f", scale) or math.isnan(scale)


@pytest.mark.parametrize("fp8_dtype", DTYPES)
def test_quantize_keys_saturates_and_never_makes_nan(fp8_dtype):
    keys = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [1e-9, -1e-9, 0.0, 1e-9], [3.0, -6.0, 1.5, 0.0], [1e30, -1e30, 1.0, 0.0]]
    )
    values, scales = quantize_keys(keys, fp8_dtype)
    decoded = values.double()
    fp8_max = FP8_MAX[fp8_dtype]
    assert not torch.isnan(decoded).any()
    assert decoded.abs().max() <= fp8_max
    assert torch.equal(decoded[0], torch.zeros(4, dtype=torch.float64))
    assert float(scales[0]) == pytest.approx(1e-4 / fp8_max)
    assert decoded[2].tolist() == [fp8_max / 2, -fp8_max, fp8_max / 4, 0.0]
    assert float(scales[2]) == pytest.approx(6.0 / fp8_max)


# --- Q quantisation ------------------------------------------------------------------------------


def rope_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> tuple[list[list[float]], torch.Tensor]:
    """(angles [max_pos][rot_dim/2] in float64, cos_sin_cache fp32 [max_pos, rot_dim], cos first, then sin)."""
    angles = [[p * base ** (-2 * i / rot_dim) for i in range(rot_dim // 2)] for p in range(max_pos)]
    cos = torch.tensor([[math.cos(a) for a in row] for row in angles])
    sin = torch.tensor([[math.sin(a) for a in row] for row in angles])
    return angles, torch.cat([cos, sin], dim=-1).float()


def complex_rope(x: torch.Tensor, positions: list[int], angles, rot_dim: int, rope: RopeSpec) -> torch.Tensor:
    """RoPE with python complex numbers: each rotary pair (a, b) becomes (a + ib) * e^(i angle)."""
    out = x.double().clone()
    tokens, heads, head_dim = x.shape
    start = 0 if rope.at_head else head_dim - rot_dim
    half = rot_dim // 2
    for t in range(tokens):
        for h in range(heads):
            for i in range(half):
                a_at, b_at = (start + 2 * i, start + 2 * i + 1) if rope.interleaved else (start + i, start + half + i)
                z = complex(float(x[t, h, a_at]), float(x[t, h, b_at])) * cmath.exp(1j * angles[positions[t]][i])
                out[t, h, a_at], out[t, h, b_at] = z.real, z.imag
    return out


ROPES = [
    RopeSpec.neox_head(),
    RopeSpec.gptj_tail(),
    RopeSpec(interleaved=True, at_head=True),
    RopeSpec(interleaved=False, at_head=False),
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: f"interleaved={r.interleaved}-at_head={r.at_head}")
@pytest.mark.parametrize("rot_dim, head_dim", [(16, 32), (8, 8)])
def test_rope_against_complex_rotation(rope, rot_dim, head_dim):
    generator = torch.Generator().manual_seed(31 + rot_dim)
    x = torch.randn(5, 3, head_dim, generator=generator)
    positions = [0, 1, 7, 100, 4095]
    angles, cos_sin = rope_cache(4096, rot_dim)
    out = apply_rope(x, torch.tensor(positions), cos_sin, rope)
    expected = complex_rope(x, positions, angles, rot_dim, rope)
    assert float((out.double() - expected).norm() / expected.norm()) < TOLERANCE
    start = 0 if rope.at_head else head_dim - rot_dim
    untouched = torch.ones(head_dim, dtype=torch.bool)
    untouched[start : start + rot_dim] = False
    assert torch.equal(out[..., untouched], x[..., untouched])
    assert torch.equal(out[0], x[0])  # position 0 rotates by nothing


def power_of_two_above(amax: float, fp8_max: float) -> float:
    return 2.0 ** math.ceil(math.log2(max(amax, 1e-4) / fp8_max))


@pytest.mark.parametrize("fp8_dtype", DTYPES)
@pytest.mark.parametrize("rope", [RopeSpec.neox_head(), RopeSpec.gptj_tail()], ids=["neox-head", "gptj-tail"])
@pytest.mark.parametrize("magnitude, in_dtype", [(1.0, torch.bfloat16), (3e3, torch.float32), (1e-3, torch.float16)])
def test_q_quant_against_hand_computation(fp8_dtype, rope, magnitude, in_dtype):
    generator = torch.Generator().manual_seed(int(magnitude * 1000) % 9973 + len(fp8_dtype.value))
    tokens, heads, head_dim, rot_dim = 6, 4, 32, 16
    q = (torch.randn(tokens, heads, head_dim, generator=generator) * magnitude).to(in_dtype)
    weights = torch.randn(tokens, heads, generator=generator)
    positions = [3, 0, 511, 12, 12, 200]
    angles, cos_sin = rope_cache(512, rot_dim)
    softmax_scale, head_scale = head_dim**-0.5, heads**-0.5
    q_fp8, folded = reference_indexer_q_quant(
        q,
        weights,
        torch.tensor(positions),
        cos_sin,
        fp8_dtype=fp8_dtype,
        rope=rope,
        softmax_scale=softmax_scale,
        head_scale=head_scale,
    )
    fp8_max = FP8_MAX[fp8_dtype]
    assert q_fp8.dtype == torch_dtype(fp8_dtype) and q_fp8.shape == q.shape
    assert folded.dtype == torch.float32 and folded.shape == weights.shape
    values = q_fp8.double()
    assert not torch.isnan(values).any() and not torch.isnan(folded).any()
    assert values.abs().max() <= fp8_max

    rotated = complex_rope(q.float(), positions, angles, rot_dim, rope)
    # The engines round the rotated dims to bf16 before the amax (the rest is q as given).
    start = 0 if rope.at_head else head_dim - rot_dim
    rotated[..., start : start + rot_dim] = rotated[..., start : start + rot_dim].to(torch.bfloat16).to(rotated.dtype)
    for t in range(tokens):
        for h in range(heads):
            amax = float(rotated[t, h].abs().max())
            scale = power_of_two_above(amax, fp8_max)
            # the scale is a power of two, and the one the folded weight carries
            implied = float(folded[t, h]) / (float(weights[t, h]) * softmax_scale * head_scale)
            assert implied == pytest.approx(scale, rel=1e-6)
            assert math.log2(scale) == int(math.log2(scale))
            # tight: the largest element lands in the top half of the fp8 range (rounding may reach its floor)
            assert fp8_max / 2 <= float(values[t, h].abs().max()) <= fp8_max
            error = (values[t, h] * scale - rotated[t, h]).norm() / rotated[t, h].norm()
            assert error < 2**-4


@pytest.mark.parametrize("fp8_dtype", DTYPES)
def test_q_quant_of_zeros_uses_the_floor_scale(fp8_dtype):
    _, cos_sin = rope_cache(4, 8)
    q_fp8, folded = reference_indexer_q_quant(
        torch.zeros(2, 3, 16),
        torch.ones(2, 3),
        torch.tensor([0, 1]),
        cos_sin,
        fp8_dtype=fp8_dtype,
        rope=RopeSpec.neox_head(),
        softmax_scale=1.0,
        head_scale=1.0,
    )
    assert torch.equal(q_fp8.double(), torch.zeros(2, 3, 16, dtype=torch.float64))
    expected = power_of_two_above(0.0, FP8_MAX[fp8_dtype])
    assert torch.equal(folded, torch.full((2, 3), expected))
