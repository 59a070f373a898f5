"""Why `import backends` found some other `backends` than dispatch-dsa's built-in package, said so the
user can act on it: most often a folder named `backends` in the current directory, which `python -m`
(and an interactive interpreter) put first on sys.path; else another distribution's package."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

from dispatch.contract.version import DISTRIBUTION

OWN = Path(__file__).resolve().parents[2] / "backends"  # where this dispatch's built-in backends live


def shadow_message(found: ModuleType) -> str:
    places = [Path(p) for p in getattr(found, "__path__", [])] or (
        [Path(found.__file__).parent] if getattr(found, "__file__", None) else []
    )
    where = ", ".join(str(p) for p in places) or repr(found)
    cwd = Path(os.getcwd()).resolve()
    first = sys.path[0] if sys.path else None
    from_cwd = any(p.resolve().parent == cwd for p in places) and first in ("", ".", str(cwd), os.getcwd())
    if from_cwd:
        return (
            f"`import backends` found the folder {where} in the current directory, which Python puts first on "
            f"sys.path under `python -m` (and in an interactive session), not {DISTRIBUTION}'s built-in backends "
            f"package ({OWN}); run from another folder, or run the `dispatch` command, which does not put the "
            "current directory on sys.path"
        )
    if getattr(found, "__file__", None) is None:  # a plain folder (a namespace package), not an installed package
        return (
            f"`import backends` found the folder {where}, a folder named `backends` on sys.path (PYTHONPATH or the "
            f"script's folder), not {DISTRIBUTION}'s built-in backends package ({OWN}); rename that folder or take "
            "its parent off the path"
        )
    return (
        f"`backends` resolves to {where}, which is not {DISTRIBUTION}'s built-in backends package ({OWN}): "
        f"another distribution installs a top-level `backends`; uninstall it or install {DISTRIBUTION} into its "
        "own virtual environment"
    )
