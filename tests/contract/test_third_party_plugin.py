"""The example third-party package, really installed (pip, entry points), chosen through a cluster
overlay, and loaded only when the allowlist names it."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dispatch.contract.key import DispatchKey, Op
from dispatch.deciding.runtime import load_dispatcher, load_plugins

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "examples" / "acme-dispatch-plugin"
KEY = DispatchKey("cpu", "target_verify", 3, "e4m3fn")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(PACKAGE)],
        check=True,
    )
    sys.path.insert(0, str(target))
    yield target
    sys.path.remove(str(target))
    sys.modules.pop("acme_dispatch.plugin", None)
    sys.modules.pop("acme_dispatch", None)


def test_not_loaded_unless_allowlisted(installed, monkeypatch):
    monkeypatch.delenv("DISPATCH_PLUGINS", raising=False)
    assert "acme" not in [p.name for p in load_plugins()]
    monkeypatch.setenv("DISPATCH_PLUGINS", "some-other-plugin")
    assert "acme" not in [p.name for p in load_plugins()]


def test_chosen_through_the_cluster_overlay(installed, monkeypatch):
    monkeypatch.setenv("DISPATCH_PLUGINS", "acme")
    registry = PACKAGE / "registry.yaml"
    with_cluster = load_dispatcher(registry, cluster="acme", arch="cpu").decide(Op.PAGED_MQA_LOGITS, KEY)
    assert (with_cluster.backend, with_cluster.plugin, with_cluster.source) == ("acme.chunked", "acme", "cluster-prefer")
    assert with_cluster.impl.distribution == "acme-dispatch-plugin"
    without = load_dispatcher(registry, arch="cpu").decide(Op.PAGED_MQA_LOGITS, KEY)
    assert without.backend != "acme.chunked"
    reasons = {r.backend: r.reason for r in without.rejected}
    assert "no cluster preference, matching rule or fallback names it" in reasons["acme.chunked"]


def test_plugin_backend_matches_the_reference(installed, monkeypatch):
    from dispatch.contract.paged_cache import build_paged_kv_cache
    from dispatch.contract.ops import paged_mqa_logits
    from dispatch.step.paged_plan import PagedBatch, build_plan

    monkeypatch.setenv("DISPATCH_PLUGINS", "acme")
    dispatcher = load_dispatcher(PACKAGE / "registry.yaml", cluster="acme", arch="cpu")
    generator = torch.Generator().manual_seed(0)
    lengths = [70, 3, 130, 64, 200, 4, 90, 33, 129]
    cache, table = build_paged_kv_cache([torch.randn(n, 128, generator=generator) for n in lengths], "e4m3fn",
                                        generator=generator, extra_blocks=2)
    batch = PagedBatch(torch.tensor(lengths, dtype=torch.int32), table, max(lengths), KEY.forward_mode, KEY.next_n)
    q = torch.randn(len(lengths) * 3, 64, 128, generator=generator).to(torch.float8_e4m3fn)
    weights = torch.randn(len(lengths) * 3, 64, generator=generator)
    plan = build_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn")
    reference = build_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn", pinned={Op.PAGED_MQA_LOGITS: "torch.reference"})
    out = paged_mqa_logits(plan, q, cache, weights)
    ref = paged_mqa_logits(reference, q, cache, weights)
    visible = ~torch.isinf(ref)
    assert torch.equal(torch.isinf(out), ~visible)
    error = (out[visible] - ref[visible]).norm() / ref[visible].norm()
    assert error < 1e-5


def test_explain_shows_the_plugin_chosen_through_the_overlay(installed, monkeypatch, capsys):
    import json

    from dispatch.cli.commands import main

    monkeypatch.setenv("DISPATCH_PLUGINS", "acme")
    argv = ["explain", "--registry", str(PACKAGE / "registry.yaml"), "--arch", "cpu",
            "--forward-mode", "target_verify", "--next-n", "3", "--json"]
    assert main(argv + ["--cluster", "acme"]) == 0
    (decision,) = json.loads(capsys.readouterr().out)["decisions"]
    assert (decision["backend"], decision["plugin"], decision["rule"]) == ("acme.chunked", "acme", "prefer[0]")
    monkeypatch.setenv("DISPATCH_PLUGINS", "")
    assert main(argv + ["--cluster", "acme"]) == 2  # not allowlisted: the overlay names an unknown backend
    assert "unknown backend `acme.chunked`" in capsys.readouterr().err
