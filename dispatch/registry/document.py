"""registry.yaml as a validated document: the Registry with where each of its parts came from, its
`extends: default` merge and its clusters' measured overlays attached."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dispatch.contract.errors import RegistryError
from dispatch.contract.limits import MAX_REGISTRY_BYTES, cut
from dispatch.registry.extends import onto_packaged
from dispatch.registry.measured import MeasuredDocument, load_measured
from dispatch.registry.models import Registry
from dispatch.registry.reading import (
    Location,
    deepest_line,
    read_bounded,
    safe_load_with_lines,
    too_big,
    errors_in_file_order,
    is_sealed,
    located_error,
    validation_problems,
)


@dataclass(frozen=True)
class RegistryDocument:
    """A validated registry with where each of its parts came from."""

    registry: Registry
    path: str
    lines: dict[Location, int] = field(repr=False)
    # Each cluster's measured overlay (dispatch.registry.measured.MeasuredDocument), by cluster name.
    measured: dict[str, Any] = field(default_factory=dict, repr=False)
    # The folder a cluster's relative `measured:` path is read from when it is not this file's: a
    # cluster taken from the packaged registry by `extends: default` keeps the packaged folder.
    measured_dirs: dict[str, Path] = field(default_factory=dict, repr=False)
    # With `extends: default`: the parts taken from the packaged registry (locations, and everything
    # under them), and where that file is and its lines, so a message names the file that holds a part.
    inherited: tuple[Location, ...] = field(default=(), repr=False)
    inherited_from: tuple[str, dict[Location, int]] | None = field(default=None, repr=False)
    # Whether the text ends with END_MARKER: once a loaded registry has it, a reload refuses a file
    # without it (dispatch/engines/reloading.py), since a file cut short loses its last line first.
    sealed: bool = False

    @property
    def fingerprint(self) -> str:
        """Hash of the validated content (not the text), measured overlays included: equal for files
        that mean the same, different when any measured preference or its evidence differs."""
        canonical = json.dumps(self.registry.model_dump(mode="json"), sort_keys=True)
        if self.measured:
            overlays = {name: m.overlay.model_dump(mode="json") for name, m in self.measured.items()}
            canonical += json.dumps(overlays, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def line_of(self, location: Location) -> int | None:
        """The line of the deepest part of `location` that the file has."""
        return deepest_line(self.lines, location)

    def where_of(self, location: Location) -> str:
        """"file:line" of `location`, in the packaged file for a part `extends: default` took from it."""
        if self.inherited_from is not None and any(location[: len(part)] == part for part in self.inherited):
            path, lines = self.inherited_from
        else:
            path, lines = self.path, self.lines
        line = deepest_line(lines, location)
        return f"{path}:{line}" if line else path

    def error(self, location: Location, message: str) -> RegistryError:
        return located_error(self.path, self.line_of(location), location, message)


def load_registry(path: str | Path, overlay_problems: list[str] | None = None) -> RegistryDocument:
    """The validated registry at `path`. With `overlay_problems`, a measured overlay that cannot be
    attached is listed there rather than raised (validate reports it with everything else)."""
    path = Path(path)
    raw = read_bounded(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise RegistryError(f"{path}:{line}: not UTF-8 text: byte {raw[error.start]:#04x} is {error.reason}") from None
    return parse_registry(text, str(path), overlay_problems)


def parse_registry(text: str, path: str = "<registry>", overlay_problems: list[str] | None = None) -> RegistryDocument:
    if len(text) > MAX_REGISTRY_BYTES:
        raise RegistryError(too_big(path, len(text)))
    data, lines = safe_load_with_lines(text, path)
    inheriting: dict[str, Any] = {}
    if "extends" in data:
        data, inheriting = onto_packaged(data, lines, path)
    try:
        registry = Registry.model_validate(data)
    except ValidationError as error:
        raise errors_in_file_order(path, validation_problems(error, lines)) from None
    duplicates = list(_duplicate_rule_ids(registry, lines)) + list(_workload_items(registry, lines))
    if duplicates:
        raise errors_in_file_order(path, duplicates)
    document = RegistryDocument(registry=registry, path=path, lines=lines, sealed=is_sealed(text), **inheriting)
    return attach_measured(document, overlay_problems)


def _workload_items(registry: Registry, lines: dict[Location, int]):
    """Each cluster's named workload items that cannot be measured (Workload.item_problems), at their lines."""
    for name, cluster in registry.clusters.items():
        if cluster.workload is None:
            continue
        for at, message in cluster.workload.item_problems():
            location = ("clusters", name, "workload") + at
            yield deepest_line(lines, location), location, message


def _duplicate_rule_ids(registry: Registry, lines: dict[Location, int]):
    for op, table in registry.ops.items():
        first: dict[str, int] = {}
        for index, rule in enumerate(table.rules):
            location = ("ops", op.value, "rules", index, "id")
            line = deepest_line(lines, location)
            if rule.id in first:
                yield line, location, f"duplicate rule id `{rule.id}` (first used on line {first[rule.id]})"
            else:
                first[rule.id] = line


def attach_measured(document: RegistryDocument, problems: list[str] | None = None) -> RegistryDocument:
    """`document` with each cluster's `measured:` overlay loaded, a relative path read from the folder of
    the file that names it. Every overlay that cannot be attached is one RegistryError listing all of
    them; with `problems` (validate's list) each is appended there instead, and the rest still loads."""
    measured, failed = {}, []
    for name, cluster in document.registry.clusters.items():
        if cluster.measured is None:
            continue
        try:
            measured[name] = _overlay_of(document, name, cluster.measured)
        except RegistryError as error:
            failed.append(str(error))
    if failed and problems is None:
        raise RegistryError("\n".join(failed))
    if problems is not None:
        problems.extend(failed)
    return dataclasses.replace(document, measured=measured) if measured else document


def _overlay_of(document: RegistryDocument, name: str, named: str) -> MeasuredDocument:
    location = ("clusters", name, "measured")
    folder = document.measured_dirs.get(name, Path(document.path).parent)
    path = folder / named
    try:
        present = path.is_file()
    except OSError as error:  # a name longer than the filesystem allows
        raise document.error(location, f"the measured overlay {cut(str(path))} cannot be read: "
                                       f"{error.strerror or error}") from None
    if not present:
        where = "an absolute path" if Path(named).is_absolute() else f"relative to {folder}, the folder of the file naming it"
        raise document.error(
            location,
            f"the measured overlay `{cut(named)}` ({where}) is {path}, which is not a file; copy the overlay there, "
            "name it by an absolute path, or start the file with `extends: default` to keep the packaged clusters "
            "and their overlays",
        )
    overlay = load_measured(path)  # its own errors name its own file and line
    if overlay.overlay.cluster not in (None, name):
        raise document.error(location, f"{overlay.path} was measured for cluster `{overlay.overlay.cluster}`, not `{name}`")
    return overlay
