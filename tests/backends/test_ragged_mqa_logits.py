"""The ragged (extend) MQA logits: the torch reference against the formula read another way, and the
Triton kernel against the reference, on fresh random extend batches.

Error is one relative number, ||out - ref|| / ||ref|| over the visible positions; the -inf pattern
must match exactly and no NaN may appear. Under the Triton interpreter (no GPU) accumulation is exact
fp32, so 1e-5; on a GPU Hopper's fp8 accumulation needs 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from backends.adapted_topk import aligned_rows
from backends.reference.ragged_mqa_logits import reference_ragged_mqa_logits as reference_logits
from backends.triton.fp8_mode import Fp8Mode
from backends.triton.ragged_mqa_logits import LaunchConfig, triton_ragged_mqa_logits
from dispatch.contract.errors import DtypeMismatchError, LayoutError
from dispatch.contract.key import Fp8Dtype
from dispatch.contract.layout import ROW_UNIT_FLOATS
from tests.support.extend_batch import extend_case

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TOLERANCE = 1e-3 if ON_GPU else 1e-5
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def assert_close(out, ref, tolerance=TOLERANCE):
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert not torch.isnan(out).any(), "NaN in the output"
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), "-inf pattern differs from the reference"
    visible = torch.isfinite(ref)
    if visible.any():
        error = ((out[visible] - ref[visible]).norm() / ref[visible].norm()).item()
        assert error < tolerance, f"relative error {error:.3e} >= {tolerance:.0e}"


def second_opinion(q, k, scales, weights, ks, ke):
    """DeepGEMM's test reference (tests/test_attention.py), in this project's words: the per-key scale
    is folded into the keys before the product, scores are laid out heads first, and the mask is
    applied with masked_fill. Since scales are positive, relu(q.k) * s == relu(q.(k s))."""
    keys = k.shape[0]
    k_scaled = k.float() * scales[:, None]
    score = torch.einsum("mhd,nd->hmn", q.float(), k_scaled)
    logits = (score.relu() * weights.T[:, :, None]).sum(dim=0)
    column = torch.arange(keys, device=q.device)[None, :]
    inside = (column >= ks[:, None]) & (column < ke[:, None])
    return logits.masked_fill(~inside, float("-inf"))


def run_case(case, **kwargs):
    k, scales = case.gathered()
    m = case.metadata
    return triton_ragged_mqa_logits(case.q, k, scales, case.weights, m.ks, m.ke, **kwargs), (k, scales)


# (prefix_lens, extend_lens): no prefix; a prefix; one-token extends; very different lengths; a request
# with no new tokens between two; page-boundary lengths.
CASES = [
    ([0], [37]),
    ([100], [20]),
    ([0, 0, 0], [1, 1, 1]),
    ([130, 5, 64], [1, 1, 1]),
    ([300, 0, 7], [3, 40, 1]),
    ([64, 50], [0, 14]),
    ([2, 190, 0, 63], [62, 2, 129, 1]),
]


@pytest.mark.parametrize("prefix_lens,extend_lens", CASES)
def test_reference_agrees_with_deepgemms_formulation(prefix_lens, extend_lens):
    case = extend_case(prefix_lens, extend_lens, seed=len(prefix_lens))
    k, scales = case.gathered()
    m = case.metadata
    args = (case.q, k, scales, case.weights, m.ks, m.ke)
    assert_close(reference_logits(*args), second_opinion(*args), tolerance=1e-5)


@pytest.mark.parametrize("prefix_lens,extend_lens", CASES)
def test_matches_reference(prefix_lens, extend_lens):
    case = extend_case(prefix_lens, extend_lens, device=DEVICE, seed=sum(extend_lens))
    out, (k, scales) = run_case(case)
    m = case.metadata
    assert_close(out, reference_logits(case.q, k, scales, case.weights, m.ks, m.ke))


@pytest.mark.parametrize("pattern", ["causal_tail", "context_parallel"])
def test_deepgemm_test_patterns(pattern):
    """The two ks / ke patterns DeepGEMM tests with: a causal tail over all keys, and the two chunks of a
    context-parallel rank (rows of the first half see a short prefix, of the second a long one)."""
    rows, keys = 48, 192
    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(rows, 64, 128, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    k = torch.randn(keys, 128, generator=gen).to(torch.float8_e4m3fn)
    scales = torch.rand(keys, generator=gen) + 0.01
    weights = torch.randn(rows, 64, generator=gen)
    ks = torch.zeros(rows, dtype=torch.int32)
    if pattern == "causal_tail":
        ke = torch.arange(rows, dtype=torch.int32) + (keys - rows)
    else:
        half, ranks = rows // 2, keys // rows
        rank = ranks // 3
        j = torch.arange(half, dtype=torch.int32)
        ke = torch.cat([rank * half + j, (2 * ranks - 1 - rank) * half + j])
    args = [t.to(DEVICE) for t in (q, k, scales, weights, ks, ke)]
    ref = reference_logits(*args)
    assert_close(ref, second_opinion(*args), tolerance=1e-5)
    assert_close(triton_ragged_mqa_logits(*args), ref)


@pytest.mark.parametrize(
    "config",
    [
        LaunchConfig(rows=1, keys=16, fill=16, num_stages=1),
        LaunchConfig(rows=2, keys=32, fill=64, num_stages=1),
        LaunchConfig(rows=4, keys=64, fill=1024, num_stages=2),
        LaunchConfig(rows=16, keys=128, fill=32, num_warps=8, num_stages=1),
    ],
)
def test_launch_configs_agree(config):
    """Row tiles (some spanning two requests), key blocks and fill widths change the schedule only."""
    case = extend_case([70, 0, 200], [9, 30, 3], device=DEVICE, seed=11)
    out, (k, scales) = run_case(case, config=config)
    m = case.metadata
    assert_close(out, reference_logits(case.q, k, scales, case.weights, m.ks, m.ke))


def test_any_ranges_are_clipped_to_the_buffer():
    """Empty, reversed, negative and past-the-end ranges: the kernel clips them to [0, S), as the
    formula does, and reads no key outside the buffer."""
    rows, keys = 40, 150
    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(rows, 16, 32, generator=gen) * 50).to(torch.float8_e4m3fn)
    k = torch.randn(keys, 32, generator=gen).to(torch.float8_e4m3fn)
    scales = torch.rand(keys, generator=gen) + 0.01
    weights = torch.randn(rows, 16, generator=gen)
    ks = torch.randint(-50, 200, (rows,), generator=gen, dtype=torch.int32)
    ke = torch.randint(-50, 220, (rows,), generator=gen, dtype=torch.int32)
    args = [t.to(DEVICE) for t in (q, k, scales, weights, ks, ke)]
    assert_close(triton_ragged_mqa_logits(*args, config=LaunchConfig(rows=4, keys=32, fill=64)), reference_logits(*args))


def test_rows_are_readable_in_16_byte_units_so_an_engines_top_k_needs_no_copy():
    case = extend_case([90, 3], [17, 22], device=DEVICE, seed=4)
    k, scales = case.gathered()
    m = case.metadata
    keep = m.total_keys - 1  # a key count that is not a multiple of ROW_UNIT_FLOATS
    assert keep % ROW_UNIT_FLOATS
    ke = m.ke.clamp(max=keep)
    ks = torch.minimum(m.ks, ke)
    out = triton_ragged_mqa_logits(case.q, k[:keep], scales[:keep], case.weights, ks, ke)
    assert tuple(out.shape) == (m.total_tokens, keep)
    assert aligned_rows(out, ROW_UNIT_FLOATS) is out
    assert_close(out, reference_logits(case.q, k[:keep], scales[:keep], case.weights, ks, ke))


def test_every_element_is_written():
    case = extend_case([90, 3], [17, 22], device=DEVICE, seed=4)
    k, scales = case.gathered()
    m = case.metadata
    out = torch.full((m.total_tokens, m.total_keys + 5), float("nan"), device=DEVICE)[:, : m.total_keys]
    triton_ragged_mqa_logits(case.q, k, scales, case.weights, m.ks, m.ke, out=out)
    assert_close(out, reference_logits(case.q, k, scales, case.weights, m.ks, m.ke))


def test_without_clean_logits_only_scored_blocks_are_written():
    """clean_logits=False: every visible logit is right, columns no tile scores keep what out held."""
    case = extend_case([200, 0], [5, 60], device=DEVICE, seed=13)
    k, scales = case.gathered()
    m = case.metadata
    out = torch.full((m.total_tokens, m.total_keys), float("nan"), device=DEVICE)
    triton_ragged_mqa_logits(case.q, k, scales, case.weights, m.ks, m.ke, clean_logits=False, out=out,
                      config=LaunchConfig(rows=4, keys=32))
    ref = reference_logits(case.q, k, scales, case.weights, m.ks, m.ke)
    visible = torch.isfinite(ref)
    error = ((out[visible] - ref[visible]).norm() / ref[visible].norm()).item()
    assert error < TOLERANCE
    # Tiles of 4 rows: rows 0-3 are request 0's alone, rows 8+ request 1's alone (4-7 mix both).
    assert torch.isnan(out[:4, 224:]).all()  # request 0's tile never scores request 1's keys
    assert torch.isnan(out[8:, :192]).all()  # nor request 1's tiles request 0's


def test_nan_keys_of_another_request_stay_hidden():
    """Request 0's keys decode to NaN; request 1's rows, tiled together with request 0's, stay finite."""
    case = extend_case([10, 40], [3, 9], device=DEVICE, seed=6)
    k, scales = case.gathered()
    k, scales = k.clone(), scales.clone()
    k.view(torch.uint8)[:13] = 0x7F  # e4m3fn NaN
    scales[:13] = float("nan")
    m = case.metadata
    out = triton_ragged_mqa_logits(case.q, k, scales, case.weights, m.ks, m.ke, config=LaunchConfig(rows=8, keys=16))
    ref = reference_logits(case.q, k, scales, case.weights, m.ks, m.ke)
    # Request 0's own rows are NaN inside their ranges (the poison shows) and -inf outside.
    inside = torch.isfinite(reference_logits(case.q, *case.gathered(), case.weights, m.ks, m.ke))[:3]
    assert torch.isnan(out[:3][inside]).all() and torch.isneginf(out[:3][~inside]).all()
    assert_close(out[3:], ref[3:])


