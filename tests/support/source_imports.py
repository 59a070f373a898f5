"""The imports of the project's source, read with `ast` (nothing is imported): every `import` and
`from ... import` anywhere in a file, inside functions and `if TYPE_CHECKING:` too, relative ones
resolved, and, in a file that calls importlib.import_module, every string that names a module of the
project (a lazy table of names such as the front door's). What the layering and plugin-boundary tests
check."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Import:
    path: Path  # the importing file
    line: int
    module: str  # the module the statement names (`from X import y`: X; `import X.Y`: X.Y)
    names: tuple[str, ...]  # the names taken from it (`from X import a, b`), () for `import X`

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            found.append(Import(path, node.lineno, module, tuple(alias.name for alias in node.names)))
    if "import_module" in {getattr(n, "attr", getattr(n, "id", None)) for n in ast.walk(tree)}:
        found += [
            Import(path, node.lineno, node.value, ())
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value.split(".")[0] in ("dispatch", "backends") and node.value.replace(".", "").replace("_", "").isalnum()
        ]
    return found


def python_files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def modules_under(folder: str) -> dict[str, Path]:
    return {module_name(path): path for path in python_files(folder)}


def imported_modules(found: Import, known: dict[str, Path]) -> set[str]:
    """The project modules an import statement loads: `from pkg import sub` names the submodule when
    `sub` is one, else the package itself."""
    if not found.names:
        return {found.module} & set(known)
    submodules = {f"{found.module}.{name}" for name in found.names} & set(known)
    takes_attributes = any(f"{found.module}.{name}" not in known for name in found.names)
    return submodules | ({found.module} & set(known) if takes_attributes else set())
