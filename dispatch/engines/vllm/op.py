"""vLLM's `sparse_attn_indexer` served by dispatch: the same signature as vLLM 0.33.0's function
(vllm/model_executor/layers/sparse_attn_indexer.py), so it can stand where vLLM calls that function.

Per call it finds the forward's plans (built once per forward from vLLM's indexer metadata, reused by
every later layer of that forward), writes vLLM's K cache as vLLM does where the call asks for it, and
writes the top-k through dispatch. What dispatch does not serve is handed to vLLM's own function whole,
decided from host values alone, and logged once per reason: the FP4 indexer cache, decode or prefill
context parallelism, v4.1 candidate blocks, MX-scaled K, profiling runs (no metadata), and forwards
`forward_plan.not_served` names."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from dispatch.engines.vllm.forward_plan import ForwardPlans, build_forward_plans, not_served
from dispatch.engines.vllm.topk_writer import write_topk

logger = logging.getLogger("vllm.plugins.dispatch")


class DispatchIndexer:
    """Callable like vLLM's sparse_attn_indexer. Holds the dispatcher (loaded at first use, in the
    process that serves: loading it detects the GPU) and the last forwards' plans."""

    def __init__(self, vllm_function: Callable[..., torch.Tensor], load: Callable[[], Any]):
        self.vllm_function = vllm_function
        self._load = load
        self._dispatcher = None
        self._plans: list[ForwardPlans] = []  # the latest forwards' plans, newest last
        self._told: set[str] = set()

    @property
    def dispatcher(self):
        if self._dispatcher is None:
            dispatcher = self._load()
            from dispatch.deciding.warming import warm_for

            warm_for(dispatcher)  # its first forward (vLLM's profile run) comes before any graph capture
            self._dispatcher = dispatcher
            logger.info(
                "dispatch serves vLLM's sparse attention indexer: arch %s, cluster %s, registry fingerprint %s",
                self._dispatcher.target_arch.value, self._dispatcher.cluster, self._dispatcher.fingerprint[:12],
            )
        return self._dispatcher

    def plans_for(self, metadata: Any, kv_cache: torch.Tensor) -> ForwardPlans:
        """The plans of the forward `metadata` describes: built at its first layer, then reused (vLLM
        hands every layer of a KV-cache group the same metadata object within one forward)."""
        for plans in self._plans:
            if plans.metadata is metadata:
                return plans
        from vllm.platforms import current_platform

        plans = build_forward_plans(
            self.dispatcher, metadata, kv_fp8_dtype=current_platform.fp8_dtype(),
            num_kv_blocks=kv_cache.shape[0], block_kv=kv_cache.shape[1],
        )
        self._plans = self._plans[-3:] + [plans]  # a few groups' forwards; older objects are released
        return plans

    def _hand_to_vllm(self, reason: str, args: tuple, kwargs: dict) -> torch.Tensor:
        if reason not in self._told:
            self._told.add(reason)
            logger.info("dispatch hands vLLM's own sparse_attn_indexer: %s", reason)
        return self.vllm_function(*args, **kwargs)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        k_cache_prefix,
        kv_cache: torch.Tensor,
        q_quant: torch.Tensor,
        q_scale: torch.Tensor | None,
        k: torch.Tensor | None,
        weights: torch.Tensor,
        quant_block_size: int,
        scale_fmt: str | None,
        topk_tokens: int,
        head_dim: int,
        max_model_len: int,
        total_seq_lens: int,
        topk_indices_buffer: torch.Tensor,
        skip_k_cache_insert: bool,
        use_pcp: bool,
        pcp_shard_decode_requests: bool,
        dense_mha_metadata_layer_name,
        use_fp4_cache: bool = False,
        dcp_rank: int = 0,
        dcp_world_size: int = 1,
        cp_kv_cache_interleave_size: int = 1,
        skip_topk_buffer_clear: bool = False,
        candidate_blocks: torch.Tensor | None = None,
        candidate_block_size: int = 0,
        candidate_write: bool = False,
        topk_backend: str = "auto",
    ) -> torch.Tensor:
        from vllm.forward_context import get_forward_context
        from vllm.utils.deep_gemm import mqa_logits_use_mx_scales
        from vllm.utils.torch_utils import _resolve_layer_name

        args = (hidden_states, k_cache_prefix, kv_cache, q_quant, q_scale, k, weights, quant_block_size,
                scale_fmt, topk_tokens, head_dim, max_model_len, total_seq_lens, topk_indices_buffer,
                skip_k_cache_insert, use_pcp, pcp_shard_decode_requests, dense_mha_metadata_layer_name)
        kwargs = dict(use_fp4_cache=use_fp4_cache, dcp_rank=dcp_rank, dcp_world_size=dcp_world_size,
                      cp_kv_cache_interleave_size=cp_kv_cache_interleave_size,
                      skip_topk_buffer_clear=skip_topk_buffer_clear, candidate_blocks=candidate_blocks,
                      candidate_block_size=candidate_block_size, candidate_write=candidate_write,
                      topk_backend=topk_backend)
        reason = _static_reason(use_fp4_cache, dcp_world_size, use_pcp, candidate_blocks, mqa_logits_use_mx_scales())
        forward_context = get_forward_context()
        attn_metadata = forward_context.attn_metadata
        if reason is None and not isinstance(attn_metadata, dict):
            reason = "a profiling or dummy run (no indexer metadata): vLLM reserves its workspace"
        metadata = attn_metadata[_resolve_layer_name(k_cache_prefix)] if reason is None else None
        reason = reason or not_served(metadata)
        if reason is not None:
            return self._hand_to_vllm(reason, args, kwargs)

        if not skip_k_cache_insert:
            _insert_k(k, kv_cache, metadata.slot_mapping, quant_block_size, scale_fmt)
        if _dense_mha_skips(forward_context, attn_metadata, dense_mha_metadata_layer_name):
            return topk_indices_buffer
        if not skip_topk_buffer_clear:
            topk_indices_buffer[: hidden_states.shape[0]] = -1
        plans = self.plans_for(metadata, kv_cache)
        return write_topk(plans, q_quant, weights, kv_cache, topk_indices_buffer, topk_tokens)


