"""The plugin host: built-in backends and third-party plugins register through the same hook.

Third-party plugins come from the entry-point group `dispatch.backends` and load only when named in
DISPATCH_PLUGINS (comma-separated entry-point or distribution names, `*` for all; unset or empty:
none). A plugin that fails, or registers a name that is taken, is an error naming it; nothing is
silently overridden. Pluggy collects the candidates; it never decides.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
from dataclasses import dataclass, replace

import pluggy

from dispatch.contract import hookspecs
from dispatch.contract.backend import BACKEND_NAME, Backend, Support
from dispatch.contract.catalog import Catalog
from dispatch.contract.ops import OP_CONTRACTS
from dispatch.contract.errors import PluginError
from dispatch.contract.key import Arch, Fp8Dtype, ForwardMode, Op
from dispatch.contract.layout import Layout
from dispatch.contract.limits import cut, quoted
from dispatch.contract.version import DISTRIBUTION as OWN_DISTRIBUTION
from dispatch.contract.version import dispatch_version

logger = logging.getLogger("dispatch")

ENTRY_POINT_GROUP = "dispatch.backends"
BUILTIN_PLUGINS = (
    "backends.reference.plugin",
    "backends.triton.plugin",
    "backends.cuda_topk.plugin",
    "backends.deepgemm.plugin",
    "backends.flashinfer.plugin",
    "backends.sglang_topk.plugin",
    "backends.vllm_topk.plugin",
)


@dataclass(frozen=True)
class LoadedPlugin:
    name: str
    distribution: str
    module: object
    version: str = ""  # the plugin distribution's version (a backend's own `version` is its library's)


def allowlist_from_env() -> frozenset[str]:
    raw = os.environ.get("DISPATCH_PLUGINS", "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def normalized(name: str) -> str:
    """A distribution name as packaging compares them: `Acme_Dispatch.Plugin` is `acme-dispatch-plugin`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _allowed(entry_name: str, dist: str, allowlist: frozenset[str]) -> bool:
    wanted = {normalized(entry) for entry in allowlist}
    return "*" in allowlist or entry_name in allowlist or normalized(entry_name) in wanted or normalized(dist) in wanted


def _installed() -> list[tuple[importlib.metadata.EntryPoint, str, str]]:
    """(entry point, distribution, version) of the group, sorted by name; read from metadata, nothing imported."""
    found = []
    for entry_point in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = entry_point.dist.name if entry_point.dist else "<unknown distribution>"
        version = entry_point.dist.version if entry_point.dist else ""
        found.append((entry_point, dist, version))
    return found


def not_allowed_plugins(allowlist: frozenset[str] | None = None) -> list[tuple[str, str]]:
    """(entry-point name, distribution) of installed plugins the allowlist leaves out (never imported)."""
    allowlist = allowlist_from_env() if allowlist is None else allowlist
    return [(ep.name, dist) for ep, dist, _ in _installed() if not _allowed(ep.name, dist, allowlist)]


def not_allowed_hint(backend_name: str) -> str:
    """For an unknown backend name: the installed plugins DISPATCH_PLUGINS leaves out, the likeliest first
    (whose entry-point or distribution name starts the backend's), and the value to set. Plugins that are
    not allowed are never imported, so which backends they would register is inferred from their names."""
    left_out = not_allowed_plugins()
    if not left_out:
        return ""
    stem = normalized(backend_name.split(".")[0])
    likely = [(n, d) for n, d in left_out if stem and (normalized(n).startswith(stem) or normalized(d).startswith(stem))]
    current = sorted(allowlist_from_env())
    if likely:
        name, dist = likely[0]
        value = ",".join(current + [name])
        return (
            f"; plugin `{name}` (distribution `{dist}`) is installed but not allowed and may register it: "
            f"set DISPATCH_PLUGINS={value}"
        )
    names = ", ".join(f"`{n}` (distribution `{d}`)" for n, d in left_out[:5])
    return f"; installed but not allowed by DISPATCH_PLUGINS: {names} (add one to DISPATCH_PLUGINS to load it)"


def builtin_plugins() -> list[LoadedPlugin]:
    _check_builtin_package()
    version = dispatch_version()
    return [LoadedPlugin(path, OWN_DISTRIBUTION, importlib.import_module(path), version) for path in BUILTIN_PLUGINS]


def _check_builtin_package() -> None:
    """`backends` is a generic top-level name: another distribution's package of that name could shadow
    ours on sys.path or overwrite it in site-packages. Say so, rather than fail on a missing submodule."""
    try:
        package = importlib.import_module("backends")
    except ImportError as error:
        raise PluginError(f"the built-in backends package `backends` of {OWN_DISTRIBUTION} is not importable: {error}") from error
    if not getattr(package, "DISPATCH_DSA_BUILTIN_BACKENDS", False):
        from dispatch.contract.shadowing import shadow_message

        raise PluginError(shadow_message(package))


def entry_point_plugins(allowlist: frozenset[str]) -> list[LoadedPlugin]:
    """Load the allowlisted plugins of the entry-point group (entry-point or distribution names, the
    latter compared normalized); an import failure names plugin and distribution. An allowlist entry
    that matches nothing installed is logged as a warning: a typo there silently loads nothing."""
    installed = _installed()
    _warn_unmatched(allowlist, installed)
    loaded = []
    for entry_point, dist, version in installed:
        if not _allowed(entry_point.name, dist, allowlist):
            continue
        try:
            module = entry_point.load()
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # SystemExit at import must not end `validate` with exit 0
            raise PluginError(
                f"plugin `{entry_point.name}` (distribution `{dist}`) failed to import "
                f"`{entry_point.value}`: {type(error).__name__}: {cut(str(error))}"
            ) from error
        loaded.append(LoadedPlugin(entry_point.name, dist, module, version))
    return loaded


