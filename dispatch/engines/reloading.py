"""Explicit, atomic reload of registry.yaml under a running engine.

An engine keeps one LiveDispatcher, reads `live.current` once per batch (build_plan(live.current, ...),
so every op of a batch comes from one registry) and calls `live.reload()` when an operator asks: on
SIGHUP or from an admin endpoint (neither is implemented here). Nothing watches the file.

A reload loads the new file, checks every backend name against the catalog and resolves the cluster
before anything changes; one attribute assignment then swaps the dispatcher, so a reader sees the old
one or the new one, never a mix. A bad edit keeps the old dispatcher and says why. Decisions already
made are frozen values and stay valid; decisions after a swap come from the new registry's cache.

A reload never loses coverage silently: a new registry under which a key that decided before (one the
old dispatcher decided, or any kind of key it would decide, every arch, next_n taken span by span)
would have no backend is refused, naming the keys, unless `reload(force=True)`. A file caught half-written fails
here too: once the loaded registry ends with END_MARKER (`# end`, as the shipped one does) a file without it
is refused, and otherwise it does not parse, lacks an op (every op is required), or serves fewer keys.
A model on many ranks reloads every rank, then checks them again (dispatch.engines.agreement.check_ranks_agree).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from dispatch.contract.catalog import Catalog
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.errors import RegistryError
from dispatch.contract.key import Arch, Op
from dispatch.contract.host import collect_backends
from dispatch.registry.checks import Cell, NextNSpan, keys_at, merged, next_n_spans
from dispatch.registry.document import load_registry
from dispatch.registry.reading import END_MARKER
from dispatch.deciding.runtime import build_dispatcher, load_plugins, registry_path


@dataclass(frozen=True)
class ReloadResult:
    ok: bool
    fingerprint_before: str
    fingerprint_after: str  # equal to fingerprint_before when the reload was refused
    error: str = ""  # the RegistryError's text (file:line: key: problem) when refused


class LiveDispatcher:
    """The current Dispatcher for one registry file and catalog; `current` is read without a lock.

        live = LiveDispatcher("/etc/dispatch/registry.yaml")   # or LiveDispatcher(): DISPATCH_REGISTRY, else the packaged file

    The catalog (the backends the plugins registered) is collected once, when not given: a reload
    re-reads the file, not the plugins.
    """

    def __init__(
        self,
        registry: str | os.PathLike | None = None,
        *,
        catalog: Catalog | None = None,
        cluster: str | None = None,
        arch: Arch | str | None = None,
        check_availability: bool | None = None,
    ) -> None:
        self.path: Path = registry_path(registry)
        self.catalog = collect_backends(load_plugins()) if catalog is None else catalog
        self._options = {"cluster": cluster, "arch": arch, "check_availability": check_availability}
        self._lock = threading.Lock()
        # The first load has no older registry to keep: its RegistryError propagates.
        self.current: Dispatcher = self._load()

    def reload(self, *, force: bool = False) -> ReloadResult:
        """Load the file again and swap it in, or keep the current dispatcher and report why not.
        Only RegistryError is a bad edit; anything else is a bug and propagates, the old one kept.
        `force` swaps in a registry that leaves keys without a backend (still valid, still checked)."""
        with self._lock:  # unserialised, a slow reload of an older file could swap in last
            before = self.current.fingerprint
            try:
                fresh = self._load()
            except RegistryError as error:
                return ReloadResult(False, before, before, str(error))
            if self.current.document.sealed and not fresh.document.sealed:
                return ReloadResult(False, before, before, _unsealed_message(self.path))
            lost = [] if force else lost_keys(self.current, fresh)
            if lost:
                return ReloadResult(False, before, before, _lost_message(self.path, lost))
            self.current = fresh
            return ReloadResult(True, before, fresh.fingerprint)

    def _load(self) -> Dispatcher:
        return build_dispatcher(load_registry(self.path), self.catalog, **self._options)


def lost_keys(old: Dispatcher, new: Dispatcher) -> list[tuple[Op, Cell]]:
    """(op, kind of key) that `old` decides and `new` cannot: every key `old` has decided, and every kind
    of key on every arch (one per next_n span over both registries' bounds, so no enumeration). Every
    arch, not only this machine's: a what-if asks about others, and a file torn before the last op's
    fallback loses keys only there."""
    spans = next_n_spans(old.document, old.catalog) + next_n_spans(new.document, new.catalog)
    bounds = sorted({span.low for span in spans})
    asked = [(op, key) for op in Op for key in keys_at(bounds)] + old.decided_keys()
    lost, seen = [], set()
    for op, key in asked:
        cell = Cell(key, _span_from(bounds, key.next_n))
        kind = (op, key.arch, key.forward_mode, key.fp8_dtype, cell.span.low)
        if kind in seen:  # one answer per span; a decided key inside a span checked already adds nothing
            continue
        seen.add(kind)
        if old.can_decide(op, key) and not new.can_decide(op, key):
            lost.append((op, cell))
    return lost


def _span_from(bounds: list[int], next_n: int) -> NextNSpan:
    """The span of `next_n` between the sorted cut points `bounds` (which start at 1)."""
    low = max(b for b in bounds if b <= next_n)
    later = [b for b in bounds if b > low]
    return NextNSpan(low, later[0] - 1 if later else None)


def _unsealed_message(path: Path) -> str:
    return (
        f"{path}: refused: the registry loaded before ends with `{END_MARKER}` and this file does not: a file "
        f"caught half-written loses its last line first (if the edit is complete, end it with `{END_MARKER}`)"
    )


def _lost_message(path: Path, lost: list[tuple[Op, Cell]]) -> str:
    by_op: dict[Op, list[Cell]] = {}
    for op, cell in lost:
        by_op.setdefault(op, []).append(cell)
    parts = []
    for op, cells in by_op.items():
        texts = merged(cells)
        shown = "; ".join(texts[:6]) + (f"; and {len(texts) - 6} more" if len(texts) > 6 else "")
        parts.append(f"{op.value} at {shown}")
    return (
        f"{path}: refused: keys that decided before would have no backend under this registry: "
        + " | ".join(parts)
        + " (a file caught half-written? if meant, reload(force=True))"
    )
