"""What SGLang 0.5.23 would choose for a key by its own rules, for `explain --engine sglang`: read from
its indexer (dsa_indexer.py `_get_topk_paged` / `_get_topk_ragged`) and attention backend
(dsa_backend.py `_build_paged_mqa_schedule_2d_ctx_lens`), stated here as data. Imports no sglang."""

from __future__ import annotations

from dataclasses import dataclass

from dispatch.contract.key import Arch, DispatchKey, ForwardMode, Op

RELEASE = "sglang 0.5.23"
_HIP = (Arch.GFX942, Arch.GFX950)


@dataclass(frozen=True)
class EngineChoice:
    """One op as the engine would run it: its kernel, its layout, and the rule in its own code."""

    op: Op
    engine: str
    choice: str
    layout: str
    why: str

    def as_dict(self) -> dict[str, str]:
        return {"op": self.op.value, "engine": self.engine, "choice": self.choice, "layout": self.layout, "why": self.why}


def sglang_choices(key: DispatchKey, ops) -> list[EngineChoice]:
    rules = {Op.PAGED_MQA_LOGITS: _paged_logits, Op.RAGGED_MQA_LOGITS: _ragged_logits, Op.TOPK: _topk,
             Op.INDEXER_Q_QUANT: _q_quant}
    return [EngineChoice(op, RELEASE, *rules[op](key)) for op in ops if op in rules]


def _paged_logits(key: DispatchKey) -> tuple[str, str, str]:
    arch, mode, next_n = key.arch, key.forward_mode, key.next_n
    if arch in _HIP:
        return ("aiter paged MQA logits", "per token", "ROCm: `--dsa-paged-mqa-logits-backend` resolves to aiter")
    if arch is Arch.CPU:
        return ("torch fallback (SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1)", "flatten",
                "no CUDA: the indexer reshapes every lens to per-token [B*N, 1]; the fallback takes next_n 1 only")
    if mode is ForwardMode.TARGET_VERIFY and next_n >= 2 and arch is Arch.SM100:
        return ("DeepGEMM fp8_paged_mqa_logits, native", "native",
                "target_verify, next_n >= 2, SM100: the backend builds paged_mqa_ctx_lens_2d as [B, next_n] and the "
                "indexer takes the native path because `ctx_2d.shape == (B, next_n)` (an implicit shape check)")
    if mode is ForwardMode.TARGET_VERIFY and next_n >= 2:
        return ("DeepGEMM fp8_paged_mqa_logits, flatten", "flatten",
                f"target_verify on {arch.value}: native is SM100-only (a TODO for SM90), so each of the next_n "
                "tokens is its own request and every KV page is read next_n times")
    notes = ""
    if arch not in (Arch.SM90, Arch.SM100):
        notes = f"; DeepGEMM has no paged-logits kernel for {arch.value} (sglang #31480: SM120 fails at the first decode)"
    layout = "native = flatten at next_n 1" if next_n == 1 else "flatten"
    return ("DeepGEMM fp8_paged_mqa_logits", layout, f"{mode.value}: lens per token, [B*N, 1]{notes}")


def _ragged_logits(key: DispatchKey) -> tuple[str, str, str]:
    if key.arch in _HIP:
        return ("aiter fp8_mqa_logits", "ragged", "ROCm extend batches")
    return ("DeepGEMM fp8_mqa_logits", "ragged",
            "extend: K gathered by the pool, query rows chunked to a free-memory logits budget")


def _topk(key: DispatchKey) -> tuple[str, str, str]:
    return ("`--dsa-topk-backend` (sgl-kernel fast_topk_v2 by default; torch or flashinfer)", "rows",
            "one start-up flag for every batch; SGLANG_DSA_FUSE_TOPK fuses the page-table transform")


def _q_quant(key: DispatchKey) -> tuple[str, str, str]:
    dtype = "e4m3fnuz" if key.arch is Arch.GFX942 else "e4m3fn"
    return ("fused_q_indexer_rope_first_quant, or RoPE + Hadamard rotation + act_quant", "tokens",
            f"fp8 {dtype} per 128-block scale; the plugin receives Q after this step (dispatch does not replace it)")


def choices_text(choices: list[EngineChoice]) -> str:
    lines = [f"{RELEASE} by its own rules (what it would run without the dispatch plugin):"]
    for choice in choices:
        lines.append(f"  {choice.op.value}: {choice.choice} [{choice.layout}]")
        lines.append(f"    why: {choice.why}")
    return "\n".join(lines)
