"""backends/shared/bound_launch.py: a launch goes straight to the compiled kernel only for a signature
Triton's own launch bound, with exactly the arguments Triton's binder passed; everything else (a new
signature, an argument it cannot key, a hook, a changed global, a binder or compiled kernel of another
form, a kernel that is not a JITFunction) takes the normal launch. On the CPU with a recording fake of
Triton's JITFunction and CompiledKernel; on the H200 the real kernels, bound and normal, write the same
outputs (the GPU case)."""

from __future__ import annotations

import pytest
import torch

import backends.shared.bound_launch as bound_launch
from backends.shared.bound_launch import BoundLauncher

NAMES = ("x_ptr", "n", "stride", "BLOCK", "FLAG")


class _Compiled:
    """A CompiledKernel: `compiled[grid](*arguments)` launches it."""

    run = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *arguments: self.log.append(("direct", grid, arguments))


class _Kernel:
    """A JITFunction: `kernel[grid](*args, **kwargs)` binds (as Triton's binder does: every parameter by
    name, in order, with its default), launches, and returns its compiled kernel."""

    arg_names = list(NAMES)
    defaults = {"FLAG": 0}

    def __init__(self, *, binder_result=None):
        self.log, self.pre_run_hooks, self.used_global_vals = [], [], {}
        self.compiled = _Compiled(self.log)
        self.device_caches = {0: ({}, "target", "backend", self._binder)}
        self.binder_result = binder_result

    def _binder(self, *args, **kwargs):
        if self.binder_result is not None:
            return self.binder_result(args, kwargs)
        return self._bind(args, kwargs)

    def _bind(self, args, kwargs):
        bound = dict(zip(NAMES, args))
        for name in NAMES[len(args):]:
            bound[name] = kwargs.get(name, self.defaults.get(name))
        return bound, ["specialisation"], {"num_warps": kwargs.get("num_warps", 4)}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            bound = self._bind(args, kwargs)[0]
            self.log.append(("normal", grid, tuple(bound.values())))
            return self.compiled
        return launch


@pytest.fixture
def fake_triton(monkeypatch):
    monkeypatch.setattr(bound_launch, "JITFunction", _Kernel)
    monkeypatch.setattr(bound_launch, "_current_device", lambda: 0)


_POOL = torch.zeros(4096, dtype=torch.int32)
_START = (-_POOL.data_ptr() % 256) // 4  # the first element on a 256-byte boundary
_SLOT = [0]


def _x(offset: int = 0, dtype=torch.float32):
    """A fresh 64-element tensor on a 256-byte boundary (as CUDA's allocator gives), plus `offset` elements."""
    _SLOT[0] = (_SLOT[0] + 1) % 8
    first = _START + 256 * _SLOT[0] + offset
    return _POOL[first:first + 64].view(dtype)


def test_the_second_launch_of_a_signature_goes_straight_to_the_compiled_kernel(fake_triton):
    kernel = _Kernel()
    launcher = BoundLauncher(kernel)
    first, second = _x(), _x()
    launcher.launch((3,), first, 16, 1, BLOCK=128, num_warps=4)
    launcher.launch((5,), second, 16, 1, BLOCK=128, num_warps=4)
    # The same arguments Triton's binder gave, in the kernel's order, its default filled; the new grid.
    assert kernel.log == [("normal", (3,), (first, 16, 1, 128, 0)), ("direct", (5,), (second, 16, 1, 128, 0))]
    assert launcher.direct_launches == 1


def test_a_new_int_of_the_same_class_reuses_the_binding_with_its_own_value(fake_triton):
    # A batch's lengths and page counts change every step: 48 and 80 are both 16 times an odd number.
    kernel = _Kernel()
    launcher = BoundLauncher(kernel)
    first, second = _x(), _x()
    launcher.launch((1,), first, 48, 1, BLOCK=128)
    launcher.launch((1,), second, 80, 1, BLOCK=128)
    assert kernel.log[-1] == ("direct", (1,), (second, 80, 1, 128, 0))


@pytest.mark.parametrize("change", ["int", "alignment", "dtype", "constexpr", "option", "keyword type"])
def test_any_change_triton_could_specialise_on_is_a_normal_launch(fake_triton, change):
    kernel = _Kernel()
    launcher = BoundLauncher(kernel)
    base = dict(x=_x(), n=16, block=128, warps=4)
    launcher.launch((1,), base["x"], base["n"], 1, BLOCK=base["block"], num_warps=base["warps"])
    changed = dict(base)
    if change == "int":
        changed["n"] = 17  # no longer divisible by 16
    elif change == "alignment":
        changed["x"] = _x(offset=1)  # 4 bytes past a 64-byte boundary
    elif change == "dtype":
        changed["x"] = _x(dtype=torch.int32)
    elif change == "constexpr":
        changed["block"] = 64
    elif change == "option":
        changed["warps"] = 8
    else:
        changed["block"] = 128.0
    launcher.launch((1,), changed["x"], changed["n"], 1, BLOCK=changed["block"], num_warps=changed["warps"])
    assert [entry[0] for entry in kernel.log] == ["normal", "normal"]
    launcher.launch((1,), changed["x"], changed["n"], 1, BLOCK=changed["block"], num_warps=changed["warps"])
    assert kernel.log[-1][0] == "direct"  # the new signature is bound in its turn


