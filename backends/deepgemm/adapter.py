"""DeepGEMM behind dispatch: the bridge over its API generations, the input checks its extension would
assert, and its two backends: paged MQA logits (prepare and run) and ragged MQA logits for extend
batches (fp8_mqa_logits; API notes at its section below).

deep_gemm is imported only when a backend is probed, prepared or run, never at module load (plugin.py's
`import_deep_gemm` imports it then and keeps it): the packaged builds link libtorch and load CUDA
libraries, which fails or is slow where they cannot run.
A build works only with the torch whose headers it was compiled against (it calls libtorch's inline
accessors). On torch 2.11 + CUDA 13 (H200, 2026-11-29): sgl-deep-gemm 0.1.3 to 0.1.5 and
tokenspeed-deepgemm 2.3.0 to 2.5.0.post20260629 run; later builds of either were compiled for a newer torch.

The paged logits API, tolerant of the generations in the field:
- `fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule, max_context_len,
  clean_logits)`: the first generation; q is the fp8 tensor.
- `fp8_fp4_paged_mqa_logits(...)`, same arguments, q a (values, scales) pair: fp8 q goes as `(q, None)`
  because some builds read a bare tensor as packed FP4. Builds that have it keep the first name as a
  legacy alias, so the newer name is tried first.
- Newer builds accept only 2-D context lens; plans always hold 2-D lens (native [B, N], flatten
  [B*N, 1]), which every generation that has a 2-D path reads the same way.
- `get_num_sms()` is what the kernel launches with, so the schedule must use it; builds without it fall
  back to the device's SM count.
- The schedule: on SM90, for the builds whose shipped scheduler source is a rule we compute
  (backends/deepgemm/guard_and_schedule.py), our kernel computes it in the page guard's launch; else
  `get_paged_mqa_logits_metadata`, a second launch.

Every function takes the module as its first argument, so tests can hand in a recording stand-in.

Bounds: deep_gemm follows every table entry a length covers without checking it, so prepare, once per
batch, launches backends/shared/page_guard.py (one small kernel, no sync; at the first layer call when
the engine did not give the plan its pool size): every layer's deep_gemm call gets the guard's copy of
the table, whose out-of-range entries point at block 0, the masking pass makes an affected token's row
all NaN, and the plan's error flag is set. What the guard cannot fix: a length past max_context_len. The lens must stay
the ones the schedule was built from, so deep_gemm still scores (and writes) that token's keys up to its
length, past the row's width, into the 256-aligned padding or the next row. The guard flags and poisons
the row; the engine must still guarantee max_seq_len >= every length (DISPATCH_DEBUG_BOUNDS=1 checks it
on the host before the launch and raises).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

# At module level: a function-level import costs a GPU host 1-3 us, and every batch's plan comes through it.
from backends.deepgemm.plan_tensors import deepgemm_plan_tensors
from backends.deepgemm.state import DeepGemmState
from dispatch.contract import (
    BLOCK_KV,
    DtypeMismatchError,
    PagedPlan,
    Layout,
    LayoutError,
    check_pages,
    debug_bounds_on,
    readable_width,
)

SCHEDULE = "get_paged_mqa_logits_metadata"
LOGITS_FP8_FP4 = "fp8_fp4_paged_mqa_logits"
LOGITS_FP8 = "fp8_paged_mqa_logits"
# SM90 and SM100 kernels are instantiated for these head counts only.
HEAD_COUNTS = (32, 64)


# --- the library ------------------------------------------------------------------------------------


def version_of(module: ModuleType) -> str:
    return str(getattr(module, "__version__", "") or "(version unknown)")


def missing_symbols(module: ModuleType) -> list[str]:
    """The API names this adapter needs and `module` lacks, as they would read in a message."""
    missing = [] if hasattr(module, SCHEDULE) else [f"`{SCHEDULE}`"]
    if not (hasattr(module, LOGITS_FP8_FP4) or hasattr(module, LOGITS_FP8)):
        missing.append(f"`{LOGITS_FP8_FP4}` or `{LOGITS_FP8}`")
    return missing


# --- SM90 next_n 4: the 2-CTA KV-multicast kernel ------------------------------------------------------
# Some builds (tokenspeed-deepgemm 2.5.0.post20260604 and post20260629, the DeepGEMM vLLM 0.33 bundles)
# run SM90 next_n 4 natively: a cluster of two CTAs shares each KV page (TMA multicast) and each CTA
# scores two of the four tokens. Their host code then asserts a schedule of num_sms / 2 + 1 rows, one
# task per cluster. Earlier builds (sgl-deep-gemm 0.1.3-0.1.5, tokenspeed-deepgemm 2.3.0.post20251110 and
# 2.5.0.post20260424) assert next_n in {1, 2}. No build has an SM90 next_n 3 kernel (DeepGEMM issue 340).
# DeepGEMM compiles its kernels at first use from the headers it ships, so the shipped SM90 kernel source
# says which kernel a build runs; its multicast template parameter is read without loading the extension.
SM90_PAGED_SOURCE = ("include", "deep_gemm", "impls", "sm90_fp8_paged_mqa_logits.cuh")
SM90_KV_MULTICAST_MARK = "kNumKVMulticast"
SM90_NEXT_N4_KV_MULTICAST = 2


def sm90_paged_source(module: ModuleType) -> Path | None:
    """The SM90 paged logits kernel source shipped beside `module`, or None when it ships none."""
    package = getattr(module, "__file__", None)
    if not package:
        return None
    source = Path(package).parent.joinpath(*SM90_PAGED_SOURCE)
    return source if source.is_file() else None


def missing_sm90_next_n4(module: ModuleType) -> list[str]:
    """missing_symbols, plus the SM90 next_n 4 kernel when this build does not ship it."""
    missing = missing_symbols(module)
    source = sm90_paged_source(module)
    if source is None:
        missing.append(f"SM90 paged logits source `{'/'.join(SM90_PAGED_SOURCE)}`")
    elif SM90_KV_MULTICAST_MARK not in source.read_text(errors="replace"):
        missing.append(f"SM90 next_n 4 kernel (its `{SM90_PAGED_SOURCE[-1]}` has no KV multicast)")
    return missing


# --- paged MQA logits (decode, target_verify, draft_extend) -----------------------------------------


def num_sms(module: ModuleType, device: torch.device) -> int:
    if hasattr(module, "get_num_sms"):
        return int(module.get_num_sms())
    return torch.cuda.get_device_properties(device).multi_processor_count


def build_schedule(module: ModuleType, context_lens: torch.Tensor, sms: int) -> torch.Tensor:
    """int32 [sms + 1, 2]: the split of the batch's KV pages over the SMs, for exactly these lens."""
    return getattr(module, SCHEDULE)(context_lens, BLOCK_KV, sms)


