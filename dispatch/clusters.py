"""Which cluster overlay applies: named by the caller or DISPATCH_CLUSTER, else declared by a match."""

from __future__ import annotations

import fnmatch
import os
import socket

from dispatch.detect import gpu_name
from dispatch.errors import RegistryError
from dispatch.key import Arch
from dispatch.registry.document import RegistryDocument
from dispatch.registry.models import ClusterMatch


def requested_cluster(requested: str | None = None) -> str | None:
    """The cluster asked for by name (the caller's, else DISPATCH_CLUSTER), before any match."""
    return requested or os.environ.get("DISPATCH_CLUSTER") or None


def resolve_cluster(document: RegistryDocument, requested: str | None, arch: Arch) -> str | None:
    name = requested_cluster(requested)
    clusters = document.registry.clusters
    if name is not None:
        if name not in clusters:
            declared = ", ".join(sorted(clusters)) or "none"
            raise RegistryError(f"{document.path}: unknown cluster `{name}` (declared: {declared})")
        return name
    matching = [n for n, c in clusters.items() if c.match is not None and _matches(c.match, arch)]
    if len(matching) > 1:
        raise RegistryError(
            f"{document.path}: clusters {', '.join(f'`{n}`' for n in matching)} all match this machine; "
            "pick one with --cluster or DISPATCH_CLUSTER"
        )
    return matching[0] if matching else None


def _matches(match: ClusterMatch, arch: Arch) -> bool:
    return (
        (match.arch is None or arch in match.arch)
        and (match.gpu_name is None or fnmatch.fnmatch(gpu_name(), match.gpu_name))
        and (match.hostname is None or fnmatch.fnmatch(socket.gethostname(), match.hostname))
    )
