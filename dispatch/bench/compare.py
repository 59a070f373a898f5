"""How a backend's output is checked against the reference, the same way in `bench` and the tuners."""

from __future__ import annotations

import torch


def compare_logits(out: torch.Tensor, reference: torch.Tensor, tolerance: float) -> tuple[float | None, str]:
    """(relative error over visible positions, verdict). The -inf pattern must match exactly."""
    if out.shape != reference.shape:
        return None, f"shape {list(out.shape)} != reference {list(reference.shape)}"
    if torch.isnan(out).any():
        return None, "NaN in output"
    masked = torch.isinf(reference)
    if not torch.equal(torch.isinf(out) & (out < 0), masked):
        return None, "-inf pattern differs from the reference"
    visible = ~masked
    diff = (out[visible] - reference[visible]).double().norm()
    error = float(diff / reference[visible].double().norm().clamp(min=1e-30))
    return error, "ok" if error <= tolerance else f"error {error:.2e} > {tolerance:.0e}"


def compare_q_quant(
    out: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor]
) -> tuple[float, str]:
    """(fraction of fp8 bytes that differ, verdict): the quantised Q must be bit-exact, the weights equal."""
    q_fp8, weights = out
    mismatched = int((q_fp8.view(torch.uint8) != reference[0].view(torch.uint8)).sum())
    weights_equal = torch.equal(weights, reference[1])
    verdict = "ok" if mismatched == 0 and weights_equal else f"{mismatched} fp8 bytes differ; weights equal: {weights_equal}"
    return mismatched / max(q_fp8.numel(), 1), verdict


def compare_topk(indices: torch.Tensor, logits: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[float, str]:
    """(fraction of rows that differ, verdict) against torch.topk over each row's first lengths[r]
    columns: the selected values' multiset must be torch.topk's, and -1 must fill exactly the slots
    past min(k, lengths[r]). Indices must be distinct and visible. Logits must hold no NaN."""
    rows, width = logits.shape
    if indices.shape != (rows, k) or indices.dtype != torch.int32:
        return 1.0, f"got {indices.dtype} {list(indices.shape)}; expected int32 [{rows}, {k}]"
    columns = torch.arange(width, device=logits.device)
    visible = columns < lengths.long()[:, None]
    take = min(k, width)
    expected = torch.topk(torch.where(visible, logits, float("-inf")), take, dim=1).values
    count = lengths.long().clamp(max=take)[:, None]
    slot = torch.arange(k, device=logits.device)
    valid = indices >= 0
    bad_rows = (valid != (slot < count)).any(dim=1)
    in_range = (indices.long() < lengths.long()[:, None]) | ~valid
    bad_rows |= ~in_range.all(dim=1)
    picked = logits.gather(1, indices.long().clamp(min=0, max=width - 1))
    picked = torch.where(valid, picked, float("-inf")).sort(dim=1, descending=True).values[:, :take]
    wanted = torch.where(slot[:take] < count, expected, float("-inf"))
    bad_rows |= ~((picked == wanted) | (torch.isinf(picked) & torch.isinf(wanted) & (picked < 0) & (wanted < 0))).all(dim=1)
    # The same index twice would pass the multiset test only by luck of ties; refuse it outright.
    ordered = torch.where(valid, indices.long(), -1 - slot).sort(dim=1).values
    bad_rows |= (ordered[:, 1:] == ordered[:, :-1]).any(dim=1) if k > 1 else torch.zeros_like(bad_rows)
    wrong = int(bad_rows.sum())
    return wrong / max(rows, 1), "ok" if wrong == 0 else f"{wrong} of {rows} rows differ from torch.topk"


def compare_window_topk(
    indices: torch.Tensor, logits: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, k: int, block: int = 1024
) -> tuple[float, str]:
    """compare_topk over each row's window: row r sees logits[r, starts[r] : starts[r] + lengths[r]] and
    its positions are relative to starts[r] (the extend step's top-k). Every row is checked, exactly,
    `block` rows at a time so the windows copied out stay small."""
    rows, width = logits.shape
    if indices.shape != (rows, k) or indices.dtype != torch.int32:
        return 1.0, f"got {indices.dtype} {list(indices.shape)}; expected int32 [{rows}, {k}]"
    wrong = 0
    for begin in range(0, rows, block):
        end = min(begin + block, rows)
        span = max(int(lengths[begin:end].max()), 1)
        columns = (starts[begin:end].long()[:, None] + torch.arange(span, device=logits.device)).clamp(max=width - 1)
        window = logits[begin:end].gather(1, columns)  # columns past a row's length are never read as visible
        fraction, _ = compare_topk(indices[begin:end], window, lengths[begin:end], k)
        wrong += round(fraction * (end - begin))
    return wrong / max(rows, 1), "ok" if wrong == 0 else f"{wrong} of {rows} rows differ from torch.topk over [ks, ke)"


def compare_ragged_topk(
    indices: torch.Tensor, logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, k: int, tolerance: float
) -> tuple[float | None, str]:
    """(relative error, verdict) of ragged top-k rows against torch.topk over each row's [ks, ke) of
    reference `logits` [rows, S]: positions (relative to ks) distinct and visible, exactly
    min(k, ke - ks) of them then -1s, and their reference logits, sorted, torch.topk's values (one
    relative error over all rows, so near-ties between close logits pass)."""
    picked_all, wanted_all = [], []
    for row in range(indices.shape[0]):
        begin, end = int(ks[row]), int(ke[row])
        visible = logits[row, begin:end]
        count = min(k, end - begin)
        chosen = indices[row]
        if (chosen[count:] != -1).any() or (chosen[:count] < 0).any() or (chosen[:count] >= end - begin).any():
            return None, f"row {row}: expected {count} positions in [0, {end - begin}) then -1s"
        if chosen[:count].unique().numel() != count:
            return None, f"row {row}: a position is selected twice"
        picked_all.append(visible[chosen[:count].long()].sort(descending=True).values)
        wanted_all.append(torch.topk(visible, count).values)
    if not picked_all:
        return 0.0, "ok"
    picked, wanted = torch.cat(picked_all).double(), torch.cat(wanted_all).double()
    error = float((picked - wanted).norm() / wanted.norm().clamp(min=1e-30))
    return error, "ok" if error <= tolerance else f"error {error:.2e} > {tolerance:.0e}"
