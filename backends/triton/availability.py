"""Where the Triton backends run, and the probe that says why not. Never imports triton at import time."""

from __future__ import annotations

import importlib.metadata
from typing import Callable

from dispatch.contract import Arch, Availability, InvalidKeyError, detect_arch, triton_interpreter_on

# fp8 tensor-core dots need sm89+ (sm80 here is 8.0/8.6/8.7, which have none) or CDNA3+; sm89 (Ada)
# runs the fp8 tl.dot natively. e4m3fn does not compile for gfx942. The CPU runs the kernels under
# TRITON_INTERPRET=1.
TRITON_ARCHS = frozenset({Arch.SM89, Arch.SM90, Arch.SM100, Arch.SM120, Arch.GFX950, Arch.CPU})
# e4m3fnuz caches exist only on gfx942 (tl.float8e4b8 natively); the CPU runs the emulated bytes for tests.
FNUZ_ARCHS = frozenset({Arch.GFX942, Arch.CPU})


def probe_for(archs: frozenset[Arch]) -> Callable[[], Availability]:
    """A probe: triton importable, then a GPU (or the interpreter), then this machine's arch declared."""

    def probe() -> Availability:
        import torch  # here, not at import: registering must not import torch (`validate` runs without it)

        try:
            import triton  # noqa: F401
        except ImportError as error:
            return Availability.no(f"triton is not importable: {error}")
        if not torch.cuda.is_available() and not triton_interpreter_on():
            return Availability.no("no GPU visible to torch, and TRITON_INTERPRET is not 1 (the CPU interpreter is off)")
        try:
            arch = detect_arch()
        except InvalidKeyError as error:
            return Availability.no(str(error))
        if arch not in archs:
            declared = ", ".join(sorted(a.value for a in archs))
            return Availability.no(f"this machine's arch {arch.value} is not among the declared archs ({declared})")
        return Availability.yes()

    return probe


def triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return ""
