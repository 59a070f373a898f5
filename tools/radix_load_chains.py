"""Where `cuda.radix`'s machine code makes a thread wait on its own global loads one after another: read
from the sm_90 SASS of radix_select.cu (or a copy of it), on a machine with nvcc and no GPU.

    python3 tools/radix_load_chains.py [SOURCE ...] [--sass FILE]

Per kernel instance (threads, config, pages) it prints:
- **short-row loads**: each unrolled run of scalar row loads (`LDG.E.CONSTANT`, at least 6), and how many
  of them issue before the first NaN test of a loaded value. Issue is in order, so a load after that
  test waits for the first load's data: the run needs more than one memory round trip where this count
  is smaller than the run.
- **load-store pairs**: the longest stretch, between barriers, of global loads each followed by a store
  before the next load (`LDG.E` then `STG.E`: a paged instance's page-table read, then its output slot).
  Each store waits for its load's data and the next load issues after it, so the pairs' latencies add up:
  an L1 hit's each at best, an L2 round trip where a page-table line is new to the SM.
- **registers and spills**, where it compiled the source: ptxas's count (`-Xptxas -v`) of registers a thread
  and bytes spilled to local memory (stores / loads), since a change that moves loads often moves spills.

SOURCE defaults to backends/cuda_topk/radix_select.cu. It is compiled with nvcc (`-cubin -arch=sm_90
-O3`, with torch's headers, as the served build's device code) and disassembled with cuobjdump or
nvdisasm from PATH or from Triton's bundled copies. --sass reads a saved `cuobjdump -sass` listing
instead. These are static counts, not timings: time a change with tools/time_radix_variants.py.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.cuda_topk.build import SOURCE, find_nvcc  # noqa: E402 - the served build's source and nvcc
from tools.cuda_binaries import find  # noqa: E402

# The shortest unrolled run of row loads reported, and the gap (in instructions) that ends a run.
MIN_RUN = 6
RUN_GAP = 120
KERNEL = re.compile(r"radix_topk_kernelILi(\d+)EN\w*?\d+(Wide|ShortList)ELb([01])E")
INSTANCE = re.compile(r"Function : \S*" + KERNEL.pattern)
PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
ROW_LOAD = re.compile(r"\bLDG\.E\.CONSTANT R")
NAN_TEST = re.compile(r"\bFSETP\.NAN\b")
PLAIN_LOAD = re.compile(r"\bLDG\.E R")
STORE = re.compile(r"\bSTG\.E\b")
BOUNDARY = re.compile(r"\b(BAR\.SYNC|EXIT|RET)\b")  # a stretch of pairs ends at a barrier or a path's end


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_stores: int  # bytes
    spill_loads: int

    def text(self) -> str:
        return f"{self.registers} registers, spills {self.spill_stores}/{self.spill_loads} bytes (stores/loads)"


@dataclass(frozen=True)
class Chains:
    instance: str
    load_runs: tuple[tuple[int, int], ...]  # (loads in the run, loads issued before its first NaN test)
    longest_pairs: int  # load-store pairs in a row
    resources: Resources | None = None  # None for a saved listing: ptxas's report is not in it

    def line(self) -> str:
        runs = ", ".join(f"{issued} of {loads} before waiting" for loads, issued in self.load_runs) or "none"
        tail = f"; {self.resources.text()}" if self.resources is not None else ""
        return f"{self.instance}: short-row loads {runs}; load-store pairs in a row: {self.longest_pairs}{tail}"


def label(kernel: re.Match) -> str:
    return f"{kernel.group(1)} {kernel.group(2)} pages={kernel.group(3)}"


def instances(sass: str) -> dict[str, list[str]]:
    """{'T config pages=P': its instructions, in order} for every radix_topk_kernel instance."""
    found: dict[str, list[str]] = {}
    current = None
    for text in sass.splitlines():
        if (name := INSTANCE.search(text)) is not None:
            current = label(name)
            found[current] = []
        elif current is not None and (op := INSTRUCTION.search(text)) is not None:
            found[current].append(op.group(1))
    return found


def load_runs(code: list[str]) -> tuple[tuple[int, int], ...]:
    at = [i for i, op in enumerate(code) if ROW_LOAD.search(op)]
    runs, run = [], []
    for i in at:
        if run and i - run[-1] > RUN_GAP:
            runs.append(run)
            run = []
        run.append(i)
    runs.append(run)
    counted = []
    for run in (r for r in runs if len(r) >= MIN_RUN):
        first_test = next((i for i in range(run[0], run[-1]) if NAN_TEST.search(code[i])), run[-1] + 1)
        counted.append((len(run), sum(i < first_test for i in run)))
    return tuple(counted)


def longest_pairs(code: list[str]) -> int:
    """The most global loads in a row that each meet a store before the next load does."""
    marks = "".join("L" if PLAIN_LOAD.search(op) else "S" if STORE.search(op) else "|" if BOUNDARY.search(op) else ""
                    for op in code)
    return max((len(m) // 2 for m in re.findall(r"(?:LS)+", marks)), default=0)


def resources(ptxas_log: str) -> dict[str, Resources]:
    """{instance: its registers and spills} from ptxas's -v report (per entry: its name, then its stack frame
    and spills, then the registers it used)."""
    found: dict[str, Resources] = {}
    current, spills = None, (0, 0)
    for text in ptxas_log.splitlines():
        if (entry := PTXAS_ENTRY.search(text)) is not None:
            kernel = KERNEL.search(entry.group(1))
            current, spills = (label(kernel) if kernel else None), (0, 0)
        elif current is not None and (spill := PTXAS_SPILLS.search(text)) is not None:
            spills = (int(spill.group(1)), int(spill.group(2)))
        elif current is not None and (used := PTXAS_REGISTERS.search(text)) is not None:
            found[current] = Resources(int(used.group(1)), *spills)
            current = None
    return found


def chains(sass: str, ptxas_log: str = "") -> list[Chains]:
    used = resources(ptxas_log)
    return [Chains(name, load_runs(code), longest_pairs(code), used.get(name))
            for name, code in instances(sass).items()]


def disassembler() -> list[str] | None:
    for tool in ("cuobjdump", "nvdisasm"):
        found = find(tool)
        if found is not None:
            return [found, "-sass"] if tool == "cuobjdump" else [found]
    return None


def compiled_sass(source: Path) -> tuple[str, str]:
    """(the sm_90 SASS of `source`, compiled as the served build compiles its device code; ptxas's report)."""
    nvcc, disasm = find_nvcc(), disassembler()
    if nvcc is None or disasm is None:
        raise SystemExit(f"needs nvcc ($CUDA_HOME/bin, PATH or /usr/local/cuda) and cuobjdump or nvdisasm (PATH or "
                         f"Triton's bundled copies); found nvcc: {nvcc}, disassembler: {disasm}; "
                         "or pass --sass with a saved `cuobjdump -sass` listing")
    import torch.utils.cpp_extension as extension  # noqa: PLC0415 - the headers of the torch that serves it

    with tempfile.TemporaryDirectory() as folder:
        # torch's headers include a macros file that only a CUDA build of torch ships: an empty one stands in.
        stub = Path(folder) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        stub.parent.mkdir(parents=True)
        stub.write_text("#pragma once\n")
        cubin = Path(folder) / "radix.cubin"
        includes = [f"-I{folder}", *(f"-I{path}" for path in extension.include_paths()),
                    f"-I{sysconfig.get_paths()['include']}"]
        built = subprocess.run([nvcc, "-cubin", "-std=c++17", "-arch=sm_90", "-O3", "-Xptxas", "-v", *includes,
                                "-DTORCH_EXTENSION_NAME=x", "-DTORCH_API_INCLUDE_EXTENSION_H", str(source), "-o",
                                str(cubin)], check=True, capture_output=True, text=True)
        sass = subprocess.run([*disasm, str(cubin)], check=True, capture_output=True, text=True).stdout
        return sass, built.stdout + built.stderr


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="*", type=Path, help=f"copies of radix_select.cu (default {SOURCE})")
    parser.add_argument("--sass", type=Path, help="a saved `cuobjdump -sass` listing, instead of compiling")
    args = parser.parse_args(argv)
    listings = {str(args.sass): (args.sass.read_text(), "")} if args.sass else {
        str(source): compiled_sass(source) for source in (args.sources or [SOURCE])}
    for name, (sass, ptxas_log) in listings.items():
        found = chains(sass, ptxas_log)
        if not found:
            print(f"{name}: no radix_topk_kernel instance in its SASS", file=sys.stderr)
            return 1
        print(name)
        for entry in found:
            print("  " + entry.line())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
