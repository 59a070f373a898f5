"""The DeepGEMM ragged (extend) logits adapter against the recording stand-in: the exact arguments
per API generation, -inf outside each row's range, and what it refuses before the extension would."""

from __future__ import annotations

import pytest
import torch

from backends.deepgemm.adapter import launch_ragged_mqa_logits, missing_ragged_symbols
from backends.reference.ragged_mqa_logits import reference_ragged_mqa_logits as reference_logits
from dispatch.contract.errors import DtypeMismatchError, LayoutError
from dispatch.contract.key import Fp8Dtype
from tests.support.fake_deep_gemm import FakeDeepGemm
from tests.support.extend_batch import extend_case


def inputs(seed=0):
    case = extend_case([70, 0, 5], [6, 40, 1], seed=seed)
    k, scales = case.gathered()
    return case.q, k, scales, case.weights, case.metadata.ks, case.metadata.ke


def test_newest_generation_gets_q_as_a_pair_and_clean_logits():
    fake = FakeDeepGemm("fp8_fp4")
    q, k, scales, weights, ks, ke = args = inputs()
    out = launch_ragged_mqa_logits(fake, *args)
    (call,) = fake.calls_to("fp8_fp4_mqa_logits")
    q_arg, kv_arg, w_arg, ks_arg, ke_arg, clean = call.args
    assert q_arg[0] is q and q_arg[1] is None
    assert kv_arg[0] is k and kv_arg[1] is scales
    assert w_arg is weights and ks_arg is ks and ke_arg is ke and clean is True
    assert call.kwargs == {"max_seqlen_k": 0, "logits_dtype": torch.float32}  # the defaults: full-width logits
    assert out is fake.outputs[0] and out.stride(0) > out.shape[1]  # a slice of the wider buffer, as returned
    # Exact: the stand-in computes with this same reference function on these same tensors.
    assert torch.equal(out, reference_logits(*args))


def test_first_generation_gets_a_bare_q():
    fake = FakeDeepGemm("fp8")
    args = inputs(1)
    out = launch_ragged_mqa_logits(fake, *args)
    (call,) = fake.calls_to("fp8_mqa_logits")
    assert call.args[0] is args[0] and call.args[5] is True and len(call.args) == 6
    assert torch.equal(out, reference_logits(*args))  # exact: the stand-in's own function, same tensors


@pytest.mark.parametrize("garbage", ["nan", "random"])
def test_without_clean_logits_only_the_ranges_are_defined(garbage):
    fake = FakeDeepGemm("fp8_fp4", garbage=garbage)
    args = inputs(2)
    out = launch_ragged_mqa_logits(fake, *args, clean_logits=False)
    assert fake.calls[-1].args[5] is False
    ref = reference_logits(*args)
    visible = torch.isfinite(ref)
    # Exact: the stand-in's own function on the same tensors; only the garbage outside differs.
    assert torch.equal(out[visible], ref[visible]) and not torch.isneginf(out[~visible]).any()


def test_missing_ragged_symbols():
    assert missing_ragged_symbols(FakeDeepGemm("fp8_fp4")) == [] and missing_ragged_symbols(FakeDeepGemm("fp8")) == []
    assert missing_ragged_symbols(FakeDeepGemm("none")) == ["`fp8_fp4_mqa_logits` or `fp8_mqa_logits`"]


