"""Two top-k selections of SGLang's paged indexer compared on the same batch, in any convention
SGLang's topk_transform returns: physical KV slots (the fused PAGED transform) or positions in the
request (unfused). Slots are mapped back to positions through the batch's own req_to_token, then each
selection is checked tie-aware against an fp32 torch reference over the same bytes (tests/support/numerics.py):
valid, distinct, visible positions, and selected values within a tolerance of the reference's top-k."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE = 64


@dataclass
class SelectionReport:
    worst: float  # largest |selected - reference top-k| over the row's largest |logit|, either side
    identical_rows: int  # rows whose two selections are the same set of positions
    rows: int


def positions_from_slots(selection: torch.Tensor, req_to_token: torch.Tensor, row_request: torch.Tensor) -> torch.Tensor:
    """Physical slots -> positions in each row's request (-1 stays -1; a slot that is not the row's
    request's -> -2, which the checks reject). The requests' slots are disjoint, as SGLang's allocator
    keeps them, so one inverse map serves every row."""
    device = req_to_token.device
    slots = req_to_token.long().flatten()
    position_of = torch.full((int(slots.max()) + 1,), -2, dtype=torch.int64, device=device)
    request_of = torch.full_like(position_of, -1)
    width = req_to_token.shape[1]
    position_of[slots] = torch.arange(width, device=device).repeat(req_to_token.shape[0])
    request_of[slots] = torch.arange(req_to_token.shape[0], device=device).repeat_interleave(width)
    picked = selection.clamp(min=0).long()
    positions = torch.where(request_of[picked] == row_request.long()[:, None], position_of[picked], -2)
    return torch.where(selection >= 0, positions, -1).to(torch.int32)


def reference_logits(index_k: torch.Tensor, req_to_token, row_request, lengths, q, weights) -> torch.Tensor:
    """fp32 logits [rows, max_len] of every row's visible keys from the pool's bytes (uint8
    [pages, 64 * 132]: 64 x 128 e4m3fn keys, then 64 fp32 scales), -inf past each row's length."""
    pages = index_k.shape[0]
    keys = index_k[:, : PAGE * 128].contiguous().view(torch.float8_e4m3fn).view(pages * PAGE, 128)
    scales = index_k[:, PAGE * 128 :].contiguous().view(torch.float32).view(pages * PAGE)
    width = int(lengths.max())
    out = torch.full((q.shape[0], width), float("-inf"), device=q.device)
    for request in row_request.unique().tolist():
        rows = (row_request == request).nonzero().flatten()
        slots = req_to_token[request, :width].long()
        scores = torch.relu(torch.einsum("rhd,kd->rhk", q[rows].float(), keys[slots].float())) * scales[slots]
        logits = (weights[rows].float().view(rows.numel(), -1, 1) * scores).sum(1)
        visible = torch.arange(width, device=q.device) < lengths[rows, None]
        out[rows] = torch.where(visible, logits, out[rows])
    return out


def _check_one(positions: torch.Tensor, logits: torch.Tensor, lengths: torch.Tensor, k: int, side: str) -> torch.Tensor:
    """Per row: the relative distance of the selected values from the reference's top-k ones."""
    count = lengths.clamp(max=k)
    valid = positions >= 0
    assert torch.equal(valid.sum(1), count), f"{side}: a row selects other than min(k, length) positions"
    visible = positions < lengths[:, None]
    assert bool(visible[valid].all()), f"{side}: an invisible position"
    ordered = torch.where(valid, positions, torch.full_like(positions, -1)).sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    assert not bool(repeated.any()), f"{side}: a repeated position"
    picked = logits.gather(1, positions.clamp(min=0).long())
    got = torch.where(valid, picked, torch.full_like(picked, float("-inf"))).sort(dim=1, descending=True).values
    want = logits.topk(k, dim=1).values if logits.shape[1] >= k else logits.sort(dim=1, descending=True).values
    width = min(k, logits.shape[1])
    keep = torch.arange(width, device=logits.device) < count[:, None]
    difference = torch.where(keep, (got[:, :width] - want[:, :width]).abs(), torch.zeros_like(want[:, :width]))
    scale = torch.where(torch.isfinite(logits), logits.abs(), torch.zeros_like(logits)).amax(1).clamp(min=1e-30)
    return difference.amax(1) / scale


def compare_selections(theirs, ours, logits, lengths, k: int, *, tolerance: float) -> SelectionReport:
    """Both selections (positions, [rows, k]) checked tie-aware against `logits`; raises on either."""
    assert theirs.shape == ours.shape and theirs.dtype == ours.dtype == torch.int32
    worst = torch.maximum(
        _check_one(theirs, logits, lengths, k, "SGLang's"), _check_one(ours, logits, lengths, k, "the plugin's")
    )
    largest = float(worst.max())
    row = int(worst.argmax())
    assert largest <= tolerance, f"row {row}: selected values {largest:.2e} from the reference's (tolerance {tolerance:.0e})"
    identical = (theirs.sort(dim=1).values == ours.sort(dim=1).values).all(dim=1)
    return SelectionReport(largest, int(identical.sum()), theirs.shape[0])
