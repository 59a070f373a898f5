"""CapturedIndexerStep.update is all or nothing (issue 24): a batch it refuses leaves the captured plan's
tensors and every backend's per-batch state (the page guard, the schedule) exactly as they were, so the
next replay answers for the previous batch. The capture itself needs CUDA; the update does not, so the
step's select on the captured plan stands in for a replay here (the Triton kernels interpreted)."""

from __future__ import annotations

import pytest
import torch

from dispatch.contract.errors import GraphMismatchError
from dispatch.engines.graphs import CapturedIndexerStep, StaticInputs
from dispatch.engines.indexer_step import IndexerStep
from dispatch.contract.key import ForwardMode
from dispatch.step.paged_plan import PagedBatch
from dispatch.contract.rope import RopeSpec
from dispatch.deciding.runtime import load_dispatcher
from tests.support.paged_batch import paged_batch

REGISTRY = """
version: 1
ops:
  paged_mqa_logits: {fallback: [triton]}
  indexer_q_quant: {fallback: [torch.reference]}
  topk: {fallback: [torch.reference]}
  ragged_mqa_logits: {fallback: [torch.reference]}
"""
HEADS, DIM = 32, 32


def _uncaptured(step, batch, inputs) -> CapturedIndexerStep:
    """A CapturedIndexerStep as capture leaves it, without the CUDA graph (GPU-only)."""
    captured = object.__new__(CapturedIndexerStep)
    captured.step, captured.plan, captured.inputs = step, step.plan(batch), inputs
    return captured


def _replay(captured) -> torch.Tensor:
    i = captured.inputs
    return captured.step.select(captured.plan, i.q, i.weights, i.positions, i.cos_sin_cache, i.kv_cache)


def _snapshot(plan):
    state = plan.state
    return [t.clone() for t in (plan.context_lens, plan.block_table, state.guard.safe_table, state.guard.lens,
                                state.guard.fill)] + [state.guard.num_blocks]


@pytest.mark.parametrize("declared", [True, False], ids=["pool-declared", "pool-from-first-layer"])
def test_a_refused_update_leaves_the_captured_plan_as_it_was(tmp_path, declared):
    path = tmp_path / "registry.yaml"
    path.write_text(REGISTRY)
    step = IndexerStep(load_dispatcher(path, arch="cpu"), kv_fp8_dtype=torch.float8_e4m3fn, rope=RopeSpec.neox_head(),
                       softmax_scale=DIM**-0.5, head_scale=HEADS**-0.5, index_topk=16)
    first = paged_batch([70, 20], 2, heads=HEADS, head_dim=DIM, seed=1)
    blocks = first.kv_cache.shape[0]
    batch = PagedBatch(first.seq_lens, first.page_table, 72, ForwardMode.TARGET_VERIFY, 2,
                         num_kv_blocks=blocks if declared else None)
    gen = torch.Generator().manual_seed(0)
    inputs = StaticInputs(q=torch.randn(4, HEADS, DIM, generator=gen).to(torch.bfloat16),
                          weights=torch.randn(4, HEADS, generator=gen), positions=torch.tensor([68, 69, 18, 19]),
                          cos_sin_cache=torch.ones(128, DIM // 2, dtype=torch.bfloat16), kv_cache=first.kv_cache)
    captured = _uncaptured(step, batch, inputs)
    before = _replay(captured)
    snapshot = _snapshot(captured.plan)
    other = PagedBatch(torch.tensor([40, 9], dtype=torch.int32), first.page_table.flip(0).contiguous(), 72,
                         ForwardMode.TARGET_VERIFY, 2, num_kv_blocks=blocks + 1)
    with pytest.raises(GraphMismatchError, match=rf"num_kv_blocks={blocks + 1}; the graph's cache was checked against {blocks}"):
        captured.update(other)
    after = _snapshot(captured.plan)
    assert after[-1] == snapshot[-1]
    for then, now in zip(snapshot[:-1], after[:-1]):
        assert torch.equal(then, now)  # the same int32 / fp32 values written back: exact
    # The same kernels on the same plan and inputs: the same operations on the same values, so exact.
    assert torch.equal(_replay(captured), before)
    # An accepted update still goes through.
    captured.update(PagedBatch(torch.tensor([40, 9], dtype=torch.int32), first.page_table, 72,
                                 ForwardMode.TARGET_VERIFY, 2, num_kv_blocks=blocks))
    assert captured.plan.context_lens.tolist() == [[39, 40], [8, 9]]
