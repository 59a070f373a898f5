"""The Triton paged logits kernel's optional histogram epilogue (issue 23 item 4, a measurement route):
per logit row, the count of its visible non-NaN logits by first radix digit. Checked against a torch
count of the same digits of the kernel's own output (exact: the same values binned the same way)."""

from __future__ import annotations

import pytest
import torch

from backends.triton.paged_mqa_logits import HIST_BINS, triton_paged_mqa_logits
from dispatch.contract.errors import LayoutError
from tests.backends.test_triton_paged_mqa_logits import BACKENDS, DEVICE, make_case

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def first_digits(values: torch.Tensor) -> torch.Tensor:
    """The top 11 bits of each fp32's order-preserving unsigned key, in torch."""
    bits = values.contiguous().view(torch.int32).long()
    unsigned = torch.where(bits < 0, ~bits & 0xFFFFFFFF, bits | 0x80000000)
    return unsigned >> 21


def torch_histogram(logits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    rows, width = logits.shape
    visible = (torch.arange(width)[None, :] < lengths[:, None]) & ~torch.isnan(logits)
    flat = torch.arange(rows)[:, None] * HIST_BINS + first_digits(logits)
    counts = torch.bincount(flat[visible], minlength=rows * HIST_BINS)
    return counts.view(rows, HIST_BINS).to(torch.int32)


def run_with_histogram(plan, q, cache, weights, **kwargs):
    histogram = torch.zeros(q.shape[0] * q.shape[1], HIST_BINS, dtype=torch.int32, device=DEVICE)
    out = triton_paged_mqa_logits(q, cache, weights, plan.context_lens, plan.block_table, plan.max_context_len,
                                  plan.fp8_dtype, histogram=histogram, **kwargs)
    return out, histogram


@pytest.mark.parametrize("seq_lens,next_n", [([100, 64, 1], 1), ([200, 3, 128], 2), ([0, 4, 130], 4), ([90, 300], 5)])
def test_histogram_counts_each_rows_visible_logits_by_first_digit(seq_lens, next_n):
    plan, q, cache, weights = make_case(seq_lens, next_n, BACKENDS["triton"], extra_pages=1, seed=next_n)
    out, histogram = run_with_histogram(plan, q, cache, weights)
    lengths = plan.token_lengths.cpu().long()
    assert torch.equal(histogram.cpu(), torch_histogram(out.cpu(), lengths))
    assert torch.equal(histogram.sum(dim=1).cpu().long(), lengths.clamp(min=0))


def test_histogram_leaves_the_logits_as_without_it():
    plan, q, cache, weights = make_case([150, 40], 3, BACKENDS["triton"], extra_pages=1, seed=4)
    plain = triton_paged_mqa_logits(q, cache, weights, plan.context_lens, plan.block_table, plan.max_context_len,
                                    plan.fp8_dtype)
    out, _ = run_with_histogram(plan, q, cache, weights)
    assert torch.equal(out, plain)  # same kernel, same inputs; the epilogue only adds counts


def test_histogram_of_negative_and_positive_logits_uses_both_halves():
    plan, q, cache, weights = make_case([300], 1, BACKENDS["triton"], seed=9)
    out, histogram = run_with_histogram(plan, q, cache, weights)
    visible = out[:, :300]
    assert (visible < 0).any() and (visible > 0).any()
    assert histogram[:, : HIST_BINS // 2].sum() == (visible < 0).sum()
    assert histogram[:, HIST_BINS // 2 :].sum() == (visible >= 0).sum()


def test_wrong_histogram_is_refused_naming_it():
    plan, q, cache, weights = make_case([70], 1, BACKENDS["triton"], seed=2)
    for bad in (torch.zeros(1, HIST_BINS, dtype=torch.int64, device=DEVICE),
                torch.zeros(1, HIST_BINS // 2, dtype=torch.int32, device=DEVICE),
                torch.zeros(HIST_BINS, 2, dtype=torch.int32, device=DEVICE).t()[:1]):
        with pytest.raises(LayoutError, match="histogram"):
            triton_paged_mqa_logits(q, cache, weights, plan.context_lens, plan.block_table, plan.max_context_len,
                                    plan.fp8_dtype, histogram=bad)
