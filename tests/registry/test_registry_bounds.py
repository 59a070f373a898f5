"""Loading a registry is bounded: only regular files, a size cap, a cap on YAML nodes with aliases
expanded (counted while composing, so an alias bomb fails at once), quoted input cut short. And what a
file must say: every op, order-bearing fields as lists, next_n within int32, reasoned about as ranges."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatch.contract.errors import RegistryError
from dispatch.contract.key import Op
from dispatch.contract.limits import MAX_MESSAGE_CHARS, MAX_REGISTRY_BYTES, MAX_REGISTRY_NODES, MAX_RULE_NEXT_N
from dispatch.registry.checks import coverage, lint
from dispatch.registry.document import load_registry, parse_registry
from tests.support.fakes import catalog_of, fake_backend
from tests.support.shipped import shipped_registry_text

OPS = "  indexer_q_quant: {fallback: [torch.reference]}\n  topk: {fallback: [torch.reference]}\n  ragged_mqa_logits: {fallback: [torch.reference]}\n"


def error_of(text: str, path: str = "r.yaml") -> str:
    with pytest.raises(RegistryError) as error:
        parse_registry(text, path)
    return str(error.value)


def load_in_a_child(path: str) -> subprocess.CompletedProcess:
    """load_registry(path) in a child with 1 GiB of address space and 20 s: reading /dev/zero without a
    bound, or blocking on a FIFO, fails this test instead of the machine."""
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from dispatch.contract.errors import RegistryError\n"
        "from dispatch.registry.document import load_registry\n"
        "try:\n"
        "    load_registry(sys.argv[1])\n"
        "except RegistryError as error:\n"
        "    print(error)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, path], capture_output=True, text=True, timeout=20, cwd=os.getcwd()
    )


# --- only regular files, only so many bytes ------------------------------------------------------


def test_dev_zero_is_refused_without_reading_it():
    done = load_in_a_child("/dev/zero")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("/dev/zero: cannot read the registry: not a regular file")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "registry.fifo"
    os.mkfifo(fifo)
    try:
        done = load_in_a_child(str(fifo))
    except subprocess.TimeoutExpired:
        pytest.fail("loading a FIFO blocked")
    assert done.stdout.startswith(f"{fifo}: cannot read the registry: not a regular file"), done.stderr[-2000:]


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(RegistryError, match="cannot read the registry"):
        load_registry(tmp_path)


def test_a_file_past_the_size_cap_is_refused_before_parsing(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * (MAX_REGISTRY_BYTES // 10 + 1))
    started = time.perf_counter()
    with pytest.raises(RegistryError, match=rf"the limit is {MAX_REGISTRY_BYTES}"):
        load_registry(path)
    assert time.perf_counter() - started < 0.5
    with pytest.raises(RegistryError, match="the limit is"):
        parse_registry(path.read_text(), str(path))


def test_a_file_at_the_cap_still_loads(tmp_path):
    shipped = _shipped()
    text = shipped + "#" * (MAX_REGISTRY_BYTES - len(shipped.encode()) - 1) + "\n"
    path = tmp_path / "full.yaml"
    path.write_text(text)
    assert len(path.read_bytes()) == MAX_REGISTRY_BYTES
    assert load_registry(path).registry.version == 1


def _shipped() -> str:
    from dispatch.deciding.runtime import DEFAULT_REGISTRY

    return shipped_registry_text()


# --- aliases and node counts -----------------------------------------------------------------------


def bomb(levels: int, width: int) -> str:
    """A billion laughs inside when.arch: level k holds `width` aliases of level k-1."""
    inner = "&a0 [" + ", ".join(["sm90"] * width) + "]"
    for level in range(1, levels):
        inner = f"&a{level} [" + ", ".join([inner] + [f"*a{level - 1}"] * (width - 1)) + "]"
    return (
        "version: 1\nops:\n  paged_mqa_logits:\n    rules:\n      - id: bomb\n        when:\n"
        f"          arch: {inner}\n        use: [triton]\n" + OPS
    )


def test_a_billion_laughs_in_when_arch_fails_fast_at_its_line():
    text = bomb(levels=10, width=10)
    assert len(text) < 1000
    started = time.perf_counter()
    message = error_of(text, "bomb.yaml")
    assert time.perf_counter() - started < 0.5
    assert message.startswith("bomb.yaml:7: not valid YAML: ")
    assert f"more than {MAX_REGISTRY_NODES} YAML nodes with aliases expanded" in message


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(widths=st.lists(st.integers(1, 12), min_size=1, max_size=8), reuse=st.integers(0, 3))
def test_random_alias_structures_load_or_fail_fast_with_a_located_error(widths, reuse):
    """Each level is a list holding the previous level `widths[k]` times (anchor then aliases), placed
    in when.arch and, with `reuse`, aliased again elsewhere. Whatever the shape: a RegistryError with
    file and line, in well under a second; the node cap is the reason exactly when the expansion is big."""
    inner, expanded = "&l0 [sm90]", 2
    for level, width in enumerate(widths[1:], start=1):
        inner = f"&l{level} [" + ", ".join([inner] + [f"*l{level - 1}"] * (width - 1)) + "]"
        expanded = 1 + width * expanded
    last = f"*l{len(widths) - 1}"
    extra = "".join(f"      - id: again{i}\n        when: {{arch: {last}}}\n        use: [triton]\n" for i in range(reuse))
    text = (
        "version: 1\nops:\n  paged_mqa_logits:\n    rules:\n      - id: shaped\n        when:\n"
        f"          arch: {inner}\n        use: [triton]\n" + extra + OPS
    )
    started = time.perf_counter()
    try:
        parse_registry(text, "shaped.yaml")
        loaded = True
    except RegistryError as error:
        loaded, message = False, str(error)
    assert time.perf_counter() - started < 1.0
    total = expanded * (1 + reuse) + 40  # the rest of the document is a few dozen nodes
    if loaded:
        assert len(widths) == 1  # only a flat [sm90] is a valid arch list
        return
    assert message.startswith("shaped.yaml:"), message
    assert len(message) < MAX_MESSAGE_CHARS * 60
    if expanded * (1 + reuse) > MAX_REGISTRY_NODES:
        assert "YAML nodes with aliases expanded" in message
    elif total < MAX_REGISTRY_NODES:
        assert "YAML nodes" not in message


def test_many_plain_nodes_are_refused_at_the_cap():
    names = ", ".join(["sm90"] * (MAX_REGISTRY_NODES + 1))
    message = error_of(f"version: 1\nops:\n  paged_mqa_logits:\n    rules:\n      - id: a\n        when: {{arch: [{names}]}}\n")
    assert message.startswith("r.yaml:6: not valid YAML: more than")


# --- messages stay short -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [
        "version: 1\nops:\n  paged_mqa_logits:\n    rules:\n      - id: a\n        when: {{arch: {value}}}\n        use: [triton]\n",
        "version: 1\nops:\n  paged_mqa_logits:\n    rules:\n      - id: a\n        when: {{forward_mode: [decode, {value}]}}\n        use: [triton]\n",
        "version: !!int '{value}'\nops:\n  paged_mqa_logits: {{fallback: [a]}}\n",
    ],
    ids=["arch", "forward-mode", "yaml-tag"],
)
def test_error_messages_cut_quoted_input(template):
    value = "x" * 100_000
    message = error_of(template.format(value=value) + OPS)
    assert "100002 characters" in message or "100000 characters" in message, message[:300]
    assert all(len(line) <= MAX_MESSAGE_CHARS + 80 for line in message.splitlines())


def test_errors_past_the_listing_cap_are_counted_not_listed():
    rules = "".join(f"      - id: r{i}\n        when: {{arch: sm7{i}}}\n        use: [a]\n" for i in range(80))
    message = error_of("version: 1\nops:\n  paged_mqa_logits:\n    rules:\n" + rules + OPS)
    lines = message.splitlines()
    assert len(lines) == 51 and lines[-1] == "r.yaml: ... and 30 more errors"


# --- what a registry must say -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, words",
    [
        ("version: 1\nops: {}\n", "r.yaml:2: ops: missing paged_mqa_logits, indexer_q_quant"),
        ("version: 1\nops:\n  paged_mqa_logits: {fallback: [a]}\n", "r.yaml:2: ops: missing indexer_q_quant"),
        ("version: 1\nops:\n  paged_mqa_logits: {}\n" + OPS, "r.yaml:3: ops.paged_mqa_logits: serves no key"),
        ("version: 1\nops:\n  paged_mqa_logits: {rules: [], fallback: []}\n" + OPS, "r.yaml:3: ops.paged_mqa_logits: serves no key"),
    ],
    ids=["no-ops", "missing-op", "empty-op", "empty-lists"],
)
def test_every_op_is_declared_and_serves_something(text, words):
    assert error_of(text).startswith(words)


@pytest.mark.parametrize(
    "field_text, line, key",
    [
        ("    fallback: !!set {triton, torch.reference}\n", 4, "ops.paged_mqa_logits.fallback"),
        ("    fallback: {triton: 1, torch.reference: 2}\n", 4, "ops.paged_mqa_logits.fallback"),
        ("    rules:\n      - id: a\n        use: !!set {triton, torch.reference}\n", 6, "ops.paged_mqa_logits.rules[0].use"),
        ("    fallback: [a]\nclusters:\n  c:\n    prefer: !!set {triton, torch.reference}\n", 10, "clusters.c.prefer"),
        ("    fallback: [a]\nclusters:\n  c:\n    disable: !!set {triton}\n", 10, "clusters.c.disable"),
        ("    fallback: [a]\nclusters:\n  c:\n    enable: {triton: null}\n", 10, "clusters.c.enable"),
        ("    fallback: [a]\ndisabled: !!set {triton}\n", 8, "disabled"),
    ],
    ids=["set-fallback", "map-fallback", "set-use", "set-prefer", "set-disable", "map-enable", "set-disabled"],
)
def test_order_bearing_fields_must_be_lists(field_text, line, key):
    text = "version: 1\nops:\n  paged_mqa_logits:\n" + field_text
    text = text.replace("clusters:", OPS + "clusters:").replace("disabled:", OPS + "disabled:")
    if OPS not in text:
        text += OPS
    message = error_of(text)
    assert message.startswith(f"r.yaml:{line}: {key}: must be a YAML list"), message


def test_next_n_past_int32_is_refused_with_a_clear_message():
    text = (
        "version: 1\nops:\n  paged_mqa_logits:\n    rules:\n      - id: a\n"
        f"        when: {{next_n: {{min: {10**29}}}}}\n        use: [a]\n" + OPS
    )
    message = error_of(text)
    assert message.startswith("r.yaml:6: ops.paged_mqa_logits.rules[0].when.next_n.min: ")
    assert f"less than or equal to {MAX_RULE_NEXT_N}" in message


@pytest.mark.parametrize("low", [1_000_000, MAX_RULE_NEXT_N])
def test_lint_reasons_about_next_n_ranges_without_enumerating(low):
    text = textwrap.dedent(
        f"""\
        version: 1
        ops:
          paged_mqa_logits:
            rules:
              - id: deep
                when: {{forward_mode: target_verify, next_n: {{min: {low}}}}}
                use: [b]
              - id: exactly
                when: {{forward_mode: target_verify, next_n: {low}}}
                use: [b]
            fallback: [a]
          indexer_q_quant: {{fallback: [q]}}
          topk: {{fallback: [q]}}
          ragged_mqa_logits: {{fallback: [q]}}
        """
    )
    catalog = catalog_of(
        fake_backend("a"), fake_backend("b", next_n_max=8), fake_backend("q", Op.INDEXER_Q_QUANT), fake_backend("q", Op.TOPK), fake_backend("q", Op.RAGGED_MQA_LOGITS)
    )
    document = parse_registry(text, "deep.yaml")
    started = time.perf_counter()
    found = lint(document, catalog) + coverage(document, catalog)
    assert time.perf_counter() - started < 0.5
    messages = [f.message for f in found]
    assert any("`exactly` can never fire" in m for m in messages)
    assert any("backend `b` supports none of the keys rule `deep` matches" in m and f"next_n {low}" in m for m in messages)
