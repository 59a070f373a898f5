"""A Triton kernel's per-batch launch, bound once per argument signature: later launches with the same
signature go straight to the compiled kernel (`CompiledKernel[grid](*arguments)`), skipping
`JITFunction.run`'s binding, specialisation and cache-key work, which on the H200's host is the largest
share of a plan's host time (docs/benchmarks.md, issue 24 item 5). The guard and schedule launches run
every batch on the host's critical path.

The signature is everything Triton's specialisation can depend on, taken conservatively: each tensor's
dtype and its pointer's alignment class (the address modulo 256; Triton specialises on 16); each int's
class: its sign and width (int32, int64, past), whether it is 0 or 1, and its divisibility by each power
of two up to 256 (Triton specialises on 16 and on 1), so a batch's new lengths and page counts reuse
the binding where Triton reuses its kernel; other scalars by exact value; every keyword (constexprs and
launch options) by value. A signature never seen, any argument of another kind,
a launch hook, a pre-run hook, a changed global the kernel read, or a Triton whose binder or compiled
kernel is not of the form read here (3.x: `binder(*args, **kwargs)` -> (bound arguments, specialisation,
options), the compiled kernel launched with every bound argument in the kernel's order): the normal
launch. A wrong launch is far worse than a slow one.

Binding is checked against Triton's own binder for the call that binds: the arguments this module would
pass must be those Triton passes, object for object, or the signature is never bound. Triton's knobs
(debug, instrumentation) are those of the launch that bound: a process does not change them mid-run.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from triton.runtime.jit import JITFunction
except ImportError:  # a Triton without it: every launch is the normal one
    JITFunction = None

_ALIGNMENT_CLASS = 255  # address bits kept in the signature: every alignment up to 256 bytes is its own signature
_SCALARS = (int, float, bool, str, type(None))
_UNBINDABLE = object()
_MOST_SIGNATURES = 64  # per kernel: past them, a new signature launches normally and is not kept


class BoundLauncher:
    """`launch(grid, *args, **kwargs)`: what `kernel[grid](*args, **kwargs)` does, bound per signature."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._bound: dict[tuple, tuple[Any, tuple]] = {}  # signature -> (compiled kernel, recipe)
        self.direct_launches = 0  # launches that took the bound path (tests read it)
        self._bindable = JITFunction is not None and isinstance(kernel, JITFunction)

    def launch(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        signature = self._signature(args, kwargs) if self._bindable else _UNBINDABLE
        bound = self._bound.get(signature) if signature is not _UNBINDABLE else None
        if bound is not None and self._unhooked():
            compiled, recipe = bound
            compiled[grid](*_arguments(recipe, args, kwargs))
            self.direct_launches += 1
            return
        compiled = self.kernel[grid](*args, **kwargs)
        if signature is not _UNBINDABLE and bound is None and len(self._bound) < _MOST_SIGNATURES:
            recipe = self._recipe(compiled, args, kwargs)
            if recipe is None:  # this Triton's binder or compiled kernel is not of the form read here
                self._bindable = False
            else:
                self._bound[signature] = (compiled, recipe)

    @staticmethod
    def _signature(args: tuple, kwargs: dict) -> tuple | object:
        parts = []
        for value in args:
            if isinstance(value, torch.Tensor):
                parts.append((value.dtype, value.data_ptr() & _ALIGNMENT_CLASS))
            elif type(value) is int:
                parts.append(_int_class(value))
            elif isinstance(value, _SCALARS):
                parts.append((type(value), value))
            else:
                return _UNBINDABLE
        for name, value in kwargs.items():
            if not isinstance(value, _SCALARS):
                return _UNBINDABLE
            parts.append((name, type(value), value))
        return tuple(parts)

    def _unhooked(self) -> bool:
        """No pre-run hook, and every global the kernel read as it was when it compiled (else the
        normal launch, which runs the hooks and refuses a changed global)."""
        kernel = self.kernel
        if kernel.pre_run_hooks:
            return False
        for (name, _), (value, globals_dict) in kernel.used_global_vals.items():
            if globals_dict.get(name, _UNBINDABLE) != value:
                return False
        return True

    def _recipe(self, compiled: Any, args: tuple, kwargs: dict) -> tuple | None:
        """Where each of the compiled kernel's arguments comes from, in the kernel's order: ("arg", i),
        ("kw", name) or ("default", value); None unless that is exactly what Triton's binder passes."""
        try:
            if not (callable(getattr(compiled, "__getitem__", None)) and hasattr(compiled, "run")):
                return None
            if getattr(self.kernel, "pre_run_hooks", None) or not isinstance(
                    getattr(self.kernel, "used_global_vals", None), dict):
                return None
            binder = self.kernel.device_caches[_current_device()][-1]
            result = binder(*args, **kwargs)
            if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], dict)):
                return None
            bound = result[0]
            names = list(self.kernel.arg_names)
            if list(bound) != names:
                return None
            recipe = []
            for index, name in enumerate(names):
                if index < len(args):
                    recipe.append(("arg", index))
                elif name in kwargs:
                    recipe.append(("kw", name))
                else:
                    recipe.append(("default", bound[name]))
            recipe = tuple(recipe)
            mine = _arguments(recipe, args, kwargs)
            if len(mine) != len(bound) or any(a is not b and not _same_scalar(a, b) for a, b in zip(mine, bound.values())):
                return None
            return recipe
        except Exception:  # any other Triton: the normal launch, always
            return None


def _int_class(value: int) -> tuple:
    """What Triton could specialise an int on, conservatively: sign and width, 0 and 1, and the largest
    power of two up to 256 dividing it."""
    width = 32 if -2**31 <= value < 2**31 else 64 if -2**63 <= value < 2**63 else 128
    divides = min((value & -value).bit_length(), 9) if value else 0
    return (int, value < 0, width, value == 1, divides)


def _current_device() -> Any:
    """The device whose compiled kernels a launch uses, as JITFunction.run looks it up."""
    from triton.runtime.driver import driver

    return driver.active.get_current_device()


def _arguments(recipe: tuple, args: tuple, kwargs: dict) -> list:
    out = []
    for source, where in recipe:
        out.append(args[where] if source == "arg" else kwargs[where] if source == "kw" else where)
    return out


def _same_scalar(a: Any, b: Any) -> bool:
    return type(a) is type(b) and isinstance(a, _SCALARS) and a == b
