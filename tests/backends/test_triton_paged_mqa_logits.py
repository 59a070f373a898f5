"""The Triton paged MQA logits kernel against the torch reference, on fresh random inputs.

Error is one relative number, ||out - ref|| / ||ref|| over the visible positions; the -inf pattern
must match exactly and no NaN may appear. Without a GPU these run under the Triton interpreter
(exact fp32 accumulation, so 1e-5); on a GPU Hopper's fp8 accumulation needs 1e-3.
"""

from __future__ import annotations

import math

import pytest
import torch

from dispatch.contract.paged_cache import build_paged_kv_cache
from backends.reference.paged_mqa_logits import reference_paged_mqa_logits as reference_logits
from backends.triton import availability, plugin
from backends.triton.fp8_mode import Fp8Mode, fnuz_mode_for_here
from backends.triton.paged_mqa_logits import LaunchConfig, default_config, triton_paged_mqa_logits
from dispatch.contract.errors import LayoutError
from dispatch.contract import check_logits_inputs
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.key import FP8_MAX, Arch, Fp8Dtype, Op
from dispatch.contract.layout import Layout
from tests.support.plans import plan_for

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TOLERANCE = 1e-3 if ON_GPU else 1e-5
BACKENDS = {backend.name: backend for backend in plugin.logits_backends()}
# Random garbage scales past a request's tokens overflow in the interpreter's numpy; they are masked.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def make_case(seq_lens, next_n, backend, *, heads=64, head_dim=128, fp8_dtype=Fp8Dtype.E4M3FN, extra_pages=0, seed=0):
    """(plan, q in the plan's layout, kv_cache, weights) on DEVICE, for requests of total lengths `seq_lens`.

    Table entries past each request's pages hold an out-of-range block index, so a kernel that looks
    one up reads out of bounds; `extra_pages` widens max_context_len past every length.
    """
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(length, head_dim, generator=gen) for length in seq_lens]
    cache, table = build_paged_kv_cache(keys, fp8_dtype, extra_blocks=4, generator=gen)
    max_len = max(seq_lens) + extra_pages * 64
    pages = max(math.ceil(max_len / 64), table.shape[1])
    poisoned = torch.full((len(seq_lens), pages), 1 << 30, dtype=torch.int32)
    for request, length in enumerate(seq_lens):
        used = math.ceil(length / 64)
        poisoned[request, :used] = table[request, :used]
    fp8_max = FP8_MAX[fp8_dtype]
    q_tokens = (torch.randn(len(seq_lens) * next_n, heads, head_dim, generator=gen) * fp8_max / 3).clamp(-fp8_max, fp8_max)
    weights = torch.randn(len(seq_lens) * next_n, heads, generator=gen)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    plan = plan_for(backend, seq, poisoned.to(DEVICE), next_n, fp8_dtype=fp8_dtype, max_seq_len=max(max_len, 1))
    q = plan.q_in_layout(q_tokens.to(torch_dtype(fp8_dtype)).to(DEVICE))
    return plan, q, cache.to(DEVICE), weights.to(DEVICE)


def reference_for(plan, q, cache, weights):
    # Table entries past each request's pages are padding the reference never follows.
    return reference_logits(q, cache, weights, plan.context_lens, plan.block_table, plan.max_context_len, plan.fp8_dtype)


def assert_close(out, ref, tolerance=TOLERANCE):
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert not torch.isnan(out).any(), "NaN in the output"
    assert torch.equal(torch.isinf(out), torch.isinf(ref)), "-inf pattern differs from the reference"
    assert torch.equal(out[torch.isinf(out)], ref[torch.isinf(ref)]), "masked positions must be -inf"
    visible = torch.isfinite(ref)
    if visible.any():
        error = ((out[visible] - ref[visible]).norm() / ref[visible].norm()).item()
        assert error < tolerance, f"relative error {error:.3e} >= {tolerance:.0e}"


# (seq_lens, next_n): ragged, shorter than next_n, exact multiples of 64, zero.
CASES = [
    ([100, 64, 1], 1),
    ([0, 130], 1),
    ([200, 3, 128], 2),
    ([65, 2, 192], 3),
    ([128, 1, 250], 4),
    ([0, 4, 64], 4),
    ([90, 300], 5),
    ([6, 129], 6),
    ([257, 7], 7),
    ([3, 320, 64], 8),
]


@pytest.mark.parametrize("layout", [Layout.NATIVE, Layout.FLATTEN])
@pytest.mark.parametrize("seq_lens,next_n", CASES)
def test_matches_reference(seq_lens, next_n, layout):
    backend = BACKENDS["triton" if layout is Layout.NATIVE else "triton.flatten"]
    plan, q, cache, weights = make_case(seq_lens, next_n, backend, seed=next_n)
    assert_close(backend.run(plan, q, cache, weights), reference_for(plan, q, cache, weights))