def launch_paged_mqa_logits(
    module: ModuleType,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule: torch.Tensor,
    max_context_len: int,
) -> torch.Tensor:
    """fp32 [rows * next_n, max_context_len]; positions past a token's length hold garbage.

    clean_logits stays off: it accepts only 1-D lens, and plans hold 2-D lens.
    deep_gemm's output storage ends at the last row's width, so it is asked for the width rounded up to
    ROW_UNIT_FLOATS and the first max_context_len columns are returned: the last row's 16-byte tail is
    then inside the storage, and an engine's top-k reads the logits where they are (no copy). The extra
    columns lie past every token's length (the plan's max_context_len bounds them), on pages the table
    already covers (its width is whole pages of BLOCK_KV, a multiple of ROW_UNIT_FLOATS).
    """
    if hasattr(module, LOGITS_FP8_FP4):
        kernel, q_arg = getattr(module, LOGITS_FP8_FP4), (q, None)
    else:
        kernel, q_arg = getattr(module, LOGITS_FP8), q
    readable = readable_width(max_context_len)
    # Positional: the eight leading parameters sit in the same places in every generation and binding.
    logits = kernel(q_arg, kv_cache, weights, context_lens, block_table, schedule, readable, False)
    return logits[:, :max_context_len]


def check_kernel_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    """Raise LayoutError for anything deep_gemm's host code would assert, so a mistake names the tensor
    instead of surfacing inside the C++ extension; shapes and dtypes against the tag are checked already."""
    # The kernel builds TMA descriptors from these pointers and assumes dense rows.
    if not q.is_contiguous():
        raise LayoutError(f"deep_gemm needs a contiguous q; got strides {list(q.stride())}")
    if q.shape[2] not in HEAD_COUNTS:
        raise LayoutError(f"deep_gemm supports {HEAD_COUNTS} indexer heads; q has {q.shape[2]}")
    if not weights.is_contiguous() or weights.dtype != torch.float32:
        raise LayoutError(
            f"deep_gemm needs contiguous fp32 weights; got {weights.dtype}, strides {list(weights.stride())}"
        )
    if kv_cache.shape[1] != BLOCK_KV:
        raise LayoutError(f"the schedule is built for block_kv={BLOCK_KV}; kv_cache has block_kv={kv_cache.shape[1]}")
    if kv_cache.stride(1) != kv_cache.shape[3] or kv_cache.stride(3) != 1:
        raise LayoutError(f"deep_gemm needs kv_cache rows of D+4 dense bytes; got strides {list(kv_cache.stride())}")
    if context_lens.dtype != torch.int32 or not context_lens.is_contiguous():
        raise LayoutError(f"deep_gemm needs contiguous int32 context_lens; got {context_lens.dtype}")
    if block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        raise LayoutError(f"deep_gemm needs an int32 block_table with unit column stride; got {block_table.dtype}")


