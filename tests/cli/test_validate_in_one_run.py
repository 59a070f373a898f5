"""validate reports everything in one run: a missing overlay beside the other errors, keys a cluster
leaves without a backend, YAML mistakes in words; and `extends: default`, a registry holding only what
differs from the packaged one."""

from __future__ import annotations

import textwrap

import pytest

from dispatch.cli.commands import main
from dispatch.contract.errors import RegistryError
from dispatch.contract.key import ForwardMode
from dispatch.deciding.cluster_coverage import decided_in
from dispatch.registry.document import load_registry, parse_registry
from dispatch.deciding.runtime import DEFAULT_REGISTRY, load_dispatcher
from tests.support.shipped import shipped_registry_text


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("DISPATCH_REGISTRY", "DISPATCH_CLUSTER", "DISPATCH_PLUGINS", "DISPATCH_ARCH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("dispatch.deciding.clusters.gpu_name", lambda: "")


def validate(capsys, tmp_path, text: str) -> tuple[int, str, str]:
    path = tmp_path / "registry.yaml"
    path.write_text(textwrap.dedent(text))
    code = main(["validate", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.replace(str(tmp_path), "T")


def test_a_missing_overlay_is_reported_with_every_other_problem(capsys, tmp_path):
    text = shipped_registry_text().replace("use: [triton, flashinfer, torch.reference]", "use: [tritn, flashinfer]")
    text = text.replace("    prefer: [torch.reference]", "    prefer: [torch.reference]\n    measured: gone/overlay.yaml")
    code, out, err = validate(capsys, tmp_path, text)
    assert code == 2 and out == ""
    assert "clusters.reference-only.measured: the measured overlay `gone/overlay.yaml` (relative to T, the folder" in err
    assert "is T/gone/overlay.yaml, which is not a file" in err and "extends: default" in err
    assert "unknown backend `tritn`; did you mean `triton`?" in err


def test_a_copied_registry_names_where_its_relative_overlay_was_looked_for(tmp_path):
    copy = tmp_path / "registry.yaml"
    copy.write_text(DEFAULT_REGISTRY.read_text())
    with pytest.raises(RegistryError, match=rf"`measured/h200-mtp.yaml` \(relative to {tmp_path}, the folder of the "
                                            rf"file naming it\) is {tmp_path}/measured/h200-mtp.yaml, which is not a file"):
        load_registry(copy)
    (tmp_path / "measured").mkdir()
    (tmp_path / "measured" / "h200-mtp.yaml").write_text((DEFAULT_REGISTRY.parent / "measured/h200-mtp.yaml").read_text())
    assert load_registry(copy).measured["h200-mtp"].path == str(tmp_path / "measured/h200-mtp.yaml")


def test_a_cluster_that_disables_the_only_backend_is_flagged(capsys, tmp_path):
    # Before: validate said ok, and explain --cluster no-reference --arch cpu exited 1.
    text = shipped_registry_text() + textwrap.indent(textwrap.dedent("""\
        no-reference:
          match: {arch: cpu}
          disable: [torch.reference]
        """), "  ")
    code, out, err = validate(capsys, tmp_path, text)
    assert code == 2 and out == ""
    (line,) = [line for line in err.splitlines() if "no-reference" in line]
    assert line.startswith("lint: T/registry.yaml:")
    assert "cluster `no-reference` leaves keys without a backend" in line
    assert "indexer_q_quant at arch=cpu forward_mode=decode next_n=1 fp8_dtype=e4m3fn" in line
    assert "arch=sm90" not in line  # its match names cpu only
    assert main(["explain", "--registry", str(tmp_path / "registry.yaml"), "--arch", "cpu", "--op", "indexer_q_quant",
                 "--cluster", "no-reference"]) == 1


def test_a_cluster_that_leaves_every_key_served_passes(capsys, tmp_path):
    code, out, err = validate(capsys, tmp_path, shipped_registry_text())
    assert code == 0 and err == "", err


def test_decided_in_is_what_a_plan_decides():
    from dispatch.step.paged_plan import ops_for

    for mode in ForwardMode:
        assert set(decided_in(mode)) == set(ops_for(mode))


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("version: 1\nops:\n  topk:\n    fallback: [a]\n   rules: []\n", 5, "indented less than the keys before it"),
        ("version: 1\nops:\n\ttopk: 1\n", 3, "a tab character: YAML indents with spaces only"),
        ("version: 1\nops:\n  topk:\n    fallback: [a\n  x: 1\n", 5, "a [list] not closed with `]`"),
        ("version: 1\nops:\n  topk:\n    why: a: b\n", 4, "a value holds an unquoted `: `"),
    ],
)
def test_yaml_mistakes_are_said_in_words_with_their_line(text, line, words):
    with pytest.raises(RegistryError) as raised:
        parse_registry(text, "r.yaml")
    message = str(raised.value)
    assert message.startswith(f"r.yaml:{line}: not valid YAML: ") and words in message
    assert f"\n    {line} | " in message  # the offending line, as written


def test_an_unclosed_list_says_where_it_opens():
    with pytest.raises(RegistryError, match=r"r.yaml:5: not valid YAML: a \[list\] not closed .*; it opens on line 4"):
        parse_registry("version: 1\nops:\n  topk:\n    fallback: [a\n  x: 1\n", "r.yaml")


def test_extends_default_holds_only_what_differs(capsys, tmp_path):
    code, out, err = validate(capsys, tmp_path, """\
        extends: default
        clusters:
          b200-pool:
            match: {arch: sm100}
            disable: [deepgemm.sm100]
        """)
    assert code == 0, err
    assert "3 clusters, 1 measured overlay " in out  # the packaged two, their overlay read from the package
    dispatcher = load_dispatcher(tmp_path / "registry.yaml", arch="sm100", cluster="b200-pool")
    from dispatch.contract.key import DispatchKey

    decision = dispatcher.decide("paged_mqa_logits", DispatchKey("sm100", "decode", 1, "e4m3fn"))
    assert (decision.backend, decision.rule) == ("triton", "sm100-deepgemm-native")
    assert decision.rule_at.startswith(f"{DEFAULT_REGISTRY}:")  # the rule's own file and line


def test_extends_alone_means_the_packaged_registry():
    extended = parse_registry("extends: default\n", "/elsewhere/r.yaml")
    assert extended.fingerprint == load_registry(DEFAULT_REGISTRY).fingerprint


def test_an_op_given_with_extends_replaces_the_packaged_table_and_is_validated(capsys, tmp_path):
    code, _, err = validate(capsys, tmp_path, """\
        extends: default
        ops:
          topk:
            rules:
              - id: only-reference
                when: {arch: sm91}
                use: [torch.reference]
        """)
    assert code == 2 and "T/registry.yaml:6: ops.topk.rules[0].when.arch[0]: 'sm91' is not allowed" in err
    path = tmp_path / "registry.yaml"
    path.write_text("extends: default\nops:\n  topk: {fallback: [torch.reference]}\n")
    assert load_registry(path).registry.ops["topk"].rules == ()


def test_extends_names_only_the_packaged_registry(tmp_path):
    with pytest.raises(RegistryError, match=r"r.yaml:2: extends: `extends` takes only `default` \(the packaged registry"):
        parse_registry("version: 1\nextends: /etc/other.yaml\n", "r.yaml")


def test_tune_leaves_a_packaged_clusters_overlay_alone(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("dispatch.deciding.clusters.gpu_name", lambda: "")
    path = tmp_path / "registry.yaml"
    path.write_text("extends: default\n")
    before = (DEFAULT_REGISTRY.parent / "measured/h200-mtp.yaml").read_text()
    assert main(["tune", "--registry", str(path), "--cluster", "h200-mtp", "--quick"]) == 2
    assert "comes from the packaged registry (`extends: default`), whose overlay tune will not overwrite" in (
        capsys.readouterr().err)
    assert (DEFAULT_REGISTRY.parent / "measured/h200-mtp.yaml").read_text() == before
