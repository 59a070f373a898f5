"""A decision: a frozen value saying what was chosen for a key, by which rule, from which plugin,
and why every other candidate was rejected. `explain` prints it; nothing recomputes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dispatch.backend import Backend
from dispatch.key import DispatchKey, Op
from dispatch.layout import Layout


@dataclass(frozen=True)
class Rejection:
    backend: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"backend": self.backend, "reason": self.reason}


@dataclass(frozen=True)
class Decision:
    op: Op
    key: DispatchKey
    backend: str
    layout: Layout
    rule: str  # the rule's id, "prefer[<i>]" (the cluster's list) or "fallback[<i>]"
    source: str  # "rule", "cluster-prefer", "fallback" or "pinned"
    cluster: str | None
    plugin: str
    rejected: tuple[Rejection, ...]
    registry_fingerprint: str
    availability_checked: bool = True
    rule_at: str = ""  # "registry.yaml:LINE" of the rule, prefer or fallback entry that chose it ("" if pinned)
    # The resolved implementation; not part of the value's identity or its JSON.
    impl: Backend = field(compare=False, repr=False, default=None)  # type: ignore[assignment]

    @property
    def chosen_by(self) -> str:
        """How people name what chose it: "rule `x`", "cluster `c` prefer[0]", "fallback[1]", "pinned"."""
        if self.source == "rule":
            return f"rule `{self.rule}`"
        if self.source == "cluster-prefer":
            return f"cluster `{self.cluster}` {self.rule}"
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
        }
