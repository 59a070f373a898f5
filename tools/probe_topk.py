"""GPU probe for the Triton top-k kernels: times them (a sweep of launch configs), torch.topk,
FlashInfer's top_k_ragged_transform and dispatch's CUDA top-k (`cuda.radix`, where it compiles) on
indexer-like logits, checks each against torch.topk, prints a table last.

    PYTHONPATH=. python3 tools/probe_topk.py            # details to $OUT/probe_topk.json if OUT is set
    PYTHONPATH=/opt/triton36:. python3 tools/probe_topk.py --resources   # no GPU: sm_90 registers
    TRITON_INTERPRET=1 PYTHONPATH=. python3 tools/probe_topk.py --smoke  # tiny shapes on the CPU

Logits as the indexer makes them: random fp32, -inf past each row's length; per request a context
L uniform in [L/2, 3L/2], and its N query tokens see L - N + j + 1 keys (j = 0..N-1). k = 2048.
Times are medians of triton.testing.do_bench (L2 flushed before each run), of each call replayed
from a CUDA graph (the serving step is captured; the Triton top-k is three launches) and, for the
default config and FlashInfer, also eager. The floor is the visible logits' bytes read once at
4.2 TB/s. "exact" means each row's selected values equal torch.topk's as multisets, with distinct
positions inside [0, length) (and, sorted, in descending order). For the default config a profiler
pass gives each kernel's own time (bracket, split, finish, sort).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends.triton.topk import launch, launch_config  # noqa: E402

K = 2048
BYTES_PER_S = 4.2e12
SHAPES = [("B128 N4 L32K", 128, 4, 32768), ("B128 N1 L32K", 128, 1, 32768), ("B32 N2 L8K", 32, 2, 8192)]
# Changes to launch_config's default for the shape, swept in this order: the finish's fine bins, the
# split's chunk (block x tiles) and warps, then the bracket's sample, the refine's radix and the
# finish's warps.
SWEEP = [
    {},
    {"fine": 256},
    {"fine": 4096},
    {"block": 1024, "tiles": 1, "num_warps": 4},
    {"block": 2048, "tiles": 1, "num_warps": 8},
    {"block": 512, "tiles": 1, "num_warps": 2},
    {"block": 4096, "tiles": 1, "num_warps": 16},
    {"block": 1024, "tiles": 2, "num_warps": 4},
    {"block": 2048, "tiles": 2, "num_warps": 8},
    {"block": 2048, "tiles": 4, "num_warps": 8},
    {"sample": 2048},
    {"sample": 1024},
    {"radix": 8},
    {"finish_warps": 4},
    {"finish_warps": 16},
]
FALLBACK = {"z": -1e9}  # the bracket is one bin: the exact radix select over each row, what a misjudged sample costs
# The lead's call is limited (~150 s in all): sweep configs past a shape's share are reported as skipped.
TIME_BUDGET_S = 110
KEYS = ("block", "tiles", "lanes", "num_warps", "sample", "z", "radix", "cap", "finish_warps", "fine", "ties")

SMOKE = "--smoke" in sys.argv
if SMOKE:  # the script's own check, under the interpreter: tiny shapes, two configs, wall-clock timing
    K, SHAPES, SWEEP = 64, [("smoke N2", 3, 2, 1024)], [{}, {"block": 256, "tiles": 2}]
DEVICE = "cpu" if SMOKE else "cuda"


def make_batch(batch, next_n, context, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    ctx = torch.randint(context // 2, context * 3 // 2 + 1, (batch,), generator=gen, device=DEVICE)
    lengths = (ctx[:, None] - next_n + torch.arange(next_n, device=DEVICE)[None, :] + 1).reshape(-1).to(torch.int32)
    width = int(lengths.max())
    logits = torch.randn(lengths.numel(), width, generator=gen, device=DEVICE)
    logits.masked_fill_(torch.arange(width, device=DEVICE)[None, :] >= lengths[:, None], float("-inf"))
    return logits, lengths


def exact(logits, lengths, positions, want_sorted, descending=False):
    """Every row: k distinct positions inside [0, length) whose values equal torch.topk's multiset."""
    positions = positions.long()
    if ((positions < 0) | (positions >= lengths[:, None].long())).any():
        return False
    values = logits.gather(1, positions)
    if descending and (values[:, 1:] > values[:, :-1]).any():
        return False
    ordered = positions.sort(dim=1).values
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        return False
    return bool(torch.equal(values.sort(dim=1).values, want_sorted))


