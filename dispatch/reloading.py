"""Explicit, atomic reload of registry.yaml under a running engine.

An engine keeps one LiveDispatcher, reads `live.current` once per batch (build_plan(live.current, ...),
so every op of a batch comes from one registry) and calls `live.reload()` when an operator asks: on
SIGHUP or from an admin endpoint (neither is implemented here). Nothing watches the file.

A reload loads the new file, checks every backend name against the catalog and resolves the cluster
before anything changes; one attribute assignment then swaps the dispatcher, so a reader sees the old
one or the new one, never a mix. A bad edit keeps the old dispatcher and says why. Decisions already
made are frozen values and stay valid; decisions after a swap come from the new registry's cache.
A model on many ranks reloads every rank, then checks them again (dispatch.agreement.check_ranks_agree).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from dispatch.catalog import Catalog
from dispatch.dispatcher import Dispatcher
from dispatch.errors import RegistryError
from dispatch.key import Arch
from dispatch.plugins import collect_backends
from dispatch.registry.document import load_registry
from dispatch.runtime import build_dispatcher, load_plugins, registry_path


@dataclass(frozen=True)
class ReloadResult:
    ok: bool
    fingerprint_before: str
    fingerprint_after: str  # equal to fingerprint_before when the reload was refused
    error: str = ""  # the RegistryError's text (file:line: key: problem) when refused


class LiveDispatcher:
    """The current Dispatcher for one registry file and catalog; `current` is read without a lock.

        live = LiveDispatcher("/etc/dispatch/registry.yaml")   # or LiveDispatcher(): DISPATCH_REGISTRY, else the packaged file

    The catalog (the backends the plugins registered) is collected once, when not given: a reload
    re-reads the file, not the plugins.
    """

    def __init__(
        self,
        registry: str | os.PathLike | None = None,
        *,
        catalog: Catalog | None = None,
        cluster: str | None = None,
        arch: Arch | str | None = None,
        check_availability: bool | None = None,
    ) -> None:
        self.path: Path = registry_path(registry)
        self.catalog = collect_backends(load_plugins()) if catalog is None else catalog
        self._options = {"cluster": cluster, "arch": arch, "check_availability": check_availability}
        self._lock = threading.Lock()
        # The first load has no older registry to keep: its RegistryError propagates.
        self.current: Dispatcher = self._load()

    def reload(self) -> ReloadResult:
        """Load the file again and swap it in, or keep the current dispatcher and report why not.
        Only RegistryError is a bad edit; anything else is a bug and propagates, the old one kept."""
        with self._lock:  # unserialised, a slow reload of an older file could swap in last
            before = self.current.fingerprint
            try:
                fresh = self._load()
            except RegistryError as error:
                return ReloadResult(False, before, before, str(error))
            self.current = fresh
            return ReloadResult(True, before, fresh.fingerprint)

    def _load(self) -> Dispatcher:
        return build_dispatcher(load_registry(self.path), self.catalog, **self._options)
