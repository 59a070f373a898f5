"""The dispatcher: for an (op, key), the one decision, from the registry's ordered rules.

Order of consideration: the cluster's `prefer` list, then the cluster's measured order for the key
(the overlay `python -m dispatch tune` wrote, fastest first, only backends that passed the check),
then the first rule whose `when` matches the key (its `use` list in order), then the op's fallback
chain. Where the overlay measured the key at several batch sizes and the caller declares the batch's
size (`decide(op, key, batch_size=B)`, as a plan does), the measured order is that batch size's band
(dispatch/registry/measured_bands.py), and where that band has length sub-bands and the caller also
declares the batch's max_seq_len (`decide(..., batch_size=B, max_seq_len=L)`, as build_plan does), the
sub-band's; the prefer list, disabled backends and pinning are unchanged.
A candidate is eligible when it is not disabled, supports the key and (when checked) is available on
this machine. The first eligible candidate wins; every other registered backend of the
op is listed with the reason it lost (a measured one: "measured slower: 202.6 us vs 161.9 us", or
in a band "measured slower at B=8: 17.1 us vs 12.2 us"; one within MEASURED_TIE of the chosen one,
"measured level", since the rules' order broke the tie).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from dispatch.contract.backend import Backend
from dispatch.contract.catalog import Catalog
from dispatch.contract.decision import Decision, Evidence, Rejection
from dispatch.contract.errors import InvalidBatchError, NoBackendError
from dispatch.contract.key import Arch, DispatchKey, Op
from dispatch.registry.document import RegistryDocument
from dispatch.registry.measured import MEASURED_TIE
from dispatch.registry.measured_bands import band_index, band_label, batch_size_of, length_label

logger = logging.getLogger("dispatch")
# The torch reference's plugin: correct everywhere, and slower than the GPU kernels the registry prefers.
REFERENCE_PLUGIN = "backends.reference.plugin"
_warned_reference: set[tuple[Op, Arch]] = set()  # once per process, not once per dispatcher or reload
_PLAN_CACHE_ENTRIES = 4096  # decide_ops' (ops, key, batch size) entries: every batch size an engine runs


@dataclass(frozen=True)
class _Step:
    backend: str
    rule: str
    source: str
    label: str  # how explain names the step: "rule `x`", "cluster `c` prefer", "fallback[1]"
    location: tuple  # where registry.yaml says it: ("ops", op, "rules", i), ("clusters", c, "prefer", i), ...
    where: str = ""  # "file:line" when a measured overlay, not registry.yaml, says it


def _band_at(band: int | None, length: int | None) -> tuple:
    """Where in a preference the order a decision rests on is: the key's, a band's, or its sub-band's."""
    if band is None:
        return ()
    return ("bands", band) + (("lengths", length) if length is not None else ())


def served_label(preference, band: int, length: int | None) -> str:
    """The batches a band (and sub-band) serves: "8 < B <= 32", "B <= 32, rows <= 12K"."""
    label = band_label(preference.bounds, band)
    if length is None:
        return label
    return f"{label}, {length_label(preference.bands[band].length_bounds, length)}"


