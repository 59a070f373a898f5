"""nan_poisoned_rows: NaN across the rows whose guard length is negative, every other element untouched."""

from __future__ import annotations

import pytest
import torch

from backends.shared.poisoned_rows import nan_poisoned_rows
from dispatch.contract.errors import LayoutError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,width", [(5, 3000), (1, 1), (4, 1024), (3, 0)])
def test_only_poisoned_rows_become_nan(rows, width):
    gen = torch.Generator().manual_seed(rows * 7 + width)
    wide = torch.randn(rows, width + 17, generator=gen)
    logits = wide[:, 3 : 3 + width].to(DEVICE)  # a strided slice: the row stride is not the width
    before = logits.clone()
    lens = torch.randint(0, max(width, 1), (rows,), generator=gen, dtype=torch.int32)
    lens[::2] = -1
    out = nan_poisoned_rows(logits, lens.to(DEVICE))
    assert out.data_ptr() == logits.data_ptr()
    poisoned = (lens < 0).to(DEVICE)
    assert torch.isnan(out[poisoned]).all()
    assert torch.equal(out[~poisoned], before[~poisoned])  # exact: untouched memory


def test_nothing_poisoned_writes_nothing():
    logits = torch.randn(6, 300, device=DEVICE)
    before = logits.clone()
    nan_poisoned_rows(logits, torch.full((2, 3), 5, dtype=torch.int32, device=DEVICE))  # [R, N] lens, flattened
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "logits,lens,message",
    [
        (torch.randn(4, 8, dtype=torch.float64), torch.zeros(4, dtype=torch.int32), "logits must be fp32"),
        (torch.randn(4, 8).t(), torch.zeros(8, dtype=torch.int32), "unit column stride"),
        (torch.randn(4, 8), torch.zeros(3, dtype=torch.int32), "one entry per logits row"),
        (torch.randn(4, 8), torch.zeros(4, dtype=torch.int64), "lens must be contiguous int32"),
    ],
)
def test_bad_tensors_are_named(logits, lens, message):
    with pytest.raises(LayoutError, match=message):
        nan_poisoned_rows(logits, lens)
