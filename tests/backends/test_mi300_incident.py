"""Regression test for the vLLM MI300 incident: Q quantised as e4m3fn (FP8_MAX 448) against an
e4m3fnuz K cache. Here the cache's dtype is the key's, so that Q cannot reach the kernel, and the
path decided for gfx942 quantises with FP8_MAX 224 into e4m3fnuz."""

import pytest
import torch

from dispatch.contract.paged_cache import build_paged_kv_cache
from backends.reference.q_quant import reference_indexer_q_quant
from dispatch.contract.errors import DtypeMismatchError, InvalidKeyError, RegistryError
from dispatch.contract.key import DispatchKey, ForwardMode, Op
from dispatch.contract.ops import indexer_q_quant, paged_mqa_logits
from dispatch.step.paged_plan import PagedBatch, build_plan
from dispatch.registry import parse_registry
from dispatch.contract.rope import RopeSpec
from dispatch.deciding.runtime import load_dispatcher

H, D, ROT = 64, 128, 64
SETTINGS = dict(rope=RopeSpec.gptj_tail(), softmax_scale=D**-0.5, head_scale=H**-0.5)


def _batch(generator, lengths=(40, 129, 7)):
    cache, table = build_paged_kv_cache(
        [torch.randn(n, D, generator=generator) for n in lengths], "e4m3fnuz", generator=generator
    )
    batch = PagedBatch(torch.tensor(lengths, dtype=torch.int32), table, max(lengths), ForwardMode.TARGET_VERIFY, 2)
    tokens = len(lengths) * 2
    inputs = dict(
        q=(torch.randn(tokens, H, D, generator=generator) * 300).to(torch.bfloat16),
        weights=torch.randn(tokens, H, generator=generator),
        positions=torch.arange(tokens),
        cos_sin_cache=torch.randn(64, ROT, generator=generator).to(torch.bfloat16),
    )
    return cache, batch, inputs


def test_e4m3fn_q_against_an_fnuz_cache_is_refused_naming_both_dtypes():
    generator = torch.Generator().manual_seed(0)
    cache, batch, inputs = _batch(generator)
    plan = build_plan(load_dispatcher(arch="cpu"), batch, kv_fp8_dtype=torch.float8_e4m3fnuz)
    hard_coded_q, weights = reference_indexer_q_quant(**inputs, fp8_dtype="e4m3fn", **SETTINGS)  # the bug: FP8_MAX 448, e4m3fn
    assert hard_coded_q.float().abs().max() > 224
    with pytest.raises(DtypeMismatchError, match=r"float8_e4m3fn.*e4m3fnuz"):
        paged_mqa_logits(plan, hard_coded_q, cache, weights)


def test_the_plan_quantises_into_the_cache_dtype_and_the_logits_match():
    generator = torch.Generator().manual_seed(1)
    cache, batch, inputs = _batch(generator)
    plan = build_plan(load_dispatcher(arch="cpu"), batch, kv_fp8_dtype=torch.float8_e4m3fnuz)
    q_fp8, weights = indexer_q_quant(plan, **inputs, **SETTINGS)
    assert q_fp8.dtype == torch.float8_e4m3fnuz
    assert q_fp8.float().abs().max() <= 224
    assert torch.isfinite(paged_mqa_logits(plan, q_fp8, cache, weights)).any()


def test_gfx942_decides_the_fnuz_path_with_fp8_max_224():
    dispatcher = load_dispatcher(arch="gfx942")  # a what-if on this machine
    key = DispatchKey("gfx942", "target_verify", 2, "e4m3fnuz")
    quant = dispatcher.decide(Op.INDEXER_Q_QUANT, key)
    logits = dispatcher.decide(Op.PAGED_MQA_LOGITS, key)
    assert (quant.backend, logits.backend) == ("rocm.fnuz", "rocm.fnuz")
    assert "not supported" in {r.backend: r.reason for r in quant.rejected}["triton"]
    generator = torch.Generator().manual_seed(2)
    _, _, inputs = _batch(generator)
    q_fp8, _ = quant.impl.run(**inputs, fp8_dtype=quant.key.fp8_dtype, **SETTINGS)
    assert q_fp8.dtype == torch.float8_e4m3fnuz
    # The scale is the power of two at or above amax / 224, so each head's largest value lands in
    # (112, 224] before the fp8 rounding, which can bring it down to 112.
    head_max = q_fp8.float().abs().amax(dim=-1)
    assert head_max.max() <= 224 and head_max.min() >= 112


