"""GPU probe for the Triton top-k kernel: times it (a few configs), torch.topk and FlashInfer's
top_k_ragged_transform on indexer-like logits, checks each against torch.topk, prints a table.

    PYTHONPATH=. python3 tools/probe_topk.py            # details to $OUT/probe_topk.json if OUT is set
    TRITON_INTERPRET=1 PYTHONPATH=. python3 tools/probe_topk.py --smoke   # tiny shapes on the CPU

Logits as the indexer makes them: random fp32, -inf past each row's length; per request a context
L uniform in [L/2, 3L/2], and its N query tokens see L - N + j + 1 keys (j = 0..N-1). k = 2048.
Times are triton.testing.do_bench medians (L2 flushed before each run). The floor is the visible
logits' bytes read once at 4.2 TB/s. "exact" means each row's selected values equal torch.topk's as
multisets, with distinct positions inside [0, length).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton
import triton.testing

from backends.triton.topk import launch

K = 2048
BYTES_PER_S = 4.2e12
SHAPES = [("B128 N4 L32K", 128, 4, 32768), ("B128 N1 L32K", 128, 1, 32768), ("B32 N2 L8K", 32, 2, 8192)]
# (block, bins, sample, z, lanes, radix, num_warps); launch_config's defaults are the first
# (>= 256 rows) and the second (fewer rows).
CONFIGS = [
    (2048, 64, 4096, 4.0, 8, 8, 8),
    (4096, 64, 4096, 4.0, 8, 8, 16),
    (2048, 64, 4096, 4.0, 8, 4, 8),
    (4096, 64, 4096, 4.0, 8, 4, 16),
    (1024, 64, 4096, 4.0, 8, 8, 4),
    (2048, 64, 4096, 4.0, 8, 8, 4),
    (4096, 64, 4096, 4.0, 16, 8, 8),
    (8192, 64, 4096, 4.0, 16, 8, 16),
    (2048, 64, 2048, 4.0, 8, 8, 8),
    (2048, 64, 4096, 3.0, 8, 8, 8),
]
FALLBACK = (2048, 64, 4096, -1e9, 8, 8, 8)  # forces the exact two-pass path: what a misjudged sample costs
TIME_BUDGET_S = 200  # the lead's call is limited: configs past this are reported as skipped


SMOKE = "--smoke" in sys.argv
if SMOKE:  # the script's own check, under the interpreter: tiny shapes, one config, wall-clock timing
    K, SHAPES, CONFIGS = 64, [("smoke N2", 3, 2, 1024)], CONFIGS[:1]
    FALLBACK = (1024, 64, 1024, -1e9, 8, 8, 1)
DEVICE = "cpu" if SMOKE else "cuda"


def make_batch(batch, next_n, context, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    ctx = torch.randint(context // 2, context * 3 // 2 + 1, (batch,), generator=gen, device=DEVICE)
    lengths = (ctx[:, None] - next_n + torch.arange(next_n, device=DEVICE)[None, :] + 1).reshape(-1).to(torch.int32)
    width = int(lengths.max())
    logits = torch.randn(lengths.numel(), width, generator=gen, device=DEVICE)
    logits.masked_fill_(torch.arange(width, device=DEVICE)[None, :] >= lengths[:, None], float("-inf"))
    return logits, lengths


def exact(logits, lengths, positions, want_sorted):
    """Every row: k distinct positions inside [0, length) whose values equal torch.topk's multiset."""
    positions = positions.long()
    if ((positions < 0) | (positions >= lengths[:, None].long())).any():
        return False
    ordered = positions.sort(dim=1).values
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        return False
    got = logits.gather(1, positions).sort(dim=1).values
    return bool(torch.equal(got, want_sorted))


def bench(fn):
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3  # us


