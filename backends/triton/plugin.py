"""Registers the Triton backends. Registration never imports triton: a machine without it still
lists these backends, and their probe says why they cannot run."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from backends.triton.availability import (
    FNUZ_ARCHS,
    TRITON_ARCHS,
    probe_for,
    triton_version,
)
from backends.shared.plan_extension import logits_warm_up
from dispatch.contract import PAGED_MODES, Arch, Backend, Fp8Dtype, Layout, Op, Support, Verified, hookimpl

if TYPE_CHECKING:  # fp8_mode and the input checks import torch; registering must not (`validate` runs without it)
    from backends.triton.fp8_mode import Fp8Mode

# Where the kernels ran (README, "Backends"): timed and checked on the H200 and under the CPU interpreter
# in CI; compiled ahead of time for sm89, sm100, sm120 and gfx950, never run there (no such GPU here).
TRITON_VERIFIED = {Arch.SM90: Verified.MEASURED, Arch.CPU: Verified.CPU_TESTS} | {
    arch: Verified.COMPILED for arch in (Arch.SM89, Arch.SM100, Arch.SM120, Arch.GFX950)
}
# e4m3fnuz is emulated bit-exactly through e4m3fn (CPU interpreter, H200); no AMD GPU ran it.
FNUZ_VERIFIED = {Arch.GFX942: Verified.EMULATED, Arch.CPU: Verified.CPU_TESTS}
# The ragged logits and the top-k ran on the H200 (tools/probe_extend.py, tools/probe_topk.py) and the
# interpreter; elsewhere they are portable Triton with no evidence from that arch.
PORTABLE_VERIFIED = {Arch.SM90: Verified.MEASURED, Arch.CPU: Verified.CPU_TESTS} | {
    arch: Verified.NOT_RUN for arch in (Arch.SM80, Arch.SM89, Arch.SM100, Arch.SM120, Arch.GFX942, Arch.GFX950)
}

# The native kernel holds a row's tokens x heads in one program's tile; past 8 tokens it is untested.
NATIVE_NEXT_N_MAX = 8


def logits_runner(layout: Layout, fnuz_mode: Fp8Mode | None = None) -> Callable:
    """run(plan, q, kv_cache, weights, *, clean_logits) for one layout; `fnuz_mode` None lets the machine
    choose."""

    def run(plan, q, kv_cache, weights, *, clean_logits=True):
        # The inputs passed the op's checks against this layout first (dispatch/contract/ops/paged_logits.py).
        from backends.triton.paged_mqa_logits import triton_paged_mqa_logits

        return triton_paged_mqa_logits(
            q,
            kv_cache,
            weights,
            plan.context_lens,
            plan.block_table,
            plan.max_context_len,
            plan.fp8_dtype,
            fnuz_mode=fnuz_mode,
            error_flags=plan.error_flags,
            clean_logits=clean_logits,
            # None for a plan built without prepare: the call then guards and schedules itself
            guard=plan.state.guard if plan.state is not None else None,
            schedule=plan.state.schedule if plan.state is not None else None,
        )

    return run


def prepare_logits(plan):
    """Per batch: the page guard and the length-balanced schedule (backends/triton/paged_state.py)."""
    from backends.triton.paged_state import prepare_triton_paged  # imports triton, which the probe found

    return prepare_triton_paged(plan)


def logits_plan_tensors(**batch):
    """The plan's lengths, flags and this state in one launch, where it can (backends/triton/plan_tensors.py)."""
    return _plan_tensors()(**batch)


@functools.cache
def _plan_tensors():
    # Imported once, on the first plan: a function-level import costs a GPU host ~2-3 us every batch.
    from backends.triton.plan_tensors import triton_plan_tensors

    return triton_plan_tensors


def refresh_logits(captured, fresh) -> None:
    """Under CUDA graphs: guard and schedule the new batch into the captured plan's tensors, in place."""
    from backends.triton.paged_state import refresh_triton_paged

    refresh_triton_paged(captured, fresh)


