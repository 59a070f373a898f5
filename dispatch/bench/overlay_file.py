"""Writing a measured overlay so a reader never sees half of one: tune checks the path before it measures
(a directory, a device such as /dev/full, a name the filesystem refuses: refused in a second, not after
minutes of timing), writes a temporary file beside it, flushes it to disk and renames it over the old one.
A reader then sees the old overlay or the new one, and the new one ends with END_MARKER."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dispatch.contract.errors import OptionError


def check_writable(path: str | os.PathLike) -> Path:
    """Raise OptionError unless an overlay can be written at `path` (creating its folder if needed)."""
    target = Path(path)
    try:
        if target.exists() and not target.is_file():
            raise OptionError(f"-o {_shown(target)}: not a regular file (a directory or a device); tune writes an overlay file")
        target.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name[:64]}.", suffix=".tmp", delete=True)
        probe.close()
    except OSError as error:
        raise OptionError(f"-o {_shown(target)}: cannot write there: {error.strerror or error}") from None
    return target


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write `text` to a temporary file beside `path`, flush it to disk, then rename it over `path`."""
    target = check_writable(path)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:64]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        raise OptionError(f"-o {_shown(target)}: writing failed: {error.strerror or error}") from None


def _shown(path: Path) -> str:
    text = str(path)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"
