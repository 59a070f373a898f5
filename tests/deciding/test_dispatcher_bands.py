"""The dispatcher with a measured overlay's batch-size bands: the band of the declared batch size
decides (the last one beyond it), the key's order without one, and the cluster's prefer and disable
lists and pinning keep their precedence; a plan decides with its batch's size."""

from __future__ import annotations

import pytest
import torch

from dispatch.contract.errors import InvalidBatchError
from dispatch.contract.key import ForwardMode, Op
from dispatch.contract.layout import Layout
from dispatch.deciding.runtime import load_dispatcher
from dispatch.step.paged_plan import PagedBatch, build_plan
from tests.support.banded import FLATTEN, NATIVE, OVERLAY, REGISTRY, VERIFY, write_banded

LOGITS = Op.PAGED_MQA_LOGITS


def _dispatcher(folder, registry: str = REGISTRY):
    return load_dispatcher(write_banded(folder, registry=registry), cluster="banded", arch="cpu")


def _line(fragment: str, occurrence: int = 0) -> int:
    return [n for n, line in enumerate(OVERLAY.splitlines(), 1) if fragment in line][occurrence]


def _reasons(decision) -> dict[str, str]:
    return {r.backend: r.reason for r in decision.rejected}


def test_the_declared_batch_size_picks_its_band(tmp_path):
    decision = _dispatcher(tmp_path).decide(LOGITS, VERIFY, batch_size=2)
    overlay = tmp_path / "measured" / "banded.yaml"
    assert (decision.backend, decision.layout, decision.source) == (FLATTEN, Layout.FLATTEN, "measured")
    assert (decision.rule, decision.band) == ("measured[0]", "B <= 2")
    assert decision.chosen_by == "cluster `banded` measured[0] for B <= 2"
    assert decision.rule_at == f"{overlay}:{_line(f'order: [{FLATTEN}, {NATIVE}]')}"
    assert decision.evidence.at == f"{overlay}:{_line('- batch_size_up_to: 2')}"
    assert [shape for shape, _ in decision.evidence.shapes] == ["B=2 N=2 L~256 H=64 D=128", "B=2 N=2 L~1K H=64 D=128"]
    assert dict(decision.evidence.means)[NATIVE] == pytest.approx((20.0 * 22.0) ** 0.5, abs=1e-3)
    assert _reasons(decision)[NATIVE] == (
        f"measured slower at B=2: 21.0 us vs 11.0 us ({FLATTEN}, geometric mean over 2 shapes)"
    )
    assert decision.as_dict()["band"] == "B <= 2"


@pytest.mark.parametrize("batch_size, backend, band", [
    (1, FLATTEN, "B <= 2"), (2, FLATTEN, "B <= 2"), (3, NATIVE, "B > 2"), (16, NATIVE, "B > 2"),
    (17, NATIVE, "B > 2"), (4096, NATIVE, "B > 2"),  # beyond the last band: the last band's order
])
def test_every_batch_size_is_served_by_a_band(tmp_path, batch_size, backend, band):
    decision = _dispatcher(tmp_path).decide(LOGITS, VERIFY, batch_size=batch_size)
    assert (decision.backend, decision.band) == (backend, band)


def test_the_last_band_names_the_batch_size_it_measured(tmp_path):
    decision = _dispatcher(tmp_path).decide(LOGITS, VERIFY, batch_size=500)
    assert _reasons(decision)[FLATTEN] == (
        f"measured slower at B=16: 42.0 us vs 21.0 us ({NATIVE}, geometric mean over 2 shapes)"
    )


def test_without_a_batch_size_the_keys_own_order_decides(tmp_path):
    dispatcher = _dispatcher(tmp_path)
    decision = dispatcher.decide(LOGITS, VERIFY)
    assert (decision.backend, decision.band, decision.chosen_by) == (NATIVE, "", "cluster `banded` measured[0]")
    assert len(decision.evidence.shapes) == 4
    assert _reasons(decision)[FLATTEN] == f"measured slower: 21.4 us vs 21.0 us ({NATIVE}, geometric mean over 4 shapes)"
    assert dispatcher.band_sizes(LOGITS, VERIFY) == (2, 16)
    assert dispatcher.band_sizes(Op.TOPK, VERIFY) == ()


def test_decisions_are_cached_per_band(tmp_path):
    dispatcher = _dispatcher(tmp_path)
    small = dispatcher.decide(LOGITS, VERIFY, batch_size=1)
    assert dispatcher.decide(LOGITS, VERIFY, batch_size=2) is small
    large = dispatcher.decide(LOGITS, VERIFY, batch_size=3)
    assert large is not small and dispatcher.decide(LOGITS, VERIFY, batch_size=99) is large
    assert dispatcher.decide(LOGITS, VERIFY) is not small
    # A key without bands: one decision whatever the batch size.
    assert dispatcher.decide(Op.TOPK, VERIFY, batch_size=1) is dispatcher.decide(Op.TOPK, VERIFY, batch_size=50)
    assert dispatcher.decided_keys() == [(LOGITS, VERIFY), (Op.TOPK, VERIFY)]


