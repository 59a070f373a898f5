"""The top-k op: the torch reference against torch.topk row by row on ragged batches and their edge
cases, the page-table transform, bad input, and the op through the plan (decision, lengths, transform,
graph replay check, rank fingerprint)."""

from __future__ import annotations

import pytest
import torch

from backends.reference.topk import topk_indices
from dispatch.engines.agreement import summary
from dispatch.bench.compare import compare_topk
from dispatch.contract.errors import GraphMismatchError, LayoutError
from dispatch.engines.graphs import check_replayable
from dispatch.contract.key import DispatchKey, ForwardMode, Op
from dispatch.contract.ops import topk, topk_rows
from dispatch.step.paged_plan import PagedBatch, build_plan
from dispatch.deciding.runtime import load_dispatcher
from tests.support.fakes import catalog_of, dispatcher, fake_backend
from tests.support.plans import one_op_plan

NAN, NEG_INF = float("nan"), float("-inf")


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def expected_row(row: torch.Tensor, start: int, length: int, k: int) -> tuple[list[float], int]:
    """torch.topk over the row's visible, non-NaN values: (values sorted descending, how many)."""
    visible = row[start : start + length]
    visible = visible[~torch.isnan(visible)]
    take = min(k, visible.numel())
    return torch.topk(visible, take).values.tolist() if take else [], take


def check_against_torch_topk(logits, lengths, k, starts=None):
    out = topk_indices(logits, lengths, k, starts=starts)
    assert out.dtype == torch.int32 and out.shape == (logits.shape[0], k)
    for r in range(logits.shape[0]):
        start = 0 if starts is None else int(starts[r])
        values, take = expected_row(logits[r], start, int(lengths[r]), k)
        chosen = out[r, :take]
        assert (out[r, take:] == -1).all(), f"row {r}: -1 past the {take} selectable keys"
        assert ((chosen >= 0) & (chosen < int(lengths[r]))).all(), f"row {r}: a position outside the row"
        assert len(set(chosen.tolist())) == take, f"row {r}: an index chosen twice"
        got = logits[r, start + chosen.long()]
        assert not torch.isnan(got).any(), f"row {r}: a NaN was selected"
        assert got.tolist() == values, f"row {r}: values {got.tolist()} != torch.topk's {values}"
    return out


@pytest.mark.parametrize("k", [1, 5, 16, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ragged_rows_match_torch_topk(k, seed):
    generator = torch.Generator().manual_seed(seed)
    width = 96
    # Every length class in one batch: 0, 1, < k, = k, > k, the whole width.
    lengths = i32([0, 1, max(k - 1, 0), k, min(k + 7, width), width] + torch.randint(0, width + 1, (10,), generator=generator).tolist())
    logits = torch.randn(lengths.shape[0], width, generator=generator)
    out = check_against_torch_topk(logits, lengths, k)
    assert compare_topk(out, logits, lengths, k) == (0.0, "ok")


def test_ties_choose_distinct_visible_positions():
    logits = torch.zeros(3, 40)
    logits[1, :10] = 2.0
    logits[2] = torch.tensor([1.0, 3.0] * 20)
    out = check_against_torch_topk(logits, i32([25, 25, 31]), 12)
    assert set(out[0].tolist()) <= set(range(25))


def test_minus_inf_is_selectable_and_nan_never_is():
    logits = torch.tensor(
        [
            [NEG_INF] * 8,  # a row of -inf: its visible positions are selected, then -1
            [NAN] * 8,  # a poisoned row: nothing is selectable
            [1.0, NAN, NEG_INF, 2.0, NAN, 0.5, 9.0, 9.0],  # mixed; position 6.. past the length
        ]
    )
    out = check_against_torch_topk(logits, i32([5, 8, 6]), 6)
    assert sorted(out[0, :5].tolist()) == [0, 1, 2, 3, 4] and out[0, 5] == -1
    assert (out[1] == -1).all()
    assert out[2].tolist() == [3, 0, 5, 2, -1, -1]


def test_past_the_length_is_never_read():
    # Garbage (here: huge values and NaN) past each row's length must not change the answer.
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=generator)
    lengths = i32([0, 3, 17, 20, 49, 50])
    clean = topk_indices(logits, lengths, 8)
    dirty = logits.clone()
    for r, length in enumerate(lengths.tolist()):
        dirty[r, length:] = 1e30 if r % 2 else NAN
    # Exact: the same function on the same visible values (random normals: no ties).
    assert torch.equal(topk_indices(dirty, lengths, 8), clean)


def test_k_wider_than_the_logits_and_a_strided_view():
    generator = torch.Generator().manual_seed(4)
    wide = torch.randn(4, 20, generator=generator)
    view = wide[:, :12]  # a row stride of 20, last dim contiguous
    out = check_against_torch_topk(view, i32([12, 0, 5, 11]), 30)
    assert out.shape == (4, 30) and (out[:, 12:] == -1).all()


def test_starts_select_within_each_rows_window_relative_to_its_start():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 64, generator=generator)
    starts, lengths = i32([0, 10, 30, 63, 64]), i32([20, 5, 34, 1, 0])
    check_against_torch_topk(logits, lengths, 8, starts=starts)


