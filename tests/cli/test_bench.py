"""`dispatch bench` end to end at tiny shapes on the CPU: every row is checked against the reference
before it is timed, and the report carries the machine, versions and dispatch overhead."""

import json

import torch

from dispatch.bench.compare import compare_logits
from dispatch.contract.key import DispatchKey, ForwardMode, Fp8Dtype, Op
from dispatch.cli.commands import main


def test_quick_bench_checks_then_times(capsys):
    code = main(["bench", "--quick", "--next-n", "1,3", "--backends", "torch.reference.flatten,triton", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    rows = {(r["op"], r["backend"], r["shape"]) for r in report["rows"]}
    assert ("paged_mqa_logits", "torch.reference.flatten", "B=2 N=3 L~256 H=64 D=128") in rows
    assert ("indexer_q_quant", "triton", "T=64 H=64 D=128 rot=64") in rows
    assert all(r["check"] == "ok" and r["median_us"] > 0 for r in report["rows"])
    assert report["torch"] == torch.__version__
    assert report["dispatch_overhead"]["decide_cached_us"] > 0


def test_compare_logits_catches_a_wrong_mask_and_nan():
    reference = torch.tensor([[1.0, 2.0, float("-inf")]])
    assert compare_logits(reference.clone(), reference, 1e-5) == (0.0, "ok")
    leaked = torch.tensor([[1.0, 2.0, 5.0]])
    assert compare_logits(leaked, reference, 1e-5)[1] == "-inf pattern differs from the reference"
    assert compare_logits(torch.tensor([[float("nan"), 2.0, float("-inf")]]), reference, 1e-5)[1] == "NaN in output"
    error, verdict = compare_logits(torch.tensor([[1.1, 2.0, float("-inf")]]), reference, 1e-5)
    assert verdict.startswith("error") and abs(error - 0.1 / 5**0.5) < 1e-6


def test_quick_bench_of_the_extend_path(capsys):
    """bench --op ragged_mqa_logits: the op per eligible backend (checked against the reference), then
    the whole extend step through the decided backends, checked on sampled rows, with its chunks."""
    code = main(["bench", "--quick", "--op", "ragged_mqa_logits", "--backends", "triton", "--k", "16",
                 "--extend-shapes", "2x24+40,3x5+0", "--logits-budget", "4096", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    rows = {(r["op"], r["backend"], r["shape"]): r for r in report["rows"]}
    assert set(rows) == {
        ("ragged_mqa_logits", "triton", "M=48 S=128 R=2 H=64 D=128"),
        ("ragged_mqa_logits", "triton", "M=15 S=15 R=3 H=64 D=128"),
        ("extend_step", "torch.reference", "M=48 S=128 R=2 H=64 D=128 k=16"),
        ("extend_step", "torch.reference", "M=15 S=15 R=3 H=64 D=128 k=16"),
    }
    assert all(r["check"] == "ok" and r["median_us"] > 0 for r in report["rows"])
    step = rows[("extend_step", "torch.reference", "M=48 S=128 R=2 H=64 D=128 k=16")]
    assert step["chunks"] > 1 and step["step"] == "q quant torch.reference, top-k torch.reference"
    assert rows[("ragged_mqa_logits", "triton", "M=48 S=128 R=2 H=64 D=128")]["no_fill_us"] > 0


def test_compare_ragged_topk_catches_wrong_rows():
    from dispatch.bench.compare import compare_ragged_topk

    logits = torch.tensor([[9.0, 1.0, 5.0, 7.0, 3.0], [0.0, 0.0, 2.0, 8.0, 4.0]])
    ks, ke = torch.tensor([0, 2]), torch.tensor([4, 5])
    good = torch.tensor([[0, 3, -1], [1, 2, 0]], dtype=torch.int32)  # row 1: positions relative to ks = 2
    assert compare_ragged_topk(good, logits, ks, ke, 3, 1e-6)[1] != "ok"  # row 0 must select 3 of its 4 keys
    good = torch.tensor([[0, 3, 2], [1, 2, 0]], dtype=torch.int32)
    assert compare_ragged_topk(good, logits, ks, ke, 3, 1e-6) == (0.0, "ok")
    assert "twice" in compare_ragged_topk(torch.tensor([[0, 0, 2], [1, 2, 0]], dtype=torch.int32), logits, ks, ke, 3, 1e-6)[1]
    assert "error" in compare_ragged_topk(torch.tensor([[0, 3, 1], [1, 2, 0]], dtype=torch.int32), logits, ks, ke, 3, 1e-6)[1]
    assert "positions in" in compare_ragged_topk(torch.tensor([[0, 3, 2], [1, 2, 3]], dtype=torch.int32), logits, ks, ke, 3, 1e-6)[1]


def test_quick_bench_times_the_whole_step_per_backend_combination(capsys):
    code = main(["bench", "--quick", "--op", "step", "--next-n", "2", "--k", "16",
                 "--backends", "triton,torch.reference", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    combos = {r["backend"] for r in report["rows"]}
    # Every eligible logits backend named, each with every eligible top-k backend.
    assert {"triton + torch.reference", "torch.reference + torch.reference"} <= combos
    for row in report["rows"]:
        assert row["op"] == "indexer_step" and row["check"] == "ok"
        assert row["quant_us"] > 0 and row["logits_us"] > 0 and row["topk_us"] > 0
        assert abs(row["x_logits"] - row["median_us"] / row["logits_us"]) < 1e-6 * row["x_logits"]
    # The one combination a plan of this batch size decides is marked, so the step reads against it.
    from dispatch.deciding.runtime import load_dispatcher

    dispatcher = load_dispatcher()
    key = DispatchKey(dispatcher.target_arch, ForwardMode.TARGET_VERIFY, 2, Fp8Dtype(report["fp8_dtype"]))
    decided = " + ".join(dispatcher.decide(op, key, batch_size=2).backend for op in (Op.PAGED_MQA_LOGITS, Op.TOPK))
    assert [r["backend"] for r in report["rows"] if r.get("decided")] == [decided]


def test_compare_window_topk_checks_every_row_against_its_own_range():
    from backends.reference.topk import topk_indices
    from dispatch.bench.compare import compare_window_topk

    generator = torch.Generator().manual_seed(5)
    for rows, width, k, block in ((7, 40, 4, 3), (33, 90, 16, 1024), (5, 12, 20, 2)):  # k past a range, blocks
        starts = torch.randint(0, width // 2, (rows,), generator=generator, dtype=torch.int32)
        lengths = torch.randint(0, width // 2 + 1, (rows,), generator=generator, dtype=torch.int32)
        logits = torch.randn(rows, width, generator=generator)
        good = topk_indices(logits, lengths, k, starts=starts)
        assert compare_window_topk(good, logits, starts, lengths, k, block=block) == (0.0, "ok")
        absolute = torch.where(good >= 0, good + starts[:, None], -1)  # positions not relative to ks
        wrong_rows = int(((absolute != good).any(dim=1)).sum())
        assert compare_window_topk(absolute, logits, starts, lengths, k, block=block) == (
            wrong_rows / rows, f"{wrong_rows} of {rows} rows differ from torch.topk over [ks, ke)")
    assert compare_window_topk(good[:, :-1], logits, starts, lengths, k)[1].startswith("got torch.int32")


def test_host_time_reports_each_plan_against_its_target(capsys):
    """bench --host-time: build_plan at B=128 (pool deferred and given) and the extend plans at M=16K
    (S=16K, 64K), each a median of many calls with its target, and the machine and UTC time they ran."""
    code = main(["bench", "--host-time", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["date"].endswith("UTC") and report["machine"]
    plans = {entry["plan"]: entry for entry in report["host_time"]}
    assert set(plans) == {
        "build_plan B=128 N=4 (pool deferred to the first layer)",
        "build_plan B=128 N=4 (pool given)",
        "extend plan M=16K S=16K R=4",
        "extend plan M=16K S=64K R=4",
    }
    for name, entry in plans.items():
        assert entry["median_us"] > 0 and entry["repeats"] >= 100
        assert entry["target_us"] == (50.0 if name.startswith("build_plan") else 200.0)
        assert entry["within"] == (entry["median_us"] <= entry["target_us"])
        # The paged plans say how they were made: on this CPU the reference is decided, with no one-launch path.
        assert entry["path"] == ("logits `torch.reference`; top-k `torch.reference`" if name.startswith("build_plan") else "")


def test_host_time_names_a_top_k_with_a_per_batch_plan_and_times_that_plan_alone(monkeypatch):
    """Where the decided top-k builds a per-batch state (SGLang's v2 plans its rows), the paged line says
    its plan includes it and times it alone over the same plan, so a figure says what it is made of."""
    from dispatch.bench import host_time
    from dispatch.deciding.runtime import load_dispatcher

    dispatcher = load_dispatcher(arch="cpu")
    prepared = []
    _plans_whose_backend_has(monkeypatch, Op.TOPK, prepare=lambda plan: prepared.append(plan))
    times = host_time.plan_host_times(dispatcher, device="cpu", fp8_dtype=Fp8Dtype.E4M3FN)
    for entry in times[:2]:
        assert entry.path.startswith("logits `torch.reference`; top-k `torch.reference`, its per-batch plan included; "
                                     "of which the top-k's per-batch plan "), entry.path
        assert float(entry.path.rsplit(" ", 2)[1]) > 0
    assert len(prepared) >= 2 * host_time.PAGED_REPEATS  # timed alone, over the plan built for it


def test_host_time_times_the_logits_one_launch_alone_where_plans_take_it(monkeypatch):
    """Where the decided logits backend makes the plan's tensors in one C++ call, the paged line says so
    and times that call alone (with the Python that wraps its tensors), beside the top-k's share."""
    from dispatch.bench import host_time
    from dispatch.deciding.runtime import load_dispatcher

    dispatcher = load_dispatcher(arch="cpu")
    made = []

    def plan_tensors(**batch):
        made.append(batch)
        return object()  # anything but None: the path the one launch takes

    _plans_whose_backend_has(monkeypatch, Op.PAGED_MQA_LOGITS, plan_tensors=plan_tensors)
    times = host_time.plan_host_times(dispatcher, device="cpu", fp8_dtype=Fp8Dtype.E4M3FN)
    for entry in times[:2]:
        assert entry.path.startswith("logits `torch.reference`, one C++ launch ("), entry.path
        assert entry.path.endswith(" us alone); top-k `torch.reference`"), entry.path
        assert float(entry.path.split("(")[1].split(" ")[0]) > 0
    assert len(made) >= 2 * host_time.PAGED_REPEATS


def _plans_whose_backend_has(monkeypatch, op, module=None, **entries):
    """build_plan's plans (as `module` calls it: paged_plan's own by default), their `op` decision's backend
    given `entries` (a prepare, a plan_tensors, an engine_run)."""
    import dataclasses

    from dispatch.step import paged_plan

    module = module or paged_plan
    real_build = module.build_plan

    def build_plan(*args, **kwargs):
        plan = real_build(*args, **kwargs)
        decision = plan.decision(op)
        impl = dataclasses.replace(decision.impl, **entries)
        return dataclasses.replace(plan, decisions={**plan.decisions, op: dataclasses.replace(decision, impl=impl)})

    monkeypatch.setattr(module, "build_plan", build_plan)


def test_an_engine_kernels_own_call_is_timed_beside_its_backend_in_bench_not_in_tune(monkeypatch):
    """A top-k backend with an `engine_run` (an engine's kernel behind an adapter) gets a second row in
    `bench --op topk`, "NAME (engine's call)": the kernel as its engine calls it, checked and timed beside
    the backend's own row, over the same logits and the plan's lengths and state. tune's call of the same
    function (engine_calls left False) gets no such row, so no overlay can name one."""
    from backends.reference.topk import topk_indices
    from dispatch.bench import runner
    from dispatch.bench.workload import LogitsShape
    from dispatch.deciding.runtime import load_dispatcher

    calls = []

    def engine_run(logits, lengths, k, **kwargs):
        calls.append((lengths, k, kwargs))
        return topk_indices(logits, lengths, k)

    _plans_whose_backend_has(monkeypatch, Op.TOPK, module=runner, engine_run=engine_run)
    dispatcher = load_dispatcher(arch="cpu")
    bench = dict(k=64, device="cpu", ceilings=None, repeats=1, wanted={"torch.reference"})
    rows = runner.bench_topk(dispatcher, LogitsShape(2, 2, 256), Fp8Dtype.E4M3FN, engine_calls=True, **bench)
    by_name = {row.backend: row for row in rows}
    assert set(by_name) == {"torch.reference", f"torch.reference {runner.ENGINE_CALL}"}
    assert all(row.check == "ok" and row.seconds > 0 for row in rows)
    assert calls and all(k == 64 and lengths.shape == (4,) and kwargs == {} for lengths, k, kwargs in calls)
    calls.clear()
    rows = runner.bench_topk(dispatcher, LogitsShape(2, 2, 256), Fp8Dtype.E4M3FN, **bench)
    assert [row.backend for row in rows] == ["torch.reference"] and not calls


def test_a_refused_shape_is_listed_without_failing_the_run():
    from dispatch.bench.command import exit_code
    from dispatch.bench.runner import UNSERVED

    refused = {"check": f"{UNSERVED}: UnservedCallError: 128 rows is past its 64 (one cluster wave)"}
    assert exit_code([{"check": "ok"}, refused]) == 0
    assert exit_code([{"check": "ok"}, refused, {"check": "failed: RuntimeError: boom"}]) == 1
    assert exit_code([{"check": "1 of 4 rows differ from torch.topk"}]) == 1


def test_an_engine_stack_with_an_engine_kernel_gets_the_engines_own_call_in_the_step(monkeypatch):
    """`bench --op step`: where a combination is an engine's stack and its top-k has an `engine_run`, a
    second row "... (engine's call)" runs the same Q quant and logits, then the kernel as the engine calls
    it, checked and timed like the first; the first row says it went through dispatch's adapter."""
    from backends.reference.topk import topk_indices
    from dispatch.bench import runner, step
    from dispatch.bench.workload import LogitsShape
    from dispatch.deciding.runtime import load_dispatcher

    calls = []

    def engine_run(logits, lengths, k, **kwargs):
        calls.append((lengths.shape, k))
        return topk_indices(logits, lengths, k)

    _plans_whose_backend_has(monkeypatch, Op.TOPK, module=step, engine_run=engine_run)
    monkeypatch.setattr(step, "stack_of", lambda key, logits, topk: "SGLang's stack")
    rows = step.bench_step(load_dispatcher(arch="cpu"), LogitsShape(2, 2, 256), Fp8Dtype.E4M3FN, k=64, device="cpu",
                           ceilings=None, repeats=1, wanted={"torch.reference"})
    by_name = {row.backend: row for row in rows}
    own = f"torch.reference + torch.reference {runner.ENGINE_CALL}"
    assert set(by_name) == {"torch.reference + torch.reference", own}
    assert all(row.check == "ok" and row.seconds > 0 and row.extra["topk_us"] > 0 for row in rows)
    assert by_name[own].extra["engine"] == "SGLang's stack, its top-k as the engine calls it"
    assert by_name["torch.reference + torch.reference"].extra["engine"].endswith("through dispatch's adapter")
    assert calls and all(shape == (4,) and k == 64 for shape, k in calls)

