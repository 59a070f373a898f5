"""The host cost of a plan, counted: engines build one every batch on the host's critical path, and on a
GPU each torch op that is not a view costs the host a launch (5-10 us on the H200's host), so the count
of such ops is the CPU's proxy for the GPU host's time (`bench --host-time` measures it; issue 24). On the
CPU the extend plan does its arithmetic in numpy (dispatch/step/ragged_on_host.py), which torch does not
see: every call into C the plan makes is counted too, and neither count may grow with the chunks."""

import collections
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dispatch.step.extend_plan import build_extend_plan
from dispatch.contract.key import ForwardMode
from dispatch.step.paged_plan import PagedBatch, build_plan
from dispatch.step.extend_batch import ExtendBatch
from dispatch import load_dispatcher

# Ops that only describe a tensor (no kernel, no allocation): counted apart.
_VIEWS = {"select", "slice", "view", "unsqueeze", "unbind", "reshape", "alias", "expand", "as_strided",
          "narrow", "squeeze", "t", "transpose", "detach", "split", "split_with_sizes"}


class _Launches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> int:
        return sum(n for name, n in self.ops.items() if name not in _VIEWS)


def _launches(fn) -> int:
    with _Launches() as counted:
        fn()
    return counted.launches


def _calls_into_c(fn) -> int:
    """Calls of functions written in C (torch's, numpy's, builtins) made while `fn` runs."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        count += event == "c_call"

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def counted_ops(batch, dispatcher) -> collections.Counter:
    with _Launches() as counted:
        build_extend_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn")
    return counted.ops


def _extend_batch(prefix: int, extend: int = 4096, requests: int = 4) -> ExtendBatch:
    pages = -(-(prefix + extend) // 64)
    table = torch.arange(requests * pages, dtype=torch.int32).view(requests, pages)
    return ExtendBatch.from_lengths([prefix] * requests, [extend] * requests, table, num_kv_blocks=requests * pages)


def test_a_pinned_plan_hashes_the_registry_once_per_dispatcher(monkeypatch):
    """A backend pinned by the engine (IndexerStep's `pinned`) is decided afresh each batch, and its
    decision carries the registry's fingerprint: hashed from the whole document at every pin, it cost a
    plan ~0.9 ms on the H200's host. The dispatcher hashes it once; every decision carries that value."""
    from dispatch.contract.key import Op
    from dispatch.registry.document import RegistryDocument

    hashed = []
    fingerprint = RegistryDocument.fingerprint
    monkeypatch.setattr(RegistryDocument, "fingerprint",
                        property(lambda document: hashed.append(1) or fingerprint.fget(document)))
    dispatcher = load_dispatcher(arch="cpu")
    batch = PagedBatch(seq_lens=torch.full((128,), 4096, dtype=torch.int32),
                       page_table=torch.zeros(128, 64, dtype=torch.int32), max_seq_len=4096,
                       forward_mode=ForwardMode.TARGET_VERIFY, next_n=4)
    plans = [build_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn", pinned={Op.TOPK: "torch.reference"})
             for _ in range(5)]
    assert len(hashed) <= 1  # (0 where loading the registry already asked for it)
    assert {plan.topk.registry_fingerprint for plan in plans} == {dispatcher.document.fingerprint}


def test_a_paged_plan_at_b128_launches_a_handful_of_ops():
    dispatcher = load_dispatcher(arch="cpu")
    batch = PagedBatch(seq_lens=torch.full((128,), 4096, dtype=torch.int32),
                         page_table=torch.zeros(128, 64, dtype=torch.int32), max_seq_len=4096,
                         forward_mode=ForwardMode.TARGET_VERIFY, next_n=4)
    build_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn")  # caches warm, as on every later batch
    # the lengths' add and clamp, the error flags (the unsqueeze is a view)
    assert _launches(lambda: build_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn")) <= 3


@pytest.mark.parametrize("prefix", [0, 12288])  # M = 16K rows, S = 16K and 64K keys
def test_an_extend_plan_at_m16k_makes_a_few_calls_whatever_its_chunks(prefix):
    dispatcher = load_dispatcher(arch="cpu")
    batch = _extend_batch(prefix)
    whole = build_extend_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn", logits_byte_budget=1 << 40)
    chunked = build_extend_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn")
    assert len(whole.chunks) == 1 and len(chunked.chunks) >= 2
    # What no backend reads on this path is not written: the rows' absolute ks / ke wait until asked.
    assert whole.metadata.row_ranges is None and chunked.metadata.row_ranges is None
    one = _launches(lambda: build_extend_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn", logits_byte_budget=1 << 40))
    many = _launches(lambda: build_extend_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn"))
    # 52 before issue 24 (item 5), 37 after its first round, 18 with a torch host path, 6 with the slots'
    # torch broadcast add; now the error flags and the four numpy arrays taken as tensors (no copy:
    # torch.from_numpy), nothing per chunk, and no torch op over the rows or keys.
    assert one <= 5 and many == one
    assert "add" not in counted_ops(batch, dispatcher)
    with _Launches() as counted:
        build_extend_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn")
    views = sum(n for name, n in counted.ops.items() if name in _VIEWS)
    assert views <= 3  # one split gives every chunk's four tensors (9 views before: 4 of them the slots')
    calls_one = _calls_into_c(lambda: build_extend_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn",
                                                        logits_byte_budget=1 << 40))
    calls_many = _calls_into_c(lambda: build_extend_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn"))
    # 81 and 102 (4 chunks) on Python 3.11 (88 and 115 with the slots' torch add and the metadata and
    # the chunks built apart; 105 and 141 with the rows' ks / ke built eagerly, the key checked afresh
    # and Tensor.split's Python wrapper): a handful of appends and an isqrt per chunk.
    assert calls_one <= 86 and calls_many - calls_one <= 10 * (len(chunked.chunks) - 1)
    for c in chunked.chunks:  # and the views are the whole-batch values, shifted into each window
        rows = c.chunk.rows
        assert torch.equal(c.ks + c.chunk.key_begin, whole.metadata.ks[rows])
        assert torch.equal(c.ke + c.chunk.key_begin, whole.metadata.ke[rows])
        assert torch.equal(c.lengths, whole.metadata.ke[rows] - whole.metadata.ks[rows])
        assert torch.equal(c.page_rows, whole.metadata.row_request[rows])
        assert c.ks.is_contiguous() and c.ke.is_contiguous() and c.page_rows.is_contiguous()
