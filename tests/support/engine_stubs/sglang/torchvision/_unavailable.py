"""Placeholders for names the stub does not provide: importable, unusable."""

from __future__ import annotations

import enum


class InterpolationMode(enum.Enum):
    """torchvision's enum, real: SGLang reads its members at import time (default arguments)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Unavailable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"`{self._name}` is a test stub: torchvision is not installed for the engine tests")

    def __getattr__(self, attr: str) -> "_Unavailable":
        return _Unavailable(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        # A module that subclasses a torchvision class at import time still imports.
        return (object,)


def unavailable_module(module: str):
    """A module-level __getattr__: InterpolationMode is real, every other name a placeholder."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        return _Unavailable(f"{module}.{name}")

    return __getattr__
