"""Fuzzing plans: random ragged batches over shuffled page tables, through build_plan pinned to each
paged-logits backend this machine can run for the key, against the torch reference scoring every token
on its own. The error is one relative number over the visible positions; the -inf pattern must match.

Without a GPU the Triton backends run under the interpreter (exact fp32, so 1e-5, and slow: few
examples, small shapes); on a GPU Hopper's fp8 dot needs 1e-3.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.contract.paged_cache import build_paged_kv_cache
from dispatch.contract.kv_cache import BLOCK_KV
from dispatch.contract.backend import PAGED_MODES
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.key import FP8_MAX, Arch, DispatchKey, ForwardMode, Fp8Dtype, Op, arch_can_hold
from dispatch.contract.ops import paged_mqa_logits
from dispatch.step.paged_plan import PagedBatch, build_plan
from dispatch.deciding.runtime import DEFAULT_REGISTRY, load_dispatcher, load_plugins
from tests.support.paged_batch import PagedCase, expected_logits

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TOLERANCE = 1e-3 if ON_GPU else 1e-5
# The interpreter gets the smallest shape the Triton kernel takes (powers of two, H >= 16, D >= 32); a GPU
# gets the model's, which the DeepGEMM kernels require.
HEADS, HEAD_DIM = (64, 128) if ON_GPU else (16, 32)
DISPATCHER = load_dispatcher(DEFAULT_REGISTRY, plugins=load_plugins(frozenset()))
HERE = DISPATCHER.target_arch
CPU_BACKENDS = {
    Fp8Dtype.E4M3FN: {"torch.reference", "torch.reference.flatten", "triton", "triton.flatten"},
    Fp8Dtype.E4M3FNUZ: {"torch.reference", "torch.reference.flatten", "rocm.fnuz"},
}
# Random garbage scales in unused blocks overflow in the interpreter's numpy; they are masked.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@st.composite
def ragged_batches(draw):
    """(seq_lens, next_n, forward_mode, extra_blocks, padding_pages, seed)."""
    next_n = draw(st.integers(1, 8))
    modes = sorted(m.value for m in PAGED_MODES if m is not ForwardMode.DECODE or next_n == 1)
    # A request holds at least the next_n tokens it scores (PagedBatch refuses shorter ones);
    # exactly next_n leaves its first token one visible key.
    length = st.one_of(
        st.integers(next_n, 3 * BLOCK_KV + 10),
        st.sampled_from([next_n, BLOCK_KV, 2 * BLOCK_KV, 3 * BLOCK_KV]),
    )
    return (
        draw(st.lists(length, min_size=1, max_size=6)),
        next_n,
        draw(st.sampled_from(modes)),
        draw(st.integers(1, 3)),
        draw(st.integers(0, 2)),
        draw(st.integers(0, 2**16)),
    )


def paged_inputs(seq_lens, next_n, fp8, extra_blocks, padding_pages, seed) -> PagedCase:
    generator = torch.Generator().manual_seed(seed)
    keys = [torch.randn(length, HEAD_DIM, generator=generator) for length in seq_lens]
    cache, table = build_paged_kv_cache(keys, fp8, extra_blocks=extra_blocks, generator=generator)
    # Engines pad tables with whatever block; padding past a request's pages must never be read.
    padding = torch.randint(0, cache.shape[0], (len(seq_lens), padding_pages), generator=generator)
    table = torch.cat([table, padding.to(torch.int32)], dim=1)
    tokens = len(seq_lens) * next_n
    fp8_max = FP8_MAX[fp8]
    q = (torch.randn(tokens, HEADS, HEAD_DIM, generator=generator) * fp8_max / 3).clamp(-fp8_max, fp8_max)
    return PagedCase(
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        page_table=table.to(DEVICE),
        kv_cache=cache.to(DEVICE),
        q_tokens=q.to(torch_dtype(fp8)).to(DEVICE),
        weights=torch.randn(tokens, HEADS, generator=generator).to(DEVICE),
        next_n=next_n,
    )


def runnable_backends(key: DispatchKey) -> list[str]:
    """Every paged-logits backend that is available here and supports `key`, disabled or not."""
    return [
        b.name
        for b in DISPATCHER.catalog.for_op(Op.PAGED_MQA_LOGITS)
        if b.availability().ok and b.supports.why_not(key) is None
    ]


def assert_agrees(out: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    assert out.shape == ref.shape and out.dtype == torch.float32, name
    assert not torch.isnan(out).any(), f"{name}: NaN in the output"
    assert torch.equal(torch.isinf(out), torch.isinf(ref)), f"{name}: -inf pattern differs from the reference"
    assert (out[torch.isinf(out)] < 0).all(), f"{name}: masked positions must be -inf"
    visible = torch.isfinite(ref)
    if visible.any():
        error = ((out[visible] - ref[visible]).norm() / ref[visible].norm().clamp(min=1e-30)).item()
        assert error < TOLERANCE, f"{name}: relative error {error:.3e} >= {TOLERANCE:.0e}"


@pytest.mark.parametrize("fp8", [d for d in Fp8Dtype if arch_can_hold(HERE, d)], ids=lambda d: d.value)
@settings(max_examples=15, deadline=None)
@given(case=ragged_batches())
def test_every_runnable_backend_agrees_with_the_reference(fp8, case):
    seq_lens, next_n, mode, extra_blocks, padding_pages, seed = case
    inputs = paged_inputs(seq_lens, next_n, fp8, extra_blocks, padding_pages, seed)
    batch = PagedBatch(inputs.seq_lens, inputs.page_table, max(seq_lens), ForwardMode(mode), next_n)
    names = runnable_backends(DispatchKey(HERE, mode, next_n, fp8))
    assert {"torch.reference", "torch.reference.flatten"} <= set(names)
    if HERE is Arch.CPU:  # a probe that stopped finding the interpreter would leave only the reference
        assert set(names) == CPU_BACKENDS[fp8]
    reference = expected_logits(inputs)
    for name in names:
        plan = build_plan(DISPATCHER, batch, kv_fp8_dtype=fp8, pinned={Op.PAGED_MQA_LOGITS: name}, allow_disabled=True)
        assert plan.logits.backend == name
        out = paged_mqa_logits(plan, inputs.q_tokens, inputs.kv_cache, inputs.weights)
        assert_agrees(out, reference, name)
