"""The per-batch plan: layout tensors against hand-computed values, build_plan with a real dispatcher,
prepare once per plan, and the checks a backend runs on what it is handed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.contract import check_logits_inputs
from dispatch.contract.errors import DtypeMismatchError, InvalidKeyError, LayoutError
from dispatch.contract.key import Arch, ForwardMode, Fp8Dtype, Op
from dispatch.contract.layout import Layout
from dispatch.step.paged_plan import PagedBatch, build_plan, layout_tensors, visible_lengths
from tests.support.fakes import catalog_of, dispatcher, fake_backend
from tests.support.plans import plan_for
from tests.support.numerics import CPU_LOGITS_TOLERANCE, assert_logits_match

SEQ_LENS = torch.tensor([5, 9, 3], dtype=torch.int32)
PAGES = torch.tensor([[10, 11], [20, 21], [30, 31]], dtype=torch.int32)


def test_native_layout_hand_computed():
    context_lens, block_table = layout_tensors(Layout.NATIVE, SEQ_LENS, PAGES, 3)
    assert context_lens.tolist() == [[3, 4, 5], [7, 8, 9], [1, 2, 3]]
    assert context_lens.dtype == torch.int32
    assert block_table.tolist() == PAGES.tolist()


def test_flatten_layout_hand_computed():
    context_lens, block_table = layout_tensors(Layout.FLATTEN, SEQ_LENS, PAGES, 3)
    assert context_lens.tolist() == [[3], [4], [5], [7], [8], [9], [1], [2], [3]]
    assert context_lens.dtype == torch.int32
    assert block_table.tolist() == [[10, 11]] * 3 + [[20, 21]] * 3 + [[30, 31]] * 3
    assert block_table.dtype == torch.int32


def test_next_n_one_is_plain_decode():
    for layout in (Layout.NATIVE, Layout.FLATTEN):
        context_lens, block_table = layout_tensors(layout, SEQ_LENS, PAGES, 1)
        assert context_lens.tolist() == [[5], [9], [3]]
        assert block_table.tolist() == PAGES.tolist()


def test_lengths_shorter_than_next_n_clamp_at_zero():
    lens = visible_lengths(torch.tensor([1, 2, 0, 4]), 4)
    assert lens.tolist() == [[0, 0, 0, 1], [0, 0, 1, 2], [0, 0, 0, 0], [1, 2, 3, 4]]
    assert lens.dtype == torch.int32


@pytest.mark.parametrize("next_n", range(1, 9))
def test_ragged_lengths_every_next_n(next_n):
    generator = torch.Generator().manual_seed(1000 + next_n)
    batch = 7
    seq_lens = torch.randint(0, 300, (batch,), generator=generator, dtype=torch.int32)
    pages = torch.randint(0, 1000, (batch, 5), generator=generator, dtype=torch.int32)
    expected = [[max(int(length) - next_n + j + 1, 0) for j in range(next_n)] for length in seq_lens]
    native_lens, native_table = layout_tensors(Layout.NATIVE, seq_lens, pages, next_n)
    assert native_lens.tolist() == expected
    assert native_table.tolist() == pages.tolist()
    flat_lens, flat_table = layout_tensors(Layout.FLATTEN, seq_lens, pages, next_n)
    assert flat_lens.tolist() == [[v] for row in expected for v in row]
    assert flat_table.tolist() == [pages[r].tolist() for r in range(batch) for _ in range(next_n)]


def test_tokens_layout_has_no_paged_tensors():
    with pytest.raises(LayoutError, match="`tokens`"):
        layout_tensors(Layout.TOKENS, SEQ_LENS, PAGES, 2)


# --- build_plan with the project's registry and the built-in backends -----------------------------


@pytest.fixture(scope="module")
def cpu_dispatcher():
    from dispatch.deciding.runtime import DEFAULT_REGISTRY, load_dispatcher

    return load_dispatcher(DEFAULT_REGISTRY, arch="cpu", cluster=None, plugins=None)


def batch(next_n=3, mode=ForwardMode.TARGET_VERIFY, seq_lens=SEQ_LENS, pages=PAGES) -> PagedBatch:
    return PagedBatch(
        seq_lens=seq_lens, page_table=pages, max_seq_len=int(seq_lens.max()), forward_mode=mode, next_n=next_n
    )


def test_build_plan_on_the_cpu_chooses_the_reference(cpu_dispatcher):
    plan = build_plan(cpu_dispatcher, batch(), kv_fp8_dtype=torch.float8_e4m3fn)
    assert plan.key.as_dict() == {"arch": "cpu", "forward_mode": "target_verify", "next_n": 3, "fp8_dtype": "e4m3fn"}
    assert (plan.logits.backend, plan.logits.rule, plan.logits.layout) == (
        "torch.reference",
        "cpu-reference",
        Layout.NATIVE,
    )
    assert (plan.indexer_q_quant.backend, plan.indexer_q_quant.rule) == ("torch.reference", "cpu-reference")
    assert plan.logits.plugin == plan.indexer_q_quant.plugin == "backends.reference.plugin"
    assert (plan.batch_size, plan.next_n, plan.max_context_len) == (3, 3, 9)
    assert plan.context_lens.tolist() == [[3, 4, 5], [7, 8, 9], [1, 2, 3]]
    assert plan.block_table.tolist() == PAGES.tolist()
    assert plan.state is None
    assert plan.as_dict()["context_lens_shape"] == [3, 3]


def test_build_plan_takes_the_cache_dtype_by_name_or_torch_dtype(cpu_dispatcher):
    by_torch = build_plan(cpu_dispatcher, batch(), kv_fp8_dtype=torch.float8_e4m3fnuz)
    by_name = build_plan(cpu_dispatcher, batch(), kv_fp8_dtype="e4m3fnuz")
    assert by_torch.fp8_dtype is by_name.fp8_dtype is Fp8Dtype.E4M3FNUZ
    assert by_torch.logits is by_name.logits  # the same cached decision
    with pytest.raises(DtypeMismatchError, match="the K cache has dtype torch.float16"):
        build_plan(cpu_dispatcher, batch(), kv_fp8_dtype=torch.float16)


def test_build_plan_rejects_invalid_batches(cpu_dispatcher):
    with pytest.raises(InvalidKeyError, match="`next_n`"):
        build_plan(cpu_dispatcher, batch(next_n=2, mode=ForwardMode.DECODE), kv_fp8_dtype="e4m3fn")


def lengths(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"seq_lens": lengths(-5, 3), "next_n": 1}, "request 0 has seq_len -5; every request's total length must be at least next_n (1)"),
        ({"seq_lens": lengths(0), "next_n": 1}, "request 0 has seq_len 0"),
        ({"seq_lens": lengths(2, 1), "next_n": 3}, "request 0 has seq_len 2; every request's total length must be at least next_n (3)"),
        ({"seq_lens": lengths(9, 1), "next_n": 2, "max_seq_len": 9}, "request 1 has seq_len 1"),
        ({"seq_lens": lengths(5, 12), "max_seq_len": 9}, "request 1 has seq_len 12, above the batch's max_seq_len 9"),
        ({"max_seq_len": 2}, "request 0 has seq_len 5, above the batch's max_seq_len 2"),
        # On a device only the host-side facts are checked: reading lengths would synchronise.
        ({"seq_lens": SEQ_LENS.to("meta"), "pages": PAGES.to("meta"), "max_seq_len": 2},
         "`max_seq_len` is 2; expected a host int >= next_n (3)"),
        ({"pages": PAGES.to("meta")}, "`page_table` is on meta and `seq_lens` on cpu; expected one device"),
        ({"max_seq_len": torch.tensor(9)}, "`max_seq_len` is tensor(9); expected a host int"),
        ({"max_seq_len": True}, "`max_seq_len` is True"),
        ({"next_n": 0}, "`next_n` is 0; expected an integer >= 1"),
        ({"next_n": 2.0}, "`next_n` is 2.0"),
        ({"seq_lens": lengths(5, 9, 3, dtype=torch.float32)}, "`seq_lens` has dtype torch.float32"),
        ({"seq_lens": SEQ_LENS[:, None]}, "`seq_lens` is a torch.int32 tensor of shape [3, 1]; expected an int32 tensor [B]"),
        ({"seq_lens": [5, 9, 3]}, "`seq_lens` is a list"),
        ({"seq_lens": lengths(), "max_seq_len": 9}, "`seq_lens` is empty"),
        ({"pages": PAGES[:2]}, "`page_table` is a torch.int32 tensor of shape [2, 2]; expected an int32 tensor [B=3, max_pages]"),
        ({"pages": PAGES.long()}, "`page_table` has dtype torch.int64"),
        ({"mode": "prefill"}, "`forward_mode` is 'prefill'"),
    ],
)
def test_a_batch_that_cannot_occur_is_refused_where_built(fields, words):
    from dispatch.contract.errors import DispatchError

    values = {"seq_lens": SEQ_LENS, "pages": PAGES, "max_seq_len": 9, "mode": ForwardMode.TARGET_VERIFY, "next_n": 3}
    values.update(fields)
    if "pages" not in fields and isinstance(values["seq_lens"], torch.Tensor) and values["seq_lens"].dim() == 1:
        values["pages"] = torch.zeros(len(values["seq_lens"]), 2, dtype=torch.int32)
    with pytest.raises(DispatchError) as refused:
        PagedBatch(values["seq_lens"], values["pages"], values["max_seq_len"], values["mode"], values["next_n"])
    assert words in str(refused.value)


def test_a_batch_may_bound_max_seq_len_above_its_longest_request():
    # CUDA graphs capture with a length bound that later batches stay under.
    assert PagedBatch(SEQ_LENS, PAGES, 4096, "target_verify", 3).forward_mode is ForwardMode.TARGET_VERIFY
    assert PagedBatch(lengths(3, 3, 3, dtype=torch.int64), PAGES, 3, ForwardMode.TARGET_VERIFY, 3).next_n == 3


def test_lengths_on_a_device_are_left_to_the_kernels():
    # Not read (no sync): a device tensor of any values passes; the kernels' bounds flag covers it.
    on_device = lengths(-5, 0, 2).to("meta")
    assert PagedBatch(on_device, PAGES.to("meta"), 9, ForwardMode.TARGET_VERIFY, 3).seq_lens is on_device


def test_plan_through_the_ops_matches_the_reference(cpu_dispatcher):
    from dispatch.contract.paged_cache import build_paged_kv_cache
    from backends.reference.paged_mqa_logits import reference_paged_mqa_logits as reference
    from dispatch.contract.ops import paged_mqa_logits

    generator = torch.Generator().manual_seed(7)
    seq_lens = torch.tensor([70, 3, 129], dtype=torch.int32)
    keys = [torch.randn(int(n), 32, generator=generator) for n in seq_lens]
    kv_cache, pages = build_paged_kv_cache(keys, Fp8Dtype.E4M3FN, generator=generator)
    plan = build_plan(cpu_dispatcher, batch(next_n=2, seq_lens=seq_lens, pages=pages), kv_fp8_dtype="e4m3fn")
    q_tokens = torch.randn(6, 4, 32, generator=generator).to(torch.float8_e4m3fn)
    weights = torch.randn(6, 4, generator=generator)
    out = paged_mqa_logits(plan, q_tokens, kv_cache, weights)
    flat_lens, flat_table = layout_tensors(Layout.FLATTEN, seq_lens, pages, 2)
    expected = reference(q_tokens[:, None], kv_cache, weights, flat_lens, flat_table, 129)
    assert out.shape == (6, 129)
    # The plan's flatten layout against the reference's: the same sums, maybe in another order.
    assert_logits_match(out, expected, tolerance=CPU_LOGITS_TOLERANCE)


# --- prepare, once per plan -----------------------------------------------------------------------

PREPARE_REGISTRY = """\
version: 1
ops:
  paged_mqa_logits:
    rules:
      - id: verify
        when: {forward_mode: target_verify}
        use: [scheduled.flatten]
    fallback: [scheduled]
  indexer_q_quant:
    fallback: [quant]
  topk:
    fallback: [topk]
  ragged_mqa_logits:
    fallback: [topk]
