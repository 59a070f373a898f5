"""Bench inputs at serving shapes, built directly on the device (no per-page Python loop)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dispatch.contract.paged_cache import build_paged_kv_cache
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.key import FP8_MAX, Fp8Dtype, ForwardMode


@dataclass(frozen=True)
class LogitsShape:
    batch_size: int
    next_n: int
    mean_len: int  # lengths are uniform in [mean/2, 3*mean/2]
    heads: int = 64
    head_dim: int = 128

    @property
    def forward_mode(self) -> ForwardMode:
        """The mode a paged shape is timed under: decode for one token a request, else verify."""
        return ForwardMode.DECODE if self.next_n == 1 else ForwardMode.TARGET_VERIFY

    def label(self) -> str:
        # Exact (8K, 3000), never rounded: a length sub-band is found again from this label
        # (dispatch.registry.measured_bands.mean_len_of), and two lengths must not share one.
        length = f"{self.mean_len // 1024}K" if self.mean_len >= 1024 and self.mean_len % 1024 == 0 else str(self.mean_len)
        return f"B={self.batch_size} N={self.next_n} L~{length} H={self.heads} D={self.head_dim}"


def paged_shapes(workload, next_n: int) -> list[LogitsShape]:
    """The paged shapes `tune` measures at `next_n` (`workload` is dispatch.registry.models.Workload): the
    grid's (batch_sizes x lengths), then the named `shapes` of that next_n, as one list, so every op's
    tune and the step's ranking measure exactly the same shapes."""
    grid = [LogitsShape(size, next_n, length) for size in workload.batch_sizes for length in workload.lengths
            if next_n in workload.next_n]
    return grid + [LogitsShape(s.batch_size, next_n, s.length) for s in workload.shapes if s.next_n == next_n]


@dataclass(frozen=True)
class LogitsInputs:
    seq_lens: torch.Tensor  # int32 [B], on device
    seq_lens_host: list[int]
    page_table: torch.Tensor  # int32 [B, max_pages]
    kv_cache: torch.Tensor  # uint8 [num_blocks, BLOCK_KV, 1, D + 4]
    q_tokens: torch.Tensor  # fp8 [B*N, H, D]
    weights: torch.Tensor  # fp32 [B*N, H]


