"""Registers SGLang's top-k kernels as backends of the `topk` op, available where SGLang (or its
kernel package) is installed. Each one's whole contract is its row below and its run in adapter.py.

| backend               | entry point (module)                                   | modes                 | k          | rows                         |
| sglang.topk_v2        | plan_topk_v2 + topk_transform_paged_v2 (sglang)        | decode, target_verify, draft_extend | 1..2048 | from column 0; page transform in the finish |
| sglang.topk_v2.ragged | topk_transform_ragged_v2 (sglang)                      | every mode            | 1..2048    | row starts (extend's [ks, ke)) |
| sglang.fast_topk      | fast_topk_v2 (sgl_kernel)                              | every mode            | 2048 only  | row starts                    |

All three: CUDA sm90 and sm100 (where SGLang's DSA path runs them), fp32 logits with a contiguous last
dim (v2: a row stride of a multiple of 4 floats, else the adapter copies the logits to one), -1 past a
row's length, a selected NaN turned into -1. A call they cannot serve (k past 2048, or not 2048 for
fast_topk; row starts for the paged v2) raises LayoutError naming the backend and the reason.
The availability probe checks the cheap facts first (a GPU, its arch), then imports the module; nothing
here imports torch or sglang until a probe or a run needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from backends.engine_probe import distribution_version, import_module, probe_for
from dispatch.contract import ALL_MODES, PAGED_MODES, Arch, Backend, Layout, Op, Support, Verified, hookimpl

SGLANG_ARCHS = frozenset({Arch.SM90, Arch.SM100})
# Built from sglang 0.5.23's published sources and checked exact against torch.topk on the H200 (2026-12-01);
# on SM100 the adapters' calls are checked against the recording stand-in only.
VERIFIED = {Arch.SM90: Verified.MEASURED, Arch.SM100: Verified.CONTRACT}
V2_MODULE = "sglang.kernels.ops.attention.dsv4.topk"
V2_PAGED_SYMBOLS = ("plan_topk_v2", "topk_transform_paged_v2")
V2_RAGGED_SYMBOLS = ("topk_transform_ragged_v2",)
SGL_KERNEL_MODULE = "sgl_kernel"
FAST_TOPK_SYMBOLS = ("fast_topk_v2",)


class _Adapter:
    """One adapter run (backends/sglang_topk/adapter.py, which imports torch) bound to its module's loader."""

    def __init__(self, run_name: str, load: Callable[[], ModuleType]) -> None:
        self._run_name, self._load = run_name, load

    def run(self, *args, **kwargs):
        return getattr(_adapter(), self._run_name)(self._load(), *args, **kwargs)

    def engine_run(self, *args, **kwargs):
        """The same call without dispatch's finish: the kernel as its engine calls it (bench only)."""
        return getattr(_adapter(), self._run_name)(self._load(), *args, engine=True, **kwargs)

    def prepare(self, plan):
        return _adapter().prepare_v2(self._load(), plan)

    @staticmethod
    def refresh_state(captured, fresh) -> None:
        from backends.sglang_topk.adapter import refresh_v2

        refresh_v2(captured, fresh)


# Imported at the first call (it imports torch), then kept by the loader: every batch's plan and
# every layer's call come through here.
_adapter = import_module("backends.sglang_topk.adapter")


def sglang_topk_backends(
    load_v2: Callable[[], ModuleType] = import_module(V2_MODULE),
    load_sgl_kernel: Callable[[], ModuleType] = import_module(SGL_KERNEL_MODULE),
) -> list[Backend]:
    """The three backends, resolving their modules through the loaders (tests pass stand-ins)."""
    paged = _Adapter("run_v2_paged", load_v2)
    return [
        Backend(
            name="sglang.topk_v2",
            op=Op.TOPK,
            layout=Layout.ROWS,
            supports=Support(archs=SGLANG_ARCHS, forward_modes=PAGED_MODES),
            run=paged.run,
            engine_run=paged.engine_run,
            probe=probe_for(load_v2, V2_MODULE, V2_PAGED_SYMBOLS, SGLANG_ARCHS),
            prepare=paged.prepare,
            refresh_state=paged.refresh_state,
            version=distribution_version("sglang"),
            verified=VERIFIED,
            description="SGLang top-k v2 (its DSA decode path): one CTA a row, 8-CTA clusters for long rows",
        ),
        Backend(
            name="sglang.topk_v2.ragged",
            op=Op.TOPK,
            layout=Layout.ROWS,
            supports=Support(archs=SGLANG_ARCHS, forward_modes=ALL_MODES),
            run=_Adapter("run_v2_ragged", load_v2).run,
            probe=probe_for(load_v2, V2_MODULE, V2_RAGGED_SYMBOLS, SGLANG_ARCHS),
            version=distribution_version("sglang"),
            verified=VERIFIED,
            description="SGLang top-k v2 over row windows [ks, ke) (its DSA extend path)",
        ),
        Backend(
            name="sglang.fast_topk",
            op=Op.TOPK,
            layout=Layout.ROWS,
            supports=Support(archs=SGLANG_ARCHS, forward_modes=ALL_MODES),
            run=_Adapter("run_fast_topk", load_sgl_kernel).run,
            probe=probe_for(load_sgl_kernel, SGL_KERNEL_MODULE, FAST_TOPK_SYMBOLS, SGLANG_ARCHS),
            version=distribution_version("sglang-kernel", "sgl-kernel"),
            verified=VERIFIED,
            description="sgl-kernel fast_topk_v2: one 1024-thread CTA a row, histogram radix select, k = 2048",
        ),
    ]


@hookimpl
def register_backends(register):
    for backend in sglang_topk_backends():
        register(backend)
