"""`python -m dispatch validate` as a pre-commit hook: every problem of a file in one run and in file
order, keys nothing serves flagged, the nearest backend name suggested, no torch imported, and a JSON
Schema that agrees with it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from dispatch.cli.commands import main
from dispatch.registry.document import parse_registry
from dispatch.deciding.runtime import DEFAULT_REGISTRY
from tests.support.shipped import shipped_registry_text

SHIPPED = shipped_registry_text()


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("DISPATCH_REGISTRY", "DISPATCH_CLUSTER", "DISPATCH_PLUGINS", "DISPATCH_ARCH"):
        monkeypatch.delenv(name, raising=False)


def validate(capsys, tmp_path, text: str) -> tuple[int, str, str]:
    path = tmp_path / "registry.yaml"
    path.write_text(text)
    code = main(["validate", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.replace(str(path), "R")


def test_the_shipped_registry_is_ok(capsys, tmp_path):
    code, out, err = validate(capsys, tmp_path, SHIPPED)
    assert code == 0 and out.startswith("ok: ") and err == ""


def test_every_schema_error_in_one_run_in_file_order(capsys, tmp_path):
    text = SHIPPED.replace("when: {arch: sm100, fp8_dtype: e4m3fn}", "when: {arch: sm101, fp8_dtype: e4m3fn}", 1)
    text = text.replace("when: {arch: sm90, next_n: {min: 3}}", "when: {arch: sm90, next_n: {min: 3}, colour: red}")
    text = text.replace("    match: {arch: sm90, gpu_name:", "    match: {arch: sm91, gpu_name:")
    code, out, err = validate(capsys, tmp_path, text)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0].startswith("dispatch: R:")
    assert [re.search(r"R:\d+: (\S+):", line).group(1) for line in lines] == [
        "ops.paged_mqa_logits.rules[0].when.arch[0]",
        "ops.paged_mqa_logits.rules[3].when.colour",
        "clusters.h200-mtp.match.arch[0]",
    ]
    numbers = [int(re.search(r"R:(\d+):", line).group(1)) for line in lines]
    assert numbers == sorted(numbers) and len(set(numbers)) == 3


def test_unknown_names_and_lint_together_in_file_order(capsys, tmp_path):
    text = SHIPPED.replace("use: [deepgemm.sm90, triton]", "use: [deepgemm.sm90, tritn]", 1)
    text = text.replace("prefer: [torch.reference]", "prefer: [Torch.Reference]")
    text = text.replace("      - id: portable-triton\n", "      - id: never\n        when: {arch: cpu}\n        use: [triton]\n      - id: portable-triton\n")
    code, out, err = validate(capsys, tmp_path, text)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 3, err
    line = {marker: text.splitlines().index(marker) + 1 for marker in (
        "        use: [deepgemm.sm90, tritn]", "      - id: cpu-reference", "    prefer: [Torch.Reference]")}
    assert lines[0].startswith(f"dispatch: R:{line['        use: [deepgemm.sm90, tritn]']}: ops.paged_mqa_logits.rules[1].use[1]: "
                               "unknown backend `tritn`; did you mean `triton`?")
    assert lines[1].startswith(f"lint: R:{line['      - id: cpu-reference']}: ops.paged_mqa_logits.rules[7]: "
                               "rule `cpu-reference` can never fire: earlier rules `never`")
    assert lines[2].startswith(f"dispatch: R:{line['    prefer: [Torch.Reference]']}: clusters.reference-only.prefer[0]: "
                               "unknown backend `Torch.Reference`; did you mean `torch.reference`?")


def test_a_name_with_a_capital_letter_is_an_unknown_backend_not_a_regex_error(capsys, tmp_path):
    code, _, err = validate(capsys, tmp_path, SHIPPED.replace("use: [rocm.fnuz]\n      - id: gpu-triton", "use: [ROCm.fnuz]\n      - id: gpu-triton"))
    assert code == 2
    assert "unknown backend `ROCm.fnuz`; did you mean `rocm.fnuz`?" in err
    assert "pattern" not in err


def test_a_duplicate_rule_id_points_at_the_duplicate(capsys, tmp_path):
    text = SHIPPED.replace("      - id: cpu-reference\n        why: On the CPU", "      - id: sm90-deepgemm-measured\n        why: On the CPU")
    code, _, err = validate(capsys, tmp_path, text)
    duplicate_line = text.splitlines().index("      - id: sm90-deepgemm-measured", 20) + 1
    first_line = text.splitlines().index("      - id: sm90-deepgemm-measured") + 1
    assert code == 2
    assert err.startswith(f"dispatch: R:{duplicate_line}: ops.paged_mqa_logits.rules[6].id: duplicate rule id")
    assert f"(first used on line {first_line})" in err


@pytest.mark.parametrize("op", ["paged_mqa_logits", "indexer_q_quant"])
def test_deleting_a_fallback_is_not_ok(capsys, tmp_path, op):
    start = SHIPPED.index("    fallback:", SHIPPED.index(f"  {op}:"))
    text = SHIPPED[:start] + SHIPPED[SHIPPED.index("\n", start) + 1 :]
    code, out, err = validate(capsys, tmp_path, text)
    assert code == 2 and out == ""
    assert f": ops.{op}: no rule or fallback serves keys a backend could serve: arch=sm80 forward_mode=decode" in err


def test_an_arch_nothing_in_the_registry_mentions_or_serves_is_not_flagged(capsys, tmp_path):
    text = """\
