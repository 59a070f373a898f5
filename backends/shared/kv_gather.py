"""Gather a batch's keys out of the paged indexer cache in Triton: backends/reference/kv_gather.py's
function, with the team's device-side bound check instead of an exception.

A program copies BLOCK_S gathered keys: D fp8 bytes and one fp32 scale each, moved as 32-bit words
(fp8 bytes need no decoding to be copied, so one kernel serves e4m3fn and e4m3fnuz alike). A slot
outside [0, num_blocks * block_kv) is never read: its key is written as zeros with a NaN scale, so
every logit that uses it is NaN and top-k never selects it, and BAD_PAGE (1, dispatch/contract/bounds.py) is
ORed into `error_flag[0]` for the engine to read when it syncs anyway. Nothing here waits on the device.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from dispatch.contract import Fp8Dtype, LayoutError, torch_dtype

_NAN_BITS = 0x7FC00000  # the fp32 quiet NaN, as the int32 the kernel moves
BLOCK_S = 64


@triton.jit
def _gather_keys_kernel(
    cache_ptr,  # int32 words of the cache, [num_blocks, BLOCK_KV * (D + 4) / 4]
    slots_ptr,  # int32 [S]
    k_ptr,  # int32 words of k, [S, D / 4]
    s_ptr,  # int32 bits of the fp32 scales, [S]
    flag_ptr,  # int32 [1]
    keys,
    num_slots,
    BLOCK_KV: tl.constexpr,
    DW: tl.constexpr,  # D / 4: words per key
    BLOCK_S: tl.constexpr,
    NAN_BITS: tl.constexpr,
):
    index = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    present = index < keys
    slot = tl.load(slots_ptr + index, mask=present, other=0)
    bad = present & ((slot < 0) | (slot >= num_slots))
    good = present & ~bad
    block = (slot // BLOCK_KV).to(tl.int64)
    offset = slot % BLOCK_KV
    base = block * (BLOCK_KV * (DW + 1))
    word = tl.arange(0, DW)
    values = tl.load(cache_ptr + (base + offset * DW)[:, None] + word[None, :], mask=good[:, None], other=0)
    tl.store(k_ptr + index.to(tl.int64)[:, None] * DW + word[None, :], values, mask=present[:, None])
    scale = tl.load(cache_ptr + base + BLOCK_KV * DW + offset, mask=good, other=NAN_BITS)
    tl.store(s_ptr + index, scale, mask=present)
    # OR, not max: the word is shared with other kernels' bits (dispatch/contract/bounds.py: 1 is BAD_PAGE).
    tl.atomic_or(flag_ptr + tl.zeros_like(index), tl.full((BLOCK_S,), 1, tl.int32), mask=bad)


def triton_gather_keys(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    error_flag: torch.Tensor,
    fp8_dtype: Fp8Dtype = Fp8Dtype.E4M3FN,
    *,
    k_out: torch.Tensor | None = None,
    scales_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k fp8 [S, D] in `fp8_dtype`, fp32 scales [S]) for int32 slots [S].

    `error_flag` is an int32 tensor of at least one element on
    the cache's device; the kernel only ever ORs BAD_PAGE (1) into element 0 (the caller zeroes it when it reads
    it). `k_out` / `scales_out` are preallocated results (a per-batch workspace).
    """
    num_blocks, block_kv, head_dim = _check(kv_cache, slots, error_flag)
    keys = slots.shape[0]
    if k_out is None:
        k_out = torch.empty(keys, head_dim, dtype=torch_dtype(fp8_dtype), device=kv_cache.device)
    if scales_out is None:
        scales_out = torch.empty(keys, dtype=torch.float32, device=kv_cache.device)
    if k_out.dtype != torch_dtype(fp8_dtype) or tuple(k_out.shape) != (keys, head_dim) or not k_out.is_contiguous():
        raise LayoutError(f"k_out must be a contiguous {torch_dtype(fp8_dtype)} [S={keys}, D={head_dim}]; "
                          f"got {k_out.dtype} {list(k_out.shape)}")
    if scales_out.dtype != torch.float32 or tuple(scales_out.shape) != (keys,) or not scales_out.is_contiguous():
        raise LayoutError(f"scales_out must be contiguous fp32 [S={keys}]; "
                          f"got {scales_out.dtype} {list(scales_out.shape)}")
    if keys == 0:
        return k_out, scales_out
    words = kv_cache.view(num_blocks, -1).view(torch.int32)
    _gather_keys_kernel[(triton.cdiv(keys, BLOCK_S),)](
        words,
        slots,
        k_out.view(torch.uint8).view(torch.int32),
        scales_out.view(torch.int32),
        error_flag,
        keys,
        num_blocks * block_kv,
        BLOCK_KV=block_kv,
        DW=head_dim // 4,
        BLOCK_S=BLOCK_S,
        NAN_BITS=_NAN_BITS,
        num_warps=4,
    )
    return k_out, scales_out


def _check(kv_cache, slots, error_flag) -> tuple[int, int, int]:
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.dtype != torch.uint8 or not kv_cache.is_contiguous():
        raise LayoutError(f"kv_cache must be contiguous uint8 [num_blocks, block_kv, 1, D + 4]; got {kv_cache.dtype} "
                          f"{list(kv_cache.shape)}, strides {kv_cache.stride()}")
    num_blocks, block_kv, _, row_bytes = kv_cache.shape
    head_dim = row_bytes - 4
    if head_dim <= 0 or head_dim & (head_dim - 1) or head_dim < 16:
        raise LayoutError(f"kv_cache rows of {row_bytes} bytes: D = {head_dim} must be a power of two >= 16")
    if kv_cache.storage_offset() % 4:
        raise LayoutError(f"kv_cache must start on a 4-byte boundary (storage offset {kv_cache.storage_offset()})")
    if slots.dtype != torch.int32 or slots.dim() != 1 or slots.stride(0) != 1:
        raise LayoutError(f"slots must be contiguous int32 [S]; got {slots.dtype} {list(slots.shape)}")
    if error_flag.dtype != torch.int32 or error_flag.numel() < 1 or not error_flag.is_contiguous():
        raise LayoutError(f"error_flag must be a contiguous int32 tensor of >= 1 element; got {error_flag.dtype} "
                          f"{list(error_flag.shape)}")
    devices = {t.device for t in (kv_cache, slots, error_flag)}
    if len(devices) != 1:
        raise LayoutError(f"kv_cache, slots and error_flag must be on one device; got {sorted(map(str, devices))}")
    return num_blocks, block_kv, head_dim


@dataclasses.dataclass(frozen=True)
class TritonKeyGather:
    """An extend plan's K gather through the Triton copy kernel (dispatch.contract.RaggedKeyGather):
    the batch's slots and error flags, bound once per batch, applied to each layer's cache with no
    host-device sync. It copies bytes, so it serves every ragged GPU backend and both fp8 dtypes."""

    slots: torch.Tensor
    error_flags: torch.Tensor
    fp8_dtype: Fp8Dtype

    @classmethod
    def for_plan(cls, plan) -> "TritonKeyGather":
        return cls(plan.metadata.gather_slots, plan.error_flags, plan.fp8_dtype)

    def __call__(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_gather_keys(kv_cache, self.slots, self.error_flags, self.fp8_dtype)
