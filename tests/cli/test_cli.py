"""`python -m dispatch` through dispatch.cli.commands.main: explain, validate, backends; exit codes 0 / 1 / 2 and
clean messages (no traceback) for user mistakes."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from dispatch.cli.commands import main
from tests.support.cli_session import clean_environment, run  # noqa: F401 (clean_environment: an autouse fixture)

LOGITS_KEYS = {"op", "key", "backend", "layout", "rule", "cluster", "plugin", "rejected"}




def explain_json(capsys, *argv) -> dict:
    """The one decision of a one-op explain (every --json explain prints {"decisions": [...], "plan": ...})."""
    (decision,) = explain_all_json(capsys, *argv)["decisions"]
    return decision


def explain_all_json(capsys, *argv) -> dict:
    code, out, err = run(capsys, "explain", "--json", *argv)
    assert code == 0, err
    payload = json.loads(out)
    assert set(payload) == {"decisions", "plan"}
    return payload


def logits_backends(capsys) -> set[str]:
    code, out, _ = run(capsys, "backends", "--json")
    assert code == 0
    return {row["name"] for row in json.loads(out) if row["op"] == "paged_mqa_logits"}


def assert_decision_shape(payload: dict, capsys) -> None:
    assert LOGITS_KEYS <= set(payload)
    assert isinstance(payload["rejected"], list)
    for rejection in payload["rejected"]:
        assert set(rejection) == {"backend", "reason"} and rejection["reason"]
    # every other registered backend is listed once, with its reason
    names = [r["backend"] for r in payload["rejected"]]
    assert len(names) == len(set(names))
    assert set(names) | {payload["backend"]} == logits_backends(capsys)


def test_explain_sm100_target_verify(capsys):
    payload = explain_json(
        capsys, "--arch", "sm100", "--forward-mode", "target_verify", "--next-n", "4", "--fp8-dtype", "e4m3fn"
    )
    assert payload["op"] == "paged_mqa_logits"
    assert payload["key"] == {"arch": "sm100", "forward_mode": "target_verify", "next_n": 4, "fp8_dtype": "e4m3fn"}
    assert (payload["backend"], payload["layout"], payload["rule"]) == (
        "deepgemm.sm100",
        "native",
        "sm100-deepgemm-native",
    )
    assert payload["plugin"] == "backends.deepgemm.plugin"
    assert payload["cluster"] is None
    assert payload["availability_checked"] is False  # sm100 on this machine is a what-if
    assert_decision_shape(payload, capsys)
    reasons = {r["backend"]: r["reason"] for r in payload["rejected"]}
    assert reasons["triton"] == "eligible, but rule `sm100-deepgemm-native` lists `deepgemm.sm100` before it"


@pytest.mark.parametrize(
    "next_n, backend, rule",
    [(2, "deepgemm.sm90", "sm90-deepgemm-measured"), (3, "triton", "sm90-beyond-deepgemm"),
     (4, "deepgemm.sm90.n4", "sm90-deepgemm-next-n4")],
)
def test_explain_sm90(capsys, next_n, backend, rule):
    payload = explain_json(capsys, "--arch", "sm90", "--forward-mode", "target_verify", "--next-n", str(next_n))
    assert payload["key"]["fp8_dtype"] == "e4m3fn"
    assert (payload["backend"], payload["rule"], payload["cluster"]) == (backend, rule, None)
    assert_decision_shape(payload, capsys)


def test_explain_sm90_on_an_h200_applies_its_cluster(capsys, clean_environment):
    clean_environment.setattr("dispatch.deciding.clusters.gpu_name", lambda: "NVIDIA H200")
    payload = explain_json(capsys, "--arch", "sm90", "--forward-mode", "target_verify", "--next-n", "4")
    # The H200 cluster prefers it (measured ahead there on 2026-12-01; the later overlay ran without a build of it).
    assert (payload["backend"], payload["cluster"], payload["source"]) == ("deepgemm.sm90.n4", "h200-mtp", "cluster-prefer")
    reasons = {r["backend"]: r["reason"] for r in payload["rejected"]}
    assert (
        reasons["deepgemm.sm90.flatten"] == "rule `sm90-deepgemm-next-n4` names it, but disabled by cluster `h200-mtp`"
    )


def test_explain_gfx942_uses_fnuz(capsys):
    payload = explain_json(capsys, "--arch", "gfx942", "--forward-mode", "target_verify", "--next-n", "3")
    assert payload["key"] == {"arch": "gfx942", "forward_mode": "target_verify", "next_n": 3, "fp8_dtype": "e4m3fnuz"}
    assert (payload["backend"], payload["rule"]) == ("rocm.fnuz", "gfx942-fnuz")
    assert_decision_shape(payload, capsys)


def test_explain_text_says_what_if_and_lists_rejections(capsys):
    code, out, err = run(capsys, "explain", "--arch", "sm100", "--forward-mode", "target_verify", "--next-n", "4")
    assert code == 0 and err == ""
    assert "what-if" in out
    assert "chosen:   deepgemm.sm100" in out
    assert "rule `sm100-deepgemm-native` (" in out and "registry.yaml:" in out
    assert "rejected:" in out and "triton" in out


needs_cpu_host = pytest.mark.skipif(torch.cuda.is_available(), reason="explains this machine, which must be a CPU host")


@needs_cpu_host
def test_explain_this_machine(capsys):
    code, out, err = run(capsys, "explain")
    assert code == 0, err
    assert "torch.reference" in out and "what-if" not in out
    payload = explain_json(capsys)
    assert payload["key"] == {"arch": "cpu", "forward_mode": "decode", "next_n": 1, "fp8_dtype": "e4m3fn"}
    assert (payload["backend"], payload["rule"], payload["availability_checked"]) == (
        "torch.reference",
        "cpu-reference",
        True,
    )
    assert payload["plugin"] == "backends.reference.plugin"


@needs_cpu_host
def test_explain_all_ops(capsys):
    payload = explain_all_json(capsys, "--op", "all", "--forward-mode", "target_verify", "--next-n", "3")["decisions"]
    assert [d["op"] for d in payload] == ["paged_mqa_logits", "indexer_q_quant", "topk"]
    assert [d["backend"] for d in payload] == ["torch.reference", "torch.reference", "torch.reference"]
    for decision in payload:
        assert LOGITS_KEYS <= set(decision)
        assert decision["key"] == payload[0]["key"]
    code, out, _ = run(capsys, "explain", "--op", "all")
    assert code == 0 and "paged_mqa_logits for" in out and "indexer_q_quant for" in out and "topk for" in out


def write_registry(tmp_path, text: str):
    path = tmp_path / "registry.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_exit_1_when_no_backend_fits(capsys, tmp_path):
    path = write_registry(
        tmp_path,
        """\
        version: 1
        ops:
          paged_mqa_logits:
            rules:
              - id: only-reference
                when: {arch: cpu}
                use: [torch.reference]
            fallback: [torch.reference.flatten]
          indexer_q_quant: {fallback: [torch.reference]}
          topk: {fallback: [torch.reference]}
          ragged_mqa_logits: {fallback: [torch.reference]}
        """,
    )
    code, out, err = run(
        capsys, "explain", "--registry", str(path), "--arch", "cpu", "--forward-mode", "extend", "--next-n", "2",
        "--op", "paged_mqa_logits",
    )
    assert code == 1
    assert out == "" and "Traceback" not in err
    assert err.startswith("dispatch: no backend for paged_mqa_logits at arch=cpu forward_mode=extend next_n=2")
    assert "torch.reference: rule `only-reference` names it, but forward_mode extend not supported" in err
    assert "torch.reference.flatten: fallback[0] names it, but forward_mode extend not supported" in err
    listed = {line.strip().split(":")[0] for line in err.splitlines()[1:]}
    assert listed == logits_backends(capsys)  # every candidate, with its reason


def assert_clean_exit_2(code: int, out: str, err: str) -> None:
    assert code == 2
    assert out == ""
    assert err.startswith("dispatch: ") and "Traceback" not in err


def test_exit_2_on_an_invalid_registry(capsys, tmp_path):
    path = write_registry(
        tmp_path,
        "version: 1\nops:\n  paged_mqa_logits:\n    rules:\n      - id: a\n        use: [triton]\n        when: {arch: sm77}\n",
    )
    code, out, err = run(capsys, "validate", str(path))
    assert_clean_exit_2(code, out, err)
    assert f"{path}:7: ops.paged_mqa_logits.rules[0].when.arch" in err and "'sm77'" in err
    code, out, err = run(capsys, "explain", "--registry", str(path), "--arch", "cpu")
    assert_clean_exit_2(code, out, err)
    assert f"{path}:7:" in err


def test_exit_2_on_an_unknown_backend_name(capsys, tmp_path):
    path = write_registry(
        tmp_path, "version: 1\nops:\n  paged_mqa_logits:\n    fallback: [torch.reference, no.such.backend]\n  indexer_q_quant: {fallback: [torch.reference]}\n  topk: {fallback: [torch.reference]}\n  ragged_mqa_logits: {fallback: [torch.reference]}\n"
    )
    code, out, err = run(capsys, "validate", str(path))
    assert_clean_exit_2(code, out, err)
    assert f"{path}:4: ops.paged_mqa_logits.fallback[1]: unknown backend `no.such.backend`" in err


def test_exit_2_on_lint_findings(capsys, tmp_path):
    path = write_registry(
        tmp_path,
        """\
        version: 1
        ops:
          paged_mqa_logits:
            rules:
              - id: everything
                use: [torch.reference]
              - id: cpu
                when: {arch: cpu}
                use: [torch.reference]
          indexer_q_quant: {fallback: [torch.reference]}
          topk: {fallback: [torch.reference]}
          ragged_mqa_logits: {fallback: [torch.reference]}
        """,
    )
    code, out, err = run(capsys, "validate", str(path))
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"lint: {path}:7: ops.paged_mqa_logits.rules[1]: rule `cpu` can never fire" in err


def test_exit_2_on_a_missing_registry_file_names_it_and_the_default(capsys, tmp_path, clean_environment):
    from dispatch.deciding.runtime import DEFAULT_REGISTRY

    code, out, err = run(capsys, "validate", str(tmp_path / "missing.yaml"))
    assert_clean_exit_2(code, out, err)
    assert f"{tmp_path / 'missing.yaml'}: no registry file there (the path given)" in err
    assert f"the packaged default is {DEFAULT_REGISTRY}" in err
    clean_environment.setenv("DISPATCH_REGISTRY", str(tmp_path / "env.yaml"))
    code, out, err = run(capsys, "explain")
    assert_clean_exit_2(code, out, err)
    assert "env.yaml: no registry file there (DISPATCH_REGISTRY)" in err and str(DEFAULT_REGISTRY) in err


def test_the_packaged_registry_is_the_top_level_file():
    from pathlib import Path

    from dispatch.deciding.runtime import DEFAULT_REGISTRY

    top_level = Path(__file__).resolve().parents[2] / "registry.yaml"
    assert DEFAULT_REGISTRY == top_level  # dispatch/registry.yaml links to it: one file to edit


def test_a_foreign_backends_package_is_named(monkeypatch, tmp_path):
    import sys
    import types

    from dispatch.contract.errors import PluginError
    from dispatch.contract.host import builtin_plugins

    foreign = types.ModuleType("backends")
    foreign.__file__ = str(tmp_path / "backends" / "__init__.py")
    monkeypatch.setitem(sys.modules, "backends", foreign)
    with pytest.raises(PluginError, match="which is not dispatch-dsa's built-in backends package"):
        builtin_plugins()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--arch", "gfx942", "--fp8-dtype", "e4m3fn"], "`fp8_dtype` e4m3fn cannot occur on `arch` gfx942"),
        (["--arch", "sm90", "--fp8-dtype", "e4m3fnuz"], "`fp8_dtype` e4m3fnuz cannot occur on `arch` sm90"),
        (["--arch", "sm90", "--forward-mode", "decode", "--next-n", "2"], "`next_n` is 2 with forward_mode `decode`"),
        (["--arch", "sm90", "--forward-mode", "target_verify", "--next-n", "0"], "`next_n` is 0"),
    ],
)
def test_exit_2_on_an_invalid_key(capsys, argv, words):
    code, out, err = run(capsys, "explain", *argv)
    assert_clean_exit_2(code, out, err)
    assert words in err


def test_exit_2_on_an_unknown_cluster(capsys, clean_environment):
    code, out, err = run(capsys, "explain", "--arch", "sm90", "--cluster", "nope")
    assert_clean_exit_2(code, out, err)
    assert "unknown cluster `nope` (declared: `h200-mtp`, `reference-only`)" in err
    clean_environment.setenv("DISPATCH_CLUSTER", "also-nope")
    code, out, err = run(capsys, "explain", "--arch", "sm90")
    assert_clean_exit_2(code, out, err)
    assert "unknown cluster `also-nope`" in err


def test_named_cluster_changes_the_decision(capsys):
    payload = explain_json(
        capsys, "--arch", "sm100", "--forward-mode", "target_verify", "--next-n", "4", "--cluster", "reference-only"
    )
    assert (payload["backend"], payload["rule"], payload["source"], payload["cluster"]) == (
        "torch.reference",
        "prefer[0]",
        "cluster-prefer",
        "reference-only",
    )


def test_bad_argument_is_a_usage_error(capsys):
    assert main(["explain", "--arch", "sm77"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("usage: ") and "invalid choice: 'sm77'" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert main(["explain", "--json", "--arch", "sm77"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert (error["type"], error["exit_code"]) == ("UsageError", 2) and "invalid choice: 'sm77'" in error["message"]


def test_backends_json_lists_the_reference_with_its_plugin(capsys):
    code, out, err = run(capsys, "backends", "--json")
    assert code == 0, err
    rows = {(row["op"], row["name"]): row for row in json.loads(out)}
    reference = rows[("paged_mqa_logits", "torch.reference")]
    assert reference["plugin"] == "backends.reference.plugin"
    assert reference["distribution"] == "dispatch-dsa"
    assert reference["layout"] == "native" and reference["available"] is True
    assert reference["supports"]["forward_modes"] == ["decode", "draft_extend", "target_verify"]
    assert rows[("paged_mqa_logits", "torch.reference.flatten")]["layout"] == "flatten"
    assert rows[("indexer_q_quant", "torch.reference")]["layout"] == "tokens"
    assert all(
        set(row) >= {"name", "op", "layout", "plugin", "distribution", "available", "reason"} for row in rows.values()
    )


def test_backends_text(capsys):
    code, out, _ = run(capsys, "backends")
    assert code == 0
    assert "torch.reference  [paged_mqa_logits, native]" in out and "plugin backends.reference.plugin" in out


def test_validate_the_project_registry(capsys):
    code, out, err = run(capsys, "validate")
    assert code == 0, err
    assert out.startswith("ok: ") and "registry.yaml" in out and "fingerprint" in out
    assert err == ""


def test_explain_a_whole_batch_plan_as_json(capsys):
    payload = explain_all_json(capsys, "--arch", "cpu", "--forward-mode", "target_verify", "--next-n", "3",
                               "--seq-lens", "130,64,3")
    plan = payload["plan"]
    assert plan["context_lens"] == [[128, 129, 130], [62, 63, 64], [1, 2, 3]]
    assert plan["block_table"] == [[0, 1, 2], [3, 0, 0], [4, 0, 0]]
    assert (plan["batch_size"], plan["next_n"], plan["max_context_len"]) == (3, 3, 130)
    assert [d["op"] for d in payload["decisions"]] == ["indexer_q_quant", "paged_mqa_logits", "topk"]
    assert {d["backend"] for d in payload["decisions"]} == {"torch.reference"}
    flatten = explain_all_json(capsys, "--arch", "cpu", "--forward-mode", "target_verify", "--next-n", "2",
                               "--seq-lens", "5,9", "--cluster", "reference-only")
    assert flatten["plan"]["context_lens_shape"] == [2, 2]


# --- extend batches --------------------------------------------------------------------

EXTEND_RULES = {
    "sm100": ("deepgemm.sm100", "sm100-deepgemm-ragged"),
    "sm90": ("deepgemm.sm90", "sm90-deepgemm-ragged"),
    "gfx942": ("rocm.fnuz", "gfx942-fnuz-ragged"),
    "gfx950": ("triton", "portable-triton-ragged"),
    "sm120": ("triton", "portable-triton-ragged"),
    "sm89": ("triton", "portable-triton-ragged"),
    "sm80": ("torch.reference", "fallback[1]"),
    "cpu": ("torch.reference", "cpu-reference-ragged"),
}


@needs_cpu_host
@pytest.mark.parametrize("arch", sorted(EXTEND_RULES))
def test_explain_extend_decides_every_op_of_the_ragged_step_on_every_arch(capsys, arch):
    # Issue 12's symptom: `explain --forward-mode extend` exited 1 on every arch.
    code, out, err = run(capsys, "explain", "--arch", arch, "--forward-mode", "extend")
    assert f"ragged_mqa_logits for arch={arch} forward_mode=extend next_n=1" in out
    backend, rule = EXTEND_RULES[arch]
    assert code == 0, err
    assert f"chosen:   {backend}" in out and (f"rule `{rule}`" in out or rule in out)
    payload = explain_all_json(capsys, "--arch", arch, "--forward-mode", "extend", "--op", "all")["decisions"]
    assert [d["op"] for d in payload] == ["indexer_q_quant", "ragged_mqa_logits", "topk"]  # in Op's order: the op files'
    assert {d["key"]["next_n"] for d in payload} == {1}


@needs_cpu_host
def test_explain_an_extend_batch_shows_its_ragged_plan_and_chunks(capsys):
    code, out, err = run(capsys, "explain", "--arch", "sm90", "--extend-lens", "100,3,700",
                         "--prefix-lens", "0,500,64", "--logits-budget", "400000")
    assert code == 0, err
    assert "M=803 query rows, S=1367 gathered keys" in out and "key_offsets [0, 100, 603, 1367]" in out
    assert "rows [0, 141) x keys [0, 705): logits [141, 705], 397620 bytes" in out
    assert "chosen:   deepgemm.sm90" in out and "rule `sm90-deepgemm-ragged`" in out
    payload = explain_all_json(capsys, "--arch", "gfx942", "--forward-mode", "extend", "--extend-lens", "3,2",
                               "--prefix-lens", "1,0")
    plan = payload["plan"]
    assert plan["ks"] == [0, 0, 0, 4, 4] and plan["ke"] == [2, 3, 4, 5, 6]
    assert plan["chunks"] == [{"row_begin": 0, "row_end": 5, "key_begin": 0, "key_end": 6}]
    assert {d["op"]: d["backend"] for d in payload["decisions"]} == {
        "indexer_q_quant": "rocm.fnuz", "ragged_mqa_logits": "rocm.fnuz", "topk": "triton"}


def test_explain_extend_refuses_what_cannot_be_planned(capsys):
    code, _, err = run(capsys, "explain", "--arch", "sm90", "--extend-lens", "100", "--logits-budget", "100")
    assert code == 2 and "query row 25 sees 26 keys" in err and "more than the budget of 100" in err
    code, _, err = run(capsys, "explain", "--forward-mode", "decode", "--seq-lens", "5", "--prefix-lens", "1")
    assert code == 2 and "--prefix-lens and --logits-budget go with --extend-lens" in err
    code, _, err = run(capsys, "explain", "--extend-lens", "5,6", "--prefix-lens", "1")
    assert code == 2 and "--prefix-lens has 1 requests, --extend-lens 2" in err
    # --seq-lens is a paged batch's total lengths: an extend batch is told which option it takes
    code, _, err = run(capsys, "explain", "--forward-mode", "extend", "--seq-lens", "5")
    assert code == 2 and "an extend batch takes --extend-lens" in err
    code, _, err = run(capsys, "explain", "--forward-mode", "target_verify", "--extend-lens", "5")
    assert code == 2 and "--forward-mode target_verify takes --seq-lens" in err
    code, _, err = run(capsys, "explain", "--forward-mode", "extend", "--op", "paged_mqa_logits")
    assert code == 1 and "forward_mode extend not supported" in err


def test_a_what_if_plan_runs_no_backend(capsys, clean_environment):
    """sm90 at next_n 2 decides deepgemm.sm90 (Triton next), whose per-batch prepare needs deep_gemm (and
    Triton's launches GPU kernels): a what-if describes the plan (shapes, decisions) without running either,
    and exits 0."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("a what-if ran a backend's prepare")

    from backends.deepgemm.adapter import DeepGemmPagedLogits

    clean_environment.setattr(DeepGemmPagedLogits, "prepare", must_not_run)
    clean_environment.setattr("backends.triton.paged_state.prepare_triton_paged", must_not_run)
    code, out, err = run(capsys, "explain", "--arch", "sm90", "--forward-mode", "target_verify", "--next-n", "2",
                         "--seq-lens", "130,64,7")
    assert code == 0, err
    assert "what-if" in out and "chosen:   deepgemm.sm90" in out
    assert "plan for B=3, next_n=2, max_context_len=130" in out
    assert "context_lens [3, 2] (native): [[129, 130], [63, 64], [6, 7]]" in out
    payload = explain_all_json(capsys, "--arch", "sm90", "--forward-mode", "target_verify", "--next-n", "2",
                               "--seq-lens", "130,64,7")
    backends = {d["op"]: d["backend"] for d in payload["decisions"]}
    assert backends["paged_mqa_logits"] == "deepgemm.sm90" and payload["plan"]["context_lens_shape"] == [3, 2]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--seq-lens=-5,3"], "request 0 has seq_len -5"),
        (["--seq-lens", "0"], "request 0 has seq_len 0"),
        (["--seq-lens", "2,1", "--forward-mode", "target_verify", "--next-n", "3"], "request 0 has seq_len 2"),
        (["--seq-lens", "9,2", "--forward-mode", "target_verify", "--next-n", "3"], "request 1 has seq_len 2"),
    ],
)
def test_explain_refuses_a_batch_that_cannot_occur(capsys, argv, words):
    code, out, err = run(capsys, "explain", "--arch", "cpu", *argv)
    assert_clean_exit_2(code, out, err)
    assert words in err and "at least next_n" in err


def test_seq_lens_that_are_not_integers_are_a_usage_error(capsys):
    assert main(["explain", "--seq-lens", "3,x"]) == 2
    assert "a --seq-lens length 'x' is not an integer" in capsys.readouterr().err
