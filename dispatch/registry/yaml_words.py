"""PyYAML's syntax errors said in words a registry's author can act on, with the line they point at.
PyYAML reports what its parser expected ("expected <block end>, but found '<block mapping start>'");
an author needs to hear that a line is indented unlike its siblings."""

from __future__ import annotations

import yaml

from dispatch.contract.limits import cut

# (what PyYAML's problem text starts with, what it means in a registry)
_WORDS = (
    ("mapping values are not allowed here",
     "a `key:` where no key can start: this line is indented deeper than the keys beside it, or a "
     "value holds an unquoted `: ` (quote the value)"),
    ("expected <block end>, but found '<block mapping start>'",
     "this line is indented less than the keys before it but more than their parent: keys of one "
     "mapping line up, each nested level indented further"),
    ("expected <block end>, but found '?'",
     "a `key:` inside a list, or a line indented unlike its siblings: list items start with `- ` at one "
     "indentation, and a mapping's keys line up"),
    ("expected <block end>, but found '-'",
     "a list item (`- `) where a key was expected: indent the list under its key"),
    ("found character '\\t' that cannot start any token",
     "a tab character: YAML indents with spaces only"),
    ("could not find expected ':'",
     "a key without its `:` (or a plain value running over several lines): write `key: value`"),
    ("found unexpected end of stream",
     "the file ends inside a quoted value: a closing quote is missing"),
    ("expected ',' or ']'",
     "a [list] not closed with `]` before the next item or line"),
    ("expected ',' or '}'",
     "a {mapping} not closed with `}` before the next key or line"),
    ("found duplicate anchor", "an anchor (`&name`) defined twice"),
    ("found undefined alias", "an alias (`*name`) with no anchor (`&name`) before it"),
)


# Problems found past where the list, mapping or quoted value they are about began (PyYAML's context mark).
_OPENED_EARLIER = ("expected ',' or ']'", "expected ',' or '}'", "found unexpected end of stream")


def in_words(error: yaml.YAMLError, text: str) -> tuple[int | None, str]:
    """(line, message) for a YAML error: the meaning where it is a common mistake, PyYAML's own
    words otherwise, and the offending line's text so the author sees what is meant."""
    mark = getattr(error, "problem_mark", None)
    problem = str(getattr(error, "problem", None) or error)
    meaning = next((words for start, words in _WORDS if problem.startswith(start)), None)
    message = f"{meaning} (PyYAML: {problem})" if meaning else problem
    opened = getattr(error, "context_mark", None)
    if problem.startswith(_OPENED_EARLIER) and opened is not None and mark is not None and opened.line != mark.line:
        message += f"; it opens on line {opened.line + 1}"
    if mark is None:
        return None, message
    lines = text.splitlines()
    if mark.line < len(lines) and lines[mark.line].strip():
        message += f"\n    {mark.line + 1} | {cut(lines[mark.line].rstrip())}"
    return mark.line + 1, message
