"""The host side of `cuda.radix`: the CUDA-only checks (the op's call in dispatch.contract.ops.top_k
has checked the rest against the contract once), the launch (one kernel, no host sync, with
programmatic dependent launch on sm90+: backends/shared/dependent_launch.py), and,
for sorted=True, the contract's order applied by backends/adapted_topk.finish."""

from __future__ import annotations

import functools

import torch

from backends.adapted_topk import finish
from backends.cuda_topk.build import extension
from backends.shared.dependent_launch import dependent_launch
from dispatch.contract import LayoutError


def radix_topk(logits: torch.Tensor, lengths: torch.Tensor, k: int, *, starts: torch.Tensor | None = None,
               page_table: torch.Tensor | None = None, page_rows: torch.Tensor | None = None, block_size: int = 64,
               sorted: bool = False) -> torch.Tensor:
    """int32 [rows, k]: positions (relative to starts) of each row's k largest visible non-NaN logits, -1
    past the selectable count; physical KV slots with page_table (dispatch.contract.TopkRun)."""
    _check_cuda(logits, lengths, starts, page_table, page_rows)
    return launch(logits, lengths, k, starts=starts, page_table=page_table, page_rows=page_rows,
                  block_size=block_size, sorted=sorted, stage=0, filtered=True)


def launch(logits, lengths, k, *, starts, page_table, page_rows, block_size, sorted, stage, filtered=True,
           threads=None, short_list=None):
    """The launch of checked inputs. filtered: short rows selected in registers, longer ones by the
    sampled cut and one filtered pass first (the served path); False: the full select only. stage: keys
    of a row the full select stages in shared memory (a multiple of 4, at most max_stage). Served with
    0: the full select runs only where the filtered pass cannot serve a row. threads: a CTA's threads,
    512 or 1024, and short_list: the kernel's short-list instance (512 threads only); threads None:
    instance()'s choice for these rows and this width."""
    device = logits.device.index if logits.device.index is not None else torch.cuda.current_device()
    if stage % 4 or not 0 <= stage <= max_stage(device):
        raise ValueError(f"stage {stage} must be a multiple of 4 in [0, {max_stage(device)}]")
    rows = logits.shape[0]
    if threads is None:
        threads, short_list = instance(rows, logits.shape[1], multiprocessors(device))
    short_list = bool(short_list)
    if (threads, short_list) not in INSTANCES:
        raise ValueError(f"threads {threads} with short_list {short_list} must be one of {INSTANCES}")
    out = torch.empty((rows, k), dtype=torch.int32, device=logits.device)
    if rows == 0:
        return out
    fuse_pages = page_table is not None and not sorted
    extension().radix_topk(logits, lengths, starts, page_table if fuse_pages else None,
                           page_rows if fuse_pages else None, k, block_size, stage, filtered, threads, short_list,
                           dependent_launch(logits.device), out)
    if sorted:
        return finish(logits, lengths, out, page_table=page_table, page_rows=page_rows, block_size=block_size,
                      sorted=True, starts=starts)
    return out


INSTANCES = ((512, False), (1024, False), (512, True))  # (threads, short_list): radix_select.cu's three
SHORT_LIST_WIDTH = 3 * 8192  # the widest rows the short-list instance serves (measured to 24.5K: faster there)


def instance(rows: int, width: int, sms: int) -> tuple[int, bool]:
    """(threads, short_list) for `rows` rows of at most `width` keys on a GPU of `sms` multiprocessors:
    the short-list instance (three 512-thread CTAs an SM, a 4096-entry list) for many short rows (more
    rows than SMs, width <= SHORT_LIST_WIDTH), else block_threads's CTA size with the 8192-entry list.
    Both are exact whatever the data (a row the short list cannot hold takes the full select); this
    picks the faster one from the host's ints alone (no sync). H200 (132 SMs), this kernel's own build,
    2026-12-02 01:37 UTC: 138.7 us against 167.6 for the wide list in extend (4096 rows to 16K keys).
    2026-12-01 21:52 UTC, the short list with the 11-bit cut in a build that also held round 6's output
    scan (since reverted): 37.9 against 40.1 at 512 x 24.5K; 111.8 against 53.1 at 512 x 49K and 136.8
    against 45.0 at 256 x 98K, where it is not served; between 24.5K and 49K keys not measured. Few rows
    of 8-12K keys split over a cluster of 2 CTAs (round 6, not kept) ran within 0.7 us of one CTA a row.
    Rows read whole into a shared-memory stage and fully selected there, or a never-sampling instance with
    a 2048-entry list (round 7, not kept), ran 169-182 us in extend at two, three or four CTAs an SM."""
    threads = block_threads(rows, sms)
    return threads, threads == 512 and width <= SHORT_LIST_WIDTH


def block_threads(rows: int, sms: int) -> int:
    """A CTA's threads for `rows` rows on a GPU of `sms` multiprocessors: 512 (at <= 64 registers a
    thread, ptxas's count on sm_90a, two such CTAs share an SM, so one row's select overlaps another's
    read) once the rows fill every SM, else 1024 (a lone row gets the whole SM). The faster of the two
    at every shape of the H200 probe (2026-12-01 17:10 UTC, 132 SMs): 512 at 256-4096 rows (5-27%),
    1024 at 1-128 rows (up to 20%); between 133 and 255 rows not measured."""
    return 512 if rows > sms else 1024


@functools.lru_cache(maxsize=None)
def multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def max_stage(device: int) -> int:
    """Keys of a row the kernel stages in shared memory on `device` (the rest it reads twice)."""
    return int(extension().max_stage(device))


def _check_cuda(logits, lengths, starts, page_table, page_rows) -> None:
    """What this kernel adds to the contract's checks: CUDA tensors on one device, a page table
    contiguous along its pages, and sizes its int32 indexing holds."""
    tensors = {"logits": logits, "lengths": lengths, "starts": starts, "page_table": page_table,
               "page_rows": page_rows}
    given = {name: t for name, t in tensors.items() if t is not None}
    for name, tensor in given.items():
        if tensor.device.type != "cuda":
            raise LayoutError(f"top-k backend `cuda.radix` needs CUDA tensors; `{name}` is on {tensor.device}")
    if len({t.device for t in given.values()}) != 1:
        raise LayoutError(f"top-k tensors must be on one device; got {sorted(str(t.device) for t in given.values())}")
    if page_table is not None and page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise LayoutError(f"page_table must be contiguous along its pages; got strides {list(page_table.stride())}")
    if logits.shape[1] >= 2**31 or logits.shape[0] >= 2**31:
        raise LayoutError(f"top-k backend `cuda.radix` indexes rows and columns with int32; logits are {list(logits.shape)}")
