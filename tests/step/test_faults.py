"""Faults at run time: a backend that raises, and registry edits reloaded under a running engine."""

from __future__ import annotations

import threading

import pytest
import torch

from dispatch.contract.errors import BackendError, DtypeMismatchError, LayoutError, RegistryError
from dispatch.contract.key import Arch, DispatchKey, ForwardMode, Fp8Dtype, Op
from dispatch.contract.ops import indexer_q_quant, paged_mqa_logits
from dispatch.step.paged_plan import PagedBatch, build_plan
from dispatch.engines.reloading import LiveDispatcher, ReloadResult
from dispatch.contract.rope import RopeSpec
from tests.support.fakes import catalog_of, dispatcher, fake_backend
from tests.support.shipped import shipped_registry_text

LOGITS, QUANT = Op.PAGED_MQA_LOGITS, Op.INDEXER_Q_QUANT
KEY = DispatchKey(Arch.SM90, ForwardMode.TARGET_VERIFY, 2, Fp8Dtype.E4M3FN)

# --- a backend that raises -------------------------------------------------------------------------

FAULTS = """\
version: 1
ops:
  paged_mqa_logits:
    rules:
      - id: sm90-faulty
        when: {arch: sm90}
        use: [faulty]
    fallback: [healthy]
  indexer_q_quant:
    fallback: [faulty]
  topk:
    fallback: [topk]
  ragged_mqa_logits:
    fallback: [topk]
"""


def raising(error: Exception):
    def run(*args, **kwargs):
        raise error

    return run


def plan_with(logits_error: Exception, quant_error: Exception | None = None):
    catalog = catalog_of(
        fake_backend("faulty", run=raising(logits_error)),
        fake_backend("healthy", run=lambda *a, **k: "healthy ran"),
        fake_backend("faulty", QUANT, run=raising(quant_error or logits_error)),
        fake_backend("topk", Op.TOPK), fake_backend("topk", Op.RAGGED_MQA_LOGITS),
    )
    batch = PagedBatch(
        seq_lens=torch.tensor([5, 9], dtype=torch.int32),
        page_table=torch.zeros(2, 1, dtype=torch.int32),
        max_seq_len=9,
        forward_mode=ForwardMode.TARGET_VERIFY,
        next_n=2,
    )
    return build_plan(dispatcher(FAULTS, catalog), batch, kv_fp8_dtype="e4m3fn")


def logits_inputs(tokens: int):
    """Inputs that pass the op's checks (they run before any backend): fp8 q [T, 16, 32], a one-block
    cache, fp32 weights; the faulty backend never reads them."""
    q = torch.zeros(tokens, 16, 32).to(torch.float8_e4m3fn)
    return q, torch.zeros(1, 64, 1, 36, dtype=torch.uint8), torch.zeros(tokens, 16)


def call_logits(plan):
    return paged_mqa_logits(plan, *logits_inputs(4))


def test_a_backend_that_raises_is_a_backend_error_naming_backend_op_key_and_rule():
    launch_failure = RuntimeError("CUDA error: too many resources requested for launch")
    plan = plan_with(launch_failure)
    with pytest.raises(BackendError) as error:
        call_logits(plan)
    message = str(error.value)
    assert message.startswith("backend `faulty` (plugin `plugin-paged_mqa_logits-faulty`) raised RuntimeError")
    assert f"running paged_mqa_logits at {KEY}, chosen by rule `sm90-faulty`" in message
    assert message.endswith(": CUDA error: too many resources requested for launch")
    assert error.value.__cause__ is launch_failure


def test_a_prepare_that_raises_is_a_backend_error_and_no_plan_is_returned():
    schedule_failure = RuntimeError("schedule kernel failed")
    catalog = catalog_of(
        fake_backend("faulty", prepare=raising(schedule_failure)),
        fake_backend("healthy"),
        fake_backend("faulty", QUANT),
        fake_backend("topk", Op.TOPK), fake_backend("topk", Op.RAGGED_MQA_LOGITS),
    )
    batch = PagedBatch(torch.tensor([5, 9], dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), 9,
                         ForwardMode.TARGET_VERIFY, 2)
    with pytest.raises(BackendError) as error:
        build_plan(dispatcher(FAULTS, catalog), batch, kv_fp8_dtype="e4m3fn")
    assert "raised RuntimeError preparing a batch for paged_mqa_logits" in str(error.value)
    assert "chosen by rule `sm90-faulty`" in str(error.value)
    assert error.value.__cause__ is schedule_failure


