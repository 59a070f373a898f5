"""Every environment variable dispatch reads, in one table: the CLI's `--help` prints it and the
README carries the same rows (tests/test_cli.py keeps the two, and the code, in step)."""

from __future__ import annotations

ENVIRONMENT: tuple[tuple[str, str], ...] = (
    ("DISPATCH_REGISTRY", "registry file to use instead of the packaged registry.yaml (--registry wins)"),
    ("DISPATCH_CLUSTER", "cluster overlay to apply (--cluster wins); unset: the first whose `match` fits"),
    ("DISPATCH_PLUGINS", "third-party plugins to load: entry-point or distribution names, comma-separated, `*` for all; unset or empty: none"),
    ("DISPATCH_ARCH", "this machine's arch instead of the detected one (sm80, sm89, sm90, ...)"),
    ("DISPATCH_FP8_DTYPE", "the platform fp8 dtype instead of the arch's (e4m3fn, e4m3fnuz)"),
    ("DISPATCH_TRACE", "1: log every plugin hook call and each decision in full (at INFO; the CLI shows it)"),
    ("TRITON_INTERPRET", "1: run the Triton kernels on the CPU under Triton's interpreter (slow; tests set it)"),
)


def environment_text() -> str:
    width = max(len(name) for name, _ in ENVIRONMENT)
    return "environment variables:\n" + "\n".join(f"  {name.ljust(width)}  {meaning}" for name, meaning in ENVIRONMENT)


def environment_markdown() -> str:
    rows = "\n".join(f"| `{name}` | {meaning} |" for name, meaning in ENVIRONMENT)
    return "| variable | effect |\n| --- | --- |\n" + rows
