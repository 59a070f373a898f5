"""Many ranks, one model: every rank must decide the same backends from the same registry, or their
top-k could differ and the model silently diverge. Works over any torch.distributed backend."""

from __future__ import annotations

from typing import Iterable

from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.errors import DispatchError, RankDisagreementError
from dispatch.contract.limits import MAX_MESSAGE_CHARS
from dispatch.contract.key import DispatchKey
from dispatch.step.paged_plan import ops_for


def summary(dispatcher: Dispatcher, keys: Iterable[DispatchKey]) -> dict[str, str]:
    """What must agree, as flat fields: the registry fingerprint and the choice for each key of every op
    its step runs (dispatch.step.paged_plan.ops_for: extend keys the ragged step, the others the paged one),
    and the choice of each measured batch-size band of the key and of each length sub-band inside it:
    ranks of one group may hold batches of different sizes and lengths in one step, so every band must
    agree, not only the key's own order."""
    fields = {"registry_fingerprint": dispatcher.fingerprint, "cluster": str(dispatcher.cluster)}
    for key in keys:
        for op in ops_for(key.forward_mode):
            decision = dispatcher.decide(op, key)
            fields[f"{op.value} @ {key}"] = _choice(decision)
            for size in dispatcher.band_sizes(op, key):
                banded = dispatcher.decide(op, key, batch_size=size)
                fields[f"{op.value} @ {key} B={size}"] = _choice(banded)
                for bound in dispatcher.band_lengths(op, key, size):
                    sub = dispatcher.decide(op, key, batch_size=size, max_seq_len=bound)
                    fields[f"{op.value} @ {key} B={size} max_seq_len<={bound}"] = _choice(sub)
    return fields


def _choice(decision) -> str:
    band = f" for {decision.band}" if decision.band else ""
    return f"{decision.backend} ({decision.layout.value}, {decision.rule}{band})"


# The field a rank sends in place of its summary when it could not build one.
_FAILED = "<error>"


def check_ranks_agree(dispatcher: Dispatcher, keys: Iterable[DispatchKey], group=None) -> None:
    """Gather every rank's summary; raise RankDisagreementError naming the ranks and fields that differ.

    A rank that cannot decide a key (NoBackendError, a plugin's error, ...) still reaches the gather,
    carrying its error instead of a summary, so no rank waits for it until the process group times out:
    every rank then raises RankDisagreementError naming the failed ranks and their reasons."""
    import torch.distributed as dist

    try:
        mine = summary(dispatcher, list(keys))
    except DispatchError as error:
        mine = {_FAILED: f"{type(error).__name__}: {str(error)[:MAX_MESSAGE_CHARS]}"}
    gathered: list[dict[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    failed = [f"rank {rank}: {g[_FAILED]}" for rank, g in enumerate(gathered) if _FAILED in g]
    if failed:
        raise RankDisagreementError(
            f"{len(failed)} of {len(gathered)} ranks could not decide: " + "; ".join(failed[:8])
            + (f"; and {len(failed) - 8} more" if len(failed) > 8 else "")
        )
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
