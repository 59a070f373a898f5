"""dispatch inside SGLang: the DSA indexer's logits and top-k decided by dispatch's registry.

SGLang's `load_plugins()` calls `register` (the `sglang.srt.plugins` entry point `dispatch`) when
SGLANG_PLUGINS names it; nothing here runs, and sglang is never imported, otherwise. What is replaced
and why: docs/engines/sglang.md."""

from __future__ import annotations


def register() -> None:
    """The entry point: check the SGLang release, then register dispatch's hooks with SGLang's HookRegistry."""
    from dispatch.engines.sglang.hooks import install

    install()
