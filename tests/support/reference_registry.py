"""The smallest registry the CPU tests decide by: every op falls back to the torch reference, then the
clusters a test declares."""

from __future__ import annotations


def reference_registry(clusters: str, *, paged_fallback: str = "torch.reference") -> str:
    """Registry text whose ops each fall back to the torch reference (the paged logits to
    `paged_fallback`), then `clusters`: the YAML under `clusters:`, indented as written."""
    return f"""\
version: 1
ops:
  paged_mqa_logits:
    fallback: [{paged_fallback}]
  indexer_q_quant:
    fallback: [torch.reference]
  topk:
    fallback: [torch.reference]
  ragged_mqa_logits:
    fallback: [torch.reference]
clusters:
{clusters}"""
