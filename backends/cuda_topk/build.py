"""radix_select.cu compiled at first use with torch's C++-extension tooling, cached per user under a
directory keyed by the source's hash, the torch build and the GPU's compute capability; and, where it
cannot be, the reason (no CUDA GPU, nvcc not found, compile failed) that `explain` shows."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path
from types import ModuleType

from dispatch.contract import Arch, Availability

SOURCE = Path(__file__).with_name("radix_select.cu")
# Plain CUDA C++ (shared-memory atomics, warp shuffles): any NVIDIA GPU torch's CUDA build supports.
CUDA_ARCHS = frozenset({Arch.SM80, Arch.SM89, Arch.SM90, Arch.SM100, Arch.SM120})


def cuda_topk_availability(*, rocm: bool, gpu_visible: bool, arch: Arch | None, nvcc: str | None,
                           compile_error: str | None) -> Availability:
    """The probe's answer from the machine's facts, in the order they are cheap to find."""
    if rocm:
        return Availability.no("torch is a ROCm build: this backend is CUDA C++ (the Triton top-k serves ROCm)")
    if not gpu_visible:
        return Availability.no("no CUDA device visible to torch")
    if arch not in CUDA_ARCHS:
        shown = arch.value if arch is not None else "unknown"
        return Availability.no(f"this GPU's arch {shown} is not among {', '.join(sorted(a.value for a in CUDA_ARCHS))}")
    if nvcc is None:
        return Availability.no("nvcc not found (neither under CUDA_HOME nor on PATH): the kernel compiles at first use")
    if compile_error is not None:
        return Availability.no(f"compile failed: {compile_error}")
    return Availability.yes()


def probe() -> Availability:
    """Backend.probe: the facts of this machine, then (the first time on it) the compile itself."""
    import torch

    from dispatch.contract import InvalidKeyError, detect_arch

    rocm = torch.version.hip is not None
    gpu_visible = not rocm and torch.cuda.is_available()
    arch = None
    if gpu_visible:
        try:
            arch = detect_arch()
        except InvalidKeyError:
            arch = None
    nvcc = find_nvcc() if gpu_visible else None
    compile_error = None
    if gpu_visible and arch in CUDA_ARCHS and nvcc is not None:
        try:
            extension()
        except Exception as error:  # a failed build says why; it does not stop dispatch
            compile_error = compile_summary(error)
    return cuda_topk_availability(rocm=rocm, gpu_visible=gpu_visible, arch=arch, nvcc=nvcc,
                                  compile_error=compile_error)


def find_nvcc() -> str | None:
    """$CUDA_HOME/bin/nvcc, else the first nvcc on PATH, else /usr/local/cuda's (where torch's tooling looks)."""
    candidates = [Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"] if os.environ.get("CUDA_HOME") else []
    on_path = shutil.which("nvcc")
    candidates += [Path(on_path)] if on_path else []
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    return next((str(path) for path in candidates if path.is_file()), None)


def compile_summary(error: BaseException, limit: int = 300) -> str:
    """The first compiler error line of a failed build (or the exception's first line), cut to `limit`."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and "error building extension" not in line.lower()]
    summary = errors[0] if errors else (lines[0] if lines else type(error).__name__)
    return summary if len(summary) <= limit else summary[: limit - 3] + "..."


def build_key(source: bytes, torch_version: str, cuda_version: str, capability: tuple[int, int]) -> str:
    """The cache key: anything that changes the binary changes the directory."""
    digest = hashlib.sha256(source)
    digest.update(f"|torch {torch_version}|cuda {cuda_version}|sm {capability[0]}{capability[1]}".encode())
    return digest.hexdigest()[:20]


def cache_root() -> Path:
    """Per user: $DISPATCH_CACHE_DIR, else $XDG_CACHE_HOME/dispatch, else ~/.cache/dispatch."""
    explicit = os.environ.get("DISPATCH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dispatch"


@functools.lru_cache(maxsize=None)
def extension() -> ModuleType:
    """The compiled module (radix_topk, max_stage), built once per key and loaded once per process.
    Built for the current GPU's compute capability; torch's tooling locks the directory, so processes
    that start together build it once."""
    import torch
    from torch.utils.cpp_extension import load

    capability = torch.cuda.get_device_capability()
    key = build_key(SOURCE.read_bytes(), torch.__version__, torch.version.cuda or "", capability)
    directory = cache_root() / "cuda_topk" / key
    directory.mkdir(parents=True, exist_ok=True)
    arch = f"{capability[0]}{capability[1]}"
    return load(name=f"dispatch_cuda_topk_{key}", sources=[str(SOURCE)], build_directory=str(directory),
                extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"], verbose=False)
