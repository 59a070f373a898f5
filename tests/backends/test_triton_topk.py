"""The Triton top-k kernel against a torch.topk oracle, row by row.

The contract leaves ties and order free, so a result is checked by what it selects: per row the
positions are distinct, inside [0, length), the -1s are exactly the slots past min(k, non-NaN
keys), and the multiset of selected values equals torch.topk's over the visible non-NaN keys
(exactly: selection copies values, so the tolerance is zero). Without a GPU the kernel runs under
the Triton interpreter (conftest sets TRITON_INTERPRET=1); the GPU-marked tests run serving shapes.
"""

from __future__ import annotations

import pytest
import torch

from backends.triton.topk import launch, launch_config, topk_indices
from dispatch.contract.errors import LayoutError
from dispatch.contract.key import Op
from dispatch.contract.ops import topk_rows
from tests.support.plans import one_op_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")


def oracle_values(row: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest non-NaN values of one row's visible keys, sorted ascending."""
    visible = row[~row.isnan()]
    return torch.topk(visible, min(k, visible.numel())).values.sort().values


def check(logits, lengths, k, out, starts=None):
    """Every row of out is a valid top-k selection of its visible keys."""
    logits, lengths, out = logits.cpu(), lengths.cpu(), out.cpu()
    assert out.dtype == torch.int32 and tuple(out.shape) == (logits.shape[0], k)
    for r in range(logits.shape[0]):
        start = 0 if starts is None else int(starts[r])
        n = int(lengths[r])
        row = logits[r, start:start + n]
        want = oracle_values(row, k)
        count = want.numel()
        picked = out[r, :count]
        assert (out[r, count:] == -1).all(), f"row {r}: slots past {count} must be -1"
        assert ((picked >= 0) & (picked < n)).all(), f"row {r}: position outside [0, {n})"
        assert picked.unique().numel() == count, f"row {r}: repeated position"
        got = row[picked.long()].sort().values
        assert torch.equal(got, want), f"row {r}: selected values differ from torch.topk's"


def ragged_lengths(rows, width, k, gen):
    """Lengths covering 0, 1, < k, = k, > k and the full width, then random."""
    fixed = [0, 1, max(k - 1, 0), k, k + 1, width]
    rand = torch.randint(0, width + 1, (rows,), generator=gen).tolist()
    return torch.tensor([min(v, width) for v in (fixed + rand)[:rows]], dtype=torch.int32)


def random_logits(rows, width, gen, row_stride=None):
    """Random fp32 logits; with row_stride, a view into a wider buffer (rows not contiguous)."""
    stride = row_stride or width
    buf = torch.randn(rows, stride, generator=gen) * 3.0
    return buf[:, :width]


@pytest.mark.parametrize(("rows", "width", "k", "seed"), [(12, 300, 16, 0), (16, 3000, 64, 1), (9, 5000, 64, 2)])
def test_random_ragged_batches(rows, width, k, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = random_logits(rows, width, gen)
    lengths = ragged_lengths(rows, width, k, gen)
    out = topk_indices(logits.to(DEVICE), lengths.to(DEVICE), k)
    check(logits, lengths, k, out)


# z = 4: the sampled bracket, as served. z = 1e9: every key a candidate, so the capped list
# overflows and the exact radix select over the row runs. z = -1e9: the bracket is one bin, usually
# wrong, same fallback. cap = 8 overflows the list on every long row. block 256 x tiles 2: each row
# split over up to 5 programs sharing its counters; block 128 x tiles 1: 20.
@pytest.mark.parametrize(("change"), [
    {"z": 4.0, "radix": 8}, {"z": 1e9, "radix": 8}, {"z": -1e9, "radix": 8}, {"z": 4.0, "radix": 4},
    {"z": 1e9, "radix": 4}, {"cap": 8}, {"block": 256, "tiles": 2}, {"block": 128, "tiles": 1, "lanes": 4},
    {"block": 512, "tiles": 3, "cap": 300},
], ids=["sampled", "all-candidates", "fallback", "sampled-radix4", "all-candidates-radix4", "list-overflow",
        "chunks-of-two-tiles", "twenty-chunks", "three-tiles-small-cap"])
def test_every_path_of_the_select(change):
    gen = torch.Generator().manual_seed(11)
    width, k = 2500, 64
    logits = random_logits(10, width, gen).clone()
    logits[0] = 2.0
    logits[1, ::2] = NAN
    logits[2, 64:] = NAN
    lengths = ragged_lengths(10, width, k, gen)
    lengths[:3] = width
    config = {**launch_config(10, width, k), **change}
    out = launch(logits.to(DEVICE), lengths.to(DEVICE), k, **config)
    check(logits, lengths, k, out)


def test_k_2048_at_a_few_thousand_keys():
    gen = torch.Generator().manual_seed(3)
    logits = random_logits(4, 6000, gen)
    lengths = torch.tensor([6000, 2049, 2048, 4500], dtype=torch.int32)
    check(logits, lengths, 2048, topk_indices(logits.to(DEVICE), lengths.to(DEVICE), 2048))


def test_ties_inf_and_nan_rows():
    gen = torch.Generator().manual_seed(4)
    width, k = 2000, 64
    logits = random_logits(12, width, gen).clone()
    logits[0] = 1.5  # all equal: any k positions
    logits[1] = -INF  # -inf is selectable
    logits[2] = NAN  # poisoned row: all -1
    logits[3, ::3] = NAN  # NaN sprinkled
    logits[4] = torch.randint(0, 3, (width,), generator=gen).float()  # three values, heavy ties
    logits[5, : width // 2] = NAN  # a NaN block at the front, many keys left
    logits[6, 100:] = NAN  # only 100 non-NaN keys in a long row: fewer selectable than visible
    logits[6, :100] = torch.randn(100, generator=gen)
    logits[7] = torch.tensor([INF, -INF, 3e38, -3e38, 0.0, -0.0, 1e-45, -1e-45])[torch.randint(0, 8, (width,), generator=gen)]
    logits[8] = torch.arange(width, dtype=torch.float32)  # the sample's window misses the top
    logits[9] = -torch.arange(width, dtype=torch.float32) * 1e30
    logits[10] = -INF  # longer than k, nothing finite: the sample has no window to offer
    logits[11] = INF
    lengths = torch.tensor([width, 5, width, width, width, width, width, width, width, 1500, width, 700],
                           dtype=torch.int32)
    out = topk_indices(logits.to(DEVICE), lengths.to(DEVICE), k)
    check(logits, lengths, k, out)
    assert (out[2].cpu() == -1).all()
    assert (out[1, :5].cpu().sort().values == torch.arange(5, dtype=torch.int32)).all()


def test_k_larger_than_width_and_widths_past_every_length():
    gen = torch.Generator().manual_seed(5)
    logits = random_logits(5, 40, gen)
    lengths = torch.tensor([0, 1, 17, 39, 40], dtype=torch.int32)
    check(logits, lengths, 64, topk_indices(logits.to(DEVICE), lengths.to(DEVICE), 64))
    wide = random_logits(4, 4096, gen)
    short = torch.tensor([100, 300, 70, 1000], dtype=torch.int32)
    check(wide, short, 64, topk_indices(wide.to(DEVICE), short.to(DEVICE), 64))


def test_never_reads_past_a_length():
    # Keys past each row's length are +inf, larger than anything visible: reading one would pick it.
    gen = torch.Generator().manual_seed(6)
    logits = random_logits(6, 1500, gen).clone()
    lengths = torch.tensor([0, 10, 64, 65, 700, 1499], dtype=torch.int32)
    for r, n in enumerate(lengths.tolist()):
        logits[r, n:] = INF
    check(logits, lengths, 64, topk_indices(logits.to(DEVICE), lengths.to(DEVICE), 64))


def test_starts_select_inside_each_rows_window():
    gen = torch.Generator().manual_seed(7)
    width, k = 2500, 64
    logits = random_logits(8, width, gen).clone()
    starts = torch.tensor([0, 5, 100, 2400, 1000, 0, 2500, 37], dtype=torch.int32)
    lengths = torch.tensor([2500, 64, 2400, 100, 1500, 1, 0, 2000], dtype=torch.int32)
    # Outside each window the keys are +inf: selecting one would show.
    for r in range(8):
        s, n = int(starts[r]), int(lengths[r])
        logits[r, :s] = INF
        logits[r, s + n:] = INF
    out = topk_indices(logits.to(DEVICE), lengths.to(DEVICE), k, starts=starts.to(DEVICE))
    check(logits, lengths, k, out, starts=starts)


def test_non_contiguous_rows():
    gen = torch.Generator().manual_seed(8)
    logits = random_logits(7, 1800, gen, row_stride=2048)
    assert not logits.is_contiguous()
    lengths = ragged_lengths(7, 1800, 64, gen)
    check(logits, lengths, 64, topk_indices(logits.to(DEVICE), lengths.to(DEVICE), 64))


def test_row_streaming_kernels_do_not_specialise_on_the_row_stride():
    """An aligned row stride (DeepGEMM's 256-aligned output) must compile to the same code as any other:
    specialised, the split's tile goes through shared memory
    (docs/internal/triton-notes.md; top-k 27 -> 49 us on the H200)."""
    from backends.triton.topk import _bracket_kernel, _split_kernel
    from backends.triton.topk_finish import _finish_kernel

    for kernel in (_bracket_kernel, _split_kernel, _finish_kernel):
        # A compiled kernel lists its parameters; the interpreter's wrapper keeps the decorator's words.
        if hasattr(kernel, "params"):
            names = [p.name for p in kernel.params if p.do_not_specialize]
        else:
            names = kernel.kwargs["do_not_specialize"]
        # The finish leaves the candidate lists' stride unspecialised too (topk_finish.py: 28 registers).
        assert names == ["stride_row"] + (["stride_cand"] if kernel is _finish_kernel else []), kernel.fn.__name__


@pytest.mark.parametrize("sorted_", [False, True], ids=["fused", "sorted"])
def test_page_table_transform(sorted_):
    gen = torch.Generator().manual_seed(9)
    rows, width, k, block = 6, 1024, 64, 16
    pages = width // block
    logits = random_logits(rows, width, gen)
    lengths = ragged_lengths(rows, width, k, gen)
    # Three requests' page tables of distinct physical pages; rows map onto them out of order.
    table = torch.randperm(3 * pages, generator=gen).to(torch.int32).reshape(3, pages)
    page_rows = torch.tensor([2, 0, 1, 1, 0, 2], dtype=torch.int32)
    out = topk_indices(logits.to(DEVICE), lengths.to(DEVICE), k, page_table=table.to(DEVICE),
                       page_rows=page_rows.to(DEVICE), block_size=block, sorted=sorted_).cpu()
    # Map physical slots back to positions through the (invertible) table, then check as positions.
    page_of = torch.full((3, 3 * pages), -1, dtype=torch.long)
    for p in range(3):
        page_of[p, table[p].long()] = torch.arange(pages)
    positions = torch.full_like(out, -1)
    for r in range(rows):
        slots = out[r][out[r] >= 0].long()
        logical = page_of[int(page_rows[r])][slots // block]
        assert (logical >= 0).all(), f"row {r}: a slot outside its page table row"
        positions[r, : slots.numel()] = (logical * block + slots % block).to(torch.int32)
    assert ((out >= 0) == (positions >= 0)).all()
    check(logits, lengths, k, positions)
    if sorted_:
        vals = torch.where(positions >= 0, logits.gather(1, positions.clamp(min=0).long()), -INF)
        assert (vals[:, :-1] >= vals[:, 1:]).all()


@pytest.mark.parametrize("sort_max", [8192, 32], ids=["triton-sort", "torch-sort-past-sort-max"])
def test_sorted_is_descending_with_minus_ones_last(sort_max, monkeypatch):
    from backends.triton import topk as module

    monkeypatch.setattr(module, "SORT_MAX", sort_max)
    gen = torch.Generator().manual_seed(10)
    logits = random_logits(6, 700, gen).clone()
    logits[0, ::2] = NAN
    logits[1] = -INF
    lengths = torch.tensor([700, 30, 64, 0, 699, 65], dtype=torch.int32)
    out = topk_indices(logits.to(DEVICE), lengths.to(DEVICE), 64, sorted=True).cpu()
    check(logits, lengths, 64, out)
    for r in range(6):
        picked = out[r][out[r] >= 0].long()
        vals = logits[r, picked]
        assert (vals[:-1] >= vals[1:]).all(), f"row {r}: not descending"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(logits=a["logits"].half()), "logits"),
        (lambda a: a.update(logits=a["logits"].t().contiguous().t()), "contiguous last dim"),
        (lambda a: a.update(lengths=a["lengths"].long()), "lengths"),
        (lambda a: a.update(lengths=a["lengths"][:-1]), "lengths"),
        (lambda a: a.update(starts=torch.zeros(3, dtype=torch.int64)), "starts"),
        (lambda a: a.update(lengths=torch.tensor([1, 2, 65], dtype=torch.int32)), "64 wide"),
        (lambda a: a.update(starts=torch.tensor([0, 0, 2], dtype=torch.int32),
                            lengths=torch.tensor([1, 1, 63], dtype=torch.int32)), "64 wide"),
        (lambda a: a.update(page_table=torch.zeros(1, 4, dtype=torch.int32)), "page_rows"),
        (lambda a: a.update(page_table=torch.zeros(1, 4, dtype=torch.int64),
                            page_rows=torch.zeros(3, dtype=torch.int32)), "page_table"),
        (lambda a: a.update(page_table=torch.zeros(4, 2, dtype=torch.int32).t(),
                            page_rows=torch.zeros(3, dtype=torch.int32)), "page_table must be contiguous"),
        (lambda a: a.update(k=0), "k an integer"),
    ],
)
def test_bad_inputs_name_the_tensor(change, message):
    args = {"logits": torch.randn(3, 64), "lengths": torch.tensor([1, 2, 3], dtype=torch.int32), "k": 8}
    change(args)
    # The op's checks run in the host's call, then the kernel's own (one device, a contiguous table).
    with pytest.raises(LayoutError, match=message):
        topk_rows(one_op_plan(Op.TOPK, topk_indices), args.pop("logits"), args.pop("lengths"), args.pop("k"),
                  block_size=16, **args)


def test_bad_launch_config_is_rejected():
    with pytest.raises(ValueError, match="powers of two"):
        launch(torch.randn(2, 8), torch.ones(2, dtype=torch.int32), 4, **{**launch_config(2, 8), "block": 3000})
    with pytest.raises(ValueError, match="cap >= 1"):
        launch(torch.randn(2, 8), torch.ones(2, dtype=torch.int32), 4, **{**launch_config(2, 8), "cap": 0})


def test_default_chunks_give_every_sm_programs():
    # Serving shapes outside the interpreter: one tile of 1024 keys a program, one thread-column of
    # `lanes` keys per thread, so even 64 rows of ~12K keys make 768 split programs (several an SM).
    for rows, width in [(512, 49070), (128, 49070), (64, 11814), (1, 100)]:
        c = launch_config(rows, width, 2048, interpreted=False)
        chunk = c["block"] * c["tiles"]
        assert chunk == 1024 and c["block"] // c["lanes"] == 32 * c["num_warps"]
        assert rows * -(-width // chunk) >= 4 * 132 or rows == 1  # an H200's 132 SMs, 4 programs each


def test_scratch_is_reused_across_calls():
    # One workspace per (device, row bucket, cap): a second call at the same bucket allocates nothing
    # (what lets a CUDA graph capture the call), and stale counters from a first call never leak.
    from backends.triton.topk import _workspace

    gen = torch.Generator().manual_seed(12)
    a = _workspace(torch.device(DEVICE), 5, 1024)
    b = _workspace(torch.device(DEVICE), 7, 1024)
    assert a.cand.data_ptr() == b.cand.data_ptr() and a.counts.shape == (5,) and b.cand.shape == (7, 1024)
    for rows in (7, 5):
        logits = random_logits(rows, 900, gen)
        lengths = torch.full((rows,), 900, dtype=torch.int32)
        check(logits, lengths, 64, topk_indices(logits.to(DEVICE), lengths.to(DEVICE), 64))


def finish_paths(lengths, k, config, width, starts=None):
    """The path the finish took for each row of the last launch with `config`, read back from the
    cached workspace: "all" (length <= k: every non-NaN key), "ties" (two-level, the threshold bin's
    entries ranked pairwise), "bin-radix" (two-level, radix rounds over the threshold bin), "radix"
    (fine = 0: radix rounds over the list), "row" (the exact select over the row). Also checks that
    each two-level row's histogram counted exactly its candidates."""
    from backends.triton.topk import _workspace

    rows = lengths.numel()
    scratch = _workspace(torch.device(DEVICE), rows, config["cap"], config["fine"], config["ties"])
    counts, hist = scratch.counts.cpu(), scratch.hist.cpu()
    paths = []
    for r in range(rows):
        start = 0 if starts is None else min(max(int(starts[r]), 0), width)
        n = min(max(int(lengths[r]), 0), width - start)
        above, listed = int(counts[r]) & 0xFFFFFFFF, int(counts[r]) >> 32
        if n <= k:
            paths.append("all")
        elif not (above <= k <= above + listed and listed <= config["cap"]):
            paths.append("row")
        elif config["fine"] == 0:
            paths.append("radix")
        else:
            h = hist[r].long()
            assert int(h.sum()) == listed, f"row {r}: histogram counts {int(h.sum())} of {listed} candidates"
            at_or_above = h.flip(0).cumsum(0).flip(0)
            b = int((at_or_above >= k - above).nonzero().max())
            paths.append("ties" if int(h[b]) <= config["ties"] else "bin-radix")
    return paths


def threshold_rows(width, k, gen):
    """Rows whose k-th largest key is one of many equal keys: 60 keys above 10, then `copies` keys of
    exactly 5.0, the rest below 3. k = 64 takes 4 of the copies: with 10 copies they fit the ties
    list (ranked pairwise, equal keys told apart by position), with 300 they do not (radix rounds
    over the threshold bin)."""
    rows = []
    for copies in (10, 300, 300):
        row = torch.rand(width, generator=gen) * 5.0 - 2.0
        place = torch.randperm(width, generator=gen)
        row[place[:60]] = 10.0 + torch.rand(60, generator=gen)
        row[place[60:60 + copies]] = 5.0
        rows.append(row)
    rows[2][place[width // 2:]] = NAN  # NaN beside the ties: never selected, never counted
    return torch.stack(rows)


# fine = 256 bins, ties = 16 (the interpreter's default); ties = 1: nearly every threshold bin goes to
# radix rounds over it; fine = 1: one bin, every row's whole list in it; fine = 0: round 2's finish.
@pytest.mark.parametrize("change", [{}, {"ties": 1}, {"fine": 1}, {"fine": 0}, {"fine": 4096, "ties": 64}],
                         ids=["two-level", "ties-1", "one-bin", "radix-finish", "fine-4096"])
@pytest.mark.parametrize("mode", ["plain", "pages", "sorted"])
def test_two_level_finish(change, mode):
    gen = torch.Generator().manual_seed(14)
    width, k, rows = 2500, 64, 16
    logits = random_logits(rows, width, gen).clone()
    lengths = ragged_lengths(rows, width, k, gen)
    logits[13:16] = threshold_rows(width, k, gen)
    logits[6] = 1.5  # all equal, within the list's cap: one bin holds them all
    logits[7] = -INF  # -inf is selectable: all in the lowest bin
    logits[8, ::3] = NAN
    lengths[6:16] = torch.tensor([600, 500, width, 2000, width, width, 1900, width, width, width])
    config = {**launch_config(rows, width, k), **change}
    block = 16
    pages = width // block + 1
    table = torch.randperm(rows * pages, generator=gen).to(torch.int32).reshape(rows, pages)
    page_rows = torch.arange(rows, dtype=torch.int32)
    kwargs = {"page_table": table.to(DEVICE), "page_rows": page_rows.to(DEVICE), "block_size": block} \
        if mode == "pages" else {}
    out = launch(logits.to(DEVICE), lengths.to(DEVICE), k, sorted=mode == "sorted", **kwargs, **config).cpu()
    paths = finish_paths(lengths, k, config, width)
    if mode == "pages":  # slots back to positions: the table is a permutation
        page_of = torch.empty(rows * pages, dtype=torch.long)
        page_of[table.reshape(-1).long()] = torch.arange(rows * pages) % pages
        out = torch.where(out >= 0, page_of[(out.long() // block).clamp(min=0)] * block + out % block, -1).int()
    check(logits, lengths, k, out)
    if mode == "sorted":
        vals = torch.where(out >= 0, logits.gather(1, out.clamp(min=0).long()), -INF)
        assert (vals[:, :-1] >= vals[:, 1:]).all()
    assert paths[:6] == ["all", "all", "all", "all"] + paths[4:6] and paths[6] != "row"
    if config["fine"] == 0:
        assert "radix" in paths
    elif change == {"fine": 1}:
        assert set(paths) <= {"all", "bin-radix", "row"} and paths.count("bin-radix") >= 8
    elif change == {"ties": 1}:
        assert paths.count("bin-radix") >= 6 and paths[13:16] == ["bin-radix"] * 3, paths
    else:
        assert paths.count("ties") >= 5 and paths[13:16] == ["ties", "bin-radix", "bin-radix"], paths


@pytest.mark.gpu
@pytest.mark.parametrize(("batch", "next_n", "context", "k"), [(128, 4, 32768, 2048), (32, 2, 8192, 2048), (64, 1, 32768, 512)])
@pytest.mark.parametrize("change", [{}, {"ties": 1}, {"fine": 0}], ids=["two-level", "bin-radix", "radix-finish"])
def test_serving_shapes_on_gpu(batch, next_n, context, k, change):
    """Indexer-like logits: -inf past each row's length, lengths = L - N + j + 1, L in [L/2, 3L/2]. The
    default config's rows must take the two-level finish (most resolved pairwise)."""
    gen = torch.Generator().manual_seed(batch + next_n)
    ctx = torch.randint(context // 2, context * 3 // 2 + 1, (batch,), generator=gen)
    lengths = (ctx[:, None] - next_n + torch.arange(next_n)[None, :] + 1).reshape(-1).to(torch.int32)
    width = int(lengths.max())
    logits = torch.randn(lengths.numel(), width, generator=gen)
    logits[torch.arange(width)[None, :] >= lengths[:, None].long()] = -INF
    config = {**launch_config(*logits.shape, k), **change}
    out = launch(logits.cuda(), lengths.cuda(), k, **config)
    check(logits, lengths, k, out)
    paths = finish_paths(lengths, k, config, width)
    if not change:
        assert paths.count("ties") >= 0.9 * len(paths), {p: paths.count(p) for p in set(paths)}


@pytest.mark.gpu
def test_aligned_row_stride_on_gpu():
    """Rows padded to a multiple of 256 floats, as DeepGEMM's output and padded engine buffers are."""
    gen = torch.Generator().manual_seed(77)
    lengths = torch.randint(8192, 32768, (96,), generator=gen, dtype=torch.int32)
    width = int(lengths.max())
    logits = random_logits(96, width, gen, row_stride=-(-width // 256) * 256)
    check(logits, lengths, 2048, topk_indices(logits.cuda(), lengths.cuda(), 2048))


@pytest.mark.parametrize("sorted_", [False, True], ids=["fused", "sorted"])
def test_windows_and_pages_across_many_chunks(sorted_):
    # Rows split over up to 10 programs each, windows starting mid-tile, keys outside each window
    # +inf, and the page transform on both the split's and the finish's slots.
    gen = torch.Generator().manual_seed(13)
    rows, width, k, block = 6, 2600, 64, 16
    logits = random_logits(rows, width, gen).clone()
    starts = torch.tensor([0, 3, 250, 1000, 7, 2500], dtype=torch.int32)
    lengths = torch.tensor([2600, 2597, 2000, 65, 64, 100], dtype=torch.int32)
    for r in range(rows):
        s, n = int(starts[r]), int(lengths[r])
        logits[r, :s] = INF
        logits[r, s + n:] = INF
    pages = -(-width // block)
    table = torch.arange(rows * pages, dtype=torch.int32).reshape(rows, pages).flip(1).contiguous()
    page_rows = torch.arange(rows, dtype=torch.int32).flip(0).contiguous()
    config = {**launch_config(rows, width, k), "block": 256, "tiles": 1}
    out = launch(logits.to(DEVICE), lengths.to(DEVICE), k, starts=starts.to(DEVICE), page_table=table.to(DEVICE),
                 page_rows=page_rows.to(DEVICE), block_size=block, sorted=sorted_, **config).cpu()
    # The table is invertible: slot -> (table row, page) -> position.
    positions = torch.full_like(out, -1)
    for r in range(rows):
        slots = out[r][out[r] >= 0].long()
        row_table = table[int(page_rows[r])].long()
        page_index = (row_table[None, :] == (slots // block)[:, None]).int().argmax(dim=1)
        assert (row_table[page_index] == slots // block).all(), f"row {r}: a slot outside its page table row"
        positions[r, : slots.numel()] = (page_index * block + slots % block).to(torch.int32)
    assert ((out >= 0) == (positions >= 0)).all()
    check(logits, lengths, k, positions, starts=starts)
    if sorted_:
        vals = torch.stack([torch.where(positions[r] >= 0, logits[r, int(starts[r]) + positions[r].clamp(min=0).long()],
                                        -INF) for r in range(rows)])
        assert (vals[:, :-1] >= vals[:, 1:]).all()
