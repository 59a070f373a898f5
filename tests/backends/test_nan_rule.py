"""NaN and inf give one defined result on every backend (torch.reference, triton, rocm.fnuz emulated
and, under the interpreter, native):

- Q quant: a head vector holding NaN or inf (after RoPE) gets the format's NaN byte (e4m3fn 0x7F, fnuz
  0x80) in every dim and a NaN folded weight; every other vector is unaffected.
- Logits: a NaN q element or weight makes its token's logit NaN at every visible key; a NaN key byte, or
  a non-finite key scale, makes that key's logit NaN for every token that sees it. Positions past a
  token's length stay -inf whatever the bytes hold.
"""

from __future__ import annotations

import pytest
import torch

from dispatch.contract.paged_cache import build_paged_kv_cache
from backends.reference.paged_mqa_logits import reference_paged_mqa_logits as reference_logits
from backends.reference.q_quant import NAN_BYTE, reference_indexer_q_quant as reference_quant
from backends.triton.fp8_mode import Fp8Mode
from backends.triton.paged_mqa_logits import triton_paged_mqa_logits as triton_logits
from backends.triton.q_quant import triton_indexer_q_quant as triton_quant
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.key import Fp8Dtype
from dispatch.step.paged_plan import layout_tensors
from dispatch.contract.layout import Layout
from dispatch.contract.rope import RopeSpec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
# The Triton kernels run where the suite runs: compiled on a GPU, under the interpreter on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NATIVE_FNUZ = pytest.mark.skipif(
    DEVICE == "cuda" and torch.version.hip is None,
    reason="tl.float8e4b8 does not compile on NVIDIA GPUs; native fnuz is the gfx94x path, checked under the "
    "CPU interpreter",
)
# (name, fp8 dtype, the Triton fnuz mode or None for the torch reference / e4m3fn)
QUANT_BACKENDS = [
    pytest.param(Fp8Dtype.E4M3FN, "triton", None, id="triton"),
    pytest.param(Fp8Dtype.E4M3FNUZ, "triton", Fp8Mode.FNUZ_EMULATED, id="rocm.fnuz-emulated"),
    pytest.param(Fp8Dtype.E4M3FNUZ, "triton", Fp8Mode.FNUZ_NATIVE, id="rocm.fnuz-native", marks=NATIVE_FNUZ),
    pytest.param(Fp8Dtype.E4M3FN, "reference", None, id="torch.reference-e4m3fn"),
    pytest.param(Fp8Dtype.E4M3FNUZ, "reference", None, id="torch.reference-fnuz"),
]
SETTINGS = dict(softmax_scale=128**-0.5, head_scale=64**-0.5)


def quant_inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 8, 128, generator=gen)
    q[1, 2, 3] = float("nan")  # rotary dim for neox-head, rest for gptj-tail
    q[2, 0, 100] = float("inf")  # rest for neox-head, rotary for gptj-tail
    q[3, 5, :] = float("-inf")
    q[4, 7, 70] = 3.0e38  # finite in fp32, inf once rounded to bf16 (through RoPE where it is rotated)
    weights = torch.randn(5, 8, generator=gen)
    angles = torch.arange(64, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, 64, 2) / 64)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch.bfloat16)
    return q, weights, torch.tensor([5, 0, 63, 9, 1]), cache


@pytest.mark.parametrize("fp8_dtype, which, mode", QUANT_BACKENDS)
@pytest.mark.parametrize("rope", [RopeSpec.neox_head(), RopeSpec.gptj_tail()], ids=["neox-head", "gptj-tail"])
def test_q_quant_poisons_exactly_the_non_finite_vectors(fp8_dtype, which, mode, rope):
    q, weights, positions, cache = quant_inputs()
    if which == "reference":
        q_fp8, folded = reference_quant(q, weights, positions, cache, fp8_dtype=fp8_dtype, rope=rope, **SETTINGS)
    else:
        q_fp8, folded = triton_quant(*(t.to(DEVICE) for t in (q, weights, positions, cache)), fp8_dtype=fp8_dtype,
                                     rope=rope, fnuz_mode=mode, **SETTINGS)
        q_fp8, folded = q_fp8.cpu(), folded.cpu()
    poisoned = torch.zeros(5, 8, dtype=torch.bool)
    poisoned[1, 2] = poisoned[2, 0] = poisoned[3, 5] = True
    poisoned[4, 7] = not torch.isfinite(q[4, 7].to(torch.bfloat16)).all()  # 3e38 rounds to bf16 inf
    assert torch.equal(torch.isnan(folded), poisoned)
    assert (q_fp8.view(torch.uint8)[poisoned] == NAN_BYTE[fp8_dtype]).all()
    clean = q.clone()
    clean[poisoned] = 0.0
    want_q, want_w = reference_quant(clean, weights, positions, cache, fp8_dtype=fp8_dtype, rope=rope, **SETTINGS)
    # Exact: Q quant is elementwise and correctly rounded step by step (tests/backends/test_triton_q_quant.py).
    assert torch.equal(q_fp8.view(torch.uint8)[~poisoned], want_q.view(torch.uint8)[~poisoned])
    assert torch.equal(folded[~poisoned], want_w[~poisoned])


# --- logits ---------------------------------------------------------------------------------------

