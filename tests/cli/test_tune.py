"""`dispatch tune` end to end on the CPU (torch reference and the Triton interpreter at tiny shapes):
tune writes an overlay, validate accepts it, a cluster including it decides by it and explain shows the
evidence, validate warns when the evidence is stale, and a backend that fails its check is never preferred."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

import torch

from backends.reference.paged_mqa_logits import run_paged_mqa_logits
from backends.reference.ragged_mqa_logits import run_ragged_mqa_logits
from dispatch.contract.backend import Backend, Support
from dispatch.bench.tune import measure_overlay
from dispatch.cli.commands import main
from dispatch.contract import PAGED_MODES, Layout, Op
from dispatch.contract.errors import RegistryError
from dispatch.step.extend_plan import build_extend_plan
from dispatch.contract.key import Arch, DispatchKey, Fp8Dtype, ForwardMode
from dispatch.step.paged_plan import EXTEND_STEP_OPS
from dispatch.contract.host import collect_backends
from dispatch.step.extend_batch import ExtendBatch
from dispatch.registry.document import load_registry
from dispatch.registry.measured import MEASURED_TIE, load_measured, parse_measured
from dispatch.deciding.runtime import build_dispatcher, load_plugins
from dispatch.contract.version import dispatch_version
from tests.support.documentation import documentation_text
from tests.support.fakes import fake_plugin
from tests.support.reference_registry import dispatcher_with_overlay

REGISTRY = """\
version: 1
ops:
  paged_mqa_logits:
    rules:
      - id: cpu-reference
        when: {arch: cpu}
        use: [torch.reference]
    fallback: [torch.reference]
  indexer_q_quant:
    fallback: [torch.reference]
  topk:
    fallback: [torch.reference]
  ragged_mqa_logits:
    fallback: [torch.reference]
clusters:
  ci-cpu:
    workload: {next_n: [1, 2]}