class Dispatcher:
    def __init__(
        self,
        document: RegistryDocument,
        catalog: Catalog,
        *,
        cluster: str | None,
        target_arch: Arch,
        check_availability: bool = True,
    ) -> None:
        """`target_arch` is the arch decisions are made for: this machine's, or another in a what-if
        (then `check_availability` is normally off, since this machine's availability says nothing)."""
        self.document = document
        self.catalog = catalog
        self.cluster = cluster
        self.target_arch = target_arch
        self.check_availability = check_availability
        self._disabled = self._disabled_backends()
        self._measured = document.measured.get(cluster) if cluster is not None else None
        self._bounds = self._band_bounds()
        self._cache: dict[tuple[Op, DispatchKey, int | None, int | None], Decision] = {}  # (op, key, band, sub-band)
        # (ops, key, batch size) -> (each op's sub-band bounds, {sub-bands: decisions}): decide_ops'
        self._plan_cache: dict[tuple, tuple[tuple | None, dict[tuple | None, Mapping[Op, Decision]]]] = {}
        self._lock = threading.Lock()
        self._fingerprint: str | None = None

    @property
    def fingerprint(self) -> str:
        """The document's fingerprint, hashed once: every decision carries it, and hashing the whole
        registry cost a pinned plan ~0.9 ms a batch (the rules' decisions are cached, a pin is not).
        A dispatcher's decisions are its document's when made; a reload builds a new dispatcher."""
        if self._fingerprint is None:
            self._fingerprint = self.document.fingerprint
        return self._fingerprint

    def decide(self, op: Op | str, key: DispatchKey, *, batch_size: int | None = None,
               max_seq_len: int | None = None) -> Decision:
        """The decision for `key`, for a batch of `batch_size` requests when the caller declares it
        (None: the key's own measured order) and, with both, of at most `max_seq_len` keys a request
        (the batch's declared bound, which picks a length sub-band inside the batch-size band; None: the
        band's own order); computed once per (op, key, band, sub-band), then cached."""
        op = op if type(op) is Op else Op(op)  # every plan asks: an Op is taken as it is
        band = length = None
        if batch_size is not None:
            # Checked without a call (a plan asks per op and batch): a host int, bool refused.
            if batch_size.__class__ is not int or batch_size < 1:
                raise InvalidBatchError(f"decide: `batch_size` is {batch_size!r}; expected a host int >= 1, "
                                        "the batch's declared request count")
            if max_seq_len is not None and (max_seq_len.__class__ is not int or max_seq_len < 1):
                raise InvalidBatchError(f"decide: `max_seq_len` is {max_seq_len!r}; expected a host int >= 1, "
                                        "the batch's declared bound on its longest request")
            if self._bounds:  # (no lookup at all where the overlay has no bands)
                band, length = self._band_of(op, key, batch_size, max_seq_len)
        cached = self._cache.get((op, key, band, length))
        if cached is not None:
            return cached
        with self._lock:
            cached = self._cache.get((op, key, band, length))
            if cached is None:
                cached = self._decide(op, key, band, length)
                self._cache[(op, key, band, length)] = cached
                self._log(cached)
                self._warn_if_reference_on_a_gpu(cached)
        return cached

    def decide_ops(self, ops: tuple[Op, ...], key: DispatchKey, *, batch_size: int | None = None,
                   max_seq_len: int | None = None) -> Mapping[Op, Decision]:
        """decide(op, key, batch_size=..., max_seq_len=...) for each of `ops`, as one read-only mapping,
        cached per (ops, key, batch size, the length sub-bands it falls in): a plan asks for all its ops
        every batch, on the engine's critical path, and one lookup costs the host a third of three (the
        decisions are the same objects decide caches)."""
        # (Ints only: True hashes as 1, and decide refuses a bool or a bound < 1; a new or refused
        # call goes to decide, so a refusal is never served from the cache.)
        cacheable = (batch_size is None or batch_size.__class__ is int) and (
            max_seq_len is None or (max_seq_len.__class__ is int and max_seq_len >= 1))
        if not cacheable:
            return self._decided_ops(ops, key, batch_size, max_seq_len)
        # Per (ops, key, batch size): each op's length sub-band bounds in its band, found once, and the
        # decisions per sub-band tuple; a batch then costs one lookup and a bisect per op with sub-bands.
        by_size = self._plan_cache.get((ops, key, batch_size))
        if by_size is None:
            if len(self._plan_cache) >= _PLAN_CACHE_ENTRIES:  # sizes are many; decide caches too
                return self._decided_ops(ops, key, batch_size, max_seq_len)
            by_size = self._plan_cache[(ops, key, batch_size)] = (self._length_bounds(ops, key, batch_size), {})
        bounds, decided = by_size
        sub_bands = None if bounds is None or max_seq_len is None else tuple(
            band_index(lengths, max_seq_len) if lengths else None for lengths in bounds)
        cached = decided.get(sub_bands)
        if cached is None:
            cached = decided[sub_bands] = self._decided_ops(ops, key, batch_size, max_seq_len)
        return cached

    def _decided_ops(self, ops: tuple[Op, ...], key: DispatchKey, batch_size: int | None,
                     max_seq_len: int | None) -> Mapping[Op, Decision]:
        return MappingProxyType({op: self.decide(op, key, batch_size=batch_size, max_seq_len=max_seq_len)
                                 for op in ops})

    def _length_bounds(self, ops: tuple[Op, ...], key: DispatchKey,
                       batch_size: int | None) -> tuple[tuple[int, ...], ...] | None:
        """Each op's length sub-band bounds inside the band serving `batch_size` (() where it has none),
        or None where no length can matter: a batch's many lengths then share one decision."""
        if batch_size is None or not self._bounds:
            return None
        found = tuple(self.band_lengths(op, key, batch_size) for op in ops)
        return found if any(found) else None

    def _band_of(self, op: Op, key: DispatchKey, batch_size: int,
                 max_seq_len: int | None) -> tuple[int | None, int | None]:
        """(band, length sub-band) of (op, key) serving a batch of `batch_size` requests of at most
        `max_seq_len` keys: None where the overlay has no bands for the key, or the band no sub-bands
        (or no length is declared)."""
        bounds = self._bounds.get((op, key))
        if bounds is None:
            return None, None
        band = band_index(bounds[0], batch_size)
        lengths = bounds[1][band]
        return band, (band_index(lengths, max_seq_len) if lengths and max_seq_len is not None else None)

    def band_sizes(self, op: Op | str, key: DispatchKey) -> tuple[int, ...]:
        """The measured batch sizes whose bands order (op, key), ascending; empty when the overlay has
        one order for the key. Deciding at each covers every decision the key can have, but for the
        length sub-bands inside a band (band_lengths)."""
        bounds = self._bounds.get((Op(op), key))
        return bounds[0] if bounds else ()

    def band_lengths(self, op: Op | str, key: DispatchKey, batch_size: int) -> tuple[int, ...]:
        """The `max_seq_len_up_to` bounds of the length sub-bands inside the band serving `batch_size`,
        ascending; empty where that band has none."""
        bounds = self._bounds.get((Op(op), key))
        return bounds[1][band_index(bounds[0], batch_size)] if bounds else ()

    def _band_bounds(self) -> dict[tuple[Op, DispatchKey], tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]]:
        if self._measured is None:
            return {}
        preferences = self._measured.overlay.ops
        found = {}
        for (op, key), position in self._measured.index.items():
            preference = preferences[op].preferences[position]
            if preference.bands:
                found[(op, key)] = (preference.bounds, tuple(band.length_bounds for band in preference.bands))
        return found

    def can_decide(self, op: Op, key: DispatchKey) -> bool:
        """Whether `decide` would find a backend, without caching or logging a decision (a reload's
        coverage check asks this of every kind of key)."""
        op = Op(op)
        # _decide's choice without its rejections and messages: a step whose backend is eligible.
        # (validate asks this of every key and cluster, so it must stay cheap.)
        return any(
            (backend := self.catalog.get(op, step.backend)) is not None and not self._why_ineligible(backend, key)
            for step in self._steps(op, key)
        )

    def decided_keys(self) -> list[tuple[Op, DispatchKey]]:
        """The (op, key) pairs decided so far (for any batch size), from the cache."""
        return list(dict.fromkeys((op, key) for op, key, *_ in self._cache))

    def pin(self, op: Op | str, key: DispatchKey, backend: str, *, allow_disabled: bool = False) -> Decision:
        """A decision naming `backend` outright (a benchmark, or an engine flag forcing a path). It is
        still tagged and checked: an unknown, unsupported or unavailable backend is refused, and so is
        a disabled one unless `allow_disabled` (a benchmark comparing every path that can run)."""
        op = Op(op)
        impl = self.catalog.get(op, backend)
        if impl is None:
            raise NoBackendError(f"no backend `{backend}` for {op.value} (registered: {', '.join(self.catalog.names(op))})")
        reason = self._why_ineligible(impl, key, respect_disabled=not allow_disabled)
        if reason:
            raise NoBackendError(f"backend `{backend}` cannot serve {op.value} at {key}: {reason}")
        return self._decision(op, key, impl, _Step(backend, "pinned", "pinned", "pinned", ()), (), None, None)

    def eligible(self, op: Op | str, key: DispatchKey, *, respect_disabled: bool = True) -> list[Backend]:
        """Every registered backend of `op` that could serve `key` here (what a benchmark compares),
        by the same test the decision uses; `respect_disabled=False` includes disabled ones."""
        op = Op(op)
        return [
            b for b in self.catalog.for_op(op) if not self._why_ineligible(b, key, respect_disabled=respect_disabled)
        ]

    def _decide(self, op: Op, key: DispatchKey, band: int | None, length: int | None = None) -> Decision:
        candidates = self.catalog.for_op(op)
        ineligible = {b.name: reason for b in candidates if (reason := self._why_ineligible(b, key))}
        steps = self._steps(op, key, band, length)
        chosen = next((s for s in steps if s.backend not in ineligible), None)
        named_at = {}
        for step in steps:
            named_at.setdefault(step.backend, step)
        unnamed = "eligible, but no cluster preference, matching rule or fallback names it"
        if chosen is None:
            lines = [
                f"  {b.name}: "
                + (self._explained(ineligible[b.name], named_at.get(b.name)) if b.name in ineligible else unnamed)
                for b in candidates
            ]
            raise NoBackendError(f"no backend for {op.value} at {key}:\n" + "\n".join(lines))
        measured = self._measured_preference(op, key)
        failed = measured[1].failed if measured else {}
        rejected = []
        for backend in candidates:
            if backend.name == chosen.backend:
                continue
            if backend.name in ineligible:
                reason = self._explained(ineligible[backend.name], named_at.get(backend.name))
            elif backend.name in failed:
                reason = f"failed the check against the reference when measured: {failed[backend.name]}"
            elif backend.name in named_at and chosen.source == named_at[backend.name].source == "measured":
                reason = self._measured_slower(measured[1], band, length, backend.name, chosen.backend)
            elif backend.name in named_at:
                reason = self._lost_to(chosen, named_at[backend.name])
            else:
                reason = unnamed
            rejected.append(Rejection(backend.name, reason))
        impl = self.catalog.get(op, chosen.backend)
        return self._decision(op, key, impl, chosen, tuple(rejected), band, length)

    def _decision(self, op: Op, key: DispatchKey, impl: Backend, step: _Step, rejected: tuple[Rejection, ...],
                  band: int | None, length: int | None) -> Decision:
        line = self.document.line_of(step.location) if step.location else None
        measured = self._measured_preference(op, key) if step.source == "measured" else None
        band = band if measured else None  # a band names the measured order only, not what came before it
        length = length if band is not None else None
        return Decision(
            op=op,
            key=key,
            backend=impl.name,
            layout=impl.layout,
            rule=step.rule,
            source=step.source,
            rule_at=step.where or (self.document.where_of(step.location) if line else ""),
            evidence=self._evidence(op, *measured, band, length) if measured else None,
            band=served_label(measured[1], band, length) if band is not None else "",
            cluster=self.cluster,
            plugin=impl.plugin,
            rejected=rejected,
            registry_fingerprint=self.fingerprint,
            availability_checked=self.check_availability,
            impl=impl,
        )

    def _steps(self, op: Op, key: DispatchKey, band: int | None = None, length: int | None = None) -> list[_Step]:
        steps = []
        if self.cluster is not None:
            for index, name in enumerate(self.document.registry.clusters[self.cluster].prefer):
                label = f"cluster `{self.cluster}` prefer[{index}]"
                location = ("clusters", self.cluster, "prefer", index)
                steps.append(_Step(name, f"prefer[{index}]", "cluster-prefer", label, location))
        measured = self._measured_preference(op, key)
        if measured is not None:
            position, preference = measured
            at = ("ops", op.value, "preferences", position) + _band_at(band, length)
            order = preference.measured_at(band, length)[0]
            label = f"cluster `{self.cluster}` measured"
            if band is not None:
                label += f" for {served_label(preference, band, length)}"
            for index, name in enumerate(order):
                where = self._measured.where(at + ("order", index))
                steps.append(_Step(name, f"measured[{index}]", "measured", label, (), where))
        table = self.document.registry.table(op)
        index = table.first_match(key)
        if index is not None:
            rule, location = table.rules[index], ("ops", op.value, "rules", index)
            steps += [_Step(name, rule.id, "rule", f"rule `{rule.id}`", location) for name in rule.use]
        steps += [
            _Step(name, f"fallback[{i}]", "fallback", f"fallback[{i}]", ("ops", op.value, "fallback", i))
            for i, name in enumerate(table.fallback)
        ]
        # Any of them may name a backend whose plugin is not loaded here (an allowlist, a catalog of one's
        # own, a cluster's or an overlay's name): it is skipped, never chosen.
        return [step for step in steps if self.catalog.get(op, step.backend) is not None]

    def _measured_preference(self, op: Op, key: DispatchKey):
        """(position, Preference) the cluster's measured overlay holds for (op, key), or None."""
        return self._measured.find(op, key) if self._measured is not None else None

    def _evidence(self, op: Op, position: int, preference, band: int | None, length: int | None = None) -> Evidence:
        """The times the order rests on: the key's shapes, in a band that batch size's shapes, in a
        length sub-band those of its mean length."""
        overlay = self._measured.overlay
        at = ("ops", op.value, "preferences", position) + _band_at(band, length)
        order, shapes, mean = preference.measured_at(band, length)
        ranked_by = preference.ranked_by_at(band, length)

        def times(shape) -> tuple[tuple[str, float], ...]:
            return tuple((name, shape.median_us[name]) for name in order)

        step = {}
        if ranked_by == "step":  # the op's own times and the step's other backends beside the step's times
            step = dict(alone=tuple((s.shape, times(s)) for s in preference.alone_at(band, length)),
                        stages=tuple((s.shape, tuple((op.value, name) for op, name in s.stages.items())) for s in shapes))
        sizes = {batch_size_of(s.shape) for s in shapes}
        return Evidence(
            machine=overlay.machine,
            date=overlay.date.isoformat(),
            at=self._measured.where(at),
            means=tuple((name, round(mean(name), 3)) for name in order),
            shapes=tuple((s.shape, times(s)) for s in shapes),
            failed=tuple(sorted(preference.failed.items())),
            ranked_by=ranked_by,
            batch_size=sizes.pop() if len(sizes) == 1 else None,
            timing=preference.timing or "",
            timed_eagerly=tuple(sorted(preference.timed_eagerly.items())),
            **step,
        )

    @staticmethod
    def _measured_slower(preference, band: int | None, length: int | None, backend: str, chosen: str) -> str:
        _, shapes, mean = preference.measured_at(band, length)
        where = " in the step" if preference.ranked_by_at(band, length) == "step" else ""
        at = where + ("" if band is None else f" at B={preference.bands[band].batch_size_up_to}")
        if length is not None:
            at += f", {length_label(preference.bands[band].length_bounds, length)}"
        over = "" if len(shapes) == 1 else f", geometric mean over {len(shapes)} shapes"
        if mean(backend) <= mean(chosen) * (1 + MEASURED_TIE):  # a tie, this one perhaps a hair faster
            return (f"measured level{at}: {mean(backend):.1f} us vs {mean(chosen):.1f} us ({chosen}{over}), within "
                    f"{MEASURED_TIE:.0%}, where the rules' order puts {chosen} first")
        return f"measured slower{at}: {mean(backend):.1f} us vs {mean(chosen):.1f} us ({chosen}{over})"

    def _why_ineligible(self, backend: Backend, key: DispatchKey, *, respect_disabled: bool = True) -> str | None:
        if respect_disabled and backend.name in self._disabled:
            return self._disabled[backend.name]
        unsupported = backend.why_unsupported(key)
        if unsupported:
            return unsupported
        if self.check_availability:
            availability = backend.availability()
            if not availability.ok:
                return f"not available here: {availability.reason}"
        return None

    @staticmethod
    def _lost_to(chosen: _Step, later: _Step) -> str:
        if later.label == chosen.label:
            return f"eligible, but {chosen.label} lists `{chosen.backend}` before it"
        return f"eligible, but {chosen.label} (`{chosen.backend}`) comes before {later.label}"

    @staticmethod
    def _explained(reason: str, step: _Step | None) -> str:
        return f"{step.label} names it, but {reason}" if step else reason

    def _disabled_backends(self) -> dict[str, str]:
        registry = self.document.registry
        disabled = {name: "disabled by the registry's `disabled` list" for name in registry.disabled}
        if self.cluster is not None:
            overlay = registry.clusters[self.cluster]
            for name in overlay.enable:
                disabled.pop(name, None)
            for name in overlay.disable:
                disabled[name] = f"disabled by cluster `{self.cluster}`"
        return disabled

    def _warn_if_reference_on_a_gpu(self, decision: Decision) -> None:
        """A GPU that lands on the torch reference, because no rule had a GPU path for the key or the
        backends its rule named could not run, is slower than the registry meant: say so, and why, once.
        A reference the registry chose on purpose (a rule or a cluster naming it first) stays quiet."""
        if not self.check_availability or self.target_arch is Arch.CPU or decision.plugin != REFERENCE_PLUGIN:
            return  # a what-if describes another machine; on a CPU the reference is the fast path
        named = [r for r in decision.rejected if " names it, but " in r.reason]  # what the registry tried first
        if decision.source == "cluster-prefer" or (decision.source == "rule" and not named):
            return
        if (decision.op, self.target_arch) in _warned_reference:
            return
        _warned_reference.add((decision.op, self.target_arch))
        logger.warning(
            "%s on this %s GPU runs on the torch reference `%s`, chosen by %s at %s, not on a GPU kernel "
            "backend: %s (python -m dispatch explain shows every candidate)",
            decision.op.value,
            self.target_arch.value,
            decision.backend,
            decision.chosen_by,
            decision.key,
            "; ".join(f"{r.backend}: {r.reason}" for r in named or decision.rejected) or "none is registered",
        )

    def _log(self, decision: Decision) -> None:
        others = ", ".join(r.backend for r in decision.rejected)
        logger.info(
            "using %s (%s, by %s) for %s at %s out of [%s]",
            decision.backend,
            decision.layout.value,
            decision.chosen_by,  # "rule `x`", "fallback[1]": the source said once
            decision.op.value,
            decision.key,
            others,
        )
        if os.environ.get("DISPATCH_TRACE") == "1":
            logger.info("dispatch trace: %s", decision.as_dict())
