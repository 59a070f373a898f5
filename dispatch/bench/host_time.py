"""`bench --host-time`: the host time of building a batch's plan, against the targets of issue 24.

Engines build a plan every step, on the host's critical path, so its host time is a promise of its own:
build_plan at B=128 (target_verify, N=4, 64 pages a request) within 50 us, an extend plan at M = 16K
query rows within 200 us (S = 16K and 64K keys: 4 requests of 4096 new tokens after 0 or 12288 cached
keys, host lengths given as engines keep them). Medians of many calls on the host clock
(dispatch.bench.timing.time_host), after a warm-up: one call alone is at the mercy of the machine's load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch.bench.timing import time_host
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.key import ForwardMode, Op

PAGED_TARGET_US = 50.0
EXTEND_TARGET_US = 200.0
PAGED_REPEATS = 400
EXTEND_REPEATS = 100
_PAGED_BATCH, _NEXT_N, _PAGES, _LENGTH = 128, 4, 64, 4096
_REQUESTS, _EXTEND = 4, 4096
_PREFIXES = (0, 12288)  # S = 16K and 64K keys


@dataclass(frozen=True)
class HostTime:
    plan: str  # what was planned, in words
    median_us: float
    target_us: float
    repeats: int
    path: str = ""  # how the plans were made (the paged ones: the logits backend, one launch or Triton's)

    @property
    def within(self) -> bool:
        return self.median_us <= self.target_us

    def as_dict(self) -> dict:
        return {"plan": self.plan, "median_us": self.median_us, "target_us": self.target_us,
                "repeats": self.repeats, "within": self.within, "path": self.path}

    def line(self) -> str:
        verdict = "within" if self.within else "OVER"
        made = f" [{self.path}]" if self.path else ""
        return (f"{self.plan}: median {self.median_us:.1f} us of {self.repeats} calls, target {self.target_us:.0f} us "
                f"({verdict}){made}")


def plan_host_times(dispatcher: Dispatcher, *, device: str, fp8_dtype) -> list[HostTime]:
    """The paged plan with the pool deferred (as dispatch_overhead times it) and given (the page guard
    then runs inside build_plan, as when an engine passes num_kv_blocks), then the two extend plans."""
    return [_paged(dispatcher, device, fp8_dtype, pool) for pool in (None, _PAGED_BATCH * _PAGES)] + [
        _extend(dispatcher, device, fp8_dtype, prefix) for prefix in _PREFIXES
    ]


def _paged(dispatcher: Dispatcher, device: str, fp8_dtype, pool: int | None) -> HostTime:
    from dispatch.step.paged_plan import PagedBatch, build_plan

    batch = PagedBatch(
        seq_lens=torch.full((_PAGED_BATCH,), _LENGTH, dtype=torch.int32, device=device),
        page_table=torch.arange(_PAGED_BATCH * _PAGES, dtype=torch.int32, device=device).view(_PAGED_BATCH, _PAGES),
        max_seq_len=_LENGTH,
        forward_mode=ForwardMode.TARGET_VERIFY,
        next_n=_NEXT_N,
        num_kv_blocks=pool,
    )
    seconds = time_host(lambda: build_plan(dispatcher, batch, kv_fp8_dtype=fp8_dtype), repeats=PAGED_REPEATS, warmup=20)
    told = "pool given" if pool is not None else "pool deferred to the first layer"
    plan = build_plan(dispatcher, batch, kv_fp8_dtype=fp8_dtype)  # one of the timed plans, to say what they hold
    return HostTime(f"build_plan B={_PAGED_BATCH} N={_NEXT_N} ({told})", seconds * 1e6, PAGED_TARGET_US, PAGED_REPEATS,
                    _paged_path(plan, batch) + _topk_state_share(plan))


def _topk_state_share(plan) -> str:
    """How much of the plan is the decided top-k backend's own per-batch state, where it has one (SGLang's
    v2 plans its rows per batch, as SGLang does once per forward): timed alone over the same plan."""
    prepare = plan.decision(Op.TOPK).impl.prepare
    if prepare is None:
        return ""
    seconds = time_host(lambda: prepare(plan), repeats=PAGED_REPEATS, warmup=20)
    return f"; of which the top-k's per-batch plan {seconds * 1e6:.1f} us"


def _paged_path(plan, batch) -> str:
    """How the timed plans were made: the decided logits backend, and its one launch or the Triton ones."""
    from dispatch.step.paged_plan import logits_plan_tensors

    logits, topk = plan.logits, plan.decision(Op.TOPK)
    # A top-k backend with a per-batch state (SGLang's v2 plans its rows once per batch, as SGLang does
    # per forward) adds that to the plan's host time: named, so a figure says what it includes.
    selected = f"; top-k `{topk.backend}`" + (", its per-batch plan included" if topk.impl.prepare is not None else "")
    if logits.impl.plan_tensors is None:
        return f"logits `{logits.backend}`{selected}"
    if logits_plan_tensors(logits, batch) is not None:
        # Timed alone too (its C++ call and the Python that wraps the tensors), beside the top-k's share.
        seconds = time_host(lambda: logits_plan_tensors(logits, batch), repeats=PAGED_REPEATS, warmup=20)
        return f"logits `{logits.backend}`, one C++ launch ({seconds * 1e6:.1f} us alone){selected}"
    # Why not (not built here, or this batch not taken) is the backend's to say: `backends --warm` prints it.
    return (f"logits `{logits.backend}`, Triton launches (its one launch is not built here or does not take this "
            f"batch){selected}")


def _extend(dispatcher: Dispatcher, device: str, fp8_dtype, prefix: int) -> HostTime:
    from dispatch.step.extend_plan import build_extend_plan
    from dispatch.step.extend_batch import ExtendBatch

    pages = -(-(prefix + _EXTEND) // 64)
    table = torch.arange(_REQUESTS * pages, dtype=torch.int32, device=device).view(_REQUESTS, pages)
    batch = ExtendBatch.from_lengths([prefix] * _REQUESTS, [_EXTEND] * _REQUESTS, table, num_kv_blocks=_REQUESTS * pages)
    seconds = time_host(lambda: build_extend_plan(dispatcher, batch, kv_fp8_dtype=fp8_dtype),
                        repeats=EXTEND_REPEATS, warmup=5)
    rows, keys = batch.total_tokens, batch.total_keys
    label = f"extend plan M={rows // 1024}K S={keys // 1024}K R={_REQUESTS}"
    return HostTime(label, seconds * 1e6, EXTEND_TARGET_US, EXTEND_REPEATS)
