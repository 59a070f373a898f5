"""Regression for the SGLang NextN incident (reverted as #27138): the indexer chose the native path by an
implicit `ctx.shape == (B, next_n)` check on lens that the attention backend had built elsewhere, under
its own condition. Where the two disagree the shape check still passes and the answer is silently wrong.

Here the layout is a tag: the plan builds the lens itself from the request lengths, in the decided
layout, and every backend checks what it is handed against that tag. For batches built to fool a
shape check, the tagged path gives the reference answer (through the DeepGEMM stand-in and the torch
reference backends) or a LayoutError, never a wrong answer.
"""

from __future__ import annotations

import pytest
import torch

from backends.deepgemm.plugin import deepgemm_backends
from backends.reference.paged_mqa_logits import reference_paged_mqa_logits as reference_kernel
from backends.reference.plugin import register_backends as register_reference
from dispatch.contract import check_logits_inputs
from dispatch.contract.errors import LayoutError
from dispatch.contract.key import Arch, DispatchKey, ForwardMode, Fp8Dtype
from dispatch.contract.ops import paged_mqa_logits
from tests.support.fake_deep_gemm import FakeDeepGemm
from tests.support.numerics import CPU_LOGITS_TOLERANCE, assert_logits_match, relative_error
from tests.support.paged_batch import expected_logits, paged_batch
from tests.support.plans import plan_for


def reference_backends():
    seen = []
    register_reference(seen.append)
    return {b.name: b for b in seen if b.op.value == "paged_mqa_logits"}


def tagged_backends():
    """(backend, arch) for every paged logits backend a plan can be tagged with here."""
    fake = FakeDeepGemm(num_sms=4)
    deepgemm = {b.name: b for b in deepgemm_backends(load=lambda: fake)}
    reference = reference_backends()
    return [
        (deepgemm["deepgemm.sm90"], Arch.SM90),
        (deepgemm["deepgemm.sm90.flatten"], Arch.SM90),
        (deepgemm["deepgemm.sm100"], Arch.SM100),
        (reference["torch.reference"], Arch.CPU),
        (reference["torch.reference.flatten"], Arch.CPU),
    ]


def implicit_native(ctx: torch.Tensor, batch_size: int, next_n: int) -> bool:
    """The incident's selector: native whenever the lens happen to have the native shape."""
    return tuple(ctx.shape) == (batch_size, next_n)


