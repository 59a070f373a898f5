"""The vLLM releases the plugin knows: every hook target, patched name, signature and metadata field it
relies on was read from these (tests/engines/test_vllm_plugin_drift.py checks them against the installed one)."""

from __future__ import annotations

from importlib import metadata

from dispatch.contract.errors import EngineVersionError, PluginError

KNOWN_VLLM_VERSIONS = ("0.33.0",)


def check_vllm_version(installed: str | None = None) -> str:
    """The installed vLLM's version; EngineVersionError naming it when the plugin does not know it."""
    if installed is None:
        try:
            installed = metadata.version("vllm")
        except metadata.PackageNotFoundError:
            raise PluginError("dispatch's vLLM plugin was loaded, but no `vllm` distribution is installed") from None
    if installed not in KNOWN_VLLM_VERSIONS:
        raise EngineVersionError(
            f"dispatch's vLLM plugin knows vllm {', '.join(KNOWN_VLLM_VERSIONS)}; this is vllm {installed}. "
            "Its indexer hooks may have moved: upgrade dispatch, or leave `dispatch` out of VLLM_PLUGINS"
        )
    return installed
