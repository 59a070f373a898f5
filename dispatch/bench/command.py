"""Arguments and report of `python -m dispatch bench`."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

from dispatch.bench.arguments import BATCH_SIZES, K, LENGTHS, NEXT_N, TOKENS, positive_int, extend_shapes
from dispatch.contract.key import Fp8Dtype, Op


# M in {4K, 16K} query rows, S from 4K to 64K keys, several requests (issue 12's extend shapes).
EXTEND_SHAPES = ["4x1024+0", "2x2048+14336", "4x4096+0", "4x4096+12288"]
QUICK_EXTEND_SHAPES = ["2x24+40"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", choices=[o.value for o in Op] + ["step", "all"], default="all",
                        help="one op, `step` (the whole indexer step per backend combination), or all (default: all)")
    parser.add_argument("--batch-sizes", type=BATCH_SIZES, default=[32, 128], metavar="B,B,...", help="requests per batch (default: 32,128)")
    parser.add_argument("--next-n", type=NEXT_N, default=[1, 2, 4], metavar="N,N,...", help="tokens scored per request (default: 1,2,4)")
    parser.add_argument("--lengths", type=LENGTHS, default=[8192, 32768], metavar="L,L,...",
                        help="mean lengths; each batch is uniform in [L/2, 3L/2] (default: 8192,32768)")
    parser.add_argument("--k", type=K, default=[2048], metavar="K,K,...", help="keys kept per token, for topk (default: 2048)")
    parser.add_argument("--tokens", type=TOKENS, default=[64, 512, 16384], metavar="T,T,...",
                        help="tokens for indexer_q_quant (a decode step has few: 64 and 512 show small-batch cost; "
                             "default: 64,512,16384)")
    parser.add_argument(
        "--extend-shapes",
        type=extend_shapes,
        default=None,
        metavar="RxE+P,...",
        help="extend batches for ragged_mqa_logits and the extend step: RxE+P is R requests of E new tokens "
        "after P cached keys (M = R*E query rows, S = R*(P+E) keys); default " + ",".join(EXTEND_SHAPES)
        + " (--quick: " + ",".join(QUICK_EXTEND_SHAPES) + ")",
    )
    parser.add_argument("--logits-budget", type=positive_int(1 << 40), default=None, metavar="BYTES",
                        help="the extend step's logits byte budget (default: dispatch.step.extend_batch's, 512 MiB)")
    parser.add_argument("--heads", type=positive_int(1024), default=64,
                        help="indexer heads H, 1 to 1024 (default: %(default)s)")
    parser.add_argument("--head-dim", type=positive_int(1024), default=128,
                        help="indexer head dim D, 1 to 1024 (default: %(default)s)")
    parser.add_argument("--fp8-dtype", choices=[d.value for d in Fp8Dtype], help="default: the platform's")
    parser.add_argument("--backends", help="comma-separated backend names (default: every available one but the reference)")
    parser.add_argument("--repeats", type=positive_int(1000), default=30,
                        help="timed calls per backend and shape, 1 to 1000 (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, for a CPU smoke run")
    parser.add_argument("--host-time", action="store_true",
                        help="only the host time of building a plan (build_plan at B=128, an extend plan at "
                             "M=16K), medians against their targets (50 and 200 us)")
    parser.add_argument("--cluster", help="cluster overlay (default: DISPATCH_CLUSTER, else a declared match)")
    parser.add_argument("--registry", help="registry file (default: DISPATCH_REGISTRY, else the packaged registry.yaml)")
    parser.add_argument("--json", action="store_true", help="print the report (or {\"error\": ...}) as JSON")


def _progress(message: str) -> None:
    # Progress goes to stderr, so `--json > report.json` and pipes get the report alone.
    print(f"bench: {message}", file=sys.stderr, flush=True)


def _cpu_note() -> None:
    """On a CPU, say what the report can and cannot show, before the user waits for it."""
    from dispatch.contract.detect import triton_interpreter_on

    _progress("no GPU visible to torch: CPU timings show no kernel's GPU speed")
    if not triton_interpreter_on():
        _progress(
            "the Triton backends cannot run here (TRITON_INTERPRET is not 1) and the torch reference is timed "
            "only when named, so nothing may be timed; run `TRITON_INTERPRET=1 python -m dispatch bench --quick` "
            "to check the Triton kernels under the interpreter, or add `--backends torch.reference`"
        )


def job_table() -> dict:
    """op -> jobs(BenchRun): the runner's JOBS, one row per op of OP_CONTRACTS."""
    from dispatch.bench import runner
    from dispatch.contract.ops import OP_CONTRACTS

    table = runner.JOBS
    missing = [op.value for op in OP_CONTRACTS if op not in table]
    assert not missing, f"every op needs a way to be measured: no JOBS row for {missing}"
    return {op: table[op] for op in OP_CONTRACTS}


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from dispatch.bench.ceilings import measure_ceilings
    from dispatch.bench.runner import dispatch_overhead
    from dispatch.bench.workload import BenchRun, LogitsShape, QuantShape, RaggedShape
    from dispatch.step.extend_batch import DEFAULT_LOGITS_BYTES
    from dispatch.contract.detect import platform_fp8_dtype
    from dispatch.deciding.runtime import load_dispatcher

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.batch_sizes, args.lengths, args.tokens, args.repeats = [2], [256], [64], min(args.repeats, 3)
        args.extend_shapes = args.extend_shapes or QUICK_EXTEND_SHAPES
        args.k = [min(k, 64) for k in args.k]
    args.extend_shapes = args.extend_shapes or EXTEND_SHAPES
    dispatcher = load_dispatcher(args.registry, cluster=args.cluster)
    fp8 = Fp8Dtype(args.fp8_dtype) if args.fp8_dtype else platform_fp8_dtype(dispatcher.target_arch)
    wanted = set(args.backends.split(",")) if args.backends else None
    if args.host_time:
        return _host_time(dispatcher, device, fp8, json_out=args.json)
    from dispatch.deciding.warming import warm_for

    warm_for(dispatcher)  # builds (cuda.radix's nvcc) now, never inside a timed call or a capture
    if device == "cpu":
        _cpu_note()
    ceilings = measure_ceilings(device) if device == "cuda" else None
    tolerance = 1e-3 if device == "cuda" else 1e-5

    logits_shapes = [
        LogitsShape(batch_size, next_n, length, args.heads, args.head_dim)
        for batch_size in args.batch_sizes
        for length in args.lengths
        for next_n in args.next_n
    ]
    ragged_shapes = [RaggedShape.parse(text, args.heads, args.head_dim) for text in args.extend_shapes]
    budget = DEFAULT_LOGITS_BYTES if args.logits_budget is None else args.logits_budget
    run = BenchRun(dispatcher, fp8, device, ceilings, args.repeats, wanted, tolerance,
                   [QuantShape(tokens, args.heads, args.head_dim) for tokens in args.tokens], logits_shapes,
                   ragged_shapes, args.k, budget)
    # One job per (op, shape), labelled for the progress line on stderr; each op's from the runner's JOBS.
    jobs = {op: build(run) for op, build in job_table().items()}
    chosen = [(op.value, label, job) for op in Op if args.op in ("all", op.value) for label, job in jobs[op]]
    if args.op in ("all", "step"):
        from dispatch.bench.step import bench_step

        chosen += [
            ("step", f"{shape.label()} k={k}", lambda shape=shape, k=k: bench_step(dispatcher, shape, fp8, k=k, **run.common))
            for shape in logits_shapes
            for k in args.k
        ]
    rows = []
    for number, (name, label, job) in enumerate(chosen, 1):
        _progress(f"[{number}/{len(chosen)}] {name} {label}")
        rows += job()
        if device == "cuda":
            torch.cuda.empty_cache()
    report = {
        "machine": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "fp8_dtype": fp8.value,
        "ceilings": ceilings.as_dict() if ceilings else None,
        "dispatch_overhead": dispatch_overhead(dispatcher, device=device),
        "dependent_launch": _dependent_launch(),
        "rows": [row.as_dict() for row in rows],
    }
    if not rows:
        _progress("no backend was timed: none of those asked for is available here (`python -m dispatch backends` says why)")
    print(json.dumps(report, indent=2) if args.json else report_text(report))
    return exit_code(report["rows"])


