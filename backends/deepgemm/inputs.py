"""What deep_gemm's host code asserts about its tensors beyond the layout tag, checked before the launch
so a mistake names the tensor instead of surfacing as an assertion inside the C++ extension."""

from __future__ import annotations

import torch

from backends.deepgemm.api import BLOCK_KV
from dispatch.errors import LayoutError

# SM90 and SM100 kernels are instantiated for these head counts only.
HEAD_COUNTS = (32, 64)


def check_kernel_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    """Raise LayoutError for anything deep_gemm would reject; shapes and dtypes are checked already."""
    # The kernel builds TMA descriptors from these pointers and assumes dense rows.
    if not q.is_contiguous():
        raise LayoutError(f"deep_gemm needs a contiguous q; got strides {list(q.stride())}")
    if q.shape[2] not in HEAD_COUNTS:
        raise LayoutError(f"deep_gemm supports {HEAD_COUNTS} indexer heads; q has {q.shape[2]}")
    if not weights.is_contiguous() or weights.dtype != torch.float32:
        raise LayoutError(
            f"deep_gemm needs contiguous fp32 weights; got {weights.dtype}, strides {list(weights.stride())}"
        )
    if kv_cache.shape[1] != BLOCK_KV:
        raise LayoutError(f"the schedule is built for block_kv={BLOCK_KV}; kv_cache has block_kv={kv_cache.shape[1]}")
    if kv_cache.stride(1) != kv_cache.shape[3] or kv_cache.stride(3) != 1:
        raise LayoutError(f"deep_gemm needs kv_cache rows of D+4 dense bytes; got strides {list(kv_cache.stride())}")
    if context_lens.dtype != torch.int32 or not context_lens.is_contiguous():
        raise LayoutError(f"deep_gemm needs contiguous int32 context_lens; got {context_lens.dtype}")
    if block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        raise LayoutError(f"deep_gemm needs an int32 block_table with unit column stride; got {block_table.dtype}")
