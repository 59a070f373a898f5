"""What the CLI tests share: a clean environment (no dispatch variables, no GPU name, a fresh arch
detection) and `run`, which calls the CLI in-process and returns its exit code, stdout and stderr."""

from __future__ import annotations

import pytest

from dispatch.cli.commands import main
from dispatch.contract.detect import detect_arch


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("DISPATCH_REGISTRY", "DISPATCH_CLUSTER", "DISPATCH_PLUGINS", "DISPATCH_ARCH", "DISPATCH_FP8_DTYPE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("dispatch.deciding.clusters.gpu_name", lambda: "")
    detect_arch.cache_clear()
    yield monkeypatch
    detect_arch.cache_clear()


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err
