"""The shape of registry.yaml as frozen pydantic models; unknown fields are rejected.

Validation here is what can be checked from the file alone. Checks that need the registered
backends (unknown names, lint) live in dispatch.registry.checks.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from dispatch.contract.key import FP8_DTYPES_BY_ARCH, Arch, DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.contract.limits import MAX_CLI_BATCH, MAX_CLI_NEXT_N, MAX_CLI_SEQ_LEN, MAX_RULE_NEXT_N, MAX_TUNE_LOGITS_BYTES


def _as_tuple(value: object) -> object:
    """Let a single value stand for a one-element list (`arch: sm90`). A set or a mapping is refused:
    where a list's order decides (use, prefer, fallback...), a YAML `!!set` would follow the hash seed,
    and two ranks reading one file could decide differently."""
    if isinstance(value, (set, frozenset, dict)):
        kind = "a set" if isinstance(value, (set, frozenset)) else "a mapping"
        raise ValueError(f"must be a YAML list such as [a, b], not {kind}: a list's order is part of its meaning")
    return (value,) if isinstance(value, (str, int)) and not isinstance(value, bool) else value


class Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)


def _one_or_many(item: object, *, if_empty: str | None = None) -> object:
    """A list of `item` in which a single value stands for a one-element list; the JSON Schema says so
    too. With `if_empty`, an empty list is refused with that message (and the schema says minItems 1)."""
    listed = list[item] if if_empty is None else Annotated[list[item], Field(min_length=1)]
    parts: list[object] = [BeforeValidator(_as_tuple, json_schema_input_type=item | listed)]
    if if_empty is not None:
        parts.append(AfterValidator(lambda values: _not_empty(values, if_empty)))
    return Annotated[tuple[item, ...], *parts]


def _not_empty(values: tuple, message: str) -> tuple:
    if not values:
        raise ValueError(message)
    return values


# Any non-empty text: whether a backend of that name exists is checked against what plugins registered,
# where a near miss (`Triton`, `tritn`) gets "unknown backend" and the nearest name.
BackendName = Annotated[str, Field(min_length=1)]
NameList = _one_or_many(BackendName)
_MATCHES_NOTHING = "an empty list matches nothing; leave the field out to match any value"
ArchList = _one_or_many(Arch, if_empty=_MATCHES_NOTHING)
ModeList = _one_or_many(ForwardMode, if_empty=_MATCHES_NOTHING)
Fp8DtypeList = _one_or_many(Fp8Dtype, if_empty=_MATCHES_NOTHING)
NextN = Annotated[int, Field(ge=1, le=MAX_RULE_NEXT_N, strict=True)]


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
    use: _one_or_many(BackendName, if_empty="an empty list serves nothing; name at least one backend")
    why: str = ""


class OpTable(Strict):
    # The JSON Schema says what _serves_something checks: non-empty rules or a non-empty fallback.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["rules"], "properties": {"rules": {"minItems": 1}}},
                {"required": ["fallback"], "properties": {"fallback": {"minItems": 1}}},
            ]
        }
    )
    # Rule ids are unique per op; dispatch.registry.document checks that, pointing at the duplicate's line.
    rules: tuple[Rule, ...] = ()
    fallback: NameList = ()

    def first_match(self, key: DispatchKey) -> int | None:
        """The index of the first rule whose `when` matches `key` (rules are tried in order), or None."""
        return next((i for i, rule in enumerate(self.rules) if rule.when.matches(key)), None)

    def named_for(self, key: DispatchKey) -> tuple[str, ...]:
        """The backends the registry alone would try for `key`, in order: the first matching rule's
        `use`, then the fallback."""
        index = self.first_match(key)
        return (self.rules[index].use if index is not None else ()) + self.fallback

    @model_validator(mode="after")
    def _serves_something(self) -> "OpTable":
        if not self.rules and not self.fallback:
            raise ValueError("serves no key: give it rules or a fallback")
        return self


class ClusterMatch(Strict):
    """Declares which machines a cluster is: every given field must match the host."""

    arch: ArchList | None = None
    gpu_name: str | None = None  # shell-style glob over torch.cuda.get_device_name()
    hostname: str | None = None  # shell-style glob over socket.gethostname()


def _bounded(most: int, least: int = 1) -> object:
    """A non-empty list of integers from `least` to `most`: what one machine can measure in minutes.
    (Empty is refused after the items are checked, so a bad item is not also reported as an empty list.)"""
    item = Annotated[int, Field(ge=least, le=most, strict=True)]
    return Annotated[tuple[item, ...], Field(max_length=16), AfterValidator(lambda v: _not_empty(v, "name at least one"))]


class PagedShape(Strict):
    """One paged batch `tune` measures beside the grid: `batch_size` requests of `next_n` tokens each,
    lengths uniform in [length/2, 3*length/2] as a grid shape's (a shape of the issue's table, say,
    that the grid's batch sizes x lengths x next_n does not hold)."""

    batch_size: Annotated[int, Field(ge=1, le=MAX_CLI_BATCH, strict=True)]
    next_n: Annotated[int, Field(ge=1, le=MAX_CLI_NEXT_N, strict=True)]
    length: Annotated[int, Field(ge=1, le=MAX_CLI_SEQ_LEN, strict=True)]  # the mean