@pytest.mark.parametrize(
    "mode",
    [
        Fp8Mode.FNUZ_EMULATED,
        pytest.param(
            Fp8Mode.FNUZ_NATIVE,
            marks=pytest.mark.skipif(ON_GPU, reason="tl.float8e4b8 compiles for gfx94x and the interpreter only"),
        ),
    ],
)
@pytest.mark.parametrize("prefix_lens,extend_lens", [([0, 77], [21, 5]), ([140], [1])])
def test_fnuz_modes(mode, prefix_lens, extend_lens):
    case = extend_case(prefix_lens, extend_lens, fp8_dtype=Fp8Dtype.E4M3FNUZ, device=DEVICE, seed=7)
    out, (k, scales) = run_case(case, fnuz_mode=mode)
    assert k.dtype == torch.float8_e4m3fnuz
    m = case.metadata
    assert_close(out, reference_logits(case.q, k, scales, case.weights, m.ks, m.ke))


def test_chunks_reproduce_the_whole_batch():
    """Row chunks on their own key windows give the same logits as one call over every key: the same -inf
    pattern and the same values to 1e-6 relative (not bit for bit: the interpreter's dot is numpy's matmul,
    whose BLAS may sum a block in another order for other operand addresses; seen on a CI CPU, AVX2)."""
    case = extend_case([100, 20, 0], [30, 50, 40], device=DEVICE, seed=8)
    k, scales = case.gathered()
    m = case.metadata
    whole = triton_ragged_mqa_logits(case.q, k, scales, case.weights, m.ks, m.ke)
    chunks = m.chunks(byte_budget=60 * 4 * 64)
    assert len(chunks) > 2
    for chunk in chunks:
        ks, ke = m.chunk_ranges(chunk)
        part = triton_ragged_mqa_logits(case.q[chunk.rows], k[chunk.keys], scales[chunk.keys], case.weights[chunk.rows],
                                 ks, ke)
        assert_close(part, whole[chunk.rows, chunk.keys], tolerance=1e-6)
        outside = torch.ones(m.total_keys, dtype=torch.bool, device=DEVICE)
        outside[chunk.keys] = False
        assert torch.isneginf(whole[chunk.rows][:, outside]).all()


