"""A measured overlay refused where it is wrong: the file, the line and the key path in the message."""

from __future__ import annotations

import pytest

from dispatch.contract.errors import RegistryError
from dispatch.registry.measured import parse_measured


def line_of(text: str, fragment: str, occurrence: int = 0) -> int:
    """The 1-based line of `text` holding `fragment` for the `occurrence`-th time."""
    return [number for number, line in enumerate(text.splitlines(), 1) if fragment in line][occurrence]


def assert_refused_at(text: str, path: str, fragment: str, occurrence: int, where: str, message: str) -> None:
    """parse_measured(text, path) raises a RegistryError one of whose lines is `path:LINE: where: ...message...`,
    LINE the line of the `occurrence`-th `fragment`."""
    with pytest.raises(RegistryError) as raised:
        parse_measured(text, path)
    at = f"{path}:{line_of(text, fragment, occurrence)}: {where}: "
    assert any(line.startswith(at) and message in line for line in str(raised.value).splitlines()), str(raised.value)
