"""Plugins are checked where they register: every Backend field, names by fullmatch, probe results when
they run; a plugin that exits or raises a BaseException is a PluginError naming it (never exit 0); the
allowlist accepts normalized distribution names, warns about entries that match nothing, and an unknown
backend name points at an installed plugin the allowlist leaves out."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest

from dispatch.contract.backend import Availability, Backend, Support
from dispatch.cli.commands import main
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.errors import PluginError
from dispatch.cli.explain import backend_row, decision_text
from dispatch.contract.key import Arch, DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.contract.layout import Layout
from dispatch.contract.host import collect_backends, entry_point_plugins, normalized
from tests.support.fakes import fake_plugin, registry
from tests.contract.test_plugins import Site

KEY = DispatchKey(Arch.SM90, ForwardMode.TARGET_VERIFY, 2, Fp8Dtype.E4M3FN)


@pytest.fixture
def site(tmp_path, monkeypatch):
    made = Site(tmp_path, monkeypatch)
    monkeypatch.delenv("DISPATCH_PLUGINS", raising=False)
    yield made
    for name in [m for m in sys.modules if m.startswith(made.prefix)]:
        del sys.modules[name]


def _paged_run(plan, q, kv_cache, weights, *, clean_logits=True):  # the op's call, never made here
    raise AssertionError("not run")


def backend(**changes) -> Backend:
    fields = {"name": "ok", "op": Op.PAGED_MQA_LOGITS, "layout": Layout.NATIVE, "supports": Support(), "run": _paged_run}
    return Backend(**{**fields, **changes})


@pytest.mark.parametrize(
    "registration, words",
    [
        (backend(supports=None), "supports=None; expected a dispatch.contract.Support"),
        (backend(supports=Support(archs="sm90")), "supports.archs='sm90'; expected a frozenset of dispatch.contract.key.Arch"),
        (backend(supports=Support(archs=frozenset({"sm90"}))), "supports.archs=frozenset({'sm90'})"),
        (backend(supports=Support(forward_modes={ForwardMode.DECODE})), "supports.forward_modes={"),
        (backend(supports=Support(fp8_dtypes=frozenset({Arch.SM90}))), "expected a frozenset of dispatch.contract.key.Fp8Dtype"),
        (backend(supports=Support(next_n_min=0)), "supports.next_n_min=0; expected an int >= 1"),
        (backend(supports=Support(next_n_min=3, next_n_max=2)), "supports.next_n_max=2"),
        (backend(supports=Support(next_n_max=2.5)), "supports.next_n_max=2.5"),
        (backend(supports=Support(extra="next_n in {1, 2}")), "supports.extra='next_n in {1, 2}'"),
        (backend(name="trailing\n"), "backend name 'trailing\\n'; names are lowercase"),
        (backend(name=42), "backend name 42; names are lowercase"),
        (backend(op="paged_mqa_logits"), "with op 'paged_mqa_logits'; expected a dispatch.contract.Op"),
        (backend(layout="native"), "with layout 'native'; that op takes: native, flatten"),
        (backend(run=None), "whose `run` is not callable"),
        # The op's Protocol is the one signature: a run that cannot take its call is refused here.
        (backend(run=lambda plan, q, kv_cache, weights: None),
         "for paged_mqa_logits with a run(plan, q, kv_cache, weights) that cannot take paged_mqa_logits's call"),
        (backend(run=lambda q, kv_cache, weights, *, clean_logits=True: None), "too many positional arguments"),
        (backend(probe=None), "whose `probe` is not callable"),
        (backend(probe=True), "whose `probe` is not callable"),
        (backend(prepare="schedule"), "whose `prepare` is neither None nor callable"),
        (backend(warm="build"), "whose `warm` is neither None nor callable"),
        (backend(version=2.1), "whose `version` is 2.1; expected a str"),
    ],
    ids=lambda value: None if isinstance(value, Backend) else value[:30],
)
def test_every_field_is_checked_at_registration_naming_plugin_and_distribution(registration, words):
    with pytest.raises(PluginError) as error:
        collect_backends([fake_plugin("sloppy", registration, distribution="dispatch-sloppy")])
    message = str(error.value)
    assert message.startswith("plugin `sloppy` (distribution `dispatch-sloppy`) registered"), message
    assert words in message, message


@pytest.mark.parametrize("result", [True, None, "yes", Availability])
def test_a_probe_returning_something_else_is_a_plugin_error_when_it_runs(result):
    catalog = collect_backends(
        [fake_plugin("liar", backend(name="liar", probe=lambda: result), distribution="dispatch-liar")]
    )
    text = "version: 1\nops:\n  paged_mqa_logits: {fallback: [liar]}\n  indexer_q_quant: {fallback: [q]}\n  topk: {fallback: [topk]}\n  ragged_mqa_logits: {fallback: [topk]}\n"
    dispatcher = Dispatcher(registry(text), catalog, cluster=None, target_arch=Arch.SM90, check_availability=True)
    with pytest.raises(PluginError) as error:
        dispatcher.decide(Op.PAGED_MQA_LOGITS, KEY)
    message = str(error.value)
    assert message.startswith("plugin `liar` (distribution `dispatch-liar`): the probe of backend `liar` returned")
    assert "expected dispatch.contract.backend.Availability" in message


def test_a_probe_that_exits_means_unavailable_not_a_dead_process():
    def probe():
        sys.exit(0)

    catalog = collect_backends([fake_plugin("quitter", backend(name="quitter", probe=probe))])
    availability = catalog.get(Op.PAGED_MQA_LOGITS, "quitter").availability()
    assert not availability.ok and "SystemExit" in availability.reason


HOOK = """\
from dispatch.contract.hookspecs import hookimpl


