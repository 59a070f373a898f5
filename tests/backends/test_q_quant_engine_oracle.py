"""Q quantisation equals the engines' bit for bit: fp8 bytes and folded weights.

The oracle restates, in plain per-element torch, the arithmetic of the engines' fused indexer-Q kernels
as read in vLLM (V3.2 `sparse_attn_indexer.py`, V4 `fused_indexer_q.py`) and SGLang (RoPE on bf16
activations, then the per-token quantiser):
1. RoPE in fp32 on the fp32 values of q and the cos/sin rows: a*cos - b*sin and b*cos + a*sin;
2. the rotated values rounded to bf16 and back (the activation dtype);
3. amax over the whole head vector (rotated dims and the rest as given), floored at 1e-4 (V4 and
   SGLang; V3.2 floors at 1e-10, which differs only for vectors with amax < 1e-4);
4. scale = 2 ** ceil(log2(amax / FP8_MAX)), FP8_MAX 448 (e4m3fn) or 224 (e4m3fnuz, vLLM's ROCm value);
5. q / scale clamped to +-FP8_MAX and cast to fp8 (round to nearest even);
6. the folded weight w * scale, then * softmax_scale, then * head_scale, each product in fp32.
Step 4 is computed here in float64 from the fp32 amax: log2 of amax / FP8_MAX is then never within
rounding of an integer unless it is one (amax is a bf16 value or an fp32 from the rest dims).
"""

from __future__ import annotations

import pytest
import torch

from backends.reference.q_quant import reference_indexer_q_quant as reference_quant
from backends.triton.fp8_mode import Fp8Mode
from backends.triton.q_quant import triton_indexer_q_quant as triton_quant
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.key import FP8_MAX, Fp8Dtype
from dispatch.contract.rope import RopeSpec

ROPES = [RopeSpec.neox_head(), RopeSpec.gptj_tail(), RopeSpec(interleaved=False, at_head=False),
         RopeSpec(interleaved=True, at_head=True)]
ROPE_IDS = ["neox-head", "gptj-tail", "neox-tail", "gptj-head"]
SOFTMAX_SCALE, HEAD_SCALE = 128**-0.5, 64**-0.5


def engine_oracle(q, weights, positions, cos_sin_cache, rope: RopeSpec, fp8_dtype: Fp8Dtype):
    fp8_max = FP8_MAX[fp8_dtype]
    tokens, heads, dim = q.shape
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    start = 0 if rope.at_head else dim - rot
    x = q.float().clone()
    rows = cos_sin_cache.float()[positions.long()]
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    part = x[..., start : start + rot]
    a, b = (part[..., 0::2], part[..., 1::2]) if rope.interleaved else (part[..., :half], part[..., half:])
    first = (a * cos - b * sin).to(torch.bfloat16).float()
    second = (b * cos + a * sin).to(torch.bfloat16).float()
    if rope.interleaved:
        x[..., start : start + rot : 2], x[..., start + 1 : start + rot : 2] = first, second
    else:
        x[..., start : start + half], x[..., start + half : start + rot] = first, second
    # float64 on the CPU: log2 there is exact at powers of two, and amax / FP8_MAX is exact in float64.
    amax = x.abs().amax(dim=-1).clamp(min=1e-4).double().cpu()
    scale = torch.exp2(torch.ceil(torch.log2(amax / fp8_max))).float().to(x.device)
    q_out = (x / scale[..., None]).clamp(-fp8_max, fp8_max).to(torch_dtype(fp8_dtype))
    one = lambda value: torch.tensor(value, dtype=torch.float32)  # noqa: E731
    w_out = weights.float() * scale * one(SOFTMAX_SCALE) * one(HEAD_SCALE)
    return q_out, w_out


def inputs(seed: int, tokens=6, heads=8, cache_dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.randint(-10, 11, (tokens, heads, 1), generator=gen).double())
    q = (torch.randn(tokens, heads, 128, generator=gen, dtype=torch.float64) * magnitude).to(torch.bfloat16)
    weights = torch.randn(tokens, heads, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 8192, (tokens,), generator=gen)
    angles = torch.arange(8192, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, 64, 2) / 64)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(cache_dtype)
    return q, weights, positions, cache


