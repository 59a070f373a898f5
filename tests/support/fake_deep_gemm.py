"""A recording stand-in for the deep_gemm module, for tests without a GPU.

It records every call's arguments (the objects themselves, so tests can check identity), rejects what the
real host code asserts on, and computes the logits with the torch reference, then leaves garbage (NaN or
random values) past each token's length and hands back a slice of a wider 256-aligned buffer, as the
real kernel does. A backend that passes tests against it must mask on its own.

`scheduler="sgl"` / `"tokenspeed"` ships that build's scheduler source, so the adapter computes the SM90
schedule in its page guard's launch; the stand-in then checks a schedule it did not build against the
rule (tests/support/deepgemm_schedule.py).

`sm90_next_n4=True` stands for a build with SM90's 2-CTA KV-multicast next_n 4 kernel (tokenspeed-deepgemm
2.5.0.post20260629): it ships that kernel's source beside its `__file__` (the adapter's probe reads it)
and, at next_n 4, asserts a schedule of num_sms / 2 + 1 rows, one task per cluster, as the real host
code does. Without it the stand-in ships an SM90 source without the multicast kernel.

The ragged (extend) logits follow the same generations: "fp8_fp4" exposes fp8_fp4_mqa_logits (q as a
(values, scales) pair), "fp8" the first-generation fp8_mqa_logits (q a bare tensor, no max_seqlen_k).
Without clean_logits they leave garbage outside each row's [ks, ke); with it, -inf.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends.reference.paged_mqa_logits import reference_paged_mqa_logits as reference_logits
from backends.reference.ragged_mqa_logits import reference_ragged_mqa_logits

# The real kernels split KV into 256-token chunks and allocate the logits row stride to match.
SPLIT_KV = 256
# The ragged kernel's logits rows: S + one 256-key block, rounded up to 64 floats (128-byte TMA rows).
RAGGED_ROW_ALIGN = 64


@dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict = field(default_factory=dict)


class FakeDeepGemm(types.ModuleType):
    """`generation` "fp8_fp4" exposes fp8_fp4_paged_mqa_logits (q as a (values, scales) pair);
    "fp8" exposes only the first-generation fp8_paged_mqa_logits (q a bare tensor)."""

    def __init__(self, generation: str = "fp8_fp4", *, num_sms: int = 8, has_get_num_sms: bool = True,
                 garbage: str = "nan", has_schedule: bool = True, sm90_next_n4: bool = False,
                 package_dir: Path | None = None, scheduler: str | None = None):
        super().__init__("deep_gemm")
        self._sm90_next_n4 = sm90_next_n4
        self._scheduler = scheduler  # "sgl" / "tokenspeed": ships that scheduler source (package_dir needed)
        if package_dir is not None:
            ship_sm90_source(package_dir, multicast=sm90_next_n4)
            if scheduler is not None:
                from tests.support.deepgemm_schedule import ship_scheduler_source

                ship_scheduler_source(package_dir, scheduler)
            self.__file__ = str(package_dir / "__init__.py")
        self.__version__ = f"fake-{generation}"
        self.calls: list[Call] = []
        self.outputs: list[torch.Tensor] = []  # each logits call's returned tensor
        self._num_sms = num_sms
        self._garbage = garbage
        self._schedules: dict[int, torch.Tensor] = {}  # id(schedule) -> the lens it was built from
        if has_schedule:
            self.get_paged_mqa_logits_metadata = self._metadata
        if has_get_num_sms:
            self.get_num_sms = lambda: self._num_sms
        if generation == "fp8_fp4":
            self.fp8_fp4_paged_mqa_logits = self._logits_fp8_fp4
            self.fp8_fp4_mqa_logits = self._ragged_fp8_fp4
        elif generation == "fp8":
            self.fp8_paged_mqa_logits = self._logits_fp8
            self.fp8_mqa_logits = self._ragged_fp8
        elif generation != "none":
            raise ValueError(f"unknown generation {generation!r}")

    def calls_to(self, name: str) -> list[Call]:
        return [call for call in self.calls if call.name == name]

    def _metadata(self, context_lens, block_kv, num_sms, *rest):
        self.calls.append(Call("get_paged_mqa_logits_metadata", (context_lens, block_kv, num_sms, *rest)))
        _require(context_lens.dim() == 2, "context_lens.dim() == 2")
        _require(context_lens.dtype == torch.int32 and context_lens.is_contiguous(), "int32 contiguous lens")
        _require(block_kv == 64, "block_kv == 64")
        # Any deterministic function of the lens will do: the tests check where it goes, not its values.
        pages = (context_lens.long() + block_kv - 1) // block_kv
        schedule = torch.zeros(num_sms + 1, 2, dtype=torch.int32)
        schedule[:, 0] = int(pages.sum())
        self._schedules[id(schedule)] = context_lens
        return schedule

    def _logits_fp8_fp4(self, q, *args):
        self.calls.append(Call("fp8_fp4_paged_mqa_logits", (q, *args)))
        # Some builds read a bare tensor as packed FP4 with missing scales: refuse it loudly here.
        _require(isinstance(q, tuple) and len(q) == 2 and q[1] is None, "q passed as (q_fp8, None)")
        return self._logits(q[0], *args)

    def _logits_fp8(self, q, *args):
        self.calls.append(Call("fp8_paged_mqa_logits", (q, *args)))
        _require(isinstance(q, torch.Tensor), "q a tensor")
        return self._logits(q, *args)

    def _logits(self, q, kv_cache, weights, context_lens, block_table, schedule, max_context_len, clean_logits=False):
        rows, next_n, heads, head_dim = q.shape
        _require(q.is_contiguous() and q.dtype == torch.float8_e4m3fn, "contiguous e4m3fn q")
        _require(heads in (32, 64), "num_heads in (32, 64)")
        _require(kv_cache.dtype == torch.uint8 and tuple(kv_cache.shape[1:]) == (64, 1, head_dim + 4), "kv_cache")
        _require(kv_cache.stride(1) == head_dim + 4 and kv_cache.stride(3) == 1, "kv_cache strides")
        _require(weights.is_contiguous() and weights.dtype == torch.float32, "contiguous fp32 weights")
        _require(tuple(weights.shape) == (rows * next_n, heads), "weights [B*N, H]")
        _require(tuple(context_lens.shape) == (rows, next_n) and context_lens.dtype == torch.int32, "lens [B, N]")
        _require(block_table.dim() == 2 and block_table.shape[0] == rows, "block_table [B, M]")
        _require(block_table.dtype == torch.int32 and block_table.stride(1) == 1, "int32 block_table")
        if self._sm90_next_n4 and next_n == 4:
            _require(self._num_sms % 2 == 0, "num_sms % 2 == 0")
            _require(tuple(schedule.shape) == (self._num_sms // 2 + 1, 2), "schedule [num_sms / 2 + 1, 2]")
        else:
            _require(tuple(schedule.shape) == (self._num_sms + 1, 2), "schedule [num_sms + 1, 2]")
        if self._scheduler is not None and id(schedule) not in self._schedules:  # computed by the adapter itself
            from tests.support.deepgemm_schedule import spelled_out

            slots = schedule.shape[0] - 1
            expected = spelled_out(context_lens.tolist(), slots, self._scheduler == "tokenspeed")
            _require(schedule.tolist() == expected, "the schedule of these very lens")
        else:
            _require(self._schedules.get(id(schedule)) is context_lens, "schedule built from these very lens")
        _require(not clean_logits, "clean_logits only with 1-D lens")
        exact = reference_logits(q, kv_cache, weights, context_lens, block_table, max_context_len)
        stride = math.ceil(max_context_len / SPLIT_KV) * SPLIT_KV
        if self._garbage == "nan":
            buffer = torch.full((rows * next_n, stride), float("nan"))
        else:
            buffer = torch.randn(rows * next_n, stride) * 1e3
        # As sgl-deep-gemm 0.1.5 lays it out on the H200 (2026-12-02): rows `stride` apart, the storage
        # ending at the last row's width (no padding after it).
        out = torch.empty_strided((rows * next_n, max_context_len), (stride, 1))
        out.copy_(buffer[:, :max_context_len])
        visible = exact != float("-inf")
        out[visible] = exact[visible]
        self.outputs.append(out)
        return out


    def _ragged_fp8_fp4(self, q, kv, weights, ks, ke, clean_logits=True, max_seqlen_k=0,
                        logits_dtype=torch.float32):
        self.calls.append(Call("fp8_fp4_mqa_logits", (q, kv, weights, ks, ke, clean_logits),
                               {"max_seqlen_k": max_seqlen_k, "logits_dtype": logits_dtype}))
        _require(isinstance(q, tuple) and len(q) == 2 and q[1] is None, "q passed as (q_fp8, None)")
        _require(logits_dtype == torch.float32, "fp32 logits")
        _require(max_seqlen_k == 0, "max_seqlen_k == 0 (full-width logits)")
        return self._ragged(q[0], kv, weights, ks, ke, clean_logits)

    def _ragged_fp8(self, q, kv, weights, ks, ke, clean_logits=True):
        self.calls.append(Call("fp8_mqa_logits", (q, kv, weights, ks, ke, clean_logits)))
        _require(isinstance(q, torch.Tensor), "q a tensor")
        return self._ragged(q, kv, weights, ks, ke, clean_logits)

    def _ragged(self, q, kv, weights, ks, ke, clean_logits):
        _require(isinstance(kv, tuple) and len(kv) == 2, "kv passed as (k_fp8, scales)")
        k, scales = kv
        rows, heads, head_dim = q.shape
        _require(q.is_contiguous() and q.dtype == torch.float8_e4m3fn, "contiguous e4m3fn q")
        _require(heads in (32, 64) and head_dim in (32, 64, 128), "num_heads in (32, 64), head_dim in (32, 64, 128)")
        _require(k.dim() == 2 and k.shape[1] == head_dim, "k [S, D]")
        _require(k.is_contiguous() and k.dtype == torch.float8_e4m3fn, "contiguous e4m3fn k")
        _require(tuple(scales.shape) == (k.shape[0],), "scales [S]")
        _require(scales.is_contiguous() and scales.dtype == torch.float32, "contiguous fp32 scales")
        _require(tuple(weights.shape) == (rows, heads), "weights [M, H]")
        _require(weights.is_contiguous() and weights.dtype == torch.float32, "contiguous fp32 weights")
        for bound in (ks, ke):
            _require(tuple(bound.shape) == (rows,) and bound.dtype == torch.int32, "ks / ke int32 [M]")
            _require(bound.is_contiguous(), "contiguous ks / ke")
        _require(isinstance(clean_logits, bool), "clean_logits a bool")
        exact = reference_ragged_mqa_logits(q, k, scales, weights, ks, ke)
        keys = k.shape[0]
        stride = math.ceil((keys + SPLIT_KV) / RAGGED_ROW_ALIGN) * RAGGED_ROW_ALIGN
        if clean_logits:
            buffer = torch.full((rows, stride), float("-inf"), device=q.device)
        elif self._garbage == "nan":
            buffer = torch.full((rows, stride), float("nan"), device=q.device)
        else:
            buffer = torch.randn(rows, stride, device=q.device) * 1e3
        out = buffer[:, :keys]
        visible = exact != float("-inf")
        out[visible] = exact[visible]
        self.outputs.append(out)
        return out


def ship_sm90_source(package_dir: Path, *, multicast: bool) -> Path:
    """A stand-in for the SM90 paged logits kernel source a build ships under include/ (only the
    template parameter the probe looks for, or its absence)."""
    source = package_dir.joinpath("include", "deep_gemm", "impls", "sm90_fp8_paged_mqa_logits.cuh")
    source.parent.mkdir(parents=True, exist_ok=True)
    parameters = "uint32_t kNumTMAThreads, uint32_t kNumMathThreads,"
    if multicast:
        parameters += " uint32_t kNumKVMulticast,"
    source.write_text(f"template <uint32_t kNextN, uint32_t kNumHeads, {parameters} typename logits_dtype_t>\n")
    return source


class FakeKernelError(RuntimeError):
    """What the real extension raises when a host-side assertion fails."""


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise FakeKernelError(f"deep_gemm host assertion failed: {what}")
