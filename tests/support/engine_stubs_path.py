"""The engine tests' stubs (tests/support/engine_stubs/<engine>: modules outside the indexer's import path,
torchvision for SGLang, xgrammar and llguidance for vLLM), importable only while that engine is imported.
One folder per engine: SGLang treats a missing xgrammar as optional, and would build pydantic models
over vLLM's placeholder classes if it found them.

On leaving, the stub modules are dropped from sys.modules as well as their folder from sys.path: the
engine imported keeps its references, and the other engine, imported later in the same process, finds
those modules missing, as it would without the stubs."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

STUBS = Path(__file__).parent / "engine_stubs"


@contextlib.contextmanager
def engine_stubs_on_path(engine: str):
    folder = str(STUBS / engine)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", "") or "").startswith(folder):
                del sys.modules[name]
