"""Registers DeepGEMM's paged MQA logits backends. Each one's whole contract is its row below.

| backend               | layout  | arch  | next_n | why                                                 |
| deepgemm.sm100        | native  | sm100 | >= 1   | SM100 kernels take any next_n (odd ones padded)     |
| deepgemm.sm90         | native  | sm90  | 1, 2   | SM90 kernels are instantiated for next_n 1 and 2    |
| deepgemm.sm90.flatten | flatten | sm90  | >= 1   | every token its own request: next_n 1 in the kernel |

All take e4m3fn only (the kernels read OCP fp8) in the paged modes (decode, target_verify, draft_extend).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from backends.deepgemm.availability import probe_for
from backends.deepgemm.library import import_deep_gemm
from dispatch.backend import PAGED_MODES, Backend, Support
from dispatch.hookspecs import hookimpl
from dispatch.key import Arch, Fp8Dtype, Op
from dispatch.layout import Layout

_E4M3FN = frozenset({Fp8Dtype.E4M3FN})

# name, layout, arch, next_n_max, description
_TABLE = (
    ("deepgemm.sm100", Layout.NATIVE, Arch.SM100, None, "DeepGEMM fp8 paged MQA logits, SM100, native"),
    ("deepgemm.sm90", Layout.NATIVE, Arch.SM90, 2, "DeepGEMM fp8 paged MQA logits, SM90, native (next_n 1-2)"),
    ("deepgemm.sm90.flatten", Layout.FLATTEN, Arch.SM90, None, "DeepGEMM fp8 paged MQA logits, SM90, flatten"),
)


class _OnFirstUse:
    """DeepGemmPagedLogits, built on first use: its module imports torch, and registering must not
    (`validate` runs without it)."""

    def __init__(self, layout: Layout, load: Callable[[], ModuleType]) -> None:
        self._args = (layout, load)
        self._impl = None

    def _built(self):
        if self._impl is None:
            from backends.deepgemm.paged_logits import DeepGemmPagedLogits

            self._impl = DeepGemmPagedLogits(*self._args)
        return self._impl

    def run(self, plan, q, kv_cache, weights):
        return self._built().run(plan, q, kv_cache, weights)

    def prepare(self, plan):
        return self._built().prepare(plan)


def deepgemm_backends(load: Callable[[], ModuleType] = import_deep_gemm) -> list[Backend]:
    """The three backends, resolving deep_gemm through `load` (tests pass a stand-in)."""
    backends = []
    for name, layout, arch, next_n_max, description in _TABLE:
        impl = _OnFirstUse(layout, load)
        support = Support(
            archs=frozenset({arch}), forward_modes=PAGED_MODES, fp8_dtypes=_E4M3FN, next_n_max=next_n_max
        )
        backends.append(
            Backend(
                name=name,
                op=Op.PAGED_MQA_LOGITS,
                layout=layout,
                supports=support,
                run=impl.run,
                probe=probe_for(arch, load),
                prepare=impl.prepare,
                description=description,
            )
        )
    return backends


@hookimpl
def register_backends(register):
    for backend in deepgemm_backends():
        register(backend)
