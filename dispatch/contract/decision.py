"""A decision: a frozen value saying what was chosen for a key, by which rule, from which plugin,
and why every other candidate was rejected. `explain` prints it; nothing recomputes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dispatch.contract.backend import Backend
from dispatch.contract.key import DispatchKey, Op
from dispatch.contract.layout import Layout


@dataclass(frozen=True)
class Rejection:
    backend: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"backend": self.backend, "reason": self.reason}


@dataclass(frozen=True)
class Evidence:
    """What a measured choice rests on: the times `python -m dispatch tune` recorded for the key."""

    machine: str
    date: str
    at: str  # "overlay.yaml:LINE" of the measured preference
    means: tuple[tuple[str, float], ...]  # (backend, geometric mean of its median us over the shapes), fastest first
    shapes: tuple[tuple[str, tuple[tuple[str, float], ...]], ...]  # (shape, ((backend, median us), ...))
    failed: tuple[tuple[str, str], ...] = ()  # (backend, why its output differed from the reference)
    # "step": `shapes` are the whole step's times with each candidate in turn, which the order is by;
    # `alone` then holds the op's own times at those shapes and `stages` the step's other ops' backends.
    ranked_by: str = "op"
    batch_size: int | None = None  # the batch size all the shapes name, where they name one
    alone: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    stages: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()  # (shape, ((op, backend), ...))
    timing: str = ""  # "graph" (CUDA-graph replays), "eager"; "" where the overlay does not say
    timed_eagerly: tuple[tuple[str, str], ...] = ()  # (backend, where) timed eagerly in a graph-timed key

    def summary(self) -> str:
        """"measured on NVIDIA H200, 2026-11-30: triton 161.9 us, deepgemm.sm90 202.6 us at B=128 ...", or
        for an order ranked by the step "measured in the step on NVIDIA H200, 2026-12-02, B=8:
        sglang.topk_v2 21.6 us, cuda.radix 23.1 us, triton 29.2 us (geometric mean over 2 shapes)"."""
        where = f"on {self.machine}, {self.date}"
        if self.ranked_by == "step":
            where = f"in the step {where}" + (f", B={self.batch_size}" if self.batch_size is not None else "")
        if len(self.shapes) == 1:
            shape, times = self.shapes[0]
            text = f"measured {where}: {_times(times)} at {shape}"
        else:
            text = f"measured {where}: {_times(self.means)} (geometric mean over {len(self.shapes)} shapes)"
        return text + self._timed()

    def _timed(self) -> str:
        if self.timing == "eager":
            return ", timed eagerly"
        if self.timing != "graph":
            return ""
        eager = "".join(f"; {backend} eagerly, {where}" for backend, where in self.timed_eagerly)
        return ", timed in CUDA graphs" + (f" ({eager[2:]})" if eager else "")

    def details(self) -> list[str]:
        """One line per shape (when there are several; in the step also the step's other ops and the
        op's own times there), then each backend that failed the check."""
        if self.ranked_by == "step":
            stages, alone = dict(self.stages), dict(self.alone)
            lines = []
            for shape, times in self.shapes:
                around = ", ".join(f"{op} {backend}" for op, backend in stages.get(shape, ()))
                lines.append(f"{_times(times)} at {shape}" + (f" (the step with {around})" if around else ""))
                if shape in alone:
                    lines.append(f"  the op alone: {_times(alone[shape])}")
        else:
            lines = [f"{_times(times)} at {shape}" for shape, times in self.shapes] if len(self.shapes) > 1 else []
        return lines + [f"{backend} failed the check: {why}" for backend, why in self.failed]

    def as_dict(self) -> dict[str, Any]:
        step = {
            "batch_size": self.batch_size,
            "alone": [{"shape": shape, "median_us": dict(times)} for shape, times in self.alone],
            "stages": {shape: dict(ops) for shape, ops in self.stages},
        } if self.ranked_by == "step" else {}
        return {
            "machine": self.machine,
            "date": self.date,
            "at": self.at,
            "mean_us": dict(self.means),
            "shapes": [{"shape": shape, "median_us": dict(times)} for shape, times in self.shapes],
            "failed": dict(self.failed),
            "ranked_by": self.ranked_by,
            **step,
            "timing": self.timing or None,
            "timed_eagerly": dict(self.timed_eagerly),
        }


def _times(times: tuple[tuple[str, float], ...]) -> str:
    return ", ".join(f"{backend} {us:.1f} us" for backend, us in times)


@dataclass(frozen=True)
class Decision:
    op: Op
    key: DispatchKey
    backend: str
    layout: Layout
    rule: str  # the rule's id, "prefer[<i>]" (the cluster's list), "measured[<i>]" or "fallback[<i>]"
    source: str  # "rule", "cluster-prefer", "measured", "fallback" or "pinned"
    cluster: str | None
    plugin: str
    rejected: tuple[Rejection, ...]
    registry_fingerprint: str
    availability_checked: bool = True
    rule_at: str = ""  # "registry.yaml:LINE" of the rule, prefer or fallback entry that chose it ("" if pinned)
    evidence: Evidence | None = None  # the measurements behind a measured choice (source "measured")
    # The batch sizes whose measured band chose it ("B <= 8", "8 < B <= 32", "B > 32"); "" for the key's
    # own order or any other source (dispatch/registry/measured_bands.py).
    band: str = ""
    # The resolved implementation; not part of the value's identity or its JSON.
    impl: Backend = field(compare=False, repr=False, default=None)  # type: ignore[assignment]

    @property
    def chosen_by(self) -> str:
        """How people name what chose it: "rule `x`", "cluster `c` prefer[0]", "cluster `c` measured[0]
        for B <= 8", "fallback[1]", "pinned"."""
        if self.source == "rule":
            return f"rule `{self.rule}`"
        if self.source in ("cluster-prefer", "measured"):
            return f"cluster `{self.cluster}` {self.rule}" + (f" for {self.band}" if self.band else "")
        return self.rule

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op.value,
            "key": self.key.as_dict(),
            "backend": self.backend,
            "layout": self.layout.value,
            "rule": self.rule,
            "source": self.source,
            "cluster": self.cluster,
            "plugin": self.plugin,
            "rejected": [r.as_dict() for r in self.rejected],
            "registry_fingerprint": self.registry_fingerprint,
            "availability_checked": self.availability_checked,
            "rule_at": self.rule_at,
            "evidence": self.evidence.as_dict() if self.evidence else None,
            "band": self.band or None,
        }
