"""Registers `cuda.radix`, dispatch's own CUDA top-k (radix_select.cu): one CTA a row (512 or 1024
threads), short rows read once into registers, longer ones by a sampled cut and one filtered read, an
exact 11/11/10-bit radix select, the page transform fused, one launch a call.
Registering imports neither torch nor the extension; the probe only reads the machine's facts, and the
build (backends/cuda_topk/build.py) runs at the warm-up (`python -m dispatch backends --warm`,
IndexerStep.warm()) or else at the first call."""

from __future__ import annotations

import importlib.metadata

from backends.cuda_topk.build import CUDA_ARCHS, probe, warm
from dispatch.contract import ALL_MODES, Arch, Backend, Layout, Op, Support, Verified, hookimpl

# Built and checked exact against torch.topk on the H200 (tests/backends/test_cuda_topk.py, tools/probe_topk.py);
# the other NVIDIA archs compile the same source at first use, never run here.
VERIFIED = {Arch.SM90: Verified.MEASURED} | {arch: Verified.NOT_RUN for arch in CUDA_ARCHS - {Arch.SM90}}


def run_radix_topk(*args, **kwargs):
    from backends.cuda_topk.radix_topk import radix_topk  # imports torch and loads the extension the probe built

    return radix_topk(*args, **kwargs)


def torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def cuda_topk_backends() -> list[Backend]:
    return [
        Backend(
            name="cuda.radix",
            op=Op.TOPK,
            layout=Layout.ROWS,
            supports=Support(archs=CUDA_ARCHS, forward_modes=ALL_MODES),
            run=run_radix_topk,
            probe=probe,
            warm=warm,
            verified=VERIFIED,
            version=torch_version(),
            description="dispatch's CUDA radix select: a CTA a row, short rows in registers, one filtered read, one launch",
        )
    ]


@hookimpl
def register_backends(register):
    for backend in cuda_topk_backends():
        register(backend)