def test_sorted_orders_by_value_descending_minus_ones_last():
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 30, generator=generator)
    lengths = i32([30, 3, 0, 17])
    out = topk_indices(logits, lengths, 10, sorted=True)
    for r in range(4):
        taken = out[r][out[r] >= 0]
        values = logits[r, taken.long()]
        assert torch.equal(values, values.sort(descending=True).values)
        assert (out[r, taken.numel() :] == -1).all()


def test_page_transform_gives_physical_slots():
    block = 4
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 12, generator=generator)
    lengths = i32([12, 6, 0])
    page_table = i32([[7, 2, 5], [1, 9, 0]])
    page_rows = i32([0, 1, 1])
    positions = topk_indices(logits, lengths, 8)
    slots = topk_indices(logits, lengths, 8, page_table=page_table, page_rows=page_rows, block_size=block)
    for r in range(3):
        for p, s in zip(positions[r].tolist(), slots[r].tolist()):
            expected = -1 if p < 0 else int(page_table[page_rows[r], p // block]) * block + p % block
            assert s == expected


def through_the_op(*args, **kwargs):
    """The top-k op's host-side call onto the reference: its input checks run there, once, before any
    backend (dispatch/contract/ops/top_k.py), so every top-k backend refuses alike."""
    return topk_rows(one_op_plan(Op.TOPK, topk_indices), *args, **kwargs)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: through_the_op(torch.zeros(2, 8, dtype=torch.float16), i32([1, 1]), 4), "fp32 logits"),
        (lambda: through_the_op(torch.zeros(2, 8), i32([1]), 4), "lengths int32 \\[2\\]"),
        (lambda: through_the_op(torch.zeros(2, 8), torch.tensor([1, 1]), 4), "lengths int32"),
        (lambda: through_the_op(torch.zeros(2, 8), i32([1, 9]), 4), "reach column 9"),
        (lambda: through_the_op(torch.zeros(2, 8), i32([4, 4]), 4, starts=i32([0, 5])), "reach column 9"),
        (lambda: through_the_op(torch.zeros(2, 8), i32([1, -1]), 4), ">= 0"),
        (lambda: through_the_op(torch.zeros(2, 8), i32([1, 1]), 0), "k an integer >= 1"),
        (lambda: through_the_op(torch.zeros(2, 8).t(), i32([1] * 8), 1), "contiguous last dim"),
        (lambda: through_the_op(torch.zeros(2, 8), i32([1, 1]), 4, page_table=i32([[0]])), "both page_table"),
    ],
)
def test_bad_input_is_a_layout_error_naming_the_tensor(call, message):
    with pytest.raises(LayoutError, match=message):
        call()


# --- the op through the plan ------------------------------------------------------------------------


def cpu_batch(seq_lens=(9, 17, 30), next_n=3, mode=ForwardMode.TARGET_VERIFY, pages=None):
    lengths = list(seq_lens)
    table = pages if pages is not None else torch.arange(len(lengths) * 8, dtype=torch.int32).view(len(lengths), 8)
    return PagedBatch(i32(lengths), table, max(lengths), mode, next_n)


