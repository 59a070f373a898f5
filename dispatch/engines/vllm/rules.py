"""What vLLM 0.33.0 would choose for a key by its own rules, for `explain --engine vllm`. Pure: it
imports no vLLM, so a what-if for any arch runs anywhere.

vLLM decides the paged decode layout once at start-up (`_use_flattening`, `_supports_native_decode`,
`_supports_varlen_paged_mqa_logits` in v1/attention/backends/mla/indexer.py; `native_next_n_supported`
in utils/deep_gemm.py), from the arch and the configured next_n, and per step keeps native only where the
step's next_n has a kernel. Q is quantised into `current_platform.fp8_dtype()` by its fused kernels."""

from __future__ import annotations

from dataclasses import dataclass

from dispatch.contract.key import Arch, DispatchKey, ForwardMode

SM90_NATIVE_NEXT_N = frozenset({1, 2, 4})  # native_next_n_supported on SM90


@dataclass(frozen=True)
class EngineChoice:
    """An engine's choice for a key, in its own terms."""

    engine: str
    layout: str  # native / flatten / varlen / ragged
    rule: str  # the engine's function that decides it
    why: str

    def as_dict(self) -> dict[str, str]:
        return {"engine": self.engine, "layout": self.layout, "rule": self.rule, "why": self.why}

    def text(self) -> str:
        return f"{self.engine} would run: {self.layout} ({self.rule}: {self.why})"


def vllm_choice(key: DispatchKey, *, adaptive_verification: bool = False) -> EngineChoice:
    """vLLM's paged-logits layout for `key` (DeepGEMM present on NVIDIA), or its extend path."""
    if key.forward_mode is ForwardMode.EXTEND:
        return EngineChoice("vllm", "ragged", "sparse_attn_indexer (prefill chunks)",
                            "prefill gathers K per chunk and scores it with fp8_fp4_mqa_logits on every arch")
    next_n = key.next_n
    arch = key.arch
    if arch is Arch.SM100:
        return EngineChoice("vllm", "varlen", "_supports_varlen_paged_mqa_logits",
                            "SM100 with DeepGEMM expands every decode token to its own row (varlen kernel)")
    if arch is Arch.SM90:
        native = next_n in SM90_NATIVE_NEXT_N
        why = f"SM90 native_next_n_supported is next_n in {sorted(SM90_NATIVE_NEXT_N)}; next_n={next_n}"
    else:
        native = next_n in (1, 2)
        why = f"_supports_native_decode outside SM90/SM100 is next_n in [1, 2]; next_n={next_n}"
    if native and adaptive_verification and arch is Arch.SM90:
        return EngineChoice("vllm", "flatten", "_use_flattening",
                            "adaptive verification on SM90 flattens whatever next_n is")
    return EngineChoice("vllm", "native" if native else "flatten", "_use_flattening", why)
