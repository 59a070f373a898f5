"""The dispatcher: rule order, fallback, cluster overlays, cluster resolution, rejections, availability,
and the Decision value (frozen, deterministic, cached, thread-safe)."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from dispatch.contract.backend import Availability
from dispatch.deciding.clusters import resolve_cluster
from dispatch.contract.decision import Rejection
from dispatch.contract.errors import NoBackendError, RegistryError
from dispatch.contract.key import Arch, DispatchKey, ForwardMode, Fp8Dtype, Op
from dispatch.deciding.runtime import load_dispatcher
from tests.support.fakes import catalog_of, dispatcher, fake_backend, fake_plugin, registry

LOGITS = Op.PAGED_MQA_LOGITS
SM90 = frozenset({Arch.SM90})


def key(arch="sm90", mode="target_verify", next_n=2, fp8="e4m3fn") -> DispatchKey:
    return DispatchKey(arch, mode, next_n, fp8)


def reasons(decision) -> dict[str, str]:
    return {r.backend: r.reason for r in decision.rejected}


ORDER = """\
version: 1
ops:
  paged_mqa_logits:
    rules:
      - id: first
        when: {arch: sm90}
        use: [a, b]
      - id: second
        when: {arch: sm90}
        use: [d]
      - id: other-arch
        when: {arch: sm100}
        use: [b]
    fallback: [c, a]
  indexer_q_quant: {fallback: [q]}
  topk: {fallback: [topk]}
  ragged_mqa_logits: {fallback: [topk]}