def mask_past_lengths(
    logits: torch.Tensor, context_lens: torch.Tensor, fill: torch.Tensor | None = None
) -> torch.Tensor:
    """Write -inf in row r at every position >= context_lens.flatten()[r], in place; returns `logits`.
    `fill` (fp32, one value per row) replaces -inf: the page guard gives a poisoned row length -1 and
    fill NaN, so the same single pass makes that whole row NaN.

    deep_gemm leaves those positions unspecified; the contract says -inf. What it costs: one extra pass
    over the logits per layer, in place. For every position of the [B*N, max_context_len] output: a
    1-byte mask written and read back, and the logits read and written (4 + 4 bytes), in three small
    launches (positions, compare, fill). At next_n = 4 the kernel moves about 148 B per cached token,
    the pass about 40 B, more where lengths are ragged, since it covers max_context_len in every row.

    The mask is built on each call from the plan's lens rather than once per batch: under CUDA graphs
    the plan's lens are refreshed in place between replays, and the mask must follow them. deep_gemm's
    own clean_logits would make the pass inside the extension but takes only 1-D lens, and plans hold
    2-D ones. The indexer step skips the pass (clean_logits=False): its top-k takes the lengths.
    """
    positions = torch.arange(logits.shape[1], device=logits.device, dtype=context_lens.dtype)
    visible = positions[None, :] < context_lens.reshape(-1, 1)
    if fill is None:
        return logits.masked_fill_(~visible, float("-inf"))
    return torch.where(visible, logits, fill.reshape(-1, 1), out=logits)


