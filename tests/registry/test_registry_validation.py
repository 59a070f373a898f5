"""registry.yaml validation: every rule's message names file, line and key; safe loading; lint; schema."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import yaml

from dispatch.deciding.clusters import resolve_cluster
from dispatch.contract.errors import RegistryError
from dispatch.contract.key import Arch, ForwardMode, Op
from dispatch.registry.checks import check_backend_names, lint
from dispatch.registry.document import load_registry, parse_registry
from tests.support.fakes import catalog_of, fake_backend

HEAD = "version: 1\nops:\n  paged_mqa_logits:\n    rules:\n"
TAIL = "  indexer_q_quant: {fallback: [torch.reference]}\n  topk: {fallback: [torch.reference]}\n  ragged_mqa_logits: {fallback: [torch.reference]}\n"  # every op is declared


def write(tmp_path, text: str):
    path = tmp_path / "registry.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def load_error(tmp_path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(RegistryError) as error:
        load_registry(path)
    return str(error.value)


def assert_located(message: str, path, line: int, key: str) -> None:
    assert message.startswith(f"{path}:{line}: "), message
    assert f": {key}: " in message, message


@pytest.mark.parametrize(
    "body, line, key, words",
    [
        (
            "      - id: a\n        use: [x]\n        colour: red\n",
            7,
            "ops.paged_mqa_logits.rules[0].colour",
            "unknown field",
        ),
        (
            "      - id: a\n        use: [x]\n      - id: a\n        use: [y]\n",
            7,
            "ops.paged_mqa_logits.rules[1].id",
            "duplicate rule id `a` (first used on line 5)",
        ),
        (
            "      - id: a\n        when: {arch: []}\n        use: [x]\n",
            6,
            "ops.paged_mqa_logits.rules[0].when.arch",
            "empty list",
        ),
        ("      - id: a\n        use: []\n", 6, "ops.paged_mqa_logits.rules[0].use", "an empty list serves nothing"),
        (
            "      - id: a\n        when:\n          next_n: {min: 3, max: 2}\n        use: [x]\n",
            7,
            "ops.paged_mqa_logits.rules[0].when.next_n",
            "inverted: min 3 > max 2",
        ),
        (
            "      - id: a\n        when:\n          next_n: 0\n        use: [x]\n",
            7,
            "ops.paged_mqa_logits.rules[0].when.next_n.min",
            "greater than or equal to 1",
        ),
        (
            "      - id: a\n        when:\n          next_n: {min: 0}\n        use: [x]\n",
            7,
            "ops.paged_mqa_logits.rules[0].when.next_n.min",
            "greater than or equal to 1",
        ),
        (
            "      - id: a\n        when:\n          arch: sm77\n        use: [x]\n",
            7,
            "ops.paged_mqa_logits.rules[0].when.arch[0]",
            "'sm77' is not allowed",
        ),
        (
            "      - id: a\n        when:\n          forward_mode: [decode, prefill]\n        use: [x]\n",
            7,
            "ops.paged_mqa_logits.rules[0].when.forward_mode[1]",
            "'prefill' is not allowed",
        ),
        (
            "      - id: a\n        when:\n          arch: sm90\n          fp8_dtype: e4m3fnuz\n        use: [x]\n",
            6,
            "ops.paged_mqa_logits.rules[0].when",
            "arch sm90 cannot hold fp8_dtype e4m3fnuz",
        ),
        (
            "      - id: a\n        when: {arch: [gfx950, gfx942], fp8_dtype: e4m3fn}\n        use: [x]\n",
            6,
            "ops.paged_mqa_logits.rules[0].when",
            "arch gfx942 cannot hold fp8_dtype e4m3fn",
        ),
        (
            "      - id: a\n        use: ['']\n",
            6,
            "ops.paged_mqa_logits.rules[0].use[0]",
            "at least 1 character",
        ),
    ],
    ids=[
        "unknown-field",
        "duplicate-rule-id",
        "empty-list",
        "empty-use",
        "inverted-next-n",
        "next-n-0",
        "next-n-min-0",
        "unknown-arch",
        "unknown-mode-in-list",
        "fnuz-on-sm90",
        "fn-on-gfx942",
        "empty-backend-name",
    ],
)
def test_rule_validation_names_file_line_and_key(tmp_path, body, line, key, words):
    message = load_error(tmp_path, HEAD + body + TAIL)
    assert_located(message, tmp_path / "registry.yaml", line, key)
    assert words in message


def test_unknown_op_names_file_line_and_key(tmp_path):
    message = load_error(tmp_path, "version: 1\nops:\n  paged_mqa_logits: {fallback: x}\n  flash_attention: {fallback: x}\n")
    assert_located(message, tmp_path / "registry.yaml", 4, "ops.flash_attention")
    assert "'flash_attention' is not allowed" in message


def test_unknown_cluster_field(tmp_path):
    message = load_error(tmp_path, "version: 1\nops: {paged_mqa_logits: {fallback: [x]}, indexer_q_quant: {fallback: [x]}, topk: {fallback: [x]}, ragged_mqa_logits: {fallback: [x]}}\nclusters:\n  c:\n    match: {gpu: H200}\n")
    assert_located(message, tmp_path / "registry.yaml", 5, "clusters.c.match.gpu")
    assert "unknown field" in message


def test_duplicate_mapping_key(tmp_path):
    text = HEAD + "      - id: a\n        use: [x]\n  indexer_q_quant: {fallback: x}\n  paged_mqa_logits: {}\n"
    message = load_error(tmp_path, text)
    assert_located(message, tmp_path / "registry.yaml", 8, "ops.paged_mqa_logits")
    assert "duplicate key (first given on line 3)" in message


def test_duplicate_key_inside_a_rule(tmp_path):
    message = load_error(tmp_path, HEAD + "      - id: a\n        use: [x]\n        use: [y]\n" + TAIL)
    assert_located(message, tmp_path / "registry.yaml", 7, "ops.paged_mqa_logits.rules[0].use")
    assert "duplicate key (first given on line 6)" in message


@pytest.mark.parametrize("key", ["[a, b]", "{a: 1}"])
def test_non_scalar_mapping_key(tmp_path, key):
    message = load_error(tmp_path, f"version: 1\nops: {{paged_mqa_logits: {{fallback: [x]}}, indexer_q_quant: {{fallback: [x]}}, topk: {{fallback: [x]}}, ragged_mqa_logits: {{fallback: [x]}}}}\nclusters:\n  ? {key}\n  : {{}}\n")
    assert_located(message, tmp_path / "registry.yaml", 4, "clusters")
    assert "a key must be a plain name" in message


def test_version_missing(tmp_path):
    message = load_error(tmp_path, "ops: {paged_mqa_logits: {fallback: [x]}, indexer_q_quant: {fallback: [x]}, topk: {fallback: [x]}, ragged_mqa_logits: {fallback: [x]}}\n")
    assert_located(message, tmp_path / "registry.yaml", 1, "version")
    assert "required field is missing" in message


def test_version_wrong(tmp_path):
    message = load_error(tmp_path, "ops: {paged_mqa_logits: {fallback: [x]}, indexer_q_quant: {fallback: [x]}, topk: {fallback: [x]}, ragged_mqa_logits: {fallback: [x]}}\nversion: 2\n")
    assert_located(message, tmp_path / "registry.yaml", 2, "version")
    assert "1" in message


def test_version_as_string_is_wrong(tmp_path):
    message = load_error(tmp_path, "version: '1'\nops: {paged_mqa_logits: {fallback: [x]}, indexer_q_quant: {fallback: [x]}, topk: {fallback: [x]}, ragged_mqa_logits: {fallback: [x]}}\n")
    assert_located(message, tmp_path / "registry.yaml", 1, "version")


@pytest.mark.parametrize("text", ["- version: 1\n- ops: {}\n", "just a string\n", "42\n"])
def test_not_a_mapping(tmp_path, text):
    message = load_error(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'registry.yaml'}:1: ")
    assert "must be a mapping" in message


def test_empty_file(tmp_path):
    message = load_error(tmp_path, "")
    assert str(tmp_path / "registry.yaml") in message and "empty" in message


def test_invalid_yaml_syntax_names_the_line(tmp_path):
    message = load_error(tmp_path, "version: 1\nops:\n  paged_mqa_logits: {rules: [\n\n")
    assert message.startswith(f"{tmp_path / 'registry.yaml'}:5: ")
    assert "not valid YAML" in message


def test_file_missing(tmp_path):
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(RegistryError) as error:
        load_registry(path)
    assert str(path) in str(error.value) and "cannot read" in str(error.value)


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:os.system ['echo pwned']",
        "!!python/object:dispatch_registry_evil.Thing {}",
        "!!python/name:dispatch_registry_evil.thing",
        "!!python/module:dispatch_registry_evil",
    ],
)
def test_python_tags_are_rejected_and_nothing_is_imported(tmp_path, tag):
    before = set(sys.modules)
    message = load_error(tmp_path, f"version: 1\nops: {{paged_mqa_logits: {{fallback: [x]}}, indexer_q_quant: {{fallback: [x]}}, topk: {{fallback: [x]}}, ragged_mqa_logits: {{fallback: [x]}}}}\nclusters:\n  c:\n    description: {tag}\n")
    assert message.startswith(f"{tmp_path / 'registry.yaml'}:5: ")
    assert "not valid YAML" in message
    assert not {m for m in set(sys.modules) - before if "evil" in m}
    assert "dispatch_registry_evil" not in sys.modules


def test_parse_registry_names_the_given_path():
    with pytest.raises(RegistryError, match=r"^somewhere\.yaml:1: version: "):
        parse_registry("ops: {paged_mqa_logits: {fallback: [x]}, indexer_q_quant: {fallback: [x]}, topk: {fallback: [x]}, ragged_mqa_logits: {fallback: [x]}}\n", "somewhere.yaml")


def test_shorthands_mean_the_same_as_the_long_form():
    short = parse_registry(HEAD + "      - id: a\n        when: {arch: sm90, next_n: 2}\n        use: x\n" + TAIL)
    long = parse_registry(
        HEAD + "      - id: a\n        when: {arch: [sm90], next_n: {min: 2, max: 2}}\n        use: [x]\n" + TAIL
    )
    assert short.registry == long.registry
    assert short.fingerprint == long.fingerprint
    rule = short.registry.table(Op.PAGED_MQA_LOGITS).rules[0]
    assert rule.when.arch == (Arch.SM90,) and rule.use == ("x",)
    assert (rule.when.next_n.min, rule.when.next_n.max) == (2, 2)


# --- checks against the registered backends -------------------------------------------------------

CATALOG_TEXT = """\
version: 1
disabled: [b]
ops:
  paged_mqa_logits:
    rules:
      - id: first
        when: {arch: sm90}
        use: [a, {name}]
    fallback: [b]
  indexer_q_quant:
    fallback: [q]
  topk: {fallback: [topk]}
  ragged_mqa_logits: {fallback: [topk]}