version: 1
ops:
  paged_mqa_logits:
    rules:
      - id: only-sm90
        when: {arch: sm90}
        use: [torch.reference]
  indexer_q_quant:
    rules:
      - id: only-sm90
        when: {arch: sm90}
        use: [torch.reference]
  topk:
    rules:
      - id: only-sm90
        when: {arch: sm90}
        use: [torch.reference]
  ragged_mqa_logits:
    rules:
      - id: only-sm90
        when: {arch: sm90}
        use: [torch.reference]
"""
    code, out, err = validate(capsys, tmp_path, text)
    assert (code, err) == (0, ""), err


def test_validate_imports_no_torch_and_is_quick():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("DISPATCH_PLUGINS", None)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dispatch", "validate"], capture_output=True, text=True, env=env
    )
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-3000:]
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "triton" not in imported
    assert elapsed < 3.0  # about 0.7 s of CPU time (README); generous for a shared CI machine


# --- the JSON Schema agrees with the validator -------------------------------------------------------


def schema_validator(capsys):
    # Imported here, not at the top: a test dependency only these tests use, so collecting the module on a
    # machine with the runtime's dependencies alone (`pytest -m gpu tests` on the device) does not stop.
    import jsonschema

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def edited(change) -> dict:
    document = yaml.safe_load(SHIPPED)
    change(document)
    return document


CASES = {
    "shipped": lambda d: None,
    "empty-use": lambda d: d["ops"]["paged_mqa_logits"]["rules"][0].update(use=[]),
    "empty-when-arch": lambda d: d["ops"]["paged_mqa_logits"]["rules"][0]["when"].update(arch=[]),
    "empty-name": lambda d: d["ops"]["paged_mqa_logits"].update(fallback=[""]),
    "schema-key": lambda d: d.update({"$schema": "./registry.schema.json"}),
    "missing-op": lambda d: d["ops"].pop("indexer_q_quant"),
    "no-ops": lambda d: d.update(ops={}),
    "empty-op": lambda d: d["ops"].update(indexer_q_quant={}),
    "empty-op-lists": lambda d: d["ops"].update(indexer_q_quant={"rules": [], "fallback": []}),
    "fallback-only": lambda d: d["ops"].update(indexer_q_quant={"fallback": "torch.reference"}),
    "single-use": lambda d: d["ops"]["paged_mqa_logits"]["rules"][0].update(use="triton"),
    "next-n-huge": lambda d: d["ops"]["paged_mqa_logits"]["rules"][1]["when"].update(next_n={"min": 10**29}),
    "next-n-zero": lambda d: d["ops"]["paged_mqa_logits"]["rules"][1]["when"].update(next_n=0),
    "unknown-field": lambda d: d["clusters"]["h200-mtp"].update(colour="red"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_json_schema_agrees_with_the_validator(capsys, name):
    document = edited(CASES[name])
    schema_ok = not list(schema_validator(capsys).iter_errors(document))
    try:
        parse_registry(yaml.safe_dump(document, sort_keys=False), "case.yaml")
        validator_ok = True
    except Exception as error:  # a RegistryError; anything else fails the comparison below too
        validator_ok, why = False, str(error)
    assert schema_ok == validator_ok, (name, schema_ok, None if validator_ok else why)


def test_use_min_items_in_the_schema(capsys):
    schema_validator(capsys)  # checks the schema itself
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    use = schema["$defs"]["Rule"]["properties"]["use"]
    assert "minLength" not in use
    assert {"minItems": 1, "type": "array"}.items() <= next(s for s in use["anyOf"] if s.get("type") == "array").items()
    assert "$schema" in schema["properties"]
