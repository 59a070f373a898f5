"""The small frictions a first run met: a bench table whose columns follow their cells, "1 chunk", a
decision's log naming its rule once, tune refusing a full CPU run, and a `backends` folder in the
current directory named as the cause."""

from __future__ import annotations

import sys
import types

import pytest

from dispatch.bench.command import report_text
from dispatch.cli.commands import main
from dispatch.contract.shadowing import OWN, shadow_message


def report(rows: list[dict]) -> str:
    return report_text({"machine": "m", "date": "d", "torch": "t", "triton": None, "fp8_dtype": "e4m3fn",
                        "ceilings": None, "dispatch_overhead": {"decide_cached_us": 1.0, "build_plan_B128_us": 2.0},
                        "rows": rows})


def row(**fields) -> dict:
    base = dict(op="paged_mqa_logits", backend="triton", layout="native", shape="B=2", median_us=1.0, GBps=None,
                TFLOPs=None, x_floor=None, rel_error=0.0, check="ok")
    return base | fields


def test_bench_columns_line_up_whatever_the_cells_hold():
    text = report([row(op="indexer_step", backend="torch.reference + torch.reference", layout="-", GBps=0.0123),
                   row(GBps=4200.2, TFLOPs=3.14159, x_floor=1.5)])
    header, rule, *lines = text.splitlines()[3:]
    assert len(rule) == len(header)
    starts = [header.index(name) for name in ("layout", "shape", "check")]
    for line in lines:
        for start in starts:
            assert line[start - 1] == " " and line[start] != " "  # every column starts where its header does
    assert " 0.0123 " in lines[0] and " 4200 " in lines[1] and " 3.14 " in lines[1]  # small rates are not 0


def test_one_chunk_is_singular():
    assert "(1 chunk)" in report([row(chunks=1)]) and "(3 chunks)" in report([row(chunks=3)])


def test_a_decision_is_logged_by_its_rule_once(capsys, monkeypatch):
    monkeypatch.delenv("DISPATCH_ARCH", raising=False)
    monkeypatch.setattr("dispatch.deciding.clusters.gpu_name", lambda: "")
    assert main(["explain", "-v", "--arch", "cpu", "--op", "topk", "--cluster", "reference-only"]) == 0
    err = capsys.readouterr().err  # before: "(rows, cluster-prefer prefer[0])", and "fallback fallback[1]"
    assert "dispatch INFO: using torch.reference (rows, by cluster `reference-only` prefer[0]) for topk" in err


def test_tune_refuses_a_full_workload_on_a_cpu(capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal is for a machine with no GPU")
    monkeypatch.setattr("dispatch.deciding.clusters.gpu_name", lambda: "")
    assert main(["tune", "--cluster", "reference-only"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tune: no GPU visible to torch: the workload is 60 paged shapes")
    assert "pass --quick for a smoke run of tiny shapes, or --on-cpu to measure it anyway" in err


def test_a_backends_folder_in_the_current_directory_is_named_as_the_cause(tmp_path, monkeypatch):
    (tmp_path / "backends").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path[1:])
    folder = types.ModuleType("backends")
    folder.__path__ = [str(tmp_path / "backends")]  # what Python makes of a folder without __init__.py
    message = shadow_message(folder)
    assert f"found the folder {tmp_path / 'backends'} in the current directory" in message
    assert f"({OWN})" in message and "run the `dispatch` command" in message and "distribution" not in message
    monkeypatch.setattr(sys, "path", ["/elsewhere"] + sys.path[1:])
    assert "a folder named `backends` on sys.path" in shadow_message(folder)
    installed = types.ModuleType("backends")
    installed.__file__, installed.__path__ = "/site/backends/__init__.py", ["/site/backends"]
    assert "another distribution installs a top-level `backends`" in shadow_message(installed)
