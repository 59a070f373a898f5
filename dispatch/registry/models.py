"""The shape of registry.yaml as frozen pydantic models; unknown fields are rejected.

Validation here is what can be checked from the file alone. Checks that need the registered
backends (unknown names, lint) live in dispatch.registry.checks.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from dispatch.backend import BACKEND_NAME
from dispatch.key import FP8_DTYPES_BY_ARCH, Arch, DispatchKey, Fp8Dtype, ForwardMode, Op


def _as_tuple(value: object) -> object:
    """Let a single value stand for a one-element list (`arch: sm90`)."""
    return (value,) if isinstance(value, (str, int)) and not isinstance(value, bool) else value


class Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)


def _one_or_many(item: object) -> object:
    """A list of `item` in which a single value stands for a one-element list; the JSON Schema says so too."""
    return Annotated[tuple[item, ...], BeforeValidator(_as_tuple, json_schema_input_type=item | list[item])]


BackendName = Annotated[str, Field(pattern=f"^{BACKEND_NAME}$")]
NameList = _one_or_many(BackendName)
ArchList = _one_or_many(Arch)
ModeList = _one_or_many(ForwardMode)
Fp8DtypeList = _one_or_many(Fp8Dtype)
NextN = Annotated[int, Field(ge=1, strict=True)]


class NextNRange(Strict):
    min: NextN = 1
    max: NextN | None = None

    @model_validator(mode="after")
    def _ordered(self) -> "NextNRange":
        if self.max is not None and self.max < self.min:
            raise ValueError(f"next_n range is inverted: min {self.min} > max {self.max}")
        return self

    def contains(self, next_n: int) -> bool:
        return self.min <= next_n and (self.max is None or next_n <= self.max)


def _next_n(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool):
        return {"min": value, "max": value}
    return value


class When(Strict):
    """A rule's condition: each field a list of allowed values; a missing field matches anything."""

    arch: ArchList | None = None
    forward_mode: ModeList | None = None
    next_n: Annotated[NextNRange, BeforeValidator(_next_n, json_schema_input_type=NextN | NextNRange)] | None = None
    fp8_dtype: Fp8DtypeList | None = None

    @field_validator("arch", "forward_mode", "fp8_dtype")
    @classmethod
    def _not_empty(cls, values: tuple | None) -> tuple | None:
        if values is not None and not values:
            raise ValueError("an empty list matches nothing; leave the field out to match any value")
        return values

    @model_validator(mode="after")
    def _pairs_can_occur(self) -> "When":
        if self.arch is None or self.fp8_dtype is None:
            return self
        for arch in self.arch:
            if not FP8_DTYPES_BY_ARCH[arch] & set(self.fp8_dtype):
                listed = ", ".join(d.value for d in self.fp8_dtype)
                held = ", ".join(sorted(d.value for d in FP8_DTYPES_BY_ARCH[arch]))
                raise ValueError(f"arch {arch.value} cannot hold fp8_dtype {listed} (it holds only: {held})")
        return self

    def matches(self, key: DispatchKey) -> bool:
        return (
            (self.arch is None or key.arch in self.arch)
            and (self.forward_mode is None or key.forward_mode in self.forward_mode)
            and (self.next_n is None or self.next_n.contains(key.next_n))
            and (self.fp8_dtype is None or key.fp8_dtype in self.fp8_dtype)
        )


class Rule(Strict):
    id: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]
    when: When = When()
    use: Annotated[NameList, Field(min_length=1)]
    why: str = ""


class OpTable(Strict):
    rules: tuple[Rule, ...] = ()
    fallback: NameList = ()

    @field_validator("rules")
    @classmethod
    def _unique_ids(cls, rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
        seen: set[str] = set()
        for rule in rules:
            if rule.id in seen:
                raise ValueError(f"duplicate rule id `{rule.id}`")
            seen.add(rule.id)
        return rules


class ClusterMatch(Strict):
    """Declares which machines a cluster is: every given field must match the host."""

    arch: ArchList | None = None
    gpu_name: str | None = None  # shell-style glob over torch.cuda.get_device_name()
    hostname: str | None = None  # shell-style glob over socket.gethostname()


Positive = Annotated[int, Field(ge=1, strict=True)]
Positives = Annotated[tuple[Positive, ...], Field(min_length=1)]


class Workload(Strict):
    """The shapes `python -m dispatch tune` measures for a cluster. The defaults cover serving
    (README, "Choosing by measurement"); a cluster names only what it changes."""

    batch_sizes: Positives = (1, 8, 32, 128, 256)
    lengths: Positives = (2048, 8192, 32768, 131072)  # mean lengths; each batch uniform in [L/2, 3L/2]
    next_n: Annotated[tuple[NextN, ...], Field(min_length=1)] = (1, 2, 4)
    fp8_dtype: Fp8Dtype | None = None  # default: the platform's
    tokens: Positives = (64, 512, 16384)  # token counts for indexer_q_quant
    k: Positives = (2048,)  # keys kept per token, for topk


class Cluster(Strict):
    description: str = ""
    match: ClusterMatch | None = None
    enable: NameList = ()  # backends the registry disables by default, switched on here
    disable: NameList = ()  # backends this cluster must never use
    prefer: NameList = ()  # tried, in order, before the measured order and the rules (each only where it supports the key)
    workload: Workload | None = None  # what `tune` measures for this cluster (default: Workload())
    measured: Annotated[str, Field(min_length=1)] | None = None  # an overlay `tune` wrote, relative to the registry file


ClusterName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]


class Registry(Strict):
    version: Literal[1]
    disabled: NameList = ()  # off unless a cluster enables them (experimental paths)
    ops: dict[Op, OpTable]
    clusters: dict[ClusterName, Cluster] = {}

    def table(self, op: Op) -> OpTable:
        return self.ops.get(op, OpTable())

