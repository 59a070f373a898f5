"""How many operations one call puts on the GPU's stream (kernels, memsets, copies), counted by the
profiler over one eager call after a warm-up. At small batches the step's time is mostly fixed cost per
launch (issue 23 item 5), so the step's figures name their launches beside their microseconds."""

from __future__ import annotations

from collections.abc import Callable, Iterable


def gpu_launches(fn: Callable[[], object]) -> int | None:
    """Device operations one fn() issues; None where no CUDA device or profiler backend is there."""
    import torch

    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()  # compile, JIT and allocate first: only the steady state's launches count
    torch.cuda.synchronize()
    # acc_events: keep the one cycle's events (without it the profiler warns that it clears them)
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as recorded:
        fn()
        torch.cuda.synchronize()
    return device_operations(recorded.events())


def device_operations(events: Iterable) -> int:
    """The events the profiler recorded on a device (CUPTI's kernels, memsets and copies), not the host's."""
    from torch.autograd import DeviceType

    return sum(1 for event in events if event.device_type == DeviceType.CUDA)
