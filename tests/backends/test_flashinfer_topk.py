"""The `flashinfer` top-k backend: its adapter against a stand-in kernel on the CPU (the -1s, the NaN
rule, sorted and the page transform are the adapter's), its probe, and the real kernel on a GPU."""

import types

import pytest
import torch

from backends.flashinfer.plugin import flashinfer_availability, flashinfer_backends
from dispatch.contract import Arch, LayoutError


def fake_flashinfer(calls):
    """A stand-in for flashinfer.top_k_ragged_transform that, like FlashInfer, ranks NaN as a number
    (above everything) and pads short rows with -1."""

    def top_k_ragged_transform(logits, offsets, lengths, k):
        calls.append((logits, offsets.clone(), lengths.clone(), k))
        out = torch.full((logits.shape[0], k), -1, dtype=torch.int32)
        for row in range(logits.shape[0]):
            n = int(lengths[row])
            scores = logits[row, :n].nan_to_num(nan=float("inf"))
            take = min(k, n)
            out[row, :take] = torch.topk(scores, take).indices.to(torch.int32) + offsets[row]
        return out

    return types.SimpleNamespace(top_k_ragged_transform=top_k_ragged_transform, __version__="0.6.4")


def backend(calls):
    (only,) = flashinfer_backends(load=lambda: fake_flashinfer(calls))
    return only


def selected_values(logits, positions):
    return sorted(float(logits[r, p]) for r in range(logits.shape[0]) for p in positions[r].tolist() if p >= 0)


def test_passes_lengths_and_zero_offsets_and_pads_with_minus_one():
    calls = []
    logits = torch.randn(3, 40)
    lengths = torch.tensor([40, 5, 0], dtype=torch.int32)
    out = backend(calls).run(logits, lengths, 8)
    (passed, offsets, seen, k) = calls[0]
    assert passed is logits and k == 8 and offsets.tolist() == [0, 0, 0] and seen.tolist() == [40, 5, 0]
    assert out.dtype == torch.int32 and out.shape == (3, 8)
    assert out[1, 5:].tolist() == [-1, -1, -1] and out[2].tolist() == [-1] * 8
    expected = torch.topk(logits[0], 8).values.sort().values.tolist()
    assert sorted(logits[0, out[0].long()].tolist()) == expected


def test_a_selected_nan_becomes_minus_one_so_a_poisoned_row_selects_nothing():
    logits = torch.randn(2, 30)
    logits[0] = float("nan")
    out = backend([]).run(logits, torch.tensor([30, 30], dtype=torch.int32), 4)
    assert out[0].tolist() == [-1] * 4
    assert sorted(logits[1, out[1].long()].tolist()) == torch.topk(logits[1], 4).values.sort().values.tolist()


def test_sorted_and_page_transform():
    logits = torch.randn(2, 200)
    lengths = torch.tensor([200, 3], dtype=torch.int32)
    page_table = torch.tensor([[7, 2, 9, 4], [5, 1, 0, 0]], dtype=torch.int32)
    page_rows = torch.tensor([1, 0], dtype=torch.int32)
    positions = backend([]).run(logits, lengths, 6, sorted=True)
    values = logits[0, positions[0].long()]
    assert torch.all(values[:-1] >= values[1:]) and positions[1, 3:].tolist() == [-1, -1, -1]
    slots = backend([]).run(logits, lengths, 6, sorted=True, page_table=page_table, page_rows=page_rows, block_size=64)
    for row in range(2):
        for p, slot in zip(positions[row].tolist(), slots[row].tolist()):
            expected = -1 if p < 0 else int(page_table[page_rows[row], p // 64]) * 64 + p % 64
            assert slot == expected


def test_ragged_rows_are_refused_with_the_reason():
    with pytest.raises(LayoutError, match="starts"):
        backend([]).run(torch.randn(2, 8), torch.tensor([8, 8], dtype=torch.int32), 2,
                        starts=torch.tensor([0, 1], dtype=torch.int32))


def test_probe_says_why_it_cannot_run():
    def load():
        raise ImportError("No module named 'flashinfer'")

    assert "no CUDA GPU" in flashinfer_availability(host=Arch.SM90, gpu_visible=False, load=load).reason
    assert "this machine is gfx942" in flashinfer_availability(host=Arch.GFX942, gpu_visible=True, load=load).reason
    assert "cannot be imported" in flashinfer_availability(host=Arch.SM90, gpu_visible=True, load=load).reason
    old = types.SimpleNamespace(__version__="0.2.0")
    assert "needs >= 0.6" in flashinfer_availability(host=Arch.SM90, gpu_visible=True, load=lambda: old).reason
    assert flashinfer_availability(host=Arch.SM90, gpu_visible=True, load=lambda: fake_flashinfer([])).ok


@pytest.mark.gpu
def test_real_flashinfer_matches_torch_topk_on_indexer_rows():
    flashinfer = pytest.importorskip("flashinfer")
    (real,) = flashinfer_backends(load=lambda: flashinfer)
    generator = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(1, 6000, (64,), generator=generator, device="cuda", dtype=torch.int32)
    logits = torch.randn(64, 6000, generator=generator, device="cuda")
    logits.masked_fill_(torch.arange(6000, device="cuda")[None, :] >= lengths[:, None], float("-inf"))
    out = real.run(logits, lengths, 2048)
    for row in range(64):
        n = int(lengths[row])
        take = min(2048, n)
        picked = out[row][out[row] >= 0].long()
        assert picked.numel() == take and bool((picked < n).all())
        # Exact: both are selections of this same row's values (ties are equal values).
        assert torch.equal(logits[row, picked].sort().values, torch.topk(logits[row, :n], take).values.sort().values)


def test_a_strided_logits_slice_reaches_the_kernel_dense():
    calls = []
    wide = torch.randn(4, 96)
    logits = wide[:, :80]
    out = backend(calls).run(logits, torch.tensor([80, 80, 10, 1], dtype=torch.int32), 5)
    assert calls[0][0].is_contiguous() and torch.equal(calls[0][0], logits)
    assert sorted(logits[0, out[0].long()].tolist()) == torch.topk(logits[0], 5).values.sort().values.tolist()