BACKENDS = [
    pytest.param(Fp8Dtype.E4M3FN, "torch.reference", None, id="reference-e4m3fn"),
    pytest.param(Fp8Dtype.E4M3FNUZ, "torch.reference", None, id="reference-fnuz"),
    pytest.param(Fp8Dtype.E4M3FN, "triton", None, id="triton"),
    pytest.param(Fp8Dtype.E4M3FNUZ, "rocm.fnuz", Fp8Mode.FNUZ_EMULATED, id="rocm.fnuz-emulated"),
    pytest.param(Fp8Dtype.E4M3FNUZ, "rocm.fnuz", Fp8Mode.FNUZ_NATIVE, id="rocm.fnuz-native"),
]


@pytest.mark.parametrize("fp8_dtype, backend, mode", BACKENDS)
@pytest.mark.parametrize("rope", ROPES, ids=ROPE_IDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bytes_and_weights_equal_the_engines(fp8_dtype, backend, mode, rope, seed):
    q, weights, positions, cache = inputs(seed)
    settings = dict(fp8_dtype=fp8_dtype, rope=rope, softmax_scale=SOFTMAX_SCALE, head_scale=HEAD_SCALE)
    if backend == "torch.reference":
        q_fp8, folded = reference_quant(q, weights, positions, cache, **settings)
    else:
        q_fp8, folded = triton_quant(q, weights, positions, cache, fnuz_mode=mode, **settings)
    want_q, want_w = engine_oracle(q, weights, positions, cache, rope, fp8_dtype)
    # Exact by design: elementwise, correctly rounded steps in the engines' order, no reordered sums
    # (tests/backends/test_triton_q_quant.py says which).
    differ = q_fp8.view(torch.uint8) != want_q.view(torch.uint8)
    assert not differ.any(), f"{int(differ.sum())} of {differ.numel()} fp8 bytes differ from the engines'"
    assert torch.equal(folded, want_w), "folded weights (so the power-of-two scales) differ from the engines'"


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype, mode", [(Fp8Dtype.E4M3FN, None), (Fp8Dtype.E4M3FNUZ, Fp8Mode.FNUZ_EMULATED)])
@pytest.mark.parametrize("rope", [RopeSpec.neox_head(), RopeSpec.gptj_tail()], ids=["neox-head", "gptj-tail"])
def test_bytes_and_weights_equal_the_engines_on_gpu(fp8_dtype, mode, rope):
    q, weights, positions, cache = inputs(11, tokens=4096, heads=64)
    q_fp8, folded = triton_quant(q.cuda(), weights.cuda(), positions.cuda(), cache.cuda(), fp8_dtype=fp8_dtype,
                                 rope=rope, softmax_scale=SOFTMAX_SCALE, head_scale=HEAD_SCALE, fnuz_mode=mode)
    want_q, want_w = engine_oracle(q, weights, positions, cache, rope, fp8_dtype)
    differ = q_fp8.cpu().view(torch.uint8) != want_q.view(torch.uint8)
    assert not differ.any(), f"{int(differ.sum())} of {differ.numel()} fp8 bytes differ from the engines'"
    assert torch.equal(folded.cpu(), want_w)


def test_the_fp32_rope_output_would_differ_from_the_engines():
    """Why the rounding matters: quantising the unrounded fp32 RoPE output changes bytes (and some scales)."""
    q, weights, positions, cache = inputs(7, tokens=32, heads=16)
    rope = RopeSpec.gptj_tail()
    want_q, _ = engine_oracle(q, weights, positions, cache, rope, Fp8Dtype.E4M3FN)
    x = q.float().clone()
    rows = cache.float()[positions]
    cos, sin = rows[:, None, :32], rows[:, None, 32:]
    a, b = x[..., 64::2].clone(), x[..., 65::2].clone()
    x[..., 64::2], x[..., 65::2] = a * cos - b * sin, b * cos + a * sin
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1).clamp(min=1e-4).double() / 448))).float()
    unrounded = (x / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert (unrounded.view(torch.uint8) != want_q.view(torch.uint8)).float().mean() > 1e-3
