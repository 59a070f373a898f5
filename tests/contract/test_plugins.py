"""The plugin host: real entry points behind the DISPATCH_PLUGINS allowlist, failures that name the
plugin and its distribution, refused registrations, and decisions that do not depend on load order."""

from __future__ import annotations

import itertools
import sys
import textwrap
import uuid

import pytest

from dispatch.contract.backend import Backend, Support
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.errors import NoBackendError, PluginError
from dispatch.contract.key import Arch, ForwardMode, Op
from dispatch.contract.layout import Layout
from dispatch.contract.host import (
    BUILTIN_PLUGINS,
    ENTRY_POINT_GROUP,
    LoadedPlugin,
    allowlist_from_env,
    collect_backends,
    entry_point_plugins,
)
from dispatch.registry.checks import all_keys
from tests.support.fakes import fake_backend, fake_plugin, registry

PLUGIN_SOURCE = """\
from dispatch.contract.backend import Backend, Support
from dispatch.contract.hookspecs import hookimpl
from dispatch.contract.key import Op
from dispatch.contract.layout import Layout


def run(plan, q, kv_cache, weights, *, clean_logits=True):
    raise NotImplementedError


@hookimpl
def register_backends(register):
    for name in {names!r}:
        register(Backend(name=name, op=Op.PAGED_MQA_LOGITS, layout=Layout.NATIVE, supports=Support(), run=run))
"""


class Site:
    """A directory on sys.path holding installed-looking distributions (dist-info + entry points)."""

    def __init__(self, root, monkeypatch):
        self.root = root
        self.prefix = f"dispatch_test_{uuid.uuid4().hex[:10]}"
        monkeypatch.syspath_prepend(str(root))

    def module(self, stem: str, source: str) -> str:
        name = f"{self.prefix}_{stem}"
        (self.root / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    def plugin_module(self, stem: str, *backend_names: str) -> str:
        return self.module(stem, PLUGIN_SOURCE.format(names=backend_names))

    def distribution(self, name: str, entry_points: dict[str, str]) -> None:
        info = self.root / f"{name.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        lines = "".join(f"{ep} = {target}\n" for ep, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")

    def imported(self) -> set[str]:
        return {m.removeprefix(self.prefix + "_") for m in sys.modules if m.startswith(self.prefix)}


@pytest.fixture
def site(tmp_path, monkeypatch):
    made = Site(tmp_path, monkeypatch)
    yield made
    for name in [m for m in sys.modules if m.startswith(made.prefix)]:
        del sys.modules[name]


@pytest.fixture
def two_plugins(site):
    site.distribution(
        "dispatch-fakes",
        {"fake-one": site.plugin_module("one", "fake.one"), "fake-two": site.plugin_module("two", "fake.two")},
    )
    site.distribution("dispatch-other", {"other": site.plugin_module("other", "other.backend")})
    return site


def ours(loaded: list[LoadedPlugin]) -> list[tuple[str, str]]:
    mine = {"dispatch-fakes", "dispatch-other"}
    return [(p.name, p.distribution) for p in loaded if p.distribution in mine]


def test_loaded_by_entry_point_name(two_plugins):
    loaded = entry_point_plugins(frozenset({"fake-one"}))
    assert ours(loaded) == [("fake-one", "dispatch-fakes")]
    assert two_plugins.imported() == {"one"}
    assert loaded[0].module is sys.modules[f"{two_plugins.prefix}_one"]


def test_loaded_by_distribution_name(two_plugins):
    loaded = entry_point_plugins(frozenset({"dispatch-fakes"}))
    assert ours(loaded) == [("fake-one", "dispatch-fakes"), ("fake-two", "dispatch-fakes")]
    assert two_plugins.imported() == {"one", "two"}


def test_star_loads_every_plugin(two_plugins):
    loaded = entry_point_plugins(frozenset({"*"}))
    assert ours(loaded) == [
        ("fake-one", "dispatch-fakes"),
        ("fake-two", "dispatch-fakes"),
        ("other", "dispatch-other"),
    ]


