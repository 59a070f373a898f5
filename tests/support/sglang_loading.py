"""Load the plugin the way SGLang does: its own load_plugins() over the `sglang.srt.plugins` entry
points, allowlisted by SGLANG_PLUGINS. In a checkout that is not pip-installed, the entry point
pyproject.toml declares is published from a temporary dist-info folder, so the same loader finds it."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import pkgutil

ENTRY_POINTS = "[sglang.srt.plugins]\ndispatch = dispatch.engines.sglang:register\n"


def _installed() -> bool:
    return any(ep.name == "dispatch" for ep in importlib.metadata.entry_points(group="sglang.srt.plugins"))


@contextlib.contextmanager
def plugin_loaded(tmp_path, monkeypatch, allowlist: str | None = "dispatch"):
    """Run SGLang's load_plugins() with SGLANG_PLUGINS=allowlist (None: unset); undo every patch after."""
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from dispatch.engines.sglang.hooks import HOOKS

    if not _installed():
        info = tmp_path / "dispatch_dsa-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dispatch-dsa\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(ENTRY_POINTS)
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()
    if allowlist is None:
        monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("SGLANG_PLUGINS", allowlist)
    owners = [target.rsplit(".", 1) for target, _, _ in HOOKS]
    originals = [(pkgutil.resolve_name(owner), name, vars(pkgutil.resolve_name(owner))[name]) for owner, name in owners]
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    try:
        plugins.load_plugins()
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        HookRegistry.reset()
