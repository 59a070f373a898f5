"""GPU sweep of the Triton top-k split's keys a thread (`lanes`) at the probe's three shapes: whole
top-k (graph-replayed) and the split kernel's own time, each config checked exact against torch.topk
(docs/internal/benchmark-history.md, "Top-k").

    PYTHONPATH=. python3 tools/sweep_topk_lanes.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tools.probe_topk as probe  # noqa: E402
from backends.triton.topk import launch, launch_config  # noqa: E402

K = 2048
# Changes to launch_config's default: keys a thread (lanes) x warps, the tile following (block).
VARIANTS = [{}, {"block": 2048, "lanes": 16, "num_warps": 4}, {"block": 4096, "lanes": 32, "num_warps": 4},
            {"block": 2048, "lanes": 32, "num_warps": 2}, {"block": 4096, "lanes": 16, "num_warps": 8},
            {"block": 8192, "lanes": 64, "num_warps": 4}, {"block": 4096, "lanes": 64, "num_warps": 2}]


def sweep() -> None:
    for name, batch, next_n, context in probe.SHAPES:
        logits, lengths = probe.make_batch(batch, next_n, context)
        want = torch.topk(logits, K, dim=1).values.sort(dim=1).values
        default = launch_config(*logits.shape, K)
        for change in VARIANTS:
            config = {**default, **change}

            def run(config=config):
                return launch(logits, lengths, K, **config)

            ok = probe.exact(logits, lengths, run(), want, False)
            us = probe.bench(run, True)
            split = {key: value for key, value in probe.kernel_times(run).items() if "split" in key}
            print(f"{name}: {change or 'default'} {us:.1f} us {'exact' if ok else 'WRONG'} {split}", flush=True)


if __name__ == "__main__":
    sweep()