def test_refuses_what_the_extension_would_assert_on():
    fake = FakeDeepGemm("fp8_fp4")
    q, k, scales, weights, ks, ke = inputs(3)
    fnuz = extend_case([10], [4], fp8_dtype=Fp8Dtype.E4M3FNUZ, seed=3)
    with pytest.raises(DtypeMismatchError, match="e4m3fn only"):
        launch_ragged_mqa_logits(fake, fnuz.q, *fnuz.gathered(), fnuz.weights, fnuz.metadata.ks, fnuz.metadata.ke)
    with pytest.raises(LayoutError, match="contiguous q"):
        launch_ragged_mqa_logits(fake, q.transpose(0, 1).contiguous().transpose(0, 1), k, scales, weights, ks, ke)
    with pytest.raises(LayoutError, match="H in"):
        launch_ragged_mqa_logits(fake, q[:, :16].contiguous(), k, scales, weights[:, :16].contiguous(), ks, ke)
    with pytest.raises(LayoutError, match="weights"):
        launch_ragged_mqa_logits(fake, q, k, scales, weights.T.contiguous().T, ks, ke)
    with pytest.raises(LayoutError, match="scales"):
        launch_ragged_mqa_logits(fake, q, k, scales.double(), weights, ks, ke)
    with pytest.raises(LayoutError, match="ke"):
        launch_ragged_mqa_logits(fake, q, k, scales, weights, ks, ke.long())
    assert fake.calls == []


def test_empty_sides_do_not_launch():
    fake = FakeDeepGemm("fp8_fp4")
    q, k, scales, weights, ks, ke = inputs(4)
    out = launch_ragged_mqa_logits(fake, q, k[:0], scales[:0], weights, ks, ke)
    assert out.shape == (q.shape[0], 0) and fake.calls == []


def test_the_extend_step_through_deepgemm_sm90_with_the_stand_in():
    """IndexerStep on an sm90 what-if plan whose ragged decision is deepgemm.sm90 (running the stand-in):
    one fp8_mqa_logits call per chunk, without the -inf fill, NaN garbage outside the ranges never
    selected, the selection the formula's."""
    import dataclasses

    from backends.deepgemm.adapter import DeepGemmRaggedLogits
    from dispatch.contract.catalog import Catalog
    from dispatch.deciding.dispatcher import Dispatcher
    from dispatch.engines.indexer_step import IndexerStep
    from dispatch.contract.key import Arch, Op
    from dispatch.deciding.runtime import load_dispatcher
    from tests.step.test_extend_step import SETTINGS, assert_selects_the_reference_top_k, layer_inputs_at, reference_step

    fake = FakeDeepGemm("fp8_fp4", garbage="nan")
    stand_in = DeepGemmRaggedLogits(lambda: fake)
    base = load_dispatcher(arch="sm90")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton gather and Q quant: compiled or interpreted
    # The what-if skips availability, so on a CPU the sm90 top-k rule's first choice (cuda.radix, CUDA
    # only) is left out: the extend step's top-k is then the rule's next, the Triton one (interpreted).
    cpu_only = {"cuda.radix"} if device == "cpu" else set()
    backends = [
        dataclasses.replace(b, run=stand_in.run) if (b.op is Op.RAGGED_MQA_LOGITS and b.name == "deepgemm.sm90") else b
        for b in base.catalog.backends
        if not (b.op is Op.TOPK and b.name in cpu_only)
    ]
    dispatcher = Dispatcher(base.document, Catalog.of(backends), cluster=None, target_arch=Arch.SM90,
                            check_availability=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton gather and Q quant: compiled or interpreted
    case = extend_case([70, 0, 5], [6, 40, 1], heads=32, head_dim=64, seed=4, device=device)
    step = IndexerStep(dispatcher, kv_fp8_dtype=Fp8Dtype.E4M3FN, index_topk=40, logits_byte_budget=4 * 2000, **SETTINGS)
    plan = step.plan(case.batch)
    assert plan.ragged_logits.backend == "deepgemm.sm90" and plan.ragged_logits.rule == "sm90-deepgemm-ragged"
    inputs = {name: value.to(device) for name, value in layer_inputs_at(case, 32, 64).items()}
    indices = step.select(plan, **inputs, kv_cache=case.kv_cache)
    calls = fake.calls_to("fp8_fp4_mqa_logits")
    assert len(plan.chunks) > 1 and len(calls) == len(plan.chunks)
    assert all(call.args[5] is False for call in calls)
    assert_selects_the_reference_top_k(indices, reference_step(case, inputs, 40), 40)