@hookimpl
def register_backends(register):
    {body}
"""


@pytest.mark.parametrize(
    "where, source",
    [
        ("import", "import sys\nsys.exit(0)\n"),
        ("import", "raise GeneratorExit('at import')\n"),
        ("hook", HOOK.format(body="raise SystemExit(0)")),
        ("hook", HOOK.format(body="raise GeneratorExit('in the hook')")),
    ],
    ids=["exit-at-import", "generator-exit-at-import", "exit-in-hook", "generator-exit-in-hook"],
)
def test_base_exceptions_from_a_plugin_are_plugin_errors(site, where, source):
    site.distribution("dispatch-exiter", {"exiter": site.module("exiter", source)})
    with pytest.raises(PluginError) as error:
        collect_backends(entry_point_plugins(frozenset({"exiter"})))
    message = str(error.value)
    assert "plugin `exiter` (distribution `dispatch-exiter`)" in message
    assert ("failed to import" if where == "import" else "raised in register_backends") in message


def test_validate_with_a_plugin_that_exits_at_import_fails_with_exit_2(site, monkeypatch, capsys):
    site.distribution("dispatch-exiter", {"exiter": site.module("exiter", "import sys\nsys.exit(0)\n")})
    monkeypatch.setenv("DISPATCH_PLUGINS", "exiter")
    code = main(["validate"])
    err = capsys.readouterr().err
    assert code == 2
    assert "plugin `exiter` (distribution `dispatch-exiter`) failed to import" in err and "SystemExit" in err


def test_keyboard_interrupt_still_interrupts(site):
    site.distribution("dispatch-ctrl-c", {"ctrl-c": site.module("ctrlc", HOOK.format(body="raise KeyboardInterrupt"))})
    with pytest.raises(KeyboardInterrupt):
        collect_backends(entry_point_plugins(frozenset({"ctrl-c"})))


# --- the allowlist -----------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["acme_dispatch_plugin", "Acme.Dispatch-Plugin", "acme-dispatch-plugin"])
def test_distribution_names_are_compared_normalized(site, entry):
    site.distribution("acme-dispatch-plugin", {"acme": site.plugin_module("acme", "acme.fast")})
    assert [p.name for p in entry_point_plugins(frozenset({entry}))] == ["acme"]
    assert normalized(entry) == "acme-dispatch-plugin"


def test_an_allowlist_entry_matching_nothing_is_a_warning_naming_it(site, caplog):
    site.distribution("acme-dispatch-plugin", {"acme": site.plugin_module("acme", "acme.fast")})
    with caplog.at_level(logging.WARNING, logger="dispatch"):
        loaded = entry_point_plugins(frozenset({"acme", "acne"}))
    assert [p.name for p in loaded] == ["acme"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "DISPATCH_PLUGINS names `acne`, which matches no installed plugin" in warnings[0]
    assert "acme" in warnings[0]


def test_an_unknown_backend_names_the_installed_plugin_left_out(site, monkeypatch, tmp_path, capsys):
    site.distribution("acme-dispatch-plugin", {"acme": site.plugin_module("acme", "acme.fast")})
    monkeypatch.setenv("DISPATCH_PLUGINS", "something-else")
    path = tmp_path / "registry.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            version: 1
            ops:
              paged_mqa_logits: {fallback: [torch.reference]}
              indexer_q_quant: {fallback: [torch.reference]}
              topk: {fallback: [torch.reference]}
              ragged_mqa_logits: {fallback: [torch.reference]}
            clusters:
              acme:
                prefer: [acme.fast]
            """
        )
    )
    code = main(["validate", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{path}:9: clusters.acme.prefer[0]: unknown backend `acme.fast`" in err
    assert "plugin `acme` (distribution `acme-dispatch-plugin`) is installed but not allowed and may register it" in err
    assert "set DISPATCH_PLUGINS=something-else,acme" in err
    assert site.imported() == set()  # the plugin left out was never imported to find that out
    monkeypatch.setenv("DISPATCH_PLUGINS", "something-else,acme")
    main(["validate", str(path)])
    assert "unknown backend" not in capsys.readouterr().err


# --- versions ---------------------------------------------------------------------------------------


def test_the_plugin_version_is_the_distributions_and_the_library_version_stays_separate(site):
    site.distribution("acme-dispatch-plugin", {"acme": site.plugin_module("acme", "acme.fast")})
    catalog = collect_backends(entry_point_plugins(frozenset({"acme"})))
    impl = catalog.get(Op.PAGED_MQA_LOGITS, "acme.fast")
    assert (impl.plugin_version, impl.version) == ("1.0", "")
    row = backend_row(impl)
    assert (row["plugin_version"], row["version"]) == ("1.0", "")
    text = "version: 1\nops:\n  paged_mqa_logits: {fallback: [acme.fast]}\n  indexer_q_quant: {fallback: [q]}\n  topk: {fallback: [topk]}\n  ragged_mqa_logits: {fallback: [topk]}\n"
    dispatcher = Dispatcher(registry(text), catalog, cluster=None, target_arch=Arch.SM90, check_availability=False)
    shown = decision_text(dispatcher.decide(Op.PAGED_MQA_LOGITS, KEY), dispatcher)
    assert "plugin:   acme (distribution acme-dispatch-plugin 1.0; library version -)" in shown


def test_builtin_backends_show_the_library_version_apart_from_the_plugin_version():
    from dispatch.deciding.runtime import load_plugins

    catalog = collect_backends(load_plugins(frozenset()))
    reference = catalog.get(Op.PAGED_MQA_LOGITS, "torch.reference")
    import importlib.metadata

    assert reference.version == importlib.metadata.version("torch")
    assert reference.distribution == "dispatch-dsa" and reference.plugin_version != reference.version
