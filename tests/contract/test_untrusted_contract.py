"""Every backend of an op takes the same input contract and hands back what the op promises (issue 24):
int64 lengths never wrap to int32, `num_kv_blocks` is checked and honoured by the torch reference as by
the page guard, the reference Q quant refuses the shapes the kernel refuses, the reference top-k maps a
position the page table cannot map to -1 as the Triton kernel does, and the step refuses a backend's
output that breaks the op's contract."""

from __future__ import annotations

import pytest
import torch

from backends.reference.q_quant import reference_indexer_q_quant
from backends.reference.topk import topk_indices
from backends.triton.topk import topk_indices as triton_topk_indices
from dispatch.contract.errors import BackendError, IndexBoundsError, InvalidBatchError, LayoutError
from dispatch.contract.key import ForwardMode, Op
from dispatch.contract.ops import indexer_q_quant, paged_mqa_logits, topk_rows
from dispatch.step.paged_plan import PagedBatch, build_plan, visible_lengths
from dispatch.contract.rope import RopeSpec
from dispatch.deciding.runtime import load_dispatcher
from tests.support.fakes import catalog_of, dispatcher, fake_backend
from tests.support.paged_batch import paged_batch
from tests.support.plans import one_op_plan

INT32_MAX = 2**31 - 1


def test_int64_lengths_past_int32_never_wrap():
    lens = torch.tensor([2**32 + 5, 7, -(2**32) + 3], dtype=torch.int64)
    assert visible_lengths(lens, 1).flatten().tolist() == [INT32_MAX, 7, 0]
    with pytest.raises(InvalidBatchError, match=r"`max_seq_len` is 4294967301; the plan's lengths are int32"):
        PagedBatch(lens[:1], torch.zeros(1, 1, dtype=torch.int32), 2**32 + 5, ForwardMode.DECODE, 1)