def logits_backends() -> list[Backend]:
    """The paged-logits backends: `triton` (native), `triton.flatten`, and `rocm.fnuz` (native, e4m3fnuz)."""
    version = triton_version()
    e4m3fn = frozenset({Fp8Dtype.E4M3FN})
    native_probe = probe_for(TRITON_ARCHS)
    return [
        Backend(
            name="triton",
            op=Op.PAGED_MQA_LOGITS,
            layout=Layout.NATIVE,
            supports=Support(
                archs=TRITON_ARCHS, forward_modes=PAGED_MODES, fp8_dtypes=e4m3fn, next_n_max=NATIVE_NEXT_N_MAX
            ),
            run=logits_runner(Layout.NATIVE),
            prepare=prepare_logits,
            refresh_state=refresh_logits,
            plan_tensors=logits_plan_tensors,
            probe=native_probe,
            warm=logits_warm_up(native_probe),  # the same probe: warm asks it before building
            verified=TRITON_VERIFIED,
            version=version,
            description="Triton fp8 dot, native layout: each KV page read once for all next_n tokens",
        ),
        Backend(
            name="triton.flatten",
            op=Op.PAGED_MQA_LOGITS,
            layout=Layout.FLATTEN,
            supports=Support(archs=TRITON_ARCHS, forward_modes=PAGED_MODES, fp8_dtypes=e4m3fn),
            run=logits_runner(Layout.FLATTEN),
            prepare=prepare_logits,
            refresh_state=refresh_logits,
            probe=probe_for(TRITON_ARCHS),
            verified=TRITON_VERIFIED,
            version=version,
            description="Triton fp8 dot, flatten layout: one row per token, KV pages read next_n times",
        ),
        Backend(
            name="rocm.fnuz",
            op=Op.PAGED_MQA_LOGITS,
            layout=Layout.NATIVE,
            supports=Support(
                archs=FNUZ_ARCHS,
                forward_modes=PAGED_MODES,
                fp8_dtypes=frozenset({Fp8Dtype.E4M3FNUZ}),
                next_n_max=NATIVE_NEXT_N_MAX,
            ),
            run=logits_runner(Layout.NATIVE),
            prepare=prepare_logits,
            refresh_state=refresh_logits,
            probe=probe_for(FNUZ_ARCHS),
            verified=FNUZ_VERIFIED,
            version=version,
            description="Triton, native layout, e4m3fnuz: tl.float8e4b8 on gfx94x, emulated through e4m3fn elsewhere",
        ),
    ]


def run_q_quant(*args, **kwargs):
    from backends.triton.q_quant import triton_indexer_q_quant  # imports triton, which the probe found

    return triton_indexer_q_quant(*args, **kwargs)


def q_quant_backends() -> list[Backend]:
    """The fused Q quantiser twice: `triton` stores OCP e4m3fn, `rocm.fnuz` stores MI300's e4m3fnuz
    (FP8_MAX 224), so a gfx942 key can never be served by the e4m3fn path."""
    description = "fused Triton RoPE + amax + power-of-two scale + {} store + weight folding"
    return [
        Backend(
            name="triton",
            op=Op.INDEXER_Q_QUANT,
            layout=Layout.TOKENS,
            supports=Support(archs=TRITON_ARCHS, fp8_dtypes=frozenset({Fp8Dtype.E4M3FN})),
            run=run_q_quant,
            probe=probe_for(TRITON_ARCHS),
            verified=TRITON_VERIFIED,
            version=triton_version(),
            description=description.format("e4m3fn (FP8_MAX 448)"),
        ),
        Backend(
            name="rocm.fnuz",
            op=Op.INDEXER_Q_QUANT,
            layout=Layout.TOKENS,
            supports=Support(archs=FNUZ_ARCHS, fp8_dtypes=frozenset({Fp8Dtype.E4M3FNUZ})),
            run=run_q_quant,
            probe=probe_for(FNUZ_ARCHS),
            verified=FNUZ_VERIFIED,
            version=triton_version(),
            description=description.format("e4m3fnuz (FP8_MAX 224; native on gfx94x, emulated elsewhere)"),
        ),
    ]


