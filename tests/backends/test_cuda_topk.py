"""`cuda.radix`, dispatch's own CUDA top-k: exact against torch.topk on a GPU (value multisets equal,
tie-aware, NaN never selected, -inf selectable, nothing past a row read), and, on any machine, why it
cannot run where it cannot and its registration (the probe, the build and its cache: test_cuda_topk_build.py).

The GPU tests compile backends/cuda_topk/radix_select.cu on first use (cached per user); `stage`
below forces the kernel to stage only part of each row in shared memory, so the re-read of a row's
tail runs at small widths too; `cta` runs each of the kernel's instances (512 and 1024 threads, and the
short-list one at 512) whatever the host would pick.
"""

from __future__ import annotations

import pytest
import torch

from backends.adapted_topk import page_slots
from backends.cuda_topk import build
from backends.cuda_topk.plugin import cuda_topk_backends
from dispatch.contract import Arch, LayoutError
from tests.backends.test_triton_topk import check, random_logits, ragged_lengths

NAN, INF = float("nan"), float("inf")
gpu = pytest.mark.gpu


def radix(*args, stage=None, filtered=True, cta=None, **kwargs):
    """The served call, or (stage or cta given) the launch with that staging, path and kernel instance
    (cta: (threads, short_list), one of radix_topk.INSTANCES)."""
    from backends.cuda_topk.radix_topk import launch, radix_topk

    if stage is None and cta is None:
        return radix_topk(*args, **kwargs)
    options = {"starts": None, "page_table": None, "page_rows": None, "block_size": 64, "sorted": False, **kwargs}
    threads, short_list = cta or (None, None)
    return launch(*args, stage=stage or 0, filtered=filtered, threads=threads, short_list=short_list, **options)


INSTANCES = [(512, False), (1024, False), (512, True)]
CTAS = pytest.mark.parametrize("cta", INSTANCES, ids=["t512", "t1024", "t512-short-list"])


# ---- on a GPU: exactness ----

@gpu
@pytest.mark.parametrize(("rows", "width", "k", "seed"), [
    (12, 300, 16, 0), (37, 3000, 2048, 1), (64, 12215, 2048, 2), (9, 5000, 100, 3), (5, 70001, 2048, 4),
    (3, 100000, 4096, 5), (130, 49081, 2048, 6), (2, 2500, 1, 7), (7, 8192, 2048, 8), (6, 8193, 2048, 9),
])
@pytest.mark.parametrize("cta", [None, *INSTANCES], ids=["served", "t512", "t1024", "t512-short-list"])
def test_random_ragged_rows_match_torch_topk(rows, width, k, seed, cta):
    gen = torch.Generator().manual_seed(seed)
    logits = random_logits(rows, width, gen)
    lengths = ragged_lengths(rows, width, k, gen)
    check(logits, lengths, k, radix(logits.cuda(), lengths.cuda(), k, cta=cta))


# filtered=False: the full select (what a row the filtered pass cannot serve gets), its row staged in
# part (stage keys) or not at all, the rest re-read.
@gpu
@pytest.mark.parametrize(("stage", "filtered"), [(0, True), (0, False), (4, False), (1000, False), (2048, False),
                                                 (12000, False)])
@pytest.mark.parametrize("row_stride", [None, 10003])  # a stride of 10003 floats: rows start off 16-byte boundaries
@pytest.mark.parametrize("width", [5000, 10000])  # short rows in registers; sampled cuts
@CTAS
def test_both_paths_staged_in_part_and_misaligned_rows(stage, filtered, row_stride, width, cta):
    gen = torch.Generator().manual_seed(stage + width)
    logits = random_logits(11, width, gen, row_stride=row_stride)
    lengths = ragged_lengths(11, width, 2048, gen)
    out = radix(logits.cuda(), lengths.cuda(), 2048, stage=stage, filtered=filtered, cta=cta)
    check(logits, lengths, 2048, out)


