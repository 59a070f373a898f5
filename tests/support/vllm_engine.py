"""What the vLLM plugin tests share: importing vLLM (with the stubs of tests/support/engine_stubs on sys.path,
only here), vLLM's indexer metadata built with vLLM's own builder pieces, and a torch reference of what
vLLM's indexer computes from it."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from tests.support.engine_presence import engine_missing
from tests.support.engine_stubs_path import engine_stubs_on_path

INSTALL = ("python3 -m pip install --no-deps -r tests/engines/vllm-nodeps.txt && "
           "python3 -m pip install --no-deps -r tests/engines/vllm-deps.txt")
BLOCK = 64
HEAD_DIM = 128


def import_vllm():
    """vLLM's indexer modules, or a clean skip naming the install command."""
    if importlib.util.find_spec("vllm") is None:
        engine_missing(f"vllm 0.33.0 is not installed ({INSTALL})")
    with engine_stubs_on_path("vllm"):
        from vllm.v1.attention.backends.mla import indexer
    return indexer


def kv_cache_and_keys(num_blocks: int, fp8: torch.dtype, generator: torch.Generator):
    """vLLM's per-layer indexer cache uint8 [blocks, 64, 132] with random fp8 keys and fp32 scales."""
    from dispatch.contract.key import FP8_MAX, Fp8Dtype
    from dispatch.contract.fp8 import fp8_dtype_of

    fp8_max = FP8_MAX[Fp8Dtype(fp8_dtype_of(fp8, "cache"))]
    keys = (torch.randn(num_blocks * BLOCK, HEAD_DIM, generator=generator) * fp8_max / 4).clamp(-fp8_max, fp8_max)
    scales = torch.rand(num_blocks * BLOCK, generator=generator) + 0.5
    cache = torch.empty(num_blocks, BLOCK * (HEAD_DIM + 4), dtype=torch.uint8)
    cache[:, : BLOCK * HEAD_DIM] = keys.to(fp8).view(torch.uint8).view(num_blocks, -1)
    cache[:, BLOCK * HEAD_DIM :] = scales.view(torch.uint8).view(num_blocks, -1)
    return cache.view(num_blocks, BLOCK, HEAD_DIM + 4)


def _chunk_metadata_kernel(query_start_loc, uncompressed_seq_lens, cu_seq_lens, row_start_cu, token_to_seq, ks, ke,
                           slice_start, slice_stop, dcp_rank, dcp_world, dcp_interleave, *, num_reqs, COMPRESS_RATIO):
    """vLLM's BuildPrefillChunkMetadataKernel, line for line in torch: vllm.triton_utils finds no GPU
    driver here and leaves the kernel uncompiled, so the chunk builder calls this in its place."""
    assert dcp_world == 1
    for request in range(num_reqs):
        start, end = int(query_start_loc[request]), int(query_start_loc[request + 1])
        row_start = int(row_start_cu[request])
        start_pos = int(uncompressed_seq_lens[request]) - (end - start)
        for offset in range(end - start):
            if slice_start <= start + offset < slice_stop:
                ks[start + offset - slice_start] = row_start
                ke[start + offset - slice_start] = row_start + (start_pos + 1 + offset) // COMPRESS_RATIO
        token_to_seq[int(cu_seq_lens[request]) : int(cu_seq_lens[request + 1])] = request