"""


def order_catalog(**support):
    return catalog_of(
        fake_backend("a", **support.get("a", {})),
        fake_backend("b", **support.get("b", {})),
        fake_backend("c", **support.get("c", {})),
        fake_backend("d"),
    )


def test_first_matching_rule_wins_and_its_first_backend():
    decision = dispatcher(ORDER, order_catalog()).decide(LOGITS, key())
    assert (decision.backend, decision.rule, decision.source) == ("a", "first", "rule")
    assert decision.plugin == "plugin-paged_mqa_logits-a"
    assert reasons(decision) == {
        "b": "eligible, but rule `first` lists `a` before it",
        "c": "eligible, but rule `first` (`a`) comes before fallback[0]",
        "d": "eligible, but no cluster preference, matching rule or fallback names it",
    }


def test_use_list_is_tried_in_order():
    decision = dispatcher(ORDER, order_catalog(a={"next_n_max": 1})).decide(LOGITS, key())
    assert (decision.backend, decision.rule) == ("b", "first")
    assert reasons(decision)["a"] == "rule `first` names it, but next_n 2 not supported (supports 1)"


def test_later_matching_rules_are_not_consulted():
    # `second` matches too and names an eligible `d`, but only the first matching rule counts.
    catalog = order_catalog(a={"archs": frozenset({Arch.SM100})}, b={"next_n_max": 1})
    decision = dispatcher(ORDER, catalog).decide(LOGITS, key())
    assert (decision.backend, decision.rule, decision.source) == ("c", "fallback[0]", "fallback")
    assert reasons(decision)["d"].startswith("eligible, but no cluster preference")


def test_a_rule_naming_a_backend_not_registered_here_skips_it():
    # `a`'s plugin is not loaded (an allowlist, a catalog of one's own): the rule's next name serves,
    # and no rejection names the missing one (it is no candidate here).
    catalog = catalog_of(fake_backend("b"), fake_backend("c"), fake_backend("d"))
    decision = dispatcher(ORDER, catalog).decide(LOGITS, key())
    assert (decision.backend, decision.rule, decision.source) == ("b", "first", "rule")
    assert "a" not in reasons(decision)


def test_when_no_named_backend_is_registered_the_error_lists_the_candidates():
    with pytest.raises(NoBackendError, match="d: eligible, but no cluster preference"):
        dispatcher(ORDER, catalog_of(fake_backend("d"))).decide(LOGITS, key(arch="cpu"))


def test_no_matching_rule_goes_straight_to_fallback():
    decision = dispatcher(ORDER, order_catalog()).decide(LOGITS, key(arch="cpu"))
    assert (decision.backend, decision.rule, decision.source) == ("c", "fallback[0]", "fallback")
    assert reasons(decision)["a"] == "eligible, but fallback[0] (`c`) comes before fallback[1]"


def test_fallback_chain_in_order_past_unsupported_backends():
    catalog = order_catalog(
        a={"fp8_dtypes": frozenset({Fp8Dtype.E4M3FNUZ})},
        b={"forward_modes": frozenset({ForwardMode.DECODE})},
        c={"next_n_min": 3},
    )
    # no rule matches cpu: fallback[0] `c` needs next_n >= 3, fallback[1] `a` holds fnuz
    decision = dispatcher(ORDER, catalog).decide(LOGITS, key(arch="cpu", fp8="e4m3fnuz"))
    assert (decision.backend, decision.rule, decision.source) == ("a", "fallback[1]", "fallback")
    assert reasons(decision)["c"] == "fallback[0] names it, but next_n 2 not supported (supports 3..)"
    # rule `other-arch` names `b` (decode only), then the fallback chain
    decision = dispatcher(ORDER, catalog).decide(LOGITS, key(arch="sm100", next_n=3))
    assert (decision.backend, decision.rule) == ("c", "fallback[0]")
    assert reasons(decision)["b"] == (
        "rule `other-arch` names it, but forward_mode target_verify not supported (supports decode)"
    )


def test_unavailable_backend_is_skipped_with_the_probe_reason():
    catalog = catalog_of(
        fake_backend("a", probe=lambda: Availability.no("needs libfancy.so")),
        fake_backend("b"),
        fake_backend("c"),
        fake_backend("d"),
    )
    decision = dispatcher(ORDER, catalog).decide(LOGITS, key())
    assert decision.backend == "b"
    assert reasons(decision)["a"] == "rule `first` names it, but not available here: needs libfancy.so"
    assert decision.availability_checked is True


def test_crashing_probe_means_unavailable():
    def probe():
        raise OSError("driver went away")

    catalog = catalog_of(fake_backend("a", probe=probe), fake_backend("b"), fake_backend("c"), fake_backend("d"))
    decision = dispatcher(ORDER, catalog).decide(LOGITS, key())
    assert decision.backend == "b"
    assert "not available here: availability probe raised OSError: driver went away" in reasons(decision)["a"]


def test_what_if_ignores_availability():
    calls = []

    def probe():
        calls.append(1)
        return Availability.no("no GPU here")

    catalog = catalog_of(fake_backend("a", probe=probe), fake_backend("b"), fake_backend("c"), fake_backend("d"))
    decision = dispatcher(ORDER, catalog, check_availability=False).decide(LOGITS, key())
    assert decision.backend == "a" and decision.availability_checked is False
    assert calls == []


def test_probe_runs_once_per_process():
    calls = []

    def probe():
        calls.append(1)
        return Availability.no("nope")

    catalog = catalog_of(fake_backend("a", probe=probe), fake_backend("b"), fake_backend("c"), fake_backend("d"))
    for next_n in (1, 2, 3):
        dispatcher(ORDER, catalog).decide(LOGITS, key(next_n=next_n))
    assert calls == [1]


# --- cluster overlays ------------------------------------------------------------------------------

OVERLAYS = """\
version: 1
disabled: [a]
ops:
  paged_mqa_logits:
    rules:
      - id: sm90
        when: {arch: sm90}
        use: [a, b]
    fallback: [c]
  indexer_q_quant: {fallback: [q]}
  topk: {fallback: [topk]}
  ragged_mqa_logits: {fallback: [topk]}
clusters:
  plain:
    description: changes nothing
  no-b:
    disable: [b]
  with-a:
    enable: [a]
  with-a-but-not:
    enable: [a]
    disable: [a]
  prefers:
    prefer: [d, c, q]