"""
INCLUDED = REGISTRY + "    measured: measured/ci-cpu.yaml\n"
DECODE = DispatchKey(Arch.CPU, ForwardMode.DECODE, 1, Fp8Dtype.E4M3FN)
VERIFY = DispatchKey(Arch.CPU, ForwardMode.TARGET_VERIFY, 2, Fp8Dtype.E4M3FN)
DRAFT = DispatchKey(Arch.CPU, ForwardMode.DRAFT_EXTEND, 2, Fp8Dtype.E4M3FN)
EXTEND = DispatchKey(Arch.CPU, ForwardMode.EXTEND, 1, Fp8Dtype.E4M3FN)
QUICK_EXTEND = "M=48 S=128 R=2 H=64 D=128"  # --quick's extend batch: 2 requests of 24 new tokens after 40 cached


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """(registry path, overlay path, tune's exit code): one quick tune, shared by the tests below."""
    folder = tmp_path_factory.mktemp("tuned")
    registry = folder / "registry.yaml"
    registry.write_text(REGISTRY)
    overlay = folder / "measured" / "ci-cpu.yaml"
    code = main(["tune", "--registry", str(registry), "--cluster", "ci-cpu", "--quick", "-o", str(overlay)])
    registry.write_text(INCLUDED)  # as an operator would after reviewing the overlay
    return registry, overlay, code


def test_tune_measures_every_eligible_backend_per_key(tuned):
    registry, overlay_path, code = tuned
    assert code == 0
    measured = load_measured(overlay_path)
    overlay = measured.overlay
    assert overlay.cluster == "ci-cpu" and overlay.machine.startswith("CPU")
    assert overlay.workload.next_n == (1, 2) and overlay.workload.fp8_dtype is Fp8Dtype.E4M3FN
    catalog = collect_backends(load_plugins())
    logits = overlay.ops[Op.PAGED_MQA_LOGITS]
    assert {b: v for b, v in logits.versions.items()} == {
        name: str(catalog.get(Op.PAGED_MQA_LOGITS, name).version)
        for name in ("torch.reference", "torch.reference.flatten", "triton", "triton.flatten")
    }
    for key in (DECODE, VERIFY, DRAFT):  # target_verify and draft_extend share one measurement
        _, preference = measured.find(Op.PAGED_MQA_LOGITS, key)
        assert set(preference.order) == set(logits.versions) and not preference.failed
        means = [preference.mean_us(name) for name in preference.order]
        assert means == sorted(means)
        assert [s.shape for s in preference.shapes] == [f"B=2 N={key.next_n} L~256 H=64 D=128"]
    _, quant = measured.find(Op.INDEXER_Q_QUANT, VERIFY)
    assert set(quant.order) == {"torch.reference", "triton"}
    _, topk = measured.find(Op.TOPK, VERIFY)
    assert set(topk.order) == {"torch.reference", "triton"}  # the Triton top-k is eligible on the CPU too
    assert overlay.dispatch == dispatch_version()


def test_tune_measures_the_extend_key_over_the_workloads_extend_batches(tuned):
    _, overlay_path, _ = tuned
    measured = load_measured(overlay_path)
    assert (measured.overlay.workload.extend_requests, measured.overlay.workload.extend_lens,
            measured.overlay.workload.prefix_lens) == ((2,), (24,), (40,))
    shapes = {Op.INDEXER_Q_QUANT: "T=48 H=64 D=128 rot=64", Op.RAGGED_MQA_LOGITS: QUICK_EXTEND, Op.TOPK: f"{QUICK_EXTEND} k=64"}
    for op in EXTEND_STEP_OPS:  # every op the extend step runs has a CPU choice: the reference or Triton
        found = measured.find(op, EXTEND)
        assert found is not None, f"no measured preference for {op.value} at {EXTEND}"
        _, preference = found
        assert set(preference.order) == {"torch.reference", "triton"} and not preference.failed
        assert [s.shape for s in preference.shapes] == [shapes[op]]
        assert preference.key.forward_mode == (ForwardMode.EXTEND,)
    ragged = measured.overlay.ops[Op.RAGGED_MQA_LOGITS]
    # The ragged op runs only in extend batches: no paged key is measured for it.
    assert [p.key.forward_mode for p in ragged.preferences] == [(ForwardMode.EXTEND,)]
    catalog = collect_backends(load_plugins())
    assert ragged.versions == {name: str(catalog.get(Op.RAGGED_MQA_LOGITS, name).version) for name in ("torch.reference", "triton")}


def test_the_dispatcher_and_explain_follow_the_measured_extend_choice(tuned, capsys):
    registry, overlay_path, _ = tuned
    measured = load_measured(overlay_path)
    dispatcher = build_dispatcher(load_registry(registry), collect_backends(load_plugins()), cluster="ci-cpu")
    batch = ExtendBatch.from_lengths([3, 0], [5, 2], torch.arange(4, dtype=torch.int32).view(2, 2))
    plan = build_extend_plan(dispatcher, batch, kv_fp8_dtype=Fp8Dtype.E4M3FN, prepare=False)
    for op in EXTEND_STEP_OPS:
        preference = measured.find(op, EXTEND)[1]
        decision = plan.decisions[op]
        assert (decision.source, decision.backend) == ("measured", preference.order[0]), op
        assert decision.rule_at.startswith(f"{overlay_path}:") and decision.evidence is not None
    preference = measured.find(Op.RAGGED_MQA_LOGITS, EXTEND)[1]
    summary = plan.decisions[Op.RAGGED_MQA_LOGITS].evidence.summary()
    args = ["explain", "--registry", str(registry), "--cluster", "ci-cpu", "--forward-mode", "extend"]
    for extra in ([], ["--extend-lens", "5,2", "--prefix-lens", "3,0"]):  # one key, and a whole extend plan
        assert main(args + extra) == 0
        text = capsys.readouterr().out
        block = text[text.index("ragged_mqa_logits for arch=cpu forward_mode=extend"):]
        assert "by:       cluster `ci-cpu` measured[0]" in block
        assert f"evidence: {summary}" in block and QUICK_EXTEND in summary
        assert f"chosen:   {preference.order[0]}" in block


def test_validate_accepts_it_and_a_cluster_decides_by_it(tuned, capsys):
    registry, overlay_path, _ = tuned
    assert main(["validate", str(registry)]) == 0
    out, err = capsys.readouterr()
    assert "1 measured overlay " in out
    assert "stale evidence" not in err  # just measured by this tree (its version carries the commit)
    preference = load_measured(overlay_path).find(Op.PAGED_MQA_LOGITS, VERIFY)[1]
    args = ["explain", "--registry", str(registry), "--cluster", "ci-cpu", "--forward-mode", "target_verify", "--next-n", "2"]
    assert main(args + ["--json"]) == 0
    decision = json.loads(capsys.readouterr().out)["decisions"][0]
    assert decision["source"] == "measured" and decision["backend"] == preference.order[0]
    assert decision["rule_at"].startswith(f"{overlay_path}:")
    evidence = decision["evidence"]
    assert evidence["machine"].startswith("CPU") and evidence["shapes"][0]["shape"] == "B=2 N=2 L~256 H=64 D=128"
    assert list(evidence["mean_us"]) == list(preference.order)
    reasons = {r["backend"]: r["reason"] for r in decision["rejected"]}
    chosen = preference.order[0]
    for slower in preference.order[1:]:
        times = f"{preference.mean_us(slower):.1f} us vs {preference.mean_us(chosen):.1f} us ({chosen})"
        # Timed here, on the CPU: two reference backends can land within MEASURED_TIE of each other (one CI
        # run measured 962.5 against 961.2 us), and such a pair is reported level, not slower.
        if preference.mean_us(slower) <= preference.mean_us(chosen) * (1 + MEASURED_TIE):
            assert reasons[slower] == (f"measured level: {times}, within {MEASURED_TIE:.0%}, where the rules' order "
                                       f"puts {chosen} first")
        else:
            assert reasons[slower] == f"measured slower: {times}"
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "by:       cluster `ci-cpu` measured[0]" in text
    assert f"evidence: measured on {evidence['machine']}, {evidence['date']}: {preference.order[0]} " in text


def test_the_fingerprint_covers_the_overlay(tuned, tmp_path):
    registry, overlay_path, _ = tuned
    with_overlay = load_registry(registry).fingerprint
    data = yaml.safe_load(overlay_path.read_text())
    shape = data["ops"]["paged_mqa_logits"]["preferences"][0]["shapes"][0]["median_us"]
    slowest = data["ops"]["paged_mqa_logits"]["preferences"][0]["order"][-1]
    shape[slowest] *= 2  # the order still holds; only the evidence differs
    (tmp_path / "measured").mkdir()
    (tmp_path / "measured" / "ci-cpu.yaml").write_text(yaml.safe_dump(data) + "# end\n")
    (tmp_path / "registry.yaml").write_text(INCLUDED)
    assert load_registry(tmp_path / "registry.yaml").fingerprint != with_overlay
    (tmp_path / "registry.yaml").write_text(REGISTRY)
    assert load_registry(tmp_path / "registry.yaml").fingerprint != with_overlay


def test_validate_warns_when_the_evidence_is_stale(tuned, tmp_path, capsys):
    registry, overlay_path, _ = tuned
    data = yaml.safe_load(overlay_path.read_text())
    versions = data["ops"]["paged_mqa_logits"]["versions"]
    versions["triton"] = "0.0.1"
    versions["gone.backend"] = "1.0"
    (tmp_path / "measured").mkdir()
    (tmp_path / "measured" / "ci-cpu.yaml").write_text(yaml.safe_dump(data) + "# end\n")
    (tmp_path / "registry.yaml").write_text(INCLUDED)
    assert main(["validate", str(tmp_path / "registry.yaml")]) == 0  # a warning, not a failure
    err = capsys.readouterr().err.splitlines()
    stale = [line for line in err if "stale evidence" in line]
    assert len(stale) == 2, err
    overlay = tmp_path / "measured" / "ci-cpu.yaml"
    assert any(
        line.startswith(f"warning: {overlay}:") and "ops.paged_mqa_logits.versions.triton" in line
        and "measured at version 0.0.1" in line for line in stale
    )
    assert any("`gone.backend` was measured but is not registered for paged_mqa_logits" in line for line in stale)


def _skewed_logits(plan, q, kv_cache, weights, *, clean_logits=True):
    return run_paged_mqa_logits(plan, q, kv_cache, weights) * 1.001  # 1e-3 off: fails the CPU check (1e-5)


def _skewed_ragged(q, k, scales, weights, ks, ke, *, fp8_dtype, clean_logits=True):
    return run_ragged_mqa_logits(q, k, scales, weights, ks, ke, fp8_dtype=fp8_dtype) * 1.001


def test_a_backend_that_fails_its_check_is_never_preferred(tmp_path):
    skewed = Backend(
        name="skewed", op=Op.PAGED_MQA_LOGITS, layout=Layout.NATIVE,
        supports=Support(forward_modes=PAGED_MODES), run=_skewed_logits, version="9",
    )
    skewed_ragged = Backend(
        name="skewed", op=Op.RAGGED_MQA_LOGITS, layout=Layout.RAGGED,
        supports=Support(forward_modes=frozenset({ForwardMode.EXTEND})), run=_skewed_ragged, version="9",
    )
    catalog = collect_backends(load_plugins() + [fake_plugin("skewed-plugin", skewed, skewed_ragged)])
    text = REGISTRY.replace("next_n: [1, 2]", "next_n: [1]").replace("  ci-cpu:\n", "  ci-cpu:\n    prefer: []\n")
    (tmp_path / "registry.yaml").write_text(text)
    dispatcher = build_dispatcher(load_registry(tmp_path / "registry.yaml"), catalog, cluster="ci-cpu")
    overlay_text, failures = measure_overlay(dispatcher, quick=True, output=str(tmp_path / "measured" / "ci-cpu.yaml"))
    assert failures == 2  # one paged key, one extend key
    dispatcher = dispatcher_with_overlay(tmp_path, text, overlay_text, catalog)
    for op, key in ((Op.PAGED_MQA_LOGITS, DECODE), (Op.RAGGED_MQA_LOGITS, EXTEND)):
        preference = parse_measured(overlay_text).find(op, key)[1]
        assert "skewed" not in preference.order and preference.failed["skewed"].startswith("error "), op
        decision = dispatcher.decide(op, key)
        assert decision.backend == preference.order[0] and decision.source == "measured"
        reasons = {r.backend: r.reason for r in decision.rejected}
        assert reasons["skewed"].startswith("failed the check against the reference when measured: error ")
        assert decision.evidence.failed == (("skewed", preference.failed["skewed"]),)


def test_a_cluster_prefer_still_comes_before_the_measured_order(tuned, tmp_path):
    registry, overlay_path, _ = tuned
    order = load_measured(overlay_path).find(Op.PAGED_MQA_LOGITS, DECODE)[1].order
    (tmp_path / "measured").mkdir()
    (tmp_path / "measured" / "ci-cpu.yaml").write_text(overlay_path.read_text())
    (tmp_path / "registry.yaml").write_text(INCLUDED + f"    prefer: [{order[-1]}]\n")
    catalog = collect_backends(load_plugins())
    decision = build_dispatcher(load_registry(tmp_path / "registry.yaml"), catalog, cluster="ci-cpu").decide(
        Op.PAGED_MQA_LOGITS, DECODE
    )
    assert decision.backend == order[-1] and decision.source == "cluster-prefer" and decision.evidence is None
    reasons = {r.backend: r.reason for r in decision.rejected}
    assert reasons[order[0]] == f"eligible, but cluster `ci-cpu` prefer[0] (`{order[-1]}`) comes before cluster `ci-cpu` measured"


def test_the_overlay_says_where_it_came_from_and_how_to_include_it(tuned):
    _, overlay_path, _ = tuned
    text = overlay_path.read_text()
    assert text.startswith("# Measured by `python -m dispatch tune --cluster ci-cpu` on CPU")
    assert "# A cluster includes it with `measured: measured/ci-cpu.yaml`" in text
    assert parse_measured(text).overlay.ops


# --- the overlay's schema: every error names file, line and key -------------------------------------

OVERLAY = """\
version: 1
cluster: h200-mtp
machine: NVIDIA H200
date: 2026-11-30
dispatch: 0.1.0
torch: 2.11.0+cu130
triton: 3.6.0
workload: {batch_sizes: [128], lengths: [32768], next_n: [1]}
ops:
  paged_mqa_logits:
    versions: {triton: 3.6.0, deepgemm.sm90: sgl-deep-gemm 0.1.5}
    preferences:
      - key: {arch: sm90, forward_mode: decode, next_n: 1, fp8_dtype: e4m3fn}
        order: [triton, deepgemm.sm90]
        shapes:
          - shape: B=128 N=1 L~32K H=64 D=128
            median_us: {triton: 161.9, deepgemm.sm90: 202.6}
# end
"""


def overlay_error(old: str, new: str) -> str:
    text = OVERLAY.replace(old, new)
    assert text != OVERLAY
    with pytest.raises(RegistryError) as error:
        parse_measured(text, "h200.yaml")
    return str(error.value)


def test_a_valid_overlay_parses():
    measured = parse_measured(OVERLAY, "h200.yaml")
    _, preference = measured.find(Op.PAGED_MQA_LOGITS, DispatchKey(Arch.SM90, ForwardMode.DECODE, 1, Fp8Dtype.E4M3FN))
    assert preference.order == ("triton", "deepgemm.sm90") and preference.mean_us("deepgemm.sm90") == 202.6


def test_an_order_within_the_tie_is_accepted_and_past_it_refused():
    """tune keeps backends within 1% in the registry's order, so the check allows that and no more."""
    def with_times(triton, deepgemm):
        return OVERLAY.replace("{triton: 161.9, deepgemm.sm90: 202.6}", f"{{triton: {triton}, deepgemm.sm90: {deepgemm}}}")

    assert parse_measured(with_times(161.9, 160.4), "h200.yaml")  # 0.94% slower first: a tie
    with pytest.raises(RegistryError, match="the measured order is fastest first"):
        parse_measured(with_times(161.9, 160.1), "h200.yaml")  # 1.1%


@pytest.mark.parametrize(
    "old, new, line, key, message",
    [
        ("order: [triton, deepgemm.sm90]", "order: [deepgemm.sm90, triton]", 13, "ops.paged_mqa_logits.preferences[0]",
         "`order` puts `deepgemm.sm90` (202.6 us) before `triton` (161.9 us); the measured order is fastest first"),
        ("{triton: 161.9, deepgemm.sm90: 202.6}", "{triton: 161.9}", 13, "ops.paged_mqa_logits.preferences[0]",
         "every ordered backend needs a time at every shape"),
        ("triton: 161.9,", "triton: -1.0,", 17, "ops.paged_mqa_logits.preferences[0].shapes[0].median_us.triton",
         "greater than 0"),
        ("forward_mode: decode, next_n: 1", "forward_mode: decode, next_n: 2", 13, "ops.paged_mqa_logits.preferences[0].key",
         "decode verifies one token per request"),
        ("fp8_dtype: e4m3fn}", "fp8_dtype: e4m3fnuz}", 13, "ops.paged_mqa_logits.preferences[0].key",
         "cannot occur on `arch` sm90"),
        ("versions: {triton: 3.6.0, ", "versions: {", 14, "ops.paged_mqa_logits.preferences[0].order[0]",
         "`triton` has no entry in ops.paged_mqa_logits.versions"),
        ("        shapes:", "        failed: {triton: NaN in output}\n        shapes:", 13,
         "ops.paged_mqa_logits.preferences[0]", "`triton` failed the check and cannot be in `order`"),
        ("  paged_mqa_logits:", "  paged_logits:", 10, "ops.paged_logits", "is not allowed"),
        ("date: 2026-11-30", "date: yesterday", 4, "date", "date"),
        ("machine: NVIDIA H200", "machine: NVIDIA H200\nwhen: now", 4, "when", "unknown field"),
        ("version: 1", "version: 2", 1, "version", "1"),
        ("workload: {batch_sizes: [128]", "workload: {batch_sizes: [0]", 8, "workload.batch_sizes[0]", "greater than or equal to 1"),
    ],
)
def test_overlay_errors_name_file_line_and_key(old, new, line, key, message):
    error = overlay_error(old, new)
    assert error.startswith(f"h200.yaml:{line}: {key}: "), error
    assert message in error, error


def test_a_key_measured_twice_is_refused():
    entry = OVERLAY[OVERLAY.index("      - key:"):OVERLAY.index("# end")]
    error = overlay_error(entry, entry + entry)
    assert error.startswith("h200.yaml:18: ops.paged_mqa_logits.preferences[1].key: "), error
    assert "measures arch=sm90 forward_mode=decode next_n=1 fp8_dtype=e4m3fn again (also preferences[0])" in error


def test_a_cluster_names_a_missing_or_foreign_overlay_at_its_line(tmp_path):
    text = REGISTRY + "    measured: measured/none.yaml\n"
    (tmp_path / "registry.yaml").write_text(text)
    with pytest.raises(RegistryError) as error:
        load_registry(tmp_path / "registry.yaml")
    assert str(error.value).startswith(f"{tmp_path / 'registry.yaml'}:18: clusters.ci-cpu.measured: the measured overlay ")
    (tmp_path / "measured").mkdir()
    (tmp_path / "measured" / "none.yaml").write_text(OVERLAY)  # measured for h200-mtp
    with pytest.raises(RegistryError) as error:
        load_registry(tmp_path / "registry.yaml")
    assert "was measured for cluster `h200-mtp`, not `ci-cpu`" in str(error.value)
    (tmp_path / "measured" / "none.yaml").write_text(OVERLAY.replace("cluster: h200-mtp\n", "").replace("161.9", "x"))
    with pytest.raises(RegistryError) as error:
        load_registry(tmp_path / "registry.yaml")
    assert str(error.value).startswith(f"{tmp_path / 'measured' / 'none.yaml'}:16: "), error.value  # the overlay's own line


def test_the_registry_schema_documents_workload_and_measured():
    from dispatch.registry.models import Registry

    cluster = Registry.model_json_schema()["$defs"]["Cluster"]["properties"]
    assert {"workload", "measured"} <= set(cluster)


def test_a_time_budget_caps_the_repeats_of_a_slow_call():
    from dispatch.bench.timing import time_host

    calls = []

    def slow():
        calls.append(1)
        import time

        time.sleep(0.02)

    assert time_host(slow, repeats=50, warmup=1, budget_s=0.01) >= 0.02
    assert len(calls) == 1 + 1 + 3  # the estimate, one warm-up, then 3 timed calls (the floor)


def test_workload_block_is_validated_in_the_registry(tmp_path):
    text = REGISTRY.replace("workload: {next_n: [1, 2]}", "workload: {next_n: [0]}")
    (tmp_path / "registry.yaml").write_text(textwrap.dedent(text))
    with pytest.raises(RegistryError) as error:
        load_registry(tmp_path / "registry.yaml")
    assert str(error.value).startswith(f"{tmp_path / 'registry.yaml'}:17: clusters.ci-cpu.workload.next_n[0]: ")


def test_the_documented_overlay_example_is_one_the_loader_accepts():
    docs = documentation_text()  # the example is docs/tune.md's
    section = docs[docs.index("**The overlay**"):]
    example = section[section.index("```yaml\n") + 8 : section.index("```\n", section.index("```yaml\n") + 8)]
    measured = parse_measured(example, "docs/tune.md")
    key = DispatchKey(Arch.SM90, ForwardMode.DECODE, 1, Fp8Dtype.E4M3FN)
    assert measured.find(Op.PAGED_MQA_LOGITS, key)[1].order[0] == "deepgemm.sm90"


def test_every_overlay_error_is_listed_in_file_order():
    text = OVERLAY.replace("date: 2026-11-30", "date: yesterday").replace("triton: 161.9,", "triton: 0,")
    with pytest.raises(RegistryError) as error:
        parse_measured(text, "h200.yaml")
    lines = str(error.value).splitlines()
    assert [line.split(": ")[0] for line in lines] == ["h200.yaml:4", "h200.yaml:17"], lines


def test_a_workload_is_bounded_to_what_one_machine_measures_in_minutes(tmp_path):
    text = REGISTRY.replace("workload: {next_n: [1, 2]}", "workload: {next_n: [1, 100000], batch_sizes: []}")
    (tmp_path / "registry.yaml").write_text(text)
    with pytest.raises(RegistryError) as error:
        load_registry(tmp_path / "registry.yaml")
    message = str(error.value)
    assert "clusters.ci-cpu.workload.batch_sizes: name at least one" in message, message
    assert "clusters.ci-cpu.workload.next_n[1]: Input should be less than or equal to 64" in message, message


@pytest.mark.parametrize(
    "workload, key, message",
    [
        ("{prefix_lens: [0, -1]}", "clusters.ci-cpu.workload.prefix_lens[1]", "greater than or equal to 0"),
        ("{extend_lens: [0]}", "clusters.ci-cpu.workload.extend_lens[0]", "greater than or equal to 1"),
        ("{extend_requests: []}", "clusters.ci-cpu.workload.extend_requests", "name at least one"),
        ("{extend_requests: [16], extend_lens: [4096], prefix_lens: [0, 12288]}", "clusters.ci-cpu.workload",
         "the largest extend batch (`extend_requests` 16, `extend_lens` 4096, `prefix_lens` 12288) has fp32 logits "
         "[M=65536, S=262144] of 64.0 GiB, more than the 8 GiB tune holds per batch"),
    ],
)
def test_the_extend_workload_is_validated_naming_the_key(tmp_path, workload, key, message):
    (tmp_path / "registry.yaml").write_text(REGISTRY.replace("workload: {next_n: [1, 2]}", f"workload: {workload}"))
    with pytest.raises(RegistryError) as error:
        load_registry(tmp_path / "registry.yaml")
    assert str(error.value).startswith(f"{tmp_path / 'registry.yaml'}:17: {key}: "), error.value
    assert message in str(error.value), error.value


def test_the_default_workload_covers_serving_extend():
    from dispatch.bench.extend_tune import extend_shapes
    from dispatch.registry.models import Workload

    labels = [shape.label() for shape in extend_shapes(Workload())]
    assert labels == ["M=4K S=4K R=4 H=64 D=128", "M=4K S=52K R=4 H=64 D=128", "M=16K S=16K R=4 H=64 D=128",
                      "M=16K S=64K R=4 H=64 D=128"]


@pytest.mark.parametrize(
    "order, means, rule_order, expected",
    [
        # Within 1%: the registry's order (native before flatten), whatever the noise said.
        (["triton.flatten", "triton", "deepgemm.sm90"], [28.80, 28.81, 37.2], ["triton", "deepgemm.sm90"],
         ["triton", "triton.flatten", "deepgemm.sm90"]),
        # Past 1%: measured order stands.
        (["triton.flatten", "triton"], [28.0, 28.9], ["triton"], ["triton.flatten", "triton"]),
        # A backend the rule does not name never moves ahead of one it names.
        (["a", "b", "c"], [10.0, 10.05, 10.06], ["c", "b"], ["c", "b", "a"]),
        ([], [], ["x"], []),
    ],
)
def test_measured_ties_keep_the_registry_order(order, means, rule_order, expected):
    from dispatch.bench.ordering import measured_order

    assert measured_order(order, dict(zip(order, means)).__getitem__, rule_order) == expected
