"""What each engine runs for the paged indexer step on a key: its logits path and its top-k, named as
dispatch's backends, so `bench --op step` marks the rows that are the engines' own stacks and the
comparison users care about (dispatch's decided step against SGLang's and vLLM's) comes from one run.

Read from the releases' call sites (sglang 0.5.23, vllm 0.33.0; /work/shared/domain.md):
- SGLang: DeepGEMM's paged logits, native [B, next_n] only for target_verify on SM100 (its
  `_build_paged_mqa_schedule_2d_ctx_lens`), else decode-native at next_n 1 and flatten beyond;
  top-k v2 (`topk_transform_paged_v2`, page transform fused).
- vLLM: DeepGEMM's paged logits, native where `native_next_n_supported` says (SM90 next_n 1, 2 and 4:
  dispatch's `deepgemm.sm90` for 1 and 2, `deepgemm.sm90.n4` for 4, eligible only with a DeepGEMM build
  that has that kernel, such as tokenspeed-deepgemm; vLLM asks for no other, so without one its stack
  has no row at next_n 4), any next_n on SM100, else flatten (SM90 next_n 3, 5 and up); its "auto"
  top-k (`layers/indexer_topk.py`: cooperative_topk for <= 64 rows, else persistent_topk), dispatch's
  `vllm.auto`.
"""

from __future__ import annotations

from dispatch.contract.key import Arch, DispatchKey, ForwardMode

SGLANG = "SGLang"
VLLM = "vLLM"
# vLLM 0.33's native_next_n_supported on SM90 ({1, 2, 4}), as dispatch's backends name those kernels.
VLLM_SM90_LOGITS = {1: "deepgemm.sm90", 2: "deepgemm.sm90", 4: "deepgemm.sm90.n4"}


def engine_stacks(key: DispatchKey) -> dict[str, tuple[str, str]]:
    """{engine: (logits backend, top-k backend)} for the engines that run this key's arch."""
    if key.arch is Arch.SM100:
        return {SGLANG: ("deepgemm.sm100", "sglang.topk_v2"), VLLM: ("deepgemm.sm100", "vllm.auto")}
    if key.arch is not Arch.SM90:
        return {}
    sglang_native = key.next_n == 1 or key.forward_mode is ForwardMode.DECODE
    return {
        SGLANG: ("deepgemm.sm90" if sglang_native else "deepgemm.sm90.flatten", "sglang.topk_v2"),
        VLLM: (VLLM_SM90_LOGITS.get(key.next_n, "deepgemm.sm90.flatten"), "vllm.auto"),
    }


def stack_of(key: DispatchKey, logits_backend: str, topk_backend: str) -> str | None:
    """"SGLang's stack" when (logits, top-k) is what an engine runs for `key`, else None."""
    engines = [name for name, pair in engine_stacks(key).items() if pair == (logits_backend, topk_backend)]
    return " and ".join(f"{name}'s" for name in engines) + " stack" if engines else None
