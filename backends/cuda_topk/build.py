"""radix_select.cu compiled with torch's C++-extension tooling, cached per user under a directory keyed
by what changes the binary; the cheap probe that decides availability from the machine's facts alone;
and the warm-up that builds it (explicitly, or at the backend's first run, never inside a CUDA-graph
capture).

The probe never compiles: it reads the facts every rank of a machine shares (a CUDA device and its
capability, nvcc and its version against torch's CUDA, a failure marker an earlier build left for
this key), so every rank decides the same. The build (a minute or more of nvcc) runs at `warm()` or
at the first call, in a child process bounded by BUILD_TIMEOUT_S, through compile_cache (atomic, a
lock with a bounded wait). A build that fails there is an error naming the backend, never a quietly
different choice; the marker it leaves makes the next start decide without `cuda.radix`."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from backends.cuda_topk.compile_cache import BuildSlot, CompileFailed, built_library, cached_failure, forget_failure
from dispatch.contract import Arch, Availability, BackendError

SOURCE = Path(__file__).with_name("radix_select.cu")
CHILD = Path(__file__).with_name("compile_child.py")
# Plain CUDA C++ (shared-memory atomics, warp shuffles): any NVIDIA GPU torch's CUDA build supports.
CUDA_ARCHS = frozenset({Arch.SM80, Arch.SM89, Arch.SM90, Arch.SM100, Arch.SM120})
BUILD_TIMEOUT_S = 900.0  # one nvcc build: > 60 s on the H200's 16 cores; far more on a loaded host
NVCC_VERSION_TIMEOUT_S = 30.0
WARM_HINT = "`python -m dispatch backends --warm` builds it (and retries a failed build)"


@dataclass(frozen=True)
class MachineFacts:
    """What the probe reads; each found cheaply and the same on every rank of a machine."""

    rocm: bool
    gpu_visible: bool
    arch: Arch | None
    capability: tuple[int, int] | None
    nvcc: str | None
    nvcc_version: str | None  # "13.0"; None where nvcc did not say
    torch_cuda: str  # the CUDA torch was built with, "" for none
    torch_version: str


def cuda_topk_availability(facts: MachineFacts, cached_error: str | None) -> Availability:
    """The probe's answer from the machine's facts, in the order they are cheap to find."""
    if facts.rocm:
        return Availability.no("torch is a ROCm build: this backend is CUDA C++ (the Triton top-k serves ROCm)")
    if not facts.gpu_visible:
        return Availability.no("no CUDA device visible to torch")
    if facts.arch not in CUDA_ARCHS:
        shown = facts.arch.value if facts.arch is not None else "unknown"
        return Availability.no(f"this GPU's arch {shown} is not among {', '.join(sorted(a.value for a in CUDA_ARCHS))}")
    if facts.nvcc is None:
        return Availability.no("nvcc not found (neither under CUDA_HOME nor on PATH): the kernel compiles at first use")
    if facts.nvcc_version is None:
        return Availability.no(f"nvcc at {facts.nvcc} did not report a release with --version")
    if facts.nvcc_version.split(".")[0] != facts.torch_cuda.split(".")[0]:
        return Availability.no(f"nvcc {facts.nvcc_version} ({facts.nvcc}) but torch was built with CUDA "
                               f"{facts.torch_cuda or 'none'}: torch's extension tooling refuses another major version")
    if cached_error is not None:
        return Availability.no(f"compile failed: {cached_error}")
    return Availability.yes()


def probe() -> Availability:
    """Backend.probe: the machine's facts and the failure marker of this build's key; never a build."""
    facts = machine_facts()
    usable = cuda_topk_availability(facts, None)
    if not usable.ok:
        return usable
    failure = cached_failure(build_slot(facts))
    summary = None if failure is None else f"{failure.splitlines()[0]} (cached in {build_slot(facts).failure}; {WARM_HINT})"
    return cuda_topk_availability(facts, summary)


@functools.lru_cache(maxsize=None)
def machine_facts() -> MachineFacts:
    import torch

    from dispatch.contract import InvalidKeyError, detect_arch

    rocm = torch.version.hip is not None
    gpu_visible = not rocm and torch.cuda.is_available()
    arch = capability = None
    if gpu_visible:
        try:
            arch = detect_arch()
        except InvalidKeyError:
            arch = None
        capability = tuple(torch.cuda.get_device_capability())
    nvcc = find_nvcc() if gpu_visible else None
    return MachineFacts(rocm=rocm, gpu_visible=gpu_visible, arch=arch, capability=capability, nvcc=nvcc,
                        nvcc_version=nvcc_release(nvcc) if nvcc else None, torch_cuda=torch.version.cuda or "",
                        torch_version=torch.__version__)


def find_nvcc() -> str | None:
    """$CUDA_HOME/bin/nvcc, else the first nvcc on PATH, else /usr/local/cuda's (where torch's tooling looks)."""
    candidates = [Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"] if os.environ.get("CUDA_HOME") else []
    on_path = shutil.which("nvcc")
    candidates += [Path(on_path)] if on_path else []
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    return next((str(path) for path in candidates if path.is_file()), None)


def nvcc_release(nvcc: str) -> str | None:
    """"13.0" from `nvcc --version`'s "release 13.0, V13.0.88"; None where it does not run or say."""
    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=NVCC_VERSION_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", done.stdout)
    return f"{found[1]}.{found[2]}" if found else None


