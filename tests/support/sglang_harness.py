"""SGLang 0.5.23's own DSA indexer objects, built on the CPU for the engine tests.

Only the objects that need a model runner, a GPU or process groups are assembled by hand (the backend
and the Indexer, through object.__new__, as SGLang's own sglang/test/kits/dsa_metadata_kit.py does);
every piece of metadata comes from SGLang's own init_forward_metadata and the K cache from its own
DSATokenToKVPool. Import this module only after tests/support/engine_stubs is on sys.path (the engine fixture).

`device` is "cpu" for CI (SGLang's torch top-k; its Triton seqlens kernel under the interpreter) or a
CUDA device, where SGLang takes its SM90 serving path: its sgl-kernel top-k backend, whose fused PAGED
transform is the top-k v2 JIT kernel, and DeepGEMM's paged logits (tests/engines/test_sglang_plugin_gpu.py)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend
from sglang.srt.layers.attention.dsa.paged_mqa_logits_backend import DSAPagedMQALogitsBackend
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.runtime_context import get_parallel

PAGE = 64
HEADS = 64
HEAD_DIM = 128
TOPK = 2048


@contextlib.contextmanager
def single_rank():
    """The parallel widths SGLang reads while building pools and metadata: one rank, no CP or DCP."""
    with get_parallel().override(attn_dcp_size=1, attn_cp_size=1, dcp_enabled=False):
        yield


def make_pool(num_pages: int, layers: int = 2, device: str = "cpu") -> DSATokenToKVPool:
    with single_rank():
        return DSATokenToKVPool(
            size=num_pages * PAGE, page_size=PAGE, kv_lora_rank=512, dtype=torch.bfloat16,
            qk_rope_head_dim=64, layer_num=layers, device=device, index_head_dim=HEAD_DIM,
            enable_memory_saver=False, kv_cache_dim=576,
        )


def make_backend(
    pool: DSATokenToKVPool, req_to_token: torch.Tensor, next_n: int, *, fused_topk: bool = False
) -> DeepseekSparseAttnBackend:
    device = req_to_token.device
    backend = object.__new__(DeepseekSparseAttnBackend)
    backend.device = device
    backend.device_sm_major = 9
    backend.num_q_heads = HEADS
    backend.physical_page_size = PAGE
    backend.dsa_index_topk = TOPK
    backend.dsa_index_kpool = 1
    backend.speculative_num_draft_tokens = next_n
    backend.dsa_drop_wide_page_table = False
    backend.dsa_decode_impl = "fa3"
    backend.dsa_prefill_impl = "fa3"
    backend.enable_auto_select_prefill_impl = False
    backend.dsa_kv_cache_store_fp8 = False
    backend.use_mha = False
    backend.hisparse_coordinator = None
    backend.use_fused_topk = fused_topk  # SGLang's start-up flag; False makes its metadata force unfused top-k
    backend.token_to_kv_pool = pool
    backend.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
    backend.req_to_token = req_to_token
    backend._kv_shard_pool = None
    backend._is_in_breakable_cuda_graph = lambda: False
    backend._is_in_tc_piecewise_cuda_graph = lambda: False
    backend._get_device_sm = lambda: 90
    backend._is_blackwell = lambda: False
    # SGLang's default backend (sgl-kernel) on a GPU; its torch top-k where only the CPU runs.
    backend.dsa_topk_backend = DSATopKBackend.TORCH if device.type == "cpu" else DSATopKBackend.SGL_KERNEL
    backend._arange_buf = torch.arange(1024, dtype=torch.int32, device=device)
    return backend


def make_indexer(sm_count: int = 132) -> Indexer:
    indexer = object.__new__(Indexer)
    torch.nn.Module.__init__(indexer)
    indexer.n_heads = HEADS
    indexer.head_dim = HEAD_DIM
    indexer.index_topk = TOPK
    indexer.num_init_tokens = 0
    indexer.num_local_tokens = 0
    indexer.sm_count = sm_count  # SGLang reads the device's; 132 is the H200's
    indexer.paged_mqa_logits_backend = DSAPagedMQALogitsBackend.DEEPGEMM
    return indexer


def cpu_seqlens_expand(extend_seq_lens, seq_lens, total_len, max_q_len):
    """SGLang's own seqlens_expand_kernel, launched on CPU tensors (its wrapper asserts CUDA; the
    Triton interpreter, on in the tests without a GPU, runs the kernel itself)."""
    import triton

    from sglang.kernels.ops.attention.pad import seqlens_expand_kernel

    count = extend_seq_lens.numel()
    offsets = torch.zeros(count + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(extend_seq_lens, dim=0)
    output = torch.empty(total_len, dtype=torch.int32)
    seqlens_expand_kernel[(count,)](
        extend_seq_lens, seq_lens, offsets, output, count, BLOCK=triton.next_power_of_2(max_q_len)
    )
    return output


@dataclass
class Batch:
    """One forward batch as SGLang holds it at the indexer: its backend (whose init_forward_metadata
    built the metadata), the ForwardBatch fields that backend read, and the indexer metadata."""

    backend: DeepseekSparseAttnBackend
    forward_batch: SimpleNamespace
    metadata: object

    @contextlib.contextmanager
    def context(self):
        with forward_context(ForwardContext(attn_backend=self.backend)):
            yield


def page_aligned_req_to_token(
    requests: int, pages_per_request: int, num_pages: int, generator, device: str = "cpu"
) -> torch.Tensor:
    """SGLang's req_to_token map with pages of 64 slots (its allocator's), on random physical pages
    (drawn with a CPU generator; the map lives on `device`)."""
    pages = torch.randperm(num_pages, generator=generator)[: requests * pages_per_request]
    slots = pages.view(requests, pages_per_request, 1) * PAGE + torch.arange(PAGE)
    return slots.view(requests, -1).to(device=device, dtype=torch.int32)


def make_batch(
    pool, req_to_token, seq_lens: list[int], requests: list[int], mode: ForwardMode, next_n: int, *, fused_topk: bool = False
) -> Batch:
    """init_forward_metadata as SGLang runs it, for a decode, target_verify or draft_extend_v2 batch.
    seq_lens are the requests' lengths as SGLang's batch holds them: committed ones in target_verify
    (SGLang adds the next_n drafts), drafts included in draft_extend_v2 (each extends by next_n).
    The batch lives on req_to_token's device."""
    import sglang.srt.layers.attention.dsa_backend as dsa_backend

    device = req_to_token.device
    backend = make_backend(pool, req_to_token, 0 if mode.is_decode() else next_n, fused_topk=fused_topk)
    seq = torch.tensor(seq_lens, dtype=torch.int64)
    forward_batch = SimpleNamespace(
        batch_size=len(seq_lens), forward_mode=mode, seq_lens=seq.to(device), seq_lens_cpu=seq,
        req_pool_indices=torch.tensor(requests, dtype=torch.int64, device=device), seq_lens_sum=int(seq.sum()),
        global_num_tokens_cpu=None, attn_cp_metadata=None, extend_seq_lens_cpu=None,
    )
    if mode.is_draft_extend_v2():
        extend = [next_n] * len(seq_lens)
        forward_batch.extend_seq_lens_cpu = extend
        forward_batch.extend_seq_lens = torch.tensor(extend, dtype=torch.int32, device=device)
        forward_batch.extend_prefix_lens_cpu = [length - next_n for length in seq_lens]
        forward_batch.extend_num_tokens = sum(extend)
    real_expand = dsa_backend.seqlens_expand_triton
    if device.type == "cpu":  # SGLang's own wrapper runs as it is on a GPU
        dsa_backend.seqlens_expand_triton = cpu_seqlens_expand
    try:
        with single_rank():
            backend.init_forward_metadata(forward_batch)
    finally:
        dsa_backend.seqlens_expand_triton = real_expand
    return Batch(backend, forward_batch, backend.get_indexer_metadata(0, forward_batch))


