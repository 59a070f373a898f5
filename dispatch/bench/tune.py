"""`python -m dispatch tune`: on this machine, for the keys and workload a cluster declares, check every
eligible backend of every op against the reference and time it (the bench's own runners), then write
the cluster's measured overlay: per op and key, the backends fastest first, with the evidence.

Keys: each forward mode's own ops (dispatch.step.paged_plan.ops_for). Paged keys by next_n: 1 is `decode`; next_n
> 1 is `target_verify` and `draft_extend`, which hand the kernels the same tensors, so one measurement
serves both (a mode whose eligible backends differ is left to the rules). Q quant's time depends on
its token count alone, so its measurement at the workload's token counts serves every paged key. The
`extend` key is measured over the workload's extend batches (dispatch/bench/extend_tune.py). Where only
one backend is eligible there is nothing to choose and nothing is timed.

Every time is taken in a CUDA graph where the device allows (replays of the captured call, the stream
held ahead of the host: dispatch.bench.timing.time_graph), eagerly on a CPU or where a backend cannot
be captured; the overlay says which (`timing`, `timed_eagerly`). The top-k at batches of up to
`--step-up-to` requests is ranked by the whole step instead of the op alone
(dispatch/bench/step_tune.py says why, and why only there).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import sys
import time
from pathlib import Path

import yaml

from dispatch.bench.arguments import positive_int, zero_or_positive_int
from dispatch.contract.limits import MAX_CLI_BATCH
from dispatch.bench.overlay_file import check_writable, write_atomically
from dispatch.contract.key import DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.registry.reading import END_MARKER
from dispatch.bench.ordering import band_orders, measured_order, step_times_by_size
from dispatch.bench.step_tune import STEP_RANKED_UP_TO, step_rows, stages_of, timing_of
from dispatch.registry.measured_bands import batch_size_of
from dispatch.registry.measured import geometric_mean
from dispatch.registry.models import Workload
from dispatch.contract.version import dispatch_version

BUDGET_S = 0.5  # timing per backend and shape at most about this long: a slow reference takes 3 repeats
QUICK = dict(batch_sizes=(2,), lengths=(256,), tokens=(64,), extend_requests=(2,), extend_lens=(24,), prefix_lens=(40,),
             shapes=(), extend_batches=())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", help="whose workload to measure (default: DISPATCH_CLUSTER, else a declared match)")
    parser.add_argument("--registry", help="registry file (default: DISPATCH_REGISTRY, else registry.yaml)")
    parser.add_argument(
        "-o", "--output", help="overlay file to write (default: the cluster's `measured` path, else stdout)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes and next_n <= 2, for a CPU run")
    parser.add_argument("--repeats", type=positive_int(1000), default=20,
                        help="timed calls per backend and shape, at most (1 to 1000)")
    parser.add_argument("--step-up-to", type=zero_or_positive_int(MAX_CLI_BATCH), default=STEP_RANKED_UP_TO, metavar="B",
                        help="rank the top-k by the whole step at batches of up to B requests "
                             f"(default {STEP_RANKED_UP_TO}; 0: by the op alone everywhere)")
    parser.add_argument("--on-cpu", action="store_true",
                        help="measure the cluster's whole workload even with no GPU (without it, a CPU run is "
                             "refused unless --quick: the default workload is dozens of shapes of up to 128K keys, "
                             "for the torch reference and the Triton interpreter)")


def run_tune(args: argparse.Namespace) -> int:
    from dispatch.deciding.runtime import load_dispatcher

    started = time.perf_counter()
    dispatcher = load_dispatcher(args.registry, cluster=args.cluster)
    cluster = dispatcher.document.registry.clusters.get(dispatcher.cluster) if dispatcher.cluster else None
    refusal = _cpu_refusal(cluster.workload if cluster and cluster.workload else Workload(), args)
    if refusal:
        print(f"tune: {refusal}", file=sys.stderr)
        return 2  # the CLI's EXIT_INVALID: an option is missing
    if not args.output and dispatcher.cluster in dispatcher.document.measured_dirs and cluster.measured:
        print(f"tune: cluster `{dispatcher.cluster}` comes from the packaged registry (`extends: default`), whose "
              "overlay tune will not overwrite; declare the cluster in your file with its own `measured:` path, "
              "or pass -o", file=sys.stderr)
        return 2
    output = args.output or _declared_overlay(dispatcher.document, cluster)
    if output:
        check_writable(output)  # before minutes of measuring, not after
    from dispatch.deciding.warming import warm_for

    warm_for(dispatcher)  # builds (cuda.radix's nvcc) before any timing
    text, failures = measure_overlay(dispatcher, quick=args.quick, repeats=args.repeats, output=output,
                                     step_up_to=args.step_up_to)
    if output:
        write_atomically(output, text)
        print(f"tune: wrote {output} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    else:
        print(text, end="")
    return 1 if failures else 0


def _cpu_refusal(workload: Workload, args: argparse.Namespace) -> str | None:
    """Why a full tune is not started on a CPU, or None: it runs for a long time and measures nothing a
    GPU cluster can use, so it takes --quick (a smoke run) or --on-cpu (on purpose)."""
    import torch

    if args.quick or args.on_cpu or torch.cuda.is_available():
        return None
    paged = len(workload.batch_sizes) * len(workload.lengths) * len(workload.next_n) + len(workload.shapes)
    extend = len(workload.extend_requests) * len(workload.extend_lens) * len(workload.prefix_lens) + len(workload.extend_batches)
    return (
        f"no GPU visible to torch: the workload is {paged} paged shapes (batch sizes up to "
        f"{max(workload.batch_sizes)}, lengths up to {max(workload.lengths)}) and {extend} extend batches per "
        "backend, which on a CPU runs for a long time and measures nothing a GPU "
        "cluster can use; pass --quick for a smoke run of tiny shapes, or --on-cpu to measure it anyway"
    )


def measure_overlay(dispatcher, *, quick: bool = False, repeats: int = 20, output: str | None = None,
                    step_up_to: int = STEP_RANKED_UP_TO) -> tuple[str, int]:
    """(the overlay's YAML text, how many keys had a backend fail its check) for the dispatcher's
    cluster (its workload, else the default), measured on this machine, the top-k at batches of up to
    `step_up_to` requests ranked by the whole step. The text is validated by the loader `validate`
    uses before it is returned."""
    import torch

    from dispatch.bench.extend_tune import measure_extend
    from dispatch.contract.detect import platform_fp8_dtype
    from dispatch.step.paged_plan import PAGED_STEP_OPS
    from dispatch.registry.measured import parse_measured

    name = dispatcher.cluster
    cluster = dispatcher.document.registry.clusters.get(name) if name else None
    workload = (cluster.workload if cluster and cluster.workload else None) or Workload()
    fp8 = workload.fp8_dtype or platform_fp8_dtype(dispatcher.target_arch)
    if quick:
        small_n = tuple(n for n in workload.next_n if n <= 2) or (1,)
        workload = workload.model_copy(update=dict(QUICK, next_n=small_n, k=tuple(min(k, 64) for k in workload.k)))
        repeats = min(repeats, 3)
    workload = workload.model_copy(update={"fp8_dtype": fp8})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tuner = Tuner(dispatcher, workload, fp8, device, repeats, time.perf_counter(), step_up_to=step_up_to)
    for op in PAGED_STEP_OPS:
        tuner.measure_paged(op)
    measure_extend(tuner)
    ops = tuner.tables()
    overlay = {
        "version": 1,
        "cluster": name,
        "machine": torch.cuda.get_device_name() if device == "cuda" else f"CPU ({_cpu_name()})",
        "date": datetime.date.today(),
        "dispatch": dispatch_version(),
        "torch": str(torch.__version__),
        "triton": _version("triton"),
        "workload": workload.model_dump(mode="json"),
        "ops": {op.value: table for op, table in ops.items()},
    }
    relative = os.path.relpath(output, Path(dispatcher.document.path).parent) if output else None
    text = (_header(name, overlay, relative) + yaml.safe_dump(overlay, sort_keys=False, default_flow_style=None, width=120)
            + f"{END_MARKER}\n")
    parse_measured(text, output or "<tune output>")  # what validate will read: refuse here, not there
    return text, tuner.failures


class Tuner:
    """Measures keys and collects, per op, the measured backends' versions and one preference per key."""

    def __init__(self, dispatcher, workload: Workload, fp8: Fp8Dtype, device: str, repeats: int, started: float,
                 step_up_to: int = STEP_RANKED_UP_TO):
        self.dispatcher, self.workload, self.fp8, self.device = dispatcher, workload, fp8, device
        self.repeats, self.started, self.step_up_to = repeats, started, step_up_to
        self.failures = 0
        self.fresh: dict[tuple[Op, int], dict] = {}  # (op, next_n) -> the preference this run measured
        self.common = dict(device=device, ceilings=None, repeats=repeats, budget_s=BUDGET_S)
        self.tolerance = 1e-3 if device == "cuda" else 1e-5  # bench's: fp8 dots on a GPU, exact-ish on a CPU
        self._versions: dict[Op, dict[str, str]] = {op: {} for op in Op}
        self._preferences: dict[Op, list[dict]] = {op: [] for op in Op}
        self._quant_rows: list | None = None

    def tables(self) -> dict[Op, dict]:
        """{op: {"versions": {...}, "preferences": [...]}} for every op with a preference, in Op order."""
        return {
            op: {"versions": dict(sorted(self._versions[op].items())), "preferences": self._preferences[op]}
            for op in Op
            if self._preferences[op]
        }

    def record(self, op: Op, modes: list[ForwardMode], next_n: int, names: list[str], rows: list) -> None:
        """The preference the rows give for (op, these modes at next_n), with the versions of `names`."""
        key = DispatchKey(self.dispatcher.target_arch, modes[0], next_n, self.fp8)
        preference = self._preference(rows, list(self.dispatcher.document.registry.table(op).named_for(key)))
        if preference is None:
            return
        arch = self.dispatcher.target_arch.value
        key = {"arch": arch, "forward_mode": [m.value for m in modes], "next_n": next_n, "fp8_dtype": self.fp8.value}
        self._preferences[op].append({"key": key, **preference})
        self.fresh[(op, next_n)] = preference
        for name in names:
            self._versions[op][name] = str(self.dispatcher.catalog.get(op, name).version)

    def choosable(self, op: Op, key: DispatchKey) -> list[str]:
        """The backends to measure for (op, key); empty (and said) when fewer than two are eligible."""
        names = self.eligible(op, key)
        if len(names) < 2:
            only = ", ".join(names) or "no backend"
            self.say(f"{op.value} {key.forward_mode.value} next_n={key.next_n}: only {only} eligible; nothing to choose")
            return []
        return names

    def measure_paged(self, op: Op) -> None:
        for next_n in self.workload.paged_next_n():
            modes = self._modes(op, next_n)
            names = self.choosable(op, DispatchKey(self.dispatcher.target_arch, modes[0], next_n, self.fp8))
            if not names:
                continue
            if op is Op.INDEXER_Q_QUANT:
                if self._quant_rows is None:
                    self._quant_rows = self._rows(op, None, None)
                rows = [row for row in self._quant_rows if row.backend in names]
                if {row.backend for row in rows} != set(names):
                    continue  # a backend eligible here was not eligible where Q quant was measured
            else:
                rows = self._rows(op, next_n, set(names))
                if op is Op.TOPK:
                    rows += step_rows(self, next_n, [row.backend for row in rows if row.check == "ok"])
            self.record(op, modes, next_n, names, rows)

    def _modes(self, op: Op, next_n: int) -> list[ForwardMode]:
        if next_n == 1:
            return [ForwardMode.DECODE]
        arch = self.dispatcher.target_arch
        first = self.eligible(op, DispatchKey(arch, ForwardMode.TARGET_VERIFY, next_n, self.fp8))
        same = self.eligible(op, DispatchKey(arch, ForwardMode.DRAFT_EXTEND, next_n, self.fp8)) == first
        return [ForwardMode.TARGET_VERIFY] + ([ForwardMode.DRAFT_EXTEND] if same else [])

    def eligible(self, op: Op, key: DispatchKey) -> list[str]:
        # The cluster's disabled backends are never used here, so they are not measured.
        return sorted(b.name for b in self.dispatcher.eligible(op, key))

    def _rows(self, op: Op, next_n: int | None, names: set[str] | None) -> list:
        from dispatch.bench.runner import bench_logits, bench_quant, bench_topk
        from dispatch.bench.workload import QuantShape, paged_shapes

        rows = []
        w, d = self.workload, self.dispatcher
        if op is Op.INDEXER_Q_QUANT:
            names = set(self.eligible(op, DispatchKey(d.target_arch, ForwardMode.DECODE, 1, self.fp8)))
            for tokens in w.tokens:
                rows += self.report(bench_quant(d, QuantShape(tokens), self.fp8, wanted=names, **self.common))
            return rows
        for shape in paged_shapes(w, next_n):  # the grid's, then the named shapes
            if op is Op.PAGED_MQA_LOGITS:
                measured = bench_logits(d, shape, self.fp8, tolerance=self.tolerance, wanted=names, **self.common)
                rows += self.report(measured)
            elif op is Op.TOPK:
                for k in w.k:
                    rows += self.report(bench_topk(d, shape, self.fp8, k=k, wanted=names, **self.common))
            else:  # a new op of the paged step (PAGED_STEP_OPS, from the op files) needs its runs here
                raise AssertionError(f"tune cannot measure {op.value}: add its runs to dispatch/bench/tune.py")
            self.free()
        return rows

    def report(self, rows: list) -> list:
        if rows:
            times = ", ".join(f"{r.backend} " + (f"{r.seconds * 1e6:.1f} us" if r.seconds else r.check) for r in rows)
            self.say(f"{rows[0].op} {rows[0].shape}: {times}")
        return rows

    def _preference(self, rows: list, rule_order: list[str]) -> dict | None:
        """Order, per-shape times and failures from one key's rows; None when every backend failed.
        Backends within TIE of each other are measured equal: they keep the registry's order, so noise
        never swaps two layouts of one kernel (next_n 1's native and flatten are the same launch).
        Rows of the whole step (op STEP, from step_rows) rank the batch sizes whose every shape they
        time (`ranked_by: step`); a backend that fails in the step fails for the key."""
        from dispatch.bench.runner import UNSERVED  # imports torch, which the tuner's runs need anyway
        from dispatch.bench.step import STEP

        failed: dict[str, str] = {}
        unserved: dict[str, str] = {}
        times: dict[str, dict[str, float]] = {}
        step_times: dict[str, dict[str, float]] = {}
        for row in rows:
            in_step = getattr(row, "op", None) == STEP
            where = f" at {row.shape}" + (" in the step" if in_step else "")
            if row.check.startswith(UNSERVED):  # it cannot run some shape of the key: never preferred there
                unserved.setdefault(row.backend, row.check + where)
            elif row.check != "ok":
                failed.setdefault(row.backend, row.check + where)
            else:
                (step_times if in_step else times).setdefault(row.shape, {})[row.backend] = round(row.seconds * 1e6, 1) or 0.1
        if failed:
            self.failures += 1
            self.say(f"check failed, never preferred: {failed}")
        if unserved:
            self.say(f"cannot serve every shape of the key, never preferred: {unserved}")
        names = {r.backend for r in rows} - set(failed) - set(unserved)
        shapes = [{"shape": shape, "median_us": {name: by[name] for name in sorted(names)}} for shape, by in times.items()]
        stepped = [{"shape": shape, "median_us": {name: by[name] for name in sorted(names)}, "stages": stages_of(rows, shape)}
                   for shape, by in step_times.items() if names <= set(by) and shape in times]
        step_sizes = step_times_by_size(shapes, stepped)
        stepped = [s for s in stepped if batch_size_of(s["shape"]) in step_sizes]  # only where a whole band is
        by_step = bool(stepped) and len(stepped) == len(shapes)  # every shape timed in the step: the key too
        ranking = step_times if by_step else times
        order = measured_order(names, lambda name: _geomean(ranking, name), rule_order)
        if not order:
            return None
        shapes = [{"shape": s["shape"], "median_us": {name: s["median_us"][name] for name in order}} for s in shapes]
        for s in stepped:
            s["median_us"] = {name: s["median_us"][name] for name in order}
        bands = band_orders(shapes, order, rule_order, stepped)  # where one backend does not win every batch size
        if not bands and not by_step:
            stepped = []  # a single batch size only partly timed in the step: nothing is ranked by it
        return {"order": order, **({"ranked_by": "step"} if by_step else {}), **({"bands": bands} if bands else {}),
                "shapes": shapes, **({"step_shapes": stepped} if stepped else {}), **timing_of(rows, names | set(failed)),
                **({"failed": failed} if failed else {})}

    def free(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()

    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.started:6.1f} s] {text}", file=sys.stderr, flush=True)


