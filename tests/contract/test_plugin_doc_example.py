"""The backend plugin of docs/plugins.md is complete: its code block, extracted from the page, runs
through a plan built by dispatch and gives the torch reference's logits (one relative error, the CPU
logits tolerance: the same fp32 sums in another order), with -inf past every token's length."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dispatch import load_dispatcher
from dispatch.contract.key import ForwardMode
from dispatch.step.paged_plan import PagedBatch, build_plan
from tests.support.numerics import CPU_LOGITS_TOLERANCE, assert_logits_match
from tests.support.paged_batch import expected_logits, paged_batch

PAGE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def documented_plugin() -> dict[str, object]:
    text = PAGE.read_text()
    start = text.index("```python\n") + len("```python\n")
    names: dict[str, object] = {}
    exec(compile(text[start : text.index("```\n", start)], f"{PAGE}:plugin example", "exec"), names)  # noqa: S102
    return names


@pytest.mark.parametrize("lengths, next_n", [([1], 1), ([70, 3, 129], 1), ([64, 5], 2), ([200, 4, 65], 4)])
def test_the_documented_run_gives_the_reference_logits(lengths, next_n):
    run = documented_plugin()["run"]
    batch = paged_batch(lengths, next_n, seed=len(lengths) + next_n)
    mode = ForwardMode.DECODE if next_n == 1 else ForwardMode.TARGET_VERIFY
    forward = PagedBatch(batch.seq_lens, batch.page_table, batch.max_seq_len, mode, next_n=next_n)
    plan = build_plan(load_dispatcher(arch="cpu"), forward, kv_fp8_dtype=torch.float8_e4m3fn)
    heads, head_dim = batch.q_tokens.shape[1:]
    q = batch.q_tokens.view(len(lengths), next_n, heads, head_dim)  # the native layout the backend declares
    out = run(plan, q, batch.kv_cache, batch.weights)
    ref = expected_logits(batch)
    assert out.shape == ref.shape == (len(lengths) * next_n, batch.max_seq_len)
    visible = torch.isfinite(ref)
    assert torch.equal(torch.isinf(out), ~visible)  # a mask: the same comparison on both sides
    assert_logits_match(out, ref, tolerance=CPU_LOGITS_TOLERANCE, where=visible)


def test_the_documented_plugin_registers_a_backend_the_contract_accepts():
    from dispatch.contract.backend import Backend

    registered: list[Backend] = []
    documented_plugin()["register_backends"](registered.append)
    assert [backend.name for backend in registered] == ["acme.logits"]
