"""Recording stand-ins for the engines' top-k entry points, for tests without a GPU or an engine.

Each records every call's arguments (the objects themselves, so tests can check identity), rejects what
the real host code checks (sglang 0.5.23's topk_v2 TensorMatcher / RuntimeCheck, sgl-kernel 0.4.10's
asserts, vLLM 0.33.0's TORCH_CHECKs and its indexer's limits), refuses to read a column outside a row's
window (the real kernels would read it: an adapter must clamp the lengths first), and selects as the
real kernels do: a radix order in which NaN ranks above +inf, output unordered (here: ascending, the
opposite of what sorted=True asks), -1 padded. SGLang's ragged v2 also writes -inf into the <= 3
columns ahead of each unaligned window, as the real kernel does.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch


@dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict = field(default_factory=dict)


def radix_top(values: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest of `values` in the engines' radix order (NaN above +inf), ascending by
    value (an order the contract does not promise, so the adapter's sort is tested)."""
    keyed = values.double()
    keyed = torch.where(torch.isinf(keyed) & (keyed > 0), torch.full_like(keyed, 1.7e308), keyed)
    keyed = torch.where(torch.isnan(keyed), torch.full_like(keyed, float("inf")), keyed)
    take = min(k, values.numel())
    picked = torch.topk(keyed, take).indices
    return picked.flip(0).to(torch.int32)


def _select_rows(scores, lengths, k, starts=None, *, who: str) -> torch.Tensor:
    rows, width = scores.shape
    out = torch.full((rows, k), -1, dtype=torch.int32)
    for r in range(rows):
        begin = 0 if starts is None else int(starts[r])
        n = int(lengths[r])
        if n < 0 or begin < 0 or begin + n > width:
            raise AssertionError(f"{who}: row {r} would read columns {begin}..{begin + n - 1} of a {width}-wide row")
        if n <= k:  # the engines' short-row path: every position, values unread
            out[r, :n] = torch.arange(n, dtype=torch.int32)
        else:
            out[r, :k] = radix_top(scores[r, begin:begin + n], k)
    return out


