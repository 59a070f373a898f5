"""A measured overlay: the order of backends `python -m dispatch tune` chose per (op, key) on one
machine, with its evidence (each candidate's median time per shape, the machine, the date and the
versions). A cluster includes one with `measured: <path>` (relative to the registry file). It is read
with the registry's own loader, so its errors name file, line and key in the same way.

The order is fastest first (ties within MEASURED_TIE in the registry's order) by the geometric mean of
each backend's median times over the key's shapes: every shape weighs the same whatever its size, and
it orders backends exactly as the geometric mean of their time ratios to the fastest at each shape
would. Where the shapes name several batch sizes, a preference may also carry `bands`: the same rule
over each batch size's shapes alone (dispatch/registry/measured_bands.py says which batches each serves).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, model_validator

from dispatch.contract.errors import RegistryError
from dispatch.contract.key import Arch, DispatchKey, Fp8Dtype, Op
from dispatch.contract.limits import cut
from dispatch.registry.reading import (
    END_MARKER,
    Location,
    deepest_line,
    dotted,
    errors_in_file_order,
    is_sealed,
    read_bounded,
    safe_load_with_lines,
    validation_problems,
)
from dispatch.registry.measured_bands import Band, RankedBy, batch_size_of, length_bound, length_label, mean_len_of
from dispatch.registry.models import BackendName, ClusterName, ModeList, NameList, NextN, Strict, Workload
from dispatch.contract.version import dispatch_version, release_of

Micros = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class MeasuredKey(Strict):
    """The keys one measurement serves: exact values, forward modes listed when one shape serves
    several (target_verify and draft_extend hand the kernels the same tensors at one next_n)."""

    arch: Arch
    forward_mode: ModeList
    next_n: NextN
    fp8_dtype: Fp8Dtype

    @model_validator(mode="after")
    def _can_occur(self) -> "MeasuredKey":
        self.keys()  # InvalidKeyError is a ValueError: reported at this key's line
        return self

    def keys(self) -> tuple[DispatchKey, ...]:
        return tuple(DispatchKey(self.arch, mode, self.next_n, self.fp8_dtype) for mode in self.forward_mode)


# Geometric means within 1% are one time (run-to-run spread on the H200 is ~0.5-1%): tune keeps such
# backends in the registry's order, and this check lets it.
MEASURED_TIE = 0.01


class ShapeTimes(Strict):
    shape: Annotated[str, Field(min_length=1)]
    median_us: dict[BackendName, Micros]


class StepShapeTimes(ShapeTimes):
    """The whole step's median time at one of the preference's shapes with each of the op's candidates
    in turn, the step's other ops fixed to `stages` (what was decided for the key at that batch size)."""

    stages: dict[Op, BackendName] = {}


# How the times were taken (dispatch.bench.timing): "graph", replays of a captured CUDA graph (the
# device's time); "eager", each call launched from Python (the host clock on a CPU).
Timing = Literal["graph", "eager"]


