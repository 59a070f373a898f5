"""The engine example runs end to end (two prefill steps, then decode, verify and draft extension), and
each layer's top-k holds exactly the visible keys of each token (every one, when fewer than k are
visible), with -1 padding: positions in the request, causal inside an extend batch."""

import importlib.util
from pathlib import Path

import torch

from dispatch.extend import ExtendPlan

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "engine_loop.py"


def test_engine_loop_selects_only_visible_keys():
    spec = importlib.util.spec_from_file_location("engine_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--steps", "5", "--layers", "2", "--requests", "3", "--device", "cpu"])
    assert len(results) == 10
    modes = [plan.key.forward_mode.value for plan, _ in results[::2]]
    assert modes == ["extend", "extend", "decode", "target_verify", "draft_extend"]
    for plan, topk in results:
        if isinstance(plan, ExtendPlan):
            visible = [ke - ks for ks, ke in zip(plan.metadata.host_ks, plan.metadata.host_ke)]
            assert topk.shape == (plan.total_tokens, 256)
        else:
            visible = plan.context_lens.reshape(-1).tolist()
            assert topk.shape == (plan.batch_size * plan.next_n, 256)
        assert topk.dtype == torch.int32
        for row, count in enumerate(visible):
            chosen = topk[row][topk[row] >= 0]
            assert len(chosen) == min(count, 256)
            assert chosen.unique().numel() == len(chosen) and (chosen < count).all()
    first, second = results[0][0], results[2][0]
    assert first.total_keys == first.total_tokens  # nothing cached yet
    assert second.total_keys == second.total_tokens + first.total_tokens  # the first part is its prefix
    assert len(second.chunks) > 1  # the example's small logits budget chunks the second prefill