"""


def overlay_catalog(**support):
    return catalog_of(
        fake_backend("a"),
        fake_backend("b"),
        fake_backend("c"),
        fake_backend("d", **support),
        fake_backend("q", Op.INDEXER_Q_QUANT),
    )


def test_registry_disabled_list():
    decision = dispatcher(OVERLAYS, overlay_catalog()).decide(LOGITS, key())
    assert decision.backend == "b" and decision.cluster is None
    assert reasons(decision)["a"] == "rule `sm90` names it, but disabled by the registry's `disabled` list"


def test_cluster_without_overlays_changes_nothing():
    decision = dispatcher(OVERLAYS, overlay_catalog(), cluster="plain").decide(LOGITS, key())
    assert (decision.backend, decision.cluster) == ("b", "plain")


def test_cluster_disable():
    decision = dispatcher(OVERLAYS, overlay_catalog(), cluster="no-b").decide(LOGITS, key())
    assert (decision.backend, decision.rule, decision.cluster) == ("c", "fallback[0]", "no-b")
    assert reasons(decision)["b"] == "rule `sm90` names it, but disabled by cluster `no-b`"


def test_cluster_enable_reenables_a_registry_disabled_backend():
    decision = dispatcher(OVERLAYS, overlay_catalog(), cluster="with-a").decide(LOGITS, key())
    assert (decision.backend, decision.rule) == ("a", "sm90")


def test_cluster_disable_beats_its_own_enable():
    decision = dispatcher(OVERLAYS, overlay_catalog(), cluster="with-a-but-not").decide(LOGITS, key())
    assert decision.backend == "b"
    assert "disabled by cluster `with-a-but-not`" in reasons(decision)["a"]


def test_cluster_prefer_is_tried_before_the_rules():
    decision = dispatcher(OVERLAYS, overlay_catalog(), cluster="prefers").decide(LOGITS, key())
    assert (decision.backend, decision.rule, decision.source, decision.cluster) == (
        "d",
        "prefer[0]",
        "cluster-prefer",
        "prefers",
    )
    assert reasons(decision)["b"] == "eligible, but cluster `prefers` prefer[0] (`d`) comes before rule `sm90`"


def test_cluster_prefer_only_where_supported():
    catalog = overlay_catalog(archs=frozenset({Arch.SM100}))
    decision = dispatcher(OVERLAYS, catalog, cluster="prefers").decide(LOGITS, key())
    assert (decision.backend, decision.rule, decision.source) == ("c", "prefer[1]", "cluster-prefer")
    assert reasons(decision)["d"].startswith("cluster `prefers` prefer[0] names it, but arch sm90 not supported")
    # on sm100 the first preference holds again
    assert dispatcher(OVERLAYS, catalog, cluster="prefers").decide(LOGITS, key(arch="sm100")).backend == "d"


def test_cluster_prefer_skips_names_of_another_op():
    catalog = overlay_catalog(archs=frozenset({Arch.SM100}))
    decision = dispatcher(OVERLAYS, catalog, cluster="prefers").decide(LOGITS, key())
    assert "q" not in reasons(decision)  # `q` is a q-quant backend; the logits decision never sees it
    q_decision = dispatcher(OVERLAYS, catalog, cluster="prefers").decide(Op.INDEXER_Q_QUANT, key())
    assert (q_decision.backend, q_decision.rule) == ("q", "prefer[2]")


# --- which cluster applies ---------------------------------------------------------------------------

CLUSTERS = """\
version: 1
ops:
  paged_mqa_logits:
    fallback: [a]
  indexer_q_quant: {fallback: [q]}
  topk: {fallback: [topk]}
  ragged_mqa_logits: {fallback: [topk]}
clusters:
  h200:
    match: {arch: sm90, gpu_name: "NVIDIA H200*"}
  h100:
    match: {arch: sm90, gpu_name: "NVIDIA H100*"}
  blackwell:
    match: {arch: [sm100, sm120]}
  manual:
    description: only when named