def assert_wrong_answer(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Wrong by far more than rounding: other positions masked, or visible logits off by over 1e-2."""
    if torch.equal(torch.isneginf(out), torch.isneginf(expected)):
        visible = torch.isfinite(expected)
        assert relative_error(out[visible], expected[visible]) > 1e-2


def implicit_path(batch, ctx: torch.Tensor) -> torch.Tensor:
    """What the incident's indexer computed once its shape check said native."""
    rows = batch.seq_lens.shape[0]
    q = batch.q_tokens.view(rows, batch.next_n, *batch.q_tokens.shape[1:])
    return reference_kernel(q, batch.kv_cache, batch.weights, ctx, batch.page_table, batch.max_seq_len)


# --- the hazard, shown on the reference kernel ------------------------------------------------------


def test_draft_extend_lens_built_elsewhere_pass_the_shape_check_and_give_a_wrong_answer():
    batch = paged_batch([70, 129, 64], 2)
    # Built by a backend whose own condition (target_verify only) did not cover draft_extend: every
    # draft token gets the full length L, with no causal offset.
    full_length = batch.seq_lens.view(-1, 1).expand(-1, batch.next_n).contiguous()
    assert implicit_native(full_length, 3, 2)
    assert_wrong_answer(implicit_path(batch, full_length), expected_logits(batch))


def test_token_major_lens_pass_the_shape_check_when_batch_size_equals_next_n():
    batch = paged_batch([70, 129], 2)
    lens = torch.tensor([[69, 70], [128, 129]], dtype=torch.int32)
    token_major = lens.t().contiguous()  # [N, B] built by a token-major loop: same shape when B == N
    assert implicit_native(token_major, 2, 2)
    # The native layout against one token at a time: the same sums in another order (tests/support/numerics.py).
    assert_logits_match(implicit_path(batch, lens), expected_logits(batch), tolerance=CPU_LOGITS_TOLERANCE)
    assert_wrong_answer(implicit_path(batch, token_major), expected_logits(batch))


# --- the tagged path -------------------------------------------------------------------------------

CASES = [
    # (seq_lens, next_n, forward_mode): B == next_n, draft_extend with (B, next_n)-shaped tensors, decode
    ([70, 129], 2, ForwardMode.TARGET_VERIFY),
    ([70, 129], 2, ForwardMode.DRAFT_EXTEND),
    ([70, 129, 64], 3, ForwardMode.DRAFT_EXTEND),
    ([200, 3, 65, 64], 4, ForwardMode.TARGET_VERIFY),
    ([70, 129, 1], 1, ForwardMode.DECODE),
]


@pytest.mark.parametrize("seq_lens,next_n,mode", CASES)
def test_every_tagged_backend_gives_the_reference_answer(seq_lens, next_n, mode):
    batch = paged_batch(seq_lens, next_n)
    expected = expected_logits(batch)
    ran = []
    for backend, arch in tagged_backends():
        if backend.supports.why_not(_key(arch, mode, next_n)) is not None:
            continue
        plan = plan_for(backend, batch.seq_lens, batch.page_table, next_n, forward_mode=mode, arch=arch)
        out = paged_mqa_logits(plan, batch.q_tokens, batch.kv_cache, batch.weights)
        try:
            assert_logits_match(out, expected, tolerance=CPU_LOGITS_TOLERANCE)
        except AssertionError as error:
            raise AssertionError(f"{backend.name}: {error}") from None
        ran.append(backend.name)
    assert len(ran) >= 4  # both layouts, DeepGEMM stand-in and torch reference


def refusing(backend):
    """What refuses a mismatched plan before any kernel: the op's checks, which the op's call runs once
    against the decision's layout before the backend (dispatch/contract/ops/paged_logits.py), whichever
    backend it is (DeepGEMM's run adds only what its kernel needs)."""
    return lambda plan, q, kv_cache, weights: check_logits_inputs(plan, q, kv_cache, weights, consumes=backend.layout)


@pytest.mark.parametrize("name", ["deepgemm.sm90.flatten", "torch.reference.flatten"])
def test_a_flatten_plan_handed_native_q_raises(name):
    backend, arch = _tagged(name)
    batch = paged_batch([70, 129], 2)
    plan = plan_for(backend, batch.seq_lens, batch.page_table, 2, arch=arch)
    native_q = batch.q_tokens.view(2, 2, *batch.q_tokens.shape[1:])
    with pytest.raises(LayoutError, match="layout `flatten`"):
        refusing(backend)(plan, native_q, batch.kv_cache, batch.weights)


@pytest.mark.parametrize("name", ["deepgemm.sm90", "torch.reference"])
def test_a_native_plan_handed_flatten_q_raises(name):
    backend, arch = _tagged(name)
    batch = paged_batch([70, 129], 2)
    plan = plan_for(backend, batch.seq_lens, batch.page_table, 2, arch=arch)
    with pytest.raises(LayoutError, match="layout `native`"):
        refusing(backend)(plan, batch.q_tokens[:, None], batch.kv_cache, batch.weights)


@pytest.mark.parametrize("name", ["deepgemm.sm90", "torch.reference"])
def test_a_native_plan_holding_flatten_lens_raises(name):
    backend, arch = _tagged(name)
    batch = paged_batch([70, 129], 2)
    plan = plan_for(backend, batch.seq_lens, batch.page_table, 2, arch=arch)
    flatten_lens = plan.context_lens.reshape(-1, 1)
    wrong = type(plan)(**{**plan.__dict__, "context_lens": flatten_lens})
    with pytest.raises(LayoutError, match="context_lens"):
        refusing(backend)(wrong, plan.q_in_layout(batch.q_tokens), batch.kv_cache, batch.weights)


def test_a_plan_tagged_flatten_cannot_reach_the_native_kernel():
    # The other half of the incident: two places resolving the path separately. The plan says flatten;
    # a caller that picked the native DeepGEMM kernel on its own is refused, although at next_n = 2 a
    # flatten q [B*N, 1, H, D] is a valid native q for a batch of B*N requests.
    fake = FakeDeepGemm(num_sms=4)
    backends = {b.name: b for b in deepgemm_backends(load=lambda: fake)}
    batch = paged_batch([70, 129], 2)
    plan = plan_for(backends["deepgemm.sm90.flatten"], batch.seq_lens, batch.page_table, 2, arch=Arch.SM90)
    with pytest.raises(LayoutError, match="consumes layout `native`; the plan is tagged `flatten`"):
        backends["deepgemm.sm90"].run(plan, plan.q_in_layout(batch.q_tokens), batch.kv_cache, batch.weights)
    assert not fake.calls_to("fp8_fp4_paged_mqa_logits")


def _tagged(name):
    return next((b, arch) for b, arch in tagged_backends() if b.name == name)


def _key(arch, mode, next_n):
    return DispatchKey(arch=arch, forward_mode=mode, next_n=next_n, fp8_dtype=Fp8Dtype.E4M3FN)
