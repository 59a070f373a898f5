"""Whether a DeepGEMM backend can run here, and the precise reason when it cannot.

The cheap facts come first (a GPU, its arch), so a machine that could never run the kernel does not
load deep_gemm's CUDA extension just to say no.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from backends.deepgemm.api import missing_symbols
from backends.deepgemm.library import import_deep_gemm, version_of
from dispatch import detect
from dispatch.backend import Availability
from dispatch.key import Arch


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
    missing = missing_symbols(module)
    if missing:
        return Availability.no(f"deep_gemm {version_of(module)} has no {' and no '.join(missing)}")
    return Availability.yes()


def probe_for(required: Arch, load: Callable[[], ModuleType] = import_deep_gemm) -> Callable[[], Availability]:
    """A Backend.probe: this machine's facts, read when the probe runs (detect_arch honours DISPATCH_ARCH)."""

    def probe() -> Availability:
        import torch  # here, not at import: registering must not import torch (`validate` runs without it)

        return deepgemm_availability(
            required, host=detect.detect_arch(), gpu_visible=torch.cuda.is_available(), load=load
        )

    return probe
