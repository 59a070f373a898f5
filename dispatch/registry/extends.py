"""`extends: default`: an operator's registry that holds only what differs from the packaged one.

The file's `ops` and `clusters` are merged one level deep onto the packaged registry's (an op's table
or a cluster given here replaces the packaged one of that name whole); any other top-level key given
here replaces the packaged value. The result is validated like any registry. Only the packaged
registry can be extended: a registry never names another file to load, so what it reads stays bounded.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

from dispatch.registry.reading import Location, located_error, read_bounded, safe_load_with_lines

# The registry shipped with the package. In a checkout dispatch/registry.yaml is a link to the
# top-level registry.yaml (the one file anyone edits); a wheel carries the linked file's bytes.
# Resolving the link makes messages name the top-level file, so its line numbers are the ones to edit.
PACKAGED_REGISTRY = Path(str(importlib.resources.files("dispatch") / "registry.yaml")).resolve()
EXTENDABLE = ("default",)
MERGED = ("ops", "clusters")  # merged by name; every other key replaces the packaged value


def onto_packaged(data: dict[str, Any], lines: dict[Location, int], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the merged document, the RegistryDocument fields that say which parts came from the packaged
    file: `measured_dirs`, `inherited`, `inherited_from`)."""
    named = data["extends"]
    if named not in EXTENDABLE:
        raise located_error(
            path, lines.get(("extends",)), ("extends",),
            f"`extends` takes only `default` (the packaged registry, {PACKAGED_REGISTRY}), not {str(named)[:60]!r}: "
            "a registry names no other file",
        )
    text = read_bounded(PACKAGED_REGISTRY).decode("utf-8")
    base, base_lines = safe_load_with_lines(text, str(PACKAGED_REGISTRY))
    if "extends" in base:
        raise located_error(str(PACKAGED_REGISTRY), None, ("extends",), "the packaged registry cannot extend another")
    merged = dict(base)
    inherited: list[Location] = [(key,) for key in base if key not in data]
    for key, value in data.items():
        if key in MERGED and isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = {**base[key], **value}
            inherited += [(key, name) for name in base[key] if name not in value]
        else:
            merged[key] = value
    packaged_dir = PACKAGED_REGISTRY.parent
    if ("clusters",) in inherited:
        dirs = {name: packaged_dir for name in base.get("clusters") or {}}
    else:
        dirs = {location[1]: packaged_dir for location in inherited if location[:1] == ("clusters",) and len(location) == 2}
    return merged, {
        "measured_dirs": dirs,
        "inherited": tuple(inherited),
        "inherited_from": (str(PACKAGED_REGISTRY), base_lines),
    }
