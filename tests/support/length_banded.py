"""A CPU registry whose cluster `banded` includes a measured overlay with length sub-bands: at
target_verify next_n 2 the paged logits' flatten layout was measured faster at B=2 L~256 and the native
one at B=2 L~1K, so the B=2 band carries one sub-band per length, bounded by 3L/2 (384 and 1536 keys);
at B=16 native leads at both lengths (no sub-bands). Both backends are torch references, available on
any machine, with different layouts, so a plan shows which sub-band decided it."""

from __future__ import annotations

from tests.support.banded import FLATTEN, NATIVE, REGISTRY, VERIFY, write_banded  # noqa: F401 (re-exported)

# Geometric means: at B=2 flatten sqrt(10 * 30) = 17.3 against native sqrt(20 * 22) = 21.0 (the band's
# order); at L~256 flatten 10 against 20, at L~1K native 22 against 30. At B=16 native 21.0 against 42.0.
# Over all four shapes native 21.0, flatten 27.0.
OVERLAY = """\
version: 1
cluster: banded
machine: NVIDIA H200
date: 2026-12-02
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
        lengths:
        - max_seq_len_up_to: 384
          order: [torch.reference.flatten, torch.reference]
        - max_seq_len_up_to: 1536
          order: [torch.reference, torch.reference.flatten]
      - batch_size_up_to: 16
        order: [torch.reference, torch.reference.flatten]
      shapes:
      - shape: B=2 N=2 L~256 H=64 D=128
        median_us: {torch.reference: 20.0, torch.reference.flatten: 10.0}
      - shape: B=2 N=2 L~1K H=64 D=128
        median_us: {torch.reference: 22.0, torch.reference.flatten: 30.0}
      - shape: B=16 N=2 L~256 H=64 D=128
        median_us: {torch.reference: 20.0, torch.reference.flatten: 40.0}
      - shape: B=16 N=2 L~1K H=64 D=128
        median_us: {torch.reference: 22.0, torch.reference.flatten: 44.0}
# end
"""