def _warn_unmatched(allowlist: frozenset[str], installed) -> None:
    names = {normalized(ep.name) for ep, _, _ in installed} | {normalized(dist) for _, dist, _ in installed}
    for entry in sorted(allowlist - {"*"}):
        if normalized(entry) not in names:
            logger.warning(
                "DISPATCH_PLUGINS names `%s`, which matches no installed plugin (entry points of group %s: %s)",
                entry,
                ENTRY_POINT_GROUP,
                ", ".join(sorted(ep.name for ep, _, _ in installed)) or "none",
            )


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
        except (PluginError, KeyboardInterrupt):
            raise
        except BaseException as error:  # SystemExit, GeneratorExit...: a plugin's bug, never a clean exit
            raise PluginError(
                f"plugin `{plugin.name}` (distribution `{plugin.distribution}`) raised in register_backends: "
                f"{type(error).__name__}: {cut(str(error))}"
            ) from error
    return Catalog.of(list(registered.values()))


def _validated(backend: object, plugin: LoadedPlugin) -> Backend:
    """Check every field where the plugin registers, so a bad one is an error naming the plugin, not an
    AttributeError on some later key. Stamps the backend with who registered it."""
    who = f"plugin `{plugin.name}` (distribution `{plugin.distribution}`)"
    if not isinstance(backend, Backend):
        raise PluginError(f"{who} registered {type(backend).__name__}; expected dispatch.contract.Backend")
    if not isinstance(backend.name, str) or not re.fullmatch(BACKEND_NAME, backend.name):
        name = backend.name
        shown = f"`{name}`" if isinstance(name, str) and name.isprintable() and len(name) <= 80 else quoted(name)
        raise PluginError(
            f"{who} registered backend name {shown}; names are lowercase [a-z0-9_.-], starting with [a-z0-9]"
        )
    what = f"{who} registered `{backend.name}`"
    if not isinstance(backend.op, Op):
        raise PluginError(f"{what} with op {quoted(backend.op)}; expected a dispatch.contract.Op")
    layouts = OP_CONTRACTS[backend.op].layouts
    if not isinstance(backend.layout, Layout) or backend.layout not in layouts:
        allowed = ", ".join(layout.value for layout in layouts)
        raise PluginError(
            f"{what} for {backend.op.value} with layout {quoted(backend.layout)}; that op takes: {allowed}"
        )
    problem = _support_problem(backend.supports)
    if problem:
        raise PluginError(f"{what} with {problem}")
    for field_name in ("run", "probe"):
        if not callable(getattr(backend, field_name)):
            raise PluginError(f"{what} whose `{field_name}` is not callable")
    for field_name in ("prepare", "warm"):
        if getattr(backend, field_name) is not None and not callable(getattr(backend, field_name)):
            raise PluginError(f"{what} whose `{field_name}` is neither None nor callable")
    for field_name in ("version", "description"):
        if not isinstance(getattr(backend, field_name), str):
            raise PluginError(f"{what} whose `{field_name}` is {quoted(getattr(backend, field_name))}; expected a str")
    # The op's Protocol is the one signature: a run that cannot take the op's call is refused here.
    problem = OP_CONTRACTS[backend.op].call_problem(backend.run)
    if problem:
        raise PluginError(f"{what} for {backend.op.value} with {problem}")
    return replace(backend, plugin=plugin.name, distribution=plugin.distribution, plugin_version=plugin.version)


def _support_problem(supports: object) -> str | None:
    if not isinstance(supports, Support):
        return f"supports={quoted(supports)}; expected a dispatch.contract.Support"
    for field_name, member in (("archs", Arch), ("forward_modes", ForwardMode), ("fp8_dtypes", Fp8Dtype)):
        values = getattr(supports, field_name)
        if not isinstance(values, frozenset) or not all(isinstance(v, member) for v in values):
            expected = f"{member.__module__}.{member.__name__}"
            return f"supports.{field_name}={quoted(values)}; expected a frozenset of {expected}"
    low, high = supports.next_n_min, supports.next_n_max
    if isinstance(low, bool) or not isinstance(low, int) or low < 1:
        return f"supports.next_n_min={quoted(low)}; expected an int >= 1"
    if high is not None and (isinstance(high, bool) or not isinstance(high, int) or high < low):
        return f"supports.next_n_max={quoted(high)}; expected None or an int >= next_n_min"
    if supports.extra is not None and not callable(supports.extra):
        return f"supports.extra={quoted(supports.extra)}; expected None or a callable"
    return None


def _trace_hooks(manager: pluggy.PluginManager) -> None:
    import logging

    logger = logging.getLogger("dispatch.trace")

    def before(hook_name, hook_impls, kwargs):
        logger.info("hook %s -> %s", hook_name, [impl.plugin_name for impl in hook_impls])

    def after(outcome, hook_name, hook_impls, kwargs):
        logger.info("hook %s done", hook_name)

    manager.add_hookcall_monitoring(before, after)
