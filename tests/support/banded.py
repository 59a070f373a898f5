"""A CPU registry whose cluster `banded` includes a measured overlay with batch-size bands: at
target_verify next_n 2 the paged logits' flatten layout was measured faster at B=2 and the native one
at B=16 (and over both, so the key's own order is native first). Both are torch references, available
on any machine, with different layouts, so a plan shows which band decided it."""

from __future__ import annotations

from pathlib import Path

from dispatch.contract.key import DispatchKey
from tests.support.reference_registry import reference_registry

REGISTRY = reference_registry("  banded:\n    measured: measured/banded.yaml\n",
                              paged_fallback="torch.reference, torch.reference.flatten")

NATIVE, FLATTEN = "torch.reference", "torch.reference.flatten"
VERIFY = DispatchKey("cpu", "target_verify", 2, "e4m3fn")

# Geometric means: native 20.98 us over all four shapes, flatten 21.44 (more than 1% slower); at B=2
# flatten 10.95 against native 20.98, at B=16 native 20.98 against flatten 41.95.
OVERLAY = """\
version: 1
cluster: banded
machine: NVIDIA H200
date: 2026-12-01
dispatch: 0.1.0
torch: 2.11.0
workload: {batch_sizes: [2, 16], lengths: [256, 1024], next_n: [2]}
ops:
  paged_mqa_logits:
    versions: {torch.reference: 2.11.0, torch.reference.flatten: 2.11.0}
    preferences:
    - key: {arch: cpu, forward_mode: [target_verify, draft_extend], next_n: 2, fp8_dtype: e4m3fn}
      order: [torch.reference, torch.reference.flatten]
      bands:
      - batch_size_up_to: 2
        order: [torch.reference.flatten, torch.reference]
      - batch_size_up_to: 16
        order: [torch.reference, torch.reference.flatten]
      shapes:
      - shape: B=2 N=2 L~256 H=64 D=128
        median_us: {torch.reference: 20.0, torch.reference.flatten: 10.0}
      - shape: B=2 N=2 L~1K H=64 D=128
        median_us: {torch.reference: 22.0, torch.reference.flatten: 12.0}
      - shape: B=16 N=2 L~256 H=64 D=128
        median_us: {torch.reference: 20.0, torch.reference.flatten: 40.0}
      - shape: B=16 N=2 L~1K H=64 D=128
        median_us: {torch.reference: 22.0, torch.reference.flatten: 44.0}
# end
"""


def write_banded(folder: Path, overlay: str = OVERLAY, registry: str = REGISTRY) -> Path:
    """The registry file (with measured/banded.yaml beside it) in `folder`."""
    (folder / "measured").mkdir(parents=True, exist_ok=True)
    (folder / "measured" / "banded.yaml").write_text(overlay)
    path = folder / "registry.yaml"
    path.write_text(registry)
    return path
