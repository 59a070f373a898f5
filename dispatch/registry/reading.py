"""Reading a YAML file of the registry's kind (registry.yaml, a measured overlay, the packaged file an
`extends: default` names): bounded, safe, every node's line remembered, and errors that name file, line
and key. The registry's other modules read through it; it imports none of them."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dispatch.contract.errors import RegistryError
from dispatch.contract.limits import MAX_ERRORS_LISTED, MAX_REGISTRY_BYTES, MAX_REGISTRY_NODES, clipped, quoted

Location = tuple  # a path into the document: ("ops", "paged_mqa_logits", "rules", 0, "use")


def located_error(path: str, line: int | None, location: Location, message: str) -> RegistryError:
    return RegistryError(located(path, line, location, message))


def located(path: str, line: int | None, location: Location, message: str) -> str:
    where = f"{path}:{line}" if line else path
    key = dotted(location)
    return clipped(f"{where}: {key}: {message}" if key else f"{where}: {message}")


def errors_in_file_order(path: str, problems: list[tuple[int | None, Location, str]]) -> RegistryError:
    """One RegistryError listing every problem, one per line, in file order (unlocated ones last)."""
    texts = list(dict.fromkeys(located(path, *p) for p in sorted(problems, key=lambda p: (p[0] is None, p[0] or 0))))
    if len(texts) > MAX_ERRORS_LISTED:
        texts = texts[:MAX_ERRORS_LISTED] + [f"{path}: ... and {len(texts) - MAX_ERRORS_LISTED} more errors"]
    return RegistryError("\n".join(texts))


def dotted(location: Location) -> str:
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


# The last line of a complete file. A YAML prefix of a file is often valid YAML that means less (a
# cluster's `prefer` lost, an overlay cut before `ops:`), so completeness is said by the writer: tune
# ends every overlay with it, and the shipped registry.yaml ends with it (a human keeps it last).
END_MARKER = "# end"


def is_sealed(text: str) -> bool:
    """Whether `text`'s last non-blank line is END_MARKER."""
    lines = text.rstrip().splitlines()
    return bool(lines) and lines[-1].strip() == END_MARKER


def read_bounded(path: Path) -> bytes:
    """The file's bytes, read only from a regular file and only up to MAX_REGISTRY_BYTES: a FIFO would
    block forever and /dev/zero never ends. O_NONBLOCK lets the open of a FIFO return so fstat can see it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        raise RegistryError(f"{path}: cannot read the registry: {error.strerror or error}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RegistryError(f"{path}: cannot read the registry: not a regular file (a device, FIFO or directory)")
        if info.st_size > MAX_REGISTRY_BYTES:
            raise RegistryError(too_big(path, info.st_size))
        with os.fdopen(fd, "rb", closefd=False) as stream:
            raw = stream.read(MAX_REGISTRY_BYTES + 1)  # the file may grow between fstat and read
    except OSError as error:
        raise RegistryError(f"{path}: cannot read the registry: {error.strerror or error}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_REGISTRY_BYTES:
        raise RegistryError(too_big(path, len(raw)))
    return raw


def too_big(path: object, size: int) -> str:
    return f"{path}: the registry is {size} bytes; the limit is {MAX_REGISTRY_BYTES} (a registry is a few KB)"


def validation_problems(error: ValidationError, lines) -> list:
    """pydantic's errors as (line, location, message), the form errors_in_file_order takes."""
    problems = []
    for detail in error.errors():
        location = tuple(part for part in detail["loc"] if not _is_validator_tag(part))
        problems.append((deepest_line(lines, location), location, _message(detail)))
    return problems


def _is_validator_tag(part: Any) -> bool:
    # pydantic adds the union member or a "[key]" marker to some locations; they are not document keys.
    return isinstance(part, str) and (part in ("[key]",) or part.startswith(("function-", "lax-", "tagged-")))


def deepest_line(lines: dict[Location, int], location: Location) -> int | None:
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
        return f"{quoted(error['input'])} is not allowed: {message}"
    if error["type"] == "missing":
        return "required field is missing"
    return message


class _Loader(yaml.SafeLoader):
    """SafeLoader, but a scalar its tag cannot build (`!!int abc`, `!!timestamp x`) is a YAML error
    at that scalar's line; PyYAML lets the constructor's own exception escape instead. And the
    document is counted as it is composed: each alias as a copy of its anchor, so an alias bomb is
    refused at the alias that crosses MAX_REGISTRY_NODES, before anything expands it."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.expanded_nodes = 0
        self._sizes: dict[yaml.Node, int] = {}

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            anchored = self.anchors.get(event.anchor)
            if anchored is not None:
                if anchored not in self._sizes:  # still being composed: the alias is inside its anchor
                    raise _located_yaml_error(f"alias *{event.anchor} refers to a node that contains it", event)
                self._count(self._sizes[anchored], event)
            return super().compose_node(parent, index)
        before = self.expanded_nodes
        self._count(1, self.peek_event())
        node = super().compose_node(parent, index)
        self._sizes[node] = self.expanded_nodes - before
        return node

    def _count(self, nodes: int, event: yaml.Event) -> None:
        self.expanded_nodes += nodes
        if self.expanded_nodes > MAX_REGISTRY_NODES:
            raise _located_yaml_error(
                f"more than {MAX_REGISTRY_NODES} YAML nodes with aliases expanded (a registry has a few hundred)", event
            )

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, KeyError, AttributeError, TypeError):  # what SafeConstructor's scalar parsers raise
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            problem = f"{quoted(node.value)} is not a valid {tag}"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None


def _located_yaml_error(problem: str, event: yaml.Event) -> yaml.YAMLError:
    return yaml.composer.ComposerError(None, None, problem, event.start_mark)


def safe_load_with_lines(text: str, path: str) -> tuple[Any, dict[Location, int]]:
    try:
        loader = _Loader(text)  # the reader rejects non-printable characters here, before parsing
    except yaml.reader.ReaderError as error:
        line = text.count("\n", 0, error.position) + 1
        raise RegistryError(
            f"{path}:{line}: not valid YAML: unacceptable character #x{error.character:04x}: {error.reason}"
        ) from None
    try:
        node = loader.get_single_node()
        if node is None:
            raise RegistryError(f"{path}: the registry is empty")
        lines: dict[Location, int] = {}
        _index_lines(node, (), lines, path, set())
        data = loader.construct_document(node)
    except yaml.YAMLError as error:
        from dispatch.registry.yaml_words import in_words

        line, message = in_words(error, text)
        raise RegistryError(clipped(f"{path}{f':{line}' if line else ''}: not valid YAML: {message}")) from None
    except RecursionError:
        # PyYAML composes recursively; a registry is a few levels deep.
        raise RegistryError(f"{path}: not valid YAML: nested too deeply") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise RegistryError(f"{path}:1: the registry must be a mapping with `version` and `ops`")
    return data, lines


def _index_lines(
    node: yaml.Node, location: Location, lines: dict[Location, int], path: str, indexed: set[yaml.Node]
) -> None:
    lines[location] = node.start_mark.line + 1
    # An alias is its anchored node again. Indexing each node once keeps a recursive alias from
    # recursing forever and nested aliases from costing exponential time; parts of a node reached
    # through a later alias are then located at the alias's key.
    if node in indexed:
        return
    indexed.add(node)
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
            _index_lines(value_node, location + (key,), lines, path, indexed)
            lines[location + (key,)] = line
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _index_lines(item, location + (index,), lines, path, indexed)