@gpu
@pytest.mark.parametrize(("stage", "filtered"), [(None, True), (1000, False), (0, False)])
@pytest.mark.parametrize("width", [9000, 5000])
@CTAS
def test_ties_inf_and_nan_rows(stage, filtered, width, cta):
    gen = torch.Generator().manual_seed(9)
    k = 2048
    logits = random_logits(10, width, gen).clone()
    logits[0] = 2.0  # one value: every key ties with the threshold, the candidate list overflows
    logits[1, ::2] = NAN  # half NaN: more than k selectable still
    logits[2, 100:] = NAN  # fewer than k selectable: all of them, then -1
    logits[3] = NAN  # a poisoned row: all -1
    logits[4, :3000] = -INF  # -inf is an ordinary (lowest) key
    logits[5] = -INF
    logits[6, 17] = INF
    logits[6, 4000:4100] = INF
    logits[7] = torch.randint(0, 4, (width,), generator=gen).float()  # few distinct values, many ties
    logits[8] = torch.randn(width, generator=gen) * 1e-30  # subnormal and tiny keys
    logits[9, :] = -0.0
    logits[9, ::3] = 0.0
    lengths = torch.full((10,), width, dtype=torch.int32)
    lengths[5] = 10
    check(logits, lengths, k, radix(logits.cuda(), lengths.cuda(), k, stage=stage, filtered=filtered, cta=cta))


