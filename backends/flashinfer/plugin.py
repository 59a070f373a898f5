"""Registers FlashInfer's top-k (`top_k_ragged_transform`, FlashInfer >= 0.6) as the `flashinfer`
backend of the `topk` op, the kernel of the kind SGLang and vLLM run today: a peer to measure the
Triton kernel against, and a path an operator can prefer.

Its whole contract, beside dispatch.contract.TopkRun:
- rows start at column 0 (no `starts`): it serves the paged modes, where each token's keys begin at
  column 0; a ragged extend row range is refused with LayoutError;
- positions past a row's length, and any FlashInfer reports as missing, come back as -1;
- NaN: FlashInfer ranks NaN as a number, so a selected NaN position is turned into -1 afterwards. A
  poisoned row (all NaN) therefore gives all -1, as on every backend; a row mixing NaN with numbers
  may keep fewer than k keys here where the contract keeps k (the one documented difference);
- the page-table transform and sorted=True run as torch ops over the [rows, k] result;
- FlashInfer reads dense rows only: logits with a row stride wider than W are copied first (one extra
  read and write of the logits, which bench's figures include).
FlashInfer JIT-compiles its kernels on first use (about 36 s on the H200), so warm it up before
capturing a CUDA graph. Importing this module never imports flashinfer.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Callable

from backends.adapted_topk import finish
from backends.engine_probe import engine_topk_availability
from dispatch.contract import (
    PAGED_MODES,
    Arch,
    Availability,
    Backend,
    Layout,
    LayoutError,
    Op,
    Support,
    Verified,
    detect,
    hookimpl,
)

if TYPE_CHECKING:  # torch is imported where it runs: registering must not import it (`validate` runs without it)
    import torch

# FlashInfer's top-k kernels are CUDA-only; they are built for sm_80 and newer.
FLASHINFER_ARCHS = frozenset({Arch.SM80, Arch.SM89, Arch.SM90, Arch.SM100, Arch.SM120})
ENTRY = "top_k_ragged_transform"


def import_flashinfer() -> ModuleType:
    return importlib.import_module("flashinfer")


def flashinfer_availability(*, host: Arch, gpu_visible: bool, load: Callable[[], ModuleType]) -> Availability:
    """Availability on a machine of arch `host`: the cheap facts first, then the import (as for the
    engines' top-k kernels, backends/engine_probe.py)."""
    return engine_topk_availability(host=host, gpu_visible=gpu_visible, archs=FLASHINFER_ARCHS, load=load,
                                    module="flashinfer", symbols=(ENTRY,), missing_hint=" (needs >= 0.6)")


def topk_runner(load: Callable[[], ModuleType]) -> Callable[..., torch.Tensor]:
    """run(logits, lengths, k, *, starts, page_table, page_rows, block_size, sorted) over `load()`'s kernel."""

    def run(logits, lengths, k, *, starts=None, page_table=None, page_rows=None, block_size=64, sorted=False):
        import torch

        
        if starts is not None:
            raise LayoutError("backend `flashinfer` reads every row from column 0; ragged rows (starts) need "
                              "another top-k backend")
        lengths = lengths.to(torch.int32)
        offsets = torch.zeros_like(lengths)
        # FlashInfer reads dense rows only; a logits slice of a wider, aligned buffer is copied first.
        dense = logits if logits.is_contiguous() else logits.contiguous()
        positions = load().top_k_ragged_transform(dense, offsets, lengths, k)
        return finish(logits, lengths, positions, page_table=page_table, page_rows=page_rows,
                      block_size=block_size, sorted=sorted)

    return run


def flashinfer_backends(load: Callable[[], ModuleType] = import_flashinfer) -> list[Backend]:
    """The one backend, resolving flashinfer through `load` (tests pass a stand-in)."""

    def probe() -> Availability:
        import torch

        return flashinfer_availability(host=detect.detect_arch(), gpu_visible=torch.cuda.is_available(), load=load)

    return [
        Backend(
            name="flashinfer",
            op=Op.TOPK,
            layout=Layout.ROWS,
            supports=Support(archs=FLASHINFER_ARCHS, forward_modes=PAGED_MODES),
            run=topk_runner(load),
            probe=probe,
            description="FlashInfer radix top-k over each row's length (top_k_ragged_transform)",
            # FlashInfer 0.6.4 ran and was timed on the H200 (tools/probe_topk.py); no other GPU here.
            verified={Arch.SM90: Verified.MEASURED} | {arch: Verified.NOT_RUN for arch in FLASHINFER_ARCHS - {Arch.SM90}},
        )
    ]


@hookimpl
def register_backends(register):
    for backend in flashinfer_backends():
        register(backend)
