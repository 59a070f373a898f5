"""What runs on each GPU: `python -m dispatch gpus` decides, for every GPU dispatch knows by name, each
op of the indexer step in each forward mode, as that machine would with every optional library
installed (with, where a measured overlay has batch-size bands, each band that decides otherwise than
the key's own order), and says how each decided backend was verified there (its plugin's declaration). Nothing
here is a table of backends: change the registry or a plugin and the output follows."""

from __future__ import annotations

from dataclasses import dataclass

from dispatch.contract.catalog import Catalog
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.errors import NoBackendError
from dispatch.deciding.gpus import GPUS, Gpu, gpus_of
from dispatch.contract.key import Arch, DispatchKey, ForwardMode, Op
from dispatch.registry.document import RegistryDocument
from dispatch.registry.measured_bands import band_label

# The steps the table shows: (column, forward mode, next_n, the logits op of that step).
STEPS = (
    ("decode", ForwardMode.DECODE, 1, Op.PAGED_MQA_LOGITS),
    ("MTP next_n 2", ForwardMode.TARGET_VERIFY, 2, Op.PAGED_MQA_LOGITS),
    ("MTP next_n 4", ForwardMode.TARGET_VERIFY, 4, Op.PAGED_MQA_LOGITS),
    ("extend", ForwardMode.EXTEND, 1, Op.RAGGED_MQA_LOGITS),
)
# Ops every step runs besides its logits; a column each.
SHARED_OPS = ((Op.INDEXER_Q_QUANT, "Q quant"), (Op.TOPK, "top-k"))
NONE = "none"


@dataclass(frozen=True)
class GpuRow:
    gpu: Gpu
    cluster: str | None
    cells: tuple[str, ...]  # one per STEPS column, then one per SHARED_OPS column
    verified: str  # how each decided backend was verified on this arch (its plugin's declaration)

    def as_dict(self) -> dict:
        columns = [label for label, *_ in STEPS] + [label for _, label in SHARED_OPS]
        return {
            "gpu": self.gpu.label,
            "device_name": self.gpu.device_name,
            "arch": self.gpu.arch.value,
            "fp8_dtype": self.gpu.fp8_dtype.value,
            "cluster": self.cluster,
            "decided": dict(zip(columns, self.cells)),
            "verified": self.verified,
        }


def gpu_rows(document: RegistryDocument, catalog: Catalog) -> list[GpuRow]:
    from dispatch.deciding.runtime import build_dispatcher

    rows = []
    for gpu in GPUS:
        dispatcher = build_dispatcher(document, catalog, arch=gpu.arch, check_availability=False,
                                      device_name=gpu.device_name)
        rows.append(_row(gpu, dispatcher))
    return rows


def _row(gpu: Gpu, dispatcher: Dispatcher) -> GpuRow:
    verified: list[tuple[str, str, str]] = []  # (column, backend, how verified on this arch)

    def decided(column: str, op: Op, key: DispatchKey) -> str:
        try:
            decision = dispatcher.decide(op, key)
            sizes = dispatcher.band_sizes(op, key)
            bands = [dispatcher.decide(op, key, batch_size=size) for size in sizes]
            subs = [(band, dispatcher.decide(op, key, batch_size=size, max_seq_len=bound))
                    for size, band in zip(sizes, bands) for bound in dispatcher.band_lengths(op, key, size)]
        except NoBackendError:
            return NONE
        for chosen in [decision, *bands, *(sub for _, sub in subs)]:
            verified.append((column, chosen.backend, chosen.impl.verified_on(gpu.arch).value))
        # The measured bands that decide otherwise than the key's own order, and the length sub-bands that
        # decide otherwise than their band, so none is hidden and none is said twice.
        other = [f"{band_label(sizes, i)}: {band.backend}" for i, band in enumerate(bands) if band.backend != decision.backend]
        other += [f"{sub.band}: {sub.backend}" for band, sub in subs if sub.backend != band.backend]
        return decision.backend + (f" ({'; '.join(other)})" if other else "")

    keys = [DispatchKey(gpu.arch, mode, next_n, gpu.fp8_dtype) for _, mode, next_n, _ in STEPS]
    cells = [decided(label, op, key) for key, (label, _, _, op) in zip(keys, STEPS)]
    for op, column in SHARED_OPS:
        per_step = [decided(column, op, key) for key in keys]
        # One name when every step decides alike; else each step's, so no difference is hidden.
        cells.append(per_step[0] if len(set(per_step)) == 1 else ", ".join(
            f"{label}: {name}" for (label, *_), name in zip(STEPS, per_step)))
    return GpuRow(gpu, dispatcher.cluster, tuple(cells), _verified_text(verified))


def _verified_text(verified: list[tuple[str, str, str]]) -> str:
    """One kind of evidence for the whole row: just that. Else each kind with its backends, and with a
    backend's columns where that backend has more than one kind ("triton (extend, top-k): never run")."""
    kinds: dict[str, dict[str, list[str]]] = {}
    for column, backend, kind in verified:
        columns = kinds.setdefault(kind, {}).setdefault(backend, [])
        if column not in columns:
            columns.append(column)
    if len(kinds) == 1:
        return next(iter(kinds))
    spread = {b for by_backend in kinds.values() for b in by_backend
              if sum(b in other for other in kinds.values()) > 1}
    parts = []
    for kind, by_backend in kinds.items():
        names = [f"{b} ({', '.join(cols)})" if b in spread else b for b, cols in by_backend.items()]
        parts.append(f"{', '.join(names)}: {kind}")
    return "; ".join(parts)


def _columns(row: GpuRow) -> list[str]:
    return [row.gpu.label, row.gpu.arch.value, row.cluster or "-", *row.cells, row.verified]


HEADER = ["GPU", "arch", "cluster", *(label for label, *_ in STEPS), *(label for _, label in SHARED_OPS), "how verified"]


def markdown(rows: list[GpuRow]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    lines += ["| " + " | ".join(_columns(row)) + " |" for row in rows]
    return "\n".join(lines)


def text(rows: list[GpuRow]) -> str:
    table = [HEADER] + [_columns(row) for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1] for line in table
    )


def what_if_note(dispatcher: Dispatcher, host: Arch, gpu: Gpu | None, *, cluster_named: bool) -> str:
    """The line explain prints above a what-if: what is explained, and, for a bare --arch, the cluster
    a real GPU of that arch would match (a bare arch matches clusters with this machine's GPU name)."""
    cluster = f"cluster `{dispatcher.cluster}`" if dispatcher.cluster else "no cluster"
    if gpu is not None:
        how = "named" if cluster_named else "by its match" if dispatcher.cluster else "none matches it"
        return (f"(this machine is {host.value}; explaining the {gpu.label} ({gpu.device_name or 'no GPU'}): arch "
                f"{gpu.arch.value}, {cluster} ({how}))")
    note = f"(this machine is {host.value}; explaining {dispatcher.target_arch.value} as a what-if, {cluster})"
    if cluster_named:
        return note
    from dispatch.deciding.clusters import matching_clusters

    hints = []
    for other in gpus_of(dispatcher.target_arch):
        would = matching_clusters(dispatcher.document, other.arch, other.device_name)
        if len(would) == 1 and would[0] != dispatcher.cluster:
            hints.append(f"a real {other.label} would match cluster `{would[0]}` (--gpu {other.aliases[0]} applies it)")
    return note if not hints else note + "\n(" + "; ".join(hints) + ")"