"""


def test_prepare_is_called_once_per_plan_in_the_decided_layout():
    calls = []

    def prepare(plan):
        calls.append(plan)
        assert plan.state is None
        return {"schedule": len(calls), "rows": plan.context_lens.shape[0]}

    catalog = catalog_of(
        fake_backend("scheduled", prepare=prepare),
        fake_backend("scheduled.flatten", layout=Layout.FLATTEN, prepare=prepare),
        fake_backend("quant", Op.INDEXER_Q_QUANT),
        fake_backend("topk", Op.TOPK), fake_backend("topk", Op.RAGGED_MQA_LOGITS),
    )
    chooser = dispatcher(PREPARE_REGISTRY, catalog, arch=Arch.CPU)
    first = build_plan(chooser, batch(), kv_fp8_dtype="e4m3fn")
    assert len(calls) == 1
    assert first.state == {"schedule": 1, "rows": 9}
    assert calls[0].layout is Layout.FLATTEN and calls[0].context_lens.shape == (9, 1)
    second = build_plan(chooser, batch(), kv_fp8_dtype="e4m3fn")
    assert len(calls) == 2 and second.state == {"schedule": 2, "rows": 9}
    assert second.logits is first.logits
    decode = build_plan(chooser, batch(next_n=1, mode=ForwardMode.DECODE), kv_fp8_dtype="e4m3fn")
    assert len(calls) == 3 and decode.layout is Layout.NATIVE and decode.state == {"schedule": 3, "rows": 3}


def test_no_prepare_no_state():
    catalog = catalog_of(
        fake_backend("scheduled"),
        fake_backend("scheduled.flatten", layout=Layout.FLATTEN),
        fake_backend("quant", Op.INDEXER_Q_QUANT),
        fake_backend("topk", Op.TOPK), fake_backend("topk", Op.RAGGED_MQA_LOGITS),
    )
    plan = build_plan(dispatcher(PREPARE_REGISTRY, catalog, arch=Arch.CPU), batch(), kv_fp8_dtype="e4m3fn")
    assert plan.state is None and plan.layout is Layout.FLATTEN


# --- what a backend checks ------------------------------------------------------------------------

HEADS, HEAD_DIM = 4, 16


def tagged_plan(layout: Layout, fp8_dtype=Fp8Dtype.E4M3FN):
    seq_lens = torch.tensor([5, 9, 3], dtype=torch.int32)
    return plan_for(fake_backend("tagged", layout=layout), seq_lens, PAGES, 2, fp8_dtype=fp8_dtype)


def inputs(rows, tokens, *, q_dtype=torch.float8_e4m3fn, heads=HEADS, weight_heads=HEADS, row_bytes=HEAD_DIM + 4):
    q = torch.zeros(rows, tokens, heads, HEAD_DIM).to(q_dtype)
    kv_cache = torch.zeros(8, 64, 1, row_bytes, dtype=torch.uint8)
    weights = torch.zeros(rows * tokens, weight_heads)
    return q, kv_cache, weights


@pytest.mark.parametrize("layout, rows, tokens", [(Layout.NATIVE, 3, 2), (Layout.FLATTEN, 6, 1)])
def test_matching_inputs_pass(layout, rows, tokens):
    check_logits_inputs(tagged_plan(layout), *inputs(rows, tokens))


def test_native_plan_refuses_flatten_q():
    with pytest.raises(LayoutError) as error:
        check_logits_inputs(tagged_plan(Layout.NATIVE), *inputs(6, 1))
    message = str(error.value)
    assert "layout `native`" in message and "backend `tagged`" in message and "decided by test" in message
    assert "expects q [3, 2, H, D]; got q [6, 1, 4, 16]" in message


def test_flatten_plan_refuses_native_q():
    with pytest.raises(LayoutError, match=r"layout `flatten`.*expects q \[6, 1, H, D\]; got q \[3, 2, 4, 16\]"):
        check_logits_inputs(tagged_plan(Layout.FLATTEN), *inputs(3, 2))


def test_three_dimensional_q_is_refused():
    q, kv_cache, weights = inputs(3, 2)
    with pytest.raises(LayoutError, match=r"expects q \[3, 2, H, D\]; got q \[6, 4, 16\]"):
        check_logits_inputs(tagged_plan(Layout.NATIVE), q.view(6, HEADS, HEAD_DIM), kv_cache, weights)


def test_wrong_weights_shape():
    with pytest.raises(LayoutError, match=r"expects weights \[6, 4\]; got \[6, 5\]"):
        check_logits_inputs(tagged_plan(Layout.NATIVE), *inputs(3, 2, weight_heads=5))
    q, kv_cache, weights = inputs(3, 2)
    with pytest.raises(LayoutError, match=r"expects weights \[6, 4\]; got \[3, 2, 4\]"):
        check_logits_inputs(tagged_plan(Layout.NATIVE), q, kv_cache, weights.view(3, 2, 4))


def test_wrong_kv_cache_row_bytes():
    with pytest.raises(LayoutError, match=r"kv_cache \[num_blocks, block_kv, 1, D\+4=20\]; got \[8, 64, 1, 16\]"):
        check_logits_inputs(tagged_plan(Layout.NATIVE), *inputs(3, 2, row_bytes=HEAD_DIM))
    with pytest.raises(LayoutError, match=r"D\+4=20\]; got \[8, 64, 1, 132\]"):
        check_logits_inputs(tagged_plan(Layout.NATIVE), *inputs(3, 2, row_bytes=132))


def test_kv_cache_must_be_bytes():
    q, kv_cache, weights = inputs(3, 2)
    with pytest.raises(LayoutError, match="torch.uint8"):
        check_logits_inputs(tagged_plan(Layout.NATIVE), q, kv_cache.to(torch.int8), weights)


def test_q_dtype_must_match_the_plan_fp8_dtype():
    with pytest.raises(DtypeMismatchError) as error:
        check_logits_inputs(tagged_plan(Layout.NATIVE), *inputs(3, 2, q_dtype=torch.float8_e4m3fnuz))
    assert "torch.float8_e4m3fnuz" in str(error.value) and "e4m3fn (torch.float8_e4m3fn)" in str(error.value)
    with pytest.raises(DtypeMismatchError) as error:
        check_logits_inputs(tagged_plan(Layout.NATIVE, Fp8Dtype.E4M3FNUZ), *inputs(3, 2))
    assert "has dtype torch.float8_e4m3fn " in str(error.value) and "e4m3fnuz (torch.float8_e4m3fnuz)" in str(
        error.value
    )


# --- per-token q in the decided layout ------------------------------------------------------------


def test_q_in_layout_native_is_a_request_major_view():
    plan = tagged_plan(Layout.NATIVE)
    q_tokens = torch.arange(6 * HEADS * HEAD_DIM, dtype=torch.float32).view(6, HEADS, HEAD_DIM)
    viewed = plan.q_in_layout(q_tokens)
    assert viewed.shape == (3, 2, HEADS, HEAD_DIM)
    assert viewed.data_ptr() == q_tokens.data_ptr()
    for request in range(3):
        for token in range(2):
            assert torch.equal(viewed[request, token], q_tokens[request * 2 + token])


def test_q_in_layout_flatten_is_one_token_per_row():
    plan = tagged_plan(Layout.FLATTEN)
    q_tokens = torch.randn(6, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    viewed = plan.q_in_layout(q_tokens)
    assert viewed.shape == (6, 1, HEADS, HEAD_DIM)
    assert viewed.data_ptr() == q_tokens.data_ptr()
    assert torch.equal(viewed[:, 0], q_tokens)


def test_q_in_layout_refuses_the_wrong_token_count():
    plan = tagged_plan(Layout.NATIVE)
    with pytest.raises(LayoutError, match=r"q has shape \[5, 4, 16\]; the plan expects per-token q \[B\*N=6, H, D\]"):
        plan.q_in_layout(torch.zeros(5, HEADS, HEAD_DIM))
    with pytest.raises(LayoutError, match="B\\*N=6"):
        plan.q_in_layout(torch.zeros(3, 2, HEADS, HEAD_DIM))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(-3, 40), min_size=1, max_size=6), st.integers(-1, 45))
def test_a_cpu_batch_is_accepted_exactly_when_every_request_can_occur(next_n, values, bound):
    from dispatch.contract.errors import InvalidBatchError

    seq_lens = torch.tensor(values, dtype=torch.int32)
    pages = torch.zeros(len(values), 1, dtype=torch.int32)
    can_occur = all(next_n <= length <= bound for length in values)
    try:
        PagedBatch(seq_lens, pages, bound, ForwardMode.TARGET_VERIFY, next_n)
    except InvalidBatchError as error:
        assert not can_occur
        first_bad = next(i for i, length in enumerate(values) if not next_n <= length <= bound)
        assert f"request {first_bad} has seq_len {values[first_bad]}" in str(error)
    else:
        assert can_occur