@dataclass(frozen=True)
class DeepGemmPagedLogits:
    """The paged logits op through deep_gemm, for plans tagged with `layout`.

    prepare builds deep_gemm's schedule once per batch, from the very plan.context_lens tensor every
    layer's kernel call then receives, and launches the batch's page guard; the plan keeps both as this
    backend's state. refresh_state rewrites them in place, so a CUDA-graph replay sees the new batch."""

    layout: Layout
    load: Callable[[], ModuleType]
    # CTAs sharing each KV page: the kernel runs one scheduler task per cluster of this many CTAs, so the
    # schedule has num_sms / kv_multicast + 1 rows (2 for SM90 next_n 4; 1 everywhere else).
    kv_multicast: int = 1
    # The SM90 kernels' schedule, which backends/deepgemm/guard_and_schedule.py computes in the page guard's
    # launch where the build ships a rule it knows (SM100's counts next_n atoms differently: deep_gemm's own).
    sm90_schedule: bool = False

    def prepare(self, plan: PagedPlan) -> DeepGemmState:
        """The batch's schedule, built from plan.context_lens itself, and its page guard: one launch
        (backends/deepgemm/guard_and_schedule.py) where the build's shipped scheduler is a rule we
        compute, else our guard and deep_gemm's own metadata kernel."""
        from backends.deepgemm.guard_and_schedule import prepare_guard_and_schedule, schedule_rule_of
        from backends.shared.page_guard import prepare_page_guard  # triton ships with torch on CUDA

        module = self.load()
        lens = plan.context_lens
        slots = self.schedule_slots(module, lens.device)
        rule = schedule_rule_of(module) if self.sm90_schedule else None
        if rule is not None and rule.serves(lens.shape[1]):
            guard, schedule = prepare_guard_and_schedule(plan, slots, rule)
            return DeepGemmState(schedule.schedule, guard)
        return DeepGemmState(build_schedule(module, lens, slots), prepare_page_guard(plan))

    def plan_tensors(self, **batch):
        """The plan's lengths, flags and this state in one launch, where it can (backends/deepgemm/plan_tensors.py)."""
        return deepgemm_plan_tensors(self, **batch)

    def schedule_slots(self, module: ModuleType, device: torch.device) -> int:
        """The scheduler tasks the kernel launches: one per SM, or per cluster of kv_multicast SMs."""
        sms = num_sms(module, device)
        if sms % self.kv_multicast:
            raise LayoutError(
                f"deep_gemm's {self.kv_multicast}-CTA cluster kernel needs an SM count divisible by "
                f"{self.kv_multicast}; get_num_sms() is {sms}"
            )
        return sms // self.kv_multicast

    @staticmethod
    def refresh_state(captured: DeepGemmState, fresh: DeepGemmState) -> None:
        """Write a fresh batch's schedule into the captured plan's (same shape: [num_sms + 1, 2]) and guard
        the captured plan's lens and table, already refreshed by dispatch.engines.graphs, in place."""
        # The guard first: it refuses another pool before anything is written, so a refused update
        # leaves the schedule as it was (dispatch.engines.graphs restores the rest).
        captured.guard.refresh(fresh.guard.num_blocks)
        captured.schedule.copy_(fresh.schedule)

    def run(
        self, plan: PagedPlan, q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, *, clean_logits=True
    ) -> torch.Tensor:
        # The op's call checked the inputs against this layout (dispatch/contract/ops/paged_logits.py);
        # what is left is what deep_gemm's own host code would assert on, and the plan's tag (free): the
        # SGLang incident was this kernel handed a flatten plan by a caller that picked it on its own,
        # where at next_n = 2 a flatten q is a valid native q of B*N requests.
        if plan.layout is not self.layout:
            raise LayoutError(f"backend consumes layout `{self.layout.value}`; the plan is tagged `{plan.layout.value}` "
                              f"(backend `{plan.logits.backend}`, {plan.logits.chosen_by})")
        self._check_schedule(plan)
        check_kernel_inputs(q, kv_cache, weights, plan.context_lens, plan.block_table)
        num_blocks = kv_cache.shape[0]
        if num_blocks == 0 and plan.max_context_len > 0:
            raise LayoutError("kv_cache has no blocks, so no page-table entry can be valid")
        if debug_bounds_on():
            check_pages(plan.context_lens, plan.block_table, num_blocks, plan.max_context_len, BLOCK_KV)
        state: DeepGemmState = plan.state
        guard = state.guard.for_cache(kv_cache)  # host-side: the cache covers the pool the guard checked
        logits = launch_paged_mqa_logits(
            self.load(), q, kv_cache, weights, plan.context_lens, guard.safe_table, state.schedule, plan.max_context_len
        )
        if clean_logits:
            return mask_past_lengths(logits, guard.lens, guard.fill)
        # No -inf tail, but a poisoned token's row (deep_gemm scored it through the guard's safe table)
        # must still become NaN: one small launch instead of the pass over every logit.
        from backends.shared.poisoned_rows import nan_poisoned_rows  # triton ships with torch on CUDA

        return nan_poisoned_rows(logits, guard.lens)

    def _check_schedule(self, plan: PagedPlan) -> None:
        state = plan.state
        schedule = getattr(state, "schedule", None)
        if not isinstance(schedule, torch.Tensor) or schedule.dim() != 2 or schedule.dtype != torch.int32:
            raise LayoutError(
                f"the plan holds no DeepGEMM schedule (state is {type(state).__name__}); build it with build_plan"
            )


# --- ragged MQA logits (extend / prefill) -----------------------------------------------------------
# deep_gemm's non-paged fp8_mqa_logits, tolerant of the API generations in the field:
# - `fp8_mqa_logits(q, (k, scales), weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits)`: the
#   first generation.
# - Then `max_seqlen_k` (default 0) after clean_logits: non-zero asks for a compressed [M, max_seqlen_k]
#   output (column j = key ks[m] + j) and forbids clean_logits. This adapter never passes it, so every
#   generation returns the full [M, S] layout.
# - Newest: `fp8_fp4_mqa_logits(q, ...)` with q a (values, scales) pair and `logits_dtype` last; fp8 q
#   goes as `(q, None)` (a scales tensor means FP4). Builds that have it keep `fp8_mqa_logits` as a
#   legacy alias, so the newer name is tried first.
# With clean_logits the extension writes -inf outside each row's [ks, ke) (a second kernel); without it
# those positions are garbage. The output is a slice of a wider buffer: rows are not contiguous.

RAGGED_LOGITS_FP8_FP4 = "fp8_fp4_mqa_logits"
RAGGED_LOGITS_FP8 = "fp8_mqa_logits"
# What the SM90 / SM100 fp8 ragged kernels are instantiated for (heads: HEAD_COUNTS).
RAGGED_HEAD_DIMS = (32, 64, 128)


