"""Backends' warm-ups (the slow first-use work, e.g. cuda.radix's nvcc build): which run, where (the
CLI's `backends --warm`, IndexerStep.warm(), an engine's dispatcher), and a failure as a BackendError
naming the backend (never a quietly different choice on one rank)."""

from __future__ import annotations

import pytest

from dispatch.contract.backend import Availability, Backend, Support
from dispatch.contract.errors import BackendError
from dispatch.contract.key import Arch, Op
from dispatch.contract.layout import Layout
from dispatch.deciding import runtime
from dispatch.deciding.warming import warm_backend, warm_for, warmable
from dispatch.engines.indexer_step import IndexerStep
from tests.support.cli_session import clean_environment, run  # noqa: F401 (clean_environment: an autouse fixture)
from tests.support.fakes import catalog_of, dispatcher, fake_plugin

REGISTRY = """\
version: 1
ops:
  topk: {fallback: [ready, broken, elsewhere, cold, plain]}
  paged_mqa_logits: {fallback: [plain]}
  indexer_q_quant: {fallback: [plain]}
  ragged_mqa_logits: {fallback: [plain]}
"""


def topk_backend(name: str, *, warm=None, archs=frozenset({Arch.SM90, Arch.CPU}), available=True) -> Backend:
    probe = Availability.yes if available else (lambda: Availability.no("no such device here"))
    return Backend(name=name, op=Op.TOPK, layout=Layout.ROWS, supports=Support(archs=archs), run=print, probe=probe,
                   warm=warm)


def recording(calls: list, name: str, result=None):
    def warm():
        calls.append(name)
        if isinstance(result, Exception):
            raise result
        return Availability.yes() if result is None else result
    return warm


def backends(calls: list) -> list[Backend]:
    return [
        topk_backend("ready", warm=recording(calls, "ready")),
        topk_backend("broken", warm=recording(calls, "broken", RuntimeError("nvcc: error: bad flag"))),
        topk_backend("elsewhere", warm=recording(calls, "elsewhere"), archs=frozenset({Arch.SM100})),
        topk_backend("cold", warm=recording(calls, "cold"), available=False),
        topk_backend("plain"),
    ]


def test_warmable_are_those_with_a_warm_up_for_the_arch_and_available_if_asked():
    catalog = catalog_of(*backends([]))
    assert [b.name for b in warmable(catalog, Arch.SM90, available_only=False)] == ["broken", "cold", "ready"]
    assert [b.name for b in warmable(catalog, Arch.SM90, available_only=True)] == ["broken", "ready"]
    assert [b.name for b in warmable(catalog, Arch.SM100, available_only=False)] == ["elsewhere"]


def test_a_failing_warm_up_is_a_backend_error_naming_backend_and_plugin():
    [broken] = [b for b in catalog_of(*backends([])).backends if b.name == "broken"]
    with pytest.raises(BackendError, match=r"backend `broken` \(plugin `plugin-topk-broken`\) failed to warm up for "
                                           r"topk: RuntimeError: nvcc: error: bad flag"):
        warm_backend(broken)
    with pytest.raises(BackendError, match="warm\\(\\) returned bool; expected"):
        warm_backend(topk_backend("odd", warm=lambda: True))


def test_the_step_warms_what_this_machine_may_decide_and_stops_at_a_failure():
    calls = []
    step = IndexerStep(dispatcher(REGISTRY, catalog_of(*backends(calls)), arch=Arch.SM90), kv_fp8_dtype="e4m3fn",
                       rope=None, softmax_scale=1.0, head_scale=1.0)
    with pytest.raises(BackendError, match="`broken`"):
        step.warm()
    assert calls == ["broken"]  # catalog order; the unavailable and the other arch's never run
    calls.clear()
    good = [b for b in backends(calls) if b.name != "broken"]
    warmed = IndexerStep(dispatcher(REGISTRY, catalog_of(*good), arch=Arch.SM90), kv_fp8_dtype="e4m3fn", rope=None,
                         softmax_scale=1.0, head_scale=1.0).warm()
    assert calls == ["ready"] and [(w.backend.name, w.availability.ok) for w in warmed] == [("ready", True)]


def test_a_what_if_dispatcher_warms_nothing():
    calls = []
    assert warm_for(dispatcher(REGISTRY, catalog_of(*backends(calls)), arch=Arch.SM90, check_availability=False)) == []
    assert calls == []


def test_backends_warm_reports_each_and_exits_3_when_one_fails(capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(runtime, "load_plugins", lambda *a, **k: [fake_plugin("fakes", *backends(calls))])
    monkeypatch.setenv("DISPATCH_ARCH", "sm90")
    code, out, err = run(capsys, "backends", "--warm")
    assert code == 3 and calls == ["broken", "cold", "ready"]  # an unavailable one too: a cached failure is retried
    assert "warm: ready: ready (" in err and "warm: broken: FAILED" in err and "warm: cold: ready (" in err
    assert "dispatch: backend `broken` (plugin `fakes`) failed to warm up for topk" in err
    assert "ready  [topk, rows]" in out  # the listing still comes


def test_backends_warm_where_nothing_fails_exits_0_and_says_what_had_nothing_to_build(capsys, monkeypatch):
    calls = []
    quiet = topk_backend("quiet", warm=recording(calls, "quiet", Availability.no("no CUDA device visible to torch")))
    monkeypatch.setattr(runtime, "load_plugins", lambda *a, **k: [fake_plugin("fakes", quiet)])
    monkeypatch.setenv("DISPATCH_ARCH", "cpu")
    code, _, err = run(capsys, "backends", "--warm")
    assert code == 0 and calls == ["quiet"]
    assert "warm: quiet: nothing to build here: no CUDA device visible to torch" in err
