"""The shipped registry's text for tests that copy it elsewhere or mutate it.

The shipped file includes its H200 cluster's measured overlay by a path relative to itself
(`measured: measured/h200-mtp.yaml`); a copy written to another folder has no overlay beside it, so
these tests take the text without that one include line. tests/cli/test_tune.py covers overlays."""

from dispatch.deciding.runtime import DEFAULT_REGISTRY

INCLUDE = "    measured: measured/h200-mtp.yaml\n"


def shipped_registry_text() -> str:
    text = DEFAULT_REGISTRY.read_text()
    assert INCLUDE in text, "the shipped registry no longer includes its overlay this way; update tests/support/shipped.py"
    return text.replace(INCLUDE, "")
