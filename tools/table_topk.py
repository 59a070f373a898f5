"""Issue 23 item 2 from a tuned overlay: at every shape of the issue's table, the top-k the dispatcher
decides for a batch of that shape (its batch size, and a declared max_seq_len of 3L/2, the longest
request a batch of mean L holds) against the fastest engine kernel (`sglang.*`, `vllm.*`) the same tune
measured there, alone and, where the shape was ranked by the step, in the step. A decided top-k more
than 3% behind the fastest peer is marked MISS. Reads the overlay only: nothing is run.

    python3 tools/table_topk.py [--registry registry.yaml] [--cluster h200-mtp]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dispatch.contract.key import Arch, DispatchKey, Fp8Dtype, ForwardMode, Op  # noqa: E402
from dispatch.deciding.runtime import load_dispatcher  # noqa: E402
from dispatch.registry.measured_bands import length_bound  # noqa: E402

# (B, next_n, mean L) of issue 23's table; the prefill row is the extend batch of 16 requests whose
# prefixes spread over 0..15K (4096 rows, windows 1..16K).
TABLE = [(128, 4, 32768), (128, 1, 32768), (32, 2, 8192), (64, 4, 65536), (256, 2, 16384), (8, 4, 8192),
         (8, 1, 2048), (1, 1, 2048)]
PREFILL = ("M=4K S=124K R=16 P=0..15K", 16)
WITHIN = 0.03
PEERS = ("sglang.", "vllm.")


def rows(dispatcher) -> list[str]:
    measured = dispatcher.document.measured.get(dispatcher.cluster)
    if measured is None:
        return [f"cluster `{dispatcher.cluster}` has no measured overlay"]
    fp8 = measured.overlay.workload.fp8_dtype or Fp8Dtype.E4M3FN
    wanted = [(f"B={b} N={n} L~{length // 1024}K ", b, length_bound(length),
               DispatchKey(Arch.SM90, ForwardMode.DECODE if n == 1 else ForwardMode.TARGET_VERIFY, n, fp8))
              for b, n, length in TABLE]
    wanted.append((PREFILL[0] + " ", PREFILL[1], None, DispatchKey(Arch.SM90, ForwardMode.EXTEND, 1, fp8)))
    out = []
    for prefix, batch_size, longest, key in wanted:
        decision = dispatcher.decide(Op.TOPK, key, batch_size=batch_size, max_seq_len=longest)
        found = measured.find(Op.TOPK, key)
        line = f"{prefix.strip():28} decided {decision.backend} ({decision.chosen_by})"
        if found is None:
            out.append(f"{line}: key not measured")
            continue
        preference = found[1]
        for kind, shapes in (("alone", preference.shapes), ("step", preference.step_shapes)):
            shape = next((s for s in shapes if s.shape.startswith(prefix)), None)
            if shape is None:
                if kind == "alone":
                    line += ": shape not measured"
                continue
            peers = {name: us for name, us in shape.median_us.items() if name.startswith(PEERS)}
            mine = shape.median_us.get(decision.backend)
            if not peers or mine is None:
                line += f"; {kind}: no peer measured" if not peers else f"; {kind}: {decision.backend} not timed"
                continue
            peer, best = min(peers.items(), key=lambda item: item[1])
            verdict = "ok" if mine <= best * (1 + WITHIN) else "MISS"
            line += f"; {kind} {mine:.1f} us vs {peer} {best:.1f} us ({mine / best:.2f}x, {verdict})"
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", default=None)
    parser.add_argument("--cluster", default="h200-mtp")
    args = parser.parse_args(argv)
    dispatcher = load_dispatcher(args.registry, cluster=args.cluster, arch="sm90", check_availability=False,
                                 device_name="NVIDIA H200")
    lines = rows(dispatcher)
    print("\n".join(lines))
    return 1 if any("MISS" in line for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
