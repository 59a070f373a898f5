"""`cuda.radix`'s first digit on the CPU: a model of radix_select.cu's fine_digit, fine_bin_keys and the
register select built on them (round 1 on the digit, the threshold bin ranked when it holds at most
kRankCap keys, else the exact key rounds), checked against torch.topk on rows built to break it: every
key in one bin, bins just under and over kRankCap, ties at the threshold, values past 2^16 and +-inf,
denormals and signed zeros, -inf and NaN mixes. The constants are read from the kernel's source, so the
model follows an edit of them; the same rows run through the kernel itself in test_cuda_topk.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

SOURCE = (Path(__file__).resolve().parents[2] / "backends/cuda_topk/radix_select.cu").read_text()
FINE_BITS = int(re.search(r"constexpr int kFineBits = (\d+);", SOURCE).group(1))
RANK_CAP = int(re.search(r"constexpr int kRankCap = (\d+);", SOURCE).group(1))
HALF = 1 << (FINE_BITS - 1)
SHIFT = 23 - (FINE_BITS - 6)
LOW = (127 - 16) << (FINE_BITS - 6)
NAN, INF = float("nan"), float("inf")


def ordered_keys(values: np.ndarray) -> np.ndarray:
    """radix_select.cu's ordered_key: unsigned order is value order, NaN -> 0."""
    bits = values.astype(np.float32).view(np.uint32)
    keys = np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)
    keys[np.isnan(values)] = 0
    return keys


def fine_digit(keys: np.ndarray) -> np.ndarray:
    positive = (keys >> 31) == 1
    magnitude = np.where(positive, keys, ~keys) & 0x7FFFFFFF
    m = np.clip((magnitude >> SHIFT).astype(np.int64) - LOW, 0, HALF - 1)
    return np.where(positive, HALF + m, HALF - 1 - m)


def fine_bin_keys(b: int) -> tuple[int, int]:
    positive = b >= HALF
    m = b - HALF if positive else HALF - 1 - b
    lowest = 0 if m == 0 else (m + LOW) << SHIFT
    highest = 0x7FFFFFFF if m == HALF - 1 else ((m + 1 + LOW) << SHIFT) - 1
    if positive:
        return 0x80000000 | lowest, 0x80000000 | highest
    return 0x7FFFFFFF - highest, 0x7FFFFFFF - lowest


def model_select(values: np.ndarray, k: int) -> tuple[np.ndarray, str]:
    """The positions the kernel's register select takes, and which path took them."""
    keys = ordered_keys(values).astype(np.int64)
    live = keys != 0
    if live.sum() <= k:
        return np.flatnonzero(live), "all"
    digits = fine_digit(keys.astype(np.uint32))
    hist = np.bincount(digits[live], minlength=2 * HALF)
    above_counts = np.cumsum(hist[::-1])[::-1] - hist  # keys in bins above each bin
    b0 = int(np.flatnonzero((above_counts < k) & (above_counts + hist >= k)).max())
    need = k - int(above_counts[b0])
    lo, hi = fine_bin_keys(b0)
    above = np.flatnonzero(keys > hi)
    tie = np.flatnonzero(live & (keys >= lo) & (keys <= hi))
    assert above.size == above_counts[b0] and tie.size == hist[b0], "the bounds must hold exactly the bin's keys"
    if tie.size <= RANK_CAP:
        # rank_ties: larger keys first, equal keys in list order; the need lowest ranks are taken.
        tk = keys[tie]
        rank = np.array([(tk > x).sum() + (tk[:i] == x).sum() for i, x in enumerate(tk)])
        assert sorted(rank.tolist()) == list(range(tie.size))
        return np.concatenate([above, tie[rank < need]]), "ranked"
    # The key rounds: the threshold key among all keys, then the ones above it and enough equal to it.
    threshold = np.sort(keys[live])[-k]
    over = np.flatnonzero(keys > threshold)
    equal = np.flatnonzero(keys == threshold)[: k - over.size]
    return np.concatenate([over, equal]), "key rounds"


