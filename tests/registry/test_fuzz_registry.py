"""Fuzzing registry.yaml: whatever the file holds, loading it gives a RegistryDocument or a RegistryError
naming the file (and, for a problem inside the document, its line), never another exception. A document
that loads and names only registered backends then decides a spread of keys under every cluster it declares."""

from __future__ import annotations

import re

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatch.contract.catalog import Catalog
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.errors import NoBackendError, RegistryError
from dispatch.contract.key import Arch, DispatchKey, ForwardMode, Fp8Dtype, Op
from dispatch.contract.host import collect_backends
from dispatch.registry.checks import check_backend_names
from dispatch.registry.document import load_registry, parse_registry
from dispatch.deciding.runtime import DEFAULT_REGISTRY, load_plugins
from tests.support.shipped import shipped_registry_text

PATH = "fuzzed/registry.yaml"
PROJECT_LINES = shipped_registry_text().splitlines(keepends=True)
CATALOG: Catalog = collect_backends(load_plugins(frozenset()))
KEYS = [
    DispatchKey(Arch.SM90, ForwardMode.TARGET_VERIFY, 3, Fp8Dtype.E4M3FN),
    DispatchKey(Arch.SM100, ForwardMode.DECODE, 1, Fp8Dtype.E4M3FN),
    DispatchKey(Arch.GFX942, ForwardMode.DRAFT_EXTEND, 2, Fp8Dtype.E4M3FNUZ),
    DispatchKey(Arch.CPU, ForwardMode.EXTEND, 9, Fp8Dtype.E4M3FNUZ),
    DispatchKey(Arch.SM120, ForwardMode.IDLE, 1, Fp8Dtype.E4M3FN),
]
# YAML breaks lines at these, so a mark's line can count them.
YAML_LINE_BREAK = re.compile("\r\n|[\n\r\x85\u2028\u2029]")


def assert_located(error: RegistryError, text: str, path: str = PATH) -> None:
    """The message names the file, and a line of it unless the document is empty."""
    message = str(error)
    if _is_empty(text):
        assert message == f"{path}: the registry is empty", message
        return
    located = re.match(rf"{re.escape(path)}:(\d+): ", message)
    assert located, f"no file:line in: {message}"
    assert 1 <= int(located.group(1)) <= len(YAML_LINE_BREAK.findall(text)) + 1, message


def _is_empty(text: str) -> bool:
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader) is None
    except yaml.YAMLError:
        return False


def assert_loads_or_located(text: str) -> None:
    """The property every fuzzed text must have; a document that loads is also checked and used."""
    try:
        document = parse_registry(text, PATH)
    except RegistryError as error:
        assert_located(error, text)
        return
    assert document.path == PATH and len(document.fingerprint) == 16
    try:
        check_backend_names(document, CATALOG)
    except RegistryError as error:
        assert_located(error, text)
        assert "unknown backend `" in str(error)
        return
    for cluster in [None, *document.registry.clusters]:
        dispatcher = Dispatcher(document, CATALOG, cluster=cluster, target_arch=Arch.CPU, check_availability=False)
        for key in KEYS:
            for op in Op:
                try:
                    decision = dispatcher.decide(op, key)
                except NoBackendError:
                    continue
                assert decision.impl.supports.why_not(key) is None
                assert decision.registry_fingerprint == document.fingerprint


# --- arbitrary text --------------------------------------------------------------------------------

YAMLISH = st.text(alphabet=st.sampled_from(list("ab1:-_[]{},&*!|>?'\"#% \n\t.")), max_size=60)


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=80), YAMLISH))
def test_arbitrary_text(text):
    assert_loads_or_located(text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=60), st.text(max_size=40).map(lambda t: t.encode("utf-16"))))
def test_arbitrary_bytes_in_a_file(tmp_path, raw):
    path = tmp_path / "registry.yaml"
    path.write_bytes(raw)
    try:
        load_registry(path)
    except RegistryError as error:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            assert re.match(rf"{re.escape(str(path))}:\d+: not UTF-8 text: byte 0x", str(error)), str(error)
        else:
            assert_located(error, text, str(path))


