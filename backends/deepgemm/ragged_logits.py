"""deep_gemm's ragged (prefill) MQA logits, tolerant of the API generations in the field.

- `fp8_mqa_logits(q, (k, scales), weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits)`: the
  first generation (SM90 only).
- Then `max_seqlen_k` (default 0) after clean_logits: non-zero asks for a compressed [M, max_seqlen_k]
  output (column j = key ks[m] + j) and forbids clean_logits. This adapter never passes it, so every
  generation returns the full [M, S] layout.
- Newest: `fp8_fp4_mqa_logits(q, ...)` with q a (values, scales) pair and `logits_dtype` last; fp8 q goes
  as `(q, None)` (a scales tensor means FP4). Builds that have it keep `fp8_mqa_logits` as a legacy
  alias, so the newer name is tried first.
With clean_logits the extension writes -inf outside each row's [ks, ke) (a second kernel); without it
those positions are garbage. The output is a slice of a wider buffer: rows are not contiguous.
Every function takes the module as its first argument, so tests can hand in a recording stand-in.
"""

from __future__ import annotations

from types import ModuleType

import torch

from dispatch.errors import DtypeMismatchError, LayoutError

LOGITS_FP8_FP4 = "fp8_fp4_mqa_logits"
LOGITS_FP8 = "fp8_mqa_logits"
# What the SM90 / SM100 fp8 kernels are instantiated for.
HEAD_COUNTS = (32, 64)
HEAD_DIMS = (32, 64, 128)


def missing_ragged_symbols(module: ModuleType) -> list[str]:
    """The ragged API names this adapter needs and `module` lacks, as they would read in a message."""
    if hasattr(module, LOGITS_FP8_FP4) or hasattr(module, LOGITS_FP8):
        return []
    return [f"`{LOGITS_FP8_FP4}` or `{LOGITS_FP8}`"]


def launch_ragged_mqa_logits(
    module: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    scales: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    clean_logits: bool = True,
) -> torch.Tensor:
    """fp32 [M, S] (row stride wider than S); -inf outside [ks, ke) with clean_logits, garbage without."""
    check_kernel_inputs(q, k, scales, weights, ks, ke)
    if q.shape[0] == 0 or k.shape[0] == 0:
        # The extension's TMA descriptors need a non-empty tensor; an empty side is all -inf by definition.
        return torch.full((q.shape[0], k.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    if hasattr(module, LOGITS_FP8_FP4):
        kernel, q_arg = getattr(module, LOGITS_FP8_FP4), (q, None)
    else:
        kernel, q_arg = getattr(module, LOGITS_FP8), q
    # Positional: the six leading parameters sit in the same places in every generation.
    return kernel(q_arg, (k, scales), weights, ks, ke, clean_logits)


def check_kernel_inputs(q, k, scales, weights, ks, ke) -> None:
    """LayoutError / DtypeMismatchError for anything the extension would assert on, naming the tensor."""
    if q.dim() != 3:
        raise LayoutError(f"q must be [M, H, D]; got {list(q.shape)}")
    rows, heads, head_dim = q.shape
    if q.dtype != torch.float8_e4m3fn or k.dtype != torch.float8_e4m3fn:
        raise DtypeMismatchError(
            f"deep_gemm's fp8 MQA logits read e4m3fn only; q is {q.dtype}, k is {k.dtype}"
        )
    if not q.is_contiguous():
        raise LayoutError(f"deep_gemm needs a contiguous q; got strides {list(q.stride())}")
    if heads not in HEAD_COUNTS or head_dim not in HEAD_DIMS:
        raise LayoutError(f"deep_gemm supports H in {HEAD_COUNTS} and D in {HEAD_DIMS}; q is {list(q.shape)}")
    if k.dim() != 2 or k.shape[1] != head_dim or not k.is_contiguous():
        raise LayoutError(f"deep_gemm needs a contiguous k [S, D={head_dim}]; got {list(k.shape)}, "
                          f"strides {list(k.stride())}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (k.shape[0],) or not scales.is_contiguous():
        raise LayoutError(f"deep_gemm needs contiguous fp32 scales [S={k.shape[0]}]; "
                          f"got {scales.dtype} {list(scales.shape)}")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (rows, heads) or not weights.is_contiguous():
        raise LayoutError(f"deep_gemm needs contiguous fp32 weights [M={rows}, H={heads}]; got {weights.dtype} "
                          f"{list(weights.shape)}, strides {list(weights.stride())}")
    for name, bound in (("ks", ks), ("ke", ke)):
        if bound.dtype != torch.int32 or tuple(bound.shape) != (rows,) or not bound.is_contiguous():
            raise LayoutError(f"deep_gemm needs {name} as contiguous int32 [M={rows}]; "
                              f"got {bound.dtype} {list(bound.shape)}")
