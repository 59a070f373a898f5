"""Registers the torch reference backends: runs anywhere torch does, the yardstick for the rest.

Each file of this package that declares `BACKENDS` is one op's reference (`topk.py`, `q_quant.py`, ...),
found by name, so adding an op's reference adds its file and edits nothing here. Those files import
torch where their functions run: registering must not import it (`validate` runs without it)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import pkgutil

import backends.reference as package
from dispatch.contract import Arch, Verified, hookimpl


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


# Plain torch, the same code on every device: tested on the CPU in CI, and run on the H200 as the
# yardstick of every GPU check.
VERIFIED = {arch: Verified.CPU_TESTS for arch in Arch} | {Arch.SM90: Verified.MEASURED}


def reference_backends() -> list:
    """Every reference file's BACKENDS (sorted by file name), with torch's version and VERIFIED."""
    modules = (importlib.import_module(f"{package.__name__}.{info.name}") for info in sorted(pkgutil.iter_modules(package.__path__)))
    return [
        dataclasses.replace(backend, version=_torch_version(), verified=VERIFIED)
        for module in modules
        for backend in getattr(module, "BACKENDS", ())
    ]


@hookimpl
def register_backends(register):
    for backend in reference_backends():
        register(backend)