SEQ_LENS, NEXT_N, HEADS, DIM = [130, 70], 2, 16, 32
LOGITS_BACKENDS = [
    pytest.param(Fp8Dtype.E4M3FN, Layout.NATIVE, None, id="triton"),
    pytest.param(Fp8Dtype.E4M3FN, Layout.FLATTEN, None, id="triton.flatten"),
    pytest.param(Fp8Dtype.E4M3FNUZ, Layout.NATIVE, Fp8Mode.FNUZ_EMULATED, id="rocm.fnuz-emulated"),
    pytest.param(Fp8Dtype.E4M3FNUZ, Layout.NATIVE, Fp8Mode.FNUZ_NATIVE, id="rocm.fnuz-native", marks=NATIVE_FNUZ),
]


def logits_case(fp8_dtype: Fp8Dtype, layout: Layout):
    gen = torch.Generator().manual_seed(1)
    keys = [torch.randn(length, DIM, generator=gen) for length in SEQ_LENS]
    cache, table = build_paged_kv_cache(keys, fp8_dtype, generator=gen)
    tokens = len(SEQ_LENS) * NEXT_N
    q = torch.randn(tokens, HEADS, DIM, generator=gen).to(torch_dtype(fp8_dtype))
    weights = torch.randn(tokens, HEADS, generator=gen)
    nan = NAN_BYTE[fp8_dtype]
    q.view(torch.uint8)[1, 3, 7] = nan  # request 0, token 1: a NaN q element
    weights[2, 4] = float("nan")  # request 1, token 0: a NaN weight
    flat = cache.view(cache.shape[0], -1)
    values = 64 * DIM
    block0, block1 = int(table[0, 0]), int(table[1, 1])
    flat[block0, 10 * DIM + 5] = nan  # request 0, key 10: a NaN key byte
    flat[block0, values + 4 * 20 : values + 4 * 21] = torch.tensor([float("inf")]).view(torch.uint8)  # key 20
    flat[block1, values + 4 * 3 : values + 4 * 4] = torch.tensor([float("nan")]).view(torch.uint8)  # r1 key 67
    lens, layout_table = layout_tensors(layout, torch.tensor(SEQ_LENS, dtype=torch.int32), table, NEXT_N)
    rows = tokens if layout is Layout.FLATTEN else len(SEQ_LENS)
    q = q.view(rows, -1, HEADS, DIM)
    return q, cache, weights, lens, layout_table


def expected_nan(lens: torch.Tensor) -> torch.Tensor:
    """The rule, spelled out per token (request-major) and column."""
    width = max(SEQ_LENS)
    lens = lens.reshape(-1)
    cols = torch.arange(width)[None, :]
    visible = cols < lens[:, None]
    nan = torch.zeros(len(lens), width, dtype=torch.bool)
    nan[1] = visible[1]  # NaN q element
    nan[2] = visible[2]  # NaN weight
    for token in (0, 1):  # request 0's keys 10 (NaN byte) and 20 (inf scale)
        nan[token, 10] |= bool(visible[token, 10])
        nan[token, 20] |= bool(visible[token, 20])
    for token in (2, 3):  # request 1's key 67 (NaN scale)
        nan[token, 67] |= bool(visible[token, 67])
    return nan


@pytest.mark.parametrize("fp8_dtype, layout, mode", LOGITS_BACKENDS)
def test_logits_nan_rule_is_the_same_on_every_backend(fp8_dtype, layout, mode):
    q, cache, weights, lens, table = logits_case(fp8_dtype, layout)
    want = reference_logits(q, cache, weights, lens, table, max(SEQ_LENS), fp8_dtype)
    out = triton_logits(*(t.to(DEVICE) for t in (q, cache, weights, lens, table)), max(SEQ_LENS), fp8_dtype,
                        fnuz_mode=mode).cpu()
    nan = expected_nan(lens)
    assert torch.equal(torch.isnan(want), nan), "the torch reference breaks the rule"
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(torch.isneginf(out), torch.isneginf(want))
    finite = torch.isfinite(want)
    error = (out[finite] - want[finite]).norm() / want[finite].norm()
    # The interpreter sums as the reference does; a GPU's tensor-core dot accumulates in its own order.
    assert error < (1e-5 if DEVICE == "cpu" else 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [Layout.NATIVE, Layout.FLATTEN])
def test_logits_nan_rule_on_gpu(layout):
    """On the GPU the e4m3fn dot itself must turn a NaN byte into NaN (the kernel does not look)."""
    q, cache, weights, lens, table = logits_case(Fp8Dtype.E4M3FN, layout)
    want = reference_logits(q, cache, weights, lens, table, max(SEQ_LENS), Fp8Dtype.E4M3FN)
    out = triton_logits(*(t.cuda() for t in (q, cache, weights, lens, table)), max(SEQ_LENS), Fp8Dtype.E4M3FN).cpu()
    assert torch.equal(torch.isnan(out), expected_nan(lens))
    assert torch.equal(torch.isneginf(out), torch.isneginf(want))
    finite = torch.isfinite(want)
    assert (out[finite] - want[finite]).norm() / want[finite].norm() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("rope", [RopeSpec.neox_head(), RopeSpec.gptj_tail()], ids=["neox-head", "gptj-tail"])
def test_q_quant_nan_rule_on_gpu(rope):
    q, weights, positions, cache = quant_inputs()
    q_fp8, folded = triton_quant(q.cuda(), weights.cuda(), positions.cuda(), cache.cuda(), fp8_dtype=Fp8Dtype.E4M3FN,
                                 rope=rope, **SETTINGS)
    want_q, want_w = reference_quant(q, weights, positions, cache, fp8_dtype=Fp8Dtype.E4M3FN, rope=rope, **SETTINGS)
    assert torch.equal(q_fp8.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(torch.isnan(folded.cpu()), torch.isnan(want_w))
    assert torch.equal(folded.cpu().nan_to_num(), want_w.nan_to_num())
