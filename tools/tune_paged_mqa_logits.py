"""Times launch configs of the Triton paged MQA logits kernel at the serving shape, correctness first.

    PYTHONPATH=. python tools/tune_paged_mqa_logits.py --out $OUT    # on a GPU: sweep
    PYTHONPATH=. python tools/tune_paged_mqa_logits.py --resources   # no GPU: sm_90 registers

The sweep measures the two ceilings (device copy bandwidth, fp8 _scaled_mm rate), builds one paged
cache of B requests with lengths uniform in [low, high], checks every config against the torch
reference (relative error over visible positions, exact -inf pattern), then times it with
triton.testing.do_bench (median; do_bench clears L2 before each call) while rotating over several
q / weights / block-table sets. The floor is max(bytes / copy bandwidth, flops / fp8 rate), with
bytes = every needed KV page once + q + weights + the whole logits output, and flops = 2 H D per
visible (token, key) pair. Results go to OUT/tune.jsonl as they come and a table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

# The repository root, so tools.* imports as in its sibling tools, with or without PYTHONPATH=.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dispatch.bench.ceilings import measure_ceilings
from dispatch.bench.compare import compare_logits
from dispatch.contract.paged_cache import build_paged_kv_cache, page_table_for, pages_of
from dispatch.bench.workload import LogitsShape, logits_floor_counts
from dispatch.contract.bounds import new_error_flags
from dispatch.contract.kv_cache import BLOCK_KV
from backends.reference.paged_mqa_logits import reference_paged_mqa_logits as reference_logits
from backends.shared.page_guard import guard_pages
from backends.triton.paged_mqa_logits import (
    LaunchConfig,
    _paged_mqa_logits_kernel,
    default_config,
    schedule_for,
    triton_paged_mqa_logits,
)
from dispatch.contract.key import Fp8Dtype
from dispatch.contract.layout import Layout
from dispatch.step.paged_plan import layout_tensors

HEADS, HEAD_DIM = 64, 128
DEVICE = "cuda"  # a smoke test of the input building on the CPU sets "cpu"
TOLERANCE = 1e-3  # fp8 dot on the GPU

C = LaunchConfig
# (shape name, next_n, layout) -> configs; `tokens` beyond next_n is clipped by the wrapper.
SWEEP = {
    ("n4_native", 4, Layout.NATIVE): [
        C(4, 1, 2, 4, 5), C(4, 1, 1, 4, 5), C(4, 1, 3, 4, 5), C(4, 1, 2, 4, 7), C(4, 1, 2, 4, 4), C(2, 1, 2, 4, 5),
    ],
    ("n1", 1, Layout.NATIVE): [
        C(1, 1, 6, 4, 6), C(1, 1, 4, 4, 6), C(1, 1, 5, 4, 6), C(1, 1, 7, 4, 6), C(1, 1, 6, 4, 5), C(1, 1, 6, 4, 7),
        C(1, 1, 8, 4, 5), C(1, 1, 12, 2, 4), C(1, 1, 8, 2, 6),
    ],
    ("n4_flatten", 4, Layout.FLATTEN): [C(1, 1, 4, 4, 6), C(1, 2, 4, 4, 5)],
    ("n2_native", 2, Layout.NATIVE): [
        C(2, 1, 3, 4, 6), C(2, 1, 3, 4, 5), C(2, 1, 3, 4, 7), C(2, 1, 3, 4, 4), C(2, 1, 2, 4, 5), C(2, 1, 4, 4, 4),
    ],
    ("n8_native", 8, Layout.NATIVE): [C(4, 1, 2, 4, 5), C(4, 1, 2, 4, 7)],
}


class Batch:
    """One paged cache for B requests plus `sets` independent (q, weights, block table) draws."""

    def __init__(self, batch: int, low: int, high: int, *, sets: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(low, high + 1, (batch,), generator=gen).tolist()
        self.max_len = max(self.lengths)
        on = torch.Generator(device=DEVICE).manual_seed(seed)
        keys = [torch.randn(n, HEAD_DIM, device=DEVICE, generator=on) for n in self.lengths]
        self.cache, first_table = build_paged_kv_cache(keys, Fp8Dtype.E4M3FN, generator=on)
        del keys
        self.seq_lens = torch.tensor(self.lengths, dtype=torch.int32, device=DEVICE)
        # Further sets read the same cache through other page orders, so no set stays in L2.
        total = sum(pages_of(self.lengths))
        self.tables = [first_table] + [
            page_table_for(self.lengths, physical=torch.randperm(total, generator=gen) + 1, device=DEVICE)
            for _ in range(sets - 1)
        ]
        self.sets = sets
        self.guards = {}
        self.schedules = {}

    def inputs(self, next_n: int, layout: Layout, seed: int) -> list[tuple]:
        """Per set: (q, kv_cache, weights, context_lens, block_table, max_context_len) in `layout`.
        Each set's page guard (once per batch in serving) is made here, so the sweep times the kernel."""
        batch = self.seq_lens.shape[0]
        torch.manual_seed(seed)
        out = []
        for table in self.tables:
            q = (torch.randn(batch * next_n, HEADS, HEAD_DIM, device=DEVICE) * 100).clamp(-448, 448)
            weights = torch.randn(batch * next_n, HEADS, device=DEVICE)
            context_lens, block_table = layout_tensors(layout, self.seq_lens, table, next_n)
            rows = context_lens.shape[0]
            q = q.to(torch.float8_e4m3fn).view(rows, -1, HEADS, HEAD_DIM)
            out.append((q, self.cache, weights, context_lens, block_table, self.max_len))
            self.guards[id(out[-1])] = guard_pages(context_lens, block_table, self.cache.shape[0], self.max_len,
                                                   BLOCK_KV, new_error_flags(DEVICE))
        return out

    def run(self, inputs: tuple, config: LaunchConfig) -> torch.Tensor:
        context_lens = inputs[3]
        key = (id(inputs), config)
        if key not in self.schedules:  # once per batch in serving, so outside the timed call
            self.schedules[key] = schedule_for(context_lens, self.max_len, BLOCK_KV, config)
        return triton_paged_mqa_logits(*inputs, config=config, guard=self.guards[id(inputs)],
                                       schedule=self.schedules[key])

    def floor_terms(self, next_n: int) -> tuple[float, float]:
        """(bytes, flops) the problem needs at minimum, whatever the layout (the bench's floor)."""
        return logits_floor_counts(LogitsShape(len(self.lengths), next_n, self.max_len, HEADS, HEAD_DIM), self.lengths)