class SpreadExtendBatch(Strict):
    """One extend batch `tune` measures beside the grid's, whose requests' prefixes differ: `requests`
    requests of `extend` new tokens each, request i after i * prefix_up_to / (requests - 1) cached keys,
    so the query rows' windows spread from 1 to prefix_up_to + extend (chunked prefill mixes a long
    prefix with new requests; 16 x 256 after 0..15360 gives 4096 rows of windows 1..16K)."""

    requests: Annotated[int, Field(ge=2, le=MAX_CLI_BATCH, strict=True)]  # a spread needs two
    extend: Annotated[int, Field(ge=1, le=MAX_CLI_SEQ_LEN, strict=True)]
    prefix_up_to: Annotated[int, Field(ge=1, le=MAX_CLI_SEQ_LEN, strict=True)]

    def prefixes(self) -> tuple[int, ...]:
        last = self.requests - 1
        return tuple(i * self.prefix_up_to // last for i in range(self.requests))


class Workload(Strict):
    """The shapes `python -m dispatch tune` measures for a cluster. The defaults cover serving
    (README, "Choosing by measurement"); a cluster names only what it changes."""

    batch_sizes: _bounded(MAX_CLI_BATCH) = (1, 8, 32, 128, 256)
    lengths: _bounded(MAX_CLI_SEQ_LEN) = (2048, 8192, 32768, 131072)  # means; each batch uniform in [L/2, 3L/2]
    next_n: _bounded(MAX_CLI_NEXT_N) = (1, 2, 4)
    fp8_dtype: Fp8Dtype | None = None  # default: the platform's
    tokens: _bounded(MAX_CLI_SEQ_LEN) = (64, 512, 16384)  # token counts for indexer_q_quant
    k: _bounded(MAX_CLI_SEQ_LEN) = (2048,)  # keys kept per token, for topk
    # Extend batches, every combination: R requests of E new tokens after P cached keys each,
    # M = R*E query rows over S = R*(P+E) gathered keys (chunked prefill and prefix caching give P > 0).
    extend_requests: _bounded(MAX_CLI_BATCH) = (4,)
    extend_lens: _bounded(MAX_CLI_SEQ_LEN) = (1024, 4096)
    prefix_lens: _bounded(MAX_CLI_SEQ_LEN, least=0) = (0, 12288)
    # Measured in addition to the grids above, by every op that measures a grid shape (each paged op;
    # the top-k at B <= --step-up-to by the step too): the shapes the grid misses, without its product.
    shapes: Annotated[tuple[PagedShape, ...], Field(max_length=16)] = ()
    extend_batches: Annotated[tuple[SpreadExtendBatch, ...], Field(max_length=16)] = ()

    @model_validator(mode="after")
    def _extend_logits_fit(self) -> "Workload":
        # tune scores each extend batch in one chunk (dispatch.contract.limits says why this bound).
        requests, new, cached = max(self.extend_requests), max(self.extend_lens), max(self.prefix_lens)
        size = requests * new * requests * (cached + new) * 4
        if size > MAX_TUNE_LOGITS_BYTES:
            raise ValueError(
                f"the largest extend batch (`extend_requests` {requests}, `extend_lens` {new}, `prefix_lens` "
                f"{cached}) has fp32 logits [M={requests * new}, S={requests * (cached + new)}] of "
                f"{size / 2**30:.1f} GiB, more than the {MAX_TUNE_LOGITS_BYTES >> 30} GiB tune holds per batch"
            )
        return self

    def item_problems(self):
        """(("shapes" or "extend_batches", index), why) for each named item that cannot be measured as
        given: one already in the grid or named twice (two rows under one label: the overlay keys times by
        it), an extend batch too large to score in one chunk. Checked where the registry is read
        (dispatch.registry.document), so each error has its item's own line."""
        grid = {(b, n, length) for b in self.batch_sizes for n in self.next_n for length in self.lengths}
        seen: dict[tuple[int, int, int], int] = {}
        for index, shape in enumerate(self.shapes):
            triple = (shape.batch_size, shape.next_n, shape.length)
            if triple in grid:
                yield ("shapes", index), (f"(B={triple[0]}, next_n={triple[1]}, length={triple[2]}) is in the grid "
                                          "(batch_sizes x next_n x lengths) already: each shape is measured once")
            elif triple in seen:
                yield ("shapes", index), f"repeats shapes[{seen[triple]}]: each shape is measured once"
            seen.setdefault(triple, index)
        spreads: dict[tuple[int, int, int], int] = {}
        for index, batch in enumerate(self.extend_batches):
            spread = (batch.requests, batch.extend, batch.prefix_up_to)
            rows, keys = batch.requests * batch.extend, sum(batch.prefixes()) + batch.requests * batch.extend
            if spread in spreads:
                yield ("extend_batches", index), f"repeats extend_batches[{spreads[spread]}]: each batch is measured once"
            elif rows * keys * 4 > MAX_TUNE_LOGITS_BYTES:
                yield ("extend_batches", index), (
                    f"has fp32 logits [M={rows}, S={keys}] of {rows * keys * 4 / 2**30:.1f} GiB, more than the "
                    f"{MAX_TUNE_LOGITS_BYTES >> 30} GiB tune holds per batch")
            spreads.setdefault(spread, index)

    def paged_next_n(self) -> tuple[int, ...]:
        """Every next_n a paged key is measured at: the grid's, then the named shapes' others."""
        return tuple(dict.fromkeys(self.next_n + tuple(shape.next_n for shape in self.shapes)))


class Cluster(Strict):
    description: str = ""
    match: ClusterMatch | None = None
    enable: NameList = ()  # backends the registry disables by default, switched on here
    disable: NameList = ()  # backends this cluster must never use
    prefer: NameList = ()  # tried, in order, before the measured order and the rules (each where it supports the key)
    workload: Workload | None = None  # what `tune` measures for this cluster (default: Workload())
    measured: Annotated[str, Field(min_length=1, max_length=4096)] | None = None  # `tune`'s overlay, relative to this file


ClusterName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]


