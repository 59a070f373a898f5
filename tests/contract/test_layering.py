"""The wings of dispatch/ import only downwards and never in a cycle; plugins import only the contract.

Read from the source with `ast` (tests/support/source_imports.py), lazy imports inside functions and
type-only imports included: a wing that reaches up, even lazily, is a wing a reader cannot read alone."""

from __future__ import annotations

import pytest

from tests.support.source_imports import ROOT, imported_modules, imports_of, modules_under, python_files

# Bottom to top. A module may import its own wing and the wings below it. dispatch/__init__.py is the
# front door (it re-exports from every library wing) and __main__ runs the CLI.
WINGS = (
    "dispatch.contract",
    "dispatch.registry",
    "dispatch.deciding",
    "dispatch.step",
    "dispatch.engines",
    "dispatch",  # the front door: dispatch/__init__.py
    "dispatch.bench",
    "dispatch.cli",
    "dispatch.__main__",
)
MODULES = modules_under("dispatch")
# The contract defines everything a backend reads, the plan types included (dispatch/contract/plan.py,
# extend_batch.py, extend_plan.py): nothing reaches up, and nothing may be added here.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def wing_of(module: str) -> int:
    best = max((wing for wing in WINGS if module == wing or module.startswith(wing + ".")), key=len)
    return WINGS.index(best)


def project_edges() -> dict[str, set[str]]:
    """module -> the project modules it imports, less its own ancestor packages (a package's
    __init__ running before its submodule is how Python imports, not a dependency)."""
    edges = {}
    for module, path in MODULES.items():
        ancestors = {module.rsplit(".", n)[0] for n in range(1, module.count(".") + 1)}
        targets = set()
        for found in imports_of(path):
            targets |= imported_modules(found, MODULES)
        edges[module] = targets - ancestors - {module}
    return edges


def test_every_module_of_dispatch_is_in_a_wing():
    flat = [m for m, p in MODULES.items() if m.count(".") == 1 and p.name != "__init__.py" and m != "dispatch.__main__"]
    assert flat == [], f"modules outside every wing (put each in the wing it belongs to): {flat}"


def test_no_wing_imports_a_wing_above_it():
    upward = [
        f"{MODULES[module].relative_to(ROOT)} ({WINGS[wing_of(module)]}) imports {target} ({WINGS[wing_of(target)]})"
        for module, targets in project_edges().items()
        for target in sorted(targets)
        if wing_of(target) > wing_of(module) and (module, target) not in KNOWN_UPWARD
    ]
    assert upward == []


def test_the_contract_names_no_module_above_it():
    # Its lazy names (dispatch/contract/__init__.py's _LAZY) are strings, not imports: read them too.
    import dispatch.contract as contract

    above = {name: module for name, module in contract._LAZY.items() if not module.startswith("dispatch.contract")}
    assert above == {}


def test_the_library_imports_no_plugin():
    # The plugin host (dispatch/contract/host.py) loads the built-in plugins by name, allowlisted, as it
    # loads any other; nothing else of dispatch/ imports a module of backends/: a plugin may be absent,
    # disabled or shadowed, and the library must not depend on one.
    into_plugins = [f"{i.where()}: {i.module}" for module, path in MODULES.items() if module != "dispatch.contract.host"
                    for i in imports_of(path) if i.module.split(".")[0] == "backends"]
    assert into_plugins == []


def test_no_import_cycle():
    edges = project_edges()
    state: dict[str, int] = {}  # 1 on the path, 2 done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_only_the_cli_runs_the_bench():
    # The bench times kernels on the device; the library (explain included) must load without it.
    outside = [
        f"{MODULES[module].relative_to(ROOT)} imports {target}"
        for module, targets in project_edges().items()
        if not (module.startswith("dispatch.bench") or module == "dispatch.cli.commands")
        for target in targets
        if target.startswith("dispatch.bench")
    ]
    assert outside == []


PLUGIN_FILES = python_files("backends") + python_files("examples/acme-dispatch-plugin")
ENGINE_FILES = [ROOT / "examples" / "engine_loop.py"]


@pytest.mark.parametrize("path", PLUGIN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_plugin_imports_only_the_contract(path):
    wrong = [f"{i.where()}: {i.module}" for i in imports_of(path)
             if i.module.split(".")[0] == "dispatch" and i.module != "dispatch.contract"]
    assert wrong == [], "a backend imports dispatch.contract alone (README, docs/plugins.md)"


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_an_engine_imports_only_the_front_door(path):
    wrong = [f"{i.where()}: {i.module}" for i in imports_of(path) if i.module.split(".")[0] == "dispatch" and i.module != "dispatch"]
    assert wrong == [], "an engine imports `from dispatch import ...` alone (docs/engine.md)"


def test_the_boundary_tests_see_every_example():
    examples = {p for p in python_files("examples")}
    assert examples == set(PLUGIN_FILES) - set(python_files("backends")) | set(ENGINE_FILES)
