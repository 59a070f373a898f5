"""sm89 (Ada: L40S, L4, RTX 4090) has fp8 tensor cores: its own arch, served by the portable Triton
kernels; any GPU that lands on the torch reference says so once, at WARNING, with the reason."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dispatch.deciding import dispatcher as dispatcher_module
from dispatch.contract.detect import cuda_arch
from dispatch.contract.errors import InvalidKeyError
from dispatch.contract.key import Arch, DispatchKey, Op
from dispatch.deciding.runtime import DEFAULT_REGISTRY, load_dispatcher
from tests.support.shipped import shipped_registry_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "capability, arch",
    [((8, 0), Arch.SM80), ((8, 6), Arch.SM80), ((8, 7), Arch.SM80), ((8, 9), Arch.SM89), ((9, 0), Arch.SM90),
     ((10, 0), Arch.SM100), ((10, 3), Arch.SM100), ((12, 0), Arch.SM120), ((12, 1), Arch.SM120)],
)
def test_compute_capability_to_arch(capability, arch):
    assert cuda_arch(*capability) is arch


def test_sm89_holds_e4m3fn_only():
    assert DispatchKey("sm89", "decode", 1, "e4m3fn").arch is Arch.SM89
    with pytest.raises(InvalidKeyError, match="`fp8_dtype` e4m3fnuz cannot occur on `arch` sm89"):
        DispatchKey("sm89", "decode", 1, "e4m3fnuz")


@pytest.mark.parametrize("mode, next_n", [("decode", 1), ("target_verify", 2), ("target_verify", 4), ("draft_extend", 8)])
def test_sm89_gets_the_triton_kernels(mode, next_n):
    what_if = load_dispatcher(DEFAULT_REGISTRY, arch="sm89", cluster=None)
    key = DispatchKey("sm89", mode, next_n, "e4m3fn")
    logits, quant = what_if.decide(Op.PAGED_MQA_LOGITS, key), what_if.decide(Op.INDEXER_Q_QUANT, key)
    assert (logits.backend, logits.rule) == ("triton", "portable-triton")
    assert (quant.backend, quant.rule) == ("triton", "gpu-triton")


@pytest.fixture
def warnings_reset(monkeypatch, caplog):
    monkeypatch.setattr(dispatcher_module, "_warned_reference", set())
    monkeypatch.setattr("dispatch.deciding.clusters.gpu_name", lambda: "")
    caplog.set_level(logging.WARNING, logger="dispatch")
    return caplog


def reference_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "torch reference" in r.getMessage()]


def test_a_gpu_on_the_reference_warns_once_per_op_with_the_reason(warnings_reset):
    # An A100 (sm80): no fp8 tensor cores, so Triton declines and the fallback reaches the reference.
    on_an_a100 = load_dispatcher(DEFAULT_REGISTRY, arch="sm80", cluster=None, check_availability=True)
    for next_n in (1, 2, 3):
        mode = "decode" if next_n == 1 else "target_verify"
        for op in (Op.PAGED_MQA_LOGITS, Op.INDEXER_Q_QUANT):
            assert on_an_a100.decide(op, DispatchKey("sm80", mode, next_n, "e4m3fn")).backend == "torch.reference"
    messages = reference_warnings(warnings_reset)
    assert sorted(m.split()[0] for m in messages) == ["indexer_q_quant", "paged_mqa_logits"]  # once per op
    logits = next(m for m in messages if m.startswith("paged_mqa_logits"))
    assert "on this sm80 GPU runs on the torch reference `torch.reference`, chosen by fallback[1]" in logits
    assert "triton: fallback[0] names it, but arch sm80 not supported" in logits
    quant = next(m for m in messages if m.startswith("indexer_q_quant"))
    assert "chosen by fallback[0]" in quant and "triton: arch sm80 not supported" in quant  # no rule for sm80
    again = load_dispatcher(DEFAULT_REGISTRY, arch="sm80", cluster=None, check_availability=True)  # a reload
    again.decide(Op.PAGED_MQA_LOGITS, DispatchKey("sm80", "decode", 1, "e4m3fn"))
    assert len(reference_warnings(warnings_reset)) == 2


def test_a_reference_the_registry_chose_on_purpose_is_quiet(warnings_reset, tmp_path):
    on_an_h200 = load_dispatcher(DEFAULT_REGISTRY, arch="sm90", cluster="reference-only", check_availability=True)
    key = DispatchKey("sm90", "target_verify", 2, "e4m3fn")
    assert on_an_h200.decide(Op.PAGED_MQA_LOGITS, key).source == "cluster-prefer"  # bisecting on purpose
    # A rule that names the reference first (the shipped top-k rule for sm90's paged modes names
    # dispatch's CUDA top-k first).
    shipped = shipped_registry_text()
    sm90_topk = re.search(r"use: \[cuda\.radix, triton,[^\]]*\]", shipped)
    assert sm90_topk is not None
    registry = tmp_path / "registry.yaml"
    registry.write_text(shipped.replace(sm90_topk.group(0), "use: [torch.reference, triton]"))
    topk = load_dispatcher(registry, arch="sm90", cluster=None, check_availability=True).decide(Op.TOPK, key)
    assert (topk.backend, topk.source) == ("torch.reference", "rule")  # the registry's own top-k choice
    assert reference_warnings(warnings_reset) == []


def test_no_warning_on_a_cpu_or_in_a_what_if(warnings_reset):
    load_dispatcher(DEFAULT_REGISTRY, arch="cpu", cluster=None, check_availability=True).decide(
        Op.PAGED_MQA_LOGITS, DispatchKey("cpu", "decode", 1, "e4m3fn"))
    load_dispatcher(DEFAULT_REGISTRY, arch="sm80", cluster=None).decide(  # explaining another machine
        Op.PAGED_MQA_LOGITS, DispatchKey("sm80", "decode", 1, "e4m3fn"))
    assert reference_warnings(warnings_reset) == []


# Compiles the paged-logits kernel for sm_89 with Triton's own compiler (no GPU needed) and reads the PTX:
# the fp8 dot must lower to Ada's e4m3 tensor-core MMA.
_COMPILE_FOR_SM89 = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from backends.triton import paged_mqa_logits as module
    from backends.triton.fp8_mode import Fp8Mode

    kernel = module._paged_mqa_logits_kernel
    pointers = {"q_ptr": "*fp8e4nv", "k_ptr": "*fp8e4nv", "s_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32"}
    values = {"N": 4, "TG": 4, "H": 64, "D": 128, "BLOCK_KV": 64, "PAGES": 1, "PRODUCT_SCALE": 1.0,
              "NAN_BYTES": module.nan_bytes_mode(Fp8Mode.E4M3FN), "FILL": True, "HIST": False,
              "PDL": False}  # sm89 has no programmatic dependent launch
    names = kernel.arg_names
    constexpr = {p.name for p in kernel.params if p.is_constexpr}
    # Other constexprs are the module's constants of the same name (flag bits, scan widths), as launched.
    values |= {name: getattr(module, name) for name in constexpr - set(values) if hasattr(module, name)}
    missing = constexpr - set(values)
    assert not missing, f"give the sm89 compile test a value for the kernel's new constexprs {missing}"
    signature = {n: "constexpr" if n in constexpr else pointers.get(n, "*i32" if n.endswith("_ptr") else "i32")
                 for n in names}
    source = ASTSource(kernel, signature, constexprs={(names.index(n),): values[n] for n in constexpr})
    compiled = triton.compile(source, target=GPUTarget("cuda", 89, 32), options={"num_warps": 4, "num_stages": 2})
    print(compiled.asm["ptx"])
''')


def test_the_paged_logits_kernel_compiles_to_fp8_tensor_core_mma_for_sm89():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter cannot compile
    result = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM89], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ptx = result.stdout
    assert ".target sm_89" in ptx
    assert "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32" in ptx
