"""A copy of backends/cuda_topk/radix_select.cu whose rows stamp the GPU's clock at each phase: thread 0 of
a row's CTA writes `%globaltimer` (ns, about 0.26 us a tick on the H200) into a device array at the
points below, and the extension gains `stamps(rows)` (an int64 [rows, 16] CPU tensor, 0 where a row never
reached a point) and `clear_stamps()`. tools/time_radix_variants.py builds such a copy when its name has
"stamp" in it and prints each phase's median and slowest time since the rows' start.

    python3 tools/radix_phase_stamps.py [SOURCE] OUT

The points are found by the source's own lines: where one is missing the copy is refused (the kernel
changed; update POINTS), never written with a phase silently lost.
"""

from __future__ import annotations

import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "backends" / "cuda_topk" / "radix_select.cu"
SLOTS = 16

# (slot, what the row has done when it stamps it, a line of the source, where the stamp goes: "after" it
# or "before" it). Slot 0 is the row's start; the others are printed as times since it.
POINTS = (
    (0, "start", "  const int64_t row = blockIdx.x;\n", "after"),
    (1, "reset", "  reset<T>(s);\n  constexpr int kPer = kCandCap / T;", "after-first-line"),
    (12, "sample binned", "  const int numbers = kSample - s.hist[0][0];\n", "before"),
    (13, "sample threshold", "    const int need = rank - s.above;  // the cut", "before"),
    (3, "cut", "  if (cut != 0u) {\n", "before"),
    (4, "filtered pass", "    collect_candidates<T>(v, s, cut, first);\n    __syncthreads();\n", "after"),
    (6, "round-1 histogram", "  clear_bins<T>(s.hist[1], kBins);\n  __syncthreads();\n  const int selectable = s.selectable;\n",
     "after-second-line"),
    (7, "round-1 threshold", "  find_threshold<T>(s, s.hist[0], k, kBins);\n  uint32_t prefix = s.bin;\n", "after-first-line"),
    (8, "round 2", "    found = shift == 0 || s.in_bin == need;\n  }\n", "after-first-line"),
    (10, "output scan", "  const int before = block_exclusive_sum<T>(s, counts);\n  int above_slot", "after-first-line"),
    (14, "ranked", "  const int ties = s.tie_count;\n", "before"),
    (5, "list selected", "                                        [&](int i) { return s.cand_pos[i]; }, cut, s1);\n", "after"),
    (2, "short row selected", "      short_row<T, kHasPages, C::kShortPer>(v, s, k, out_row, pr, p.block_size);\n    }\n", "after"),
    (11, "full select", "  full_select<T, kHasPages>(v, stage, s, k, out_row, pr, p.block_size);\n}", "after-first-line"),
)
NAMES = {slot: name for slot, name, _, _ in POINTS}

HEADER = f"""namespace {{
__device__ unsigned long long g_stamps[16384 * {SLOTS}];  // rows x slots: a launch of at most 16384 rows
__device__ __forceinline__ void stamp(int slot) {{
  if (threadIdx.x != 0 || blockIdx.x >= 16384) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  g_stamps[blockIdx.x * {SLOTS} + slot] = t;
}}
"""

EXPORTS = f"""torch::Tensor stamps(int64_t rows) {{
  TORCH_CHECK(0 <= rows && rows <= 16384, "stamps: rows must be in [0, 16384], got ", rows);
  auto out = torch::empty({{rows, {SLOTS}}}, torch::kInt64);
  C10_CUDA_CHECK(cudaMemcpyFromSymbol(out.data_ptr(), g_stamps, rows * {SLOTS} * 8));
  return out;
}}

void clear_stamps() {{
  static unsigned long long zeros[16384 * {SLOTS}] = {{}};
  C10_CUDA_CHECK(cudaMemcpyToSymbol(g_stamps, zeros, sizeof(zeros)));
}}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{
  m.def("stamps", &stamps, "per-row globaltimer stamps, [rows, {SLOTS}], 0 where a row never reached a point");
  m.def("clear_stamps", &clear_stamps, "zero every stamp");
"""


def stamped(source: str) -> str:
    """The source with a stamp at every point; ValueError naming the first point it cannot find."""
    text = source.replace("namespace {\n", HEADER, 1)
    for slot, name, line, where in POINTS:
        if line not in text:
            raise ValueError(f"radix_select.cu no longer has the line of point {slot} ({name}): {line.splitlines()[0]!r}")
        call = f"  stamp({slot});\n"
        if where == "before":
            new = call + line
        elif where == "after":
            new = line + call
        else:  # after the first (or second) of the line's lines
            lines = line.split("\n")
            keep = 1 if where == "after-first-line" else 2
            new = "\n".join(lines[:keep]) + "\n" + call + "\n".join(lines[keep:])
        text = text.replace(line, new)
    anchor = "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n"
    if anchor not in text:
        raise ValueError("radix_select.cu no longer has its PYBIND11_MODULE block")
    return text.replace(anchor, EXPORTS, 1)


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python3 tools/radix_phase_stamps.py [SOURCE] OUT", file=sys.stderr)
        return 2
    source = Path(argv[0]) if len(argv) == 2 else SOURCE
    Path(argv[-1]).write_text(stamped(source.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
