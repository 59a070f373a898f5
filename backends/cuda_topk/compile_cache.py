"""A compiled library in a per-user cache, built so that no process ever loads half of one and none
waits forever: each build runs in a folder of its own and its library is moved into place with one
atomic rename; a build the compiler refused leaves a failure marker beside it (so later processes
decide without the backend instead of compiling again); a process killed mid-build leaves only its
own folder, which the next build removes.

Processes that start together take turns through a lock file: one builds, the others wait for its
library, at most `wait_s` seconds, and then build beside it (the first rename wins; both libraries are
the same build). A lock whose owner has died on this host is taken over at once."""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

FAILURE_LIMIT = 2000  # characters of a failed build kept in its marker


class CompileFailed(Exception):
    """The build tooling ran and reported a failure: the marker keeps it, so it is not retried per process."""


class CachedFailure(CompileFailed):
    """An earlier process's build failed for this key; the marker says why."""


@dataclass(frozen=True)
class BuildSlot:
    """Where one key's build lives: directory/<name>.so, directory/failed.txt, directory/building.lock."""

    directory: Path
    name: str

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"

    @property
    def failure(self) -> Path:
        return self.directory / "failed.txt"

    @property
    def lock(self) -> Path:
        return self.directory / "building.lock"


def cached_failure(slot: BuildSlot) -> str | None:
    """What an earlier failed build of this key said, or None when none failed (or its library exists)."""
    if slot.library.is_file():
        return None
    try:
        return slot.failure.read_text(errors="replace")[:FAILURE_LIMIT] or "(no message)"
    except FileNotFoundError:
        return None


def forget_failure(slot: BuildSlot) -> None:
    """Drop the marker, so the next build tries again (`python -m dispatch backends --warm`)."""
    slot.failure.unlink(missing_ok=True)


def built_library(slot: BuildSlot, build: Callable[[Path], Path], *, wait_s: float, poll_s: float = 0.5,
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> Path:
    """The library of `slot`, built by `build(folder) -> path of the library inside folder` if no process
    has built it yet. Raises CachedFailure where a marker says the build failed, CompileFailed where this
    build fails (and writes the marker); any other error of `build` (a timeout, a signal) writes none."""
    slot.directory.mkdir(parents=True, exist_ok=True)
    deadline = clock() + wait_s
    while True:
        if slot.library.is_file():
            return slot.library
        failure = cached_failure(slot)
        if failure is not None:
            raise CachedFailure(f"{failure} (cached in {slot.failure})")
        if _take_lock(slot.lock):
            try:
                return _build_into_place(slot, build)
            finally:
                slot.lock.unlink(missing_ok=True)
        if _owner_is_dead(slot.lock):
            slot.lock.unlink(missing_ok=True)  # its owner was killed mid-build: take over now
            continue
        if clock() >= deadline:
            return _build_into_place(slot, build)  # waited long enough: build beside it, without the lock
        sleep(poll_s)


def _build_into_place(slot: BuildSlot, build: Callable[[Path], Path]) -> Path:
    _remove_dead_builds(slot.directory)
    folder = slot.directory / f".build-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    try:
        try:
            built = build(folder)
        except CompileFailed as failure:
            _write_atomically(slot.failure, str(failure)[:FAILURE_LIMIT])
            raise
        os.replace(built, slot.library)  # atomic: a reader sees no library or a whole one
        return slot.library
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    partial.write_text(text)
    os.replace(partial, path)


def _take_lock(lock: Path) -> bool:
    try:
        handle = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(handle, "w") as out:
        out.write(f"{socket.gethostname()} {os.getpid()}\n")
    return True


def _owner_is_dead(lock: Path) -> bool:
    """True where the lock names a process of this host that no longer runs (another host's: never
    judged; the bounded wait covers it)."""
    try:
        host, pid = lock.read_text().split()
    except (FileNotFoundError, ValueError):
        return False  # gone already, or being written this instant
    return host == socket.gethostname() and pid.isdigit() and not _alive(int(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process with that id
    return True


def _remove_dead_builds(directory: Path) -> None:
    """Folders left by builds of this host whose process has died (a build killed mid-way)."""
    prefix = f".build-{socket.gethostname()}-"
    for folder in directory.glob(f"{prefix}*"):
        pid = folder.name[len(prefix):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
