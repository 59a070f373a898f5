"""GPU probe of the extend indexer step: K gather and ragged MQA logits at extend shapes.

    PYTHONPATH=. python3 tools/probe_extend.py              # on the H200: < 4 min, table last
    PYTHONPATH=. python3 tools/probe_extend.py --resources  # no GPU: sm_90 registers of each config

For each shape (several requests; M query tokens, S = prefix + new keys, H = 64, D = 128) it builds a
shuffled paged cache, the batch's metadata (dispatch.step.extend_batch), gathers K with the Triton kernel and
checks it byte for byte against the torch gather, then times the Triton ragged logits in a few
launch configs and deep_gemm's fp8_mqa_logits (clean_logits=True: both write -inf outside each row's
range) on the same inputs, then both once with clean_logits=False. Each is checked first against the
torch reference (relative error over visible positions < 1e-3, -inf pattern exact when clean). The
floor is the useful fp8 work, sum over rows of (ke - ks) * H * D * 2 flops, at the torch._scaled_mm
rate measured in this run (8192^3); the -inf writes (M * S * 4 bytes) at the copy bandwidth measured
here are printed beside it. Timing: triton.testing.do_bench, median, L2 cleared before each call.
JSON lines to $OUT/probe_extend.jsonl when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends.reference.kv_gather import reference_gather_keys as reference_gather  # noqa: E402
from backends.reference.ragged_mqa_logits import reference_ragged_mqa_logits as reference_logits  # noqa: E402
from backends.triton.ragged_mqa_logits import LaunchConfig, default_config  # noqa: E402
from dispatch.bench.ceilings import measure_ceilings  # noqa: E402
from dispatch.bench.compare import compare_logits  # noqa: E402
from dispatch.contract.key import Fp8Dtype  # noqa: E402
from dispatch.contract.kv_cache import BLOCK_KV, quantize_keys  # noqa: E402
from dispatch.step.extend_batch import ExtendBatch, build_ragged_metadata  # noqa: E402

HEADS, HEAD_DIM = 64, 128
TOLERANCE = 1e-3  # fp8 dot on the GPU
DEVICE = "cuda"  # tests/cli/test_probe_extend.py builds inputs on the CPU
C = LaunchConfig
CONFIGS = [C(4, 64, 1024, 4, 3), C(4, 64, 1024, 4, 4), C(2, 64, 1024, 4, 3), C(2, 128, 1024, 4, 3),
           C(8, 64, 1024, 8, 3), C(4, 128, 1024, 8, 3)]
# name -> (prefix_lens, extend_lens)
SHAPES = {
    "M4K_4req_S64K": ([15360] * 4, [1024] * 4),
    "M4K_1req_S64K": ([61440], [4096]),
    "M16K_4req_S64K": ([12288] * 4, [4096] * 4),
    "M16K_7req_ragged": ([0, 16384, 4096, 0, 12288, 1024, 6000], [8192, 4096, 2048, 1024, 512, 256, 256]),
}


def build(prefix_lens, extend_lens, seed=0):
    """A shuffled paged cache holding every request's keys, the batch, its metadata, q and weights."""
    torch.manual_seed(seed)
    totals = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages = [-(-t // BLOCK_KV) for t in totals]
    num_blocks = sum(pages) + 1
    values, scales = quantize_keys(torch.randn(num_blocks * BLOCK_KV, HEAD_DIM, device=DEVICE), Fp8Dtype.E4M3FN)
    cache = torch.empty(num_blocks, BLOCK_KV * (HEAD_DIM + 4), dtype=torch.uint8, device=DEVICE)
    cache[:, : BLOCK_KV * HEAD_DIM] = values.view(torch.uint8).view(num_blocks, -1)
    cache[:, BLOCK_KV * HEAD_DIM :] = scales.view(torch.uint8).view(num_blocks, -1)
    order = torch.randperm(num_blocks - 1) + 1
    table = torch.zeros(len(totals), max(pages), dtype=torch.int32)
    used = 0
    for request, count in enumerate(pages):
        table[request, :count] = order[used : used + count].to(torch.int32)
        used += count
    batch = ExtendBatch.from_lengths(prefix_lens, extend_lens, table.to(DEVICE))
    rows = batch.total_tokens
    q = (torch.randn(rows, HEADS, HEAD_DIM, device=DEVICE) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    weights = torch.randn(rows, HEADS, device=DEVICE)
    return cache.view(num_blocks, BLOCK_KV, 1, HEAD_DIM + 4), batch, build_ragged_metadata(batch), q, weights


def check(out: torch.Tensor, ref: torch.Tensor, clean: bool = True) -> tuple[float | None, str]:
    """(relative error over visible positions, verdict) through the bench's comparison. An unclean
    output is judged where it is defined only: its other positions are set to the reference's -inf."""
    if not clean:
        out = torch.where(torch.isfinite(ref), out, float("-inf"))
    return compare_logits(out, ref, TOLERANCE)


def probe(args) -> None:
    from triton.testing import do_bench

    from backends.shared.kv_gather import triton_gather_keys
    from backends.triton.ragged_mqa_logits import triton_ragged_mqa_logits

    started = time.time()
    out_dir = os.environ.get("OUT")
    log = open(os.path.join(out_dir, "probe_extend.jsonl"), "a") if out_dir else None

    def record(entry):
        if log:
            log.write(json.dumps(entry) + "\n")
            log.flush()

    props = torch.cuda.get_device_properties(0)
    ceilings = measure_ceilings().as_dict()
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}; ceilings "
          f"copy {ceilings['copy_GBps']:.0f} GB/s, fp8 _scaled_mm {ceilings['fp8_TFLOPs']:.0f} TFLOP/s", flush=True)
    record({"device": props.name, **ceilings, "date": time.strftime("%Y-%m-%d %H:%M")})
    try:
        import deep_gemm

        from backends.deepgemm.adapter import launch_ragged_mqa_logits as deepgemm_logits
        dg_version = getattr(deep_gemm, "__version__", "?")
        print(f"deep_gemm {dg_version}: fp8_fp4_mqa_logits={hasattr(deep_gemm, 'fp8_fp4_mqa_logits')}, "
              f"fp8_mqa_logits={hasattr(deep_gemm, 'fp8_mqa_logits')}", flush=True)
    except Exception as error:  # the probe still measures Triton without it
        deep_gemm = None
        print(f"deep_gemm unavailable: {type(error).__name__}: {error}", flush=True)

    rows_out = []
    for name, (prefix_lens, extend_lens) in SHAPES.items():
        if args.only and name not in args.only:
            continue
        cache, batch, meta, q, weights = build(prefix_lens, extend_lens)
        m_rows, s_keys = batch.total_tokens, batch.total_keys
        useful = sum(ke - ks for ks, ke in zip(meta.host_ks, meta.host_ke))
        flops = 2.0 * HEADS * HEAD_DIM * useful
        floor_s = flops / (ceilings["fp8_TFLOPs"] * 1e12)
        write_s = m_rows * s_keys * 4 / (ceilings["copy_GBps"] * 1e9)
        flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        k, scales = triton_gather_keys(cache, meta.gather_slots, flag)
        ref_k, ref_scales = reference_gather(cache, meta.gather_slots)
        gather_ok = (torch.equal(k.view(torch.uint8), ref_k.view(torch.uint8))
                     and torch.equal(scales, ref_scales) and int(flag) == 0)
        gather_s = do_bench(lambda: triton_gather_keys(cache, meta.gather_slots, flag, k_out=k, scales_out=scales),
                            warmup=10, rep=50, return_mode="median") * 1e-3
        gather_bytes = 2 * s_keys * (HEAD_DIM + 4)
        ref = reference_logits(q, k, scales, weights, meta.ks, meta.ke)
        print(f"\n{name}: M={m_rows} S={s_keys} requests={len(prefix_lens)} useful pairs={useful / 1e6:.0f}M; "
              f"floor {floor_s * 1e6:.0f} us (fp8), -inf writes {write_s * 1e6:.0f} us; gather {gather_s * 1e6:.1f} us "
              f"({gather_bytes / gather_s / 1e9:.0f} GB/s) {'exact' if gather_ok else 'MISMATCH'}", flush=True)
        record({"shape": name, "M": m_rows, "S": s_keys, "useful_pairs": useful, "floor_us": floor_s * 1e6,
                "write_us": write_s * 1e6, "gather_us": gather_s * 1e6, "gather_ok": gather_ok})
        out = torch.empty(m_rows, s_keys, dtype=torch.float32, device=DEVICE)
        timed = []
        default = default_config(q.device)
        # (impl, config, clean_logits): the contract's -inf everywhere first, then DeepGEMM's and the
        # default config's cheaper mode that leaves columns outside the scored blocks unwritten.
        candidates = [("deepgemm", None, True)] if deep_gemm is not None else []
        candidates += [("triton", c, True) for c in [default] + [c for c in CONFIGS if c != default]]
        candidates += [("deepgemm", None, False)] if deep_gemm is not None else []
        candidates += [("triton", default, False)]
        for impl, config, clean in candidates:
            if time.time() - started > args.budget_s:
                print(f"  budget of {args.budget_s:.0f} s spent: skipping {impl} {config}", flush=True)
                continue
            entry = {"shape": name, "impl": impl, "config": config.__dict__ if config else None, "clean": clean}
            try:
                if impl == "deepgemm":
                    def call(clean=clean):
                        return deepgemm_logits(deep_gemm, q, k, scales, weights, meta.ks, meta.ke, clean_logits=clean)
                else:
                    def call(config=config, clean=clean):
                        return triton_ragged_mqa_logits(q, k, scales, weights, meta.ks, meta.ke, config=config, out=out,
                                                 clean_logits=clean)
                err, verdict = check(call(), ref, clean)
                seconds = do_bench(call, warmup=25, rep=args.rep_ms, return_mode="median") * 1e-3
                entry.update(us=seconds * 1e6, err=err, verdict=verdict, TFLOPs=flops / seconds / 1e12,
                             x_floor=seconds / floor_s)
                timed.append(entry)
            except Exception as error:
                entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            record(entry)
            print("  " + _line(entry), flush=True)
        ok = [e for e in timed if e["verdict"] == "ok"]
        dg = next((e for e in ok if e["impl"] == "deepgemm" and e["clean"]), None)
        dg_raw = next((e for e in ok if e["impl"] == "deepgemm" and not e["clean"]), None)
        good = [e for e in ok if e["impl"] == "triton" and e["clean"]]
        best = min(good, key=lambda e: e["us"]) if good else None
        raw = next((e for e in ok if e["impl"] == "triton" and not e["clean"]), None)
        rows_out.append((name, floor_s, gather_s, dg, best, next((e for e in good if e["config"] == default.__dict__),
                                                                 None), dg_raw, raw))
        del out, ref, cache, k, scales
        torch.cuda.empty_cache()

    print(f"\nsummary ({time.time() - started:.0f} s; bars: triton <= 1.5x deepgemm, <= 2x fp8 floor)")
    print(f"{'shape':18s} {'floor us':>8s} {'gather':>7s} {'deepgemm':>9s} {'triton best':>11s} {'config':>17s} "
          f"{'x floor':>7s} {'x dg':>5s} {'default us':>10s} {'unclean dg / triton':>20s}")
    for name, floor_s, gather_s, dg, best, dflt, dg_raw, raw in rows_out:
        dg_us = f"{dg['us']:9.0f}" if dg else f"{'-':>9s}"
        if best:
            c = best["config"]
            cfg = f"{c['rows']}x{c['keys']} w{c['num_warps']} s{c['num_stages']}"
            ratio = f"{best['us'] / dg['us']:5.2f}" if dg else f"{'-':>5s}"
            tri = f"{best['us']:11.0f} {cfg:>17s} {best['x_floor']:7.2f} {ratio}"
        else:
            tri = f"{'FAILED':>11s}"
        dflt_us = f"{dflt['us']:10.0f}" if dflt else f"{'-':>10s}"
        unclean = " / ".join(f"{e['us']:.0f}" if e else "-" for e in (dg_raw, raw))
        print(f"{name:18s} {floor_s * 1e6:8.0f} {gather_s * 1e6:7.1f} {dg_us} {tri} {dflt_us} {unclean:>20s}")


def _line(e: dict) -> str:
    c = e["config"]
    cfg = f"{c['rows']}x{c['keys']} f{c['fill']} w{c['num_warps']} s{c['num_stages']}" if c else ""
    cfg += "" if e["clean"] else " unclean"
    if "error" in e:
        return f"{e['impl']:8s} {cfg:22s} ERROR {e['error'][:200]}"
    err = f"{e['err']:.1e}" if e["err"] is not None else "-"
    return (f"{e['impl']:8s} {cfg:22s} {e['us']:9.1f} us  {e['TFLOPs']:6.0f} TFLOP/s  x{e['x_floor']:.2f} floor  "
            f"err {err}  {e['verdict']}")


def resources() -> None:
    """Compile every config for sm_90 without a GPU and print registers, stack and shared memory."""
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from backends.triton.ragged_mqa_logits import _ragged_mqa_logits_kernel as kernel

    from tools.cuda_binaries import require_bundled

    cuobjdump = require_bundled("cuobjdump")
    names = kernel.arg_names
    pointers = ["*fp8e4nv", "*fp8e4nv", "*fp32", "*fp32", "*i32", "*i32", "*fp32"]
    for config in CONFIGS:
        constexprs = {"H": HEADS, "D": HEAD_DIM, "BLOCK_Q": config.rows, "BLOCK_K": config.keys,
                      "FILL": config.fill, "PRODUCT_SCALE": 1.0}
        signature = {n: (pointers[i] if i < len(pointers) else "constexpr" if n in constexprs else "i32")
                     for i, n in enumerate(names)}
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if i < 7 or n.startswith("stride")}
        source = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                           attrs=aligned)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": config.num_warps, "num_stages": config.num_stages})
        path = "/tmp/ragged_mqa_logits_sm90.cubin"
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], check=True, capture_output=True,
                               text=True).stdout
        regs = " ".join(w for w in usage.split() if w.startswith(("REG:", "STACK:")))
        print(f"{config}: {regs} SMEM:{compiled.metadata.shared}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resources", action="store_true", help="sm_90 resource report, no GPU needed")
    parser.add_argument("--only", nargs="*", help="shape names to run")
    parser.add_argument("--config", action="append", type=lambda text: LaunchConfig(*map(int, text.split(","))),
                        help="a Triton config instead of the built-in sweep (repeatable): rows,keys,fill,warps,stages")
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--budget-s", type=float, default=190.0, help="stop starting new measurements after this")
    args = parser.parse_args()
    if args.config:
        CONFIGS[:] = args.config
    if args.resources:
        resources()
    else:
        probe(args)


if __name__ == "__main__":
    main()
