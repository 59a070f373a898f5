"""The out-of-tree `SparseAttnIndexer`: vLLM's layer with its CUDA and ROCm forwards routed through
dispatch, registered by vLLM's documented `@SparseAttnIndexer.register_oot` (vLLM then builds this
class wherever a model builds `SparseAttnIndexer`). The layer keeps vLLM's construction and state;
its forwards hand dispatch exactly what vLLM's `forward_cuda` hands the `sparse_attn_indexer` op."""

from __future__ import annotations


OP_NAME = "dispatch_sparse_attn_indexer"  # torch.ops.vllm.<this>, beside vLLM's own op


def register_op(get_indexer) -> None:
    """The process's DispatchIndexer (`get_indexer()`) as a torch custom op with the schema and fake of
    vLLM's op, through vLLM's own direct_register_custom_op: opaque to torch.compile, as vLLM's
    forward_cuda keeps its op."""
    import inspect

    import torch
    from vllm.model_executor.layers import sparse_attn_indexer as vllm_layer
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import direct_register_custom_op

    if hasattr(torch.ops.vllm, OP_NAME):  # a process registers the op once
        return

    def dispatch_sparse_attn_indexer(*args, **kwargs):
        return get_indexer()(*args, **kwargs)

    dispatch_sparse_attn_indexer.__signature__ = inspect.signature(vllm_layer.sparse_attn_indexer)
    direct_register_custom_op(
        op_name=OP_NAME,
        op_func=dispatch_sparse_attn_indexer,
        mutates_args=["topk_indices_buffer", "candidate_blocks"],
        fake_impl=vllm_layer.sparse_attn_indexer_fake,
        dispatch_key=current_platform.dispatch_key,
    )


def dispatch_layer_class(get_indexer):
    """Register the op, then define and register the layer class calling it; returns the class."""
    import torch
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.utils.torch_utils import _encode_layer_name

    register_op(get_indexer)

    @SparseAttnIndexer.register_oot
    class DispatchSparseAttnIndexer(SparseAttnIndexer):
        """vLLM's SparseAttnIndexer, served by dispatch on CUDA and ROCm (its CPU and XPU forwards stay vLLM's)."""

        dispatch_plugin = True

        def forward_cuda(self, hidden_states, q_quant, k, weights):
            if isinstance(q_quant, tuple):  # FP4 Q (values, scales): dispatch hands it to vLLM's op
                return super().forward_cuda(hidden_states, q_quant, k, weights)
            return getattr(torch.ops.vllm, OP_NAME)(
                hidden_states, _encode_layer_name(self.k_cache.prefix), self.k_cache.kv_cache, q_quant, None, k, weights,
                self.quant_block_size, self.scale_fmt, self.topk_tokens, self.head_dim, self.max_model_len,
                self.max_total_seq_len, self.topk_indices_buffer, self.skip_k_cache_insert, self.use_pcp,
                self.pcp_shard_decode_requests, _encode_layer_name(self.dense_mha_metadata_layer_name), self.use_fp4_cache,
                self.dcp_rank, self.dcp_world_size, self._parallel_config.cp_kv_cache_interleave_size, False,
                candidate_blocks=self.candidate_blocks, candidate_block_size=self.candidate_block_size,
                candidate_write=self.candidate_write, topk_backend=self.topk_backend,
            )

        def forward_hip(self, hidden_states, q_quant, k, weights):
            # gfx942 included: dispatch's plan keys Q on the K cache's fp8 dtype (e4m3fnuz there).
            return self.forward_cuda(hidden_states, q_quant, k, weights)

    return DispatchSparseAttnIndexer