def test_keys_and_rules_that_pair_the_wrong_dtype_with_gfx942_are_rejected():
    with pytest.raises(InvalidKeyError, match="e4m3fn cannot occur on `arch` gfx942"):
        DispatchKey("gfx942", "decode", 1, "e4m3fn")
    with pytest.raises(RegistryError, match=r"registry.yaml:6: .*arch gfx942 cannot hold fp8_dtype e4m3fn"):
        parse_registry(
            "version: 1\nops:\n  indexer_q_quant:\n    rules:\n      - id: wrong\n"
            "        when: {arch: gfx942, fp8_dtype: e4m3fn}\n        use: torch.reference\n",
            "registry.yaml",
        )


# --- the same incident in extend batches (gathered K, ragged logits) ---------------------------------


def _extend_case(seed):
    from tests.support.extend_batch import extend_case

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton gather: compiled or interpreted
    return extend_case([40, 0, 7], [5, 30, 1], heads=H, head_dim=D, fp8_dtype="e4m3fnuz", seed=seed, device=device)


def test_gfx942_extend_plans_decide_fnuz_for_q_quant_and_ragged_logits():
    from dispatch.step.extend_plan import build_extend_plan

    dispatcher = load_dispatcher(arch="gfx942")  # a what-if on this machine
    plan = build_extend_plan(dispatcher, _extend_case(3).batch, kv_fp8_dtype=torch.float8_e4m3fnuz)
    assert plan.key == DispatchKey("gfx942", "extend", 1, "e4m3fnuz")
    assert (plan.indexer_q_quant.backend, plan.ragged_logits.backend) == ("rocm.fnuz", "rocm.fnuz")
    assert plan.ragged_logits.rule == "gfx942-fnuz-ragged" and plan.indexer_q_quant.rule == "gfx942-fnuz"
    assert Op.RAGGED_MQA_LOGITS in plan.decisions and Op.PAGED_MQA_LOGITS not in plan.decisions
    rejected = {r.backend: r.reason for r in plan.ragged_logits.rejected}
    assert "arch gfx942 not supported" in rejected["triton"]
    assert "arch gfx942 not supported" in rejected["deepgemm.sm90"]


@pytest.mark.parametrize("backend", ["torch.reference", "rocm.fnuz"])
def test_e4m3fn_q_against_an_fnuz_cache_is_refused_in_extend_too(backend):
    from dispatch.step.extend_plan import build_extend_plan
    from dispatch.contract.ops import gather_keys, ragged_mqa_logits

    case = _extend_case(4)
    plan = build_extend_plan(load_dispatcher(arch="cpu"), case.batch, kv_fp8_dtype=torch.float8_e4m3fnuz,
                             pinned={Op.RAGGED_MQA_LOGITS: backend})
    k, scales = gather_keys(plan, case.kv_cache)
    assert k.dtype == torch.float8_e4m3fnuz
    generator = torch.Generator().manual_seed(5)
    rows = case.batch.total_tokens
    inputs = dict(
        q=(torch.randn(rows, H, D, generator=generator) * 300).to(torch.bfloat16),
        weights=torch.randn(rows, H, generator=generator),
        positions=torch.arange(rows),
        cos_sin_cache=torch.randn(64, ROT, generator=generator).to(torch.bfloat16),
    )
    inputs = {name: value.to(case.kv_cache.device) for name, value in inputs.items()}
    hard_coded_q, weights = reference_indexer_q_quant(**inputs, fp8_dtype="e4m3fn", **SETTINGS)  # the bug
    assert hard_coded_q.float().abs().max() > 224
    metadata = plan.metadata
    with pytest.raises(DtypeMismatchError, match=r"float8_e4m3fn.*e4m3fnuz"):
        ragged_mqa_logits(plan, hard_coded_q, k, scales, weights, metadata.ks, metadata.ke)
    q_fp8, folded = indexer_q_quant(plan, **inputs, **SETTINGS)  # through the plan: fnuz, FP8_MAX 224
    assert q_fp8.dtype == torch.float8_e4m3fnuz and q_fp8.float().abs().max() <= 224
    logits = ragged_mqa_logits(plan, q_fp8, k, scales, folded, metadata.ks, metadata.ke)
    assert torch.isfinite(logits).sum() == int((metadata.ke - metadata.ks).sum())