class Registry(Strict):
    # An editor's schema reference (`$schema: ./registry.schema.json`); not part of the meaning.
    schema_ref: str | None = Field(default=None, alias="$schema", exclude=True)
    # `extends: default`: this file holds only what differs from the packaged registry
    # (dispatch.registry.extends merges it before validation; a merged file means what a full copy means).
    extends: Literal["default"] | None = Field(default=None, exclude=True)
    version: Literal[1]
    disabled: NameList = ()  # off unless a cluster enables them (experimental paths)
    ops: Annotated[dict[Op, OpTable], Field(json_schema_extra={"required": [op.value for op in Op]})]
    clusters: dict[ClusterName, Cluster] = {}

    @field_validator("ops")
    @classmethod
    def _every_op(cls, ops: dict[Op, OpTable]) -> dict[Op, OpTable]:
        # A plan decides both ops, and a file cut short (written in place, torn) most often loses the
        # ops at its end: a registry declares every op, so a missing one is an error, not a gap.
        missing = [op.value for op in Op if op not in ops]
        if missing:
            every = ", ".join(o.value for o in Op)
            raise ValueError(f"missing {', '.join(missing)}: a registry declares every op ({every})")
        return ops

    def table(self, op: Op) -> OpTable:
        return self.ops[op]  # every op is declared (checked at load)

