"""How the tests compare numbers: which comparisons are exact, which carry a tolerance, and why.

Exact (`torch.equal`) only where both sides are the same operation on the same values: a copy, a
selection of positions, the bytes of one cast, one function called twice on identical inputs, or a
mask (which positions are -inf or NaN: a decision on lengths and page entries, not on arithmetic).

Everything computed twice in another order is compared by one relative number. fp32 sums of the
same products in another order differ in the last bits, and the order is not ours to fix on a CPU:
MKL picks its kernels by CPU model (`MKL_ENABLE_INSTRUCTIONS=SSE4_2`, `AVX2`, `AVX512` reproduce
each machine), and einsums of different shapes (the native layout against one token at a time) take
different kernels. 1.5e-5 absolute on logits of order 10 was the largest seen; `CPU_LOGITS_TOLERANCE`
leaves room for that while still failing on any wrong key, scale or length (those move the result by
1e-2 or more).

A top-k computed from logits that differ in the last bits may pick another position among near-ties
at the k-th value, so selections from two computations are compared tie-aware: each row's selected
positions are valid and distinct, and the values they select, sorted, are within tolerance of the
reference's sorted top-k values (`assert_selection_matches`). A selection from the very same logits
tensor is compared exactly by value multiset (ties have equal values, so the multiset is unique).
"""

from __future__ import annotations

import torch

# ||out - ref|| / ||ref|| over visible positions for fp32 sums reordered on a CPU (see above).
CPU_LOGITS_TOLERANCE = 1e-5
# Hopper's fp8 tensor-core accumulation is not full fp32: ~2.5e-4 seen on the H200 over D = 128.
GPU_LOGITS_TOLERANCE = 1e-3


def logits_tolerance(device: torch.device | str) -> float:
    return GPU_LOGITS_TOLERANCE if torch.device(device).type == "cuda" else CPU_LOGITS_TOLERANCE


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; the difference alone when ref is all zeros."""
    difference = (out.double() - ref.double()).norm()
    size = ref.double().norm()
    return float(difference / size) if size > 0 else float(difference)


def assert_logits_match(out: torch.Tensor, ref: torch.Tensor, *, tolerance: float, where: torch.Tensor | None = None) -> None:
    """Same shape; the same NaN and -inf positions (exact: masks); one relative error on the rest.

    `where` limits the comparison to those positions (e.g. the visible ones when out's tail is garbage)."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if where is not None:
        out, ref = out[where], ref[where]
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), "NaN positions differ from the reference"
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), "-inf positions differ from the reference"
    assert torch.equal(torch.isposinf(out), torch.isposinf(ref)), "+inf positions differ from the reference"
    finite = torch.isfinite(ref)
    error = relative_error(out[finite], ref[finite])
    assert error < tolerance, f"relative error {error:.3e} >= {tolerance:.0e}"


def assert_selection_matches(indices: torch.Tensor, logits: torch.Tensor, lengths: torch.Tensor, k: int,
                             *, tolerance: float) -> None:
    """Tie-aware: row r of `indices` selects min(k, lengths[r]) distinct positions of [0, lengths[r])
    of the reference `logits`, then -1s, and the values it selects, sorted, are within `tolerance`
    (relative to the row's largest visible magnitude) of the reference's own top-k values."""
    indices, logits, lengths = indices.cpu(), logits.cpu(), lengths.cpu()
    assert indices.shape == (logits.shape[0], k), f"shape {tuple(indices.shape)}"
    for r in range(logits.shape[0]):
        n = int(lengths[r])
        row = logits[r, :n]
        count = min(k, n)
        picked = indices[r, :count].long()
        assert (indices[r, count:] == -1).all(), f"row {r}: slots past {count} must be -1"
        assert ((picked >= 0) & (picked < n)).all(), f"row {r}: position outside [0, {n})"
        assert picked.unique().numel() == count, f"row {r}: repeated position"
        if count == 0:
            continue
        got = row[picked].double().sort().values
        want = torch.topk(row.double(), count).values.sort().values
        scale = float(row.double().abs().max().clamp(min=1e-30))
        worst = float((got - want).abs().max()) / scale
        assert worst <= tolerance, f"row {r}: selected values {worst:.2e} from torch.topk's (tolerance {tolerance:.0e})"