def compile_summary(text: str, limit: int = 300) -> str:
    """The first compiler error line of a failed build's output (or its first line), cut to `limit`."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and "error building extension" not in line.lower()]
    summary = errors[0] if errors else (lines[0] if lines else "no output")
    return summary if len(summary) <= limit else summary[: limit - 3] + "..."


def build_key(source: bytes, torch_version: str, cuda_version: str, capability: tuple[int, int],
              nvcc_version: str) -> str:
    """The cache key: anything that changes the binary changes the directory."""
    digest = hashlib.sha256(source)
    digest.update(f"|torch {torch_version}|cuda {cuda_version}|sm {capability[0]}{capability[1]}"
                  f"|nvcc {nvcc_version}".encode())
    return digest.hexdigest()[:20]


def cache_root() -> Path:
    """Per user: $DISPATCH_CACHE_DIR, else $XDG_CACHE_HOME/dispatch, else ~/.cache/dispatch."""
    explicit = os.environ.get("DISPATCH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dispatch"


def build_slot(facts: MachineFacts) -> BuildSlot:
    key = build_key(SOURCE.read_bytes(), facts.torch_version, facts.torch_cuda, facts.capability or (0, 0),
                    facts.nvcc_version or "")
    return BuildSlot(cache_root() / "cuda_topk" / key, f"dispatch_cuda_topk_{key}")


def warm() -> Availability:
    """Backend.warm: build now (or load the cached build), outside any capture; a failure marker is
    dropped first, so a fixed toolchain is tried again. Availability.no where the machine's facts rule the
    backend out (nothing to build); BackendError where it should build here and does not."""
    facts = machine_facts()
    usable = cuda_topk_availability(facts, None)
    if not usable.ok:
        return usable
    forget_failure(build_slot(facts))
    extension()
    return Availability.yes()


@functools.lru_cache(maxsize=None)
def extension() -> ModuleType:
    """The compiled module (radix_topk, max_stage): loaded once per process, built once per key."""
    import torch

    facts = machine_facts()
    usable = cuda_topk_availability(facts, None)
    if not usable.ok:
        raise BackendError(f"top-k backend `cuda.radix` cannot build here: {usable.reason}")
    slot = build_slot(facts)
    if not slot.library.is_file() and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise BackendError(
            "top-k backend `cuda.radix` was first called inside a CUDA-graph capture, where its build (nvcc, a "
            f"minute or more) cannot run: warm it before capturing (IndexerStep.warm(), or {WARM_HINT})"
        )
    try:
        library = built_library(slot, functools.partial(compile_into, facts=facts, name=slot.name),
                                wait_s=BUILD_TIMEOUT_S)
    except CompileFailed as failure:
        raise BackendError(f"top-k backend `cuda.radix` failed to compile: {failure}; {WARM_HINT}") from failure
    return load_library(slot.name, library)


def compile_into(folder: Path, *, facts: MachineFacts, name: str, source: Path = SOURCE,
                 label: str = "top-k backend `cuda.radix`") -> Path:
    """One build of `source` in a child process (compile_child.py), bounded: the library's path inside
    `folder`. `label` names what is built in its errors (backends/shared/plan_extension.py builds too)."""
    major, minor = facts.capability
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": f"{major}.{minor}", "CUDA_HOME": str(Path(facts.nvcc).parent.parent)}
    try:
        done = subprocess.run([sys.executable, str(CHILD), str(source), str(folder), name], env=env,
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise BackendError(f"{label}: its build ran past {BUILD_TIMEOUT_S:.0f} s and was stopped "
                           "(nothing cached; the next warm-up builds again)") from error
    output = f"{done.stdout}\n{done.stderr}"
    if done.returncode < 0:  # stopped by a signal: not the compiler's verdict, so nothing is cached
        raise BackendError(f"{label}: its build was stopped by signal {-done.returncode}")
    if done.returncode != 0:
        raise CompileFailed(f"{compile_summary(output)}\n\n{output[-1500:]}")
    library = folder / f"{name}.so"
    if not library.is_file():
        raise CompileFailed(f"the build reported success but left no {library.name}\n\n{output[-1500:]}")
    return library


def load_library(name: str, path: Path) -> ModuleType:
    """Import the built extension from its cached path (torch first: it links against torch's libraries)."""
    import importlib.util

    import torch  # noqa: F401

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
