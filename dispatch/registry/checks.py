"""Checks of a registry against the registered backends: names that must exist (errors at load), and
lint for `validate` (rules that can never fire, rules naming backends that cannot serve them)."""

from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass, field

from dispatch.contract.catalog import Catalog
from dispatch.contract.errors import InvalidKeyError
from dispatch.contract.key import Arch, DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.contract.limits import cut
from dispatch.registry.document import RegistryDocument
from dispatch.registry.reading import dotted, errors_in_file_order


def check_backend_names(document: RegistryDocument, catalog: Catalog) -> None:
    """Raise one RegistryError listing, in file order, every backend name no plugin registered (for that op)."""
    unknown = unknown_backend_names(document, catalog)
    if unknown:
        raise errors_in_file_order(document.path, [(f.line, f.where, f.message) for f in unknown])


def unknown_backend_names(document: RegistryDocument, catalog: Catalog) -> list[Finding]:
    return [
        Finding(document.path, document.line_of(location), dotted(location), _unknown(name, known, op), where=location)
        for location, name, known, op in _named_backends(document, catalog)
        if name not in known
    ]


def _named_backends(document: RegistryDocument, catalog: Catalog):
    registry = document.registry
    for op, table in registry.ops.items():
        known = catalog.names(op)
        for index, rule in enumerate(table.rules):
            for position, name in enumerate(rule.use):
                yield ("ops", op.value, "rules", index, "use", position), name, known, op
        for position, name in enumerate(table.fallback):
            yield ("ops", op.value, "fallback", position), name, known, op
    everywhere = catalog.names()
    for location, name in _overlay_names(document):
        yield location, name, everywhere, None


def _overlay_names(document: RegistryDocument):
    for position, name in enumerate(document.registry.disabled):
        yield ("disabled", position), name
    for cluster_name, cluster in document.registry.clusters.items():
        for field in ("enable", "disable", "prefer"):
            for position, name in enumerate(getattr(cluster, field)):
                yield ("clusters", cluster_name, field, position), name


def _unknown(name: str, known: list[str], op: Op | None) -> str:
    scope = f"for {op.value}" if op else "by any plugin"
    # Names are lowercase; compare lowercased so `Triton` finds `triton`.
    by_lower = {k.lower(): k for k in known}
    near = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f"; did you mean `{by_lower[near[0]]}`?" if near else ""
    from dispatch.contract.host import not_allowed_hint  # reads entry-point metadata only when a name is unknown

    registered = ", ".join(known) or "none"
    # The plugin hint (what to set) before the list of names, which grows with every backend and is what
    # the message's length limit cuts.
    return f"unknown backend `{cut(name)}`{hint}{not_allowed_hint(name)} (registered {scope}: {registered})"


@dataclass(frozen=True)
class Finding:
    path: str
    line: int | None
    location: str
    message: str
    where: tuple = field(default=(), compare=False, repr=False)  # the location as a path into the document

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.location}: {self.message}"


def all_keys(max_next_n: int) -> list[DispatchKey]:
    """Every key that can occur, next_n up to `max_next_n` (for tests and small sweeps)."""
    return [key for key in keys_at(range(1, max_next_n + 1))]


def keys_at(next_ns) -> list[DispatchKey]:
    keys = []
    for arch, mode, next_n, dtype in itertools.product(Arch, ForwardMode, next_ns, Fp8Dtype):
        try:
            keys.append(DispatchKey(arch, mode, next_n, dtype))
        except InvalidKeyError:
            continue
    return keys


@dataclass(frozen=True)
class NextNSpan:
    """next_n from `low` to `high` (None: unbounded), inside which no rule or backend changes its mind."""

    low: int
    high: int | None

    def text(self) -> str:
        if self.high == self.low:
            return str(self.low)
        return f"{self.low}..{'' if self.high is None else self.high}"


def next_n_spans(document: RegistryDocument, catalog: Catalog) -> list[NextNSpan]:
    """The next_n axis cut at every bound a rule or a backend names: interval arithmetic instead of
    enumeration, so `next_n: {min: 1000000}` costs what `{min: 3}` does. Matching and support are
    constant inside a span (Support.extra, an arbitrary callable, is asked at each span's low end)."""
    cuts = {1}
    for table in document.registry.ops.values():
        for rule in table.rules:
            if rule.when.next_n:
                cuts.add(rule.when.next_n.min)
                if rule.when.next_n.max is not None:
                    cuts.add(rule.when.next_n.max + 1)
    for backend in catalog.backends:
        cuts.add(backend.supports.next_n_min)
        if backend.supports.next_n_max is not None:
            cuts.add(backend.supports.next_n_max + 1)
    ordered = sorted(cuts)
    return [NextNSpan(low, ordered[i + 1] - 1 if i + 1 < len(ordered) else None) for i, low in enumerate(ordered)]


@dataclass(frozen=True)
class Cell:
    """A set of keys that every rule and backend treats alike: one key, standing for its next_n span."""

    key: DispatchKey
    span: NextNSpan



def cells(document: RegistryDocument, catalog: Catalog) -> list[Cell]:
    spans = next_n_spans(document, catalog)
    by_low = {span.low: span for span in spans}
    return [Cell(key, by_low[key.next_n]) for key in keys_at(sorted(by_low))]


