"""Ranks over gloo on the CPU: agreement passes, and a rank with another registry overlay is named.

One process group of two ranks (forked, so no rank re-imports torch) runs both checks: two ranks are
enough to tell agreement from disagreement, and how ranks are grouped in the message is checked on
gathered summaries directly, without processes."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dispatch.engines.agreement import differences
from dispatch.contract.errors import RankDisagreementError
from dispatch.contract.key import DispatchKey

KEYS = [DispatchKey("cpu", "decode", 1, "e4m3fn"), DispatchKey("cpu", "target_verify", 4, "e4m3fnuz")]


def _outcome(dispatcher) -> str:
    from dispatch.engines.agreement import check_ranks_agree

    try:
        check_ranks_agree(dispatcher, KEYS)
    except RankDisagreementError as error:
        return str(error)
    return "agree"


def _rank(rank: int, world: int, folder: str, overlays: list, backend: str) -> None:
    from dispatch.deciding.runtime import load_dispatcher

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        outcomes = {
            "same": _outcome(load_dispatcher(cluster=None, arch="cpu")),
            "overlay": _outcome(load_dispatcher(cluster=overlays[rank], arch="cpu")),
        }
    finally:
        dist.destroy_process_group()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as out:
        json.dump(outcomes, out)


def _run(folder, overlays: list, backend: str = "gloo") -> list[dict]:
    folder.mkdir(parents=True, exist_ok=True)
    # fork: the ranks inherit the imported modules (spawn would import torch again in each).
    start = "spawn" if backend == "nccl" else "fork"
    mp.start_processes(_rank, args=(len(overlays), str(folder), overlays, backend), nprocs=len(overlays),
                       join=True, start_method=start)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(len(overlays))]


@pytest.fixture(autouse=True)
def _no_cluster_env(monkeypatch):
    monkeypatch.delenv("DISPATCH_CLUSTER", raising=False)
    os.environ.pop("DISPATCH_CLUSTER", None)


def test_ranks_agree_and_a_rank_with_another_overlay_is_named(tmp_path):
    outcomes = _run(tmp_path, [None, "reference-only"])
    assert [o["same"] for o in outcomes] == ["agree", "agree"]
    for outcome in outcomes:  # every rank raises, so none goes on alone
        message = outcome["overlay"]
        assert message.startswith("ranks disagree:")
        assert "cluster: ranks [0] -> None; ranks [1] -> reference-only" in message
        # the decisions that changed are named with the key, each rank's choice and its rule
        assert "paged_mqa_logits @ arch=cpu forward_mode=decode next_n=1 fp8_dtype=e4m3fn" in message
        assert "ranks [1] -> torch.reference (native, prefer[0])" in message


def test_ranks_sharing_a_value_are_grouped_and_a_missing_field_is_named():
    summaries = [
        {"registry_fingerprint": "a", "cluster": "None", "op @ k": "triton (native, r)"},
        {"registry_fingerprint": "a", "cluster": "None", "op @ k": "triton (native, r)"},
        {"registry_fingerprint": "b", "cluster": "None"},
    ]
    assert differences(summaries) == [
        "op @ k: ranks [0, 1] -> triton (native, r); ranks [2] -> <missing>",
        "registry_fingerprint: ranks [0, 1] -> a; ranks [2] -> b",
    ]
    assert differences(summaries[:2]) == []


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL agreement needs two GPUs")
def test_two_gpus_over_nccl(tmp_path):
    outcomes = _run(tmp_path, [None, "reference-only"], "nccl")
    assert [o["same"] for o in outcomes] == ["agree", "agree"]
    assert all("ranks [1] -> reference-only" in o["overlay"] for o in outcomes)


NO_TOPK_ON_CPU = """\
version: 1
ops:
  paged_mqa_logits: {fallback: [torch.reference]}
  indexer_q_quant: {fallback: [torch.reference]}
  topk:
    rules:
      - {id: gpu-only, when: {arch: sm90}, use: [torch.reference]}
  ragged_mqa_logits: {fallback: [torch.reference]}
"""


def _failing_rank(rank: int, world: int, folder: str) -> None:
    import datetime

    from dispatch.deciding.runtime import load_dispatcher

    # A short timeout: if a rank's failure left the others waiting, the test fails in a minute, not 30.
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        registry = os.path.join(folder, "no-topk.yaml") if rank == 1 else None
        outcome = _outcome(load_dispatcher(registry, cluster=None, arch="cpu"))
    finally:
        dist.destroy_process_group()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as out:
        json.dump({"outcome": outcome}, out)


def test_a_rank_that_cannot_decide_makes_every_rank_raise_instead_of_hanging(tmp_path):
    (tmp_path / "no-topk.yaml").write_text(NO_TOPK_ON_CPU)
    mp.start_processes(_failing_rank, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="fork")
    for rank in range(2):
        message = json.loads((tmp_path / f"rank{rank}.json").read_text())["outcome"]
        assert message.startswith("1 of 2 ranks could not decide: rank 1: NoBackendError: "), message
        assert "topk" in message


def test_ranks_whose_overlays_differ_in_one_band_disagree_on_that_band(tmp_path):
    """Ranks of one group may hold batches of different sizes: a band's decision must agree too."""
    from dispatch.deciding.runtime import load_dispatcher
    from dispatch.engines.agreement import summary
    from tests.support.banded import FLATTEN, NATIVE, OVERLAY, VERIFY, write_banded

    # The other rank measured native faster at B=2 as well: its key's order is the same, one band differs.
    other = OVERLAY.replace("median_us: {torch.reference: 20.0, torch.reference.flatten: 10.0}",
                            "median_us: {torch.reference: 5.0, torch.reference.flatten: 10.0}").replace(
        "median_us: {torch.reference: 22.0, torch.reference.flatten: 12.0}",
        "median_us: {torch.reference: 6.0, torch.reference.flatten: 12.0}").replace(
        f"order: [{FLATTEN}, {NATIVE}]", f"order: [{NATIVE}, {FLATTEN}]")
    ranks = [load_dispatcher(write_banded(tmp_path / name, overlay), cluster="banded", arch="cpu")
             for name, overlay in (("a", OVERLAY), ("b", other))]
    summaries = [summary(dispatcher, [VERIFY]) for dispatcher in ranks]
    assert summaries[0]["paged_mqa_logits @ " + str(VERIFY)] == summaries[1]["paged_mqa_logits @ " + str(VERIFY)]
    found = differences(summaries)
    assert f"paged_mqa_logits @ {VERIFY} B=2: ranks [0] -> {FLATTEN} (flatten, measured[0] for B <= 2); " \
           f"ranks [1] -> {NATIVE} (native, measured[0] for B <= 2)" in found
    assert not any(line.startswith(f"paged_mqa_logits @ {VERIFY} B=16") for line in found)  # that band agrees
    assert differences([summaries[0], summary(ranks[0], [VERIFY])]) == []
