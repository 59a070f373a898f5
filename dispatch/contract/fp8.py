"""The mapping between the key's fp8 dtype names and torch dtypes (torch imported on use)."""

from __future__ import annotations

from dispatch.contract.errors import DtypeMismatchError
from dispatch.contract.key import Fp8Dtype


def torch_dtype(fp8_dtype: Fp8Dtype):
    import torch

    return {Fp8Dtype.E4M3FN: torch.float8_e4m3fn, Fp8Dtype.E4M3FNUZ: torch.float8_e4m3fnuz}[Fp8Dtype(fp8_dtype)]


def fp8_dtype_of(dtype, what: str) -> Fp8Dtype:
    """The key's name for a torch fp8 dtype; `what` names the tensor in the error."""
    import torch

    names = {torch.float8_e4m3fn: Fp8Dtype.E4M3FN, torch.float8_e4m3fnuz: Fp8Dtype.E4M3FNUZ}
    if dtype not in names:
        raise DtypeMismatchError(f"{what} has dtype {dtype}; expected torch.float8_e4m3fn or torch.float8_e4m3fnuz")
    return names[dtype]
