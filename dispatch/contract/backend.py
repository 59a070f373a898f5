"""The backend contract: what a plugin registers. A backend is one implementation of one op in one
layout, with the keys it supports and whether it can run on this machine."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable

from dispatch.contract.errors import PluginError
from dispatch.contract.key import Arch, DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.contract.layout import Layout
from dispatch.contract.verification import Verified

# A backend's name: what registry.yaml and plugins spell the same way (checked with re.fullmatch).
BACKEND_NAME = r"[a-z0-9][a-z0-9_.\-]*"
ALL_ARCHS = frozenset(Arch)
ALL_MODES = frozenset(ForwardMode)
ALL_FP8_DTYPES = frozenset(Fp8Dtype)
# Modes in which the paged logits step runs over cached pages (extend uses the ragged, non-paged kernel).
PAGED_MODES = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND})


@dataclass(frozen=True)
class Support:
    """The keys a backend can serve. `next_n_max` None means unbounded."""

    archs: frozenset[Arch] = ALL_ARCHS
    forward_modes: frozenset[ForwardMode] = ALL_MODES
    fp8_dtypes: frozenset[Fp8Dtype] = ALL_FP8_DTYPES
    next_n_min: int = 1
    next_n_max: int | None = None
    # Extra constraint beyond the ranges, e.g. "next_n in {1, 2}"; returns a reason or None.
    extra: Callable[[DispatchKey], str | None] | None = None

    def why_not(self, key: DispatchKey) -> str | None:
        """None when `key` is supported, else the first reason it is not."""
        if key.arch not in self.archs:
            return f"arch {key.arch.value} not supported (supports {_names(self.archs)})"
        if key.forward_mode not in self.forward_modes:
            return f"forward_mode {key.forward_mode.value} not supported (supports {_names(self.forward_modes)})"
        if key.fp8_dtype not in self.fp8_dtypes:
            return f"fp8_dtype {key.fp8_dtype.value} not supported (supports {_names(self.fp8_dtypes)})"
        if not self.next_n_min <= key.next_n <= (self.next_n_max or key.next_n):
            return f"next_n {key.next_n} not supported (supports {self.next_n_text()})"
        return self.extra(key) if self.extra else None

    def next_n_text(self) -> str:
        upper = "" if self.next_n_max is None else str(self.next_n_max)
        return f"{self.next_n_min}..{upper}" if self.next_n_max != self.next_n_min else str(self.next_n_min)

    def as_dict(self) -> dict[str, Any]:
        return {
            "archs": sorted(a.value for a in self.archs),
            "forward_modes": sorted(m.value for m in self.forward_modes),
            "fp8_dtypes": sorted(d.value for d in self.fp8_dtypes),
            "next_n": {"min": self.next_n_min, "max": self.next_n_max},
        }


def _names(members: frozenset) -> str:
    return ", ".join(sorted(m.value for m in members))


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on this machine, and why not when it cannot."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> "Availability":
        return cls(True)

    @classmethod
    def no(cls, reason: str) -> "Availability":
        return cls(False, reason)


@dataclass(frozen=True)
class Backend:
    """One implementation of one op, in one layout.

    `run` is the kernel entry point; its arguments are the op's call convention, a Protocol in
    dispatch.contract (OP_CONTRACTS names it per op).
    `probe` answers availability on this machine; it is called at most once per process and must be
    cheap (machine facts, never a build): every rank of a machine calls it and must get the same answer.
    `warm()`, when given, does the slow first-use work (a JIT compile) now, outside any CUDA-graph
    capture, and returns the availability after it (Availability.no where the machine rules the backend
    out); it raises where the backend should run here and cannot. dispatch.deciding.warming calls it.
    `prepare(plan)`, when given, builds per-batch state (a schedule) once per plan, never per layer;
    the plan keeps it per op (plan.state_of(op)).
    `refresh_state(captured, fresh)`, required with `prepare` for CUDA graphs, writes a fresh batch's
    state into the captured one in place (a graph replays the captured tensors' addresses).
    `plan_tensors(seq_lens=, page_table=, next_n=, max_context_len=, num_kv_blocks=)`, optional for a
    native paged logits backend with a `prepare`: the plan's lengths and error flags and that backend's
    state in one host call (dispatch.contract.plan.PlanTensors), or None where it cannot here (the plan
    then computes the lengths and calls `prepare`). Whichever way, the tensors must be the same.
    `engine_run`, optional for an engine's kernel behind an adapter: `run`'s call without dispatch's part
    (the finish that applies the NaN rule, the sort, the page transform): the kernel as its engine calls
    it, so `bench` can time what the engine itself pays beside what dispatch pays. Never dispatched.
    """

    name: str
    op: Op
    layout: Layout
    supports: Support
    run: Callable[..., Any]
    probe: Callable[[], Availability] = Availability.yes
    warm: Callable[[], Availability] | None = None
    prepare: Callable[..., Any] | None = None
    refresh_state: Callable[[Any, Any], None] | None = None
    plan_tensors: Callable[..., Any] | None = None
    engine_run: Callable[..., Any] | None = None
    version: str = ""
    description: str = ""
    # How it was verified on each arch (`python -m dispatch gpus` prints it); archs left out: UNDECLARED.
    verified: Mapping[Arch, Verified] = field(default_factory=dict, compare=False)
    # Filled in by the host when the backend is registered; a plugin leaves them empty. `version` above
    # is the backend's library (torch, triton, deep_gemm); `plugin_version` is the plugin distribution's.
    plugin: str = field(default="", compare=False)
    distribution: str = field(default="", compare=False)
    plugin_version: str = field(default="", compare=False)

    def verified_on(self, arch: Arch) -> Verified:
        return self.verified.get(arch, Verified.UNDECLARED)

    def why_unsupported(self, key: DispatchKey) -> str | None:
        """supports.why_not(key), where a plugin's `extra` that raises or returns neither None nor a str is a
        PluginError naming plugin, distribution and backend (the CLI's exit 2), never a traceback."""
        try:
            reason = self.supports.why_not(key)
        except KeyboardInterrupt:
            raise
        except Exception as error:
            raise PluginError(
                f"plugin `{self.plugin}` (distribution `{self.distribution}`): backend `{self.name}`'s supports.extra "
                f"raised {type(error).__name__} for {key}: {str(error)[:80]}"
            ) from error
        if reason is not None and not isinstance(reason, str):
            raise PluginError(
                f"plugin `{self.plugin}` (distribution `{self.distribution}`): backend `{self.name}`'s supports.extra "
                f"returned {type(reason).__name__} {str(reason)[:80]!r} for {key}; expected None or a reason (str)"
            )
        return reason

    def availability(self) -> Availability:
        result = _probe_once(self.probe)
        if not isinstance(result, Availability):  # checked where it is first known: when the probe runs
            raise PluginError(
                f"plugin `{self.plugin}` (distribution `{self.distribution}`): the probe of backend `{self.name}` "
                f"returned {type(result).__name__} {str(result)[:80]!r}; expected dispatch.contract.backend.Availability"
            )
        return result


@functools.lru_cache(maxsize=None)
def _probe_once(probe: Callable[[], Availability]) -> object:
    try:
        return probe()
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # a probe that crashes (even by sys.exit) means "cannot run here", with the reason
        return Availability.no(f"availability probe raised {type(error).__name__}: {error}")
