"""The plans the vLLM plugin builds from vLLM's indexer metadata (built with vLLM's own builder pieces)
against vLLM's semantics: the decode part's per-token lengths are vLLM's own native [B, next_n] lengths
and its block table vLLM's rows; each extend part's key ranges are vLLM's cu_seqlen_ks / ke; and the
forwards dispatch cannot describe are named, not guessed at."""

import dataclasses

import pytest
import torch

from tests.support.vllm_engine import import_vllm, vllm_metadata

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
def vllm_indexer():
    return import_vllm()


def plans(metadata, num_blocks=64):
    from dispatch import load_dispatcher
    from dispatch.engines.vllm.forward_plan import build_forward_plans, not_served

    assert not_served(metadata) is None
    return build_forward_plans(load_dispatcher(), metadata, kv_fp8_dtype=torch.float8_e4m3fn,
                               num_kv_blocks=num_blocks, block_kv=64)


@pytest.mark.parametrize("seq_lens,next_n", [([130, 64, 7], 1), ([130, 65, 9, 2], 2), ([300, 4], 4)])
def test_decode_plan_is_vllms_decode(vllm_indexer, seq_lens, next_n):
    from dispatch.contract.layout import Layout
    from dispatch.step.paged_plan import visible_lengths

    table = torch.arange(len(seq_lens) * 5, dtype=torch.int32).view(len(seq_lens), 5)
    metadata = vllm_metadata(vllm_indexer, seq_lens, [next_n] * len(seq_lens), len(seq_lens), table)
    plan = plans(metadata).decode
    assert plan.key.next_n == next_n and plan.key.forward_mode.value == ("decode" if next_n == 1 else "target_verify")
    assert plan.batch_size == len(seq_lens) and plan.max_context_len == metadata.max_seq_len
    # vLLM's native decode lengths [B, next_n] are the same integers as dispatch's (exact: one formula).
    assert torch.equal(visible_lengths(metadata.seq_lens, next_n), metadata.decode.seq_lens)
    if plan.layout is Layout.NATIVE:
        assert torch.equal(plan.context_lens, metadata.decode.seq_lens)
        assert torch.equal(plan.block_table, metadata.decode.block_table)
    else:
        assert torch.equal(plan.context_lens.view(-1), metadata.decode.seq_lens.reshape(-1))
        assert torch.equal(plan.block_table, metadata.decode.block_table.repeat_interleave(next_n, 0))


@pytest.mark.parametrize("budget", [512 * 1024 * 1024, 260 * 200 * 4])
def test_extend_plans_are_vllms_chunks(vllm_indexer, budget):
    seq_lens, query_lens = [5, 9, 100, 30, 300, 48], [1, 1, 100, 12, 260, 1]
    table = torch.arange(6 * 5, dtype=torch.int32).view(6, 5)
    metadata = vllm_metadata(vllm_indexer, seq_lens, query_lens, 2, table, max_logits_bytes=budget)
    built = plans(metadata)
    covered = [built.decode_tokens]
    chunks = iter(metadata.prefill.chunks)
    for part in built.extend_parts:
        assert part.rows.start == covered[-1]
        covered.append(part.rows.stop)
        group = [next(chunks)]
        while group[-1].token_end < part.rows.stop:
            group.append(next(chunks))
        ks = torch.cat([c.cu_seqlen_ks for c in group])
        ke = torch.cat([c.cu_seqlen_ke for c in group])
        assert torch.equal(part.plan.metadata.ks, ks) and torch.equal(part.plan.metadata.ke, ke)
        assert part.plan.total_keys == group[0].total_seq_lens
        assert torch.equal(part.plan.page_table, group[0].block_table)
    assert covered[-1] == sum(query_lens)


def test_what_dispatch_cannot_describe_is_named(vllm_indexer):
    from dispatch.engines.vllm.forward_plan import not_served

    table = torch.zeros(3, 4, dtype=torch.int32)
    metadata = vllm_metadata(vllm_indexer, [40, 50, 60], [2, 1, 2], 3, table)
    assert "unequal query lengths" in not_served(metadata)
    sharded = vllm_metadata(vllm_indexer, [40, 50], [40, 50], 0, table[:2])
    sharded = dataclasses.replace(sharded, prefill=dataclasses.replace(sharded.prefill, row_shard_sizes=[45, 45]))
    assert "tensor-parallel" in not_served(sharded)