def fill_index_k(pool, layer: int, generator) -> None:
    """Random keys quantised per token into the layer's index-K buffer, in SGLang's layout
    (64 x 128 fp8 key bytes, then 64 fp32 scales, per page); `generator` on the pool's device."""
    from dispatch.contract.kv_cache import quantize_keys

    buffer = pool.get_index_k_with_scale_buffer(layer_id=layer)
    pages = buffer.shape[0]
    keys = torch.randn(pages * PAGE, HEAD_DIM, generator=generator, device=buffer.device)
    values, scales = quantize_keys(keys, "e4m3fn")
    buffer[:, : PAGE * HEAD_DIM] = values.view(torch.uint8).view(pages, PAGE * HEAD_DIM)
    buffer[:, PAGE * HEAD_DIM :] = scales.view(torch.uint8).view(pages, PAGE * 4)


def quantised_q(tokens: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 Q [T, H, D] and fp32 weights [T, H, 1], as SGLang's act_quant path hands them to the indexer;
    on the generator's device."""
    on = dict(generator=generator, device=generator.device)
    q = (torch.randn(tokens, HEADS, HEAD_DIM, **on) * 4).clamp(-448, 448).to(torch.float8_e4m3fn)
    weights = torch.randn(tokens, HEADS, 1, **on) * HEADS**-0.5
    return q, weights


def make_extend_batch(pool, req_to_token, prefix: list[int], extend: list[int], requests: list[int], *, ragged: bool = False) -> Batch:
    """init_forward_metadata as SGLang runs it for an extend batch. `ragged` picks SGLang's
    RAGGED top-k transform (an fp8 KV cache with flashmla_sparse prefill), else PAGED."""
    backend = make_backend(pool, req_to_token, 0, fused_topk=True)
    backend.supports_mha_one_shot = False
    if ragged:
        backend.dsa_kv_cache_store_fp8 = True
        backend.dsa_prefill_impl = "flashmla_sparse"
    seq = torch.tensor([p + e for p, e in zip(prefix, extend)], dtype=torch.int64)
    forward_batch = SimpleNamespace(
        batch_size=len(prefix), forward_mode=ForwardMode.EXTEND, seq_lens=seq, seq_lens_cpu=seq,
        req_pool_indices=torch.tensor(requests, dtype=torch.int64), seq_lens_sum=int(seq.sum()),
        global_num_tokens_cpu=None, attn_cp_metadata=None, extend_seq_lens_cpu=list(extend),
        extend_seq_lens=torch.tensor(extend), extend_prefix_lens_cpu=list(prefix),
        extend_prefix_lens=torch.tensor(prefix), extend_num_tokens=sum(extend),
    )
    with single_rank():
        backend.init_forward_metadata(forward_batch)
    return Batch(backend, forward_batch, backend.get_indexer_metadata(0, forward_batch))


def serving_batch(
    batch_size: int, next_n: int, mean_len: int, *, device: str, seed: int, layers: int = 1, fused_topk: bool = False
):
    """A decode (next_n 1) or target_verify batch at a serving shape, as dispatch's bench draws it
    (committed lengths uniform in [mean/2, 3*mean/2)): SGLang's own pool with every layer's index K
    filled, requests on shuffled physical pages, and the metadata from SGLang's init_forward_metadata.
    Returns (pool, req_to_token, lengths, requests, mode, batch)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(mean_len // 2, 1), 3 * mean_len // 2, (batch_size,), generator=generator).tolist()
    pages_per_request = -(-(max(lengths) + next_n) // PAGE)
    num_pages = batch_size * pages_per_request + 1  # one spare page: the requests get shuffled pages
    pool = make_pool(num_pages, layers, device)
    on_device = torch.Generator(device=device).manual_seed(seed)
    for layer in range(layers):
        fill_index_k(pool, layer, on_device)
    req_to_token = page_aligned_req_to_token(batch_size, pages_per_request, num_pages, generator, device)
    requests = torch.randperm(batch_size, generator=generator).tolist()
    mode = ForwardMode.DECODE if next_n == 1 else ForwardMode.TARGET_VERIFY
    batch = make_batch(pool, req_to_token, lengths, requests, mode, next_n, fused_topk=fused_topk)
    return pool, req_to_token, lengths, requests, mode, batch
