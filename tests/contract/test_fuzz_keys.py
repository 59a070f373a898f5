"""Fuzzing dispatch keys against the project's registry and the real catalog: every key that can occur
gets a Decision, or a NoBackendError that gives every candidate of the op a reason; two fresh
dispatchers decide alike; a key that cannot occur raises InvalidKeyError and nothing else."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.errors import InvalidKeyError, NoBackendError
from dispatch.contract.key import FP8_DTYPES_BY_ARCH, Arch, DispatchKey, ForwardMode, Fp8Dtype, Op
from dispatch.contract.host import collect_backends
from dispatch.registry.document import load_registry
from dispatch.deciding.runtime import DEFAULT_REGISTRY, load_plugins

DOCUMENT = load_registry(DEFAULT_REGISTRY)
CATALOG = collect_backends(load_plugins(frozenset()))
CLUSTERS = st.sampled_from([None, *DOCUMENT.registry.clusters])


def can_occur(arch: Arch, mode: ForwardMode, next_n: int, fp8: Fp8Dtype) -> bool:
    """The key's rules, restated: decode scores one token; an arch holds only its own fp8 dtypes."""
    return (mode is not ForwardMode.DECODE or next_n == 1) and fp8 in FP8_DTYPES_BY_ARCH[arch]


def outcome(op: Op, key: DispatchKey, cluster: str | None, check: bool):
    """A fresh dispatcher's decision as a plain value, or its NoBackendError."""
    dispatcher = Dispatcher(DOCUMENT, CATALOG, cluster=cluster, target_arch=key.arch, check_availability=check)
    try:
        return dispatcher.decide(op, key)
    except NoBackendError as error:
        return error


def assert_explains_every_candidate(error: NoBackendError, op: Op, key: DispatchKey) -> None:
    header, *lines = str(error).splitlines()
    assert header == f"no backend for {op.value} at {key}:"
    reasons = dict(line.strip().split(": ", 1) for line in lines)
    assert sorted(reasons) == CATALOG.names(op) and len(lines) == len(reasons)
    assert all(reason.strip() for reason in reasons.values())


def assert_sound(decision, op: Op, key: DispatchKey, cluster: str | None, check: bool) -> None:
    assert (decision.op, decision.key, decision.cluster) == (op, key, cluster)
    assert decision.impl is CATALOG.get(op, decision.backend)
    assert decision.impl.supports.why_not(key) is None
    assert decision.availability_checked is check and (not check or decision.impl.availability().ok)
    assert decision.registry_fingerprint == DOCUMENT.fingerprint
    rejected = [r.backend for r in decision.rejected]
    assert sorted(rejected + [decision.backend]) == CATALOG.names(op) and len(set(rejected)) == len(rejected)
    assert all(r.reason.strip() for r in decision.rejected)


@settings(max_examples=250, deadline=None)
@given(
    arch=st.sampled_from(Arch),
    mode=st.sampled_from(ForwardMode),
    next_n=st.integers(1, 64),
    fp8=st.sampled_from(Fp8Dtype),
    cluster=CLUSTERS,
    check=st.booleans(),
)
def test_every_key_is_decided_or_explained_and_deterministic(arch, mode, next_n, fp8, cluster, check):
    try:
        key = DispatchKey(arch, mode, next_n, fp8)
    except InvalidKeyError:
        assert not can_occur(arch, mode, next_n, fp8)
        return
    assert can_occur(arch, mode, next_n, fp8)
    for op in Op:
        first, second = outcome(op, key, cluster, check), outcome(op, key, cluster, check)
        if isinstance(first, NoBackendError):
            assert_explains_every_candidate(first, op, key)
            assert isinstance(second, NoBackendError) and str(second) == str(first)
        else:
            assert_sound(first, op, key, cluster, check)
            assert first is not second and first.as_dict() == second.as_dict()


RAW = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.floats(), st.text(max_size=8), st.lists(st.integers()))


@settings(max_examples=200, deadline=None)
@given(
    arch=st.one_of(st.sampled_from([a.value for a in Arch]), RAW),
    mode=st.one_of(st.sampled_from([m.value for m in ForwardMode]), RAW),
    next_n=st.one_of(st.integers(-3, 70), RAW),
    fp8=st.one_of(st.sampled_from([d.value for d in Fp8Dtype]), RAW),
)
def test_a_key_that_cannot_occur_raises_invalid_key_error_only(arch, mode, next_n, fp8):
    try:
        key = DispatchKey(arch, mode, next_n, fp8)
    except InvalidKeyError as error:
        assert str(error).startswith("`"), str(error)  # it names the field first
        return
    assert (key.arch.value, key.forward_mode.value, key.next_n, key.fp8_dtype.value) == (arch, mode, next_n, fp8)
    assert type(next_n) is int and can_occur(key.arch, key.forward_mode, next_n, key.fp8_dtype)