def sweep(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune.jsonl"), "a") as log:
        _sweep(args, log)


def _sweep(args, log) -> None:
    from triton.testing import do_bench

    props = torch.cuda.get_device_properties(0)
    # A profiler run (ncu) times nothing; it needs only the kernel's launches.
    ceilings = {"copy_GBps": 4273.0, "fp8_TFLOPs": 1260.0} if args.profile else measure_ceilings().as_dict()
    print(f"{props.name}, {props.multi_processor_count} SMs; ceilings {ceilings}", flush=True)
    log.write(json.dumps({"device": props.name, **ceilings, "date": time.strftime("%Y-%m-%d %H:%M")}) + "\n")
    batch = Batch(args.batch, args.low, args.high, sets=args.sets, seed=args.seed)
    started = time.time()
    rows = []
    for (name, next_n, layout), configs in SWEEP.items():
        if args.only and name not in args.only:
            continue
        sets = batch.inputs(next_n, layout, seed=next_n)
        ref = reference_logits(*sets[0])
        nbytes, flops = batch.floor_terms(next_n)
        floor_s = max(nbytes / (ceilings["copy_GBps"] * 1e9), flops / (ceilings["fp8_TFLOPs"] * 1e12))
        # What the wrapper picks by itself: flatten q has one token per row.
        default = default_config(sets[0][0].shape[1], torch.device("cuda"))
        candidates = [LaunchConfig(*args.config)] if args.config else [default] + [c for c in configs if c != default]
        for config in candidates:
            if time.time() - started > args.budget_s:
                print(f"budget of {args.budget_s} s spent; skipping the rest", flush=True)
                break
            record = {"shape": name, "next_n": next_n, "layout": layout.value, "config": config.__dict__,
                      "default": config == default}
            try:
                err, check = compare_logits(batch.run(sets[0], config), ref, TOLERANCE)
                if args.profile:
                    batch.run(sets[1], config)
                    torch.cuda.synchronize()
                    print(f"{name} {config}: {check}; launched for the profiler")
                    continue
                seconds = do_bench(_rotating(batch, sets, config), warmup=args.warmup_ms, rep=args.rep_ms,
                                   return_mode="median") * 1e-3
                record.update(err=err, check=check, us=seconds * 1e6, floor_us=floor_s * 1e6,
                              of_floor=seconds / floor_s, GBps=nbytes / seconds / 1e9, TFLOPs=flops / seconds / 1e12)
            except Exception as error:  # a config that fails to compile (shared memory) is a result too
                record.update(error=f"{type(error).__name__}: {str(error)[:300]}")
            log.write(json.dumps(record) + "\n")
            log.flush()
            rows.append(record)
            print(_row(record), flush=True)
        del sets, ref
        torch.cuda.empty_cache()
    print("\nbest per shape:")
    for name in dict.fromkeys(r["shape"] for r in rows):
        timed = [r for r in rows if r["shape"] == name and "us" in r and r["check"] == "ok"]
        if timed:
            best = min(timed, key=lambda r: r["us"])
            print(_row(best))
            dflt = next((r for r in timed if r["default"]), None)
            if dflt:
                print("  default:", _row(dflt))


def _rotating(batch: Batch, sets: list[tuple], config: LaunchConfig):
    """A call that takes the next input set each time, so no set stays in L2 between calls."""
    turn = iter(range(1 << 62))
    return lambda: batch.run(sets[next(turn) % len(sets)], config)


def _row(r: dict) -> str:
    c = r["config"]
    cfg = f"tok{c['tokens']} pg{c['pages']} progs/SM {c['programs_per_sm']} w{c['num_warps']} s{c['num_stages']}"
    if "error" in r:
        return f"{r['shape']:11s} {cfg:30s} ERROR {r['error'][:120]}"
    return (f"{r['shape']:11s} {cfg:30s} {r['us']:8.1f} us  floor {r['floor_us']:6.1f} us  x{r['of_floor']:.2f}  "
            f"{r['GBps']:6.0f} GB/s  {r['TFLOPs']:6.1f} TFLOP/s  err {r['err'] if r['err'] is not None else float('nan'):.1e}  {r['check']}")


def resources() -> None:
    """Compile every swept config for sm_90 without a GPU and print registers, stack and shared memory."""
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tools.cuda_binaries import require_bundled

    cuobjdump = require_bundled("cuobjdump")
    names = _paged_mqa_logits_kernel.arg_names
    pointer_types = ["*fp8e4nv", "*fp8e4nv", "*fp32", "*fp32", "*i32", "*i32", "*i32", "*fp32", "*i32"]  # .. out, hist
    seen = set()
    for (name, next_n, _), configs in SWEEP.items():
        for config in configs:
            tokens = min(triton.next_power_of_2(next_n), config.tokens)
            key = (next_n, tokens, config.pages, config.num_warps, config.num_stages)
            if key in seen:
                continue
            seen.add(key)
            constexprs = {"N": next_n, "TG": tokens, "H": HEADS, "D": HEAD_DIM, "BLOCK_KV": BLOCK_KV,
                          "PAGES": config.pages, "PRODUCT_SCALE": 1.0, "NAN_BYTES": 0, "FILL": True}
            signature = {n: (pointer_types[i] if i < len(pointer_types) else "constexpr" if n in constexprs else "i32")
                         for i, n in enumerate(names)}
            aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                       if i < len(pointer_types) or n.startswith("stride")}
            source = ASTSource(_paged_mqa_logits_kernel, signature,
                               constexprs={(names.index(n),): v for n, v in constexprs.items()}, attrs=aligned)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": config.num_warps, "num_stages": config.num_stages})
            path = "/tmp/paged_mqa_logits_sm90.cubin"
            with open(path, "wb") as f:
                f.write(compiled.asm["cubin"])
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], check=True, capture_output=True, text=True).stdout
            regs = " ".join(w for w in usage.split() if w.startswith(("REG:", "STACK:")))
            print(f"N={next_n} tok{tokens} pg{config.pages} w{config.num_warps} s{config.num_stages}: {regs} "
                  f"SMEM:{compiled.metadata.shared}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "tune_out"))
    parser.add_argument("--resources", action="store_true", help="sm_90 resource report, no GPU needed")
    parser.add_argument("--only", nargs="*", help="shape names to sweep")
    parser.add_argument("--config", type=lambda text: [int(v) for v in text.split(",")],
                        help="one config instead of the sweep's: tokens,pages,programs_per_sm,num_warps,num_stages")
    parser.add_argument("--profile", action="store_true", help="check, then launch once more untimed (for ncu)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--low", type=int, default=16384)
    parser.add_argument("--high", type=int, default=49152)
    parser.add_argument("--sets", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-ms", type=int, default=20)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--budget-s", type=float, default=300.0)
    args = parser.parse_args()
    if args.resources:
        resources()
    else:
        sweep(args)


if __name__ == "__main__":
    main()