def ragged_lengths(shape: LogitsShape, generator: torch.Generator) -> list[int]:
    low, high = max(shape.mean_len // 2, shape.next_n), max(3 * shape.mean_len // 2, shape.next_n + 1)
    return torch.randint(low, high, (shape.batch_size,), generator=generator).tolist()


def logits_inputs(shape: LogitsShape, fp8_dtype: Fp8Dtype, device: str, seed: int) -> LogitsInputs:
    """One paged batch built on `device`: ragged lengths, keys quantised into shuffled pages (so no kernel
    profits from contiguous pages), fp8 q in the cache's dtype, fp32 head weights."""
    generator = torch.Generator().manual_seed(seed)
    lengths = ragged_lengths(shape, generator)
    on = torch.Generator(device=device).manual_seed(seed)
    keys = [torch.randn(n, shape.head_dim, device=device, generator=on) for n in lengths]
    cache, page_table = build_paged_kv_cache(keys, fp8_dtype, generator=on)
    del keys
    fp8_max = FP8_MAX[fp8_dtype]
    tokens = shape.batch_size * shape.next_n
    q = torch.randn(tokens, shape.heads, shape.head_dim, device=device, generator=on) * fp8_max / 4
    return LogitsInputs(
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        seq_lens_host=lengths,
        page_table=page_table,
        kv_cache=cache,
        q_tokens=q.clamp(-fp8_max, fp8_max).to(torch_dtype(fp8_dtype)),
        weights=torch.randn(tokens, shape.heads, device=device, generator=on),
    )


def logits_floor_counts(shape: LogitsShape, lengths: list[int]) -> tuple[float, float]:
    """(bytes, flops) of the op at its least traffic: every visible key read once, every output written once."""
    tokens = sum(lengths)
    rows = shape.batch_size * shape.next_n
    kv_bytes = tokens * (shape.head_dim + 4)
    out_bytes = rows * max(lengths) * 4
    in_bytes = rows * shape.heads * (shape.head_dim + 4)
    flops = 2.0 * shape.next_n * shape.heads * shape.head_dim * tokens
    return float(kv_bytes + out_bytes + in_bytes), flops


@dataclass(frozen=True)
class QuantShape:
    tokens: int
    heads: int = 64
    head_dim: int = 128
    rot_dim: int = 64

    def label(self) -> str:
        return f"T={self.tokens} H={self.heads} D={self.head_dim} rot={self.rot_dim}"


def quant_inputs(shape: QuantShape, device: str, seed: int) -> dict[str, torch.Tensor]:
    on = torch.Generator(device=device).manual_seed(seed)
    max_pos = 65536
    return {
        "q": torch.randn(shape.tokens, shape.heads, shape.head_dim, device=device, generator=on).to(torch.bfloat16),
        "weights": torch.randn(shape.tokens, shape.heads, device=device, generator=on),
        "positions": torch.randint(0, max_pos, (shape.tokens,), device=device, generator=on),
        "cos_sin_cache": torch.randn(max_pos, shape.rot_dim, device=device, generator=on).to(torch.bfloat16),
    }


def quant_floor_bytes(shape: QuantShape) -> float:
    elements = shape.tokens * shape.heads * shape.head_dim
    # bf16 q in, fp8 q out, fp32 weights in and out, positions and one cos/sin row per token.
    return float(elements * 2 + elements + shape.tokens * shape.heads * 8 + shape.tokens * (8 + shape.rot_dim * 2))


def visible_token_count(lengths: list[int], next_n: int) -> int:
    """How many (token, key) pairs a batch's tokens see: token j of a request of length L sees L - N + j + 1."""
    return sum(max(length - next_n + j + 1, 0) for length in lengths for j in range(next_n))


def topk_floor_bytes(lengths: list[int], next_n: int, k: int) -> float:
    """Every visible logit read once (fp32) and every row's k int32 indices written once."""
    return float(visible_token_count(lengths, next_n) * 4 + len(lengths) * next_n * k * 4)


@dataclass(frozen=True)
class RaggedShape:
    """An extend batch: `requests` requests of `extend` new tokens after `prefix` cached keys
    each, so M = requests * extend query rows and S = requests * (prefix + extend) gathered keys.
    With `prefix_up_to`, the prefixes differ instead: request i's is i * prefix_up_to / (requests - 1),
    so the rows' windows spread from 1 to prefix_up_to + extend (chunked prefill's mix; the workload's
    `extend_batches`)."""

    requests: int
    extend: int
    prefix: int = 0
    heads: int = 64
    head_dim: int = 128
    prefix_up_to: int | None = None

    @classmethod
    def parse(cls, text: str, heads: int, head_dim: int) -> "RaggedShape":
        """"RxE+P": R requests of E new tokens after P cached keys (e.g. 4x4096+12288)."""
        requests, rest = text.split("x")
        extend, _, prefix = rest.partition("+")
        return cls(int(requests), int(extend), int(prefix or 0), heads, head_dim)

    @property
    def prefixes(self) -> tuple[int, ...]:
        """Each request's cached keys."""
        if self.prefix_up_to is None or self.requests < 2:
            return (self.prefix,) * self.requests
        return tuple(i * self.prefix_up_to // (self.requests - 1) for i in range(self.requests))

    @property
    def rows(self) -> int:
        return self.requests * self.extend

    @property
    def keys(self) -> int:
        return sum(self.prefixes) + self.requests * self.extend

    def label(self) -> str:
        spread = "" if self.prefix_up_to is None else f" P=0..{_short(self.prefix_up_to)}"
        return (f"M={_short(self.rows)} S={_short(self.keys)} R={self.requests}{spread} "
                f"H={self.heads} D={self.head_dim}")


def _short(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class RaggedInputs:
    batch: "ExtendBatch"  # noqa: F821 (dispatch.step.extend_batch; imported where built)
    kv_cache: torch.Tensor  # uint8 [num_blocks, BLOCK_KV, 1, D + 4]
    q: torch.Tensor  # bf16 [M, H, D], before quantisation (the step's input)
    weights: torch.Tensor  # fp32 [M, H]
    positions: torch.Tensor  # int64 [M]
    cos_sin_cache: torch.Tensor  # bf16 [max_pos, 64]


def ragged_inputs(shape: RaggedShape, fp8_dtype: Fp8Dtype, device: str, seed: int) -> RaggedInputs:
    """One extend batch on `device`: every request's keys quantised into shuffled pages, bf16 q."""
    from dispatch.step.extend_batch import ExtendBatch

    on = torch.Generator(device=device).manual_seed(seed)
    prefixes = list(shape.prefixes)
    keys = [torch.randn(prefix + shape.extend, shape.head_dim, device=device, generator=on) for prefix in prefixes]
    cache, table = build_paged_kv_cache(keys, fp8_dtype, generator=on)
    del keys
    rows = shape.rows
    positions = torch.cat([torch.arange(prefix, prefix + shape.extend, device=device) for prefix in prefixes])
    longest = max(prefixes) + shape.extend
    return RaggedInputs(
        batch=ExtendBatch.from_lengths(prefixes, [shape.extend] * shape.requests, table),
        kv_cache=cache,
        q=torch.randn(rows, shape.heads, shape.head_dim, device=device, generator=on).to(torch.bfloat16),
        weights=torch.randn(rows, shape.heads, device=device, generator=on),
        positions=positions,
        cos_sin_cache=torch.randn(max(longest, 1), 64, device=device, generator=on).to(torch.bfloat16),
    )


def ragged_visible_count(shape: RaggedShape) -> int:
    """(query row, key) pairs an extend batch's rows see: prefix + j + 1 for new token j (causal)."""
    return sum(shape.extend * prefix for prefix in shape.prefixes) + shape.requests * (shape.extend * (shape.extend + 1) // 2)


def ragged_topk_floor_bytes(shape: RaggedShape, k: int) -> float:
    """Every visible logit read once (fp32) and every query row's k int32 positions written once."""
    return float(ragged_visible_count(shape) * 4 + shape.rows * k * 4)


def ragged_floor_counts(shape: RaggedShape) -> tuple[float, float]:
    """(bytes, flops) of the ragged logits at their least: every gathered key read once, every fp32 logit
    of [M, S] written once (the -inf fill included: the op's contract), q and weights read once; the
    fp8 dot over each row's visible keys only (causal: prefix + j + 1 for new token j)."""
    visible = ragged_visible_count(shape)
    bytes_ = shape.keys * (shape.head_dim + 4) + shape.rows * shape.keys * 4 + shape.rows * shape.heads * (shape.head_dim + 4)
    return float(bytes_), 2.0 * shape.heads * shape.head_dim * visible


@dataclass(frozen=True)
class BenchRun:
    """One `bench` run's settings: what each op's jobs are built from (the runner's JOBS table, keyed by
    op; `bench` takes one row per op of dispatch.contract.OP_CONTRACTS)."""

    dispatcher: Any
    fp8: Fp8Dtype
    device: str
    ceilings: Any
    repeats: int
    wanted: set[str] | None
    tolerance: float
    quant_shapes: list[QuantShape]
    logits_shapes: list[LogitsShape]
    ragged_shapes: list[RaggedShape]
    ks: list[int]
    logits_budget: int

    @property
    def common(self) -> dict[str, Any]:
        return dict(device=self.device, ceilings=self.ceilings, repeats=self.repeats, wanted=self.wanted)
