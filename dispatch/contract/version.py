"""This package's version, one answer for `--version`, the plugin registry and `tune`'s overlay.

Run from a source tree (a checkout, installed editable or not at all): the version in its
pyproject.toml with the checked-out commit as a PEP 440 local part, `0.1.0+g1a2b3c4d5e6f`, or
`0.1.0+source` when no commit can be read. The commit is read from the files under .git (HEAD, the
ref it names, packed-refs), never by running git: a subprocess could hang or be missing. Installed
from a wheel: the distribution's version. Neither: "source".

Only the release part (before `+`) says which code was measured in a way two machines can compare:
the local part changes with every commit, so staleness checks compare `release_of` values.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from pathlib import Path

DISTRIBUTION = "dispatch-dsa"
_ROOT = Path(__file__).resolve().parents[2]  # the source tree's root, when this is one
_MAX_READ = 64 * 1024  # .git/HEAD and a loose ref are a line; packed-refs of a large repo stay under this
_COMMIT = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")


@functools.cache
def dispatch_version() -> str:
    """This package's version (the module docstring says which); read once per process."""
    return version_at(_ROOT)


def version_at(root: Path) -> str:
    """The version of the package whose source tree would be `root` (see the module docstring)."""
    release = _source_tree_release(root)
    if release is not None:
        commit = git_commit(root)
        return f"{release}+g{commit[:12]}" if commit else f"{release}+source"
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "source"


def release_of(version: str) -> str | None:
    """The release a version names (`0.1.0` of `0.1.0+g1a2b3c`), None for one that names none
    ("source", or the "unknown" older overlays recorded)."""
    release = version.split("+", 1)[0].strip()
    return release if release and release[0].isdigit() else None


def _source_tree_release(root: Path) -> str | None:
    """The [project] version of root/pyproject.toml when it declares this distribution, else None (an
    installed package has no pyproject.toml beside it)."""
    text = _read_small(root / "pyproject.toml")
    if text is None:
        return None
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.MULTILINE | re.DOTALL)
    if project is None:
        return None
    name = re.search(r'^name\s*=\s*"([^"]+)"', project.group(1), re.MULTILINE)
    version = re.search(r'^version\s*=\s*"([^"]+)"', project.group(1), re.MULTILINE)
    if name is None or version is None or name.group(1) != DISTRIBUTION:
        return None
    return version.group(1)


def git_commit(root: Path) -> str | None:
    """The commit checked out at `root`, from .git's files alone (a worktree's `.git` file and its
    `commondir` are followed); None when it cannot be read."""
    git_dir = _git_dir(root)
    if git_dir is None:
        return None
    head = _read_small(git_dir / "HEAD")
    if head is None:
        return None
    head = head.strip()
    if not head.startswith("ref:"):
        return head if _COMMIT.fullmatch(head) else None
    ref = head[4:].strip()
    common = _common_dir(git_dir)
    for folder in dict.fromkeys((git_dir, common)):
        loose = _read_small(folder / ref)
        if loose is not None and _COMMIT.fullmatch(loose.strip()):
            return loose.strip()
    packed = _read_small(common / "packed-refs") or ""
    for line in packed.splitlines():
        commit, _, name = line.partition(" ")
        if name.strip() == ref and _COMMIT.fullmatch(commit):
            return commit
    return None


def _git_dir(root: Path) -> Path | None:
    dot_git = root / ".git"
    if dot_git.is_dir():
        return dot_git
    pointer = _read_small(dot_git)  # a worktree or submodule: "gitdir: <path>"
    if pointer is None or not pointer.startswith("gitdir:"):
        return None
    target = Path(pointer[len("gitdir:"):].strip())
    return target if target.is_absolute() else root / target


def _common_dir(git_dir: Path) -> Path:
    """Where a worktree's shared refs live (its `commondir` file), else the git dir itself."""
    common = _read_small(git_dir / "commondir")
    if common is None:
        return git_dir
    path = Path(common.strip())
    return path if path.is_absolute() else git_dir / path


def _read_small(path: Path) -> str | None:
    """The text of a regular file of at most _MAX_READ bytes, else None (never blocks on a FIFO)."""
    try:
        if not path.is_file() or path.stat().st_size > _MAX_READ:
            return None
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