# --- the project's registry, mutated -----------------------------------------------------------------

VOCAB = sorted(
    {*CATALOG.names(), *(a.value for a in Arch), *(m.value for m in ForwardMode), *(d.value for d in Fp8Dtype)}
    | {"paged_mqa_logits", "indexer_q_quant", "zz", "0", "1", "65", "-1", "null", "true", "", "[", "]", "{", "}"}
    | {":", "- ", "&a", "*a", "!!int x", "!!python/name:os.system", "# note"}
)
KEY_NAMES = ["version", "ops", "rules", "id", "when", "use", "why", "fallback", "clusters", "disabled",
             "arch", "forward_mode", "next_n", "fp8_dtype", "min", "max", "match", "prefer", "enable",
             "disable", "description", "colour", "Rules"]  # fmt: skip
WORD = re.compile(r"[A-Za-z0-9_.\-]+")
KEY = re.compile(r"^(\s*(?:-\s+)?)([A-Za-z_]+):")


@st.composite
def mutated_registry(draw) -> str:
    lines = list(PROJECT_LINES)
    for _ in range(draw(st.integers(1, 4))):
        if not lines:
            break
        at = draw(st.integers(0, len(lines) - 1))
        kind = draw(st.sampled_from(["delete", "duplicate", "swap", "rename-key", "swap-value", "indent", "insert"]))
        line = lines[at]
        if kind == "delete":
            del lines[at]
        elif kind == "duplicate":
            lines.insert(at, line)
        elif kind == "swap":
            other = draw(st.integers(0, len(lines) - 1))
            lines[at], lines[other] = lines[other], line
        elif kind == "rename-key" and KEY.match(line):
            lines[at] = KEY.sub(lambda m: f"{m.group(1)}{draw(st.sampled_from(KEY_NAMES))}:", line, count=1)
        elif kind == "swap-value" and WORD.search(line):
            words = list(WORD.finditer(line))
            word = words[draw(st.integers(0, len(words) - 1))]
            lines[at] = line[: word.start()] + draw(st.sampled_from(VOCAB)) + line[word.end() :]
        elif kind == "indent":
            lines[at] = " " * draw(st.integers(0, 6)) + line.lstrip(" ")
        elif kind == "insert":
            lines.insert(at, draw(st.one_of(st.sampled_from(VOCAB), st.text(max_size=20))) + "\n")
    return "".join(lines)


@settings(max_examples=200, deadline=None)
@given(mutated_registry())
def test_mutated_project_registry(text):
    assert_loads_or_located(text)


def test_the_unmutated_project_registry_loads():
    document = parse_registry("".join(PROJECT_LINES), PATH)
    check_backend_names(document, CATALOG)


# --- structured documents ----------------------------------------------------------------------------

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2, 70), st.floats(), st.text(max_size=6))


def mostly(valid, *others):
    """`valid` nine times in ten, so that documents often get past the first check to the later ones."""
    return st.integers(0, 9).flatmap(lambda n: valid if n else st.one_of(*others))


def one_or_many(element):
    return st.one_of(element, st.lists(element, max_size=3))


