"""Reading registry.yaml: safe YAML, every node's line remembered, errors that name file, line and key."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dispatch.errors import RegistryError
from dispatch.registry.models import Registry

Location = tuple  # a path into the document: ("ops", "paged_mqa_logits", "rules", 0, "use")


@dataclass(frozen=True)
class RegistryDocument:
    """A validated registry with where each of its parts came from."""

    registry: Registry
    path: str
    lines: dict[Location, int] = field(repr=False)

    @property
    def fingerprint(self) -> str:
        """Hash of the validated content (not the text): equal for files that mean the same."""
        canonical = json.dumps(self.registry.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def line_of(self, location: Location) -> int | None:
        """The line of the deepest part of `location` that the file has."""
        return _deepest_line(self.lines, location)

    def error(self, location: Location, message: str) -> RegistryError:
        return located_error(self.path, self.line_of(location), location, message)


def located_error(path: str, line: int | None, location: Location, message: str) -> RegistryError:
    where = f"{path}:{line}" if line else path
    key = dotted(location)
    return RegistryError(f"{where}: {key}: {message}" if key else f"{where}: {message}")


def dotted(location: Location) -> str:
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def load_registry(path: str | Path) -> RegistryDocument:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise RegistryError(f"{path}: cannot read the registry: {error.strerror or error}") from None
    return parse_registry(text, str(path))


def parse_registry(text: str, path: str = "<registry>") -> RegistryDocument:
    data, lines = _safe_load_with_lines(text, path)
    try:
        registry = Registry.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        location = tuple(part for part in first["loc"] if not _is_validator_tag(part))
        line = _deepest_line(lines, location)
        raise located_error(path, line, location, _message(first)) from None
    return RegistryDocument(registry=registry, path=path, lines=lines)


def _is_validator_tag(part: Any) -> bool:
    # pydantic adds the union member or a "[key]" marker to some locations; they are not document keys.
    return isinstance(part, str) and (part in ("[key]",) or part.startswith(("function-", "lax-", "tagged-")))


def _deepest_line(lines: dict[Location, int], location: Location) -> int | None:
    for end in range(len(location), -1, -1):
        if tuple(location[:end]) in lines:
            return lines[tuple(location[:end])]
    return None


def _message(error: dict[str, Any]) -> str:
    message = error["msg"]
    message = message.removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return "unknown field (not part of the registry schema; see `python -m dispatch schema`)"
    if error["type"] == "enum":
        return f"{error['input']!r} is not allowed: {message}"
    if error["type"] == "missing":
        return "required field is missing"
    return message


def _safe_load_with_lines(text: str, path: str) -> tuple[Any, dict[Location, int]]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise RegistryError(f"{path}: the registry is empty")
        lines: dict[Location, int] = {}
        _index_lines(node, (), lines, path)
        data = loader.construct_document(node)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise RegistryError(f"{path}{line}: not valid YAML: {getattr(error, 'problem', error)}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise RegistryError(f"{path}:1: the registry must be a mapping with `version` and `ops`")
    return data, lines


def _index_lines(node: yaml.Node, location: Location, lines: dict[Location, int], path: str) -> None:
    lines[location] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):
                raise located_error(path, line, location, "a key must be a plain name, not a list or mapping")
            key = key_node.value
            if key in seen:
                raise located_error(
                    path, line, location + (key,), f"duplicate key (first given on line {seen[key]})"
                )
            seen[key] = line
            _index_lines(value_node, location + (key,), lines, path)
            lines[location + (key,)] = line
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _index_lines(item, location + (index,), lines, path)