def adversarial_rows(width: int, gen: torch.Generator) -> torch.Tensor:
    """Rows aimed at the fine digit (k = 2048): see the module's docstring; row 0 is plain randn."""
    def uniform(n, lo, hi):
        return lo + (hi - lo) * torch.rand(n, generator=gen)

    rows = []
    rows.append(torch.randn(width, generator=gen))
    rows.append(uniform(width, 1.0, 1.0 + 2.0**-7))  # every key in one bin: the key rounds
    for in_bin in (RANK_CAP - 1, RANK_CAP, RANK_CAP + 1, min(1000, width - 2000)):  # at the rank cap
        row = torch.cat([uniform(1900, 10.0, 1000.0), uniform(in_bin, 1.0, 1.0 + 2.0**-7)])
        rows.append(torch.cat([row, uniform(width - row.numel(), -1000.0, -10.0)]))
    ties = torch.tensor([1.0 + i * 2.0**-10 for i in range(4)])[torch.randint(0, 4, (200,), generator=gen)]
    row = torch.cat([uniform(1990, 10.0, 1000.0), ties])  # ties at the threshold inside a ranked bin
    rows.append(torch.cat([row, uniform(width - row.numel(), -1000.0, -10.0)]))
    rows.append(torch.randn(width, generator=gen) * 1e6)  # past 2^16: the outermost bins
    big = torch.randn(width, generator=gen).sign() * torch.exp(uniform(width, 11.0, 88.0))
    big[::97] = INF
    big[1::89] = -INF
    rows.append(big)
    rows.append(torch.randn(width, generator=gen) * 1e-40)  # denormals, next to zero
    tiny = torch.randn(width, generator=gen) * 1e-6
    tiny[::3] = 0.0
    tiny[1::3] = -0.0
    rows.append(tiny)
    mix = torch.randn(width, generator=gen)
    mix[::2] = NAN
    mix[1::4] = -INF  # the threshold among the -inf keys: bin 0 beside NaN's key
    rows.append(mix)
    mix = torch.randn(width, generator=gen)
    mix[: width // 3] = NAN
    mix[width // 3: width // 3 + 5] = INF
    rows.append(mix)
    rows.append(torch.full((width,), -3.0))  # all equal
    return torch.stack(rows)


def test_the_digit_is_monotone_and_each_bin_s_keys_are_its_bounds():
    magnitudes = np.array([(m + LOW) << SHIFT for m in range(1, HALF)], dtype=np.int64)  # each bin's lowest
    edges = np.concatenate([0x80000000 | magnitudes, 0x7FFFFFFF - magnitudes])
    probes = np.concatenate([edges - 1, edges, edges + 1,
                             [1, 0x007FFFFF, 0x7FFFFFFF, 0x80000000, 0xFF800000, 0xFFFFFFFF]])
    rng = np.random.default_rng(0)
    probes = np.unique(np.concatenate([probes, rng.integers(1, 2**32, 200_000)])).astype(np.uint32)
    digits = fine_digit(probes)
    assert (np.diff(digits) >= 0).all() and digits.min() == 0 and digits.max() == 2 * HALF - 1
    for b in range(2 * HALF):
        lo, hi = fine_bin_keys(b)
        assert fine_digit(np.array([lo, hi], dtype=np.uint32)).tolist() == [b, b], b
        if b > 0:
            assert fine_digit(np.array([lo - 1], dtype=np.uint32))[0] == b - 1
        if b < 2 * HALF - 1:
            assert fine_digit(np.array([hi + 1], dtype=np.uint32))[0] == b + 1


def test_randn_rows_leave_a_threshold_bin_the_ranks_settle():
    # What the digit is for: at the benchmark's widths randn's threshold bin holds tens of keys.
    rng = np.random.default_rng(1)
    for width in (2400, 8192, 12288, 49152, 98304):
        keys = ordered_keys(rng.standard_normal(width).astype(np.float32))
        digits = fine_digit(keys)
        kth = np.sort(keys)[-2048]
        assert (digits == fine_digit(np.array([kth], dtype=np.uint32))[0]).sum() <= RANK_CAP, width


@pytest.mark.parametrize("width", [3000, 5000, 8192])
def test_the_model_matches_torch_topk_on_rows_built_against_the_digit(width):
    k = 2048
    rows = adversarial_rows(width, torch.Generator().manual_seed(width))
    paths = set()
    for r, row in enumerate(rows):
        picked, path = model_select(row.numpy(), k)
        paths.add(path)
        finite = row[~row.isnan()]
        want = torch.topk(finite, min(k, finite.numel())).values.sort().values
        assert np.unique(picked).size == picked.size == want.numel(), f"row {r} ({path})"
        assert torch.equal(row[torch.from_numpy(picked)].sort().values, want), f"row {r} ({path})"
    assert {"ranked", "key rounds"} <= paths
