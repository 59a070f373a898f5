"""tune's bands: one order per measured batch size by the key's own rule (geometric mean over that
batch size's shapes, ties within 1% in the registry's order), written only where they differ from the
key's order; inside a band, length sub-bands where the fastest differs between lengths; and the shipped
H200 overlay's bands are exactly what that rule gives its recorded times."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dispatch.bench.tune import Tuner
from dispatch.bench.ordering import band_orders
from dispatch.contract.key import DispatchKey, ForwardMode, Op
from dispatch.deciding.runtime import DEFAULT_REGISTRY
from dispatch.registry.document import load_registry
from dispatch.registry.measured import load_measured


def _shapes(times: dict[str, dict[str, float]]) -> list[dict]:
    return [{"shape": shape, "median_us": medians} for shape, medians in times.items()]


def test_each_batch_size_gets_its_own_order_ascending():
    shapes = _shapes({
        "B=32 N=2 L~8K": {"a": 17.1, "b": 12.2}, "B=32 N=2 L~32K": {"a": 16.9, "b": 19.3},
        "B=8 N=2 L~8K": {"a": 13.2, "b": 16.5}, "B=8 N=2 L~32K": {"a": 19.1, "b": 18.7},
    })
    # b at B=32: sqrt(12.2 * 19.3) = 15.3 against a's 17.0; at B=8 a 15.9 against b 17.6. Inside each
    # band the lengths part (b leads at B=32 L~8K, a at L~32K), so each has length sub-bands, bounded by
    # 3L/2: 12K for L~8K, 48K for L~32K.
    assert band_orders(shapes, ["a", "b"], ["a", "b"]) == [
        {"batch_size_up_to": 8, "order": ["a", "b"],  # equal to the key's order, written all the same:
         "lengths": [{"max_seq_len_up_to": 12288, "order": ["a", "b"]},
                     {"max_seq_len_up_to": 49152, "order": ["b", "a"]}]},  # 18.7 against 19.1: past the tie
        {"batch_size_up_to": 32, "order": ["b", "a"],  # without it, B=8 would be served by this band
         "lengths": [{"max_seq_len_up_to": 12288, "order": ["b", "a"]},
                     {"max_seq_len_up_to": 49152, "order": ["a", "b"]}]},
    ]


def test_length_sub_bands_only_where_the_fastest_differs_between_lengths():
    agree = _shapes({"B=8 N=2 L~8K": {"a": 10.0, "b": 20.0}, "B=8 N=2 L~32K": {"a": 30.0, "b": 31.0},
                     "B=32 N=2 L~8K": {"a": 20.0, "b": 10.0}, "B=32 N=2 L~32K": {"a": 40.0, "b": 30.0}})
    assert band_orders(agree, ["a", "b"], ["a", "b"]) == [
        {"batch_size_up_to": 8, "order": ["a", "b"]}, {"batch_size_up_to": 32, "order": ["b", "a"]}]
    # One batch size whose lengths part: one band, carrying the sub-bands (the key's order serves no length).
    one = _shapes({"B=8 N=1 L~2K": {"a": 10.0, "b": 20.0}, "B=8 N=1 L~8K": {"a": 10.0, "b": 10.05},
                   "B=8 N=1 L~32K": {"a": 30.0, "b": 20.0}})
    assert band_orders(one, ["a", "b"], ["a", "b"]) == [
        {"batch_size_up_to": 8, "order": ["a", "b"], "lengths": [
            {"max_seq_len_up_to": 3072, "order": ["a", "b"]},
            {"max_seq_len_up_to": 12288, "order": ["a", "b"]},  # a tie within 1%: the registry's order
            {"max_seq_len_up_to": 49152, "order": ["b", "a"]}]}]
    # A shape that names no length (an extend batch's): no sub-bands.
    extend = _shapes({"M=4K S=4K R=4 H=64 D=128": {"a": 10.0, "b": 20.0}, "M=4K S=52K R=4 H=64 D=128": {"a": 30.0, "b": 20.0}})
    assert band_orders(extend, ["a", "b"], ["a", "b"]) == []


def test_a_tie_within_one_percent_keeps_the_registry_order():
    shapes = _shapes({"B=8 L~8K": {"a": 10.05, "b": 10.0}, "B=32 L~8K": {"a": 30.0, "b": 20.0}})
    assert band_orders(shapes, ["b", "a"], ["a", "b"]) == [
        {"batch_size_up_to": 8, "order": ["a", "b"]},  # b is 0.5% faster: a tie, the rule's order
        {"batch_size_up_to": 32, "order": ["b", "a"]},
    ]
    past = _shapes({"B=8 L~8K": {"a": 10.2, "b": 10.0}, "B=32 L~8K": {"a": 30.0, "b": 20.0}})
    assert band_orders(past, ["b", "a"], ["a", "b"]) == []  # b 2% faster at B=8 too: every band is the key's


@pytest.mark.parametrize("times", [
    {"B=8 L~8K": {"a": 10.0, "b": 20.0}, "B=8 L~32K": {"a": 30.0, "b": 40.0}},  # one batch size, one winner
    {"T=64 H=64": {"a": 10.0, "b": 20.0}, "T=512 H=64": {"a": 30.0, "b": 20.0}},  # Q quant: no batch size
    {"B=8 L~8K": {"a": 10.0, "b": 20.0}, "T=512 H=64": {"a": 30.0, "b": 20.0}},  # one shape names none
], ids=["one-batch-size", "token-counts", "partly-named"])
def test_no_bands_where_the_shapes_do_not_name_several_batch_sizes(times):
    assert band_orders(_shapes(times), ["b", "a"], []) == []


def test_no_bands_where_every_band_is_the_keys_order():
    shapes = _shapes({"B=8 L~8K": {"a": 10.0, "b": 20.0}, "B=32 L~8K": {"a": 11.0, "b": 25.0},
                      "B=128 L~8K": {"a": 12.0, "b": 30.0}})
    assert band_orders(shapes, ["a", "b"], []) == []


def _row(backend: str, shape: str, us: float):
    return SimpleNamespace(backend=backend, shape=shape, check="ok", seconds=us / 1e6)


def test_the_tuners_preference_carries_the_bands_between_order_and_shapes():
    tuner = object.__new__(Tuner)
    tuner.failures, tuner.say = 0, lambda text: None
    rows = [_row("a", "B=8 N=1 L~8K", 10.0), _row("b", "B=8 N=1 L~8K", 20.0),
            _row("a", "B=128 N=1 L~8K", 60.0), _row("b", "B=128 N=1 L~8K", 25.0)]
    preference = tuner._preference(rows, ["a", "b"])
    assert list(preference) == ["order", "bands", "shapes"]
    assert preference["order"] == ["b", "a"]  # sqrt(20 * 25) = 22.4 against sqrt(10 * 60) = 24.5
    assert preference["bands"] == [{"batch_size_up_to": 8, "order": ["a", "b"]},
                                   {"batch_size_up_to": 128, "order": ["b", "a"]}]


# (op, next_n, band's batch_size_up_to): [(max_seq_len_up_to, the sub-band's first backend)], as tuned.
SHIPPED_SUB_BANDS = {
    ("paged_mqa_logits", 1, 1): [(3072, "triton"), (12288, "triton"), (49152, "deepgemm.sm90")],
    ("paged_mqa_logits", 2, 1): [(12288, "triton"), (49152, "deepgemm.sm90")],
    ("topk", 1, 128): [(12288, "sglang.topk_v2"), (49152, "cuda.radix")],
    ("topk", 2, 8): [(12288, "sglang.topk_v2"), (49152, "cuda.radix")],
    ("topk", 2, 32): [(12288, "sglang.topk_v2"), (49152, "cuda.radix")],
    ("topk", 2, 128): [(12288, "sglang.topk_v2"), (49152, "cuda.radix")],
    ("topk", 4, 8): [(12288, "sglang.topk_v2"), (49152, "cuda.radix")],
    ("topk", 4, 32): [(12288, "sglang.topk_v2"), (49152, "cuda.radix")],
    ("topk", 4, 128): [(12288, "sglang.topk_v2"), (49152, "cuda.radix")],
}


def test_the_shipped_h200_bands_are_what_tune_derives_from_its_recorded_times():
    document = load_registry(DEFAULT_REGISTRY)
    overlay = load_measured(DEFAULT_REGISTRY.parent / "measured" / "h200-mtp.yaml").overlay
    banded, subs = 0, {}
    for op, table in overlay.ops.items():
        for preference in table.preferences:
            key = DispatchKey(preference.key.arch, preference.key.forward_mode[0], preference.key.next_n,
                              preference.key.fp8_dtype)
            shapes = [{"shape": s.shape, "median_us": dict(s.median_us)} for s in preference.shapes]
            stepped = [{"shape": s.shape, "median_us": dict(s.median_us)} for s in preference.step_shapes]
            rule_order = list(document.registry.table(op).named_for(key))
            derived = band_orders(shapes, list(preference.order), rule_order, stepped)
            if len(derived) == 1 and "lengths" not in derived[0]:
                derived = []  # one batch size and no sub-bands: no band
            stored = [{"batch_size_up_to": b.batch_size_up_to, "order": list(b.order),
                       **({"ranked_by": "step"} if b.ranked_by == "step" else {}),
                       **({"lengths": [{"max_seq_len_up_to": sub.max_seq_len_up_to, "order": list(sub.order),
                                        **({"ranked_by": "step"} if sub.ranked_by == "step" else {})}
                                       for sub in b.lengths]} if b.lengths else {})}
                      for b in preference.bands]
            assert stored == derived, (op.value, key)
            banded += bool(stored)
            for band in preference.bands:
                if band.lengths:
                    subs[(op.value, key.next_n, band.batch_size_up_to)] = [
                        (sub.max_seq_len_up_to, sub.order[0]) for sub in band.lengths]
    # Top-k at next_n 1, 2 and 4 (ranked by the step up to B = 32, so always banded) and the paged logits at
    # next_n 1 and 2, where the Triton kernel wins at B = 1 and DeepGEMM's above.
    assert banded == 5
    # The 2026-12-03 16:25 tune: SGLang's v2 leads where rows are held in its registers (L~8K: rows <= 12K)
    # and cuda.radix at L~32K, except at next_n 1 with 8 < B <= 32, where cuda.radix leads at both; the
    # paged logits' Triton kernel leads at short rows at B = 1.
    assert subs == SHIPPED_SUB_BANDS, subs
    topk = {p.key.next_n: p for p in overlay.ops[Op.TOPK].preferences if ForwardMode.EXTEND not in p.key.forward_mode}
    assert [b.order[0] for b in topk[2].bands] == ["sglang.topk_v2"] + ["cuda.radix"] * 4
    assert [b.ranked_by for b in topk[2].bands] == ["step", "step", "step", "op", "op"]
