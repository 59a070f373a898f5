"""GPU: variants of `cuda.radix`'s kernel (copies of backends/cuda_topk/radix_select.cu, edited) built side by
side and timed in one process, beside the engines' own top-k kernels where they import, on the logits
`bench --op topk` gives each shape (the decided paged logits kernel over bench's workload, seed 0) and on
4096 randn prefill rows. How docs/benchmarks.md's `cuda.radix` tables were measured.

    PYTHONPATH=. python3 tools/time_radix_variants.py backends/cuda_topk/radix_select.cu my_change.cu \\
        [--shapes 128x49K,64x12K,prefill] [--peers] [--reps 30]

- Each variant is compiled in a process of its own, all at once (backends/cuda_topk/compile_child.py, the
  served build's flags), and called as the served launch calls it (radix_topk.instance's CTA for the
  shape). Every output is checked against torch.topk (dispatch.bench.compare.compare_topk) before it is
  timed; a wrong one is reported WRONG and not timed. A variant whose file name starts with "ret" is timed
  unchecked (a kernel cut short on purpose, to time what remains).
- --cta times each variant at other CTAs too (named VARIANT@CTA). A variant that exports
  `served_stage(device, threads, short_list)` (one that stages rows in shared memory, as the fourteenth
  session's bulk-copy variant did) is launched with that stage, every other with none, as served.
- A variant whose name holds "stamp" (made by tools/radix_phase_stamps.py) also prints, per phase, the
  median and the slowest row's time since the rows' start.
- --peers: SGLang's top-k v2 (`sglang.kernels.ops.attention.dsv4.topk`: the paged kernel with its plan built
  beforehand, the ragged one for the prefill rows) and vLLM's `torch.ops._C` top-k ops (`vllm._custom_ops`),
  each called raw, as its engine calls it, where importable. vLLM's are checked; SGLang's paged output is
  positions through no page table and is checked too.
- --pages: every variant is called with the plan's block table and page rows, as the decode and verify
  step serves it (the paged instances, whose output is physical KV slots); its output is mapped back to
  positions (positions_of_slots) before the check. The prefill rows and the engines' calls stay unpaged.
- Medians of CUDA-graph replays held behind a spin kernel (dispatch.bench.timing), one call a graph, the L2
  not flushed; a replay of one 1-element add is printed first: every figure's floor.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.cuda_topk.build import load_library  # noqa: E402
from backends.cuda_topk.radix_topk import instance  # noqa: E402
from dispatch.bench.compare import compare_topk  # noqa: E402
from dispatch.contract import BLOCK_KV  # noqa: E402
from dispatch.bench.runner import decided_logits  # noqa: E402
from dispatch.bench.timing import time_rotating  # noqa: E402
from dispatch.bench.workload import LogitsShape, logits_inputs  # noqa: E402
from dispatch.contract.detect import detect_arch, platform_fp8_dtype  # noqa: E402
from dispatch.deciding.runtime import load_dispatcher  # noqa: E402
from tools.radix_phase_stamps import NAMES, SLOTS  # noqa: E402

K = 2048
# Issue 23's table: rows x width as (B, next_n, mean length).
SHAPES = {
    "512x49K": (128, 4, 32768), "128x49K": (128, 1, 32768), "64x12K": (32, 2, 8192), "256x98K": (64, 4, 65536),
    "512x24K": (256, 2, 16384), "32x10K": (8, 4, 8192), "8x3K": (8, 1, 2048), "1x2K": (1, 1, 2048),
    "128x12K": (128, 1, 8192),  # the widest batch of short rows no more than the SMs: B=128 next_n 1 L~8K
}
PREFILL = "prefill"
# --cta's names for the kernel's instances, (threads, short_list); "auto" is radix_topk.instance's choice.
CTAS = {"512": (512, False), "1024": (1024, False), "short": (512, True)}
CTA_NAMES = {cta: name for name, cta in CTAS.items()}
BUILD_DIR = Path(tempfile.gettempdir()) / "dispatch_radix_variants"


def build(paths: list[str], where: Path = BUILD_DIR) -> dict[str, object]:
    """Every variant compiled at once, each in its own process and folder under `where`: {file stem: module}."""
    running = []
    for path in paths:
        stem = Path(path).stem
        folder = where / stem
        folder.mkdir(parents=True, exist_ok=True)
        log = open(folder / "build.log", "w")
        child = subprocess.Popen(
            [sys.executable, str(ROOT / "backends" / "cuda_topk" / "compile_child.py"), str(Path(path).resolve()),
             str(folder), f"radix_variant_{stem}"], stdout=log, stderr=subprocess.STDOUT)
        running.append((stem, folder, log, child))
    modules = {}
    for stem, folder, log, child in running:
        child.wait()
        log.close()
        if child.returncode:
            print(f"BUILD FAILED {stem}:\n{(folder / 'build.log').read_text()[-3000:]}", flush=True)
            continue
        modules[stem] = load_library(f"radix_variant_{stem}", folder / f"radix_variant_{stem}.so")
    return modules


def step_logits(dispatcher, fp8, shape: LogitsShape):
    """bench_topk's logits for `shape`, the plan's per-token lengths, and its (block table, page rows)."""
    plan, logits = decided_logits(dispatcher, shape, fp8, logits_inputs(shape, fp8, "cuda", seed=0))
    rows = logits.shape[0]
    page_rows = plan.page_rows if plan.page_rows is not None else torch.arange(rows, device=logits.device)
    pages = (plan.block_table.to(torch.int32).contiguous(), page_rows.to(torch.int32).contiguous())
    return logits, plan.token_lengths.to(torch.int32).contiguous(), pages


def positions_of_slots(out: torch.Tensor, table: torch.Tensor, page_rows: torch.Tensor,
                       block_size: int) -> torch.Tensor:
    """A paged top-k's physical slots back as row positions: slot s of row r is position j * block_size +
    s % block_size where table[page_rows[r], j] holds s // block_size (a row's pages are distinct blocks);
    -1 stays -1, and a slot of no page of its row becomes width-sized garbage (the check then fails it)."""
    row_table = table[page_rows.long()].long()  # [rows, M]
    ordered, page_of = row_table.sort(dim=1)
    block = torch.where(out >= 0, out.long() // block_size, -1)
    at = torch.searchsorted(ordered, block).clamp(max=ordered.shape[1] - 1)
    found = ordered.gather(1, at) == block
    position = page_of.gather(1, at) * block_size + out.long() % block_size
    never = table.shape[1] * block_size  # past every row's width: not a position
    return torch.where(out < 0, -1, torch.where(found, position, never)).to(torch.int32)


def prefill_rows(rows: int = 4096, longest: int = 16384, seed: int = 0):
    """The probe's prefill: randn rows, lengths uniform in 1..longest, from column 0."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (rows,), generator=generator, device="cuda", dtype=torch.int32)
    return torch.randn(rows, longest, generator=generator, device="cuda"), lengths


