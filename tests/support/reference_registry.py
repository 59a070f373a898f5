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


def dispatcher_with_overlay(folder, registry: str, overlay: str, catalog, cluster: str = "ci-cpu"):
    """A dispatcher over `registry` (text whose last cluster is `cluster`) with `overlay` written as that
    cluster's measured overlay in `folder` and included by it, as a tune's output is adopted."""
    from dispatch.deciding.runtime import build_dispatcher
    from dispatch.registry.document import load_registry

    (folder / "measured").mkdir(exist_ok=True)
    (folder / "measured" / f"{cluster}.yaml").write_text(overlay)
    (folder / "registry.yaml").write_text(registry + f"    measured: measured/{cluster}.yaml\n")
    return build_dispatcher(load_registry(folder / "registry.yaml"), catalog, cluster=cluster)