def test_arguments_it_cannot_key_always_launch_normally(fake_triton):
    kernel = _Kernel()
    launcher = BoundLauncher(kernel)
    for _ in range(3):
        launcher.launch((1,), _x(), [16], 1, BLOCK=128)
    assert [entry[0] for entry in kernel.log] == ["normal"] * 3


def test_a_hook_or_a_changed_global_takes_the_normal_launch(fake_triton):
    kernel = _Kernel()
    launcher = BoundLauncher(kernel)
    launcher.launch((1,), _x(), 16, 1, BLOCK=128)
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    launcher.launch((1,), _x(), 16, 1, BLOCK=128)
    kernel.pre_run_hooks.clear()
    read = {"SCALE": 2}
    kernel.used_global_vals = {("SCALE", 0): (1, read)}  # compiled with SCALE = 1; now 2
    launcher.launch((1,), _x(), 16, 1, BLOCK=128)
    assert [entry[0] for entry in kernel.log] == ["normal"] * 3
    read["SCALE"] = 1
    launcher.launch((1,), _x(), 16, 1, BLOCK=128)
    assert kernel.log[-1][0] == "direct"


@pytest.mark.parametrize("form", ["five values", "other order", "other object", "raises"])
def test_a_binder_of_another_form_is_never_bound(fake_triton, form):
    def binder(args, kwargs):
        bound = dict(zip(NAMES, args)) | {"BLOCK": kwargs["BLOCK"], "FLAG": 0}
        if form == "five values":  # Triton 3.0's binder
            return bound, [], [], [], {}
        if form == "other order":
            return dict(reversed(list(bound.items()))), [], {}
        if form == "other object":
            return bound | {"x_ptr": args[0].clone()}, [], {}
        raise RuntimeError("not this Triton")

    kernel = _Kernel(binder_result=binder)
    launcher = BoundLauncher(kernel)
    for _ in range(3):
        launcher.launch((1,), _x(), 16, 1, BLOCK=128)
    assert launcher.direct_launches == 0 and not launcher._bound


def test_a_kernel_that_is_no_jit_function_is_launched_as_given():
    # The interpreter's kernels (TRITON_INTERPRET=1), or a Triton without JITFunction.
    kernel = _Kernel()
    launcher = BoundLauncher(kernel)
    for _ in range(2):
        launcher.launch((1,), _x(), 16, 1, BLOCK=128)
    assert [entry[0] for entry in kernel.log] == ["normal", "normal"]


@pytest.mark.gpu
def test_bound_launches_of_the_guard_and_schedule_write_what_the_normal_launch_writes(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none is visible to torch here")
    import backends.triton.paged_schedule as schedule_module
    from backends.shared.page_guard import PageGuard, _page_guard_kernel
    from backends.triton.guard_and_schedule import _LAUNCH, allocate_schedule, launch_guard_and_schedule
    from backends.triton.paged_mqa_logits import schedule_for
    from dispatch.contract.kv_cache import BLOCK_KV

    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(-3, 4200, (128, 4), generator=gen, dtype=torch.int32).cuda()
    table = torch.randint(-2, 8200, (128, 66), generator=gen, dtype=torch.int32).cuda()

    def flags():
        return torch.zeros(1, dtype=torch.int32, device="cuda")

    before = _LAUNCH.direct_launches
    for width in (4096, 3840, 4096, 3840):  # each width binds once (unless an earlier test did), then goes direct
        guard = PageGuard.allocate(lens, table, width, flags())
        schedule = allocate_schedule(lens, width, BLOCK_KV)
        launch_guard_and_schedule(guard, schedule, 8192)
        normal = PageGuard.allocate(lens, table, width, flags())
        arguments, constants = normal.kernel_arguments(8192)
        _page_guard_kernel[(128,)](*arguments, **constants)  # Triton's own launch, unbound
        with monkeypatch.context() as unbound:  # the schedule alone, through Triton's own launch
            unbound.setattr(schedule_module._SCHEDULE_LAUNCH, "_bindable", False)
            expected = schedule_for(lens, width, BLOCK_KV)
        torch.cuda.synchronize()
        for name in ("safe_table", "lens", "error_flags"):
            assert torch.equal(getattr(guard, name), getattr(normal, name)), name
        assert torch.equal(guard.fill.view(torch.int32), normal.fill.view(torch.int32))
        assert torch.equal(schedule.bounds, expected.bounds)
    assert _LAUNCH.direct_launches >= before + 2
