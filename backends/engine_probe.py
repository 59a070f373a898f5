"""Availability of an engine's kernel reached through a module the engine installs (sglang, sgl_kernel,
vLLM's torch.ops._C): the cheap facts first (a GPU, its arch), then the import, then the entry points
the adapter calls. Nothing here imports torch or the engine until a probe runs."""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from types import ModuleType

from dispatch.contract import Arch, Availability, detect


def import_module(name: str) -> Callable[[], ModuleType]:
    """A loader of `name`: imports it on its first call and keeps it (importlib's lookup of a module
    already imported costs a GPU host ~4 us, and an adapter loads its module on every call)."""
    loaded: list[ModuleType] = []

    def load() -> ModuleType:
        if not loaded:
            loaded.append(importlib.import_module(name))  # a failed import raises and is retried next call
        return loaded[0]

    return load


def engine_topk_availability(
    *, host: Arch, gpu_visible: bool, archs: frozenset[Arch], load: Callable[[], object], module: str,
    symbols: tuple[str, ...], missing_hint: str = "",
) -> Availability:
    """Availability of a kernel reached through `module`'s `symbols`: the cheap facts first, then the import.
    `missing_hint` follows the message when a symbol is missing (e.g. the release that added it)."""
    if not gpu_visible:
        return Availability.no(f"no CUDA GPU is visible to torch (host arch {host.value})")
    if host not in archs:
        return Availability.no(f"{module}'s top-k runs on {', '.join(sorted(a.value for a in archs))}; "
                               f"this machine is {host.value}")
    try:
        loaded = load()
    except Exception as error:  # a broken optional install says why, it does not stop dispatch
        return Availability.no(f"{module} cannot be imported: {type(error).__name__}: {error}")
    missing = [name for name in symbols if not _has(loaded, name)]
    if missing:
        return Availability.no(f"{module} has no {' and no '.join(f'`{name}`' for name in missing)}{missing_hint}")
    return Availability.yes()


def _has(loaded: object, name: str) -> bool:
    try:  # torch.ops namespaces raise RuntimeError, not AttributeError, for an op they lack
        getattr(loaded, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def probe_for(load: Callable[[], object], module: str, symbols: tuple[str, ...],
              archs: frozenset[Arch]) -> Callable[[], Availability]:
    """A Backend.probe: this machine's facts, read when the probe runs (detect_arch honours DISPATCH_ARCH)."""

    def probe() -> Availability:
        import torch

        return engine_topk_availability(host=detect.detect_arch(), gpu_visible=torch.cuda.is_available(),
                                        archs=archs, load=load, module=module, symbols=symbols)

    return probe


def distribution_version(*names: str) -> str:
    """"sglang 0.5.23": the first installed distribution of `names`, from its metadata (no import)."""
    for name in names:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""
