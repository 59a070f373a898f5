"""Every environment variable dispatch reads, in one table: the CLI's `--help` prints it and docs/cli.md
carries it as generated here (tests/cli/test_cli_conventions.py keeps the two, and the code, in step)."""

from __future__ import annotations

# (name, read by (markdown), effect)
ENVIRONMENT: tuple[tuple[str, str, str], ...] = (
    ("DISPATCH_REGISTRY", "`dispatch/deciding/runtime.py`", "the registry file, instead of the packaged registry.yaml (--registry wins)"),
    ("DISPATCH_CLUSTER", "`dispatch/deciding/clusters.py`", "the cluster overlay, instead of a declared `match` (--cluster wins)"),
    ("DISPATCH_PLUGINS", "`dispatch/contract/host.py`",
     "third-party plugins to load: entry-point or distribution names (the latter normalized), comma-separated, "
     "`*` for all; unset or empty: none; an entry matching nothing is a warning"),
    ("DISPATCH_ARCH", "`dispatch/contract/detect.py`", "this machine's arch, instead of detecting it (sm80, sm89, sm90, ...)"),
    ("DISPATCH_FP8_DTYPE", "`dispatch/contract/detect.py`", "the platform's fp8 dtype, instead of the arch's (e4m3fn, e4m3fnuz)"),
    ("DISPATCH_TRACE", "`dispatch/contract/host.py`, `dispatch/deciding/dispatcher.py`, `dispatch/cli/logs.py`",
     "`1` logs every hook call and each decision in full, at INFO (the CLI shows it without -v)"),
    ("DISPATCH_DEBUG_BOUNDS", "`dispatch/contract/bounds.py`",
     "`1` makes the Triton and DeepGEMM wrappers check pages, lengths and positions on the host before each launch "
     "(one sync a call) and raise `IndexBoundsError` at once"),
    ("DISPATCH_PDL", "`dispatch/contract/detect.py` (for backends/shared/dependent_launch.py and bench's report)",
     "`0` launches dispatch's own kernels without programmatic dependent launch (on by default on sm90 and later: "
     "each kernel's start overlaps the end of the one before); for timing the step without it"),
    ("DISPATCH_CACHE_DIR", "`backends/cuda_topk/build.py`",
     "where `cuda.radix` keeps its compiled kernel (default `$XDG_CACHE_HOME/dispatch`, else `~/.cache/dispatch`)"),
    ("XDG_CACHE_HOME", "`backends/cuda_topk/build.py`",
     "the per-user cache root `cuda.radix` builds under when `DISPATCH_CACHE_DIR` is unset"),
    ("CUDA_HOME", "`backends/cuda_topk/build.py` (and torch's C++-extension tooling)",
     "the CUDA toolkit whose `bin/nvcc` compiles `cuda.radix` (else the first `nvcc` on PATH, else /usr/local/cuda's)"),
    ("TRITON_INTERPRET", "`dispatch/contract/detect.py` (and Triton)",
     "`1` runs the Triton kernels on the CPU under Triton's interpreter; the Triton backends are then available without a GPU"),
    ("VLLM_PLUGINS", "`dispatch/engines/vllm/plugin.py` (and vLLM)",
     "vLLM's plugin allowlist, comma-separated: dispatch's vLLM plugin is on only when it names `dispatch` "
     "(unset: vLLM loads every plugin, and this one stays off); docs/engines/vllm.md"),
    ("OUT", "`tools/tune_*.py`, `tools/probe_extend.py`",
     "where the tuners write their results (default: the current folder; the probe writes nothing without it)"),
    ("SGLANG_PLUGINS", "`dispatch/engines/sglang/__init__.py` (and SGLang)",
     "SGLang's plugin allowlist: naming `dispatch` routes SGLang's DSA indexer through dispatch; unset or "
     "without it, the installed plugin stays inert (docs/engines/sglang.md)"),
)


def environment_text() -> str:
    width = max(len(name) for name, _, _ in ENVIRONMENT)
    lines = [f"  {name.ljust(width)}  {effect.replace('`', '')}" for name, _, effect in ENVIRONMENT]
    return "environment variables:\n" + "\n".join(lines)


def environment_markdown() -> str:
    rows = "\n".join(f"| `{name}` | {read_by} | {effect} |" for name, read_by, effect in ENVIRONMENT)
    return "| variable | read by | effect |\n| --- | --- | --- |\n" + rows