"""


@pytest.fixture
def no_env_cluster(monkeypatch):
    monkeypatch.delenv("DISPATCH_CLUSTER", raising=False)
    monkeypatch.setattr("dispatch.deciding.clusters.gpu_name", lambda: "")
    return monkeypatch


def test_cluster_by_name(no_env_cluster):
    assert resolve_cluster(registry(CLUSTERS), "manual", Arch.SM90) == "manual"
    # a name given outright wins over a declared match
    no_env_cluster.setattr("dispatch.deciding.clusters.gpu_name", lambda: "NVIDIA H200 NVL")
    assert resolve_cluster(registry(CLUSTERS), "manual", Arch.SM90) == "manual"


def test_cluster_by_environment(no_env_cluster):
    no_env_cluster.setenv("DISPATCH_CLUSTER", "manual")
    assert resolve_cluster(registry(CLUSTERS), None, Arch.SM100) == "manual"
    assert resolve_cluster(registry(CLUSTERS), "h100", Arch.SM100) == "h100"


def test_empty_environment_means_no_cluster_named(no_env_cluster):
    no_env_cluster.setenv("DISPATCH_CLUSTER", "")
    assert resolve_cluster(registry(CLUSTERS), None, Arch.CPU) is None


def test_cluster_by_declared_arch_match(no_env_cluster):
    assert resolve_cluster(registry(CLUSTERS), None, Arch.SM120) == "blackwell"
    assert resolve_cluster(registry(CLUSTERS), None, Arch.SM100) == "blackwell"
    assert resolve_cluster(registry(CLUSTERS), None, Arch.SM90) is None


@pytest.mark.parametrize(
    "gpu, expected",
    [("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA GH200", None)],
)
def test_cluster_by_gpu_name_glob(no_env_cluster, gpu, expected):
    no_env_cluster.setattr("dispatch.deciding.clusters.gpu_name", lambda: gpu)
    assert resolve_cluster(registry(CLUSTERS), None, Arch.SM90) == expected
    # the arch must match too
    assert resolve_cluster(registry(CLUSTERS), None, Arch.GFX942) is None


def test_two_matching_clusters_is_an_error(no_env_cluster):
    text = CLUSTERS + "  any-sm90:\n    match: {arch: sm90}\n"
    no_env_cluster.setattr("dispatch.deciding.clusters.gpu_name", lambda: "NVIDIA H200")
    with pytest.raises(RegistryError) as error:
        resolve_cluster(registry(text), None, Arch.SM90)
    assert "`h200`" in str(error.value) and "`any-sm90`" in str(error.value)
    assert "--cluster" in str(error.value)
    # naming one settles it
    assert resolve_cluster(registry(text), "any-sm90", Arch.SM90) == "any-sm90"


def test_load_dispatcher_applies_the_matched_cluster(no_env_cluster, tmp_path):
    path = tmp_path / "registry.yaml"
    path.write_text(CLUSTERS.replace("description: only when named", "disable: [a]"))
    plugins = [fake_plugin("p", fake_backend("a"), fake_backend("b"), fake_backend("q", Op.INDEXER_Q_QUANT), fake_backend("topk", Op.TOPK), fake_backend("topk", Op.RAGGED_MQA_LOGITS))]
    no_env_cluster.setattr("dispatch.deciding.clusters.gpu_name", lambda: "NVIDIA H100 PCIe")
    chosen = load_dispatcher(path, arch="sm90", plugins=plugins)
    assert chosen.cluster == "h100" and chosen.check_availability is False
    assert chosen.decide(LOGITS, key()).cluster == "h100"
    manual = load_dispatcher(path, arch="sm90", cluster="manual", plugins=plugins)
    with pytest.raises(NoBackendError, match="disabled by cluster `manual`"):
        manual.decide(LOGITS, key())
    with pytest.raises(RegistryError, match="unknown cluster `nope`"):
        load_dispatcher(path, arch="sm90", cluster="nope", plugins=plugins)


# --- no backend ------------------------------------------------------------------------------------


def test_no_backend_lists_every_candidate_with_its_reason():
    text = """\
    version: 1
    disabled: [offline]
    ops:
      paged_mqa_logits:
        rules:
          - id: sm90
            when: {arch: sm90}
            use: [narrow, offline]
        fallback: [gone]
      indexer_q_quant: {fallback: [q]}
      topk: {fallback: [topk]}
      ragged_mqa_logits: {fallback: [topk]}
    """
    catalog = catalog_of(
        fake_backend("narrow", next_n_max=1),
        fake_backend("offline"),
        fake_backend("gone", probe=lambda: Availability.no("library missing")),
        fake_backend("idle"),
        fake_backend("quant", Op.INDEXER_Q_QUANT),
    )
    with pytest.raises(NoBackendError) as error:
        dispatcher(text, catalog).decide(LOGITS, key())
    lines = str(error.value).splitlines()
    assert lines[0] == f"no backend for paged_mqa_logits at {key()}:"
    assert lines[1:] == [
        "  gone: fallback[0] names it, but not available here: library missing",
        "  idle: eligible, but no cluster preference, matching rule or fallback names it",
        "  narrow: rule `sm90` names it, but next_n 2 not supported (supports 1)",
        "  offline: rule `sm90` names it, but disabled by the registry's `disabled` list",
    ]


def test_no_backend_when_nothing_matches_and_there_is_no_fallback():
    text = "version: 1\nops:\n  paged_mqa_logits:\n    rules:\n      - id: cpu\n        when: {arch: cpu}\n        use: [a]\n  indexer_q_quant: {fallback: [q]}\n  topk: {fallback: [topk]}\n  ragged_mqa_logits: {fallback: [topk]}\n"
    catalog = catalog_of(fake_backend("a"))
    with pytest.raises(NoBackendError, match="a: eligible, but no cluster preference"):
        dispatcher(text, catalog).decide(LOGITS, key())


# --- the decision value ----------------------------------------------------------------------------


def test_decision_is_frozen():
    decision = dispatcher(ORDER, order_catalog()).decide(LOGITS, key())
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.backend = "b"
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.rejected[0].reason = "changed"
    assert isinstance(decision.rejected, tuple) and all(isinstance(r, Rejection) for r in decision.rejected)


def test_decision_as_dict():
    decision = dispatcher(ORDER, order_catalog()).decide(LOGITS, key())
    assert decision.as_dict() == {
        "op": "paged_mqa_logits",
        "key": {"arch": "sm90", "forward_mode": "target_verify", "next_n": 2, "fp8_dtype": "e4m3fn"},
        "backend": "a",
        "layout": "native",
        "rule": "first",
        "source": "rule",
        "cluster": None,
        "plugin": "plugin-paged_mqa_logits-a",
        "rejected": [{"backend": b, "reason": r} for b, r in reasons(decision).items()],
        "registry_fingerprint": registry(ORDER).fingerprint,
        "availability_checked": True,
        "rule_at": f"{registry(ORDER).path}:{registry(ORDER).line_of(('ops', 'paged_mqa_logits', 'rules', 0))}",
        "evidence": None,
        "band": None,
    }
    assert [r["backend"] for r in decision.as_dict()["rejected"]] == ["b", "c", "d"]


def test_decision_is_deterministic_across_dispatchers():
    first = dispatcher(ORDER, order_catalog()).decide(LOGITS, key())
    second = dispatcher(ORDER, order_catalog()).decide(LOGITS, key())
    assert first is not second
    assert first == second and first.as_dict() == second.as_dict()


def test_decision_is_cached():
    chosen = dispatcher(ORDER, order_catalog())
    first = chosen.decide(LOGITS, key())
    assert chosen.decide(LOGITS, key()) is first
    assert (
        chosen.decide("paged_mqa_logits", DispatchKey(Arch.SM90, ForwardMode.TARGET_VERIFY, 2, Fp8Dtype.E4M3FN))
        is first
    )
    assert chosen.decide(LOGITS, key(next_n=3)) is not first


def test_no_backend_is_not_cached_as_a_decision():
    catalog = catalog_of(
        fake_backend("a", next_n_max=1),
        fake_backend("b", next_n_max=1),
        fake_backend("c", next_n_max=1),
        fake_backend("d"),
    )
    chosen = dispatcher(ORDER.replace("fallback: [c, a]", "fallback: [c]"), catalog)
    for _ in range(2):
        with pytest.raises(NoBackendError):
            chosen.decide(LOGITS, key())


def test_decisions_are_thread_safe():
    chosen = dispatcher(ORDER, order_catalog(a={"next_n_max": 2}))
    keys = [key(next_n=n) for n in (1, 2, 3, 4)] + [key(arch="cpu"), key(arch="sm100", next_n=5)]
    workers = 32
    barrier = threading.Barrier(workers)

    def work(index):
        barrier.wait()  # every thread asks at once, on an empty cache
        ordered = keys if index % 2 else keys[::-1]
        return dict(zip(ordered, (chosen.decide(LOGITS, k) for k in ordered)))

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(work, range(workers)))
    by_key = {k: chosen.decide(LOGITS, k) for k in keys}
    for result in results:
        assert all(result[k] is by_key[k] for k in keys)
    assert [by_key[k].backend for k in keys] == ["a", "a", "b", "b", "c", "b"]
