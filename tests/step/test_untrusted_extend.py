"""The extend path refuses or flags what the paged path does (issue 24): page entries far
outside the pool are checked in 64-bit before the gather slots narrow to int32, lengths that are negative
or disagree with the totals are refused where the host has them and flagged (every key poisoned) where
only the device does, and a key with a non-finite scale or a NaN byte is never selected, on the
reference and on the Triton kernels alike."""

from __future__ import annotations

import pytest
import torch

from backends.reference.kv_gather import reference_gather_keys
from backends.reference.ragged_mqa_logits import reference_ragged_mqa_logits
from backends.triton.fp8_mode import Fp8Mode
from backends.shared.kv_gather import triton_gather_keys
from backends.triton.ragged_mqa_logits import triton_ragged_mqa_logits
from dispatch.contract.bounds import BAD_LENGTH, BAD_PAGE
from dispatch.contract.errors import IndexBoundsError, LayoutError
from dispatch.step.extend_plan import build_extend_plan
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.key import Fp8Dtype
from dispatch.step.extend_batch import ExtendBatch, build_ragged_metadata
from dispatch.deciding.runtime import load_dispatcher
from tests.support.extend_batch import extend_case, unchecked_extend_batch

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _table(entries):
    return torch.tensor(entries, dtype=torch.int32)


@pytest.mark.parametrize("entry", [2**26 + 1, 2**25, -(2**26), 2**31 - 1, -(2**31)])
def test_a_page_entry_far_outside_the_pool_never_wraps_into_a_valid_slot(entry):
    # 2^26 + 1 blocks of 64 is slot 2^32 + 64: narrowed to int32 it used to be slot 64, block 1's keys.
    table = _table([[0, 1], [2, entry]])
    batch = ExtendBatch.from_lengths([0, 64], [10, 10], table, num_kv_blocks=4)
    slots = build_ragged_metadata(batch).gather_slots
    assert slots[:10].tolist() == list(range(10))  # request 0 untouched
    assert slots[10:74].tolist() == list(range(128, 192))  # request 1's first page, block 2
    assert slots[74:].tolist() == [-1] * 10  # its second page names no block of the pool


def test_the_pool_bound_is_honoured_and_without_it_int32_is():
    table = _table([[0, 5]])
    within = build_ragged_metadata(ExtendBatch.from_lengths([64], [1], table)).gather_slots
    assert within[-1].item() == 5 * 64  # no pool given: block 5 may exist; the layer's gather checks it
    outside = build_ragged_metadata(ExtendBatch.from_lengths([64], [1], table, num_kv_blocks=5)).gather_slots
    assert outside[-1].item() == -1