def test_wrapper_rejects_bad_tensors():
    case = extend_case([20], [10], device=DEVICE, seed=9)
    k, scales = case.gathered()
    m = case.metadata
    q, w = case.q, case.weights
    with pytest.raises(DtypeMismatchError, match="k has dtype"):
        triton_ragged_mqa_logits(q, k.view(torch.float8_e4m3fnuz), scales, w, m.ks, m.ke)
    with pytest.raises(DtypeMismatchError, match="q has dtype"):
        triton_ragged_mqa_logits(q.view(torch.int8), k.view(torch.int8), scales, w, m.ks, m.ke)
    with pytest.raises(LayoutError, match="weights"):
        triton_ragged_mqa_logits(q, k, scales, w.double(), m.ks, m.ke)
    with pytest.raises(LayoutError, match="scales"):
        triton_ragged_mqa_logits(q, k, scales[:-1], w, m.ks, m.ke)
    with pytest.raises(LayoutError, match="ke"):
        triton_ragged_mqa_logits(q, k, scales, w, m.ks, m.ke.long())
    with pytest.raises(LayoutError, match="k must be"):
        triton_ragged_mqa_logits(q, k[:, :64], scales, w, m.ks, m.ke)
    with pytest.raises(LayoutError, match="q must be"):
        triton_ragged_mqa_logits(q[None], k, scales, w, m.ks, m.ke)
    with pytest.raises(LayoutError, match="out must be"):
        triton_ragged_mqa_logits(q, k, scales, w, m.ks, m.ke, out=torch.empty(3, 3, device=DEVICE))


def test_empty_sides():
    q = torch.zeros(0, 16, 32, dtype=torch.float8_e4m3fn, device=DEVICE)
    k = torch.zeros(5, 32, dtype=torch.float8_e4m3fn, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    out = triton_ragged_mqa_logits(q, k, torch.ones(5, device=DEVICE), torch.zeros(0, 16, device=DEVICE), none, none)
    assert out.shape == (0, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("prefix_lens,extend_lens", [([0, 3000, 12000], [1024, 2048, 1024]), ([15000], [4096])])
def test_extend_shapes_on_gpu(prefix_lens, extend_lens):
    case = extend_case(prefix_lens, extend_lens, device="cuda", seed=12)
    out, (k, scales) = run_case(case)
    m = case.metadata
    assert_close(out, reference_logits(case.q, k, scales, case.weights, m.ks, m.ke), tolerance=1e-3)