def test_no_fallback_to_another_backend_after_a_fault():
    # `healthy` is the fallback and would run; the fault must surface instead of switching paths.
    with pytest.raises(BackendError, match="`faulty`"):
        call_logits(plan_with(RuntimeError("boom")))


def test_q_quant_fault_names_the_fallback_that_chose_it():
    plan = plan_with(RuntimeError("logits"), quant_error=ValueError("bad launch grid"))
    args = (torch.zeros(4, 16, 32), torch.zeros(4, 16), torch.zeros(4, dtype=torch.int64), torch.zeros(8, 32))
    with pytest.raises(BackendError) as error:
        indexer_q_quant(plan, *args, rope=RopeSpec(), softmax_scale=1.0, head_scale=1.0)
    assert "backend `faulty`" in str(error.value) and "running indexer_q_quant" in str(error.value)
    assert "chosen by fallback[0]: bad launch grid" in str(error.value)
    assert isinstance(error.value.__cause__, ValueError)


def test_a_pinned_backend_fault_says_pinned():
    catalog = catalog_of(fake_backend("faulty", run=raising(RuntimeError("x"))), fake_backend("q", QUANT), fake_backend("topk", Op.TOPK), fake_backend("topk", Op.RAGGED_MQA_LOGITS))
    text = "version: 1\nops:\n  paged_mqa_logits:\n    fallback: [faulty]\n  indexer_q_quant:\n    fallback: [q]\n  topk:\n    fallback: [topk]\n  ragged_mqa_logits:\n    fallback: [topk]\n"
    batch = PagedBatch(torch.tensor([3], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 3, "decode", 1)
    plan = build_plan(dispatcher(text, catalog), batch, kv_fp8_dtype="e4m3fn", pinned={LOGITS: "faulty"})
    with pytest.raises(BackendError, match="chosen by pinned: x$"):
        paged_mqa_logits(plan, *logits_inputs(1))


@pytest.mark.parametrize(
    "error",
    [
        LayoutError("q has the wrong layout"),
        DtypeMismatchError("q is fnuz"),
        torch.cuda.OutOfMemoryError("CUDA out of memory"),  # the engine's to handle, by type
    ],
    ids=["layout", "dtype", "out-of-memory"],
)
def test_project_errors_and_out_of_memory_pass_through_unchanged(error):
    with pytest.raises(type(error)) as raised:
        call_logits(plan_with(error))
    assert raised.value is error


# --- reloading the registry ------------------------------------------------------------------------

REGISTRY = """\
version: 1
ops:
  paged_mqa_logits:
    rules:
      - id: sm90
        when: {{arch: sm90}}
        use: [{backend}]
    fallback: [a]
  indexer_q_quant:
    fallback: [q]
  topk:
    fallback: [topk]
  ragged_mqa_logits:
    fallback: [topk]
clusters:
  ops-team:
    description: {description}
"""


def registry_text(backend: str = "a", description: str = "x") -> str:
    return REGISTRY.format(backend=backend, description=description)


def reload_catalog():
    return catalog_of(fake_backend("a"), fake_backend("b"), fake_backend("q", QUANT), fake_backend("topk", Op.TOPK), fake_backend("topk", Op.RAGGED_MQA_LOGITS))


@pytest.fixture
def live(tmp_path, monkeypatch):
    monkeypatch.delenv("DISPATCH_CLUSTER", raising=False)
    path = tmp_path / "registry.yaml"
    path.write_text(registry_text("a"))
    return LiveDispatcher(path, catalog=reload_catalog(), arch="sm90")


def test_a_good_edit_swaps_in_a_new_registry(live):
    old = live.current
    before = old.decide(LOGITS, KEY)
    live.path.write_text(registry_text("b"))
    result = live.reload()
    assert result == ReloadResult(True, old.fingerprint, live.current.fingerprint)
    assert result.fingerprint_after != result.fingerprint_before
    after = live.current.decide(LOGITS, KEY)
    assert (before.backend, after.backend) == ("a", "b")
    assert after.registry_fingerprint == result.fingerprint_after
    # The decision made before the reload is unchanged, and the old dispatcher still serves it.
    assert before.backend == "a" and old.decide(LOGITS, KEY) is before


def test_an_unchanged_file_reloads_with_the_same_fingerprint_and_a_fresh_cache(live):
    old = live.current
    result = live.reload()
    assert result.ok and result.fingerprint_after == result.fingerprint_before
    assert live.current is not old


@pytest.mark.parametrize(
    "text, located",
    [
        (registry_text("b").replace("use: [b]", "use: [b"), ":8: not valid YAML: a [list] not closed with `]`"),
        (registry_text("zz"), ":7: ops.paged_mqa_logits.rules[0].use[0]: unknown backend `zz`"),
        (registry_text("b").replace("version: 1", "version: 2"), ":1: version: Input should be 1"),
    ],
    ids=["invalid-yaml", "unknown-backend", "schema"],
)
def test_a_bad_edit_keeps_the_old_registry_and_says_where(live, text, located):
    old = live.current
    live.path.write_text(text)
    result = live.reload()
    assert not result.ok
    assert result.fingerprint_after == result.fingerprint_before == old.fingerprint
    assert result.error.startswith(f"{live.path}{located}"), result.error
    assert live.current is old and live.current.decide(LOGITS, KEY).backend == "a"


def test_a_deleted_file_keeps_the_old_registry(live):
    old = live.current
    live.path.unlink()
    result = live.reload()
    assert not result.ok and live.current is old
    assert result.error.startswith(f"{live.path}: cannot read the registry")


def test_a_cluster_the_new_file_no_longer_declares_keeps_the_old_registry(tmp_path, monkeypatch):
    monkeypatch.delenv("DISPATCH_CLUSTER", raising=False)
    path = tmp_path / "registry.yaml"
    path.write_text(registry_text())
    live = LiveDispatcher(path, catalog=reload_catalog(), arch="sm90", cluster="ops-team")
    old = live.current
    path.write_text(registry_text().replace("ops-team", "renamed"))
    result = live.reload()
    assert not result.ok and live.current is old and old.cluster == "ops-team"
    assert result.error == f"{path}: unknown cluster `ops-team` (declared: `renamed`)"


def test_the_first_load_has_nothing_to_keep_and_raises(tmp_path):
    with pytest.raises(RegistryError, match="missing.yaml: no registry file there"):
        LiveDispatcher(tmp_path / "missing.yaml", catalog=reload_catalog(), arch="sm90")


def test_a_live_dispatcher_from_a_path_alone(tmp_path, monkeypatch):
    from dispatch.deciding.runtime import DEFAULT_REGISTRY

    monkeypatch.delenv("DISPATCH_REGISTRY", raising=False)
    path = tmp_path / "registry.yaml"
    path.write_text(shipped_registry_text())
    live = LiveDispatcher(path)
    assert live.path == path and live.current.catalog.get(Op.PAGED_MQA_LOGITS, "triton") is not None
    assert live.reload().ok
    assert LiveDispatcher().path == DEFAULT_REGISTRY


def test_readers_never_see_an_error_or_a_mix_while_reloads_run(live):
    texts = [registry_text("a", "first"), "version: [", registry_text("b", "second"), registry_text("zz")]
    valid = {}
    for text in (texts[0], texts[2]):
        live.path.write_text(text)
        assert live.reload().ok
        valid[live.current.fingerprint] = live.current.decide(LOGITS, KEY).backend
    assert sorted(valid.values()) == ["a", "b"]
    stop = threading.Event()
    seen: list[tuple[str, str]] = []
    failures: list[BaseException] = []
    keys = [DispatchKey(Arch.SM90, ForwardMode.TARGET_VERIFY, n, Fp8Dtype.E4M3FN) for n in (2, 3, 4)]

    def read():
        try:
            while not stop.is_set():
                for key in keys:
                    decision = live.current.decide(LOGITS, key)
                    seen.append((decision.registry_fingerprint, decision.backend))
        except BaseException as error:  # any exception in a reader fails the test below
            failures.append(error)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for reader in readers:
        reader.start()
    results = []
    for round_ in range(24):
        live.path.write_text(texts[round_ % len(texts)])
        results.append(live.reload())
    stop.set()
    for reader in readers:
        reader.join()
    assert not failures
    assert [r.ok for r in results[:4]] == [True, False, True, False]
    assert len(seen) > len(results)
    # Readers saw both registries, and each decision came whole from one: its fingerprint and backend agree.
    assert {fingerprint for fingerprint, _ in seen} == set(valid)
    assert all(valid[fingerprint] == backend for fingerprint, backend in seen)