@pytest.mark.parametrize("blocks", [10**12, -1, "abc", 2.5, True])
def test_num_kv_blocks_that_cannot_be_a_pool_are_refused(blocks):
    with pytest.raises(InvalidBatchError, match="`num_kv_blocks` is"):
        PagedBatch(torch.tensor([5], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 8,
                     ForwardMode.DECODE, 1, num_kv_blocks=blocks)


def _reference_plan(batch, **extra):
    forward = PagedBatch(batch.seq_lens, batch.page_table, batch.max_seq_len, ForwardMode.DECODE, 1, **extra)
    return build_plan(load_dispatcher(arch="cpu"), forward, kv_fp8_dtype="e4m3fn")


def test_the_reference_checks_pages_against_the_declared_pool():
    batch = paged_batch([70, 20], 1)
    used = int(batch.page_table[:, :2].max())  # the highest block a visible key needs
    plan = _reference_plan(batch, num_kv_blocks=used)  # one block short: that entry is outside the pool
    with pytest.raises(IndexBoundsError, match=rf"= {used} is outside the KV cache's \[0, {used}\) blocks"):
        paged_mqa_logits(plan, batch.q_tokens, batch.kv_cache, batch.weights)
    small = _reference_plan(batch, num_kv_blocks=batch.kv_cache.shape[0] + 1)
    with pytest.raises(LayoutError, match="fewer than the pool of"):
        paged_mqa_logits(small, batch.q_tokens, batch.kv_cache, batch.weights)


def test_a_page_table_narrower_than_max_seq_len_is_a_clear_error():
    batch = paged_batch([70, 20], 1)
    forward = PagedBatch(batch.seq_lens, batch.page_table[:, :1].contiguous(), 70, ForwardMode.DECODE, 1)
    plan = build_plan(load_dispatcher(arch="cpu"), forward, kv_fp8_dtype="e4m3fn")
    with pytest.raises(LayoutError, match=r"block_table has 1 pages of 64, fewer than max_context_len=70 needs \(2\)"):
        paged_mqa_logits(plan, batch.q_tokens, batch.kv_cache, batch.weights)


@pytest.mark.parametrize(("weights_shape", "positions_shape", "match"),
                         [((1, 8), (3,), r"weights \[3, 8\]"), ((8,), (3,), r"weights \[3, 8\]"),
                          ((3, 8), (1,), r"positions \[3\]")])
def test_the_reference_q_quant_refuses_broadcast_shapes(weights_shape, positions_shape, match):
    cache = torch.ones(16, 32, dtype=torch.bfloat16)
    # The op's checks run in the host's call, before the reference (dispatch/contract/ops/q_quant.py).
    with pytest.raises(LayoutError, match=match):
        indexer_q_quant(one_op_plan(Op.INDEXER_Q_QUANT, reference_indexer_q_quant), torch.randn(3, 8, 64),
                        torch.randn(weights_shape), torch.zeros(positions_shape, dtype=torch.int32), cache,
                        rope=RopeSpec.neox_head(), softmax_scale=1.0, head_scale=1.0)


@pytest.mark.parametrize("which", ["reference", "triton"])
def test_positions_the_page_table_cannot_map_become_minus_one(which):
    logits = torch.arange(4 * 300, dtype=torch.float32).reshape(4, 300)
    lengths = torch.full((4,), 300, dtype=torch.int32)
    # Row 0: page row -1; row 1: page row past the table; row 2: the table's second page is -5 and it has no
    # third (positions 256..299 lie past its width); row 3: a good row.
    table = torch.tensor([[1, 2], [3, -5], [4, 5]], dtype=torch.int32)
    rows = torch.tensor([-1, 3, 1, 2], dtype=torch.int32)
    run = topk_indices if which == "reference" else triton_topk_indices
    out = run(logits, lengths, 300, page_table=table, page_rows=rows, block_size=128, sorted=True)
    assert (out[0] == -1).all() and (out[1] == -1).all()
    positions = torch.arange(299, -1, -1)  # sorted: the largest logit is the last position
    expected_row2 = torch.where(positions < 128, 3 * 128 + positions, -1)
    assert torch.equal(out[2].long(), expected_row2)
    expected_row3 = torch.where(positions < 128, 4 * 128 + positions, torch.where(positions < 256, 5 * 128 + positions - 128, -1))
    assert torch.equal(out[3].long(), expected_row3)


REGISTRY = """
version: 1
ops:
  paged_mqa_logits: {fallback: [logits]}
  indexer_q_quant: {fallback: [quant]}
  topk: {fallback: [bad]}
  ragged_mqa_logits: {fallback: [ragged]}
"""


@pytest.mark.parametrize(("returned", "what"), [
    (lambda logits, lengths, k, **_: torch.zeros(1, k, dtype=torch.int32), r"torch.int32 \[1, 4\] on cpu"),
    (lambda logits, lengths, k, **_: torch.zeros(logits.shape[0], k, dtype=torch.int64), r"torch.int64 \[3, 4\] on cpu"),
    (lambda logits, lengths, k, **_: torch.zeros(2, k, dtype=torch.int32), r"torch.int32 \[2, 4\] on cpu"),
    (lambda logits, lengths, k, **_: [[0] * k] * 3, "a list"),
], ids=["broadcast-row", "int64", "row-count", "not-a-tensor"])
def test_the_step_refuses_a_top_k_output_outside_the_contract(returned, what):
    catalog = catalog_of(fake_backend("logits"), fake_backend("quant", Op.INDEXER_Q_QUANT),
                         fake_backend("bad", Op.TOPK, run=returned), fake_backend("ragged", Op.RAGGED_MQA_LOGITS))
    chooser = dispatcher(REGISTRY, catalog)
    plan = build_plan(chooser, PagedBatch(torch.tensor([5, 6, 7], dtype=torch.int32),
                                            torch.zeros(3, 1, dtype=torch.int32), 8, ForwardMode.DECODE, 1),
                      kv_fp8_dtype="e4m3fn")
    with pytest.raises(BackendError, match=rf"backend `bad` .* returned {what} as topk's indices; the op's "
                                           r"contract is torch.int32 \[3, 4\] on cpu"):
        topk_rows(plan, torch.zeros(3, 8), plan.token_lengths, 4)
