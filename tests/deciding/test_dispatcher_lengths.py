"""The dispatcher with length sub-bands inside a measured batch-size band: the declared
(batch_size, max_seq_len) picks the sub-band (bounded by 3L/2 of the length it measured, the last one
beyond it), the band's own order without a max_seq_len, the key's without a batch size; a plan decides
with its batch's declared max_seq_len, and a captured graph's update keeps the capture's sub-band."""

from __future__ import annotations

import pytest
import torch

from dispatch.contract.errors import InvalidBatchError
from dispatch.contract.key import ForwardMode, Op
from dispatch.contract.layout import Layout
from dispatch.deciding.runtime import load_dispatcher
from dispatch.engines.agreement import summary
from dispatch.step.paged_plan import PagedBatch, build_plan
from tests.support.length_banded import FLATTEN, NATIVE, OVERLAY, VERIFY, write_banded

LOGITS = Op.PAGED_MQA_LOGITS


def _dispatcher(folder):
    return load_dispatcher(write_banded(folder, overlay=OVERLAY), cluster="banded", arch="cpu")


def _line(fragment: str, occurrence: int = 0) -> int:
    return [n for n, line in enumerate(OVERLAY.splitlines(), 1) if fragment in line][occurrence]


@pytest.mark.parametrize("batch_size, max_seq_len, backend, band", [
    (2, 1, FLATTEN, "B <= 2, rows <= 384"), (2, 384, FLATTEN, "B <= 2, rows <= 384"),  # at the bound: 3 * 256 / 2
    (2, 385, NATIVE, "B <= 2, rows > 384"), (2, 1536, NATIVE, "B <= 2, rows > 384"),
    (2, 2**20, NATIVE, "B <= 2, rows > 384"),  # beyond the last sub-band: its order
    (1, 300, FLATTEN, "B <= 2, rows <= 384"),
    (2, None, FLATTEN, "B <= 2"),  # no length declared: the band's own order
    (3, 300, NATIVE, "B > 2"), (16, 2000, NATIVE, "B > 2"),  # a band without sub-bands ignores the length
    (None, 300, NATIVE, ""),  # no batch size: the key's own order, whatever the length
])
def test_the_declared_batch_size_and_max_seq_len_pick_the_sub_band(tmp_path, batch_size, max_seq_len, backend, band):
    decision = _dispatcher(tmp_path).decide(LOGITS, VERIFY, batch_size=batch_size, max_seq_len=max_seq_len)
    assert (decision.backend, decision.band, decision.source) == (backend, band, "measured")


def test_decide_ops_caches_per_sub_band_not_per_length(tmp_path):
    dispatcher = _dispatcher(tmp_path)
    ops = (LOGITS, Op.TOPK)
    short = dispatcher.decide_ops(ops, VERIFY, batch_size=2, max_seq_len=300)
    assert short[LOGITS] is dispatcher.decide(LOGITS, VERIFY, batch_size=2, max_seq_len=300)
    assert short[LOGITS].backend == FLATTEN
    assert dispatcher.decide_ops(ops, VERIFY, batch_size=2, max_seq_len=384) is short  # the same sub-band
    long = dispatcher.decide_ops(ops, VERIFY, batch_size=2, max_seq_len=385)
    assert long[LOGITS].backend == NATIVE and long is not short
    assert dispatcher.decide_ops(ops, VERIFY, batch_size=2)[LOGITS].band == "B <= 2"
    assert dispatcher.decide_ops(ops, VERIFY, batch_size=3, max_seq_len=300)[LOGITS].backend == NATIVE
    for bad in (0, 2.0, True):  # refused even where a valid call of that sub-band was cached
        with pytest.raises(InvalidBatchError, match="`max_seq_len` is"):
            dispatcher.decide_ops(ops, VERIFY, batch_size=2, max_seq_len=bad)