NAMES = mostly(st.sampled_from(CATALOG.names()), st.sampled_from(["zz", "Not A Name", ""]), JUNK)
ARCHS = mostly(st.sampled_from([a.value for a in Arch]), st.just("sm77"), JUNK)
MODES = mostly(st.sampled_from([m.value for m in ForwardMode]), st.just("prefill"), JUNK)
DTYPES = mostly(st.sampled_from([d.value for d in Fp8Dtype]), st.just("e5m2"), JUNK)
NEXT_N = st.one_of(
    st.integers(-1, 70),
    st.fixed_dictionaries({}, optional={"min": st.integers(-1, 70), "max": st.one_of(st.none(), st.integers(-1, 70))}),
    JUNK,
)
WHEN = st.fixed_dictionaries(
    {},
    optional={
        "arch": one_or_many(ARCHS),
        "forward_mode": one_or_many(MODES),
        "next_n": NEXT_N,
        "fp8_dtype": one_or_many(DTYPES),
        "colour": JUNK,
    },
)
RULE = st.fixed_dictionaries(
    {"id": mostly(st.sampled_from(["a", "b", "sm90-x"]), st.text(max_size=5)), "use": one_or_many(NAMES)},
    optional={"when": mostly(WHEN, JUNK), "why": JUNK},
)
TABLE = st.fixed_dictionaries({}, optional={"rules": st.lists(RULE, max_size=4), "fallback": one_or_many(NAMES)})
CLUSTER = st.fixed_dictionaries(
    {},
    optional={
        "description": JUNK,
        "match": st.fixed_dictionaries({}, optional={"arch": one_or_many(ARCHS), "gpu_name": JUNK, "hostname": JUNK}),
        "enable": one_or_many(NAMES),
        "disable": one_or_many(NAMES),
        "prefer": one_or_many(NAMES),
    },
)
DOCUMENT = st.fixed_dictionaries(
    {
        "version": mostly(st.just(1), JUNK),
        "ops": mostly(
            st.dictionaries(mostly(st.sampled_from([op.value for op in Op]), st.just("attention")), TABLE, max_size=2),
            JUNK,
        ),
    },
    optional={
        "disabled": one_or_many(NAMES),
        "clusters": st.dictionaries(
            mostly(st.sampled_from(["h200", "mi300"]), st.text(max_size=4)), CLUSTER, max_size=2
        ),
        "extra": JUNK,
    },
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(DOCUMENT, st.booleans())
def test_structured_documents(document, flow_style):
    assert_loads_or_located(yaml.safe_dump(document, default_flow_style=flow_style, sort_keys=False))


# --- what fuzzing found, kept as plain examples -------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        ("version: 1\nops: {}\x01\n", ":2: not valid YAML: unacceptable character #x0001"),
        ("version: !!int x\nops: {}\n", ":1: not valid YAML: 'x' is not a valid !!int"),
        ("version: 1\nops: {x: !!timestamp soon}\n", ":2: not valid YAML: 'soon' is not a valid !!timestamp"),
        ("version: !!bool maybe\n", ":1: not valid YAML: 'maybe' is not a valid !!bool"),
        # An alias inside its own anchor would expand forever: refused where the alias stands.
        ("version: 1\nops: &a [*a]\n", ":2: not valid YAML: alias *a refers to a node that contains it"),
        ("version: 1\nops: &a {paged_mqa_logits: *a}\n", ":2: not valid YAML: alias *a refers to a node that contains it"),
        ("[" * 1000, ": not valid YAML: nested too deeply"),
    ],
    ids=["control-character", "bad-int", "bad-timestamp", "bad-bool", "recursive-list", "recursive-map", "deep"],
)
def test_what_fuzzing_found(text, message):
    with pytest.raises(RegistryError) as error:
        parse_registry(text, PATH)
    assert str(error.value).startswith(PATH + message), str(error.value)


def test_a_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "registry.yaml"
    path.write_bytes(b"version: 1\nops:\n  \xff: {}\n")
    with pytest.raises(RegistryError, match=rf"^{re.escape(str(path))}:3: not UTF-8 text: byte 0xff"):
        load_registry(path)


def test_a_name_reached_through_an_alias_is_located_at_the_alias():
    text = """\
version: 1
ops:
  paged_mqa_logits: {fallback: &names [triton.flatten]}
  indexer_q_quant: {fallback: *names}
  topk: {fallback: [torch.reference]}
  ragged_mqa_logits: {fallback: [torch.reference]}
"""
    with pytest.raises(RegistryError) as error:
        check_backend_names(parse_registry(text, PATH), CATALOG)
    assert str(error.value).startswith(f"{PATH}:4: ops.indexer_q_quant.fallback[0]: unknown backend `triton.flatten`")
