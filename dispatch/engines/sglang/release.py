"""The SGLang releases the plugin was written and tested against (tests/engines/sglang-nodeps.txt pins
the same): the hook targets and metadata fields it relies on are checked there by the drift test."""

from __future__ import annotations

from importlib import metadata

from dispatch.contract.errors import EngineVersionError

KNOWN_RELEASES = ("0.5.23",)


def installed_release() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_release(version: str | None = None) -> str:
    """The installed sglang version, or EngineVersionError when it is not one the plugin knows."""
    version = installed_release() if version is None else version
    if version is None:
        raise EngineVersionError("the dispatch SGLang plugin was loaded but sglang is not installed")
    if version not in KNOWN_RELEASES:
        raise EngineVersionError(
            f"sglang {version} is not a release the dispatch plugin knows ({', '.join(KNOWN_RELEASES)}): its "
            "indexer's hook targets and metadata may differ. Unset SGLANG_PLUGINS (or leave `dispatch` out of "
            "it) to run SGLang's own indexer, or install a dispatch release that supports this sglang"
        )
    return version
