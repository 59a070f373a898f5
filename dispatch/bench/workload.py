"""Bench inputs at serving shapes, built directly on the device (no per-page Python loop)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dispatch.fp8 import torch_dtype
from dispatch.key import FP8_MAX, Fp8Dtype

BLOCK_KV = 64


@dataclass(frozen=True)
class LogitsShape:
    batch_size: int
    next_n: int
    mean_len: int  # lengths are uniform in [mean/2, 3*mean/2]
    heads: int = 64
    head_dim: int = 128

    def label(self) -> str:
        length = f"{self.mean_len // 1024}K" if self.mean_len >= 1024 else str(self.mean_len)
        return f"B={self.batch_size} N={self.next_n} L~{length} H={self.heads} D={self.head_dim}"


@dataclass(frozen=True)
class LogitsInputs:
    seq_lens: torch.Tensor  # int32 [B], on device
    seq_lens_host: list[int]
    page_table: torch.Tensor  # int32 [B, max_pages]
    kv_cache: torch.Tensor  # uint8 [num_blocks, 64, 1, D + 4]
    q_tokens: torch.Tensor  # fp8 [B*N, H, D]
    weights: torch.Tensor  # fp32 [B*N, H]


def ragged_lengths(shape: LogitsShape, generator: torch.Generator) -> list[int]:
    low, high = max(shape.mean_len // 2, shape.next_n), max(3 * shape.mean_len // 2, shape.next_n + 1)
    return torch.randint(low, high, (shape.batch_size,), generator=generator).tolist()


def logits_inputs(shape: LogitsShape, fp8_dtype: Fp8Dtype, device: str, seed: int) -> LogitsInputs:
    generator = torch.Generator().manual_seed(seed)
    lengths = ragged_lengths(shape, generator)
    pages = [math.ceil(n / BLOCK_KV) for n in lengths]
    num_blocks = sum(pages)
    # A random permutation of physical blocks, so no kernel profits from contiguous pages.
    physical = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    page_table = torch.zeros(shape.batch_size, max(pages), dtype=torch.int32)
    start = 0
    for row, count in enumerate(pages):
        page_table[row, :count] = physical[start : start + count]
        start += count
    fp8 = torch_dtype(fp8_dtype)
    fp8_max = FP8_MAX[fp8_dtype]
    on = torch.Generator(device=device).manual_seed(seed)
    values = (torch.randn(num_blocks, BLOCK_KV * shape.head_dim, device=device, generator=on) * fp8_max / 4)
    values = values.clamp(-fp8_max, fp8_max).to(fp8).view(torch.uint8)
    scales = torch.rand(num_blocks, BLOCK_KV, device=device, generator=on) * 0.01 + 1e-3
    cache = torch.cat([values, scales.view(torch.uint8)], dim=1)
    tokens = shape.batch_size * shape.next_n
    q = torch.randn(tokens, shape.heads, shape.head_dim, device=device, generator=on) * fp8_max / 4
    return LogitsInputs(
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        seq_lens_host=lengths,
        page_table=page_table.to(device),
        kv_cache=cache.view(num_blocks, BLOCK_KV, 1, shape.head_dim + 4),
        q_tokens=q.clamp(-fp8_max, fp8_max).to(fp8),
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