# Top-k is plain fp32 compares, scans, atomics and a sort: no fp8 and no tensor cores, so it runs
# wherever Triton does, MI300 (gfx942) and the sm80 family included.
TOPK_ARCHS = TRITON_ARCHS | FNUZ_ARCHS | {Arch.SM80}


def run_topk(*args, **kwargs):
    from backends.triton.topk import topk_indices  # imports triton, which the probe found

    return topk_indices(*args, **kwargs)


def topk_backends() -> list[Backend]:
    """The top-k backend: `triton`, any forward mode, rows layout."""
    return [
        Backend(
            name="triton",
            op=Op.TOPK,
            layout=Layout.ROWS,
            supports=Support(archs=TOPK_ARCHS),
            run=run_topk,
            probe=probe_for(TOPK_ARCHS),
            verified=PORTABLE_VERIFIED,
            version=triton_version(),
            description="Triton sampled-bracket select split over rows x chunks, exact radix finish; fused page transform",
        )
    ]


def ragged_runner(fnuz_mode: Fp8Mode | None = None) -> Callable:
    """run(q, k, scales, weights, ks, ke, *, fp8_dtype, clean_logits); `fnuz_mode` None lets the machine choose."""

    def run(q, k, scales, weights, ks, ke, *, fp8_dtype, clean_logits=True):
        from backends.triton.ragged_mqa_logits import triton_ragged_mqa_logits

        # The inputs passed the op's checks first (dispatch/contract/ops/ragged_logits.py).
        return triton_ragged_mqa_logits(q, k, scales, weights, ks, ke, clean_logits=clean_logits, fnuz_mode=fnuz_mode)

    return run


def triton_key_gather(plan):
    """The extend plan's K gather: the Triton copy kernel (bytes, so e4m3fn and e4m3fnuz alike)."""
    from backends.shared.kv_gather import TritonKeyGather  # imports triton, which the probe found

    return TritonKeyGather.for_plan(plan)


def ragged_backends() -> list[Backend]:
    """The ragged (extend) logits kernel twice, as the paged one: `triton` reads OCP e4m3fn, `rocm.fnuz`
    e4m3fnuz (tl.float8e4b8 on gfx94x, emulated exactly through e4m3fn elsewhere)."""
    version = triton_version()
    return [
        Backend(
            name="triton",
            op=Op.RAGGED_MQA_LOGITS,
            layout=Layout.RAGGED,
            supports=Support(archs=TRITON_ARCHS, fp8_dtypes=frozenset({Fp8Dtype.E4M3FN})),
            run=ragged_runner(),
            prepare=triton_key_gather,
            probe=probe_for(TRITON_ARCHS),
            verified=PORTABLE_VERIFIED,
            version=version,
            description="Triton fp8 dot over each row tile's key window [min ks, max ke); Triton K gather",
        ),
        Backend(
            name="rocm.fnuz",
            op=Op.RAGGED_MQA_LOGITS,
            layout=Layout.RAGGED,
            supports=Support(archs=FNUZ_ARCHS, fp8_dtypes=frozenset({Fp8Dtype.E4M3FNUZ})),
            run=ragged_runner(),
            prepare=triton_key_gather,
            probe=probe_for(FNUZ_ARCHS),
            verified=FNUZ_VERIFIED,
            version=version,
            description="Triton ragged logits, e4m3fnuz: tl.float8e4b8 on gfx94x, emulated through e4m3fn elsewhere",
        ),
    ]


@hookimpl
def register_backends(register):
    for backend in logits_backends() + q_quant_backends() + ragged_backends() + topk_backends():
        register(backend)