def replay_us(fn, repeats: int) -> float:
    return time_rotating([fn], on_gpu=True, repeats=repeats)[0] * 1e6


def engine_kernels() -> dict[str, object]:
    found = {}
    try:
        from sglang.kernels.ops.attention.dsv4 import topk as sglang_v2

        found["sglang"] = sglang_v2
    except Exception as error:  # noqa: BLE001 - an absent or broken engine is reported, not fatal
        print(f"no SGLang top-k v2: {type(error).__name__}: {error}")
    try:
        import vllm._custom_ops  # noqa: F401 - registers torch.ops._C's top-k ops

        found["vllm"] = torch.ops._C
    except Exception as error:  # noqa: BLE001
        print(f"no vLLM top-k ops: {type(error).__name__}: {error}")
    return found


def engine_calls(engines: dict, logits, lengths, prefill: bool) -> dict[str, tuple]:
    """{name: (call, its output)}: each engine kernel called raw, its scratch and plan made beforehand."""
    rows, width = logits.shape
    lens = lengths.clamp(max=width).contiguous()
    calls = {}
    if "sglang" in engines:
        module = engines["sglang"]
        out = torch.empty(rows, K, dtype=torch.int32, device="cuda")
        if prefill:
            zeros = torch.zeros_like(lens)
            calls["sglang ragged v2"] = (lambda: module.topk_transform_ragged_v2(
                logits, lens, out_offsets=zeros, out_indices=out, row_starts=zeros), out)
        else:
            metadata = module.plan_topk_v2(lens)
            calls["sglang v2"] = (lambda: module.topk_transform_paged_v2(logits, lens, None, out, 64, metadata), out)
    if "vllm" in engines:
        ops = engines["vllm"]
        workspace = torch.empty(1 << 26, dtype=torch.uint8, device="cuda")
        persistent = torch.full((rows, K), -1, dtype=torch.int32, device="cuda")
        calls["vllm persistent"] = (lambda: ops.persistent_topk(logits, lens, persistent, workspace, K, width), persistent)
        if rows <= 64:  # its limit: one cluster wave
            cooperative = torch.full((rows, K), -1, dtype=torch.int32, device="cuda")
            calls["vllm cooperative"] = (lambda: ops.cooperative_topk(logits, lens, cooperative, workspace, K, width),
                                         cooperative)
        if prefill:
            per_row = torch.full((rows, K), -1, dtype=torch.int32, device="cuda")
            starts = torch.zeros_like(lens)
            calls["vllm per_row prefill"] = (lambda: ops.top_k_per_row_prefill(
                logits, starts, starts + lens, per_row, rows, logits.stride(0), logits.stride(1), K), per_row)
    return calls