def crowded_rows(width, gen):
    """Rows that crowd or empty the bins of a value-binned first digit (k = 2048): every key inside
    one 1/128-octave band, a threshold band of 255-257 or up to 1000 keys, four distinct values tied at
    the threshold, values past 2^16 and +-inf, denormals, signed zeros among tiny values, -inf and NaN
    mixes (the threshold among the -inf keys), one value. Row 0 is plain randn."""
    def uniform(n, lo, hi):
        return lo + (hi - lo) * torch.rand(n, generator=gen)

    def banded(top, band):  # `top` keys far above a band of values just over 1.0, the rest far below
        row = torch.cat([uniform(top, 10.0, 1000.0), band])
        return torch.cat([row, uniform(width - row.numel(), -1000.0, -10.0)])

    rows = [torch.randn(width, generator=gen), uniform(width, 1.0, 1.0 + 2.0**-7)]
    rows += [banded(1900, uniform(n, 1.0, 1.0 + 2.0**-7)) for n in (255, 256, 257, min(1000, width - 2000))]
    ties = torch.tensor([1.0 + i * 2.0**-10 for i in range(4)])[torch.randint(0, 4, (200,), generator=gen)]
    rows.append(banded(1990, ties))
    rows.append(torch.randn(width, generator=gen) * 1e6)
    big = torch.randn(width, generator=gen).sign() * torch.exp(uniform(width, 11.0, 88.0))
    big[::97], big[1::89] = INF, -INF
    rows.append(big)
    rows.append(torch.randn(width, generator=gen) * 1e-40)
    tiny = torch.randn(width, generator=gen) * 1e-6
    tiny[::3], tiny[1::3] = 0.0, -0.0
    rows.append(tiny)
    mix = torch.randn(width, generator=gen)
    mix[::2], mix[1::4] = NAN, -INF
    rows.append(mix)
    mix = torch.randn(width, generator=gen)
    mix[: width // 3], mix[width // 3: width // 3 + 5] = NAN, INF
    rows.append(mix)
    rows.append(torch.full((width,), -3.0))
    return torch.stack(rows)


# Round 8 (docs/internal/benchmark-history.md) built a fine first digit against these rows; the kernel
# kept is exact on them too. Rows of 3000 and 8192 keys sit in registers (and of 16384 at 1024 threads,
# the most a thread's 16 keys hold there); at 30000 and 40000 the filtered pass's list (or the full select,
# where the short list overflows) selects, its digits over [cut, the list's largest key].
@gpu
@pytest.mark.parametrize("width", [3000, 8192, 16384, 30000, 40000])
@pytest.mark.parametrize("cta", [None, *INSTANCES], ids=["served", "t512", "t1024", "t512-short-list"])
def test_rows_that_crowd_a_value_binned_digit(width, cta):
    logits = crowded_rows(width, torch.Generator().manual_seed(width))
    lengths = torch.full((logits.shape[0],), width, dtype=torch.int32)
    check(logits, lengths, 2048, radix(logits.cuda(), lengths.cuda(), 2048, cta=cta))


def threshold_bin_rows(width, gen):
    """Short rows (k = 2048) at each end of the first round's threshold bin (the keys' top 11 bits: 4 bins
    an octave): a bin of exactly the 48 keys still needed (taken whole), one of exactly 20 (ranked), 33
    ties beside 12 neighbours in their bin (crowded: the next rounds), one outlier of 1e30, values of
    +-2e38, spreads of up to +-1.7e38, subnormals, and randn with a few +-inf. The same rows tested a
    value-binned first round (measured slower and not kept, docs/internal/benchmark-history.md), whose
    edges they were built for: a range that overflows, one just finite, an infinite bin scale."""
    def far(n, lo, hi):
        return lo + (hi - lo) * torch.rand(n, generator=gen)

    def exact_bin(ties):  # 2048 - ties keys far above, `ties` equal keys alone in their bin, the rest far below
        row = torch.cat([far(2048 - ties, 10.0, 1000.0), torch.full((ties,), 5.0)])
        return torch.cat([row, far(width - row.numel(), -1000.0, -10.0)])

    crowded = exact_bin(33)
    crowded[2048:2060] = 5.0 + torch.arange(1, 13) * 0.01  # the 5.0 bin's neighbours: 45 keys, 33 tied
    outlier = torch.randn(width, generator=gen)
    outlier[7] = 1e30
    infs = torch.randn(width, generator=gen)
    infs[::501], infs[3::701] = INF, -INF
    rows = [exact_bin(48), exact_bin(20), crowded, outlier, torch.randn(width, generator=gen).sign() * 2e38,
            torch.randn(width, generator=gen).sign() * 1.7e38 * torch.rand(width, generator=gen),
            torch.randn(width, generator=gen) * 1e-42, infs]
    return torch.stack(rows)


# Rows of 3000, 8192 and 16384 keys sit in registers (radix_select.cu's short_row); each instance serves them.
@gpu
@pytest.mark.parametrize("width", [3000, 8192, 16384])
@pytest.mark.parametrize("cta", [None, *INSTANCES], ids=["served", "t512", "t1024", "t512-short-list"])
def test_short_rows_whose_threshold_bin_is_taken_ranked_or_split(width, cta):
    logits = threshold_bin_rows(width, torch.Generator().manual_seed(width + 1))
    lengths = torch.full((logits.shape[0],), width, dtype=torch.int32)
    check(logits, lengths, 2048, radix(logits.cuda(), lengths.cuda(), 2048, cta=cta))


def list_window_rows(n: int, gen) -> torch.Tensor:
    """Rows of n keys whose candidate list spans a window [cut, its largest key] of every width: 3000
    keys one ulp apart above the rest (a window of a few thousand keys: one digit and ties), 3000 keys of
    one value (a window of one key), a cut among negative keys with 100 keys near the float maximum (a
    window crossing the sign: the widest digits), and a list whose threshold bin holds just the keys
    still needed after one round (the search ends there)."""
    def below() -> torch.Tensor:
        return -10.0 - torch.rand(n, generator=gen)

    def place(row: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        row[torch.randperm(n, generator=gen)[: values.numel()]] = values
        return row

    ulps = torch.arange(3000, dtype=torch.int32) + torch.tensor(1.0).view(torch.int32)
    wide = torch.randn(n, generator=gen) - 10.0
    wide[torch.randperm(n, generator=gen)[:100]] = 3.0e38 * torch.rand(100, generator=gen)
    spaced = torch.cat([torch.full((1000,), 4.0), 4.0 + torch.arange(1, 1049) * 0.5, torch.full((2000,), 1.5)])
    return torch.stack([place(below(), ulps.view(torch.float32)), place(below(), torch.full((3000,), 5.0)), wide,
                        place(below(), spaced)])


@gpu
@pytest.mark.parametrize("cta", [None, *INSTANCES], ids=["served", "t512", "t1024", "t512-short-list"])
def test_the_list_window_from_one_key_to_both_signs(cta):
    for n in (40000, 20000):
        logits = list_window_rows(n, torch.Generator().manual_seed(n))
        lengths = torch.full((logits.shape[0],), n, dtype=torch.int32)
        check(logits, lengths, 2048, radix(logits.cuda(), lengths.cuda(), 2048, cta=cta))


def sample_positions(n: int) -> torch.Tensor:
    """Where candidate_cut (radix_select.cu) samples a row of n keys: 4 adjacent keys at 256 spots."""
    j = torch.arange(1024)
    step = n // 256
    return (j // 4) * step + step // 2 + j % 4


def exact_cut_rows(n: int, gen) -> torch.Tensor:
    """Rows of n keys (past every list, so the sampled cut runs) whose sample is placed, each with 3000
    keys outside the sample above the cut (so the list holds at least k): the cut's bin (the sample's
    86th largest at n = 40000, k = 2048) holding 256 sample keys (ranked: the exact cut) or 257 (its
    lower edge is the cut); 100 sample keys of one value, tied with 3000 more in the row (the cut is that
    value, ties and all); a sample far above the rest (the cut leaves fewer than k: the full select);
    the row's other keys crowding the cut's bin (the list overflows: the full select)."""
    at = sample_positions(n)
    outside = torch.ones(n, dtype=torch.bool)
    outside[at] = False
    outside = outside.nonzero().flatten()

    def row(high: int, in_bin: torch.Tensor, rest: tuple[float, float], above: int = 3000,
            ties: int = 0) -> torch.Tensor:
        out = rest[0] + (rest[1] - rest[0]) * torch.rand(n, generator=gen)
        spots = outside[torch.randperm(outside.numel(), generator=gen)[:above + ties]]
        out[spots[:above]] = 2.0 + 8.0 * torch.rand(above, generator=gen)
        if ties:
            out[spots[above:]] = float(in_bin[0])
        sample = torch.cat([100.0 + torch.rand(high, generator=gen), in_bin,
                            -10.0 - torch.rand(1024 - high - in_bin.numel(), generator=gen)])
        out[at[torch.randperm(1024, generator=gen)]] = sample
        return out

    def band(count: int) -> torch.Tensor:  # distinct values inside the one 11-bit bin [1.0, 1.25)
        return 1.0 + 0.24 * torch.rand(count, generator=gen)

    return torch.stack([
        row(50, band(256), (-5.0, 0.9)),
        row(50, band(257), (-5.0, 0.9)),
        row(50, torch.full((100,), 1.1), (-5.0, 0.9), above=0, ties=3000),
        row(1024, torch.empty(0), (-1.0, 1.0), above=0),
        row(50, band(256), (1.0, 1.25)),
    ])


@gpu
@pytest.mark.parametrize("cta", [None, *INSTANCES], ids=["served", "t512", "t1024", "t512-short-list"])
def test_the_sampled_cut_exact_crowded_tied_and_misjudged(cta):
    """The filtered pass's cut is the sample's r-th largest key (its bin's sample keys ranked), or its
    bin's lower edge where the bin is crowded: exact either way, and where the cut leaves fewer than k."""
    for n in (40000, 12000):
        logits = exact_cut_rows(n, torch.Generator().manual_seed(n))
        lengths = torch.full((logits.shape[0],), n, dtype=torch.int32)
        check(logits, lengths, 2048, radix(logits.cuda(), lengths.cuda(), 2048, cta=cta))


def signed_zero_rows(rows, width, gen, positive=1 / 6, zeros=2 / 3):
    """Each row: a `positive` share of positive values, a `zeros` share of zeros (+0.0 and -0.0 alike),
    the rest negative. With positives short of k, a long row's sampled cut lands at +0.0's key, and the
    list (the positives and both zeros) fits in the 8192 entries."""
    u = torch.rand(rows, width, generator=gen)
    noise = torch.randn(rows, width, generator=gen).abs()
    zero = torch.where(u < positive + zeros / 2, torch.zeros(()), torch.full((), -0.0))
    return torch.where(u < positive, noise + 1, torch.where(u < positive + zeros, zero, -noise - 1))


@gpu
@CTAS
# 9100 keys: the filtered pass at 512 threads (registers at 1024); 20000: the filtered pass at both.
@pytest.mark.parametrize(("width", "positive", "zeros"), [(9100, 1 / 6, 2 / 3), (20000, 0.095, 0.25)])
def test_a_cut_at_plus_zero_takes_both_zeros(cta, width, positive, zeros):
    # The filtered pass compares floats, where -0.0 == +0.0: a cut at +0.0's key is moved to -0.0's, so
    # the list holds both zeros and no key below its window. The k largest then take zeros of either
    # sign wherever they rank, equal values (the check compares values, as torch.topk's ties do).
    gen = torch.Generator().manual_seed(11)
    logits = signed_zero_rows(4, width, gen, positive, zeros)
    lengths = torch.tensor([width, width - 100, width - 300, width - 50], dtype=torch.int32)
    check(logits, lengths, 2048, radix(logits.cuda(), lengths.cuda(), 2048, cta=cta))


@gpu
def test_length_zero_k_past_the_length_and_lengths_past_the_width():
    gen = torch.Generator().manual_seed(4)
    logits = random_logits(4, 3000, gen)
    lengths = torch.tensor([0, 5, 3000, 99999], dtype=torch.int32)  # the last is clamped to the width
    out = radix(logits.cuda(), lengths.cuda(), 4096)
    check(logits, lengths.clamp(max=3000), 4096, out)


@gpu
@CTAS
def test_rows_read_inside_their_window_only(cta):
    # Every key outside a row's window is +inf: any read of one would select it.
    gen = torch.Generator().manual_seed(5)
    width, k = 20000, 2048
    logits = torch.full((6, width), INF)
    starts = torch.tensor([0, 1, 3, 777, 15000, 19999], dtype=torch.int32)
    lengths = torch.tensor([2047, 5000, 10003, 12000, 5000, 1], dtype=torch.int32)
    for r in range(6):
        s, n = int(starts[r]), int(lengths[r])
        logits[r, s:s + n] = torch.randn(n, generator=gen)
    for stage, filtered in ((None, True), (1000, False)):
        out = radix(logits.cuda(), lengths.cuda(), k, starts=starts.cuda(), stage=stage, filtered=filtered,
                    cta=cta)
        check(logits, lengths, k, out, starts=starts)


@gpu
@CTAS
def test_page_transform_gives_the_physical_slots_of_the_selection(cta):
    gen = torch.Generator().manual_seed(6)
    rows, width, k, block = 8, 6000, 2048, 64
    logits = random_logits(rows, width, gen).cuda()
    lengths = ragged_lengths(rows, width, k, gen).cuda()
    pages = -(-width // block)
    table = torch.randperm(3 * pages, generator=gen)[: 3 * pages].reshape(3, pages).to(torch.int32).cuda()
    table[2, 10] = -1  # an unmapped page: its positions become -1
    page_rows = torch.tensor([0, 1, 2, 0, 1, 2, 5, -1], dtype=torch.int32).cuda()  # the last two: outside the table
    paged = radix(logits, lengths, k, page_table=table, page_rows=page_rows, cta=cta)
    plain = radix(logits, lengths, k, cta=cta)
    want = page_slots(plain, table, page_rows.clamp(0, 2), block)
    want = want.clamp(min=-1)  # the unmapped page's slots: page_slots leaves them negative, the contract -1
    want[6:] = -1
    assert torch.equal(paged.sort(dim=1).values, want.sort(dim=1).values)


@gpu
def test_sorted_orders_by_value_descending_minus_ones_last():
    gen = torch.Generator().manual_seed(7)
    logits = random_logits(5, 4000, gen)
    lengths = torch.tensor([4000, 100, 0, 2048, 3999], dtype=torch.int32)
    out = radix(logits.cuda(), lengths.cuda(), 2048, sorted=True).cpu()
    check(logits, lengths, 2048, out)
    for r in range(5):
        picked = out[r][out[r] >= 0].long()
        values = logits[r, picked]
        assert torch.equal(values, values.sort(descending=True).values), f"row {r} is not in descending order"


@gpu
def test_cuda_graph_capture_and_replay_on_new_values():
    gen = torch.Generator().manual_seed(8)
    logits = random_logits(64, 12000, gen).cuda()
    lengths = ragged_lengths(64, 12000, 2048, gen).cuda()
    radix(logits, lengths, 2048)  # compiles and sets the kernel's shared-memory limit outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = radix(logits, lengths, 2048)
    for seed in (1, 2):
        fresh = torch.Generator().manual_seed(seed)
        logits.copy_(random_logits(64, 12000, fresh))
        lengths.copy_(ragged_lengths(64, 12000, 2048, fresh))
        graph.replay()
        torch.cuda.synchronize()
        check(logits.cpu(), lengths.cpu(), 2048, out)


@gpu
def test_the_warm_up_builds_it_and_the_catalog_serves_it():
    from dispatch.contract.key import Op
    from dispatch.deciding.runtime import load_dispatcher

    backend = {b.name: b for b in load_dispatcher().catalog.for_op(Op.TOPK)}["cuda.radix"]
    assert backend.availability().ok, backend.availability().reason
    assert backend.warm().ok
    logits = torch.randn(3, 5000, device="cuda")
    lengths = torch.tensor([5000, 2000, 4000], dtype=torch.int32, device="cuda")
    check(logits.cpu(), lengths.cpu(), 2048, backend.run(logits, lengths, 2048))


# ---- on any machine: availability and registration ----

def test_the_probe_on_a_machine_without_a_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    build.machine_facts.cache_clear()
    try:
        availability = build.probe()
    finally:
        build.machine_facts.cache_clear()
    assert not availability.ok and availability.reason == "no CUDA device visible to torch"


def test_it_is_registered_as_a_topk_backend_with_its_reason_here():
    from dispatch.contract.key import Op
    from dispatch.deciding.runtime import load_dispatcher

    [backend] = cuda_topk_backends()
    assert backend.op == Op.TOPK and backend.name == "cuda.radix"
    registered = {b.name: b for b in load_dispatcher().catalog.for_op(Op.TOPK)}["cuda.radix"]
    assert registered.plugin == "backends.cuda_topk.plugin"
    if not torch.cuda.is_available():
        assert registered.availability().reason == "no CUDA device visible to torch"


def test_the_cta_size_is_512_once_the_rows_fill_the_multiprocessors():
    # Measured on the H200 (132 SMs, 17:10 UTC): 512 threads won at 256-4096 rows, 1024 at 1-128 rows.
    from backends.cuda_topk.radix_topk import INSTANCES, block_threads

    assert [block_threads(rows, 132) for rows in (1, 8, 64, 128, 132)] == [1024] * 5
    assert [block_threads(rows, 132) for rows in (133, 256, 512, 4096)] == [512] * 4
    assert block_threads(100, 78) == 512 and {threads for threads, _ in INSTANCES} == {512, 1024}


def test_the_short_list_instance_serves_many_rows_of_at_most_24k_keys():
    from backends.cuda_topk.radix_topk import INSTANCES, SHORT_LIST_WIDTH, instance

    assert SHORT_LIST_WIDTH == 24576
    assert instance(4096, 20480, 132) == (512, True)  # extend: 4096 query rows, windows to 16K
    assert instance(512, 24576, 132) == (512, True)
    assert instance(512, 24577, 132) == (512, False) and instance(512, 49152, 132) == (512, False)
    assert instance(128, 12000, 132) == (1024, False)  # a row an SM: the whole SM, the wide list
    assert instance(1, 10, 132) == (1024, False)
    assert {instance(rows, width, 132) for rows in (1, 200, 4096) for width in (1, 30000)} <= set(INSTANCES)


def test_cpu_tensors_are_a_layout_error_naming_the_tensor():
    from backends.cuda_topk.radix_topk import radix_topk

    with pytest.raises(LayoutError, match="`logits` is on cpu"):
        radix_topk(torch.randn(2, 10), torch.tensor([10, 5], dtype=torch.int32), 4)