@pytest.mark.parametrize("fp8", [Fp8Dtype.E4M3FN])
def test_the_gathers_refuse_or_flag_such_a_key(fp8):
    case = extend_case([30, 70], [5, 3], head_dim=64)
    table = case.batch.page_table.clone()
    table[1, 1] = 2**26 + 1
    batch = ExtendBatch.from_lengths([30, 70], [5, 3], table, num_kv_blocks=case.kv_cache.shape[0])
    metadata = build_ragged_metadata(batch)
    with pytest.raises(LayoutError, match=r"request 1, its key 64\) maps to slot -1, no valid page"):
        reference_gather_keys(case.kv_cache, metadata.gather_slots, fp8, key_offsets=metadata.key_offsets)
    flags = torch.zeros(1, dtype=torch.int32)
    k, scales = triton_gather_keys(case.kv_cache, metadata.gather_slots, flags, fp8)
    assert flags.item() == BAD_PAGE
    bad = metadata.gather_slots == -1
    assert bad.sum().item() == 73 - 64 and torch.isnan(scales[bad]).all() and not torch.isnan(scales[~bad]).any()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(extend_lens=torch.tensor([3, -2], dtype=torch.int32)), r"request 1: prefix_lens\[1\]=2, extend_lens\[1\]=-2"),
        (dict(prefix_lens=torch.tensor([-5, 2], dtype=torch.int32)), r"request 0: prefix_lens\[0\]=-5"),
        (dict(total_tokens=6), r"total_tokens=6 \(extend_lens sum to 7\)"),
        (dict(total_keys=11), r"total_keys=11 \(prefix_lens \+ extend_lens sum to 10\)"),
        (dict(prefix_lens=torch.tensor([0, 3], dtype=torch.int32), host_prefix_lens=(1, 2), host_extend_lens=(3, 4)),
         "tensors disagree with host_prefix_lens"),
        (dict(page_table=torch.zeros(0, 2, dtype=torch.int32), prefix_lens=torch.zeros(0, dtype=torch.int32),
              extend_lens=torch.zeros(0, dtype=torch.int32), total_tokens=0), "no requests has no keys"),
        (dict(num_kv_blocks=-1), "num_kv_blocks must be a host int >= 0"),
        (dict(num_kv_blocks=2.5), "num_kv_blocks must be a host int >= 0"),
        (dict(num_kv_blocks=10**12), "at most 2147483647"),  # the paged batch refuses it too
    ],
)
def test_host_lengths_that_cannot_occur_are_refused_where_the_batch_is_built(change, match):
    # A negative extend length used to reach repeat_interleave's output_size and corrupt the heap.
    good = dict(prefix_lens=torch.tensor([1, 2], dtype=torch.int32), extend_lens=torch.tensor([3, 4], dtype=torch.int32),
                page_table=torch.zeros(2, 2, dtype=torch.int32), total_tokens=7, total_keys=10)
    ExtendBatch(**good)
    with pytest.raises(LayoutError, match=match):
        ExtendBatch(**{**good, **change})


@pytest.mark.parametrize(
    ("prefix", "extend", "tokens", "keys"),
    [([1, 2], [3, -2], 1, 4), ([1, 2], [3, 4], 6, 10), ([1, 2], [3, 4], 7, 12), ([-9, 2], [3, 4], 7, 10),
     ([1, 2], [3, 4], 40, 50)],
    ids=["negative-extend", "tokens-short", "keys-long", "negative-prefix", "both-long"],
)
def test_device_lengths_that_cannot_occur_poison_every_key_and_flag(prefix, extend, tokens, keys):
    batch = unchecked_extend_batch(prefix_lens=torch.tensor(prefix, dtype=torch.int32),
                       extend_lens=torch.tensor(extend, dtype=torch.int32),
                       page_table=torch.zeros(2, 2, dtype=torch.int32), total_tokens=tokens, total_keys=keys)
    metadata = build_ragged_metadata(batch, host_checked=False)
    assert metadata.length_flags.item() == BAD_LENGTH
    assert (metadata.gather_slots == -1).all() and metadata.gather_slots.shape == (keys,)
    assert metadata.ks.shape == (tokens,) and ((metadata.ks >= 0) & (metadata.ke <= keys)).all()
    assert (metadata.ke >= metadata.ks).all() and ((metadata.row_request >= 0) & (metadata.row_request < 2)).all()


def test_consistent_device_lengths_are_not_flagged_and_match_the_host_path():
    table = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    host = ExtendBatch.from_lengths([70, 0], [5, 40], table)
    checked = build_ragged_metadata(host)
    unchecked = build_ragged_metadata(host, host_checked=False)
    assert unchecked.length_flags.item() == 0
    for name in ("ks", "ke", "gather_slots", "row_request", "key_offsets"):
        assert torch.equal(getattr(checked, name), getattr(unchecked, name)), name


