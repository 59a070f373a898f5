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

    def summary(self) -> str:
        """"measured on NVIDIA H200, 2026-11-30: triton 161.9 us, deepgemm.sm90 202.6 us at B=128 ..."."""
        if len(self.shapes) == 1:
            shape, times = self.shapes[0]
            return f"measured on {self.machine}, {self.date}: {_times(times)} at {shape}"
        over = f"geometric mean over {len(self.shapes)} shapes"
        return f"measured on {self.machine}, {self.date}: {_times(self.means)} ({over})"

    def details(self) -> list[str]:
        """One line per shape (when there are several), then each backend that failed the check."""
        lines = [f"{_times(times)} at {shape}" for shape, times in self.shapes] if len(self.shapes) > 1 else []
        return lines + [f"{backend} failed the check: {why}" for backend, why in self.failed]

    def as_dict(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "date": self.date,
            "at": self.at,
            "mean_us": dict(self.means),
            "shapes": [{"shape": shape, "median_us": dict(times)} for shape, times in self.shapes],
            "failed": dict(self.failed),
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
