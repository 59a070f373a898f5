"""Which cluster overlay applies: named by the caller or DISPATCH_CLUSTER, else declared by a match."""

from __future__ import annotations

import fnmatch
import os
import socket

from dispatch.contract.detect import gpu_name
from dispatch.contract.errors import RegistryError
from dispatch.contract.key import Arch
from dispatch.contract.limits import cut, listed
from dispatch.registry.document import RegistryDocument
from dispatch.registry.models import ClusterMatch


def requested_cluster(requested: str | None = None) -> str | None:
    """The cluster asked for by name (the caller's, else DISPATCH_CLUSTER), before any match."""
    return requested or os.environ.get("DISPATCH_CLUSTER") or None


def resolve_cluster(
    document: RegistryDocument, requested: str | None, arch: Arch, device_name: str | None = None
) -> str | None:
    """The cluster named, else the one whose `match` fits. `device_name` (a what-if for another GPU,
    e.g. "NVIDIA H200") is matched instead of this machine's GPU; its hostname is then unknown, so a
    match on `hostname` does not fit."""
    name = requested_cluster(requested)
    clusters = document.registry.clusters
    if name is not None:
        if name not in clusters:
            declared = listed(sorted(f"`{n}`" for n in clusters)) or "none"
            raise RegistryError(f"{document.path}: unknown cluster `{cut(name)}` (declared: {declared})")
        return name
    matching = matching_clusters(document, arch, device_name)
    if len(matching) > 1:
        raise RegistryError(
            f"{document.path}: clusters {listed([f'`{n}`' for n in matching])} all match this machine; "
            "pick one with --cluster or DISPATCH_CLUSTER"
        )
    return matching[0] if matching else None


def matching_clusters(document: RegistryDocument, arch: Arch, device_name: str | None = None) -> list[str]:
    """Every cluster whose `match` fits this machine, or with `device_name` a machine with that GPU."""
    if device_name is None:
        device, host = gpu_name(), socket.gethostname()
    else:
        device, host = device_name, None
    return [n for n, c in document.registry.clusters.items() if c.match is not None and _matches(c.match, arch, device, host)]


def _matches(match: ClusterMatch, arch: Arch, device: str, host: str | None) -> bool:
    return (
        (match.arch is None or arch in match.arch)
        and (match.gpu_name is None or fnmatch.fnmatch(device, match.gpu_name))
        and (match.hostname is None or (host is not None and fnmatch.fnmatch(host, match.hostname)))
    )
