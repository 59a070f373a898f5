"""Where the engines' tests go when an engine cannot be imported: a clean skip that names the install
command on a developer's machine, and a failure under CI (`CI=true`), where .ci/run has installed the
pinned engines, so that a dependency the recipe lacks is caught instead of skipping every engine test."""

from __future__ import annotations

import os

import pytest


def engine_missing(message: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message} (under CI the pinned engines are installed by .ci/run: the recipe in "
                    "tests/engines/ is incomplete)", pytrace=False)
    pytest.skip(message)
