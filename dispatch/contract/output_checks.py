"""What a backend hands back, checked against its op's contract (dispatch.contract) before the step uses
it: shape, dtype and device, from metadata only (no value is read, nothing waits on the device). A top-k
returning int64, `[1, k]` broadcast into every row or the wrong row count would otherwise flow into the
sparse attention; here it is a BackendError naming the backend and what it returned."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dispatch.contract.errors import BackendError

if TYPE_CHECKING:  # torch is imported where it is used: the contract loads without it
    import torch

    from dispatch.contract.decision import Decision


def check_output(decision: Decision, what: str, value: Any, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, *, min_columns: bool = False) -> None:
    """Raise BackendError unless `value` is a tensor of `dtype` on `device` with `shape` (with
    `min_columns`, the last dim may be wider: logits may be a slice of a wider buffer's rows)."""
    import torch

    if isinstance(value, torch.Tensor):
        actual = tuple(value.shape)
        shape_ok = actual == shape or (min_columns and len(actual) == len(shape) and actual[:-1] == shape[:-1]
                                       and actual[-1] >= shape[-1])
        if shape_ok and value.dtype == dtype and value.device == device:
            return
        got = f"{value.dtype} {list(actual)} on {value.device}"
    else:
        got = f"a {type(value).__name__}"
    raise BackendError(
        f"backend `{decision.backend}` (plugin `{decision.plugin}`) returned {got} as {decision.op.value}'s "
        f"{what}; the op's contract is {dtype} {list(shape)} on {device} (chosen by {decision.chosen_by})"
    )


def check_pair(decision: Decision, value: Any) -> tuple[Any, Any]:
    """The two tensors of a backend that returns a pair (Q quant, the K gather)."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise BackendError(
            f"backend `{decision.backend}` (plugin `{decision.plugin}`) returned a {type(value).__name__} from "
            f"{decision.op.value}; the op's contract is a pair of tensors (chosen by {decision.chosen_by})"
        )
    return value
