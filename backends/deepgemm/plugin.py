"""Registers DeepGEMM's MQA logits backends. Each one's whole contract is its row below.

| backend               | op                | layout  | arch  | next_n | why                                        |
| deepgemm.sm100        | paged_mqa_logits  | native  | sm100 | >= 1   | SM100 kernels take any next_n (odd padded) |
| deepgemm.sm90         | paged_mqa_logits  | native  | sm90  | 1, 2   | SM90 kernels exist for next_n 1 and 2      |
| deepgemm.sm90.n4      | paged_mqa_logits  | native  | sm90  | 4      | builds with the 2-CTA KV-multicast kernel  |
| deepgemm.sm90.flatten | paged_mqa_logits  | flatten | sm90  | >= 1   | every token its own request: next_n 1      |
| deepgemm.sm100        | ragged_mqa_logits | ragged  | sm100 | any    | fp8_mqa_logits, every mode                 |
| deepgemm.sm90         | ragged_mqa_logits | ragged  | sm90  | any    | fp8_mqa_logits, every mode                 |

All take e4m3fn only (the kernels read OCP fp8); the paged ones in the paged modes (decode,
target_verify, draft_extend), the ragged ones in any (extend is what they are for).
`deepgemm.sm90.n4` is its own backend rather than a wider `deepgemm.sm90` because only some builds have
its kernel (adapter.py's SM90 next_n 4 section): its probe says no, with the reason, on the others, while
`deepgemm.sm90` keeps serving next_n 1 and 2 there.
The availability probe checks the cheap facts first (a GPU, its arch), so a machine that could never
run the kernel does not load deep_gemm's CUDA extension just to say no.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from backends.engine_probe import import_module
from backends.shared.plan_extension import logits_warm_up
from dispatch.contract import (
    PAGED_MODES,
    Arch,
    Availability,
    Backend,
    Fp8Dtype,
    Layout,
    Op,
    Support,
    Verified,
    detect,
    hookimpl,
)

_E4M3FN = frozenset({Fp8Dtype.E4M3FN})


@dataclass(frozen=True)
class _Row:
    name: str
    layout: Layout
    arch: Arch
    next_n: tuple[int, int | None]  # (min, max); max None is unbounded
    description: str
    kv_multicast: int = 1  # CTAs per scheduler task (adapter.DeepGemmPagedLogits.kv_multicast)
    sm90_next_n4: bool = False  # the build must ship the SM90 next_n 4 kernel


_TABLE = (
    _Row("deepgemm.sm100", Layout.NATIVE, Arch.SM100, (1, None), "DeepGEMM fp8 paged MQA logits, SM100, native"),
    _Row("deepgemm.sm90", Layout.NATIVE, Arch.SM90, (1, 2), "DeepGEMM fp8 paged MQA logits, SM90, native (next_n 1-2)"),
    _Row("deepgemm.sm90.n4", Layout.NATIVE, Arch.SM90, (4, 4),
         "DeepGEMM fp8 paged MQA logits, SM90, native next_n 4 (2-CTA KV multicast)", kv_multicast=2, sm90_next_n4=True),
    _Row("deepgemm.sm90.flatten", Layout.FLATTEN, Arch.SM90, (1, None), "DeepGEMM fp8 paged MQA logits, SM90, flatten"),
)


# deep_gemm (a CUDA extension, which imports torch) is imported when a probe or a backend first runs, since
# registering must not (`validate` runs without torch), and then kept: importlib's lookup of a module
# already imported costs a GPU host ~4 us, and every batch's plan loads it (plan_tensors.py). ImportError or
# OSError where it is missing or fails to load, retried at the next call.
import_deep_gemm = import_module("deep_gemm")


class _OnFirstUse:
    """The adapter's DeepGemmPagedLogits for one layout, built on first use."""

    def __init__(self, layout: Layout, load: Callable[[], ModuleType], kv_multicast: int = 1,
                 sm90_schedule: bool = False) -> None:
        self._args = (layout, load, kv_multicast, sm90_schedule)
        self._impl = None

    def _built(self):
        if self._impl is None:
            from backends.deepgemm.adapter import DeepGemmPagedLogits

            self._impl = DeepGemmPagedLogits(*self._args)
        return self._impl

    def run(self, plan, q, kv_cache, weights, *, clean_logits=True):
        return self._built().run(plan, q, kv_cache, weights, clean_logits=clean_logits)

    def prepare(self, plan):
        return self._built().prepare(plan)

    def plan_tensors(self, **batch):
        return self._built().plan_tensors(**batch)

    @staticmethod
    def refresh_state(captured, fresh) -> None:
        from backends.deepgemm.adapter import DeepGemmPagedLogits

        DeepGemmPagedLogits.refresh_state(captured, fresh)


