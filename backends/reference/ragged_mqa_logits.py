"""Ragged MQA logits in plain torch: DeepGEMM's `fp8_mqa_logits` contract, written from the formula.

    logits[m, s] = sum_h w[m, h] * relu(q[m, h] . k[s]) * scale[s]   for ks[m] <= s < ke[m]
                 = -inf                                               otherwise

q fp8 [M, H, D], k fp8 [S, D] (the batch's keys gathered into one contiguous buffer), scale fp32 [S],
w fp32 [M, H], ks / ke int32 [M]. Extend rows see their own request's keys: [ks, ke) is the request's
slice of the buffer, causal inside it. fp8 values are decoded by torch, so e4m3fn and e4m3fnuz both
mean what their dtype says; q and k must share one. NaN as in the paged reference: a NaN q, key byte or
weight, or a non-finite key scale, makes the logits it touches NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backends.reference.kv_gather import ReferenceKeyGather
from dispatch.contract import ALL_ARCHS, Backend, DtypeMismatchError, Layout, Op, Support

if TYPE_CHECKING:  # torch is imported where it runs: registering the reference must not (plugin.py)
    import torch

# Rows per step: bounds the [rows, H, S] fp32 intermediate (64 rows x 64 heads x 64K keys = 1 GiB).
_ROWS_PER_STEP = 64


def reference_ragged_mqa_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    scales: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
) -> torch.Tensor:
    """fp32 [M, S]: the weighted relu scores inside each row's [ks, ke), -inf everywhere else."""
    import torch

    if q.dtype != k.dtype:
        raise DtypeMismatchError(f"q has dtype {q.dtype} but k has {k.dtype}; both must be one fp8 dtype")
    rows, heads, head_dim = q.shape
    keys = k.shape[0]
    k_float = k.float()
    # The paged path's NaN rule: a non-finite key scale makes its logits NaN (relu keeps a NaN q or key).
    scales = scales.float()
    scales = torch.where(torch.isfinite(scales), scales, float("nan"))
    positions = torch.arange(keys, device=q.device)
    out = torch.empty(rows, keys, dtype=torch.float32, device=q.device)
    for begin in range(0, rows, _ROWS_PER_STEP):
        end = min(begin + _ROWS_PER_STEP, rows)
        scores = (q[begin:end].float().reshape(-1, head_dim) @ k_float.T).view(end - begin, heads, keys)
        logits = (scores.relu() * weights[begin:end, :, None].float()).sum(dim=1) * scales[None, :]
        visible = (positions[None, :] >= ks[begin:end, None]) & (positions[None, :] < ke[begin:end, None])
        out[begin:end] = torch.where(visible, logits, float("-inf"))
    return out


def run_ragged_mqa_logits(q, k, scales, weights, ks, ke, *, fp8_dtype, clean_logits=True):
    # Always writes -inf outside [ks, ke): what clean_logits=False leaves unspecified may be -inf too.
    # The inputs passed the op's checks before this run (dispatch/contract/ops/ragged_logits.py).
    return reference_ragged_mqa_logits(q, k, scales, weights, ks, ke)


BACKENDS = (
    Backend(
        name="torch.reference",
        op=Op.RAGGED_MQA_LOGITS,
        layout=Layout.RAGGED,
        supports=Support(archs=ALL_ARCHS),
        run=run_ragged_mqa_logits,
        prepare=ReferenceKeyGather.for_plan,  # the extend plan's K gather in plain torch (raises on a bad slot)
        description="plain torch ragged logits over [ks, ke), -inf elsewhere; torch gather (raises on a bad slot)",
    ),
)