@pytest.mark.parametrize(
    "config",
    [
        LaunchConfig(tokens=1, pages=1, programs_per_sm=1),
        LaunchConfig(tokens=2, pages=2, programs_per_sm=2),
        LaunchConfig(tokens=4, pages=1, programs_per_sm=3),
        LaunchConfig(tokens=8, pages=1, programs_per_sm=8, num_warps=8),
        LaunchConfig(tokens=1, pages=4, programs_per_sm=5, num_warps=8),
        LaunchConfig(tokens=2, pages=1, programs_per_sm=40),  # more programs than pages: most own nothing
        LaunchConfig(tokens=8, pages=2, programs_per_sm=2),  # next_n 6: two of the 8 token slots padding
    ],
)
def test_launch_configs_agree(config):
    """Token groups, pages per step and the program count change the schedule, never the result."""
    plan, q, cache, weights = make_case([70, 5, 400], 6, BACKENDS["triton"], extra_pages=2, seed=11)
    out = triton_paged_mqa_logits(
        q, cache, weights, plan.context_lens, plan.block_table, plan.max_context_len, plan.fp8_dtype, config=config
    )
    assert_close(out, reference_for(plan, q, cache, weights))


def test_width_past_every_length_is_all_minus_inf():
    plan, q, cache, weights = make_case([70, 10], 2, BACKENDS["triton"], extra_pages=3, seed=3)
    out = BACKENDS["triton"].run(plan, q, cache, weights)
    assert_close(out, reference_for(plan, q, cache, weights))
    assert torch.isneginf(out[:, 70:]).all()


def test_every_element_is_written():
    plan, q, cache, weights = make_case([150, 40], 3, BACKENDS["triton"], extra_pages=1, seed=4)
    out = torch.full((6, plan.max_context_len), float("nan"), device=DEVICE)
    triton_paged_mqa_logits(
        q, cache, weights, plan.context_lens, plan.block_table, plan.max_context_len, plan.fp8_dtype, out=out
    )
    assert_close(out, reference_for(plan, q, cache, weights))