class _RaggedOnFirstUse:
    """The adapter's DeepGemmRaggedLogits, built on first use; its per-batch state is the Triton K gather."""

    def __init__(self, load: Callable[[], ModuleType]) -> None:
        self._load = load
        self._impl = None

    def run(self, q, k, scales, weights, ks, ke, *, fp8_dtype, clean_logits=True):
        if self._impl is None:
            from backends.deepgemm.adapter import DeepGemmRaggedLogits

            self._impl = DeepGemmRaggedLogits(self._load)
        return self._impl.run(q, k, scales, weights, ks, ke, fp8_dtype=fp8_dtype, clean_logits=clean_logits)

    @staticmethod
    def prepare(plan):
        from backends.deepgemm.adapter import DeepGemmRaggedLogits

        return DeepGemmRaggedLogits.prepare(plan)


def missing_paged_symbols(module: ModuleType) -> list[str]:
    from backends.deepgemm.adapter import missing_symbols

    return missing_symbols(module)


def missing_sm90_next_n4(module: ModuleType) -> list[str]:
    from backends.deepgemm.adapter import missing_sm90_next_n4 as missing

    return missing(module)


def missing_ragged_symbols(module: ModuleType) -> list[str]:
    from backends.deepgemm.adapter import missing_ragged_symbols as missing

    return missing(module)


def deepgemm_availability(
    required: Arch,
    *,
    host: Arch,
    gpu_visible: bool,
    load: Callable[[], ModuleType],
    missing: Callable[[ModuleType], list[str]] = missing_paged_symbols,
) -> Availability:
    """Availability of a backend built for `required` on a machine of arch `host`; `missing` names the
    API symbols the backend needs that the module lacks (the paged ones by default)."""
    if not gpu_visible:
        return Availability.no(f"no CUDA GPU is visible to torch (host arch {host.value})")
    if host is not required:
        return Availability.no(f"DeepGEMM kernels for {required.value}; this machine is {host.value}")
    try:
        module = load()
    except (ImportError, OSError) as error:
        return Availability.no(f"deep_gemm cannot be imported: {type(error).__name__}: {error}")
    from backends.deepgemm.adapter import version_of

    absent = missing(module)
    if absent:
        return Availability.no(f"deep_gemm {version_of(module)} has no {' and no '.join(absent)}")
    return Availability.yes()


def probe_for(
    required: Arch,
    load: Callable[[], ModuleType] = import_deep_gemm,
    missing: Callable[[ModuleType], list[str]] = missing_paged_symbols,
) -> Callable[[], Availability]:
    """A Backend.probe: this machine's facts, read when the probe runs (detect_arch honours DISPATCH_ARCH)."""

    def probe() -> Availability:
        import torch

        return deepgemm_availability(
            required, host=detect.detect_arch(), gpu_visible=torch.cuda.is_available(), load=load, missing=missing
        )

    return probe


# The distributions that ship the `deep_gemm` module; the first one installed names the version.
DISTRIBUTIONS = ("sgl-deep-gemm", "tokenspeed-deepgemm", "deep-gemm")


