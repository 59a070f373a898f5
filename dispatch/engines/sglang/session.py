"""The one dispatcher and indexer steps of an SGLang process, loaded when the plugin is registered."""

from __future__ import annotations

import dataclasses
import functools

from dispatch.engines.indexer_step import IndexerStep
from dispatch.contract.rope import RopeSpec
from dispatch.deciding.runtime import load_dispatcher, registry_path


@functools.lru_cache(maxsize=1)
def session() -> "Session":
    return Session()


class Session:
    """dispatch's side of one SGLang process: the dispatcher (registry, cluster) and, per top-k width
    and output convention, the IndexerStep whose quantised entry the replaced indexer calls."""

    def __init__(self) -> None:
        self.dispatcher = load_dispatcher()
        self.registry = registry_path()
        # SGLang quantises Q itself (RoPE, Hadamard rotation, act_quant) and hands the indexer fp8 Q with
        # the scale folded into the weights: only the step's quantised entry runs, so the Q settings are unused.
        self._step = IndexerStep(
            self.dispatcher, kv_fp8_dtype=sglang_fp8_dtype(), rope=RopeSpec.neox_head(),
            softmax_scale=1.0, head_scale=1.0,
        )
        # Built here, when the plugin is registered, before SGLang captures its CUDA graphs.
        self._step.warm()
        self._steps: dict[tuple[int, bool], IndexerStep] = {}

    def step(self, topk: int, *, to_slots: bool) -> IndexerStep:
        if (topk, to_slots) not in self._steps:
            self._steps[topk, to_slots] = dataclasses.replace(self._step, index_topk=topk, transform_to_slots=to_slots)
        return self._steps[topk, to_slots]

    def describe(self) -> str:
        return f"registry {self.registry}, cluster {self.dispatcher.cluster or '(none)'}, arch {self.dispatcher.target_arch.value}"



def sglang_fp8_dtype():
    """The fp8 dtype SGLang stores the index K cache in (e4m3fnuz on gfx942): the key's, so Q must match."""
    from sglang.kernels.ops.quantization.fp8_kernel import fp8_dtype

    return fp8_dtype
