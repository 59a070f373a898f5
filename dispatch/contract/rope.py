"""How a model lays out the rotary part of the indexer's Q. Both styles occur in the field:
DeepSeek-V4 in vLLM rotates the last rot_dim dims in GPT-J interleaved pairs; other DSA code rotates
the first dims, half-split (NeoX) style."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeSpec:
    interleaved: bool = False  # GPT-J pairs (x0, x1), (x2, x3)...; else NeoX halves
    at_head: bool = True  # rotary dims are the first rot_dim of the head; else the last

    @classmethod
    def neox_head(cls) -> "RopeSpec":
        return cls(interleaved=False, at_head=True)

    @classmethod
    def gptj_tail(cls) -> "RopeSpec":
        return cls(interleaved=True, at_head=False)
