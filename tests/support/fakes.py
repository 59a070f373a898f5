"""Test helpers: small fake backends registered through real pluggy plugins, and registries from text."""

from __future__ import annotations

import textwrap
import types

from dispatch.contract.backend import Availability, Backend, Support
from dispatch.contract.catalog import Catalog
from dispatch.contract import OP_CONTRACTS
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.hookspecs import hookimpl
from dispatch.contract.key import Arch, Op
from dispatch.contract.layout import Layout
from dispatch.contract.host import LoadedPlugin, collect_backends
from dispatch.registry.document import RegistryDocument, parse_registry


def _never_run(*args, **kwargs):
    raise AssertionError("a fake backend's kernel is never run by these tests")


def fake_backend(
    name: str,
    op: Op = Op.PAGED_MQA_LOGITS,
    *,
    layout: Layout | None = None,
    probe=Availability.yes,
    prepare=None,
    run=_never_run,
    **support,
) -> Backend:
    """A backend that supports what `support` (Support's fields) says; everything by default."""
    if layout is None:
        layout = OP_CONTRACTS[op].layouts[0]
    return Backend(name=name, op=op, layout=layout, supports=Support(**support), run=run, probe=probe, prepare=prepare)


def plugin_module(name: str, registrations) -> types.ModuleType:
    """A plain module carrying an @hookimpl register_backends that registers each item as given."""
    module = types.ModuleType(name)

    @hookimpl
    def register_backends(register):
        for item in registrations:
            register(item)

    module.register_backends = register_backends
    return module


def fake_plugin(name: str, *registrations, distribution: str = "fake-dist") -> LoadedPlugin:
    return LoadedPlugin(name, distribution, plugin_module(name, registrations))


def catalog_of(*backends: Backend) -> Catalog:
    """Each backend through its own plugin, named after it."""
    return collect_backends([fake_plugin(f"plugin-{b.op.value}-{b.name}", b) for b in backends])


def registry(text: str, path: str = "test-registry.yaml") -> RegistryDocument:
    return parse_registry(textwrap.dedent(text), path)


def dispatcher(
    text: str,
    catalog: Catalog,
    *,
    cluster: str | None = None,
    arch: Arch = Arch.SM90,
    check_availability: bool = True,
) -> Dispatcher:
    return Dispatcher(
        registry(text), catalog, cluster=cluster, target_arch=arch, check_availability=check_availability
    )
