"""Registers the fused Triton indexer Q quantisation twice: `triton` stores OCP e4m3fn, `rocm.fnuz`
stores MI300's e4m3fnuz (FP8_MAX 224), so that a gfx942 key can never be served by the e4m3fn path.

Importing this module does not import triton; the probe says why the kernel cannot run here."""

from __future__ import annotations

import importlib.metadata

import torch

from dispatch.backend import Availability, Backend, Support
from dispatch.detect import detect_arch, triton_interpreter_on
from dispatch.errors import InvalidKeyError
from dispatch.hookspecs import hookimpl
from dispatch.key import Arch, Fp8Dtype, Op
from dispatch.layout import Layout

# tl.float8e4nv needs sm89+ on NVIDIA (so no sm80); gfx950 has OCP fp8; the CPU runs the interpreter.
TRITON_ARCHS = frozenset({Arch.SM90, Arch.SM100, Arch.SM120, Arch.GFX950, Arch.CPU})
# gfx942 stores tl.float8e4b8 natively; the CPU emulates fnuz through e4m3fn bytes.
FNUZ_ARCHS = frozenset({Arch.GFX942, Arch.CPU})


def run(*args, **kwargs):
    from backends.triton.q_quant import indexer_q_quant  # imports triton, which the probe found

    return indexer_q_quant(*args, **kwargs)


def probe_for(archs: frozenset[Arch]):
    """An availability probe for a backend declared on `archs`."""

    def probe() -> Availability:
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
            return Availability.no(f"this machine's arch {arch.value} is not declared (declares {declared})")
        return Availability.yes()

    return probe


def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return ""


@hookimpl
def register_backends(register):
    description = "fused Triton RoPE + amax + power-of-two scale + {} store + weight folding"
    register(
        Backend(
            name="triton",
            op=Op.INDEXER_Q_QUANT,
            layout=Layout.TOKENS,
            supports=Support(archs=TRITON_ARCHS, fp8_dtypes=frozenset({Fp8Dtype.E4M3FN})),
            run=run,
            probe=probe_for(TRITON_ARCHS),
            version=_triton_version(),
            description=description.format("e4m3fn (FP8_MAX 448)"),
        )
    )
    register(
        Backend(
            name="rocm.fnuz",
            op=Op.INDEXER_Q_QUANT,
            layout=Layout.TOKENS,
            supports=Support(archs=FNUZ_ARCHS, fp8_dtypes=frozenset({Fp8Dtype.E4M3FNUZ})),
            run=run,
            probe=probe_for(FNUZ_ARCHS),
            version=_triton_version(),
            description=description.format("e4m3fnuz (FP8_MAX 224; native on gfx94x, emulated elsewhere)"),
        )
    )
