"""Programmatic dependent launch (PDL, sm90 and later): whether dispatch's own kernels launch with it.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still running:
its CTAs start, set up shared memory and read their scalar arguments, then wait (`griddepcontrol.wait`)
until that kernel has finished and its writes are visible. So the gap between two kernels of the step
(the launch, the CTAs' start, the set-up) overlaps the first one's tail instead of following it. SGLang
launches its top-k v2 this way; a step of three or four short kernels (Q quant, logits, top-k, an engine
kernel's finish) pays that gap at each boundary.

The rule every PDL kernel of dispatch keeps, so the chain stays safe whatever runs before it: each CTA
waits unconditionally, before its first read of any tensor (a tensor may have been written by the
kernel before, or by one further back whose completion that kernel's own wait stood behind), and only
then lets its dependents launch (`griddepcontrol.launch_dependents`). A dependent still waits for this
kernel's completion itself, so where the trigger sits affects only when the next kernel starts.

Off under Triton's CPU interpreter and below sm90 (the instructions do not exist there), and when
DISPATCH_PDL=0, which times the step without it (`bench --op step` beside a run with it) and rules it
out when a kernel ordering problem is suspected. The Triton kernels' side (the wait in the kernel and the
launch option, from one switch): backends/triton/dependent_launch.py.
"""

from __future__ import annotations

import functools

import torch

from dispatch.contract import dependent_launch_switched_off, triton_interpreter_on

PDL_ARCH_MAJOR = 9


def dependent_launch(device: torch.device) -> bool:
    """True when kernels on `device` launch with PDL (a CUDA device of sm90 or later, not switched off)."""
    if device.type != "cuda" or dependent_launch_switched_off() or triton_interpreter_on():
        return False
    return _arch_has_pdl(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _arch_has_pdl(index: int) -> bool:
    if torch.version.hip is not None:  # ROCm has no griddepcontrol
        return False
    return torch.cuda.get_device_capability(index)[0] >= PDL_ARCH_MAJOR