def exit_code(rows: list[dict]) -> int:
    """1 where a backend answered wrongly or raised, else 0. A kernel that refuses a shape by its contract
    (vLLM's cooperative_topk past 64 rows, say) is listed as unable, not counted as a failure: with the
    engines installed, every run would otherwise end in 1."""
    from dispatch.bench.runner import UNSERVED

    return 1 if any(row["check"] != "ok" and not row["check"].startswith(UNSERVED) for row in rows) else 0


def _host_time(dispatcher, device: str, fp8: Fp8Dtype, *, json_out: bool) -> int:
    """`bench --host-time`: each plan's median host time against its target (exit 0 either way: a
    measurement, not a check; the report says which are over)."""
    from dispatch.bench.host_time import plan_host_times
    from dispatch.deciding.warming import warm_for

    warm_for(dispatcher)  # as an engine does before serving: builds what plans use (the one-launch prepare)
    _progress("timing the host cost of building plans (medians of many calls)")
    times = plan_host_times(dispatcher, device=device, fp8_dtype=fp8)
    report = {**_provenance(device, fp8), "host_time": [t.as_dict() for t in times]}
    if json_out:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join([_provenance_line(report), *(t.line() for t in times)]))
    return 0


def _provenance(device: str, fp8: Fp8Dtype) -> dict:
    import torch

    return {
        "machine": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "fp8_dtype": fp8.value,
    }


