"""Stand-in submodule: see the package docstring."""

from xgrammar import __getattr__  # noqa: F401