class Preference(Strict):
    key: MeasuredKey
    order: NameList  # fastest first; only backends that passed the check
    ranked_by: RankedBy = "op"  # "step": `order` is by step_shapes (which then time every shape)
    # One order per measured batch size, ascending (checked with the file's lines in _band_problems).
    bands: Annotated[tuple[Band, ...], Field(max_length=16)] = ()
    shapes: tuple[ShapeTimes, ...]  # the op alone
    step_shapes: tuple[StepShapeTimes, ...] = ()  # the whole step, where an order is ranked by it
    timing: Timing | None = None  # None: an overlay from before 2026-12-02, which did not say
    timed_eagerly: dict[BackendName, str] = {}  # with timing graph: a backend no graph could capture, where
    failed: dict[BackendName, str] = {}  # backend -> why its output differed from the reference

    @model_validator(mode="after")
    def _consistent(self) -> "Preference":
        if not self.order or not self.shapes:
            raise ValueError("a preference needs at least one backend in `order` and one shape")
        if len(set(self.order)) != len(self.order):
            raise ValueError(f"`order` names a backend twice: {', '.join(self.order)}")
        for shape in self.shapes:
            if set(shape.median_us) != set(self.order):
                raise ValueError(
                    f"shape `{shape.shape}` times {_ticks(sorted(shape.median_us))} but `order` lists "
                    f"{_ticks(self.order)}; every ordered backend needs a time at every shape"
                )
        both = sorted(set(self.failed) & set(self.order))
        if both:
            raise ValueError(f"{_ticks(both)} failed the check and cannot be in `order`")
        self._step_shapes_consistent()
        unknown = sorted(set(self.timed_eagerly) - set(self.order) - set(self.failed))
        if unknown:
            raise ValueError(f"`timed_eagerly` names {_ticks(unknown)}, which this key did not measure")
        problem = out_of_order(self.order, self.mean_us)
        if problem:
            raise ValueError(f"`order` {problem}" + (" in the step" if self.ranked_by == "step" else ""))
        return self

    def _step_shapes_consistent(self) -> None:
        labels = [shape.shape for shape in self.shapes]
        stepped = [shape.shape for shape in self.step_shapes]
        for shape in self.step_shapes:
            if set(shape.median_us) != set(self.order):
                raise ValueError(
                    f"step shape `{shape.shape}` times {_ticks(sorted(shape.median_us))} but `order` lists "
                    f"{_ticks(self.order)}; every ordered backend needs a step time at every step shape"
                )
            if shape.shape not in labels:
                raise ValueError(f"step shape `{shape.shape}` is not one of `shapes`: the step is timed where the op is")
        if len(set(stepped)) != len(stepped):
            raise ValueError("`step_shapes` names a shape twice")
        if self.ranked_by == "step" and set(stepped) != set(labels):
            raise ValueError("`ranked_by: step` orders the key by the step's times, so `step_shapes` needs every "
                             f"shape; it lacks {_ticks(sorted(set(labels) - set(stepped)))}")
        if self.step_shapes and self.ranked_by == "op" and not self.bands:
            raise ValueError("`step_shapes` without an order ranked by them: `ranked_by: step` on the key or on a band")

    @property
    def ranking_shapes(self) -> tuple[ShapeTimes, ...]:
        """The shapes the key's own order is by: the step's where it is ranked by the step."""
        return self.step_shapes if self.ranked_by == "step" else self.shapes

    def mean_us(self, backend: str) -> float:
        """Geometric mean of `backend`'s median times over the shapes this key's order is by."""
        return geometric_mean([shape.median_us[backend] for shape in self.ranking_shapes])

    @property
    def bounds(self) -> tuple[int, ...]:
        """The bands' `batch_size_up_to`, ascending (empty without bands)."""
        return tuple(band.batch_size_up_to for band in self.bands)

    def band_shapes(self, index: int, length: int | None = None) -> tuple[ShapeTimes, ...]:
        """The shapes measured at band `index`'s batch size (and, with `length`, at its length sub-band's
        mean length), which its order is by (the step's, where the band is ranked by the step)."""
        return self._in_band(self.step_shapes if self.bands[index].ranked_by == "step" else self.shapes, index, length)

    def _in_band(self, shapes: tuple[ShapeTimes, ...], index: int, length: int | None) -> tuple[ShapeTimes, ...]:
        """Those of `shapes` at band `index`'s batch size (and, with `length`, its sub-band's mean length)."""
        band = self.bands[index]
        shapes = _at_size(shapes, band.batch_size_up_to)
        return shapes if length is None else _at_length(shapes, band.lengths[length].max_seq_len_up_to)

    def band_mean_us(self, index: int, backend: str, length: int | None = None) -> float:
        """Geometric mean of `backend`'s median times over band `index`'s shapes (or its sub-band's)."""
        return geometric_mean([shape.median_us[backend] for shape in self.band_shapes(index, length)])

    def measured_at(self, band: int | None, length: int | None = None
                    ) -> tuple[tuple[str, ...], tuple[ShapeTimes, ...], Callable[[str], float]]:
        """(order, shapes, mean_us) a decision rests on: the key's own (band None), band `band`'s, or
        its length sub-band `length`'s."""
        if band is None:
            return tuple(self.order), self.ranking_shapes, self.mean_us
        chosen = self.bands[band] if length is None else self.bands[band].lengths[length]
        return (tuple(chosen.order), self.band_shapes(band, length),
                functools.partial(self._mean_at, band, length))

    def _mean_at(self, band: int, length: int | None, backend: str) -> float:
        return self.band_mean_us(band, backend, length)

    def ranked_by_at(self, band: int | None, length: int | None = None) -> str:
        """"step" where the order a decision rests on (the key's, band `band`'s or its sub-band's) is by
        the whole step."""
        if band is None:
            return self.ranked_by
        return self.bands[band].ranked_by if length is None else self.bands[band].lengths[length].ranked_by

    def alone_at(self, band: int | None, length: int | None = None) -> tuple[ShapeTimes, ...]:
        """The op's own times at the shapes the order a decision rests on is by."""
        return self.shapes if band is None else self._in_band(self.shapes, band, length)


