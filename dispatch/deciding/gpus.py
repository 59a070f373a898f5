"""GPUs by name: what `explain --gpu` and `dispatch gpus` know of a machine without running on it.

Each entry holds what detect.py and a cluster's `match` would read on that hardware: the arch (from
the CUDA capability or ROCm gcnArchName), the platform fp8 dtype, and the name
torch.cuda.get_device_name() reports, which a cluster's `gpu_name` glob is matched against.
"""

from __future__ import annotations

from dataclasses import dataclass

from dispatch.contract.errors import InvalidKeyError
from dispatch.contract.detect import native_fp8_dtype
from dispatch.contract.key import Arch, Fp8Dtype


@dataclass(frozen=True)
class Gpu:
    label: str  # how tables name it
    device_name: str  # torch.cuda.get_device_name() on it ('' for the CPU); what cluster globs match
    arch: Arch
    aliases: tuple[str, ...]  # short names, compared lowercased with spaces, '-' and '_' removed

    @property
    def fp8_dtype(self) -> Fp8Dtype:
        """The K cache's dtype on it: its platform's (DISPATCH_FP8_DTYPE is this machine's, not its)."""
        return native_fp8_dtype(self.arch)


# Capabilities: H100 / H200 / H20 9.0; B200 / GB200 10.0; L40S / RTX 4090 8.9; RTX 5090 12.0.
# gcnArchName: MI300X / MI325X gfx942; MI355X gfx950.
GPUS: tuple[Gpu, ...] = (
    Gpu("H100", "NVIDIA H100 80GB HBM3", Arch.SM90, ("h100", "nvidiah100", "h100sxm", "h100pcie", "h100nvl")),
    Gpu("H200", "NVIDIA H200", Arch.SM90, ("h200", "nvidiah200", "h200nvl")),
    Gpu("H20", "NVIDIA H20", Arch.SM90, ("h20", "nvidiah20")),
    Gpu("B200", "NVIDIA B200", Arch.SM100, ("b200", "nvidiab200")),
    Gpu("GB200", "NVIDIA GB200", Arch.SM100, ("gb200", "nvidiagb200")),
    Gpu("L40S", "NVIDIA L40S", Arch.SM89, ("l40s", "nvidial40s")),
    Gpu("RTX 4090", "NVIDIA GeForce RTX 4090", Arch.SM89, ("rtx4090", "4090", "geforcertx4090", "nvidiageforcertx4090")),
    Gpu("RTX 5090", "NVIDIA GeForce RTX 5090", Arch.SM120, ("rtx5090", "5090", "geforcertx5090", "nvidiageforcertx5090")),
    Gpu("MI300X", "AMD Instinct MI300X", Arch.GFX942, ("mi300x", "mi300", "instinctmi300x", "amdinstinctmi300x")),
    Gpu("MI325X", "AMD Instinct MI325X", Arch.GFX942, ("mi325x", "instinctmi325x", "amdinstinctmi325x")),
    Gpu("MI355X", "AMD Instinct MI355X", Arch.GFX950, ("mi355x", "instinctmi355x", "amdinstinctmi355x")),
    Gpu("CPU", "", Arch.CPU, ("cpu", "none")),
)


def _folded(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch not in " -_")


_BY_ALIAS = {alias: gpu for gpu in GPUS for alias in gpu.aliases + (_folded(gpu.device_name),) if alias}


def find_gpu(name: str) -> Gpu:
    """The GPU a short or marketing name means (`h200`, `NVIDIA H200`, `mi300x`), case-insensitive.
    An unknown name is an InvalidKeyError listing the names known."""
    gpu = _BY_ALIAS.get(_folded(name))
    if gpu is None:
        known = ", ".join(g.aliases[0] for g in GPUS)
        raise InvalidKeyError(
            f"--gpu {name[:60]!r} is not a GPU dispatch knows ({known}); for another GPU give its arch with --arch"
        )
    return gpu


def gpu_name_hint(text: str) -> str | None:
    """For `--arch h200`: the advice to use --gpu, or None when `text` names no GPU."""
    gpu = _BY_ALIAS.get(_folded(text))
    if gpu is None or gpu.arch is Arch.CPU:
        return None
    return f"{text} is a GPU name: use --gpu {text}, or --arch {gpu.arch.value}"


def gpus_of(arch: Arch) -> tuple[Gpu, ...]:
    return tuple(gpu for gpu in GPUS if gpu.arch is arch)
