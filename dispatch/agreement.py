"""Many ranks, one model: every rank must decide the same backends from the same registry, or their
top-k could differ and the model silently diverge. Works over any torch.distributed backend."""

from __future__ import annotations

from typing import Iterable

from dispatch.dispatcher import Dispatcher
from dispatch.errors import RankDisagreementError
from dispatch.key import DispatchKey
from dispatch.plan import ops_for


def summary(dispatcher: Dispatcher, keys: Iterable[DispatchKey]) -> dict[str, str]:
    """What must agree, as flat fields: the registry fingerprint and the choice for each key of every op
    its step runs (dispatch.plan.ops_for: extend keys the ragged step, the others the paged one)."""
    fields = {"registry_fingerprint": dispatcher.fingerprint, "cluster": str(dispatcher.cluster)}
    for key in keys:
        for op in ops_for(key.forward_mode):
            decision = dispatcher.decide(op, key)
            fields[f"{op.value} @ {key}"] = f"{decision.backend} ({decision.layout.value}, {decision.rule})"
    return fields


def check_ranks_agree(dispatcher: Dispatcher, keys: Iterable[DispatchKey], group=None) -> None:
    """Gather every rank's summary; raise RankDisagreementError naming the ranks and fields that differ."""
    import torch.distributed as dist

    mine = summary(dispatcher, list(keys))
    gathered: list[dict[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    found = differences(gathered)
    if found:
        raise RankDisagreementError("ranks disagree:\n  " + "\n  ".join(found))


def differences(gathered: list[dict[str, str]]) -> list[str]:
    """One line per field on which the ranks' summaries differ, grouping the ranks by value."""
    lines = []
    for field in sorted(set().union(*(g.keys() for g in gathered))):
        values = {rank: g.get(field, "<missing>") for rank, g in enumerate(gathered)}
        if len(set(values.values())) > 1:
            by_value: dict[str, list[int]] = {}
            for rank, value in values.items():
                by_value.setdefault(value, []).append(rank)
            lines.append(f"{field}: " + "; ".join(f"ranks {r} -> {v}" for v, r in by_value.items()))
    return lines
