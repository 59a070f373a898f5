"""A reload never loses coverage silently: a registry under which a key that decided before would have
no backend is refused (keys named) unless forced, and a file caught half-written is never swapped in
with fewer keys served. Checked on every line-boundary prefix of the shipped registry and on sampled
byte prefixes."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatch.contract.errors import NoBackendError
from dispatch.contract.key import Arch, DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.registry.checks import all_keys
from dispatch.engines.reloading import LiveDispatcher
from dispatch.deciding.runtime import DEFAULT_REGISTRY
from tests.support.fakes import catalog_of, fake_backend
from tests.support.shipped import shipped_registry_text

SHIPPED = shipped_registry_text()
LOGITS, QUANT = Op.PAGED_MQA_LOGITS, Op.INDEXER_Q_QUANT

TWO_RULES = """\
version: 1
ops:
  paged_mqa_logits:
    rules:
      - id: sm90
        when: {arch: sm90}
        use: [a]
    fallback: [wide]
  indexer_q_quant:
    fallback: [q]
  topk:
    fallback: [topk]
  ragged_mqa_logits:
    fallback: [topk]
"""


def catalog():
    return catalog_of(
        fake_backend("a"), fake_backend("wide", next_n_max=4), fake_backend("q", QUANT), fake_backend("topk", Op.TOPK), fake_backend("topk", Op.RAGGED_MQA_LOGITS)
    )


@pytest.fixture
def live(tmp_path, monkeypatch):
    monkeypatch.delenv("DISPATCH_CLUSTER", raising=False)
    path = tmp_path / "registry.yaml"
    path.write_text(TWO_RULES)
    return LiveDispatcher(path, catalog=catalog(), arch="sm90")


def test_a_reload_that_would_lose_keys_is_refused_and_names_them(live):
    old = live.current
    live.path.write_text(TWO_RULES.replace("        when: {arch: sm90}\n", "        when: {arch: sm90, next_n: 1}\n"))
    result = live.reload()
    assert not result.ok and live.current is old
    assert result.fingerprint_after == result.fingerprint_before
    # sm90 keys past next_n 4 were served by `a` through the rule; `wide` stops at 4.
    assert "refused: keys that decided before would have no backend" in result.error
    assert "paged_mqa_logits at arch=sm90 forward_mode=target_verify next_n=5.. fp8_dtype=e4m3fn" in result.error
    assert "indexer_q_quant" not in result.error
    assert "reload(force=True)" in result.error


def test_force_swaps_it_in_anyway(live):
    live.path.write_text(TWO_RULES.replace("        when: {arch: sm90}\n", "        when: {arch: sm90, next_n: 1}\n"))
    result = live.reload(force=True)
    assert result.ok and result.fingerprint_after != result.fingerprint_before
    with pytest.raises(NoBackendError):
        live.current.decide(LOGITS, DispatchKey(Arch.SM90, ForwardMode.TARGET_VERIFY, 5, Fp8Dtype.E4M3FN))


def test_keys_on_other_archs_count_too(live):
    # This machine is sm90; the fallback is the only path for sm100 keys, and a what-if asks about them.
    small = DispatchKey(Arch.SM100, ForwardMode.TARGET_VERIFY, 3, Fp8Dtype.E4M3FN)
    assert live.current.decide(LOGITS, small).backend == "wide"
    live.path.write_text(TWO_RULES.replace("    fallback: [wide]\n", ""))
    result = live.reload()
    assert not result.ok
    assert "paged_mqa_logits at arch=sm80 forward_mode=decode next_n=1 fp8_dtype=e4m3fn; " in result.error
    assert "; arch=sm80 forward_mode=target_verify next_n=1..4 fp8_dtype=e4m3fn; " in result.error
    assert "; and 34 more" in result.error  # 6 kinds of key shown, the rest counted (sm89 adds 5)
    assert live.reload(force=True).ok
    with pytest.raises(NoBackendError):
        live.current.decide(LOGITS, small)


def test_a_reload_that_keeps_every_key_swaps_in(live):
    live.path.write_text(TWO_RULES.replace("fallback: [wide]", "fallback: [a]"))
    assert live.reload().ok


# --- torn files -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def real_catalog():
    from dispatch.contract.host import collect_backends
    from dispatch.deciding.runtime import load_plugins

    return collect_backends(load_plugins(frozenset()))


def decides(dispatcher, op: Op, key: DispatchKey) -> bool:
    try:
        dispatcher.decide(op, key)
    except NoBackendError:
        return False
    return True


def assert_torn_prefix_never_loses_keys(tmp_path, prefix: str, arch: str) -> None:
    path = tmp_path / f"torn-{arch}.yaml"
    path.write_text(SHIPPED)
    live = LiveDispatcher(path, catalog=real_catalog(), arch=arch, cluster=None)
    old = live.current
    path.write_text(prefix)
    result = live.reload()
    if not result.ok:
        assert live.current is old
        return
    # Swapped in: then it must be a whole registry again, serving every key the whole file served.
    keys = [k for k in all_keys(12) if k.arch.value == arch]
    for op in Op:
        for key in keys:
            assert decides(old, op, key) <= decides(live.current, op, key), (len(prefix), op, key)


LINE_PREFIXES = [SHIPPED[: i + 1] for i, ch in enumerate(SHIPPED) if ch == "\n"]


@pytest.mark.parametrize("arch", ["sm90", "cpu"])
def test_every_line_prefix_of_the_shipped_registry(tmp_path, monkeypatch, arch):
    monkeypatch.delenv("DISPATCH_CLUSTER", raising=False)
    refused = 0
    for prefix in LINE_PREFIXES:
        assert_torn_prefix_never_loses_keys(tmp_path, prefix, arch)
    # The prefixes that end before the last op's fallback are all refused.
    last_fallback = SHIPPED.index("\n", SHIPPED.index("    fallback:", SHIPPED.index("indexer_q_quant:"))) + 1
    for prefix in LINE_PREFIXES:
        if len(prefix) < last_fallback:
            path = tmp_path / "short.yaml"
            path.write_text(SHIPPED)
            live = LiveDispatcher(path, catalog=real_catalog(), arch=arch)
            path.write_text(prefix)
            refused += not live.reload().ok
    assert refused == sum(len(p) < last_fallback for p in LINE_PREFIXES)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, len(SHIPPED) - 1), arch=st.sampled_from(["sm90", "sm100", "gfx942", "cpu"]))
def test_sampled_byte_prefixes_of_the_shipped_registry(tmp_path, monkeypatch, cut, arch):
    monkeypatch.delenv("DISPATCH_CLUSTER", raising=False)
    assert_torn_prefix_never_loses_keys(tmp_path, SHIPPED[:cut], arch)