@pytest.mark.parametrize("layout", [Layout.NATIVE, Layout.FLATTEN])
@pytest.mark.parametrize("seq_lens,next_n", [([150, 40, 0], 3), ([70, 300], 1), ([6, 129], 6)])
def test_without_clean_logits_the_visible_keys_are_unchanged(seq_lens, next_n, layout):
    """clean_logits=False: every visible logit as with it, and the pages past a token group's longest
    length are not written (the fill is what the flag saves); nothing outside the buffer either."""
    backend = BACKENDS["triton" if layout is Layout.NATIVE else "triton.flatten"]
    plan, q, cache, weights = make_case(seq_lens, next_n, backend, extra_pages=2, seed=next_n)
    clean = backend.run(plan, q, cache, weights)
    sentinel = 7.25
    out = torch.full((len(seq_lens) * next_n, plan.max_context_len), sentinel, device=DEVICE)
    triton_paged_mqa_logits(q, cache, weights, plan.context_lens, plan.block_table, plan.max_context_len,
                            plan.fp8_dtype, out=out, clean_logits=False)
    lengths = plan.token_lengths.cpu().long()
    columns = torch.arange(plan.max_context_len)[None, :]
    visible = columns < lengths[:, None]
    # Exact: one kernel, same inputs; clean_logits only changes what is written past the lengths.
    assert torch.equal(out.cpu()[visible], clean.cpu()[visible])
    # Past the widest request's last compute step (PAGES pages of 64 keys): never written.
    step = default_config(next_n, torch.device(DEVICE)).pages * 64
    last_page_end = -(-max(seq_lens) // step) * step
    assert (out.cpu()[:, last_page_end:] == sentinel).all()


def test_nan_bytes_past_a_length_are_masked():
    """Keys and scales past a request's last token decode to NaN; the select must hide them."""
    plan, q, cache, weights = make_case([100, 30], 2, BACKENDS["triton"], seed=5)
    flat = cache.view(cache.shape[0], -1)
    for request, length in enumerate([100, 30]):
        block = int(plan.block_table[request, length // 64])
        slot = length % 64
        flat[block, slot * 128 : 64 * 128] = 0x7F  # e4m3fn NaN
        flat[block, 64 * 128 + slot * 4 :] = 0xFF  # fp32 NaN
    assert_close(BACKENDS["triton"].run(plan, q, cache, weights), reference_for(plan, q, cache, weights))


@pytest.mark.parametrize("heads,head_dim", [(32, 64), (16, 256)])
def test_other_head_shapes(heads, head_dim):
    plan, q, cache, weights = make_case([90, 200], 3, BACKENDS["triton"], heads=heads, head_dim=head_dim, seed=6)
    assert_close(BACKENDS["triton"].run(plan, q, cache, weights), reference_for(plan, q, cache, weights))


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
@pytest.mark.parametrize("seq_lens,next_n", [([100, 3, 64], 2), ([260, 0], 4)])
def test_fnuz_modes(mode, seq_lens, next_n):
    plan, q, cache, weights = make_case(seq_lens, next_n, BACKENDS["rocm.fnuz"], fp8_dtype=Fp8Dtype.E4M3FNUZ, seed=7)
    out = triton_paged_mqa_logits(
        q, cache, weights, plan.context_lens, plan.block_table, plan.max_context_len, plan.fp8_dtype, fnuz_mode=mode
    )
    assert_close(out, reference_for(plan, q, cache, weights))


def test_rocm_fnuz_backend_runs_with_the_machines_mode():
    plan, q, cache, weights = make_case([80, 5], 2, BACKENDS["rocm.fnuz"], fp8_dtype=Fp8Dtype.E4M3FNUZ, seed=8)
    assert_close(BACKENDS["rocm.fnuz"].run(plan, q, cache, weights), reference_for(plan, q, cache, weights))


def test_fnuz_mode_here_is_emulated_off_gfx94x():
    if getattr(torch.version, "hip", None):
        pytest.skip("ROCm machine: the mode depends on the GPU")
    assert fnuz_mode_for_here() is Fp8Mode.FNUZ_EMULATED


def test_wrong_layout_raises():
    native = BACKENDS["triton"]
    plan, q, cache, weights = make_case([70, 20], 2, native, seed=9)
    # The host runs these checks against the decision's layout before any backend (the op's call,
    # dispatch/contract/ops/paged_logits.py); a backend handed another layout's tensors is refused there.
    with pytest.raises(LayoutError, match="native"):
        check_logits_inputs(plan, q.reshape(4, 1, *q.shape[2:]), cache, weights, consumes=native.layout)
    flat_plan, flat_q, _, _ = make_case([70, 20], 2, BACKENDS["triton.flatten"], seed=9)
    with pytest.raises(LayoutError, match="consumes layout `native`; the plan is tagged `flatten`"):
        check_logits_inputs(flat_plan, flat_q, cache, weights, consumes=native.layout)


def test_wrapper_rejects_bad_tensors():
    plan, q, cache, weights = make_case([70, 20], 2, BACKENDS["triton"], seed=10)
    args = (plan.context_lens, plan.block_table, plan.max_context_len, plan.fp8_dtype)
    with pytest.raises(LayoutError, match="weights"):
        triton_paged_mqa_logits(q, cache, weights.double(), *args)
    with pytest.raises(LayoutError, match="block_table"):
        triton_paged_mqa_logits(q, cache, weights, plan.context_lens, plan.block_table[:, :1], 200, plan.fp8_dtype)
    with pytest.raises(LayoutError, match="kv_cache"):
        triton_paged_mqa_logits(q, cache[:, :, :, :100], weights, *args)
    with pytest.raises(LayoutError, match="q has dtype"):
        triton_paged_mqa_logits(q, cache, weights, *args[:3], Fp8Dtype.E4M3FNUZ)


def test_probe_reasons(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name == "triton":
            raise ImportError("No module named 'triton'")
        return real_import(name, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(builtins, "__import__", no_triton)
        reason = availability.probe_for(availability.TRITON_ARCHS)().reason
    assert reason == "triton is not importable: No module named 'triton'"

    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        patch.delenv("TRITON_INTERPRET", raising=False)
        assert "TRITON_INTERPRET" in availability.probe_for(availability.TRITON_ARCHS)().reason

    with monkeypatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        patch.setattr(availability, "detect_arch", lambda: Arch.SM80)
        result = availability.probe_for(availability.TRITON_ARCHS)()
    assert not result.ok and "arch sm80 is not among the declared archs" in result.reason


def test_registration_declares_the_contract():
    registered = []
    plugin.register_backends(registered.append)
    by_name = {b.name: b for b in registered if b.op is Op.PAGED_MQA_LOGITS}
    assert set(by_name) == {"triton", "triton.flatten", "rocm.fnuz"}
    assert by_name["triton"].layout is Layout.NATIVE and by_name["triton"].supports.next_n_max == 8
    assert by_name["triton.flatten"].layout is Layout.FLATTEN and by_name["triton.flatten"].supports.next_n_max is None
    assert Arch.SM80 not in by_name["triton"].supports.archs
    assert by_name["rocm.fnuz"].supports.fp8_dtypes == frozenset({Fp8Dtype.E4M3FNUZ})
    assert by_name["rocm.fnuz"].supports.archs == frozenset({Arch.GFX942, Arch.CPU})


# Serving shapes: GPU only.


def serving_lengths(batch, low, high, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (batch,), generator=gen).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [Layout.NATIVE, Layout.FLATTEN])
@pytest.mark.parametrize("batch,next_n,low,high", [(32, 1, 8192, 32768), (32, 4, 8192, 32768), (128, 2, 8192, 16384)])
def test_serving_shapes(batch, next_n, low, high, layout):
    backend = BACKENDS["triton" if layout is Layout.NATIVE else "triton.flatten"]
    plan, q, cache, weights = make_case(serving_lengths(batch, low, high, next_n), next_n, backend, seed=next_n)
    assert_close(backend.run(plan, q, cache, weights), reference_for(plan, q, cache, weights))


@pytest.mark.gpu
@pytest.mark.parametrize("name,next_n", [("triton", 1), ("triton", 4), ("triton.flatten", 4)])
def test_per_layer_call_does_not_sync(name, next_n):
    backend = BACKENDS[name]
    plan, q, cache, weights = make_case(serving_lengths(8, 1000, 5000, 0), next_n, backend)
    backend.run(plan, q, cache, weights)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.run(plan, q, cache, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