def library_version() -> str:
    """"sgl-deep-gemm 0.1.5": the installed distribution, read from its metadata without importing
    deep_gemm (a CUDA extension); "" when none is installed. A measurement records it (Backend.version).
    Where several are installed (each ships a `deep_gemm` package), the one whose package Python would
    import: SM90 next_n 4 runs only on some builds, so the record must name the build that ran."""
    installed = []
    for name in DISTRIBUTIONS:
        try:
            installed.append((name, importlib.metadata.distribution(name)))
        except importlib.metadata.PackageNotFoundError:
            continue
    if not installed:
        return ""
    if len(installed) > 1:
        imported = _deep_gemm_init()
        for name, distribution in installed:
            if imported is not None and _resolved(distribution.locate_file("deep_gemm/__init__.py")) == imported:
                return f"{name} {distribution.version}"
    name, distribution = installed[0]
    return f"{name} {distribution.version}"


def _deep_gemm_init() -> Path | None:
    """The deep_gemm/__init__.py an import would run, found without running it."""
    try:
        spec = importlib.util.find_spec("deep_gemm")
    except (ImportError, ValueError):
        return None
    return _resolved(spec.origin) if spec is not None and spec.origin else None


def _resolved(path) -> Path:
    return Path(str(path)).resolve()


# SM90 ran on the H200 with sgl-deep-gemm 0.1.5 (next_n 4: tokenspeed-deepgemm 2.5.0.post20260629); SM100
# only against the recording stand-in (no SM100 here).
VERIFIED = {Arch.SM90: Verified.MEASURED, Arch.SM100: Verified.CONTRACT}


def deepgemm_backends(load: Callable[[], ModuleType] = import_deep_gemm) -> list[Backend]:
    """The four paged backends, resolving deep_gemm through `load` (tests pass a stand-in)."""
    backends = []
    for row in _TABLE:
        impl = _OnFirstUse(row.layout, load, row.kv_multicast, row.arch is Arch.SM90)
        next_n_min, next_n_max = row.next_n
        support = Support(
            archs=frozenset({row.arch}), forward_modes=PAGED_MODES, fp8_dtypes=_E4M3FN,
            next_n_min=next_n_min, next_n_max=next_n_max,
        )
        missing = missing_sm90_next_n4 if row.sm90_next_n4 else missing_paged_symbols
        probe = probe_for(row.arch, load, missing)
        # The SM90 native ones make their plan in one launch where backends/shared/plan_prepare.cu is built.
        one_launch = row.layout is Layout.NATIVE and row.arch is Arch.SM90
        backends.append(
            Backend(
                name=row.name,
                op=Op.PAGED_MQA_LOGITS,
                layout=row.layout,
                supports=support,
                run=impl.run,
                probe=probe,
                prepare=impl.prepare,
                refresh_state=impl.refresh_state,
                plan_tensors=impl.plan_tensors if one_launch else None,
                warm=logits_warm_up(probe) if one_launch else None,
                version=library_version(),
                description=row.description,
                verified={row.arch: VERIFIED[row.arch]},
            )
        )
    return backends


def deepgemm_ragged_backends(load: Callable[[], ModuleType] = import_deep_gemm) -> list[Backend]:
    """The two ragged (extend) backends, named per arch like the paged ones, resolving deep_gemm
    through `load` (tests pass a stand-in)."""
    backends = []
    for arch in (Arch.SM100, Arch.SM90):
        ragged = _RaggedOnFirstUse(load)
        backends.append(
            Backend(
                name=f"deepgemm.{arch.value}",
                op=Op.RAGGED_MQA_LOGITS,
                layout=Layout.RAGGED,
                supports=Support(archs=frozenset({arch}), fp8_dtypes=_E4M3FN),
                run=ragged.run,
                probe=probe_for(arch, load, missing_ragged_symbols),
                prepare=ragged.prepare,
                description=f"DeepGEMM fp8_mqa_logits (ragged, extend), {arch.value.upper()}; Triton K gather",
                verified={arch: VERIFIED[arch]},
            )
        )
    return backends


@hookimpl
def register_backends(register):
    for backend in deepgemm_backends() + deepgemm_ragged_backends():
        register(backend)
