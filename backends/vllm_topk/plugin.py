"""Registers vLLM's top-k kernels as backends of the `topk` op, available where vLLM is installed (its
`vllm._C` extension registers them as `torch.ops._C` ops). Each one's whole contract is its row below
and its run in adapter.py.

| backend                | torch.ops._C op                               | modes        | k                | rows |
| vllm.persistent_topk   | persistent_topk                               | paged modes  | 512, 1024, 2048  | from column 0 |
| vllm.cooperative_topk  | cooperative_topk                              | paged modes  | 512, 1024, 2048  | from column 0, at most 64 rows |
| vllm.top_k_per_row     | top_k_per_row_decode / top_k_per_row_prefill  | every mode   | 1..2048          | from column 0 (decode) or row starts (extend) |
| vllm.auto              | vLLM's auto chain over the three above        | paged modes  | 1..2048          | from column 0 |

All: CUDA, fp32 logits with a contiguous last dim, -1 past a row's length, a selected NaN turned into
-1. persistent and per-row: sm80 to sm120; cooperative (and auto, which prefers it): sm90 and sm100 (vLLM
refuses the SM12x family). A call a kernel cannot serve (k, rows, starts) raises LayoutError naming the
backend and the reason. Nothing here imports torch or vllm until a probe or a run needs it.
"""

from __future__ import annotations

from collections.abc import Callable

from backends.engine_probe import distribution_version, import_module, probe_for
from dispatch.contract import ALL_MODES, PAGED_MODES, Arch, Backend, Layout, Op, Support, Verified, hookimpl

VLLM_ARCHS = frozenset({Arch.SM80, Arch.SM89, Arch.SM90, Arch.SM100, Arch.SM120})
COOPERATIVE_ARCHS = frozenset({Arch.SM90, Arch.SM100})
MODULE = "vllm._C (torch.ops._C)"

# name, adapter run, the ops it calls, archs, modes, description
_TABLE = (
    ("vllm.persistent_topk", "run_persistent", ("persistent_topk",), VLLM_ARCHS, PAGED_MODES,
     "vLLM persistent_topk: sampled cutoff, filtered select or rows split over CTAs, per batch"),
    ("vllm.cooperative_topk", "run_cooperative", ("cooperative_topk",), COOPERATIVE_ARCHS, PAGED_MODES,
     "vLLM cooperative_topk: one thread-block cluster per row with TMA loads (<= 64 rows)"),
    ("vllm.top_k_per_row", "run_per_row", ("top_k_per_row_decode", "top_k_per_row_prefill"), VLLM_ARCHS,
     ALL_MODES, "vLLM top_k_per_row_decode / _prefill: one CTA a row (its extend path)"),
    ("vllm.auto", "run_auto", ("cooperative_topk", "persistent_topk", "top_k_per_row_decode"), COOPERATIVE_ARCHS,
     PAGED_MODES, "vLLM's auto top-k: cooperative for <= 64 rows, else persistent"),
)


def import_vllm_ops():
    """torch.ops._C once vLLM's extension has registered its ops (importing vllm._custom_ops loads it;
    its loader keeps the module, since every adapter call asks)."""
    _custom_ops()
    import torch

    return torch.ops._C


_custom_ops = import_module("vllm._custom_ops")


class _Adapter:
    """One adapter run (backends/vllm_topk/adapter.py, which imports torch) bound to the ops' loader."""

    def __init__(self, run_name: str, load: Callable[[], object]) -> None:
        self._run_name, self._load = run_name, load

    def run(self, *args, **kwargs):
        return getattr(_adapter(), self._run_name)(self._load(), *args, **kwargs)

    def engine_run(self, *args, **kwargs):
        """The same call without dispatch's finish: the kernel as its engine calls it (bench only)."""
        return getattr(_adapter(), self._run_name)(self._load(), *args, engine=True, **kwargs)


# Imported at the first call (it imports torch), then kept by the loader: every layer's call comes through here.
_adapter = import_module("backends.vllm_topk.adapter")


def vllm_topk_backends(load: Callable[[], object] = import_vllm_ops) -> list[Backend]:
    """The four backends, resolving vLLM's ops through `load` (tests pass a recording stand-in)."""
    return [
        Backend(
            name=name,
            op=Op.TOPK,
            layout=Layout.ROWS,
            supports=Support(archs=archs, forward_modes=modes),
            run=_Adapter(run_name, load).run,
            engine_run=_Adapter(run_name, load).engine_run,
            probe=probe_for(load, MODULE, symbols, archs),
            version=distribution_version("vllm"),
            # vLLM's kernel sources are not in its wheel: built from its 0.33.0 sdist outside the repo, they ran
            # through these adapters on the H200 (2026-12-01 17:25 UTC, exact against torch.topk, timed; see
            # docs/benchmarks.md); elsewhere the record is the recording stand-in's.
            verified={arch: Verified.MEASURED if arch is Arch.SM90 else Verified.CONTRACT for arch in VLLM_ARCHS},
            description=description,
        )
        for name, run_name, symbols, archs, modes, description in _TABLE
    ]


@hookimpl
def register_backends(register):
    for backend in vllm_topk_backends():
        register(backend)
