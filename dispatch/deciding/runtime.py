"""Putting it together: load the registry, collect the backends, pick the cluster, build a Dispatcher."""

from __future__ import annotations

import os
from pathlib import Path

from dispatch.contract.catalog import Catalog
from dispatch.deciding.clusters import resolve_cluster
from dispatch.contract.detect import detect_arch
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.errors import RegistryError
from dispatch.contract.key import Arch, parse_enum
from dispatch.contract.limits import cut
from dispatch.contract.host import LoadedPlugin, allowlist_from_env, builtin_plugins, collect_backends, entry_point_plugins
from dispatch.registry.checks import check_backend_names
from dispatch.registry.document import RegistryDocument, load_registry
from dispatch.registry.extends import PACKAGED_REGISTRY

DEFAULT_REGISTRY = PACKAGED_REGISTRY  # the registry shipped with the package (dispatch.registry.extends says where)


def registry_path(explicit: str | os.PathLike | None = None) -> Path:
    """The registry file: the explicit path, else DISPATCH_REGISTRY, else the packaged registry.yaml.
    A file that is not there is a RegistryError naming where the path came from and the default."""
    if explicit:
        path, source = Path(explicit), "the path given"
    elif os.environ.get("DISPATCH_REGISTRY"):
        path, source = Path(os.environ["DISPATCH_REGISTRY"]), "DISPATCH_REGISTRY"
    else:
        path, source = DEFAULT_REGISTRY, ""
    try:
        if path.is_file():
            return path
    except OSError as error:  # a name longer than the filesystem allows, a loop of links
        raise RegistryError(f"{cut(str(path))}: cannot read the registry: {error.strerror or error}") from None
    if source:
        raise RegistryError(
            f"{path}: no registry file there ({source}); the packaged default is {DEFAULT_REGISTRY}"
            " (used when neither --registry nor DISPATCH_REGISTRY is set)"
        )
    raise RegistryError(
        f"{path}: the packaged default registry is missing (a broken install?); reinstall dispatch-dsa, "
        "or point --registry or DISPATCH_REGISTRY at a registry file"
    )


def load_plugins(allowlist: frozenset[str] | None = None) -> list[LoadedPlugin]:
    return builtin_plugins() + entry_point_plugins(allowlist_from_env() if allowlist is None else allowlist)


def load_dispatcher(
    registry: str | os.PathLike | None = None,
    *,
    cluster: str | None = None,
    arch: Arch | str | None = None,
    check_availability: bool | None = None,
    plugins: list[LoadedPlugin] | None = None,
    device_name: str | None = None,
) -> Dispatcher:
    """A dispatcher for this machine, or for `arch` when given (a what-if: availability on this
    machine is then not checked unless `check_availability` says so). `device_name` matches clusters
    as a machine with that GPU would (dispatch.deciding.clusters.resolve_cluster)."""
    document = load_registry(registry_path(registry))
    catalog = collect_backends(load_plugins() if plugins is None else plugins)
    return build_dispatcher(
        document, catalog, cluster=cluster, arch=arch, check_availability=check_availability, device_name=device_name
    )


def build_dispatcher(
    document: RegistryDocument,
    catalog: Catalog,
    *,
    cluster: str | None = None,
    arch: Arch | str | None = None,
    check_availability: bool | None = None,
    device_name: str | None = None,
) -> Dispatcher:
    """A dispatcher over a loaded registry and catalog: every backend name checked, the cluster resolved.
    Raises RegistryError before anything is built, so a caller holding an older dispatcher keeps it."""
    host = detect_arch()
    target = host if arch is None else parse_enum(Arch, arch, "arch")
    check_backend_names(document, catalog)
    return Dispatcher(
        document,
        catalog,
        cluster=resolve_cluster(document, cluster, target, device_name),
        target_arch=target,
        check_availability=(target is host) if check_availability is None else check_availability,
    )
