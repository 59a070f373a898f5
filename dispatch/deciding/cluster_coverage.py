"""Keys a cluster leaves without a backend: the registry alone serves them, but with the cluster's
`disable`, `prefer` and measured order applied nothing is left, so `explain --cluster` (and an engine
on that cluster's machines) would stop with NoBackendError. `validate` reports each such cluster."""

from __future__ import annotations

from dispatch.contract.catalog import Catalog
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.key import Arch, ForwardMode, Op
from dispatch.registry.checks import Finding, cells, merged
from dispatch.registry.document import RegistryDocument
from dispatch.registry.reading import dotted


def decided_in(mode: ForwardMode) -> tuple[Op, ...]:
    """The ops a batch of `mode` decides: dispatch.step.paged_plan.ops_for's answer, restated because dispatch.step.paged_plan
    imports torch and `validate` must not (tests/cli/test_validate_command.py checks the two agree)."""
    logits = Op.RAGGED_MQA_LOGITS if mode is ForwardMode.EXTEND else Op.PAGED_MQA_LOGITS
    return (Op.INDEXER_Q_QUANT, logits, Op.TOPK)


def cluster_coverage(document: RegistryDocument, catalog: Catalog) -> list[Finding]:
    """One finding per cluster that loses keys, at its line; a cluster is checked on the archs its
    `match` names, else on every arch the registry serves."""
    all_cells = cells(document, catalog)
    by_arch: dict[Arch, Dispatcher] = {}

    def plain(arch: Arch) -> Dispatcher:
        if arch not in by_arch:
            by_arch[arch] = Dispatcher(document, catalog, cluster=None, target_arch=arch, check_availability=False)
        return by_arch[arch]

    served = [
        (op, cell)
        for cell in all_cells
        for op in decided_in(cell.key.forward_mode)
        if plain(cell.key.arch).can_decide(op, cell.key)
    ]
    findings = []
    for name, cluster in document.registry.clusters.items():
        archs = set(cluster.match.arch) if cluster.match is not None and cluster.match.arch else None
        overlaid: dict[Arch, Dispatcher] = {}
        lost: dict[Op, list] = {}
        for op, cell in served:
            arch = cell.key.arch
            if archs is not None and arch not in archs:
                continue
            if arch not in overlaid:
                overlaid[arch] = Dispatcher(document, catalog, cluster=name, target_arch=arch, check_availability=False)
            if not overlaid[arch].can_decide(op, cell.key):
                lost.setdefault(op, []).append(cell)
        if not lost:
            continue
        texts = [f"{op.value} at {'; '.join(_first(merged(cells_)))}" for op, cells_ in lost.items()]
        location = ("clusters", name)
        findings.append(Finding(
            document.path, document.line_of(location), dotted(location),
            f"cluster `{name}` leaves keys without a backend (explain and an engine there would stop with "
            f"no backend): {' | '.join(texts)}",
            where=location,
        ))
    return findings


def _first(groups: list[str], shown: int = 3) -> list[str]:
    return groups[:shown] + ([f"and {len(groups) - shown} more"] if len(groups) > shown else [])
