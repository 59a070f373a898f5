"""One answer for "this package's version" (dispatch.contract.version): a source tree's pyproject version with
the commit read from .git's files, an installed distribution's version, else "source"; used by
`--version`, the plugin registry and tune's overlay alike; and a source tree's commit never makes
validate call evidence stale."""

from __future__ import annotations

import importlib.metadata

import pytest

from dispatch.registry.document import load_registry
from dispatch.registry.measured import stale_evidence
from dispatch.contract.version import dispatch_version, git_commit, release_of, version_at

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"
PYPROJECT = '[build-system]\nrequires = ["setuptools"]\n\n[project]\nname = "dispatch-dsa"\nversion = "1.2.3"\n'


def source_tree(root, head="ref: refs/heads/main\n"):
    (root / "pyproject.toml").write_text(PYPROJECT)
    git = root / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text(head)
    return git


def test_a_source_tree_names_its_release_and_the_commit_of_a_loose_ref(tmp_path):
    git = source_tree(tmp_path)
    (git / "refs" / "heads" / "main").write_text(COMMIT + "\n")
    assert version_at(tmp_path) == "1.2.3+g0123456789ab"


def test_the_commit_comes_from_packed_refs_or_a_detached_head(tmp_path):
    git = source_tree(tmp_path)
    (git / "packed-refs").write_text(f"# pack-refs with: peeled\n{OTHER} refs/heads/other\n{COMMIT} refs/heads/main\n")
    assert git_commit(tmp_path) == COMMIT
    (git / "HEAD").write_text(OTHER + "\n")
    assert git_commit(tmp_path) == OTHER


def test_a_worktree_reads_its_own_head_and_the_shared_refs(tmp_path):
    main = tmp_path / "main"
    main.mkdir()
    shared = source_tree(main)
    (shared / "refs" / "heads" / "feature").write_text(COMMIT + "\n")
    private = shared / "worktrees" / "feature"
    private.mkdir(parents=True)
    (private / "HEAD").write_text("ref: refs/heads/feature\n")
    (private / "commondir").write_text("../..\n")
    tree = tmp_path / "feature"
    tree.mkdir()
    (tree / "pyproject.toml").write_text(PYPROJECT)
    (tree / ".git").write_text(f"gitdir: {private}\n")
    assert version_at(tree) == "1.2.3+g0123456789ab"


@pytest.mark.parametrize("head", ["ref: refs/heads/missing\n", "not a commit\n", ""])
def test_a_source_tree_without_a_readable_commit_says_source(tmp_path, head):
    source_tree(tmp_path, head)
    assert version_at(tmp_path) == "1.2.3+source"


def test_installed_is_the_distributions_version_and_neither_is_source(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT.replace("dispatch-dsa", "someone-else"))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9" if name == "dispatch-dsa" else "0")
    assert version_at(tmp_path) == "9.9.9"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert version_at(tmp_path) == "source"


def test_the_plugin_registry_and_the_cli_say_the_same_version(capsys):
    from dispatch.cli.commands import main
    from dispatch.contract.host import builtin_plugins

    assert {plugin.version for plugin in builtin_plugins()} == {dispatch_version()}
    with pytest.raises(SystemExit):
        main(["--version"], prog="dispatch")
    assert capsys.readouterr().out == f"dispatch (dispatch-dsa {dispatch_version()})\n"


@pytest.mark.parametrize(
    "version, release",
    [("0.1.0", "0.1.0"), ("0.1.0+g0123456789ab", "0.1.0"), ("0.1.0+source", "0.1.0"), ("source", None), ("unknown", None)],
)
def test_release_of(version, release):
    assert release_of(version) == release


OVERLAY = """\
version: 1
machine: CPU (test)
date: 2026-11-30
dispatch: {measured}
torch: "2"
workload: {{}}
ops: {{}}
# end
"""
REGISTRY = """\
version: 1
ops:
  paged_mqa_logits: {fallback: [torch.reference]}
  indexer_q_quant: {fallback: [torch.reference]}
  topk: {fallback: [torch.reference]}
  ragged_mqa_logits: {fallback: [torch.reference]}
clusters:
  here: {measured: overlay.yaml}
"""


@pytest.mark.parametrize(
    "measured, current, stale",
    [
        ("0.1.0+g0123456789ab", "0.1.0+gfedcba987654", False),  # another commit of one release
        ("0.1.0+g0123456789ab", "0.1.0", False),
        ("0.1.0", "0.1.0+source", False),
        ("source", "0.2.0", False),  # no release recorded: nothing to compare
        ("unknown", "0.1.0+g0123456789ab", False),  # what tune wrote before it had one version
        ("0.1.0+source", "source", False),
        ("0.1.0+g0123456789ab", "0.2.0+g0123456789ab", True),
    ],
)
def test_only_a_changed_release_makes_the_evidence_stale(tmp_path, measured, current, stale):
    from dispatch.contract.host import collect_backends
    from dispatch.deciding.runtime import load_plugins

    (tmp_path / "overlay.yaml").write_text(OVERLAY.format(measured=measured))
    (tmp_path / "registry.yaml").write_text(REGISTRY)
    warnings = stale_evidence(load_registry(tmp_path / "registry.yaml"), collect_backends(load_plugins()), dispatch=current)
    if not stale:
        assert warnings == []
        return
    assert warnings == [
        f"{tmp_path / 'overlay.yaml'}:4: dispatch: stale evidence: measured with dispatch 0.1.0; this is 0.2.0; "
        "re-run `python -m dispatch tune --cluster here`"
    ]