def bench(fn, graph):
    """Median microseconds of fn, eager or replayed from a CUDA graph captured here."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    if graph:
        fn()  # warm: compiles and allocates the workspace before capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def kernel_times(fn):
    """Per-kernel device microseconds of one call (mean of 10), from the profiler."""
    if SMOKE:
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.key.startswith("_") and "kernel" in event.key:
            times[event.key] = round(event.device_time_total / 10, 1)
    return times


def flashinfer_ragged():
    try:
        import flashinfer

        return flashinfer.top_k_ragged_transform
    except Exception as exc:  # an optional extra: report why it is missing and go on
        print(f"flashinfer unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def cuda_radix():
    """backends/cuda_topk's radix_topk where its probe compiles it on this machine, else None (why, printed)."""
    from backends.cuda_topk.build import probe

    availability = probe()
    if not availability.ok:
        print(f"cuda.radix not measured: {availability.reason}")
        return None
    from backends.cuda_topk.radix_topk import radix_topk

    return radix_topk


def label(config):
    return ",".join(str(config[key]) for key in KEYS)


def probe() -> None:
    started = time.time()
    fi = None if SMOKE else flashinfer_ragged()
    radix = None if SMOKE else cuda_radix()
    rows_out, table = [], []
    for name, batch, next_n, context in SHAPES:
        logits, lengths = make_batch(batch, next_n, context)
        rows, width = logits.shape
        floor_us = float(lengths.sum()) * 4 / BYTES_PER_S * 1e6
        want = torch.topk(logits, K, dim=1).values.sort(dim=1).values
        default = launch_config(rows, width, K)
        results = []

        def record(impl, config, fn, graph=True, to_positions=lambda out: out, descending=False, budget=None):
            if budget is not None and time.time() - started > budget:
                results.append({"impl": impl, "config": config, "error": "skipped: over the probe's time budget"})
                return
            try:
                ok = exact(logits, lengths, to_positions(fn()), want, descending)
                us = bench(fn, graph)
                results.append({"impl": impl, "config": config, "us": us, "exact": ok, "graph": graph and not SMOKE})
            except Exception as exc:  # a config that fails to compile or run is reported, not fatal
                results.append({"impl": impl, "config": config, "error": f"{type(exc).__name__}: {exc}"[:300]})

        # Always measured: the default config (graph and eager), the fused page-table transform
        # (identity table: slots = positions), the Triton sort, the forced fallback, the peers.
        record("triton", default, lambda: launch(logits, lengths, K, **default))
        record("triton eager", default, lambda: launch(logits, lengths, K, **default), graph=False)
        table_pages = triton.cdiv(width, 64)
        page_table = torch.arange(rows * table_pages, dtype=torch.int32, device=DEVICE).reshape(rows, table_pages)
        page_rows = torch.arange(rows, dtype=torch.int32, device=DEVICE)
        record("triton +pages", default, lambda: launch(logits, lengths, K, page_table=page_table,
                                                       page_rows=page_rows, block_size=64, **default),
               to_positions=lambda out: out.long() - page_rows[:, None].long() * table_pages * 64)
        record("triton sorted", default, lambda: launch(logits, lengths, K, sorted=True, **default), descending=True)
        radix_finish = {**default, "fine": 0}  # round 2's finish: the A/B of the two-level one, always measured
        record("triton radix-fin", radix_finish, lambda: launch(logits, lengths, K, **radix_finish))
        fallback = {**default, **FALLBACK}
        record("triton two-pass", fallback, lambda: launch(logits, lengths, K, **fallback))
        record("torch.topk", {}, lambda: torch.topk(logits, K, dim=1).indices, graph=False)
        if radix is not None:  # dispatch's CUDA top-k, where it compiled here
            record("cuda.radix", {}, lambda: radix(logits, lengths, K))
        if fi is not None:
            offsets = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
            record("flashinfer ragged", {}, lambda: fi(logits, offsets, lengths, K), graph=False)
        # The sweep, within this shape's share of the time budget.
        share = TIME_BUDGET_S * (SHAPES.index((name, batch, next_n, context)) + 1) / len(SHAPES)
        for change in SWEEP[1:]:
            cfg = {**default, **change}
            record("triton", cfg, lambda cfg=cfg: launch(logits, lengths, K, **cfg), budget=share)
        if fi is not None:  # last: a capture it refuses must not disturb the Triton rows
            record("flashinfer graph", {}, lambda: fi(logits, offsets, lengths, K))
        best = min((r for r in results if r["impl"] == "triton" and "us" in r and r["exact"]),
                   key=lambda r: r["us"], default=None)
        cfg = default if best is None else best["config"]
        fi_us = next((r["us"] for r in results if r["impl"] == "flashinfer ragged" and "us" in r), None)
        split = kernel_times(lambda: launch(logits, lengths, K, sorted=True, page_table=page_table,
                                            page_rows=page_rows, **cfg))
        # The finish A/B stage by stage: the default (two-level finish) and round 2's radix finish, plain.
        stages = {"two-level": kernel_times(lambda: launch(logits, lengths, K, **default)),
                  "radix": kernel_times(lambda: launch(logits, lengths, K, **radix_finish))}
        for r in results:
            r.update(shape=name, rows=rows, width=width, floor_us=floor_us)
            if "us" in r:
                r["x_floor"] = r["us"] / floor_us
                r["flashinfer_over"] = fi_us / r["us"] if fi_us else None
        rows_out.extend(results)
        rows_out.append({"shape": name, "kernel_us": split, "config": cfg, "finish_ab_us": stages})
        print(f"{name}: rows {rows} x W {width}, floor {floor_us:.1f} us, default {label(default)}, "
              f"best {None if best is None else label(best['config'])}; per kernel at best (sorted, pages): {split}; "
              f"default per kernel, two-level vs radix finish: {stages}", flush=True)
        for r in results:
            cfg_text = label(r["config"]) if r["config"] else "-"
            if "error" in r:
                table.append(f"{name:13s} {r['impl']:17s} {cfg_text:34s} ERROR {r['error'][:90]}")
                continue
            fi_ratio = f"{r['flashinfer_over']:5.2f}x" if r["flashinfer_over"] else "   - "
            table.append(f"{name:13s} {r['impl']:17s} {cfg_text:34s} {r['us']:7.1f} us {'graph' if r['graph'] else 'eager'}"
                         f"  x{r['x_floor']:5.2f} floor  FI/this {fi_ratio}  {'exact' if r['exact'] else 'WRONG'}")
        del logits, lengths, want
        if not SMOKE:
            torch.cuda.empty_cache()

    device_name = "cpu (interpreter)" if SMOKE else torch.cuda.get_device_name()
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "probe_topk.json"), "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "triton": triton.__version__,
                       "k": K, "results": rows_out}, f, indent=1)
    print(f"\n# top-k probe, {device_name}, torch {torch.__version__}, triton {triton.__version__}, k={K}, "
          f"config = {','.join(KEYS)}, {time.time() - started:.0f} s")
    print("\n".join(table))
    print("\n# summary (us; graph-replayed unless eager; bar = FlashInfer ragged / 3 at N4, / 2 otherwise)")
    print(f"{'shape':13s} {'floor':>6s} {'FI':>6s} {'bar':>6s} {'default':>8s} {'best':>6s} {'eager':>6s} "
          f"{'+pages':>7s} {'sorted':>7s} {'2-pass':>7s} {'torch':>6s}  per kernel at best")
    for name, *_ in SHAPES:
        got = {}
        for r in rows_out:
            if r.get("shape") == name and "us" in r and r["exact"]:
                got[r["impl"]] = min(got.get(r["impl"], float("inf")), r["us"])
        first = next((r for r in rows_out if r.get("shape") == name and r.get("impl") == "triton"), {})
        fi_us = got.get("flashinfer ragged")
        bar = fi_us / (3 if "N4" in name else 2) if fi_us else None
        kernels = next((r["kernel_us"] for r in rows_out if r.get("shape") == name and "kernel_us" in r), {})

        def cell(value, width=6):
            return f"{value:{width}.1f}" if value is not None else f"{'-':>{width}s}"

        print(f"{name:13s} {cell(first.get('floor_us'))} {cell(fi_us)} {cell(bar)} {cell(first.get('us'), 8)} "
              f"{cell(got.get('triton'))} {cell(got.get('triton eager'))} {cell(got.get('triton +pages'), 7)} "
              f"{cell(got.get('triton sorted'), 7)} {cell(got.get('triton two-pass'), 7)} {cell(got.get('torch.topk'))}  "
              f"{kernels}")
    print("\n# finish A/B (us, graph-replayed; per kernel from the profiler): default (two-level) vs fine=0 (radix)")
    for name, *_ in SHAPES:
        mine = [r for r in rows_out if r.get("shape") == name]
        whole = {label: next((round(r["us"], 1) for r in mine if r.get("impl") == impl and "us" in r and r["exact"]),
                             None)
                 for label, impl in (("two-level", "triton"), ("radix", "triton radix-fin"))}
        stages = next((r["finish_ab_us"] for r in mine if "finish_ab_us" in r), {})
        print(f"{name:13s} whole {whole}  per kernel {stages}")
    if SMOKE:  # the smoke mode is a check: any error or inexact selection fails it
        bad = [r for r in rows_out if "impl" in r and ("error" in r or not r["exact"])]
        if bad:
            sys.exit(f"smoke: {len(bad)} of the probe's rows failed: " + "; ".join(
                f"{r['impl']} {r.get('error', 'not exact')}"[:200] for r in bad[:5]))