def _at_size(shapes: tuple[ShapeTimes, ...], size: int) -> tuple[ShapeTimes, ...]:
    """The shapes measured at batch size `size`."""
    return tuple(shape for shape in shapes if batch_size_of(shape.shape) == size)


def _at_length(shapes: tuple[ShapeTimes, ...], bound: int) -> tuple[ShapeTimes, ...]:
    """The shapes whose mean length's sub-band bound (3L/2) is `bound`."""
    return tuple(shape for shape in shapes if (length := mean_len_of(shape.shape)) is not None
                 and length_bound(length) == bound)


def out_of_order(order, mean_us) -> str | None:
    """What breaks the measured rule in `order` (fastest first by `mean_us`, ties within MEASURED_TIE
    of the fastest), or None. The tie band is against the fastest of those that follow, not the
    neighbour: each backend may come before a faster one only within MEASURED_TIE of it, so ties cannot
    chain (1% + 1% + ...)."""
    for index, ahead in enumerate(order[:-1]):
        fastest = min(order[index + 1:], key=mean_us)
        if mean_us(ahead) > mean_us(fastest) * (1 + MEASURED_TIE):
            return (
                f"puts `{ahead}` ({mean_us(ahead):.1f} us) before `{fastest}` ({mean_us(fastest):.1f} us); the "
                f"measured order is fastest first, ties within {MEASURED_TIE:.0%} of the fastest (to override a "
                "measurement, use the cluster's `prefer`)"
            )
    return None


def geometric_mean(values: list[float]) -> float:
    """The one aggregate `tune` orders by and the loader checks the order with (a single value exactly)."""
    return values[0] if len(values) == 1 else math.exp(sum(math.log(v) for v in values) / len(values))


class MeasuredOp(Strict):
    versions: dict[BackendName, str] = {}  # each measured backend's Backend.version when measured
    preferences: tuple[Preference, ...] = ()


class MeasuredOverlay(Strict):
    version: Literal[1]
    cluster: ClusterName | None = None  # the cluster it was measured for
    machine: Annotated[str, Field(min_length=1)]  # the GPU's name (torch.cuda.get_device_name), or the CPU's
    date: datetime.date
    dispatch: str  # versions when measured
    torch: str
    triton: str | None = None
    workload: Workload
    ops: dict[Op, MeasuredOp] = {}


