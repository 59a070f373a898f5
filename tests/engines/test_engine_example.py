"""The engine example runs end to end (two extend steps, then decode, verify and draft extension), and
each layer's top-k holds exactly the visible keys of each token (every one, when fewer than k are
visible), with -1 padding: positions in the request, causal inside an extend batch."""

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dispatch.step.extend_plan import ExtendPlan

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "engine_loop.py"


def load_example():
    spec = importlib.util.spec_from_file_location("engine_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_loop_selects_only_visible_keys():
    results = load_example().main(["--steps", "5", "--layers", "2", "--requests", "3", "--device", "cpu"])
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
    assert len(second.chunks) > 1  # the example's small logits budget chunks the second extend batch


def test_the_decision_log_is_on_by_default(capsys):
    logger = logging.getLogger("dispatch")
    level = logger.level
    try:
        load_example().main(["--steps", "3", "--layers", "1", "--requests", "2", "--device", "cpu"])
        err = capsys.readouterr().err
        assert "dispatch INFO: using torch.reference (native, by rule `cpu-reference`) for paged_mqa_logits" in err
        assert "dispatch INFO: using torch.reference (ragged, by rule `cpu-reference-ragged`) for ragged_mqa_logits" in err
        load_example().main(["--steps", "1", "--layers", "1", "--requests", "2", "--device", "cpu", "--quiet"])
        assert "INFO" not in capsys.readouterr().err
    finally:
        logger.setLevel(level)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_a_gpu_is_a_one_line_error():
    root = EXAMPLE.parent.parent  # this checkout's packages, not whichever dispatch is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(EXAMPLE), "--device", "cuda"], capture_output=True, text=True,
                            timeout=120, cwd=root, env=env)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("engine_loop.py: --device cuda, but torch sees no CUDA GPU")
