"""Registers DeepGEMM's paged MQA logits backends. Each one's whole contract is its row below.

| backend               | layout  | arch  | next_n | why                                                 |
| deepgemm.sm100        | native  | sm100 | >= 1   | SM100 kernels take any next_n (odd ones padded)     |
| deepgemm.sm90         | native  | sm90  | 1, 2   | SM90 kernels are instantiated for next_n 1 and 2    |
| deepgemm.sm90.flatten | flatten | sm90  | >= 1   | every token its own request: next_n 1 in the kernel |

All take e4m3fn only (the kernels read OCP fp8) in the paged modes (decode, target_verify, draft_extend).
The availability probe checks the cheap facts first (a GPU, its arch), so a machine that could never
run the kernel does not load deep_gemm's CUDA extension just to say no.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from types import ModuleType

from dispatch import detect
from dispatch.contract import PAGED_MODES, Arch, Availability, Backend, Fp8Dtype, Layout, Op, Support, hookimpl

_E4M3FN = frozenset({Fp8Dtype.E4M3FN})

# name, layout, arch, next_n_max, description
_TABLE = (
    ("deepgemm.sm100", Layout.NATIVE, Arch.SM100, None, "DeepGEMM fp8 paged MQA logits, SM100, native"),
    ("deepgemm.sm90", Layout.NATIVE, Arch.SM90, 2, "DeepGEMM fp8 paged MQA logits, SM90, native (next_n 1-2)"),
    ("deepgemm.sm90.flatten", Layout.FLATTEN, Arch.SM90, None, "DeepGEMM fp8 paged MQA logits, SM90, flatten"),
)


# The adapter imports torch; registering must not (`validate` runs without torch), so the adapter, deep_gemm
# and torch are imported when a probe or a backend first runs.
def import_deep_gemm() -> ModuleType:
    from backends.deepgemm.adapter import import_deep_gemm as load

    return load()


class _OnFirstUse:
    """The adapter's DeepGemmPagedLogits for one layout, built on first use."""

    def __init__(self, layout: Layout, load: Callable[[], ModuleType]) -> None:
        self._args = (layout, load)
        self._impl = None

    def _built(self):
        if self._impl is None:
            from backends.deepgemm.adapter import DeepGemmPagedLogits

            self._impl = DeepGemmPagedLogits(*self._args)
        return self._impl

    def run(self, plan, q, kv_cache, weights):
        return self._built().run(plan, q, kv_cache, weights)

    def prepare(self, plan):
        return self._built().prepare(plan)

    @staticmethod
    def refresh_state(captured, fresh) -> None:
        from backends.deepgemm.adapter import DeepGemmPagedLogits

        DeepGemmPagedLogits.refresh_state(captured, fresh)


def deepgemm_availability(
    required: Arch, *, host: Arch, gpu_visible: bool, load: Callable[[], ModuleType]
) -> Availability:
    """Availability of a backend built for `required` on a machine of arch `host`."""
    if not gpu_visible:
        return Availability.no(f"no CUDA GPU is visible to torch (host arch {host.value})")
    if host is not required:
        return Availability.no(f"DeepGEMM kernels for {required.value}; this machine is {host.value}")
    try:
        module = load()
    except (ImportError, OSError) as error:
        return Availability.no(f"deep_gemm cannot be imported: {type(error).__name__}: {error}")
    from backends.deepgemm.adapter import missing_symbols, version_of

    missing = missing_symbols(module)
    if missing:
        return Availability.no(f"deep_gemm {version_of(module)} has no {' and no '.join(missing)}")
    return Availability.yes()


def probe_for(required: Arch, load: Callable[[], ModuleType] = import_deep_gemm) -> Callable[[], Availability]:
    """A Backend.probe: this machine's facts, read when the probe runs (detect_arch honours DISPATCH_ARCH)."""

    def probe() -> Availability:
        import torch

        return deepgemm_availability(
            required, host=detect.detect_arch(), gpu_visible=torch.cuda.is_available(), load=load
        )

    return probe


# The distributions that ship the `deep_gemm` module; the first one installed names the version.
DISTRIBUTIONS = ("sgl-deep-gemm", "tokenspeed-deepgemm", "deep-gemm")


def library_version() -> str:
    """"sgl-deep-gemm 0.1.5": the installed distribution, read from its metadata without importing
    deep_gemm (a CUDA extension); "" when none is installed. A measurement records it (Backend.version)."""
    for distribution in DISTRIBUTIONS:
        try:
            return f"{distribution} {importlib.metadata.version(distribution)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


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
                refresh_state=impl.refresh_state,
                version=library_version(),
                description=description,
            )
        )
    return backends


@hookimpl
def register_backends(register):
    for backend in deepgemm_backends():
        register(backend)