def test_a_plans_decisions_are_one_cached_read_only_mapping_of_decides_own(tmp_path):
    """decide_ops (a plan's every op in one lookup): the very decisions decide caches, per band, in one
    mapping per (ops, key, batch size) that no caller can change under the next plan."""
    dispatcher = _dispatcher(tmp_path)
    ops = (LOGITS, Op.TOPK)
    small = dispatcher.decide_ops(ops, VERIFY, batch_size=2)
    assert dict(small) == {op: dispatcher.decide(op, VERIFY, batch_size=2) for op in ops}
    assert all(small[op] is dispatcher.decide(op, VERIFY, batch_size=2) for op in ops)
    assert dispatcher.decide_ops(ops, VERIFY, batch_size=2) is small
    large = dispatcher.decide_ops(ops, VERIFY, batch_size=3)
    assert (small[LOGITS].band, large[LOGITS].band) == ("B <= 2", "B > 2")
    assert dispatcher.decide_ops(ops, VERIFY)[LOGITS] is dispatcher.decide(LOGITS, VERIFY)
    with pytest.raises(TypeError):
        small[LOGITS] = large[LOGITS]  # type: ignore[index]
    plans = [build_plan(dispatcher, _batch(2), kv_fp8_dtype="e4m3fn") for _ in range(2)]
    assert plans[0].decisions is plans[1].decisions and plans[0].decision(LOGITS) is small[LOGITS]


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "2"])
def test_a_batch_size_that_cannot_occur_is_refused(tmp_path, bad):
    with pytest.raises(InvalidBatchError, match=rf"decide: `batch_size` is {bad!r}; expected a host int >= 1"):
        _dispatcher(tmp_path).decide(LOGITS, VERIFY, batch_size=bad)


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "2"])
def test_a_batch_size_that_cannot_occur_is_refused_by_decide_ops_even_after_its_equal_was_cached(tmp_path, bad):
    dispatcher = _dispatcher(tmp_path)
    dispatcher.decide_ops((LOGITS,), VERIFY, batch_size=1)  # True == 1 and 2.0 == 2 hash alike: not a hit
    dispatcher.decide_ops((LOGITS,), VERIFY, batch_size=2)
    with pytest.raises(InvalidBatchError, match=rf"decide: `batch_size` is {bad!r}; expected a host int >= 1"):
        dispatcher.decide_ops((LOGITS,), VERIFY, batch_size=bad)


def test_the_clusters_prefer_list_comes_before_any_band(tmp_path):
    registry = REGISTRY.replace("  banded:\n", f"  banded:\n    prefer: [{NATIVE}]\n")
    decision = _dispatcher(tmp_path, registry).decide(LOGITS, VERIFY, batch_size=2)
    assert (decision.backend, decision.source, decision.band) == (NATIVE, "cluster-prefer", "")
    assert decision.chosen_by == "cluster `banded` prefer[0]"


def test_a_disabled_backend_is_passed_over_in_the_band(tmp_path):
    registry = REGISTRY.replace("  banded:\n", f"  banded:\n    disable: [{FLATTEN}]\n")
    decision = _dispatcher(tmp_path, registry).decide(LOGITS, VERIFY, batch_size=2)
    assert (decision.backend, decision.rule, decision.band) == (NATIVE, "measured[1]", "B <= 2")
    assert _reasons(decision)[FLATTEN] == f"cluster `banded` measured for B <= 2 names it, but disabled by cluster `banded`"


def _batch(size: int) -> PagedBatch:
    return PagedBatch(torch.full((size,), 70, dtype=torch.int32), torch.zeros(size, 2, dtype=torch.int32), 70,
                      ForwardMode.TARGET_VERIFY, 2)


def test_a_plan_decides_with_its_batchs_size(tmp_path):
    dispatcher = _dispatcher(tmp_path)
    small, large = (build_plan(dispatcher, _batch(size), kv_fp8_dtype="e4m3fn") for size in (2, 3))
    assert (small.decision(LOGITS).backend, small.layout) == (FLATTEN, Layout.FLATTEN)
    assert list(small.context_lens.shape) == [4, 1]  # the flatten layout's per-token rows
    assert (large.decision(LOGITS).backend, large.layout) == (NATIVE, Layout.NATIVE)


def test_pinning_keeps_its_precedence_over_a_band(tmp_path):
    plan = build_plan(_dispatcher(tmp_path), _batch(2), kv_fp8_dtype="e4m3fn", pinned={LOGITS: NATIVE})
    assert (plan.decision(LOGITS).backend, plan.decision(LOGITS).source, plan.decision(LOGITS).band) == (
        NATIVE, "pinned", "")