@pytest.mark.parametrize("value", [None, "", " ", " , ,"])
def test_unset_or_empty_allowlist_loads_none(two_plugins, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("DISPATCH_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("DISPATCH_PLUGINS", value)
    assert allowlist_from_env() == frozenset()
    assert entry_point_plugins(allowlist_from_env()) == []
    assert two_plugins.imported() == set()


def test_allowlist_from_env_is_comma_separated(two_plugins, monkeypatch):
    monkeypatch.setenv("DISPATCH_PLUGINS", " fake-two , dispatch-other,unrelated ")
    assert allowlist_from_env() == frozenset({"fake-two", "dispatch-other", "unrelated"})
    loaded = entry_point_plugins(allowlist_from_env())
    assert [p.name for p in loaded if p.distribution.startswith("dispatch-")] == ["fake-two", "other"]


def test_load_plugins_adds_the_allowlisted_to_the_builtins(two_plugins, monkeypatch):
    from dispatch.deciding.runtime import load_plugins

    monkeypatch.setenv("DISPATCH_PLUGINS", "fake-two")
    loaded = load_plugins()
    assert [p.name for p in loaded[: len(BUILTIN_PLUGINS)]] == list(BUILTIN_PLUGINS)
    assert ours(loaded) == [("fake-two", "dispatch-fakes")]
    catalog = collect_backends(loaded)
    assert catalog.get(Op.PAGED_MQA_LOGITS, "fake.two").plugin == "fake-two"
    assert catalog.get(Op.PAGED_MQA_LOGITS, "torch.reference").distribution == "dispatch-dsa"


def test_backends_are_stamped_with_plugin_and_distribution(two_plugins):
    catalog = collect_backends(entry_point_plugins(frozenset({"dispatch-fakes", "other"})))
    stamped = {b.name: (b.plugin, b.distribution) for b in catalog.backends}
    assert stamped == {
        "fake.one": ("fake-one", "dispatch-fakes"),
        "fake.two": ("fake-two", "dispatch-fakes"),
        "other.backend": ("other", "dispatch-other"),
    }


@pytest.mark.parametrize(
    "source, words",
    [
        ("raise RuntimeError('no CUDA toolkit')\n", "RuntimeError: no CUDA toolkit"),
        ("import dispatch_test_module_that_does_not_exist\n", "ModuleNotFoundError"),
        ("def broken(:\n", "SyntaxError"),
    ],
    ids=["raises", "missing-dependency", "syntax-error"],
)
def test_plugin_failing_to_import_names_plugin_and_distribution(site, source, words):
    site.distribution("dispatch-broken", {"broken": site.module("broken", source)})
    with pytest.raises(PluginError) as error:
        entry_point_plugins(frozenset({"broken"}))
    message = str(error.value)
    assert "plugin `broken`" in message and "distribution `dispatch-broken`" in message
    assert words in message


def test_entry_point_naming_a_missing_attribute(site):
    module = site.plugin_module("fine", "fine.backend")
    site.distribution("dispatch-broken", {"broken": f"{module}:no_such_object"})
    with pytest.raises(PluginError, match="plugin `broken` \\(distribution `dispatch-broken`\\)"):
        entry_point_plugins(frozenset({"dispatch-broken"}))


def test_broken_plugin_is_harmless_unless_allowlisted(site):
    site.distribution("dispatch-broken", {"broken": site.module("broken", "raise RuntimeError('boom')\n")})
    site.distribution("dispatch-fine", {"fine": site.plugin_module("fine", "fine.backend")})
    assert [p.name for p in entry_point_plugins(frozenset({"fine"}))] == ["fine"]


def test_plugin_raising_in_register_backends_names_it(site):
    source = """\
    from dispatch.contract.hookspecs import hookimpl


    @hookimpl
    def register_backends(register):
        raise KeyError("missing config")
    """
    site.distribution("dispatch-raiser", {"raiser": site.module("raiser", source)})
    plugins = entry_point_plugins(frozenset({"raiser"}))
    with pytest.raises(PluginError) as error:
        collect_backends(plugins)
    message = str(error.value)
    assert "plugin `raiser` (distribution `dispatch-raiser`) raised in register_backends" in message
    assert "KeyError" in message and "missing config" in message


@pytest.mark.parametrize("order", [("alpha", "beta"), ("beta", "alpha")])
def test_duplicate_backend_names_both_plugins_and_distributions(site, order):
    site.distribution("dispatch-alpha", {"alpha": site.plugin_module("alpha", "shared", "alpha.own")})
    site.distribution("dispatch-beta", {"beta": site.plugin_module("beta", "shared")})
    by_name = {p.name: p for p in entry_point_plugins(frozenset({"*"}))}
    with pytest.raises(PluginError) as error:
        collect_backends([by_name[name] for name in order])
    message = str(error.value)
    assert "backend `shared` for paged_mqa_logits" in message
    for name in ("alpha", "beta"):
        assert f"plugin `{name}` (distribution `dispatch-{name}`)" in message


def test_duplicate_of_a_builtin_is_refused():
    import backends.reference.plugin as reference

    builtin = LoadedPlugin("backends.reference.plugin", "dispatch-dsa", reference)
    impostor = fake_plugin("impostor", fake_backend("torch.reference"), distribution="dispatch-impostor")
    for plugins in ([builtin, impostor], [impostor, builtin]):
        with pytest.raises(PluginError) as error:
            collect_backends(plugins)
        assert "`torch.reference`" in str(error.value)
        assert "plugin `impostor` (distribution `dispatch-impostor`)" in str(error.value)
        assert "plugin `backends.reference.plugin` (distribution `dispatch-dsa`)" in str(error.value)


def test_duplicate_within_one_plugin_is_refused():
    with pytest.raises(PluginError, match="`twice`.*plugin `p`.*already taken by plugin `p`"):
        collect_backends([fake_plugin("p", fake_backend("twice"), fake_backend("twice"))])


def test_same_name_for_two_ops_is_allowed():
    catalog = collect_backends(
        [fake_plugin("p", fake_backend("both")), fake_plugin("q", fake_backend("both", Op.INDEXER_Q_QUANT))]
    )
    assert catalog.get(Op.PAGED_MQA_LOGITS, "both").plugin == "p"
    assert catalog.get(Op.INDEXER_Q_QUANT, "both").plugin == "q"


def test_same_plugin_loaded_twice_is_refused():
    plugin = fake_plugin("p", fake_backend("a"))
    with pytest.raises(PluginError, match="plugin `p` .* is loaded twice"):
        collect_backends([plugin, plugin])


def _paged_run(plan, q, kv_cache, weights, *, clean_logits=True):  # the op's call, never made here
    raise AssertionError("not run")


def _backend(**changes) -> Backend:
    fields = {"name": "ok", "op": Op.PAGED_MQA_LOGITS, "layout": Layout.NATIVE, "supports": Support(), "run": _paged_run}
    return Backend(**{**fields, **changes})


@pytest.mark.parametrize(
    "registration, words",
    [
        ({"name": "ok"}, "registered dict; expected dispatch.contract.Backend"),
        ("triton", "registered str; expected dispatch.contract.Backend"),
        (None, "registered NoneType"),
        (_backend(name="Triton"), "backend name `Triton`"),
        (_backend(name="has space"), "backend name `has space`"),
        (_backend(name=""), "backend name ``"),
        (_backend(name="-lead"), "backend name `-lead`"),
        (_backend(op="paged_mqa_logits"), "expected a dispatch.contract.Op"),
        (_backend(layout=Layout.TOKENS), "for paged_mqa_logits with layout"),
        (_backend(op=Op.INDEXER_Q_QUANT, layout=Layout.NATIVE), "that op takes: tokens"),
        (_backend(op=Op.INDEXER_Q_QUANT, layout=Layout.FLATTEN), "that op takes: tokens"),
        (_backend(run="not callable"), "`run` is not callable"),
    ],
    ids=[
        "dict",
        "str",
        "none",
        "uppercase",
        "space",
        "empty",
        "leading-dash",
        "op-not-enum",
        "tokens-for-logits",
        "native-for-q-quant",
        "flatten-for-q-quant",
        "run",
    ],
)
def test_invalid_registration_is_refused(registration, words):
    plugin = fake_plugin("sloppy", fake_backend("fine"), registration, distribution="dispatch-sloppy")
    with pytest.raises(PluginError) as error:
        collect_backends([plugin])
    assert "plugin `sloppy` (distribution `dispatch-sloppy`)" in str(error.value)
    assert words in str(error.value)


def test_plugin_without_the_hook_registers_nothing():
    import types

    catalog = collect_backends(
        [LoadedPlugin("empty", "d", types.ModuleType("empty")), fake_plugin("p", fake_backend("a"))]
    )
    assert [b.name for b in catalog.backends] == ["a"]


# --- registration order never changes a decision -------------------------------------------------

ORDER_REGISTRY = """\
version: 1
disabled: [experimental]
ops:
  paged_mqa_logits:
    rules:
      - id: sm90-small
        when: {arch: sm90, next_n: {max: 2}}
        use: [vendor.sm90, portable]
      - id: sm90-large
        when: {arch: sm90}
        use: [portable, vendor.sm90.flatten]
      - id: amd
        when: {arch: gfx942}
        use: [vendor.rocm]
    fallback: [portable, reference]
  indexer_q_quant:
    rules:
      - id: gpu
        when: {arch: [sm90, sm100, gfx942]}
        use: [portable]
    fallback: [reference]
  topk:
    fallback: [reference]
  ragged_mqa_logits:
    fallback: [reference]
clusters:
  lab:
    enable: [experimental]
    disable: [vendor.sm90.flatten]
    prefer: [experimental]
"""


def order_plugins() -> list[LoadedPlugin]:
    paged = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND})
    return [
        fake_plugin(
            "vendor",
            fake_backend("vendor.sm90", archs=frozenset({Arch.SM90}), next_n_max=2, forward_modes=paged),
            fake_backend(
                "vendor.sm90.flatten", layout=Layout.FLATTEN, archs=frozenset({Arch.SM90}), forward_modes=paged
            ),
            distribution="dist-vendor",
        ),
        fake_plugin(
            "rocm",
            fake_backend("vendor.rocm", archs=frozenset({Arch.GFX942}), forward_modes=paged),
            distribution="dist-rocm",
        ),
        fake_plugin(
            "portable",
            fake_backend("portable", archs=frozenset(Arch) - {Arch.CPU, Arch.SM80}, forward_modes=paged),
            fake_backend("portable", Op.INDEXER_Q_QUANT, archs=frozenset(Arch) - {Arch.CPU}),
            distribution="dist-portable",
        ),
        fake_plugin(
            "reference",
            fake_backend("reference", forward_modes=paged),
            fake_backend("reference", Op.INDEXER_Q_QUANT),
            fake_backend("reference", Op.TOPK), fake_backend("reference", Op.RAGGED_MQA_LOGITS),
            fake_backend("experimental", next_n_min=3, forward_modes=paged),
            distribution="dist-reference",
        ),
    ]