def missing_ragged_symbols(module: ModuleType) -> list[str]:
    """The ragged API names this adapter needs and `module` lacks, as they would read in a message."""
    if hasattr(module, RAGGED_LOGITS_FP8_FP4) or hasattr(module, RAGGED_LOGITS_FP8):
        return []
    return [f"`{RAGGED_LOGITS_FP8_FP4}` or `{RAGGED_LOGITS_FP8}`"]


def launch_ragged_mqa_logits(
    module: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    scales: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    clean_logits: bool = True,
) -> torch.Tensor:
    """fp32 [M, S] (row stride wider than S); -inf outside [ks, ke) with clean_logits, garbage without."""
    check_ragged_kernel_inputs(q, k, scales, weights, ks, ke)
    if q.shape[0] == 0 or k.shape[0] == 0:
        # The extension's TMA descriptors need a non-empty tensor; an empty side is all -inf by definition.
        return torch.full((q.shape[0], k.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    if hasattr(module, RAGGED_LOGITS_FP8_FP4):
        kernel, q_arg = getattr(module, RAGGED_LOGITS_FP8_FP4), (q, None)
    else:
        kernel, q_arg = getattr(module, RAGGED_LOGITS_FP8), q
    # Positional: the six leading parameters sit in the same places in every generation.
    return kernel(q_arg, (k, scales), weights, ks, ke, clean_logits)


def check_ragged_kernel_inputs(q, k, scales, weights, ks, ke) -> None:
    """LayoutError / DtypeMismatchError for anything the extension would assert on, naming the tensor."""
    if q.dim() != 3:
        raise LayoutError(f"q must be [M, H, D]; got {list(q.shape)}")
    rows, heads, head_dim = q.shape
    if q.dtype != torch.float8_e4m3fn or k.dtype != torch.float8_e4m3fn:
        raise DtypeMismatchError(f"deep_gemm's fp8 MQA logits read e4m3fn only; q is {q.dtype}, k is {k.dtype}")
    if not q.is_contiguous():
        raise LayoutError(f"deep_gemm needs a contiguous q; got strides {list(q.stride())}")
    if heads not in HEAD_COUNTS or head_dim not in RAGGED_HEAD_DIMS:
        raise LayoutError(f"deep_gemm supports H in {HEAD_COUNTS} and D in {RAGGED_HEAD_DIMS}; q is {list(q.shape)}")
    if k.dim() != 2 or k.shape[1] != head_dim or not k.is_contiguous():
        raise LayoutError(f"deep_gemm needs a contiguous k [S, D={head_dim}]; got {list(k.shape)}, "
                          f"strides {list(k.stride())}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (k.shape[0],) or not scales.is_contiguous():
        raise LayoutError(f"deep_gemm needs contiguous fp32 scales [S={k.shape[0]}]; "
                          f"got {scales.dtype} {list(scales.shape)}")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (rows, heads) or not weights.is_contiguous():
        raise LayoutError(f"deep_gemm needs contiguous fp32 weights [M={rows}, H={heads}]; got {weights.dtype} "
                          f"{list(weights.shape)}, strides {list(weights.stride())}")
    for name, bound in (("ks", ks), ("ke", ke)):
        if bound.dtype != torch.int32 or tuple(bound.shape) != (rows,) or not bound.is_contiguous():
            raise LayoutError(f"deep_gemm needs {name} as contiguous int32 [M={rows}]; "
                              f"got {bound.dtype} {list(bound.shape)}")


@dataclass(frozen=True)
class DeepGemmRaggedLogits:
    """The ragged logits op through deep_gemm's fp8_mqa_logits. Its per-batch state is the Triton K
    gather (a byte copy that runs wherever deep_gemm does): deep_gemm has no gather of its own."""

    load: Callable[[], ModuleType]

    @staticmethod
    def prepare(plan):
        from backends.shared.kv_gather import TritonKeyGather  # triton ships with every CUDA torch

        return TritonKeyGather.for_plan(plan)

    def run(self, q, k, scales, weights, ks, ke, *, fp8_dtype, clean_logits=True) -> torch.Tensor:
        # The op's call checked the inputs (dispatch/contract/ops/ragged_logits.py); the launch adds deep_gemm's own.
        return launch_ragged_mqa_logits(self.load(), q, k, scales, weights, ks, ke, clean_logits=clean_logits)