def test_a_sub_band_decision_names_its_line_evidence_and_losers(tmp_path):
    decision = _dispatcher(tmp_path).decide(LOGITS, VERIFY, batch_size=2, max_seq_len=1000)
    overlay = tmp_path / "measured" / "banded.yaml"
    assert decision.chosen_by == "cluster `banded` measured[0] for B <= 2, rows > 384"
    assert decision.rule_at == f"{overlay}:{_line(f'order: [{NATIVE}, {FLATTEN}]', 1)}"
    assert decision.evidence.at == f"{overlay}:{_line('- max_seq_len_up_to: 1536')}"
    assert [shape for shape, _ in decision.evidence.shapes] == ["B=2 N=2 L~1K H=64 D=128"]
    assert {r.backend: r.reason for r in decision.rejected}[FLATTEN] == (
        f"measured slower at B=2, rows > 384: 30.0 us vs 22.0 us ({NATIVE})")
    assert decision.as_dict()["band"] == "B <= 2, rows > 384"


def test_a_max_seq_len_that_cannot_occur_is_refused(tmp_path):
    dispatcher = _dispatcher(tmp_path)
    for bad in (0, -1, 2.0, True, torch.tensor(5)):
        with pytest.raises(InvalidBatchError, match="`max_seq_len` is .*expected a host int >= 1"):
            dispatcher.decide(LOGITS, VERIFY, batch_size=2, max_seq_len=bad)


def test_the_dispatcher_lists_each_bands_sub_band_bounds(tmp_path):
    dispatcher = _dispatcher(tmp_path)
    assert dispatcher.band_sizes(LOGITS, VERIFY) == (2, 16)
    assert dispatcher.band_lengths(LOGITS, VERIFY, 1) == (384, 1536)
    assert dispatcher.band_lengths(LOGITS, VERIFY, 16) == ()


def _batch(lengths: list[int], max_seq_len: int) -> PagedBatch:
    table = torch.arange(len(lengths) * 16, dtype=torch.int32).reshape(len(lengths), 16)
    return PagedBatch(torch.tensor(lengths, dtype=torch.int32), table, max_seq_len, ForwardMode.TARGET_VERIFY, 2)


def test_a_plan_decides_by_its_batchs_declared_max_seq_len(tmp_path):
    dispatcher = _dispatcher(tmp_path)
    short = build_plan(dispatcher, _batch([300, 20], 384), kv_fp8_dtype="e4m3fn", prepare=False)
    long = build_plan(dispatcher, _batch([300, 20], 1000), kv_fp8_dtype="e4m3fn", prepare=False)
    assert (short.logits.backend, short.logits.layout) == (FLATTEN, Layout.FLATTEN)
    assert (long.logits.backend, long.logits.band) == (NATIVE, "B <= 2, rows > 384")
    # A captured graph's batches are decided at the captured bound, whatever their own.
    at_bound = build_plan(dispatcher, _batch([300, 20], 384), kv_fp8_dtype="e4m3fn", prepare=False, band_seq_len=1000)
    assert at_bound.logits.backend == NATIVE


def test_a_captured_graphs_update_keeps_the_captures_sub_band(tmp_path):
    from dispatch.engines.graphs import CapturedIndexerStep
    from dispatch.contract.rope import RopeSpec
    from dispatch.engines.indexer_step import IndexerStep

    step = IndexerStep(_dispatcher(tmp_path), kv_fp8_dtype=torch.float8_e4m3fn, rope=RopeSpec.neox_head(),
                       softmax_scale=32**-0.5, head_scale=32**-0.5, index_topk=16)
    captured = object.__new__(CapturedIndexerStep)  # as capture leaves it, without the CUDA graph (GPU-only)
    captured.step, captured.plan, captured.inputs = step, step.plan(_batch([900, 20], 1000)), None
    assert captured.plan.decision(LOGITS).backend == NATIVE
    captured.update(_batch([300, 20], 384))  # a shorter batch, which alone would pick the flatten sub-band
    assert captured.plan.decision(LOGITS).backend == NATIVE
    assert captured.plan.context_lens.tolist() == [[299, 300], [19, 20]]


def test_ranks_compare_every_sub_bands_choice(tmp_path):
    fields = summary(_dispatcher(tmp_path), [VERIFY])
    short = f"paged_mqa_logits @ {VERIFY} B=2 max_seq_len<=384"
    assert fields[short] == f"{FLATTEN} (flatten, measured[0] for B <= 2, rows <= 384)"
    assert fields[f"paged_mqa_logits @ {VERIFY} B=2 max_seq_len<=1536"].startswith(f"{NATIVE} (native, ")
    assert not any("B=16 max_seq_len" in name for name in fields)