def flashinfer_ragged():
    try:
        import flashinfer

        return flashinfer.top_k_ragged_transform
    except Exception as exc:  # an optional extra: report why it is missing and go on
        print(f"flashinfer unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def main() -> None:
    started = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    fi = None if SMOKE else flashinfer_ragged()
    rows_out, table = [], []
    for name, batch, next_n, context in SHAPES:
        logits, lengths = make_batch(batch, next_n, context)
        rows, width = logits.shape
        floor_us = float(lengths.sum()) * 4 / BYTES_PER_S * 1e6
        want = torch.topk(logits, K, dim=1).values.sort(dim=1).values
        results = []

        def record(impl, config, fn, to_positions=lambda out: out):
            try:
                out = fn()
                ok = exact(logits, lengths, to_positions(out), want)
                us = bench(fn)
                results.append({"impl": impl, "config": config, "us": us, "exact": ok})
            except Exception as exc:  # a config that fails to compile or run is reported, not fatal
                results.append({"impl": impl, "config": config, "error": f"{type(exc).__name__}: {exc}"[:300]})

        for block, bins, sample, z, lanes, radix, warps in CONFIGS + [FALLBACK]:
            cfg = dict(block=block, bins=bins, sample=sample, z=z, lanes=lanes, radix=radix, num_warps=warps)
            impl = "triton" if z > -1 else "triton two-pass"
            if time.time() - started > TIME_BUDGET_S:
                results.append({"impl": impl, "config": cfg, "error": "skipped: over the probe's time budget"})
                continue
            record(impl, cfg, lambda cfg=cfg: launch(logits, lengths, K, **cfg))
        best = min((r for r in results if r["impl"] == "triton" and "us" in r and r["exact"]),
                   key=lambda r: r["us"], default=None)
        if best is not None:
            # The fused page-table transform at the best config (identity table: slots = positions).
            table_pages = triton.cdiv(width, 64)
            page_table = torch.arange(rows * table_pages, dtype=torch.int32, device=DEVICE).reshape(rows, table_pages)
            page_rows = torch.arange(rows, dtype=torch.int32, device=DEVICE)
            cfg = best["config"]
            record("triton +pages", cfg, lambda: launch(logits, lengths, K, page_table=page_table, page_rows=page_rows,
                                                       block_size=64, **cfg),
                   to_positions=lambda out: out.long() - page_rows[:, None].long() * table_pages * 64)
            record("triton sorted", cfg, lambda: launch(logits, lengths, K, sorted=True, **cfg))
        record("torch.topk", {}, lambda: torch.topk(logits, K, dim=1).indices)
        if fi is not None:
            offsets = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
            record("flashinfer ragged", {}, lambda: fi(logits, offsets, lengths, K))
        fi_us = next((r["us"] for r in results if r["impl"] == "flashinfer ragged" and "us" in r), None)
        for r in results:
            r.update(shape=name, rows=rows, width=width, floor_us=floor_us)
            if "us" in r:
                r["x_floor"] = r["us"] / floor_us
                r["flashinfer_over"] = fi_us / r["us"] if fi_us else None
        rows_out.extend(results)
        best_label = None if best is None else best["config"]
        print(f"{name}: rows {rows} x W {width}, floor {floor_us:.1f} us, best triton config {best_label}", flush=True)
        for r in results:
            cfg = ",".join(str(v) for v in r["config"].values()) if r["config"] else "-"
            if "error" in r:
                table.append(f"{name:13s} {r['impl']:18s} {cfg:28s} ERROR {r['error'][:80]}")
                continue
            fi_ratio = f"{r['flashinfer_over']:5.2f}x" if r["flashinfer_over"] else "   - "
            table.append(f"{name:13s} {r['impl']:18s} {cfg:28s} {r['us']:8.1f} us  x{r['x_floor']:5.2f} floor  "
                         f"FI/this {fi_ratio}  {'exact' if r['exact'] else 'WRONG'}")
        del logits, lengths, want
        if not SMOKE:
            torch.cuda.empty_cache()

    device_name = "cpu (interpreter)" if SMOKE else torch.cuda.get_device_name()
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "probe_topk.json"), "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "triton": triton.__version__,
                       "k": K, "results": rows_out}, f, indent=1)
    print(f"\n# top-k probe, {device_name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"k={K}, config = block,bins,sample,z,lanes,radix,warps, {time.time() - started:.0f} s")
    print("\n".join(table))


if __name__ == "__main__":
    main()