class FakeSglangV2(types.ModuleType):
    """sglang.kernels.ops.attention.dsv4.topk: plan_topk_v2, topk_transform_paged_v2, topk_transform_ragged_v2."""

    def __init__(self):
        super().__init__("sglang.kernels.ops.attention.dsv4.topk")
        self.calls: list[Call] = []
        self.plans: dict[int, torch.Tensor] = {}  # id(metadata) -> the lengths it was built from

    def plan_topk_v2(self, seq_lens, static_threshold=-1, *, out=None):
        assert seq_lens.dtype == torch.int32 and seq_lens.dim() == 1
        self.calls.append(Call("plan_topk_v2", (seq_lens,)))
        metadata = torch.zeros(seq_lens.shape[0] + 1, 2, dtype=torch.int32) if out is None else out
        metadata[0, 0] = -1
        metadata[1:, 0] = torch.arange(seq_lens.shape[0], dtype=torch.int32)
        metadata[1:, 1] = seq_lens
        self.plans[id(metadata)] = seq_lens.clone()
        return metadata

    def topk_transform_paged_v2(self, scores, seq_lens, page_tables, out_page_indices, page_size, metadata,
                                out_raw_indices=None):
        self.calls.append(Call("topk_transform_paged_v2", (scores, seq_lens, page_tables, out_page_indices,
                                                           page_size, metadata, out_raw_indices)))
        rows, k = out_page_indices.shape
        _check_v2_scores(scores, seq_lens, k)
        assert metadata.shape == (rows + 1, 2), "invalid metadata shape"
        assert torch.equal(metadata[1:, 1], seq_lens), "metadata must come from plan_topk_v2 over the same seq_lens"
        assert out_raw_indices is None or page_tables is not None, "raw_indices requires a page table"
        raw = _select_rows(scores, seq_lens, k, who="topk_transform_paged_v2")
        if page_tables is None:
            out_page_indices.copy_(raw)
            return
        assert page_tables.shape[0] == rows and page_tables.stride(1) == 1 and page_tables.dtype == torch.int32
        assert page_size > 0 and page_size & (page_size - 1) == 0, "page_size must be power of 2"
        pages = torch.gather(page_tables, 1, (raw.clamp(min=0) // page_size).long())
        out_page_indices.copy_(torch.where(raw >= 0, pages * page_size + raw.clamp(min=0) % page_size, -1))
        if out_raw_indices is not None:
            out_raw_indices.copy_(raw)

    def topk_transform_ragged_v2(self, scores, seq_lens, *, out_offsets, out_indices, row_starts=None):
        self.calls.append(Call("topk_transform_ragged_v2", (scores, seq_lens),
                               dict(out_offsets=out_offsets, out_indices=out_indices, row_starts=row_starts)))
        rows, k = out_indices.shape
        _check_v2_scores(scores, seq_lens, k)
        # Its TensorMatcher for row_starts and out_offsets is the default one: int32, contiguous.
        for tensor in (row_starts, out_offsets):
            assert tensor is None or (tensor.dtype == torch.int32 and tensor.is_contiguous())
        raw = _select_rows(scores, seq_lens, k, row_starts, who="topk_transform_ragged_v2")
        out_indices.copy_(torch.where(raw >= 0, raw + out_offsets[:, None], -1))
        if row_starts is not None:  # the 16-byte-aligned read base: the columns it pulls in are masked
            for r in range(rows):
                begin = int(row_starts[r])
                scores[r, begin - begin % 4:begin] = float("-inf")


def _check_v2_scores(scores, seq_lens, k):
    assert scores.dtype == torch.float32 and scores.dim() == 2 and scores.stride(1) == 1
    assert scores.stride(0) % 4 == 0, "score_stride must be a multiple of 4 (16-byte vectorized load)"
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (scores.shape[0],)
    assert 0 < k <= 2048, "topk must be in (0, 2048]"


class FakeSglKernel(types.ModuleType):
    """sgl_kernel: fast_topk_v2 (asserts topk == 2048, as the released wrapper does)."""

    def __init__(self):
        super().__init__("sgl_kernel")
        self.calls: list[Call] = []

    def fast_topk_v2(self, score, lengths, topk, row_starts=None):
        self.calls.append(Call("fast_topk_v2", (score, lengths, topk), dict(row_starts=row_starts)))
        assert topk == 2048, "fast_topk_v2 is only optimized for deepseek v3.2 model, where topk=2048"
        assert score.dim() == 2 and score.stride(1) == 1 and lengths.dtype == torch.int32
        # The kernel reads lengths[row] and row_starts[row] from their raw pointers.
        assert lengths.is_contiguous() and (row_starts is None or (row_starts.dtype == torch.int32
                                                                   and row_starts.is_contiguous()))
        return _select_rows(score, lengths, topk, row_starts, who="fast_topk_v2")


class FakeVllmOps:
    """torch.ops._C as vLLM registers it: persistent_topk, cooperative_topk, top_k_per_row_decode/_prefill.
    Their output is left as handed in past what they select (vLLM fills it with -1 first)."""

    def __init__(self, missing: tuple[str, ...] = ()):
        self._missing = missing  # ops this build lacks: looking one up raises, as torch.ops does
        self.calls: list[Call] = []

    def __getattribute__(self, name):
        if name in object.__getattribute__(self, "_missing"):
            raise RuntimeError(f"No such operator _C::{name}")
        return object.__getattribute__(self, name)

    def persistent_topk(self, logits, lengths, output, workspace, k, max_seq_len):
        self._radix("persistent_topk", logits, lengths, output, workspace, k, max_seq_len)

    def cooperative_topk(self, logits, lengths, output, workspace, k, max_seq_len):
        assert logits.shape[0] <= 64, "cooperative_topk: one cluster wave covers at most 64 rows"
        assert logits.stride(0) % 4 == 0, "logits.stride(0) must be divisible by 4"
        self._radix("cooperative_topk", logits, lengths, output, workspace, k, max_seq_len)

    def _radix(self, name, logits, lengths, output, workspace, k, max_seq_len):
        self.calls.append(Call(name, (logits, lengths, output, workspace, k, max_seq_len)))
        assert k in (512, 1024, 2048), f"{name} supports k=512, 1024, or 2048; got {k}"
        assert max_seq_len > 0, "max_seq_len must be positive"
        assert logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
        assert lengths.dtype == torch.int32 and lengths.is_contiguous() and lengths.dim() in (1, 2)
        assert output.dtype == torch.int32 and output.shape == (logits.shape[0], k)
        assert workspace.dtype == torch.uint8 and workspace.numel() >= 1024 * 1024
        clamped = lengths.reshape(-1).clamp(max=max_seq_len)
        selected = _select_rows(logits, clamped, k, who=name)
        output.copy_(torch.where(selected >= 0, selected, output))

    def top_k_per_row_decode(self, logits, next_n, seq_lens, indices, num_rows, stride0, stride1, k):
        self.calls.append(Call("top_k_per_row_decode", (logits, next_n, seq_lens, indices, num_rows, stride0,
                                                        stride1, k)))
        assert (stride0, stride1) == logits.stride() and num_rows == logits.shape[0]
        assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()  # read as seqLens[row] from the raw pointer
        rows = logits.shape[0]
        per_row = seq_lens.reshape(-1)
        if per_row.numel() != rows:  # one length per request: token j of next_n sees len - next_n + j + 1
            offsets = torch.arange(rows) % next_n
            per_row = per_row.repeat_interleave(next_n) - next_n + offsets + 1
        selected = _select_rows(logits, per_row, k, who="top_k_per_row_decode")
        indices.copy_(torch.where(selected >= 0, selected, indices))

    def top_k_per_row_prefill(self, logits, row_starts, row_ends, indices, num_rows, stride0, stride1, k):
        self.calls.append(Call("top_k_per_row_prefill", (logits, row_starts, row_ends, indices, num_rows, stride0,
                                                         stride1, k)))
        assert (stride0, stride1) == logits.stride() and num_rows == logits.shape[0]
        # sampler.cu reads rowStarts[row] and rowEnds[row] from the raw int32 pointers.
        assert row_starts.dtype == row_ends.dtype == torch.int32 and row_starts.is_contiguous() and row_ends.is_contiguous()
        selected = _select_rows(logits, row_ends - row_starts, k, row_starts, who="top_k_per_row_prefill")
        indices.copy_(torch.where(selected >= 0, selected, indices))
