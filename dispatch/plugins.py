"""The plugin host: built-in backends and third-party plugins register through the same hook.

Third-party plugins come from the entry-point group `dispatch.backends` and load only when named in
DISPATCH_PLUGINS (comma-separated entry-point or distribution names, `*` for all; unset or empty:
none). A plugin that fails, or registers a name that is taken, is an error naming it; nothing is
silently overridden. Pluggy collects the candidates; it never decides.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
from dataclasses import dataclass, replace

import pluggy

from dispatch import hookspecs
from dispatch.backend import BACKEND_NAME, Backend
from dispatch.catalog import Catalog
from dispatch.contract import OP_CONTRACTS
from dispatch.errors import PluginError
from dispatch.key import Op

ENTRY_POINT_GROUP = "dispatch.backends"
OWN_DISTRIBUTION = "dispatch-dsa"
BUILTIN_PLUGINS = (
    "backends.reference.plugin",
    "backends.triton.plugin",
    "backends.deepgemm.plugin",
    "backends.flashinfer.plugin",
)


@dataclass(frozen=True)
class LoadedPlugin:
    name: str
    distribution: str
    module: object


def allowlist_from_env() -> frozenset[str]:
    raw = os.environ.get("DISPATCH_PLUGINS", "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def builtin_plugins() -> list[LoadedPlugin]:
    return [LoadedPlugin(path, OWN_DISTRIBUTION, importlib.import_module(path)) for path in BUILTIN_PLUGINS]


def entry_point_plugins(allowlist: frozenset[str]) -> list[LoadedPlugin]:
    """Load the allowlisted plugins of the entry-point group; an import failure names plugin and distribution."""
    loaded = []
    for entry_point in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = entry_point.dist.name if entry_point.dist else "<unknown distribution>"
        if not ({"*", entry_point.name, dist} & allowlist):
            continue
        try:
            module = entry_point.load()
        except Exception as error:
            raise PluginError(
                f"plugin `{entry_point.name}` (distribution `{dist}`) failed to import "
                f"`{entry_point.value}`: {type(error).__name__}: {error}"
            ) from error
        loaded.append(LoadedPlugin(entry_point.name, dist, module))
    return loaded


def get_plugin_manager(plugins: list[LoadedPlugin]) -> pluggy.PluginManager:
    manager = pluggy.PluginManager("dispatch")
    manager.add_hookspecs(hookspecs)
    for plugin in plugins:
        if manager.is_registered(plugin.module) or manager.has_plugin(plugin.name):
            raise PluginError(f"plugin `{plugin.name}` (distribution `{plugin.distribution}`) is loaded twice")
        manager.register(plugin.module, name=plugin.name)
    if os.environ.get("DISPATCH_TRACE") == "1":
        _trace_hooks(manager)
    return manager


def collect_backends(plugins: list[LoadedPlugin]) -> Catalog:
    """Ask every plugin for its backends; each one is validated and stamped with who registered it."""
    manager = get_plugin_manager(plugins)
    registered: dict[tuple[Op, str], Backend] = {}
    for plugin in plugins:
        others = [p.module for p in plugins if p is not plugin]
        caller = manager.subset_hook_caller("register_backends", remove_plugins=others)

        def register(backend: Backend, plugin: LoadedPlugin = plugin) -> None:
            stamped = _validated(backend, plugin)
            taken = registered.get((stamped.op, stamped.name))
            if taken is not None:
                raise PluginError(
                    f"backend `{stamped.name}` for {stamped.op.value} is registered by plugin `{plugin.name}` "
                    f"(distribution `{plugin.distribution}`) but already taken by plugin `{taken.plugin}` "
                    f"(distribution `{taken.distribution}`)"
                )
            registered[(stamped.op, stamped.name)] = stamped

        try:
            caller(register=register)
        except PluginError:
            raise
        except Exception as error:
            raise PluginError(
                f"plugin `{plugin.name}` (distribution `{plugin.distribution}`) raised in register_backends: "
                f"{type(error).__name__}: {error}"
            ) from error
    return Catalog.of(list(registered.values()))


def _validated(backend: object, plugin: LoadedPlugin) -> Backend:
    who = f"plugin `{plugin.name}` (distribution `{plugin.distribution}`)"
    if not isinstance(backend, Backend):
        raise PluginError(f"{who} registered {type(backend).__name__}; expected dispatch.backend.Backend")
    if not isinstance(backend.name, str) or not re.fullmatch(BACKEND_NAME, backend.name):
        raise PluginError(f"{who} registered backend name `{backend.name}`; names are lowercase [a-z0-9_.-]")
    if not isinstance(backend.op, Op):
        raise PluginError(f"{who} registered `{backend.name}` with op {backend.op!r}; expected a dispatch.key.Op")
    if backend.layout not in OP_CONTRACTS[backend.op].layouts:
        allowed = ", ".join(layout.value for layout in OP_CONTRACTS[backend.op].layouts)
        raise PluginError(
            f"{who} registered `{backend.name}` for {backend.op.value} with layout `{backend.layout}`; "
            f"that op takes: {allowed}"
        )
    if not callable(backend.run):
        raise PluginError(f"{who} registered `{backend.name}` whose `run` is not callable")
    return replace(backend, plugin=plugin.name, distribution=plugin.distribution)



def _trace_hooks(manager: pluggy.PluginManager) -> None:
    import logging

    logger = logging.getLogger("dispatch.trace")

    def before(hook_name, hook_impls, kwargs):
        logger.info("hook %s -> %s", hook_name, [impl.plugin_name for impl in hook_impls])

    def after(outcome, hook_name, hook_impls, kwargs):
        logger.info("hook %s done", hook_name)

    manager.add_hookcall_monitoring(before, after)
