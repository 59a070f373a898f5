"""Registers the torch reference backends: runs anywhere torch does, the yardstick for the rest."""

from __future__ import annotations

import importlib.metadata

from dispatch.contract import ALL_ARCHS, PAGED_MODES, Arch, Backend, Layout, Op, Support, Verified, hookimpl


# The kernels and the input checks import torch; registering must not (`validate` runs without it),
# so they are imported on first call (afterwards a sys.modules lookup).
def run_paged_mqa_logits(plan, q, kv_cache, weights, *, clean_logits=True):
    from backends.reference.paged_mqa_logits import reference_paged_mqa_logits

    # Both reference backends run the same function, which reads the layout from the tensors' tag. It
    # writes the -inf tail whatever clean_logits says (the flag permits skipping it, never requires it).
    # The inputs passed the op's checks before this run (dispatch/contract/ops/paged_logits.py).
    return reference_paged_mqa_logits(
        q, kv_cache, weights, plan.context_lens, plan.block_table, plan.max_context_len, plan.fp8_dtype,
        num_kv_blocks=plan.num_kv_blocks,
    )


def run_q_quant(*args, **kwargs):
    from backends.reference.q_quant import reference_indexer_q_quant

    return reference_indexer_q_quant(*args, **kwargs)


def run_topk(*args, **kwargs):
    from backends.reference.topk import topk_indices

    return topk_indices(*args, **kwargs)


def run_ragged_mqa_logits(q, k, scales, weights, ks, ke, *, fp8_dtype, clean_logits=True):
    from backends.reference.ragged_mqa_logits import reference_ragged_mqa_logits

    # Always writes -inf outside [ks, ke): what clean_logits=False leaves unspecified may be -inf too.
    # The inputs passed the op's checks before this run (dispatch/contract/ops/ragged_logits.py).
    return reference_ragged_mqa_logits(q, k, scales, weights, ks, ke)


def reference_key_gather(plan):
    """The extend plan's K gather in plain torch (it raises, naming the request, on a bad slot)."""
    from backends.reference.kv_gather import ReferenceKeyGather

    return ReferenceKeyGather.for_plan(plan)


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


# Plain torch, the same code on every device: tested on the CPU in CI, and run on the H200 as the
# yardstick of every GPU check.
VERIFIED = {arch: Verified.CPU_TESTS for arch in Arch} | {Arch.SM90: Verified.MEASURED}


@hookimpl
def register_backends(register):
    logits_support = Support(archs=ALL_ARCHS, forward_modes=PAGED_MODES)
    for name, layout in (("torch.reference", Layout.NATIVE), ("torch.reference.flatten", Layout.FLATTEN)):
        register(
            Backend(
                name=name,
                op=Op.PAGED_MQA_LOGITS,
                layout=layout,
                supports=logits_support,
                run=run_paged_mqa_logits,
                version=_torch_version(),
                verified=VERIFIED,
                description=f"plain torch, {layout.value} layout; slow, exact fp32 on fp8 inputs",
            )
        )
    register(
        Backend(
            name="torch.reference",
            op=Op.INDEXER_Q_QUANT,
            layout=Layout.TOKENS,
            supports=Support(archs=ALL_ARCHS),
            run=run_q_quant,
            version=_torch_version(),
            verified=VERIFIED,
            description="plain torch RoPE + power-of-two fp8 quantisation",
        )
    )
    register(
        Backend(
            name="torch.reference",
            op=Op.TOPK,
            layout=Layout.ROWS,
            supports=Support(archs=ALL_ARCHS),
            run=run_topk,
            version=_torch_version(),
            verified=VERIFIED,
            description="plain torch two-key stable sort: visible first, then by value; NaN never selected",
        )
    )
    register(
        Backend(
            name="torch.reference",
            op=Op.RAGGED_MQA_LOGITS,
            layout=Layout.RAGGED,
            supports=Support(archs=ALL_ARCHS),
            run=run_ragged_mqa_logits,
            prepare=reference_key_gather,
            version=_torch_version(),
            verified=VERIFIED,
            description="plain torch ragged logits over [ks, ke), -inf elsewhere; torch gather (raises on a bad slot)",
        )
    )