def _static_reason(use_fp4_cache, dcp_world_size, use_pcp, candidate_blocks, mx_scales) -> str | None:
    if use_fp4_cache:
        return "the FP4 indexer cache (dispatch's K cache layout is fp8 + fp32 scales)"
    if dcp_world_size > 1 or use_pcp:
        return "decode or prefill context parallelism (KV sharded over ranks)"
    if candidate_blocks is not None:
        return "v4.1 two-level candidate blocks"
    if mx_scales:
        return "MX-scaled K (ue8m0 scales, not fp32)"
    return None


def _insert_k(k, kv_cache, slot_mapping, quant_block_size, scale_fmt) -> None:
    """vLLM's own K store, as its function runs it (the cache is vLLM's; dispatch only reads it)."""
    from vllm import _custom_ops as ops

    ops.indexer_k_quant_and_cache(k[: slot_mapping.shape[0]], kv_cache, slot_mapping, quant_block_size, scale_fmt)


def _dense_mha_skips(forward_context, attn_metadata: dict, dense_mha_layer_name) -> bool:
    """vLLM's rule: a short prefill whose main attention runs dense MHA consumes no top-k, so the
    buffer is left untouched (outside full CUDA graphs)."""
    from vllm.config import CUDAGraphMode
    from vllm.utils.torch_utils import _resolve_layer_name

    if forward_context.cudagraph_runtime_mode == CUDAGraphMode.FULL:
        return False
    layer = _resolve_layer_name(dense_mha_layer_name)
    if not layer:
        return False
    mla_metadata = attn_metadata.get(layer)
    prefill = getattr(mla_metadata, "prefill", None)
    return (
        getattr(prefill, "use_dense_mha", False)
        and getattr(mla_metadata, "num_decode_tokens", -1) == 0
        and not torch.cuda.is_current_stream_capturing()
    )
