"""Rendering decisions and backends for people. Nothing here decides: it prints Decision values.

    from dispatch.cli.explain import explain
    explanation = explain(load_dispatcher(arch="sm90"), DispatchKey("sm90", "target_verify", 4, "e4m3fn"))
    explain(dispatcher, key, batch_size=32)  # the measured band of a batch of 32 requests, where there are bands
    explain(dispatcher, key, batch_size=32, max_seq_len=12288)  # and its length sub-band, where it has them
    print(explanation.text())          # what `python -m dispatch explain` prints
    explanation.as_dict()              # what `python -m dispatch explain --json` prints
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dispatch.contract.backend import Backend
from dispatch.contract.decision import Decision
from dispatch.contract.errors import InvalidBatchError
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.key import DispatchKey, Op
from dispatch.registry.measured_bands import band_label, length_label

if TYPE_CHECKING:
    from dispatch.step.paged_plan import PagedPlan


@dataclass(frozen=True)
class BandChoice:
    """What one measured batch-size band of a key decides (or, with `max_seq_len_up_to`, one length
    sub-band inside it), listed when no batch size (or no max_seq_len) was given."""

    batch_size_up_to: int
    serves: str  # "B <= 8", "8 < B <= 32", "B > 32"; a sub-band's "rows <= 12K", "rows > 12K"
    decision: Decision
    lengths: tuple["BandChoice", ...] = ()  # the band's length sub-bands' choices, where it has them
    max_seq_len_up_to: int | None = None  # a sub-band's bound

    def as_dict(self) -> dict[str, Any]:
        d = self.decision
        bound = {"max_seq_len_up_to": self.max_seq_len_up_to} if self.max_seq_len_up_to is not None else {}
        return {"batch_size_up_to": self.batch_size_up_to, **bound, "serves": self.serves, "backend": d.backend,
                "layout": d.layout.value, "rule": d.rule, "source": d.source,
                **({"lengths": [sub.as_dict() for sub in self.lengths]} if self.lengths else {})}

    def text(self) -> str:
        subs = f" ({', '.join(sub.text() for sub in self.lengths)})" if self.lengths else ""
        return f"{self.serves}: {self.decision.backend}{subs}"


@dataclass(frozen=True)
class Explanation:
    """The decisions for a key, and with seq_lens the plan an engine would build for that batch; without
    a batch size, each op's measured bands' choices (by op), where its overlay has bands; with one but no
    max_seq_len, the choices of that band's length sub-bands, where it has them."""

    dispatcher: Dispatcher
    decisions: tuple[Decision, ...]
    plan: "PagedPlan | None" = None
    bands: tuple[tuple[Op, tuple[BandChoice, ...]], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """{"decisions": [decision, ...], "plan": {...} or null}: one shape for one op, all ops, or a batch.
        A decision whose key has measured bands, explained without a batch size, also lists `bands`."""
        plan = None
        if self.plan is not None:
            plan = {key: value for key, value in self.plan.as_dict().items() if key != "decisions"}
            plan |= {"context_lens": self.plan.context_lens.tolist(), "block_table": self.plan.block_table.tolist()}
        bands = dict(self.bands)
        decisions = [decision.as_dict() | _listed(bands.get(decision.op, ())) for decision in self.decisions]
        return {"decisions": decisions, "plan": plan}

    def text(self) -> str:
        parts = []
        if self.plan is not None:
            plan = self.plan
            parts.append(
                f"plan for B={plan.batch_size}, next_n={plan.next_n}, max_context_len={plan.max_context_len}\n"
                f"  context_lens {list(plan.context_lens.shape)} ({plan.layout.value}): {plan.context_lens.tolist()}\n"
                f"  block_table {list(plan.block_table.shape)}: {plan.block_table.tolist()}"
            )
        bands = dict(self.bands)
        parts += [decision_text(decision, self.dispatcher, bands.get(decision.op, ())) for decision in self.decisions]
        return "\n\n".join(parts)


def explain(
    dispatcher: Dispatcher,
    key: DispatchKey,
    *,
    ops: Iterable[Op | str] = tuple(Op),
    seq_lens: Sequence[int] | None = None,
    batch_size: int | None = None,
    max_seq_len: int | None = None,
) -> Explanation:
    """Decide `ops` for `key`, or with `seq_lens` (each request's total length) build the whole plan for
    that batch on the CPU. `batch_size` (the batch's request count; with seq_lens, their count) picks
    each op's measured batch-size band; without one the key's own order decides and every band's choice
    is listed. `max_seq_len` (with batch_size; with seq_lens, their longest) picks the length sub-band
    inside the band; without it, where the band has sub-bands, each one's choice is listed. Backends are never run: a per-batch `prepare` is skipped, so a what-if for another
    machine needs none of its vendor libraries. Raises InvalidBatchError for lengths that cannot occur
    or a batch size that cannot, NoBackendError when no backend fits."""
    if seq_lens is None:
        decisions = tuple(dispatcher.decide(Op(op), key, batch_size=batch_size, max_seq_len=max_seq_len) for op in ops)
        if batch_size is not None:
            if max_seq_len is not None:
                return Explanation(dispatcher, decisions)
            subs = tuple((d.op, choices) for d in decisions if (choices := length_choices(dispatcher, d.op, key, batch_size)))
            return Explanation(dispatcher, decisions, bands=subs)
        bands = tuple((d.op, choices) for d in decisions if (choices := band_choices(dispatcher, d.op, key)))
        return Explanation(dispatcher, decisions, bands=bands)
    if batch_size is not None and batch_size != len(seq_lens):
        raise InvalidBatchError(f"batch_size {batch_size} with {len(seq_lens)} seq_lens: the lengths give the batch's size")
    from dispatch.step.paged_plan import build_plan

    plan = build_plan(dispatcher, example_batch(seq_lens, key), kv_fp8_dtype=key.fp8_dtype, arch=key.arch, prepare=False)
    return Explanation(dispatcher, tuple(plan.decisions.values()), plan)


def example_batch(seq_lens: Sequence[int], key: DispatchKey):
    """A PagedBatch on the CPU for these lengths: pages numbered in request order."""
    import torch

    from dispatch.contract.paged_cache import page_table_for
    from dispatch.step.paged_plan import PagedBatch

    lengths = list(seq_lens)
    table = page_table_for(lengths)
    return PagedBatch(torch.tensor(lengths, dtype=torch.int32), table, max(lengths, default=0), key.forward_mode, key.next_n)


def band_choices(dispatcher: Dispatcher, op: Op, key: DispatchKey) -> tuple[BandChoice, ...]:
    """Each measured band's decision for (op, key), ascending; empty where the overlay has none (at most
    16: an overlay's bands are bounded like a workload's batch sizes)."""
    sizes = dispatcher.band_sizes(op, key)
    return tuple(
        BandChoice(size, band_label(sizes, index), dispatcher.decide(op, key, batch_size=size),
                   length_choices(dispatcher, op, key, size))
        for index, size in enumerate(sizes)
    )


def length_choices(dispatcher: Dispatcher, op: Op, key: DispatchKey, batch_size: int) -> tuple[BandChoice, ...]:
    """Each length sub-band's decision inside the band serving `batch_size`, ascending; empty where it has none."""
    bounds = dispatcher.band_lengths(op, key, batch_size)
    return tuple(
        BandChoice(batch_size, length_label(bounds, index),
                   dispatcher.decide(op, key, batch_size=batch_size, max_seq_len=bound), max_seq_len_up_to=bound)
        for index, bound in enumerate(bounds)
    )


def decision_text(decision: Decision, dispatcher: Dispatcher, bands: Sequence[BandChoice] = ()) -> str:
    document = dispatcher.document
    lines = [f"{decision.op.value} for {decision.key}"]
    if not decision.availability_checked:
        lines.append("  what-if: availability on this machine was not checked for this key")
    where = f" ({decision.rule_at})" if decision.rule_at else ""
    lines += [
        f"  chosen:   {decision.backend}",
        f"  layout:   {decision.layout.value}: {decision.layout.describe()}",
        f"  by:       {decision.chosen_by}{where}",
        *_by_band(bands),
        f"  plugin:   {decision.plugin} (distribution {decision.impl.distribution} "
        f"{decision.impl.plugin_version or '-'}; library version {decision.impl.version or '-'})",
        f"  cluster:  {decision.cluster or 'none'}",
        *_evidence(decision),
        *_here(decision),
        f"  registry: {document.path} (fingerprint {decision.registry_fingerprint})",
    ]
    if decision.rejected:
        width = max(len(r.backend) for r in decision.rejected)
        lines.append("  rejected:")
        lines += [f"    {r.backend.ljust(width)}  {r.reason}" for r in decision.rejected]
    return "\n".join(lines)


def _listed(bands: Sequence[BandChoice]) -> dict[str, Any]:
    """{"bands": [...]} (each band's choice), {"lengths": [...]} (with a batch size: each sub-band's), or {}."""
    if not bands:
        return {}
    return {"lengths" if bands[0].max_seq_len_up_to is not None else "bands": [b.as_dict() for b in bands]}


def _by_band(bands: Sequence[BandChoice]) -> list[str]:
    """The `by batch:` line (each band's choice, its sub-bands' beside it), or with a batch size given
    the `by length:` line (each sub-band's choice in its band)."""
    if not bands:
        return []
    if bands[0].max_seq_len_up_to is not None:
        return [f"  by length: {'; '.join(b.text() for b in bands)} (--max-seq-len L explains one)"]
    more = " (--batch-size B explains one" + (", with --max-seq-len L a sub-band)" if any(b.lengths for b in bands) else ")")
    return [f"  by batch: {'; '.join(b.text() for b in bands)}{more}"]


def _evidence(decision: Decision) -> list[str]:
    if decision.evidence is None:
        return []
    evidence = decision.evidence
    return [f"  evidence: {evidence.summary()} ({evidence.at})"] + [f"            {line}" for line in evidence.details()]


def _here(decision: Decision) -> list[str]:
    """In a what-if, whether the chosen backend could run on this machine, and why not."""
    if decision.availability_checked:
        return []
    availability = decision.impl.availability()
    return [f"  here:     {'available on this machine' if availability.ok else 'not available on this machine: ' + availability.reason}"]


def backend_row(backend: Backend) -> dict:
    availability = backend.availability()
    return {
        "name": backend.name,
        "op": backend.op.value,
        "layout": backend.layout.value,
        "plugin": backend.plugin,
        "distribution": backend.distribution,
        "plugin_version": backend.plugin_version,
        "version": backend.version,
        "supports": backend.supports.as_dict(),
        "available": availability.ok,
        "reason": availability.reason,
        "description": backend.description,
        "verified": {arch.value: backend.verified_on(arch).value for arch in backend.supports.archs},
    }


def backends_text(rows: list[dict]) -> str:
    out = []
    for row in rows:
        s = row["supports"]
        next_n = f"{s['next_n']['min']}..{s['next_n']['max'] or ''}"
        here = "available here" if row["available"] else f"NOT available here: {row['reason']}"
        out += [
            f"{row['name']}  [{row['op']}, {row['layout']}]",
            f"  plugin {row['plugin']} (distribution {row['distribution']} {row['plugin_version'] or '-'}), "
            f"library version {row['version'] or '-'}",
            f"  supports arch {', '.join(s['archs'])}; modes {', '.join(s['forward_modes'])}; "
            f"next_n {next_n}; fp8 {', '.join(s['fp8_dtypes'])}",
            f"  {here}",
        ]
        if row["description"]:
            out.append(f"  {row['description']}")
        out.append(f"  verified: {_verified_text(row['verified'])}")
    return "\n".join(out)


def _verified_text(verified: dict[str, str]) -> str:
    """{"sm90": "measured on an H200", "cpu": "CPU tests"} as "sm90 measured on an H200; cpu CPU tests",
    archs of one kind together."""
    by_kind: dict[str, list[str]] = {}
    for arch, kind in sorted(verified.items()):
        by_kind.setdefault(kind, []).append(arch)
    return "; ".join(f"{', '.join(archs)}: {kind}" for kind, archs in by_kind.items())
