"""plan_prepare.cu, compiled with torch's C++-extension tooling like `cuda.radix` (the same cache, lock,
failure marker and bounded child build: backends/cuda_topk/build.py), and the cheap question build_plan
asks every batch: is it loaded? (Whether it serves a batch, the launch itself answers: its prepares
return no tensors for a batch it does not take, and the plan then takes the Triton launches.)

It is an accelerator of the host, never a choice of path: a paged logits backend whose plan it can
build (backends/deepgemm/plan_tensors.py, backends/triton/plan_tensors.py) gets the same tensors, bit
for bit, as from the Triton launches it replaces; where it is not built, those launches run. So it is
never built implicitly (a plan must not wait a minute for nvcc): `python -m dispatch backends --warm` and
IndexerStep.warm() build it, through the warm-up of the logits backends that use it, and a process loads
it when its library is already in the cache."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from backends.cuda_topk.build import (BUILD_TIMEOUT_S, MachineFacts, build_key, cache_root, compile_into,
                                      cuda_topk_availability, load_library, machine_facts)
from backends.cuda_topk.compile_cache import BuildSlot, CompileFailed, built_library, forget_failure
from dispatch.contract import BLOCK_KV, Availability

SOURCE = Path(__file__).with_name("plan_prepare.cu")
LABEL = "the plan's one-launch prepare (backends/shared/plan_prepare.cu)"


def build_slot(facts: MachineFacts) -> BuildSlot:
    key = build_key(SOURCE.read_bytes(), facts.torch_version, facts.torch_cuda, facts.capability or (0, 0),
                    facts.nvcc_version or "")
    return BuildSlot(cache_root() / "plan_prepare" / key, f"dispatch_plan_prepare_{key}")


class _Loaded:
    """This process's answer, found once (build_plan asks every batch): the module, or why there is none."""

    module: ModuleType | None = None
    why_not: str | None = None  # None: not looked for yet


def loaded() -> ModuleType | None:
    """The built extension where this process has loaded it or its library is in the cache; None
    otherwise (why_not_loaded() says why). Never builds; looks at most once per process until warm() runs."""
    if _Loaded.why_not is None:
        _Loaded.module, _Loaded.why_not = _find()
    return _Loaded.module


def why_not_loaded() -> str | None:
    """None where loaded() has the module, else why not, in words."""
    return None if loaded() is not None else _Loaded.why_not


def _find() -> tuple[ModuleType | None, str]:
    facts = machine_facts()
    usable = cuda_topk_availability(facts, None)
    if not usable.ok:
        return None, usable.reason
    slot = build_slot(facts)
    if not slot.library.is_file():
        return None, f"not built for this machine yet ({slot.library}); `python -m dispatch backends --warm` builds it"
    try:
        return load_library(slot.name, slot.library), ""
    except (ImportError, OSError) as error:
        return None, f"its cached library did not load: {type(error).__name__}: {error}"


def warm() -> Availability:
    """Build (or load) it now, outside any capture. Availability.no with the reason where it cannot be
    built here; the plans then take the Triton launches, which compute the same tensors."""
    facts = machine_facts()
    usable = cuda_topk_availability(facts, None)
    if not usable.ok:
        return usable
    slot = build_slot(facts)
    forget_failure(slot)
    try:
        library = built_library(slot, functools.partial(compile_into, facts=facts, name=slot.name, source=SOURCE,
                                                        label=LABEL), wait_s=BUILD_TIMEOUT_S)
    except CompileFailed as failure:
        _Loaded.module, _Loaded.why_not = None, f"its build failed: {str(failure).splitlines()[0]}"
        return Availability.no(_Loaded.why_not)
    try:
        _Loaded.module, _Loaded.why_not = load_library(slot.name, library), ""
    except (ImportError, OSError) as error:  # a library that does not load is a path not taken, never a crash
        _Loaded.module, _Loaded.why_not = None, f"its built library did not load: {type(error).__name__}: {error}"
        return Availability.no(_Loaded.why_not)
    return Availability.yes()


def page_guard(context_lens, page_table, max_context_len: int, error_flags, safe_table, lens, fill,
               num_kv_blocks: int | None):
    """The PageGuard the kernel's outputs make: launched when the pool was known, else left for the first
    layer call to guard (PageGuard.for_cache), into the same outputs, as the Triton path's is."""
    guard = _page_guard_type()
    return guard(context_lens=context_lens, block_table=page_table, max_context_len=max_context_len,
                 error_flags=error_flags, block_kv=BLOCK_KV, safe_table=safe_table, lens=lens, fill=fill,
                 num_blocks=num_kv_blocks)


@functools.cache
def _page_guard_type():
    # Imported once (page_guard imports triton): a function-level import costs a GPU host ~2-3 us a batch.
    from backends.shared.page_guard import PageGuard

    return PageGuard


def logits_warm_up(probe: Callable[[], Availability]) -> Callable[[], Availability]:
    """The warm-up of a paged logits backend that uses this extension (probed by `probe`): build it where
    the backend can run. The backend runs either way (the Triton launches make the same plan), so it
    stays available; where the extension cannot be built here, the reason comes with it, for
    `backends --warm` to print."""

    def warm_up() -> Availability:
        usable = probe()
        if not usable.ok:
            return usable
        built = warm()
        return built if built.ok else Availability(True, f"plans take the Triton launches: {built.reason}")

    return warm_up