def _geomean(times: dict[str, dict[str, float]], name: str) -> float:
    return geometric_mean([by[name] for by in times.values()])


def _header(cluster: str | None, overlay: dict, relative: str | None) -> str:
    include = f"`measured: {relative}`" if relative else "`measured: <this file, relative to the registry>`"
    return (
        f"# Measured by `python -m dispatch tune{f' --cluster {cluster}' if cluster else ''}` on {overlay['machine']}, "
        f"{overlay['date']}.\n"
        "# Per op and key: the backends fastest first (geometric mean of median times over the shapes), where\n"
        "# one backend does not win every batch size the same per batch-size band (`bands`), inside a band per\n"
        "# length where one does not win every length (`lengths`, up to each measured mean L's 3L/2), each\n"
        "# shape's times, and the backends that failed the check against the reference (never preferred).\n"
        "# `ranked_by: step`: that order is by the whole step's times (`step_shapes`), each candidate in turn;\n"
        "# `timing`: graph (CUDA-graph replays) or eager, with any backend timed eagerly (`timed_eagerly`).\n"
        f"# A cluster includes it with {include}; re-run tune rather than edit it.\n"
    )


def _declared_overlay(document, cluster) -> str | None:
    """Where the cluster's `measured:` path points, read from the registry file's folder as the loader
    reads it (a cluster taken from the packaged registry is refused before this)."""
    if cluster is None or not cluster.measured:
        return None
    return str(Path(document.path).parent / cluster.measured)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    import platform

    return platform.processor() or platform.machine()
