"""The engine example runs end to end, and each layer's top-k holds exactly the visible keys of each
token (every one, when fewer than k are visible), with -1 padding."""

import importlib.util
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "engine_loop.py"


def test_engine_loop_selects_only_visible_keys():
    spec = importlib.util.spec_from_file_location("engine_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--steps", "3", "--layers", "2", "--requests", "3", "--device", "cpu"])
    assert len(results) == 6
    modes = {plan.key.forward_mode.value for plan, _ in results}
    assert modes == {"decode", "target_verify", "draft_extend"}
    for plan, topk in results:
        assert topk.dtype == torch.int32 and topk.shape == (plan.batch_size * plan.next_n, 256)
        visible = plan.context_lens.reshape(-1)
        for row, count in enumerate(visible.tolist()):
            chosen = topk[row][topk[row] >= 0]
            assert len(chosen) == min(count, 256)
            assert chosen.unique().numel() == len(chosen) and (chosen < count).all()