def phase_line(module, run, rows: int) -> str:
    module.clear_stamps()
    run()
    torch.cuda.synchronize()
    stamps = module.stamps(rows).to(torch.float64)
    cells = []
    for slot in range(1, SLOTS):
        hit = stamps[:, slot] > 0
        if not hit.any():
            continue
        since = (stamps[:, slot] - stamps[:, 0])[hit] / 1e3
        cells.append(f"{NAMES.get(slot, slot)} {since.median().item():.2f}/{since.max().item():.2f}")
    spread = (stamps[:, 0].max() - stamps[:, 0].min()).item() / 1e3
    return f"  phases, us since the row's start, median/slowest (rows start {spread:.2f} us apart): " + "; ".join(cells)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="copies of radix_select.cu")
    parser.add_argument("--shapes", default=",".join([*SHAPES, PREFILL]))
    parser.add_argument("--peers", action="store_true", help="the engines' kernels too, where importable")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--pages", action="store_true",
                        help="call the variants with the plan's block table, as the step serves them")
    parser.add_argument("--cta", default="auto",
                        help="CTAs to time each variant with, comma-separated: auto (radix_topk.instance's choice for "
                             "the shape), 512, 1024, short (the short-list instance)")
    parser.add_argument("--build-dir", type=Path, default=BUILD_DIR, help=f"where the variants build (default {BUILD_DIR})")
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES and s != PREFILL]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join([*SHAPES, PREFILL])}")
    unknown = [c for c in args.cta.split(",") if c not in CTAS and c != "auto"]
    if unknown:
        parser.error(f"unknown --cta {unknown}; known: auto, {', '.join(CTAS)}")
    if not torch.cuda.is_available():
        print("no CUDA device: this tool times kernels on a GPU", file=sys.stderr)
        return 2
    started = time.time()
    modules = build(args.variants, args.build_dir)
    print(f"built {', '.join(modules)} in {time.time() - started:.0f} s", flush=True)
    engines = engine_kernels() if args.peers else {}
    dispatcher = load_dispatcher()
    fp8 = platform_fp8_dtype(detect_arch())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiny = torch.zeros(1, device="cuda")
    print(f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"a 1-element add replays in {replay_us(lambda: tiny.add_(1.0), args.reps):.2f} us", flush=True)
    for label in args.shapes.split(","):
        prefill = label == PREFILL
        table = page_rows = None  # unpaged unless --pages, and the prefill rows always
        if prefill:
            logits, lengths = prefill_rows()
        else:
            logits, lengths, pages = step_logits(dispatcher, fp8, LogitsShape(*SHAPES[label]))
            if args.pages:
                table, page_rows = pages
        rows, width = logits.shape
        chosen = instance(rows, width, sms)
        ctas = [CTAS.get(c, chosen) for c in args.cta.split(",")]
        cells, phases = [], []
        for stem, module in modules.items():
            for threads, short_list in dict.fromkeys(ctas):
                name = stem if (threads, short_list) == chosen else f"{stem}@{CTA_NAMES[threads, short_list]}"
                # A variant that stages rows (served_stage) gets the served launch's stage, else none.
                stage = module.served_stage(0, threads, short_list) if hasattr(module, "served_stage") else 0
                out = torch.empty(rows, K, dtype=torch.int32, device="cuda")

                def run(module=module, out=out, threads=threads, short_list=short_list, stage=stage):
                    # no dependent launch: a graph of this one kernel has no kernel before it to overlap
                    module.radix_topk(logits, lengths, None, table, page_rows, K, BLOCK_KV, stage, True, threads,
                                      short_list, False, out)

                run()
                torch.cuda.synchronize()
                positions = out if table is None else positions_of_slots(out, table, page_rows, BLOCK_KV)
                verdict = "ok" if stem.startswith("ret") else compare_topk(positions, logits, lengths, K)[1]
                if verdict != "ok":
                    cells.append(f"{name} WRONG ({verdict})")
                    continue
                cells.append(f"{name} {replay_us(run, args.reps):.1f}")
                if "stamp" in stem:
                    phases.append(f"{name}:" + phase_line(module, run, rows))
        for name, (call, out) in engine_calls(engines, logits, lengths, prefill).items():
            try:
                call()
                torch.cuda.synchronize()
                verdict = compare_topk(out, logits, lengths, K)[1]
                cells.append(f"{name} {replay_us(call, args.reps):.1f}" + ("" if verdict == "ok" else f" ({verdict})"))
            except Exception as error:  # noqa: BLE001 - one engine's failure must not end the others' rows
                cells.append(f"{name} ERROR ({type(error).__name__}: {str(error)[:80]})")
        paged = ", paged" if table is not None else ""
        print(f"{label} ({rows} x {width}, {CTA_NAMES[chosen]} as served{paged}), us: " + " | ".join(cells), flush=True)
        for line in phases:
            print(line, flush=True)
        del logits, lengths, table, page_rows
        torch.cuda.empty_cache()
    print(f"done in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