# Integer arguments divisible by 16 at the probe's shapes, which Triton specialises unless a kernel opts
# out (the row stride everywhere, topk_keys.ROW_STRIDE_NOT_SPECIALISED; the list stride in the finish,
# topk_finish.FINISH_NOT_SPECIALISED).
SPECIALISED_INTS = {"k", "cap", "stride_cand"}


def resources() -> None:
    """Compile each kernel at every swept config for sm_90 without a GPU; print registers, stack (spills),
    shared and local memory."""
    import subprocess

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from backends.triton import topk

    from tools.cuda_binaries import require_bundled

    cuobjdump = require_bundled("cuobjdump")
    pointers = {"logits_ptr": "*fp32", "lengths_ptr": "*i32", "starts_ptr": "*i32", "out_ptr": "*i32",
                "cand_ptr": "*i64", "pt_ptr": "*i32", "page_rows_ptr": "*i32", "bracket_ptr": "*fp32",
                "counts_ptr": "*i64", "window_ptr": "*fp32", "hist_ptr": "*i32", "ties_ptr": "*i64"}
    seen = set()
    for rows, width in [(512, 49070), (128, 49070), (64, 11814)]:
        for change in SWEEP:
            c = {**launch_config(rows, width, K, interpreted=False), **change}
            variants = [
                (topk._bracket_kernel, {"HAS_STARTS": False, "BINS": c["bins"], "SAMPLE": c["sample"], "Z": c["z"],
                                        "FINE": c["fine"]}, c["finish_warps"]),
                (topk._split_kernel, {"HAS_STARTS": False, "BLOCK": c["block"], "TILES": c["tiles"],
                                      "LANES": c["lanes"]}, c["num_warps"]),
            ]
            for pages in (False, True):
                variants.append((topk._finish_kernel, {"HAS_STARTS": False, "HAS_PAGES": pages, "BLOCK_SIZE": 64,
                                                       "BLOCK": topk.FINISH_LANES * 32 * c["finish_warps"],
                                                       "LANES": topk.FINISH_LANES, "RADIX": c["radix"],
                                                       "RADIX_BINS": max(1 << c["radix"], 32), "FINE": c["fine"],
                                                       "TIES": c["ties"]}, c["finish_warps"]))
                variants.append((topk._sort_kernel, {"HAS_STARTS": False, "HAS_PAGES": pages, "BLOCK_SIZE": 64,
                                                     "KP": K}, c["finish_warps"]))
            for kernel, constexprs, warps in variants:
                key = (kernel.fn.__name__, tuple(sorted(constexprs.items())), warps)
                if key in seen:
                    continue
                seen.add(key)
                names = kernel.arg_names
                signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
                # What the runtime specialises at the probe's shapes: 16-byte-aligned pointers (torch's
                # allocations) and the integers divisible by 16 there (k = 2048, cap, the list stride);
                # without these attributes the counts describe code that never runs (the finish: 9.8K
                # instructions and 151 barriers compiled bare, 10.7K and 216 as launched).
                specialised = (set(pointers) | SPECIALISED_INTS) - set(kernel.do_not_specialize)
                attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in specialised}
                source = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                                   attrs=attrs)
                t = time.time()
                compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
                path = "/tmp/topk_sm90.cubin"
                with open(path, "wb") as f:
                    f.write(compiled.asm["cubin"])
                usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], check=True, capture_output=True,
                                       text=True).stdout
                regs = " ".join(w for w in usage.split() if w.startswith(("REG:", "STACK:", "SHARED:", "LOCAL:")))
                print(f"{kernel.fn.__name__:15s} warps {warps:2d} {constexprs}: {regs} "
                      f"({time.time() - t:.1f} s) sass {sass_counts(cuobjdump, path)}", flush=True)


def sass_counts(cuobjdump: str, path: str) -> str:
    """Static SASS counts of a cubin: all instructions, barriers, shared-memory and shuffle ones, global
    atomics (RED/ATOM)."""
    import subprocess

    sass = subprocess.run([cuobjdump, "-sass", path], check=True, capture_output=True, text=True).stdout
    ops = []
    for line in sass.splitlines():
        text = line.split("*/", 1)[1].strip() if line.strip().startswith("/*") and "*/" in line else ""
        if text:
            op = text.split()[0]
            ops.append(text.split()[1] if op.startswith("@") and len(text.split()) > 1 else op)
    count = lambda *prefixes: sum(o.startswith(prefixes) for o in ops)  # noqa: E731
    return (f"{len(ops)} instrs, {count('BAR')} BAR, {count('LDS', 'STS', 'ATOMS')} LDS/STS, {count('SHFL')} SHFL, "
            f"{count('REDG', 'RED.', 'ATOMG', 'ATOM.')} RED/ATOM")


if __name__ == "__main__":
    resources() if "--resources" in sys.argv else probe()
