"""The bounds on what dispatch reads from a file, a plugin or the command line. Each one turns input
that would hang, exhaust memory or flood a terminal into the project's own error, fast. The README's
"Reliability" section lists them; change both together."""

from __future__ import annotations

# A registry is a few KB (the shipped one is 3 KB); parsing YAML in pure Python costs ~3.5 s per MB.
MAX_REGISTRY_BYTES = 256 * 1024
# YAML nodes after expanding every alias as a copy of its anchor (the shipped registry has ~200).
# Counted while the file is composed, so a "billion laughs" fails at the alias that crosses it.
MAX_REGISTRY_NODES = 10_000
# Errors listed from one file before "... and N more"; characters quoted from the input per error.
MAX_ERRORS_LISTED = 50
MAX_QUOTED_CHARS = 80
MAX_MESSAGE_CHARS = 600
# next_n in a registry rule: engines hold it in int32. Larger values are refused, not enumerated.
MAX_RULE_NEXT_N = 2**31 - 1
# What the CLI's what-if accepts: MTP verifies a handful of tokens per step (8 is the most any backend
# here optimises for), and a what-if plan builds and prints one block-table row per request.
MAX_CLI_NEXT_N = 64
MAX_CLI_SEQ_LEN = 2**20  # 8x DeepSeek V3.2's 128K context
MAX_CLI_BATCH = 1024
MAX_CLI_PLAN_TOKENS = 2**24  # requests x the longest: the block table printed is this / 64 entries
# An extend batch `tune` measures: its fp32 logits [M, S] in one chunk (the default workload's largest is
# 4 GiB). The torch reference top-k sorts them with int64 indices, about 8x their bytes at its peak, so
# 8 GiB of logits is about what an H200's 141 GB holds.
MAX_TUNE_LOGITS_BYTES = 8 << 30


def quoted(value: object) -> str:
    """repr(value), cut to MAX_QUOTED_CHARS with the full length said, for messages that quote input."""
    text = repr(value)
    if len(text) <= MAX_QUOTED_CHARS:
        return text
    return f"{text[:MAX_QUOTED_CHARS]}... ({len(text)} characters)"


def cut(text: str) -> str:
    """`text` itself (no quotes added), cut to MAX_QUOTED_CHARS."""
    return text if len(text) <= MAX_QUOTED_CHARS else f"{text[:MAX_QUOTED_CHARS]}... ({len(text)} characters)"


def clipped(message: str) -> str:
    """A message cut to MAX_MESSAGE_CHARS, so one bad value cannot flood a log."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... (message cut at {MAX_MESSAGE_CHARS} characters)"


MAX_NAMES_LISTED = 8  # names an error lists (clusters, ranks) before "and N more"


def listed(names: list[str]) -> str:
    """`names` joined, each cut to MAX_QUOTED_CHARS, at most MAX_NAMES_LISTED of them, the rest counted."""
    shown = ", ".join(cut(name) for name in names[:MAX_NAMES_LISTED])
    return shown + (f", and {len(names) - MAX_NAMES_LISTED} more" if len(names) > MAX_NAMES_LISTED else "")