clusters:
  c:
    prefer: [q]
"""


def small_catalog():
    return catalog_of(
        fake_backend("a"), fake_backend("b"), fake_backend("q", Op.INDEXER_Q_QUANT), fake_backend("topk", Op.TOPK), fake_backend("topk", Op.RAGGED_MQA_LOGITS)
    )


def test_known_backends_pass():
    document = parse_registry(CATALOG_TEXT.replace("{name}", "b"), "r.yaml")
    check_backend_names(document, small_catalog())


@pytest.mark.parametrize(
    "text, line, key",
    [
        (CATALOG_TEXT.replace("{name}", "zz"), 8, "ops.paged_mqa_logits.rules[0].use[1]"),
        # `q` exists, but only for the other op
        (CATALOG_TEXT.replace("{name}", "q"), 8, "ops.paged_mqa_logits.rules[0].use[1]"),
        (
            CATALOG_TEXT.replace("{name}", "b").replace("fallback: [b]", "fallback: [b, zz]"),
            9,
            "ops.paged_mqa_logits.fallback[1]",
        ),
        (CATALOG_TEXT.replace("{name}", "b").replace("prefer: [q]", "prefer: [q, zz]"), 16, "clusters.c.prefer[1]"),
        (CATALOG_TEXT.replace("{name}", "b").replace("disabled: [b]", "disabled: [zz]"), 2, "disabled[0]"),
    ],
    ids=["rule-use", "other-op", "fallback", "cluster-prefer", "disabled"],
)
def test_unknown_backend(text, line, key):
    document = parse_registry(text, "r.yaml")
    with pytest.raises(RegistryError) as error:
        check_backend_names(document, small_catalog())
    message = str(error.value)
    assert message.startswith(f"r.yaml:{line}: {key}: unknown backend "), message
    assert "registered" in message


def test_unknown_backend_lists_the_registered_names():
    document = parse_registry(CATALOG_TEXT.replace("{name}", "zz"), "r.yaml")
    with pytest.raises(RegistryError) as error:
        check_backend_names(document, small_catalog())
    assert "`zz`" in str(error.value) and "registered for paged_mqa_logits: a, b" in str(error.value)


def test_unknown_cluster():
    document = parse_registry(CATALOG_TEXT.replace("{name}", "b"), "r.yaml")
    with pytest.raises(RegistryError) as error:
        resolve_cluster(document, "nope", Arch.SM90)
    assert str(error.value).startswith("r.yaml: ")
    assert "unknown cluster `nope`" in str(error.value) and "declared: `c`" in str(error.value)


def test_unknown_cluster_from_the_environment(monkeypatch):
    monkeypatch.setenv("DISPATCH_CLUSTER", "nope")
    document = parse_registry(CATALOG_TEXT.replace("{name}", "b"), "r.yaml")
    with pytest.raises(RegistryError, match="unknown cluster `nope`"):
        resolve_cluster(document, None, Arch.SM90)


# --- lint -------------------------------------------------------------------------------------------


def lint_text(text: str, catalog=None):
    document = parse_registry(textwrap.dedent(text) + TAIL, "lint.yaml")
    return lint(document, catalog or catalog_of(fake_backend("a"), fake_backend("b")))


def test_a_clean_registry_lints_clean():
    assert (
        lint_text(
            """\
        version: 1
        ops:
          paged_mqa_logits:
            rules:
              - id: narrow
                when: {arch: sm90, next_n: {max: 2}}
                use: [a]
              - id: wide
                when: {arch: sm90}
                use: [b]
        """
        )
        == []
    )


def test_shadowed_rule_is_reported_with_its_line():
    findings = lint_text(
        """\
        version: 1
        ops:
          paged_mqa_logits:
            rules:
              - id: sm90
                when: {arch: sm90}
                use: [a]
              - id: sm90-two
                when: {arch: sm90, next_n: 2}
                use: [b]
        """
    )
    assert len(findings) == 1
    finding = findings[0]
    assert (finding.path, finding.line, finding.location) == ("lint.yaml", 8, "ops.paged_mqa_logits.rules[1]")
    assert "`sm90-two` can never fire" in finding.message and "`sm90`" in finding.message
    assert str(finding).startswith("lint.yaml:8: ops.paged_mqa_logits.rules[1]: ")


def test_rule_shadowed_by_several_earlier_rules_together():
    findings = lint_text(
        """\
        version: 1
        ops:
          paged_mqa_logits:
            rules:
              - id: low
                when: {next_n: {max: 2}}
                use: [a]
              - id: unrelated
                when: {arch: cpu, next_n: 1}
                use: [a]
              - id: high
                when: {next_n: {min: 3}}
                use: [a]
              - id: sm90
                when: {arch: sm90}
                use: [b]
        """
    )
    assert [(f.line, f.location) for f in findings] == [
        (8, "ops.paged_mqa_logits.rules[1]"),
        (14, "ops.paged_mqa_logits.rules[3]"),
    ]
    assert "`unrelated` can never fire: earlier rules `low`" in findings[0].message
    assert "`low`, `high`" in findings[1].message


def test_rule_matching_no_possible_key_is_reported():
    findings = lint_text(
        """\
        version: 1
        ops:
          paged_mqa_logits:
            rules:
              - id: decode-many
                when: {forward_mode: decode, next_n: {min: 2}}
                use: [a]
        """
    )
    assert len(findings) == 1
    assert (findings[0].line, findings[0].location) == (5, "ops.paged_mqa_logits.rules[0]")
    assert "`decode-many` matches no key that can occur" in findings[0].message


def test_rule_whose_backend_supports_none_of_its_keys_is_reported():
    catalog = catalog_of(
        fake_backend("a", archs=frozenset({Arch.SM100})),
        fake_backend("b", forward_modes=frozenset({ForwardMode.DECODE})),
    )
    findings = lint_text(
        """\
        version: 1
        ops:
          paged_mqa_logits:
            rules:
              - id: sm90
                when: {arch: sm90, forward_mode: [target_verify, decode]}
                use: [b, a]
        """,
        catalog,
    )
    assert len(findings) == 1
    finding = findings[0]
    assert (finding.line, finding.location) == (7, "ops.paged_mqa_logits.rules[0].use[1]")
    assert "backend `a` supports none of the keys rule `sm90` matches" in finding.message
    assert "arch sm90 not supported" in finding.message


def test_lint_looks_past_next_n_bounds_in_the_catalog():
    # `b` supports only next_n >= 12; a rule over next_n >= 10 does have keys `b` serves.
    catalog = catalog_of(fake_backend("a"), fake_backend("b", next_n_min=12))
    text = """\
        version: 1
        ops:
          paged_mqa_logits:
            rules:
              - id: deep
                when: {forward_mode: target_verify, next_n: {min: 10}}
                use: [b]
        """
    assert lint_text(text, catalog) == []
    narrow = text.replace("{min: 10}", "{min: 10, max: 11}")
    assert len(lint_text(narrow, catalog)) == 1


# --- the project's own registry -------------------------------------------------------------------


def test_project_registry_validates_and_lints_clean_against_the_builtin_catalog(monkeypatch):
    from dispatch.contract.host import collect_backends
    from dispatch.deciding.runtime import DEFAULT_REGISTRY, load_plugins

    monkeypatch.delenv("DISPATCH_PLUGINS", raising=False)
    document = load_registry(DEFAULT_REGISTRY)
    catalog = collect_backends(load_plugins())
    check_backend_names(document, catalog)
    assert lint(document, catalog) == []


def test_schema_is_json_schema_of_the_registry(capsys):
    import jsonschema
    from dispatch.cli.commands import main
    from dispatch.deciding.runtime import DEFAULT_REGISTRY

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"version", "ops", "clusters", "disabled"} <= set(schema["properties"])
    assert schema["required"] == ["version", "ops"]
    validator = jsonschema.Draft202012Validator(schema)
    validator.check_schema(schema)
    project = yaml.safe_load(DEFAULT_REGISTRY.read_text())
    assert [e.message for e in validator.iter_errors(project)] == []
    project["ops"]["paged_mqa_logits"]["rules"][0]["colour"] = "red"
    project["clusters"]["h200-mtp"]["match"]["arch"] = "sm77"
    errors = sorted(list(e.absolute_path) for e in validator.iter_errors(project))
    assert errors == [["clusters", "h200-mtp", "match"], ["ops", "paged_mqa_logits", "rules", 0]]
