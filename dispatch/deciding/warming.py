"""Warming backends up: the slow first-use work some backends have (cuda.radix's nvcc build), done at
a moment the caller picks (`python -m dispatch backends --warm`, IndexerStep.warm() before an engine
captures its graphs) rather than inside the first decision, the first timed call or a capture.

A warm-up that fails is a BackendError naming the backend: the backend was available to every rank's
decision, so quietly dropping it on one rank would make the ranks choose differently."""

from __future__ import annotations

import time
from dataclasses import dataclass

from dispatch.contract.backend import Availability, Backend
from dispatch.contract.catalog import Catalog
from dispatch.contract.errors import BackendError, DispatchError
from dispatch.contract.key import Arch


@dataclass(frozen=True)
class Warmed:
    backend: Backend
    availability: Availability  # after the warm-up
    seconds: float


def warm_backend(backend: Backend) -> Warmed:
    """One backend's warm-up; its own failure becomes a BackendError naming it."""
    started = time.monotonic()
    try:
        result = backend.warm()
    except KeyboardInterrupt:
        raise
    except Exception as error:
        detail = str(error) if isinstance(error, DispatchError) else f"{type(error).__name__}: {error}"
        raise BackendError(
            f"backend `{backend.name}` (plugin `{backend.plugin}`) failed to warm up for {backend.op.value}: {detail}"
        ) from error
    if not isinstance(result, Availability):
        raise BackendError(
            f"backend `{backend.name}` (plugin `{backend.plugin}`): warm() returned {type(result).__name__}; "
            "expected dispatch.contract.backend.Availability"
        )
    return Warmed(backend, result, time.monotonic() - started)


def warmable(catalog: Catalog, arch: Arch, *, available_only: bool) -> list[Backend]:
    """The backends with a warm-up that could serve `arch`; available_only: those whose probe says yes."""
    return [b for b in catalog.backends if b.warm is not None and arch in b.supports.archs
            and (not available_only or b.availability().ok)]


def warm_available(catalog: Catalog, arch: Arch) -> list[Warmed]:
    """Warm every backend a decision on this machine may pick (probe yes, supports `arch`), in catalog order."""
    return [warm_backend(b) for b in warmable(catalog, arch, available_only=True)]


def warm_for(dispatcher) -> list[Warmed]:
    """What an engine calls once it holds its dispatcher, before it captures graphs: warm what this
    machine's decisions may pick. A what-if dispatcher (another arch, availability unchecked) warms nothing."""
    if not dispatcher.check_availability:
        return []
    return warm_available(dispatcher.catalog, dispatcher.target_arch)