def vllm_metadata(indexer, seq_lens: list[int], query_lens: list[int], num_decodes: int, block_table: torch.Tensor,
                  *, max_logits_bytes: int = 512 * 1024 * 1024, workspace: int = 1 << 20):
    """DeepseekV32IndexerMetadata for a forward whose first num_decodes requests decode (each
    query_lens[r] tokens), the rest prefill, composed as DeepseekV32IndexerMetadataBuilder.build
    composes it on its native decode path, from vLLM's own pieces (the chunk splitter, the chunk
    builder and its kernel, the decode-tensor preparation)."""
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    num_decode_tokens = int(qsl[num_decodes])
    num_prefills = len(seq_lens) - num_decodes
    prefill = None
    if num_prefills:
        specs = indexer.DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks(
            seq[num_decodes:], torch.diff(qsl[num_decodes:]), workspace, max_logits_bytes, request_offset=num_decodes
        )
        kernel = indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL
        indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL = _chunk_metadata_kernel
        try:
            chunks = [indexer.build_prefill_chunk_metadata(
                s.start, s.stop, qsl, qsl, seq, seq, seq, block_table, 1, query_slice=q, skip_kv_gather=q.start > 0,
            ) for s, q in specs]
        finally:
            indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL = kernel
        prefill = indexer.DeepseekV32IndexerPrefillMetadata(
            chunks=[c for c in chunks if c is not None], max_prefill_seq_len=max(seq_lens[num_decodes:])
        )
    decode = None
    if num_decodes:
        lens = torch.diff(qsl[: num_decodes + 1])
        next_n = int(lens.max())
        builder = SimpleNamespace(  # the builder's buffers _prepare_decode_tensors reads
            vllm_config=SimpleNamespace(speculative_config=None), supports_varlen=False,
            decode_seq_lens_buffer=torch.zeros(4096, dtype=torch.int32),
            offsets_buffer=torch.arange(next_n, dtype=torch.int32),
        )
        d_seq, d_table, d_lens, _, padding = indexer.DeepseekV32IndexerMetadataBuilder._prepare_decode_tensors(
            builder, seq[:num_decodes], block_table[:num_decodes], lens, lens, qsl[:num_decodes],
            num_decodes, num_decode_tokens, True, next_n, next_n,
        )
        decode = indexer.DeepSeekV32IndexerDecodeMetadata(
            block_table=d_table, seq_lens=d_seq if d_seq.dim() == 2 else d_seq.unsqueeze(-1), decode_lens=d_lens,
            requires_padding=padding, schedule_metadata=torch.empty(0, 2, dtype=torch.int32),
            decode_is_uniform=int(lens.min()) == next_n, write_max_decode_len=next_n,
        )
    return indexer.DeepseekV32IndexerMetadata(
        seq_lens=seq, max_seq_len=max(seq_lens), slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        num_decodes=num_decodes, num_decode_tokens=num_decode_tokens, num_prefills=num_prefills,
        num_prefill_tokens=int(qsl[-1]) - num_decode_tokens, decode=decode, prefill=prefill, block_table=block_table,
    )


def visible_keys(seq_lens: list[int], query_lens: list[int]) -> list[tuple[int, int]]:
    """(request, visible length) per token, by vLLM's causal rule: token j of a request of total length
    L with q new tokens sees its keys 0 .. L - q + j."""
    rows = []
    for request, (length, q) in enumerate(zip(seq_lens, query_lens)):
        rows += [(request, length - q + j + 1) for j in range(q)]
    return rows


def reference_logits(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                     rows: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Per token, fp32 logits over its visible keys: sum_h w * relu(q . k) * scale (vLLM's indexer)."""
    blocks = cache.shape[0]
    flat = cache.reshape(blocks, -1)
    keys = flat[:, : BLOCK * HEAD_DIM].contiguous().view(q.dtype).view(blocks, BLOCK, HEAD_DIM).float()
    scales = flat[:, BLOCK * HEAD_DIM :].contiguous().view(torch.float32).view(blocks, BLOCK)
    out = []
    for t, (request, length) in enumerate(rows):
        pos = torch.arange(length)
        page = block_table[request, pos // BLOCK].long()
        k = keys[page, pos % BLOCK]
        s = scales[page, pos % BLOCK]
        out.append(((q[t].float() @ k.T).relu() * weights[t, :, None]).sum(0) * s)
    return out


def assert_topk_matches(buffer: torch.Tensor, logits: list[torch.Tensor], k: int, *, rtol: float = 1e-5) -> None:
    """Tie-aware: per row, the selected positions are distinct and visible, -1 past what the row sees,
    and their values as a multiset are the reference top-k's within rtol of the row's k-th value."""
    for t, row in enumerate(logits):
        picked = buffer[t, :k]
        valid = picked[picked >= 0].long()
        expected = min(k, row.numel())
        assert valid.numel() == expected, f"row {t}: {valid.numel()} indices, expected {expected}"
        assert int((picked == -1).sum()) == k - expected, f"row {t}: not -1 padded"
        assert valid.unique().numel() == valid.numel() and int(valid.max()) < row.numel(), f"row {t}: bad index"
        got = row[valid].sort(descending=True).values
        want = row.topk(expected).values
        scale = want.abs().max().clamp(min=1e-30)
        error = float(((got - want).abs().max() / scale)) if expected else 0.0
        assert error <= rtol, f"row {t}: selected values differ from the reference by {error:.2e} (relative)"