def _provenance_line(report: dict) -> str:
    return (f"machine {report['machine']}, {report['date']}, torch {report['torch']}, triton {report['triton']}, "
            f"fp8 {report['fp8_dtype']}")


def _dependent_launch() -> str:
    """How dispatch's kernels launched in this run: the step's figures differ by it, so the report says
    (backends/shared/dependent_launch.py decides per kernel from the GPU and DISPATCH_PDL)."""
    from dispatch.contract import dependent_launch_switched_off

    if dependent_launch_switched_off():
        return "off (DISPATCH_PDL=0)"
    return "on where the GPU has it (sm90+)"


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def report_text(report: dict) -> str:
    lines = [
        f"machine {report['machine']}, {report['date']}, torch {report['torch']}, triton {report['triton']}, fp8 {report['fp8_dtype']}",
    ]
    if report["ceilings"]:
        c = report["ceilings"]
        lines.append(f"ceilings: copy {c['copy_GBps']:.0f} GB/s (read+write), fp8 matmul {c['fp8_TFLOPs']:.0f} TFLOP/s")
    o = report["dispatch_overhead"]
    pdl = report.get("dependent_launch")
    launched = "" if pdl is None else f"; dependent launch {pdl}"
    lines.append(f"dispatch: cached decide {o['decide_cached_us']:.2f} us, build_plan B=128 {o['build_plan_B128_us']:.1f} us "
                 f"(host){launched}")
    # Widths from the cells themselves: a step row's backend ("torch.reference + torch.reference") or a
    # long shape must not push the columns after it out of line.
    columns = [
        ("op", "<", lambda r: r["op"]),
        ("backend", "<", lambda r: r["backend"]),
        ("layout", "<", lambda r: r["layout"]),
        ("shape", "<", lambda r: r["shape"]),
        ("median us", ">", lambda r: _num(r["median_us"], ".1f")),
        ("GB/s", ">", lambda r: _figure(r["GBps"])),
        ("TFLOP/s", ">", lambda r: _figure(r["TFLOPs"])),
        ("x floor", ">", lambda r: _num(r["x_floor"], ".2f")),
        ("rel err", ">", lambda r: _num(r["rel_error"], ".1e")),
        ("timed", "<", lambda r: r.get("timing", "-")),
        ("check", "<", lambda r: r["check"]),
    ]
    cells = [[shown(row) for _, _, shown in columns] for row in report["rows"]]
    widths = [max([len(name)] + [len(line[i]) for line in cells]) for i, (name, _, _) in enumerate(columns)]

    def joined(values: list[str]) -> str:
        return " ".join(format(v, f"{align}{w}") for v, (_, align, _), w in zip(values, columns, widths)).rstrip()

    header = joined([name for name, _, _ in columns])
    lines += ["", header, "-" * len(header)]
    for row, line in zip(report["rows"], cells):
        lines.append(joined(line) + _stage_times(row) + _notes(row))
    return "\n".join(lines)


def _figure(value) -> str:
    """A rate with three significant digits: a CPU's 0.004 TFLOP/s is not printed as 0."""
    if value is None:
        return "-"
    return format(value, ".0f") if value >= 100 else format(value, ".3g")


# Extra figures some rows carry (the extend rows), printed after the check when present.
_NOTES = (
    ("engine", str),
    ("decided", str),
    ("step", str),
    ("no_fill_us", "without -inf fill {:.1f} us".format),
    ("x_deepgemm", "{:.2f}x deepgemm".format),
    ("chunks", lambda n: f"{n} chunk" if n == 1 else f"{n} chunks"),
    ("peak_MiB", "peak {:.0f} MiB".format),
    ("plan_us", "plan {:.0f} us (host)".format),
)


def _notes(row: dict) -> str:
    notes = [shown(row[name]) for name, shown in _NOTES if row.get(name) is not None]
    return f"  ({', '.join(notes)})" if notes else ""


def _stage_times(row: dict) -> str:
    """A whole-step row's parts, each timed alone in the same run, and the step over the logits alone."""
    if "x_logits" not in row:
        return ""
    launches = f"; {row['launches']} launches" if row.get("launches") is not None else ""
    return (f"  (quant {row['quant_us']:.1f} + logits {row['logits_us']:.1f} + topk {row['topk_us']:.1f} us;"
            f" step = {row['x_logits']:.2f}x logits{launches})")


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)
