"""A CPU registry whose cluster `stepped` includes an overlay where the top-k at B=2 is ranked by the whole
step: alone the Triton top-k is the faster at both batch sizes, in the step at B=2 the torch reference
is (the figures are made up, shaped like the H200's at B=8 next_n 4). Both backends are available on
any machine with the Triton interpreter, so `explain` decides by it on the CPU."""

from __future__ import annotations

from pathlib import Path

from dispatch.contract.key import DispatchKey
from tests.support.reference_registry import reference_registry

REGISTRY = reference_registry("  stepped:\n    measured: measured/stepped.yaml\n")

DECODE = DispatchKey("cpu", "decode", 1, "e4m3fn")
SMALL, LARGE = "B=2 N=1 L~256 H=64 D=128 k=64", "B=16 N=1 L~256 H=64 D=128 k=64"

# Alone: triton 10.0 / 20.0 us, the reference 12.0 / 40.0 (key: triton 14.1 against 21.9). In the step at
# B=2: the reference 25.0, triton 30.0.
OVERLAY = f"""\
version: 1
cluster: stepped
machine: NVIDIA H200
date: 2026-12-02
dispatch: 0.1.0
torch: 2.13.0
workload: {{batch_sizes: [2, 16], lengths: [256], next_n: [1], k: [64]}}
ops:
  topk:
    versions: {{torch.reference: 2.13.0, triton: 3.9.0}}
    preferences:
    - key: {{arch: cpu, forward_mode: [decode], next_n: 1, fp8_dtype: e4m3fn}}
      order: [triton, torch.reference]
      bands:
      - batch_size_up_to: 2
        order: [torch.reference, triton]
        ranked_by: step
      - batch_size_up_to: 16
        order: [triton, torch.reference]
      shapes:
      - shape: {SMALL}
        median_us: {{triton: 10.0, torch.reference: 12.0}}
      - shape: {LARGE}
        median_us: {{triton: 20.0, torch.reference: 40.0}}
      step_shapes:
      - shape: {SMALL}
        median_us: {{triton: 30.0, torch.reference: 25.0}}
        stages: {{indexer_q_quant: torch.reference, paged_mqa_logits: torch.reference}}
      timing: graph
# end
"""


def write_stepped(folder: Path, overlay: str = OVERLAY) -> Path:
    """The registry file (with measured/stepped.yaml beside it) in `folder`."""
    (folder / "measured").mkdir(parents=True, exist_ok=True)
    (folder / "measured" / "stepped.yaml").write_text(overlay)
    path = folder / "registry.yaml"
    path.write_text(REGISTRY)
    return path