def sweep(plugins: list[LoadedPlugin], cluster: str | None) -> list:
    catalog = collect_backends(plugins)
    chooser = Dispatcher(
        registry(ORDER_REGISTRY), catalog, cluster=cluster, target_arch=Arch.SM90, check_availability=False
    )
    out = []
    for key in all_keys(5):
        for op in Op:
            try:
                out.append(chooser.decide(op, key).as_dict())
            except NoBackendError as error:
                out.append(str(error))
    return out


@pytest.mark.parametrize("cluster", [None, "lab"])
def test_decisions_do_not_depend_on_registration_order(cluster):
    plugins = order_plugins()
    expected = sweep(plugins, cluster)
    # the sweep exercises every path, so agreement below is not agreement on trivia
    decided = [d for d in expected if isinstance(d, dict)]
    assert {d["source"] for d in decided} == (
        {"rule", "fallback", "cluster-prefer"} if cluster else {"rule", "fallback"}
    )
    assert {d["backend"] for d in decided} >= {"vendor.sm90", "vendor.rocm", "portable", "reference"}
    assert any(isinstance(d, str) for d in expected)  # extend / idle: no backend
    permutations = list(itertools.permutations(plugins))
    assert len(permutations) == 24
    for permutation in permutations:
        assert sweep(list(permutation), cluster) == expected, [p.name for p in permutation]
