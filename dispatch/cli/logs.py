"""Showing dispatch's own log records on stderr: the CLI's `-v`, DISPATCH_TRACE=1, and the examples.

A library leaves handlers to its application, so `import dispatch` configures nothing; an engine that
wants the decision log attaches its own handler to the `dispatch` logger (or calls show_logs).
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER = "dispatch"


class _StderrHandler(logging.StreamHandler):
    """Marks the handler show_logs installed, so a second call adjusts it instead of adding another."""

    def __init__(self) -> None:
        super().__init__()  # the stream is looked up on each record: tests and pipes swap sys.stderr

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def show_logs(verbosity: int = 1) -> None:
    """Print the `dispatch` logger's records on stderr: 0 warnings only, 1 decisions (INFO), 2 debug.
    DISPATCH_TRACE=1 raises 0 to 1, since the trace is logged at INFO."""
    if verbosity < 1 and os.environ.get("DISPATCH_TRACE") == "1":
        verbosity = 1
    logger = logging.getLogger(LOGGER)
    logger.setLevel({0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG))
    if not any(isinstance(handler, _StderrHandler) for handler in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
