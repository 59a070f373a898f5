"""Checks of a registry against the registered backends: names that must exist (errors at load), and
lint for `validate` (rules that can never fire, rules naming backends that cannot serve them)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from dispatch.catalog import Catalog
from dispatch.errors import InvalidKeyError
from dispatch.key import Arch, DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.registry.document import RegistryDocument, dotted


def check_backend_names(document: RegistryDocument, catalog: Catalog) -> None:
    """Raise RegistryError at the first backend name that no plugin registered (for that op)."""
    registry = document.registry
    for op, table in registry.ops.items():
        known = catalog.names(op)
        for index, rule in enumerate(table.rules):
            for position, name in enumerate(rule.use):
                _require(document, name, known, ("ops", op.value, "rules", index, "use", position), op)
        for position, name in enumerate(table.fallback):
            _require(document, name, known, ("ops", op.value, "fallback", position), op)
    everywhere = catalog.names()
    for location, name in _overlay_names(document):
        _require(document, name, everywhere, location, None)


def _overlay_names(document: RegistryDocument):
    for position, name in enumerate(document.registry.disabled):
        yield ("disabled", position), name
    for cluster_name, cluster in document.registry.clusters.items():
        for field in ("enable", "disable", "prefer"):
            for position, name in enumerate(getattr(cluster, field)):
                yield ("clusters", cluster_name, field, position), name


def _require(document: RegistryDocument, name: str, known: list[str], location: tuple, op: Op | None) -> None:
    if name not in known:
        scope = f"for {op.value}" if op else "by any plugin"
        raise document.error(location, f"unknown backend `{name}` (registered {scope}: {', '.join(known) or 'none'})")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int | None
    location: str
    message: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.location}: {self.message}"


def all_keys(max_next_n: int) -> list[DispatchKey]:
    """Every key that can occur, next_n up to `max_next_n`."""
    keys = []
    for arch, mode, next_n, dtype in itertools.product(Arch, ForwardMode, range(1, max_next_n + 1), Fp8Dtype):
        try:
            keys.append(DispatchKey(arch, mode, next_n, dtype))
        except InvalidKeyError:
            continue
    return keys


def _next_n_horizon(document: RegistryDocument, catalog: Catalog) -> int:
    # Past every bound named anywhere, matching and support no longer change with next_n.
    bounds = [8]
    for table in document.registry.ops.values():
        for rule in table.rules:
            if rule.when.next_n:
                bounds += [rule.when.next_n.min, rule.when.next_n.max or 0]
    bounds += [b.supports.next_n_min for b in catalog.backends]
    bounds += [b.supports.next_n_max or 0 for b in catalog.backends]
    return max(bounds) + 1


def lint(document: RegistryDocument, catalog: Catalog) -> list[Finding]:
    findings = []
    keys = all_keys(_next_n_horizon(document, catalog))
    for op, table in document.registry.ops.items():
        earlier: list[tuple[str, set[DispatchKey]]] = []
        for index, rule in enumerate(table.rules):
            location = ("ops", op.value, "rules", index)
            matched = {key for key in keys if rule.when.matches(key)}
            taken = set().union(*(m for _, m in earlier)) if earlier else set()
            if not matched:
                findings.append(_finding(document, location, f"rule `{rule.id}` matches no key that can occur"))
            elif matched <= taken:
                by = [rid for rid, m in earlier if m & matched]
                findings.append(
                    _finding(document, location, f"rule `{rule.id}` can never fire: earlier rules {_ticks(by)} take every key it matches")
                )
            for position, name in enumerate(rule.use):
                backend = catalog.get(op, name)
                if backend and matched and all(backend.supports.why_not(key) for key in matched):
                    sample = min(matched, key=str)
                    findings.append(
                        _finding(
                            document,
                            location + ("use", position),
                            f"backend `{name}` supports none of the keys rule `{rule.id}` matches "
                            f"(e.g. {sample}: {backend.supports.why_not(sample)})",
                        )
                    )
            earlier.append((rule.id, matched))
    return findings


def _finding(document: RegistryDocument, location: tuple, message: str) -> Finding:
    return Finding(document.path, document.line_of(location), dotted(location), message)


def _ticks(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)