def test_an_extend_plan_carries_the_length_flag_into_its_error_flags(monkeypatch):
    import dispatch.step.extend_plan

    batch = unchecked_extend_batch(prefix_lens=torch.tensor([1, 2], dtype=torch.int32),
                       extend_lens=torch.tensor([3, -4], dtype=torch.int32),
                       page_table=torch.zeros(2, 2, dtype=torch.int32), total_tokens=7, total_keys=10)
    # The plan builds its metadata as it would from a GPU batch.
    monkeypatch.setattr(dispatch.step.extend_plan, "build_ragged_metadata", lambda b: build_ragged_metadata(b, host_checked=False))
    plan = build_extend_plan(load_dispatcher(arch="cpu"), batch, kv_fp8_dtype="e4m3fn", prepare=False)
    with pytest.raises(IndexBoundsError, match="lengths are negative or disagree"):
        plan.check_errors()


def _ragged(which, fp8, q, k, scales, weights, ks, ke):
    if which == "reference":
        return reference_ragged_mqa_logits(q, k, scales, weights, ks, ke)
    mode = {"triton": None, "fnuz-emulated": Fp8Mode.FNUZ_EMULATED}[which]
    return triton_ragged_mqa_logits(q, k, scales, weights, ks, ke, fnuz_mode=mode)


NAN_BYTE = {Fp8Dtype.E4M3FN: 0x7F, Fp8Dtype.E4M3FNUZ: 0x80}


@pytest.mark.parametrize(("which", "fp8"), [("reference", Fp8Dtype.E4M3FN), ("triton", Fp8Dtype.E4M3FN),
                                            ("reference", Fp8Dtype.E4M3FNUZ), ("fnuz-emulated", Fp8Dtype.E4M3FNUZ)])
@pytest.mark.parametrize("fault", ["+inf scale", "-inf scale", "nan scale", "nan key byte", "nan q byte"])
def test_extend_follows_the_paged_nan_rule(which, fp8, fault):
    gen = torch.Generator().manual_seed(3)
    rows, heads, dim, keys = 6, 16, 64, 20
    # Positive q and k: every relu is live, so an inf scale would make a finite +inf logit, the largest.
    q = (torch.rand(rows, heads, dim, generator=gen) + 0.5).to(torch_dtype(fp8))
    k = (torch.rand(keys, dim, generator=gen) + 0.5).to(torch_dtype(fp8))
    scales = torch.rand(keys, generator=gen) + 0.1
    weights = torch.rand(rows, heads, generator=gen) + 0.1
    ks = torch.zeros(rows, dtype=torch.int32)
    ke = torch.full((rows,), keys, dtype=torch.int32)
    if fault.endswith("scale"):
        scales[7] = float(fault.split()[0].replace("+", ""))
    elif fault == "nan key byte":
        k.view(torch.uint8)[7, 5] = NAN_BYTE[fp8]
    else:
        q.view(torch.uint8)[2, 3, 9] = NAN_BYTE[fp8]
    logits = _ragged(which, fp8, q, k, scales, weights, ks, ke)
    if fault == "nan q byte":
        assert torch.isnan(logits[2]).all() and not torch.isnan(logits[torch.arange(rows) != 2]).any()
    else:
        assert torch.isnan(logits[:, 7]).all() and not torch.isnan(logits[:, torch.arange(keys) != 7]).any()


def test_a_page_entry_whose_slots_pass_int32_is_no_slot_even_inside_a_huge_pool():
    # 2^25 + 3 blocks of 64 start at slot 2^31 + 192: an int32 slot would wrap to a negative garbage value.
    table = torch.tensor([[2**25 + 3, 1]], dtype=torch.int32)
    batch = ExtendBatch.from_lengths([64], [1], table, num_kv_blocks=2**30)
    slots = build_ragged_metadata(batch).gather_slots
    assert (slots[:64] == -1).all() and slots[64].item() == 64


def test_total_keys_past_the_int32_room_is_refused():
    with pytest.raises(LayoutError, match="total_keys=1073741825 is past 1073741824"):
        ExtendBatch(prefix_lens=torch.zeros(0, dtype=torch.int32), extend_lens=torch.zeros(0, dtype=torch.int32),
                    page_table=torch.zeros(0, 1, dtype=torch.int32), total_tokens=0, total_keys=2**30 + 1)
