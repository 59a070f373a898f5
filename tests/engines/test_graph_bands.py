"""CUDA graphs with measured bands: a graph is captured per batch size, so the band is fixed for a
captured step. An update of the same B keeps its band's decision and goes through; a fresh plan of
another band (another layout here) is refused with GraphMismatchError rather than replayed wrongly.
The capture needs CUDA; the update does not, so the captured plan is built as capture builds it."""

from __future__ import annotations

import pytest
import torch

from dispatch.contract.errors import GraphMismatchError
from dispatch.contract.key import ForwardMode, Op
from dispatch.contract.rope import RopeSpec
from dispatch.deciding.runtime import load_dispatcher
from dispatch.engines.graphs import CapturedIndexerStep, check_replayable
from dispatch.engines.indexer_step import IndexerStep
from dispatch.step.paged_plan import PagedBatch, build_plan
from tests.support.banded import FLATTEN, NATIVE, write_banded


def _step(tmp_path) -> IndexerStep:
    dispatcher = load_dispatcher(write_banded(tmp_path), cluster="banded", arch="cpu")
    return IndexerStep(dispatcher, kv_fp8_dtype=torch.float8_e4m3fn, rope=RopeSpec.neox_head(),
                       softmax_scale=32**-0.5, head_scale=32**-0.5, index_topk=16)


def _batch(lengths: list[int], pages: int = 2) -> PagedBatch:
    size = len(lengths)
    table = torch.arange(size * pages, dtype=torch.int32).reshape(size, pages)
    return PagedBatch(torch.tensor(lengths, dtype=torch.int32), table, 100, ForwardMode.TARGET_VERIFY, 2)


def _uncaptured(step: IndexerStep, batch: PagedBatch) -> CapturedIndexerStep:
    """A CapturedIndexerStep as capture leaves it, without the CUDA graph (GPU-only)."""
    captured = object.__new__(CapturedIndexerStep)
    captured.step, captured.plan, captured.inputs = step, step.plan(batch), None
    return captured


def test_a_same_batch_size_update_keeps_the_bands_decision(tmp_path):
    captured = _uncaptured(_step(tmp_path), _batch([70, 20]))
    assert captured.plan.decision(Op.PAGED_MQA_LOGITS).backend == FLATTEN  # the B <= 2 band's
    captured.update(_batch([41, 9]))
    assert captured.plan.decision(Op.PAGED_MQA_LOGITS).band == "B <= 2"
    assert captured.plan.context_lens.flatten().tolist() == [40, 41, 8, 9]  # flatten: one row per token


def test_a_fresh_plan_of_another_band_is_refused(tmp_path):
    step = _step(tmp_path)
    captured = _uncaptured(step, _batch([70, 20]))
    other_band = build_plan(step.dispatcher, _batch([70, 20, 30]), kv_fp8_dtype="e4m3fn")
    assert other_band.decision(Op.PAGED_MQA_LOGITS).backend == NATIVE
    with pytest.raises(GraphMismatchError, match=rf"paged_mqa_logits: this batch .* decides `{NATIVE}` \(native, "
                                                 rf"measured\[0\]\); the graph was captured with `{FLATTEN}`"):
        check_replayable(captured.plan, _batch([41, 9]), other_band)
    with pytest.raises(GraphMismatchError, match="graph captured for B=2, next_n=2; batch has B=3"):
        captured.update(_batch([70, 20, 30]))
