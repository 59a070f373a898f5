"""Several ranks over gloo on the CPU: agreement passes, and a rank with another registry is named."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dispatch.errors import RankDisagreementError
from dispatch.key import DispatchKey

KEYS = [DispatchKey("cpu", "decode", 1, "e4m3fn"), DispatchKey("cpu", "target_verify", 4, "e4m3fnuz")]


def _rank(rank: int, world: int, store: str, clusters: list, results, backend: str) -> None:
    import torch

    from dispatch.agreement import check_ranks_agree
    from dispatch.runtime import load_dispatcher

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dispatcher = load_dispatcher(cluster=clusters[rank], arch="cpu")
        check_ranks_agree(dispatcher, KEYS)
        results[rank] = "agree"
    except RankDisagreementError as error:
        results[rank] = str(error)
    finally:
        dist.destroy_process_group()


def _run(tmp_path, clusters: list, backend: str = "gloo") -> list:
    world = len(clusters)
    tmp_path.mkdir(parents=True, exist_ok=True)
    with mp.Manager() as manager:
        results = manager.list([None] * world)
        mp.spawn(_rank, args=(world, str(tmp_path / "store"), clusters, results, backend), nprocs=world, join=True)
        return list(results)


@pytest.fixture(autouse=True)
def _no_cluster_env(monkeypatch):
    monkeypatch.delenv("DISPATCH_CLUSTER", raising=False)
    os.environ.pop("DISPATCH_CLUSTER", None)


def test_ranks_with_the_same_registry_agree(tmp_path):
    assert _run(tmp_path, [None, None, None]) == ["agree"] * 3


def test_a_rank_with_another_overlay_is_named_with_the_field(tmp_path):
    results = _run(tmp_path, [None, None, "reference-only"])
    for message in results:
        assert "ranks disagree" in message
        assert "cluster" in message
        assert "ranks [0, 1] -> None" in message and "ranks [2] -> reference-only" in message


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL agreement needs two GPUs")
def test_two_gpus_over_nccl(tmp_path):
    assert _run(tmp_path / "agree", [None, None], "nccl") == ["agree"] * 2
    results = _run(tmp_path / "differ", [None, "reference-only"], "nccl")
    assert all("ranks [1] -> reference-only" in message for message in results)