def findings(document: RegistryDocument, catalog: Catalog) -> list[Finding]:
    """What `validate` reports past the schema: lint and coverage, in file order."""
    return sorted(lint(document, catalog) + coverage(document, catalog), key=lambda f: f.line or 0)


def lint(document: RegistryDocument, catalog: Catalog) -> list[Finding]:
    """Rules that can never fire, and rules naming backends that serve none of their keys."""
    findings = []
    all_cells = cells(document, catalog)
    for op, table in document.registry.ops.items():
        earlier: list[tuple[str, set[Cell]]] = []
        for index, rule in enumerate(table.rules):
            location = ("ops", op.value, "rules", index)
            matched = {cell for cell in all_cells if rule.when.matches(cell.key)}
            taken = set().union(*(m for _, m in earlier)) if earlier else set()
            if not matched:
                findings.append(_finding(document, location, f"rule `{rule.id}` matches no key that can occur"))
            elif matched <= taken:
                by = [rid for rid, m in earlier if m & matched]
                findings.append(
                    _finding(
                        document,
                        location,
                        f"rule `{rule.id}` can never fire: earlier rules {_ticks(by)} take every key it matches",
                    )
                )
            for position, name in enumerate(rule.use):
                backend = catalog.get(op, name)
                if backend and matched and all(backend.why_unsupported(cell.key) for cell in matched):
                    sample = min(matched, key=lambda cell: str(cell.key)).key
                    findings.append(
                        _finding(
                            document,
                            location + ("use", position),
                            f"backend `{name}` supports none of the keys rule `{rule.id}` matches "
                            f"(e.g. {sample}: {backend.why_unsupported(sample)})",
                        )
                    )
            earlier.append((rule.id, matched))
    return findings


def coverage(document: RegistryDocument, catalog: Catalog) -> list[Finding]:
    """Keys some registered backend of an op supports, on an arch the registry is for, that neither the
    first matching rule nor the fallback can serve (disabled backends left out): `explain` would exit 1
    there. The registry is for the archs it mentions and the archs where it serves either op, since a
    plan decides both ops: deleting one op's fallback must not pass because the other op still serves."""
    registry = document.registry
    all_cells = cells(document, catalog)
    served: dict[Op, set[Cell]] = {}
    for op, table in registry.ops.items():
        served[op] = set()
        for cell in all_cells:
            if any(_serves(catalog, op, name, cell.key, registry.disabled) for name in table.named_for(cell.key)):
                served[op].add(cell)
    in_scope = mentioned_archs(document) | {cell.key.arch for cells_ in served.values() for cell in cells_}
    findings = []
    for op, table in registry.ops.items():
        lost = [
            cell
            for cell in all_cells
            if cell.key.arch in in_scope
            and cell not in served[op]
            and any(b.why_unsupported(cell.key) is None for b in catalog.for_op(op))
        ]
        if not lost:
            continue
        location = ("ops", op.value, "fallback") if table.fallback else ("ops", op.value)
        groups = merged(lost)
        shown = "; ".join(groups[:4]) + (f"; and {len(groups) - 4} more" if len(groups) > 4 else "")
        findings.append(_finding(document, location, f"no rule or fallback serves keys a backend could serve: {shown}"))
    return findings


def merged(lost: list[Cell]) -> list[str]:
    """Cells as text, adjacent next_n spans of one (arch, mode, dtype) joined: `next_n=1..` not three spans."""
    spans: dict[tuple, list[NextNSpan]] = {}
    def order(cell: Cell) -> tuple:
        key = cell.key
        return list(Arch).index(key.arch), list(ForwardMode).index(key.forward_mode), key.fp8_dtype.value, cell.span.low

    for cell in sorted(lost, key=order):
        k = cell.key
        group = spans.setdefault((k.arch, k.forward_mode, k.fp8_dtype), [])
        if group and group[-1].high is not None and group[-1].high + 1 == cell.span.low:
            group[-1] = NextNSpan(group[-1].low, cell.span.high)
        else:
            group.append(cell.span)
    texts = []
    for (arch, mode, dtype), group in spans.items():
        for span in group:
            next_n = "1" if mode is ForwardMode.DECODE else span.text()
            texts.append(f"arch={arch.value} forward_mode={mode.value} next_n={next_n} fp8_dtype={dtype.value}")
    return texts


def _serves(catalog: Catalog, op: Op, name: str, key: DispatchKey, disabled: tuple[str, ...]) -> bool:
    backend = catalog.get(op, name)
    return backend is not None and name not in disabled and backend.why_unsupported(key) is None


def mentioned_archs(document: RegistryDocument) -> set[Arch]:
    """Archs named by a rule's `when` or a cluster's `match`: the machines this registry is for."""
    archs: set[Arch] = set()
    for table in document.registry.ops.values():
        for rule in table.rules:
            archs |= set(rule.when.arch or ())
    for cluster in document.registry.clusters.values():
        if cluster.match is not None:
            archs |= set(cluster.match.arch or ())
    return archs


def _finding(document: RegistryDocument, location: tuple, message: str) -> Finding:
    return Finding(document.path, document.line_of(location), dotted(location), message)


def _ticks(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)