def test_the_plan_decides_topk_once_and_the_op_uses_its_per_token_lengths():
    chooser = load_dispatcher(arch="cpu")
    plan = build_plan(chooser, cpu_batch(), kv_fp8_dtype="e4m3fn")
    assert (plan.topk.backend, plan.topk.rule) == ("torch.reference", "cpu-reference")
    assert plan.topk.rule_at.startswith(f"{chooser.document.path}:")
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(9, 30, generator=generator)
    out = topk(plan, logits, 8)
    lengths = plan.token_lengths
    assert lengths.tolist() == [7, 8, 9, 15, 16, 17, 28, 29, 30]
    assert torch.equal(out, topk_indices(logits, lengths, 8))  # exact: the op calls this very function


@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND])
def test_transform_to_slots_through_the_plans_block_table(mode):
    dispatcher = load_dispatcher(arch="cpu")
    pages = torch.randperm(64, generator=torch.Generator().manual_seed(9)).to(torch.int32).view(4, 16)
    plan = build_plan(dispatcher, cpu_batch((70, 5, 130, 64), 2, mode, pages), kv_fp8_dtype="e4m3fn")
    logits = torch.randn(8, 130, generator=torch.Generator().manual_seed(10))
    positions = topk(plan, logits, 16)
    slots = topk(plan, logits, 16, transform_to_slots=True, block_size=64)
    for token in range(8):
        request = token // 2
        for p, s in zip(positions[token].tolist(), slots[token].tolist()):
            assert s == (-1 if p < 0 else int(pages[request, p // 64]) * 64 + p % 64)


def test_a_batch_whose_topk_decision_differs_is_refused_for_replay():
    text = """\
    version: 1
    ops:
      paged_mqa_logits:
        fallback: [logits]
      indexer_q_quant:
        fallback: [quant]
      topk:
        rules:
          - id: verify-fast
            when: {forward_mode: target_verify}
            use: [fast]
        fallback: [plain]
      ragged_mqa_logits:
        rules:
          - id: verify-fast
            when: {forward_mode: target_verify}
            use: [fast]
        fallback: [plain]
    """
    catalog = catalog_of(
        fake_backend("logits"), fake_backend("quant", Op.INDEXER_Q_QUANT),
        fake_backend("fast", Op.TOPK), fake_backend("plain", Op.TOPK),
    )
    chooser = dispatcher(text, catalog)
    captured = build_plan(chooser, cpu_batch(), kv_fp8_dtype="e4m3fn")
    draft = cpu_batch(mode=ForwardMode.DRAFT_EXTEND)
    with pytest.raises(GraphMismatchError, match=r"topk: this batch .* decides `plain`.*captured with `fast`"):
        check_replayable(captured, draft, build_plan(chooser, draft, kv_fp8_dtype="e4m3fn"))


def test_the_rank_fingerprint_covers_topk():
    key = DispatchKey("cpu", "decode", 1, "e4m3fn")
    fields = summary(load_dispatcher(arch="cpu"), [key])
    assert fields[f"topk @ {key}"] == "torch.reference (rows, cpu-reference)"


def test_gpu_archs_decide_a_gpu_topk_before_the_reference():
    # A what-if for each GPU arch (availability is not checked for another machine's key).
    for arch, fp8 in [("sm80", "e4m3fn"), ("sm89", "e4m3fn"), ("sm90", "e4m3fn"), ("sm100", "e4m3fn"),
                      ("gfx942", "e4m3fnuz"), ("gfx950", "e4m3fn")]:
        decision = load_dispatcher(arch=arch).decide(Op.TOPK, DispatchKey(arch, "target_verify", 2, fp8))
        # sm90's paged modes lead with dispatch's CUDA top-k, measured ahead of Triton there (rule
        # sm90-cuda-radix-measured); sm100 names the engines' kernels after Triton's, unmeasured.
        expected = {"sm90": ("cuda.radix", "sm90-cuda-radix-measured"),
                    "sm100": ("triton", "sm90-sm100-engine-topk-unmeasured")}.get(arch, ("triton", "gpu-triton"))
        assert (decision.backend, decision.rule) == expected, arch
        assert decision.layout.value == "rows"
    # Prefill too: measured ahead of Triton with row starts (4096 rows, windows 1..16K, H200 17:10 UTC).
    extend = load_dispatcher(arch="sm90").decide(Op.TOPK, DispatchKey("sm90", "extend", 1, "e4m3fn"))
    assert (extend.backend, extend.rule) == ("cuda.radix", "sm90-cuda-radix-measured")
