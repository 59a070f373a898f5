"""The CLI behaves as a command-line tool should: --version, usage named as invoked, help text for every
option, one table of environment variables (here, in --help and in docs/cli.md), logs on stderr with -v,
JSON errors with --json, quiet broken pipes, and a bench that says what a CPU run can show."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dispatch.cli.commands import _parser, main
from dispatch.contract.detect import detect_arch
from dispatch.cli.environment import ENVIRONMENT, environment_markdown
from dispatch.contract.key import Op

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name, _, _ in ENVIRONMENT:
        if name.startswith("DISPATCH_"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("dispatch.deciding.clusters.gpu_name", lambda: "")
    detect_arch.cache_clear()
    level = logging.getLogger("dispatch").level
    yield monkeypatch
    logging.getLogger("dispatch").setLevel(level)
    detect_arch.cache_clear()


def cli(*argv: str, env: dict | None = None, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    """`python -m dispatch` in a child process, on this checkout's packages."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("DISPATCH_")}
    environment["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "dispatch", *argv], cwd=ROOT, env={**environment, **(env or {})},
                          stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"], prog="dispatch")
    assert exit_.value.code == 0
    assert re.fullmatch(r"dispatch \(dispatch-dsa [^)]+\)\n", capsys.readouterr().out)


def test_usage_names_the_program_as_invoked(capsys):
    result = cli("--help")
    interpreter = os.path.basename(sys.executable)  # what the child was started as
    assert result.returncode == 0
    assert result.stdout.startswith(f"usage: {interpreter} -m dispatch ")
    with pytest.raises(SystemExit):
        main(["explain", "--help"], prog="dispatch")
    assert capsys.readouterr().out.startswith("usage: dispatch explain ")


def test_help_is_for_users(capsys):
    with pytest.raises(SystemExit):
        main(["--help"], prog="dispatch")
    text = capsys.readouterr().out
    assert "The one place that turns" not in text  # the module's docstring is for developers
    assert "environment variables:" in text and "exit codes:" in text
    for name, _, effect in ENVIRONMENT:
        assert name in text and effect.replace("`", "") in text


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_has_help_text():
    missing = [
        f"{parser.prog} {action.option_strings or action.dest}"
        for parser in _parsers(_parser("dispatch"))
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not action.help
    ]
    assert missing == []


def test_one_table_of_environment_variables_in_the_readme_the_help_and_the_code():
    from tests.support.documentation import documentation_text
    from tests.docs.test_documented import env_vars_read

    assert environment_markdown() in documentation_text()  # docs/cli.md; --help prints the same rows
    documented = {name for name, _, _ in ENVIRONMENT}
    assert env_vars_read() <= documented, env_vars_read() - documented


def test_verbose_shows_each_decision_on_stderr(capsys):
    assert main(["explain", "--arch", "cpu", "-v"]) == 0
    err = capsys.readouterr().err
    assert "dispatch INFO: using torch.reference (native, by rule `cpu-reference`) for paged_mqa_logits" in err
    assert main(["-v", "explain", "--arch", "cpu", "--forward-mode", "draft_extend"]) == 0  # before the command too
    assert "for paged_mqa_logits at arch=cpu forward_mode=draft_extend" in capsys.readouterr().err
    assert main(["explain", "--arch", "cpu", "--forward-mode", "target_verify", "--next-n", "5"]) == 0
    assert capsys.readouterr().err == ""  # quiet without -v


def test_the_trace_works_from_the_cli(capsys, clean_environment):
    clean_environment.setenv("DISPATCH_TRACE", "1")
    assert main(["explain", "--arch", "cpu", "--forward-mode", "draft_extend", "--next-n", "3"]) == 0
    err = capsys.readouterr().err
    assert "dispatch.trace INFO: hook register_backends -> ['backends.reference.plugin']" in err
    assert "dispatch INFO: dispatch trace: {'op': 'paged_mqa_logits'" in err


def test_json_errors_are_json_objects(capsys):
    code = main(["explain", "--json", "--arch", "sm90", "--cluster", "nope"])
    captured = capsys.readouterr()
    assert code == 2
    error = json.loads(captured.out)["error"]
    assert error == {"type": "RegistryError", "exit_code": 2, "message": error["message"]}
    assert "unknown cluster `nope`" in error["message"] and "unknown cluster `nope`" in captured.err
    code = main(["explain", "--json", "--arch", "cpu", "--seq-lens=-1"])
    assert code == 2 and json.loads(capsys.readouterr().out)["error"]["type"] == "InvalidBatchError"


def test_one_json_shape_for_one_op_or_all(capsys):
    shapes = []
    for argv in (["--op", "indexer_q_quant"], ["--op", "all"], ["--seq-lens", "7,9"]):
        assert main(["explain", "--json", "--arch", "cpu", *argv]) == 0
        payload = json.loads(capsys.readouterr().out)
        shapes.append(set(payload))
        assert payload["decisions"] and all(d["op"] in {op.value for op in Op} for d in payload["decisions"])
    assert shapes == [{"decisions", "plan"}] * 3


def test_a_closed_pipe_is_not_a_traceback():
    reader = subprocess.Popen(["head", "-n", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    result = cli("backends", stdout=reader.stdin)
    reader.stdin.close()
    first = reader.stdout.read()
    reader.wait()
    assert first.strip() and "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr
    assert result.returncode in (0, 141)


def test_bench_on_a_cpu_says_what_it_can_show_and_reports_progress(capsys, clean_environment):
    clean_environment.delenv("TRITON_INTERPRET", raising=False)
    assert main(["bench", "--quick", "--op", "indexer_q_quant", "--json"]) == 0
    captured = capsys.readouterr()
    assert "the Triton backends cannot run here (TRITON_INTERPRET is not 1)" in captured.err
    assert "bench: [1/1] indexer_q_quant T=64" in captured.err
    assert "no backend was timed" in captured.err
    assert json.loads(captured.out)["rows"] == []
