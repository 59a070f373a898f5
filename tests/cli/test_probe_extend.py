"""The extend probe's input building and checks, on the CPU at a small shape, so the one GPU run the
lead makes does not die in its setup."""

from __future__ import annotations

import importlib.util
import pathlib

import torch

from backends.reference.kv_gather import reference_gather_keys as reference_gather
from backends.reference.ragged_mqa_logits import reference_ragged_mqa_logits as reference_logits
from backends.shared.kv_gather import triton_gather_keys
from backends.triton.ragged_mqa_logits import triton_ragged_mqa_logits

PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "probe_extend.py"


def load_probe():
    spec = importlib.util.spec_from_file_location("probe_extend", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.DEVICE = "cpu"
    return module


def test_probe_builds_a_consistent_batch_and_checks_it():
    probe = load_probe()
    cache, batch, meta, q, weights = probe.build([70, 0], [5, 9])
    assert q.shape == (14, probe.HEADS, probe.HEAD_DIM) and batch.total_keys == 84
    flag = torch.zeros(1, dtype=torch.int32)
    k, scales = triton_gather_keys(cache, meta.gather_slots, flag)
    ref_k, ref_scales = reference_gather(cache, meta.gather_slots, key_offsets=meta.key_offsets)
    assert int(flag) == 0 and torch.equal(k.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(scales, ref_scales)
    ref = reference_logits(q, k, scales, weights, meta.ks, meta.ke)
    err, verdict = probe.check(triton_ragged_mqa_logits(q, k, scales, weights, meta.ks, meta.ke), ref)
    assert verdict == "ok" and err < 1e-5
    bad = ref.clone()
    bad[0, 80] = 0.0  # a finite value where -inf belongs (row 0 sees keys 0..70)
    assert probe.check(bad, ref)[1] != "ok"
    assert probe.check(bad, ref, clean=False)[1] == "ok"  # unclean outputs are judged where visible only


def test_probe_shapes_are_extend_shapes():
    probe = load_probe()
    for prefix, extend in probe.SHAPES.values():
        assert sum(extend) in (4096, 16384) and sum(prefix) + sum(extend) <= 65536
