"""The registered backends, keyed by (op, name), in an order that does not depend on who registered first."""

from __future__ import annotations

from dataclasses import dataclass

from dispatch.contract.backend import Backend
from dispatch.contract.key import Op


@dataclass(frozen=True)
class Catalog:
    backends: tuple[Backend, ...]  # sorted by (op, name)

    @classmethod
    def of(cls, backends: list[Backend]) -> "Catalog":
        return cls(tuple(sorted(backends, key=lambda b: (b.op.value, b.name))))

    def for_op(self, op: Op) -> tuple[Backend, ...]:
        return tuple(b for b in self.backends if b.op is op)

    def get(self, op: Op, name: str) -> Backend | None:
        return next((b for b in self.backends if b.op is op and b.name == name), None)

    def names(self, op: Op | None = None) -> list[str]:
        return sorted({b.name for b in self.backends if op is None or b.op is op})