@dataclass(frozen=True)
class MeasuredDocument:
    """A validated overlay with where each part came from, and its preferences indexed by key."""

    overlay: MeasuredOverlay
    path: str
    lines: dict[Location, int] = field(repr=False)
    index: dict[tuple[Op, DispatchKey], int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        index = {
            (op, key): position
            for op, table in self.overlay.ops.items()
            for position, preference in enumerate(table.preferences)
            for key in preference.key.keys()
        }
        object.__setattr__(self, "index", index)

    def find(self, op: Op, key: DispatchKey) -> tuple[int, Preference] | None:
        position = self.index.get((op, key))
        return None if position is None else (position, self.overlay.ops[op].preferences[position])

    def where(self, location: Location) -> str:
        line = deepest_line(self.lines, location)
        return f"{self.path}:{line}" if line else self.path


def parse_measured(text: str, path: str = "<measured>") -> MeasuredDocument:
    """An overlay must end with END_MARKER, as tune writes it: a file cut short is refused, not read as
    the valid YAML prefix it may be (which would silently hand the measured keys back to the rules)."""
    if not is_sealed(text):
        line = text.count("\n") + 1
        raise RegistryError(
            f"{path}:{line}: incomplete: a measured overlay's last line is `{END_MARKER}` (tune writes it); this "
            "file ends without it, so it was cut short (caught mid-write?): re-run tune"
        )
    data, lines = safe_load_with_lines(text, path)
    try:
        overlay = MeasuredOverlay.model_validate(data)
    except ValidationError as error:
        raise errors_in_file_order(path, validation_problems(error, lines)) from None
    problems = [(deepest_line(lines, at), at, message) for at, message in _across_preferences(overlay)]
    if problems:
        raise errors_in_file_order(path, problems)
    return MeasuredDocument(overlay=overlay, path=path, lines=lines)


def _across_preferences(overlay: MeasuredOverlay):
    """What one preference cannot check alone: a key measured twice, a backend without a version."""
    for op, table in overlay.ops.items():
        seen: dict[DispatchKey, int] = {}
        for index, preference in enumerate(table.preferences):
            here = ("ops", op.value, "preferences", index)
            for key in preference.key.keys():
                if key in seen:
                    yield here + ("key",), f"measures {key} again (also preferences[{seen[key]}])"
                seen[key] = index
            for name in sorted((set(preference.order) | set(preference.failed)) - set(table.versions)):
                where = ("order", preference.order.index(name)) if name in preference.order else ("failed", name)
                yield here + where, f"`{name}` has no entry in ops.{op.value}.versions"
            for where, message in _band_problems(preference):
                yield here + where, message


def _band_problems(preference: Preference):
    """Bands that cannot serve: each one per batch size the shapes name, ascending, its order the key's
    backends in the measured rule over that batch size's shapes (dispatch/registry/measured_bands.py)."""
    if not preference.bands:
        return
    measured = sorted({size for shape in preference.shapes if (size := batch_size_of(shape.shape)) is not None})
    sub_banded = any(band.lengths for band in preference.bands)  # one batch size may still have length sub-bands
    if len(measured) < (1 if sub_banded else 2) or len(measured) != len({batch_size_of(s.shape) for s in preference.shapes}):
        yield ("bands",), (
            "bands need shapes that each name a batch size (`B=<n>` or `R=<n>`), at least two of them; these "
            f"shapes name {', '.join(map(str, measured)) or 'none'} (one batch size takes a band only with length "
            "sub-bands)"
        )
        return
    bounds = preference.bounds
    for index, bound in enumerate(bounds):
        at = ("bands", index, "batch_size_up_to")
        if index and bound <= bounds[index - 1]:
            yield at, f"{bound} after {bounds[index - 1]}: bands are ascending, one per measured batch size"
        elif bound not in measured:
            yield at, f"{bound} is not a measured batch size (the shapes measure {', '.join(map(str, measured))})"
    missing = [size for size in measured if size not in bounds]
    if missing:
        yield ("bands",), f"no band for the measured batch size {', '.join(map(str, missing))}: one band per batch size"
    stepped = {size: sorted(s.shape for s in _at_size(preference.step_shapes, size)) for size in measured}
    for index, band in enumerate(preference.bands):
        at = ("bands", index, "order")
        size = band.batch_size_up_to
        alone = sorted(s.shape for s in _at_size(preference.shapes, size))
        if band.ranked_by == "step" and stepped.get(size) != alone:
            yield ("bands", index, "ranked_by"), (
                f"is `step`, but `step_shapes` time {len(stepped.get(size, []))} of the {len(alone)} shapes at "
                f"B={size}: a band ranked by the step needs the step's time at each of its shapes")
        elif sorted(band.order) != sorted(preference.order):
            yield at, (f"lists {_ticks(band.order)}; a band orders exactly the key's backends "
                       f"({_ticks(preference.order)}), each once")
        elif size in measured and not missing:
            problem = out_of_order(band.order, functools.partial(preference.band_mean_us, index))
            if problem:
                yield at, f"{problem} at B={size}" + (" in the step" if band.ranked_by == "step" else "")
            yield from _length_problems(preference, index)
    by_step = {band.batch_size_up_to for band in preference.bands if band.ranked_by == "step"}
    unused = sorted({size for size, shapes in stepped.items() if shapes} - by_step)
    if unused and preference.ranked_by == "op":
        yield ("step_shapes",), (f"time the step at B={', B='.join(map(str, unused))}, which no band is ranked by "
                                 "(`ranked_by: step`)")


def _length_problems(preference: Preference, index: int):
    """Length sub-bands of band `index` that cannot serve: one per mean length that batch size's shapes
    measure (each bounded by 3L/2), ascending, ranked as the band is, each order the key's backends in
    the measured rule over that length's shapes (dispatch/registry/measured_bands.py)."""
    band = preference.bands[index]
    if not band.lengths:
        return
    here = ("bands", index, "lengths")
    size = band.batch_size_up_to
    lengths = [mean_len_of(shape.shape) for shape in _at_size(preference.shapes, size)]
    if None in lengths or len(set(lengths)) < 2:
        yield here, (f"length sub-bands need the shapes at B={size} to each name a mean length (`L~<n>`), at least "
                     f"two of them; they name {', '.join(str(n) for n in sorted(set(lengths) - {None})) or 'none'}")
        return
    wanted = sorted(length_bound(n) for n in set(lengths))
    bounds = band.length_bounds
    for sub_index, bound in enumerate(bounds):
        at = here + (sub_index, "max_seq_len_up_to")
        if sub_index and bound <= bounds[sub_index - 1]:
            yield at, f"{bound} after {bounds[sub_index - 1]}: length sub-bands are ascending, one per measured length"
        elif bound not in wanted:
            yield at, (f"{bound} is not 3L/2 of a length measured at B={size} (the sub-bands' bounds are "
                       f"{', '.join(map(str, wanted))})")
    missing = [bound for bound in wanted if bound not in bounds]
    if missing:
        yield here, f"no sub-band up to {', '.join(map(str, missing))} at B={size}: one sub-band per measured length"
        return
    for sub_index, sub in enumerate(band.lengths):
        at = here + (sub_index, "order")
        if sub.ranked_by != band.ranked_by:
            yield here + (sub_index, "ranked_by"), (f"is `{sub.ranked_by}` in a band ranked by `{band.ranked_by}`: a "
                                                     "sub-band is ranked by the times its band is")
        elif sorted(sub.order) != sorted(preference.order):
            yield at, (f"lists {_ticks(sub.order)}; a sub-band orders exactly the key's backends "
                       f"({_ticks(preference.order)}), each once")
        else:
            problem = out_of_order(sub.order, functools.partial(preference._mean_at, index, sub_index))
            if problem:
                yield at, (f"{problem} at B={size}, {length_label(bounds, sub_index)}"
                           + (" in the step" if sub.ranked_by == "step" else ""))


def load_measured(path: str | Path) -> MeasuredDocument:
    """Raises RegistryError naming the file (and line) when it cannot be read or is invalid."""
    return parse_measured(_read(Path(path)), str(path))


def _read(path: Path) -> str:
    raw = read_bounded(path)  # the registry's size bound, and no hanging on a FIFO
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise RegistryError(f"{path}:{line}: not UTF-8 text: byte {raw[error.start]:#04x} is {error.reason}") from None


def this_machine() -> str:
    """This machine as `tune` names it, without importing torch: the first NVIDIA GPU's name from
    nvidia-smi (NVML's, the same string torch.cuda.get_device_name gives), else "CPU (<processor>)"."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            answer = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                    text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            answer = None
        if answer is not None and answer.returncode == 0 and answer.stdout.strip():
            return answer.stdout.strip().splitlines()[0].strip()
    return f"CPU ({platform.processor() or platform.machine()})"


def stale_evidence(document, catalog, machine: str | None = None, dispatch: str | None = None) -> list[str]:
    """Warnings (not errors) for a RegistryDocument's measurements that may no longer hold: a backend's version differs
    from the one it was measured with, a measured backend is no longer registered, or dispatch's
    release differs (its own kernels are part of what was measured; `dispatch`, default this one's). With
    `machine`, only overlays measured on that kind of machine are compared: an H200 overlay read on a
    laptop is not stale, it is simply not this machine's (and the laptop's library versions say nothing
    of it)."""
    warnings = []
    for cluster, measured in document.measured.items():
        if machine is not None and measured.overlay.machine != machine:
            continue
        rerun = f"python -m dispatch tune --cluster {cluster}"
        changed = _dispatch_release_changed(measured.overlay.dispatch, dispatch or dispatch_version())
        if changed:
            warnings.append(f"{measured.where(('dispatch',))}: dispatch: stale evidence: {changed}; re-run `{rerun}`")
        for op, table in measured.overlay.ops.items():
            for name, version in table.versions.items():
                location = ("ops", op.value, "versions", name)
                where = f"{measured.where(location)}: {dotted(location)}"
                backend = catalog.get(op, name)
                if backend is None:
                    problem = f"`{name}` was measured but is not registered for {op.value} now"
                elif backend.version != version:
                    problem = f"`{name}` was measured at version {version or '-'}; it is {backend.version or '-'} now"
                else:
                    continue
                warnings.append(f"{where}: stale evidence: {problem}; re-run `{rerun}`")
    return warnings


def _dispatch_release_changed(measured: str, current: str) -> str | None:
    """Why dispatch's version makes the evidence stale, or None. Releases are compared, not whole
    versions: a source tree's version carries its commit (dispatch.contract.version), which changes with every
    commit, and "source" or "unknown" name no release at all; neither says the kernels changed."""
    then, now = release_of(measured), release_of(current)
    if then is None or now is None or then == now:
        return None
    return f"measured with dispatch {then}; this is {now}"


def _ticks(names) -> str:
    return ", ".join(f"`{n}`" for n in names)
