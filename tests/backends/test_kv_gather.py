"""Gathering a batch's keys from the paged cache: the reference against the keys the cache was built
from, the Triton kernel against the reference (bytes exact), and bad slots (reference: an error naming
the request; kernel: zeros, a NaN scale and the error flag, nothing read)."""

from __future__ import annotations

import pytest
import torch

from dispatch.contract.kv_cache import quantize_keys
from backends.reference.kv_gather import reference_gather_keys as reference_gather
from backends.shared.kv_gather import triton_gather_keys
from dispatch.contract.errors import LayoutError
from dispatch.contract.key import Fp8Dtype
from tests.support.extend_batch import extend_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [([0], [5]), ([100, 0, 64], [1, 30, 1]), ([63, 129], [2, 127])]


def flag():
    return torch.zeros(1, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("fp8_dtype", list(Fp8Dtype))
@pytest.mark.parametrize("prefix_lens,extend_lens", CASES)
def test_reference_returns_each_requests_keys_in_order(prefix_lens, extend_lens, fp8_dtype):
    case = extend_case(prefix_lens, extend_lens, fp8_dtype=fp8_dtype, seed=1)
    k, scales = case.gathered()
    values, expected_scales = quantize_keys(torch.cat(case.keys), fp8_dtype)
    assert torch.equal(k.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(scales, expected_scales)


@pytest.mark.parametrize("fp8_dtype", list(Fp8Dtype))
@pytest.mark.parametrize("prefix_lens,extend_lens", CASES)
def test_kernel_matches_reference_bytes(prefix_lens, extend_lens, fp8_dtype):
    case = extend_case(prefix_lens, extend_lens, fp8_dtype=fp8_dtype, device=DEVICE, seed=2)
    error = flag()
    k, scales = triton_gather_keys(case.kv_cache, case.metadata.gather_slots, error, fp8_dtype)
    ref_k, ref_scales = case.gathered()
    assert k.dtype == ref_k.dtype
    assert torch.equal(k.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))
    assert int(error) == 0


def test_any_slot_order_and_preallocated_outputs():
    case = extend_case([200], [56], device=DEVICE, seed=3)
    num_slots = case.kv_cache.shape[0] * 64
    slots = torch.randint(0, num_slots, (300,), dtype=torch.int32).to(DEVICE)
    k_out = torch.empty(300, 128, dtype=torch.float8_e4m3fn, device=DEVICE)
    scales_out = torch.empty(300, device=DEVICE)
    k, scales = triton_gather_keys(case.kv_cache, slots, flag(), k_out=k_out, scales_out=scales_out)
    assert k is k_out and scales is scales_out
    ref_k, ref_scales = reference_gather(case.kv_cache, slots)
    assert torch.equal(k.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))


@pytest.mark.parametrize("bad", [-1, "num_slots", 1 << 30, -(1 << 31)])
def test_bad_slot_is_poisoned_and_flagged_never_read(bad):
    case = extend_case([30, 70], [4, 6], device=DEVICE, seed=4)
    num_slots = case.kv_cache.shape[0] * 64
    slots = case.metadata.gather_slots.clone()
    position = 40  # request 1's key 6
    slots[position] = num_slots if bad == "num_slots" else bad
    error = flag()
    k, scales = triton_gather_keys(case.kv_cache, slots, error)
    assert int(error) == 1
    assert torch.isnan(scales[position]) and (k[position].view(torch.uint8) == 0).all()
    ref_k, ref_scales = case.gathered()
    good = torch.arange(slots.shape[0], device=DEVICE) != position
    assert torch.equal(k[good].view(torch.uint8), ref_k[good].view(torch.uint8))
    assert torch.equal(scales[good], ref_scales[good])
    with pytest.raises(LayoutError, match=rf"gathered key 40 \(request 1, its key 6\) maps to slot {slots[position]}"):
        reference_gather(case.kv_cache, slots, key_offsets=case.metadata.key_offsets)


def test_flag_is_only_ever_set():
    """Several bad slots in several programs leave the flag at 1; a clean gather does not clear it."""
    case = extend_case([300], [10], device=DEVICE, seed=5)
    slots = case.metadata.gather_slots.clone()
    slots[::50] = -7
    error = flag()
    triton_gather_keys(case.kv_cache, slots, error)
    assert int(error) == 1
    triton_gather_keys(case.kv_cache, case.metadata.gather_slots, error)
    assert int(error) == 1


def test_page_table_too_short_is_a_bad_slot():
    """Keys past the page table's width get slot -1 from the metadata: the gather flags them."""
    case = extend_case([100], [28], device=DEVICE, seed=6)
    from dispatch.step.extend_batch import ExtendBatch, build_ragged_metadata

    narrow = ExtendBatch(prefix_lens=case.batch.prefix_lens, extend_lens=case.batch.extend_lens,
                         page_table=case.batch.page_table[:, :1].contiguous(), total_tokens=28, total_keys=128)
    slots = build_ragged_metadata(narrow).gather_slots
    assert (slots[64:] == -1).all() and (slots[:64] >= 0).all()
    error = flag()
    _, scales = triton_gather_keys(case.kv_cache, slots, error)
    assert int(error) == 1 and torch.isnan(scales[64:]).all() and not torch.isnan(scales[:64]).any()
    with pytest.raises(LayoutError, match="request 0, its key 64"):
        reference_gather(case.kv_cache, slots, key_offsets=build_ragged_metadata(narrow).key_offsets)


def test_wrapper_rejects_bad_tensors():
    case = extend_case([10], [5], device=DEVICE, seed=7)
    slots = case.metadata.gather_slots
    with pytest.raises(LayoutError, match="slots"):
        triton_gather_keys(case.kv_cache, slots.long(), flag())
    with pytest.raises(LayoutError, match="error_flag"):
        triton_gather_keys(case.kv_cache, slots, torch.zeros(1, device=DEVICE))
    with pytest.raises(LayoutError, match="kv_cache"):
        triton_gather_keys(case.kv_cache.view(torch.int8), slots, flag())
    with pytest.raises(LayoutError, match="k_out"):
        triton_gather_keys(case.kv_cache, slots, flag(), k_out=torch.empty(15, 128, dtype=torch.float8_e4m3fnuz, device=DEVICE))


def test_empty_gather():
    case = extend_case([10], [5], device=DEVICE, seed=8)
    k, scales = triton_gather_keys(case.kv_cache, torch.zeros(0, dtype=torch.int32, device=DEVICE), flag())
    assert k.shape == (0, 128) and scales.shape == (0,)


@pytest.mark.gpu
def test_extend_shape_on_gpu():
    case = extend_case([15000, 30000, 0], [1024, 4096, 2048], device="cuda", seed=9)
    error = flag()
    k, scales = triton_gather_keys(case.kv_cache, case.metadata.gather_slots, error)
    ref_k, ref_scales = case.gathered()
    assert int(error) == 0 and torch.equal(k.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(scales, ref_scales)
