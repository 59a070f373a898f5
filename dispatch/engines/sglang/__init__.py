"""dispatch inside SGLang: the DSA indexer's logits and top-k decided by dispatch's registry.

SGLang's `load_plugins()` calls `register` (the `sglang.srt.plugins` entry point `dispatch`) when
SGLANG_PLUGINS names it; nothing here runs, and sglang is never imported, otherwise. What is replaced
and why: docs/engines/sglang.md."""

from __future__ import annotations


import logging
import os

ENTRY_POINT = "dispatch"  # the name SGLANG_PLUGINS must list


def register() -> None:
    """The entry point: when SGLANG_PLUGINS names `dispatch`, check the SGLang release, then register
    dispatch's hooks with SGLang's HookRegistry. SGLang loads every installed plugin when SGLANG_PLUGINS
    is unset; dispatch stays inert then, so installing it never changes an engine by itself."""
    named = {name.strip() for name in os.environ.get("SGLANG_PLUGINS", "").split(",")}
    if ENTRY_POINT not in named:
        logging.getLogger("dispatch.engines.sglang").info(
            "dispatch SGLang plugin installed but inert: SGLANG_PLUGINS does not name `%s`", ENTRY_POINT
        )
        return
    from dispatch.engines.sglang.hooks import install

    install()
