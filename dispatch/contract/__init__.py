"""The plugin contract, whole: everything a backend plugin imports, from this module alone.

A plugin registers `Backend` values through `hookimpl`-marked `register_backends(register)`. Each op's
`run` follows the op's call convention, a typed Protocol in the op's own file (dispatch/contract/ops/);
OP_CONTRACTS says, per op, which Protocol and which layouts a backend of it may declare. The host calls a
backend's `run` only with inputs that passed the op's input checks against the decision's layout, so a
backend does not repeat them; the checks are here too, for a plugin's own tests and direct callers.

Also here: the key and layout enums, the errors a backend raises, the bounds helpers and error-flag
bits (dispatch/contract/bounds.py), the fp8 helpers, the paged K-cache layout and its builder, the
machine detection a probe needs, and the plan types a backend reads.

A backend that raises (a kernel launch failure, a missing symbol) surfaces as BackendError naming the
backend, op, key and rule, chained to the original. The project's own errors (LayoutError and
DtypeMismatchError from the input checks) and CUDA out-of-memory pass through unchanged. There is no
fallback to another backend.

What imports torch loads on first use (`validate` and registration run without torch).
"""

from __future__ import annotations

from dispatch.contract import detect
from dispatch.contract.backend import ALL_ARCHS, ALL_FP8_DTYPES, ALL_MODES, PAGED_MODES, Availability, Backend, Support
from dispatch.contract.errors import (
    BackendError,
    DispatchError,
    DtypeMismatchError,
    GraphMismatchError,
    IndexBoundsError,
    InvalidKeyError,
    LayoutError,
    UnservedCallError,
)
from dispatch.contract.fp8 import fp8_dtype_of, torch_dtype
from dispatch.contract.hookspecs import hookimpl
from dispatch.contract.key import FP8_MAX, Arch, DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.contract.kv_cache import BLOCK_KV, quantize_keys, split_kv_cache
from dispatch.contract.layout import ROW_UNIT_FLOATS, Layout, readable_width
from dispatch.contract.ops import (
    OP_CONTRACTS,
    IndexerQQuantRun,
    OpContract,
    PagedMqaLogitsRun,
    RaggedKeyGather,
    RaggedMqaLogitsRun,
    TopkRun,
    check_logits_inputs,
    check_q_quant_inputs,
    check_ragged_logits_inputs,
    check_topk_inputs,
)
from dispatch.contract.rope import RopeSpec
from dispatch.contract.verification import Verified



# Machine detection, looked up in dispatch.contract.detect at each call: a test that patches that
# module (an arch it is not on) is seen by every plugin, which imports these names from here.
def detect_arch():
    """This machine's arch (dispatch.contract.detect.detect_arch)."""
    return detect.detect_arch()


def platform_fp8_dtype(arch):
    """The arch's platform fp8 dtype (dispatch.contract.detect.platform_fp8_dtype)."""
    return detect.platform_fp8_dtype(arch)


def rocm_gcn_arch():
    """The ROCm GPU's gcnArchName (dispatch.contract.detect.rocm_gcn_arch)."""
    return detect.rocm_gcn_arch()


def triton_interpreter_on():
    """Whether Triton runs under its CPU interpreter (dispatch.contract.detect.triton_interpreter_on)."""
    return detect.triton_interpreter_on()


def dependent_launch_switched_off():
    """Whether DISPATCH_PDL=0 rules out dependent launch (dispatch.contract.detect.dependent_launch_switched_off)."""
    return detect.dependent_launch_switched_off()


# Names whose modules import torch: loaded on first use (module attribute lookup, PEP 562).
_LAZY = {
    "BAD_LENGTH": "dispatch.contract.bounds",
    "BAD_PAGE": "dispatch.contract.bounds",
    "BAD_POSITION": "dispatch.contract.bounds",
    "LENGTH_PAST_BOUND": "dispatch.contract.bounds",
    "check_pages": "dispatch.contract.bounds",
    "check_positions": "dispatch.contract.bounds",
    "debug_bounds_on": "dispatch.contract.bounds",
    "new_error_flags": "dispatch.contract.bounds",
    "scratch_error_flags": "dispatch.contract.bounds",
    "build_paged_kv_cache": "dispatch.contract.paged_cache",
    "page_table_for": "dispatch.contract.paged_cache",
    "pages_of": "dispatch.contract.paged_cache",
    # The plan types a backend reads, defined here; dispatch/step/ builds them.
    "PagedPlan": "dispatch.contract.plan",
    "PlanTensors": "dispatch.contract.plan",
    "ExtendPlan": "dispatch.contract.extend_plan",
    "ChunkTensors": "dispatch.contract.extend_plan",
    "Chunk": "dispatch.contract.extend_plan",
    "ExtendBatch": "dispatch.contract.extend_batch",
    "RaggedMetadata": "dispatch.contract.extend_plan",
    "HostRanges": "dispatch.contract.extend_plan",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dispatch.contract' has no attribute {name!r}")


__all__ = sorted(
    [
        "ALL_ARCHS",
        "ALL_FP8_DTYPES",
        "ALL_MODES",
        "BLOCK_KV",
        "FP8_MAX",
        "OP_CONTRACTS",
        "PAGED_MODES",
        "Arch",
        "Availability",
        "Backend",
        "BackendError",
        "DispatchError",
        "DispatchKey",
        "DtypeMismatchError",
        "Fp8Dtype",
        "ForwardMode",
        "GraphMismatchError",
        "IndexBoundsError",
        "IndexerQQuantRun",
        "InvalidKeyError",
        "Layout",
        "ROW_UNIT_FLOATS",
        "readable_width",
        "LayoutError",
        "Op",
        "OpContract",
        "PagedMqaLogitsRun",
        "RaggedKeyGather",
        "RaggedMqaLogitsRun",
        "RopeSpec",
        "Support",
        "TopkRun",
        "UnservedCallError",
        "Verified",
        "check_logits_inputs",
        "check_q_quant_inputs",
        "check_ragged_logits_inputs",
        "check_topk_inputs",
        "dependent_launch_switched_off",
        "detect",
        "detect_arch",
        "fp8_dtype_of",
        "hookimpl",
        "platform_fp8_dtype",
        "quantize_keys",
        "rocm_gcn_arch",
        "split_kv_cache",
        "torch_dtype",
        "triton_interpreter_on",
    ]
    + list(_LAZY)
)
