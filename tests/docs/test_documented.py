"""Meta-tests, datasette's habit: every hook, op and environment variable the code reads is documented
in the documentation (README.md and docs/, read by tests/support/documentation.py), every hook and op is exercised by a test, and every op has its whole contract (a call
convention, a torch reference, a registry table)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dispatch.contract import hookspecs
from dispatch.contract import OP_CONTRACTS
from dispatch.contract.key import Op
from dispatch.deciding.runtime import load_dispatcher
from tests.support.documentation import documentation_text

ROOT = Path(__file__).resolve().parents[2]
DOCS = documentation_text()
TESTS = {path.name: path.read_text() for path in (ROOT / "tests").rglob("test_*.py") if path.name != Path(__file__).name}
HOOKS = sorted(name for name in dir(hookspecs) if hasattr(getattr(hookspecs, name), "dispatch_spec"))
# What the code reads: os.environ.get("X"), os.environ["X"], os.getenv("X").
ENV_READ = re.compile(r"""os\.(?:environ\.get\(|environ\[|getenv\()\s*["']([A-Z][A-Z0-9_]*)["']""")


def env_vars_read() -> set[str]:
    names = set()
    for folder in ("dispatch", "backends", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(ENV_READ.findall(path.read_text()))
    return names


def test_there_are_hooks_ops_and_variables_to_check():
    assert HOOKS == ["register_backends"]
    assert {"DISPATCH_PLUGINS", "DISPATCH_REGISTRY", "TRITON_INTERPRET"} <= env_vars_read()


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented_and_tested(hook):
    assert f"`{hook}(" in DOCS, f"the documentation does not document the hook `{hook}`"
    assert any(hook in text for text in TESTS.values()), f"no test exercises the hook `{hook}`"


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.value)
def test_every_op_is_documented_and_tested(op):
    assert f"`{op.value}`" in DOCS, f"the documentation does not document the op `{op.value}`"
    assert any(f"Op.{op.name}" in text for text in TESTS.values()), f"no test names Op.{op.name}"


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.value)
def test_every_op_has_a_contract_a_reference_and_a_registry_table(op):
    assert op in OP_CONTRACTS, f"dispatch.contract.OP_CONTRACTS has no entry for {op.value}"
    dispatcher = load_dispatcher(arch="cpu")
    assert dispatcher.catalog.get(op, "torch.reference") is not None, f"no torch.reference backend for {op.value}"
    assert op in dispatcher.document.registry.ops, f"registry.yaml has no `{op.value}` table"


@pytest.mark.parametrize("name", sorted(env_vars_read()))
def test_every_environment_variable_read_is_documented(name):
    assert f"`{name}`" in DOCS, f"the code reads {name} but the documentation (README.md, docs/) does not document it"
