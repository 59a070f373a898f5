"""When dispatch's own kernels launch with programmatic dependent launch (backends/shared/dependent_launch.py),
and that a step launched with it selects what the same step without it selects (the gpu-marked test)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from backends.shared import dependent_launch as pdl

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hopper(monkeypatch):
    """A machine whose GPU has griddepcontrol, without asking torch for one."""
    monkeypatch.setattr(pdl, "_arch_has_pdl", lambda index: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("DISPATCH_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_on_for_a_cuda_device_that_has_it(hopper):
    assert pdl.dependent_launch(torch.device("cuda", 0))
    assert pdl.dependent_launch(torch.device("cuda"))  # no index: the current device's arch


def test_never_for_the_cpu(hopper):
    assert not pdl.dependent_launch(torch.device("cpu"))


def test_off_where_the_arch_lacks_it(hopper, monkeypatch):
    monkeypatch.setattr(pdl, "_arch_has_pdl", lambda index: False)
    assert not pdl.dependent_launch(torch.device("cuda", 0))


def test_dispatch_pdl_0_switches_it_off_and_anything_else_leaves_it_on(hopper, monkeypatch):
    monkeypatch.setenv("DISPATCH_PDL", "0")
    assert not pdl.dependent_launch(torch.device("cuda", 0))
    monkeypatch.setenv("DISPATCH_PDL", "1")
    assert pdl.dependent_launch(torch.device("cuda", 0))


def test_off_under_the_triton_interpreter(hopper, monkeypatch):
    # griddepcontrol is PTX: the interpreter has nothing to run it on, so no kernel may ask for it there
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.dependent_launch(torch.device("cuda", 0))


def test_a_triton_kernel_also_needs_a_triton_that_launches_with_it(hopper, monkeypatch):
    from backends.triton import dependent_launch as triton_pdl

    monkeypatch.setattr(triton_pdl, "_triton_has_pdl", lambda: False)
    assert pdl.dependent_launch(torch.device("cuda", 0))
    assert not triton_pdl.triton_dependent_launch(torch.device("cuda", 0))
    monkeypatch.setattr(triton_pdl, "_triton_has_pdl", lambda: True)
    assert triton_pdl.triton_dependent_launch(torch.device("cuda", 0))


def test_a_triton_launch_sets_the_kernels_wait_and_the_launch_option_from_one_value(hopper, monkeypatch):
    # A kernel launched with PDL that did not wait could read its inputs before they are written.
    from backends.triton import dependent_launch as triton_pdl

    monkeypatch.setattr(triton_pdl, "_triton_has_pdl", lambda: True)
    assert triton_pdl.pdl_options(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("DISPATCH_PDL", "0")
    assert triton_pdl.pdl_options(torch.device("cuda", 0)) == {"PDL": False, "launch_pdl": False}
    assert triton_pdl.pdl_options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


def test_the_installed_triton_is_asked_for_its_launch_option_and_its_wait():
    pytest.importorskip("triton")
    import dataclasses

    from backends.triton import dependent_launch as triton_pdl
    from triton.backends.nvidia.compiler import CUDAOptions

    names = {field.name for field in dataclasses.fields(CUDAOptions)}
    assert triton_pdl._triton_has_pdl() is ("launch_pdl" in names)


@pytest.mark.gpu
@pytest.mark.parametrize("topk_backend", ["cuda.radix", "sglang.topk_v2", "triton"])
def test_the_step_launched_with_it_selects_exactly_what_the_logits_without_it_hold(topk_backend, monkeypatch):
    """The whole step launched with PDL (dispatch's Triton Q quant and logits, then the top-k with the
    finish where it is an engine's kernel), eagerly and replayed in a CUDA graph, checked exact against
    torch.topk over the logits the same plan's stages give without PDL."""
    from dispatch.bench.compare import compare_topk
    from dispatch.bench.step import step_inputs
    from dispatch.bench.workload import LogitsShape
    from dispatch.contract.errors import DispatchError
    from dispatch.contract.key import Fp8Dtype, Op
    from dispatch.contract.ops import indexer_q_quant, paged_mqa_logits
    from dispatch.deciding.runtime import load_dispatcher
    from dispatch.engines.indexer_step import IndexerStep
    from dispatch.step.paged_plan import build_plan

    if not pdl.dependent_launch(torch.device("cuda")):
        pytest.skip("this GPU has no programmatic dependent launch (sm90 and later)")
    dispatcher = load_dispatcher()
    inputs = step_inputs(LogitsShape(8, 2, 6000), Fp8Dtype.E4M3FN, "cuda")
    try:
        plan = build_plan(dispatcher, inputs.batch, kv_fp8_dtype=Fp8Dtype.E4M3FN, allow_disabled=True,
                          pinned={Op.PAGED_MQA_LOGITS: "triton", Op.TOPK: topk_backend})
    except DispatchError as error:
        pytest.skip(f"{topk_backend} cannot run here: {error}")
    a, kv_cache, k = inputs.activations, inputs.paged.kv_cache, 2048
    monkeypatch.setenv("DISPATCH_PDL", "0")
    q_fp8, folded = indexer_q_quant(plan, a["q"], a["weights"], a["positions"], a["cos_sin_cache"], **inputs.settings)
    logits = paged_mqa_logits(plan, q_fp8, kv_cache, folded, clean_logits=False)

    monkeypatch.setenv("DISPATCH_PDL", "1")
    step = IndexerStep(dispatcher, Fp8Dtype.E4M3FN, index_topk=k, **inputs.settings)

    def run():
        return step.select(plan, a["q"], a["weights"], a["positions"], a["cos_sin_cache"], kv_cache)

    assert compare_topk(run(), logits, plan.token_lengths, k)[1] == "ok"
    graph = torch.cuda.CUDAGraph()
    run()  # warmed on this stream before the capture
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert compare_topk(out, logits, plan.token_lengths, k)[1] == "ok"


# Compiles a Triton kernel of dispatch for sm_90 with Triton's own compiler (no GPU needed, as test_sm89 does)
# and prints its PTX: with PDL the wait comes before the first global load, without it there is none.
_COMPILE_FOR_SM90 = textwrap.dedent('''
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from backends.triton import selection_finish as module

    kernel = module._finish_kernel
    names = kernel.arg_names
    constexpr = {p.name for p in kernel.params if p.is_constexpr}
    values = {"HAS_STARTS": True, "HAS_TABLE": True, "BLOCK": module.BLOCK, "PDL": sys.argv[1] == "1"}
    assert constexpr == set(values), constexpr
    signature = {n: "constexpr" if n in constexpr else ("*i32" if n.endswith("_ptr") else "i32") for n in names}
    signature["logits_ptr"] = "*fp32"
    source = ASTSource(kernel, signature, constexprs={(names.index(n),): values[n] for n in constexpr})
    print(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"])
''')


@pytest.mark.parametrize("on", [True, False])
def test_a_triton_kernel_waits_before_its_first_load_exactly_when_launched_with_it(on):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter cannot compile
    result = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90, "1" if on else "0"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ptx = result.stdout
    assert ".target sm_90" in ptx
    first_load = ptx.index("ld.global")
    if on:
        assert "griddepcontrol.launch_dependents" in ptx
        assert ptx.index("griddepcontrol.wait") < first_load
    else:
        assert "griddepcontrol" not in ptx
