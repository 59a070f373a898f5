"""Stub of torchvision.transforms.v2.functional (see tests/support/engine_stubs/torchvision/__init__.py)."""

from torchvision._unavailable import unavailable_module

__getattr__ = unavailable_module("torchvision.transforms.v2.functional")
