"""`cuda.radix`'s start-up, on any machine, with fakes for the GPU and the compiler: the probe reads
machine facts only (never a build), the build runs at the warm-up or the first call (never inside a
capture), atomically (a killed build leaves nothing half-written, a compiler failure leaves a marker
the next probe reads), and processes that start together take turns through a lock whose wait is
bounded (a dead owner's lock is taken over at once)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from backends.cuda_topk import build, compile_cache
from backends.cuda_topk.compile_cache import BuildSlot, CachedFailure, CompileFailed, built_library
from dispatch.contract import Arch, BackendError

FACTS = build.MachineFacts(rocm=False, gpu_visible=True, arch=Arch.SM90, capability=(9, 0), nvcc="/opt/cuda/bin/nvcc",
                           nvcc_version="13.0", torch_cuda="13.0", torch_version="2.13.0")


def library_builder(calls: list, *, delay: float = 0.0, fail: BaseException | None = None):
    """A build(folder) that writes a stand-in library, counting its calls."""
    def build_into(folder: Path) -> Path:
        calls.append(folder)
        assert folder.is_dir() and folder.name.startswith(".build-")
        time.sleep(delay)
        if fail is not None:
            raise fail
        library = folder / "lib.so"
        library.write_bytes(b"ELF stand-in")
        return library
    return build_into


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ---- the cache: atomic, marked failures, a bounded lock ----

def test_built_once_then_loaded_from_the_cache_and_nothing_left_beside_it(tmp_path):
    slot, calls = BuildSlot(tmp_path / "key", "ext"), []
    assert built_library(slot, library_builder(calls), wait_s=1) == slot.library
    assert built_library(slot, library_builder(calls), wait_s=1) == slot.library
    assert len(calls) == 1 and slot.library.read_bytes() == b"ELF stand-in"
    assert sorted(p.name for p in slot.directory.iterdir()) == ["ext.so"]  # no lock, no build folder


@pytest.mark.parametrize("interruption", [KeyboardInterrupt(), RuntimeError("nvcc was killed"), OSError(28, "disk full")])
def test_a_build_stopped_midway_leaves_no_library_no_marker_and_no_folder(tmp_path, interruption):
    slot = BuildSlot(tmp_path / "key", "ext")
    with pytest.raises(type(interruption)):
        built_library(slot, library_builder([], fail=interruption), wait_s=1)
    assert list(slot.directory.iterdir()) == []
    calls = []
    assert built_library(slot, library_builder(calls), wait_s=1) == slot.library and len(calls) == 1


def test_a_compiler_failure_is_marked_so_later_processes_do_not_build_again_until_forgotten(tmp_path):
    slot, calls = BuildSlot(tmp_path / "key", "ext"), []
    with pytest.raises(CompileFailed, match="radix_select.cu\\(3\\): error"):
        built_library(slot, library_builder(calls, fail=CompileFailed("radix_select.cu(3): error: x")), wait_s=1)
    assert compile_cache.cached_failure(slot) == "radix_select.cu(3): error: x"
    with pytest.raises(CachedFailure, match=f"error: x \\(cached in {slot.failure}\\)"):
        built_library(slot, library_builder(calls), wait_s=1)
    assert len(calls) == 1
    compile_cache.forget_failure(slot)
    assert built_library(slot, library_builder(calls), wait_s=1) == slot.library and len(calls) == 2
    assert compile_cache.cached_failure(slot) is None


def test_a_lock_whose_owner_died_on_this_host_is_taken_over_at_once(tmp_path):
    slot, calls = BuildSlot(tmp_path / "key", "ext"), []
    slot.directory.mkdir(parents=True)
    slot.lock.write_text(f"{socket.gethostname()} {dead_pid()}\n")
    left = slot.directory / f".build-{socket.gethostname()}-{dead_pid()}-0badf00d"
    left.mkdir()
    (left / "half.o").write_bytes(b"half")
    naps = []
    assert built_library(slot, library_builder(calls), wait_s=100, sleep=naps.append) == slot.library
    assert len(calls) == 1 and naps == [] and not left.exists() and not slot.lock.exists()


def test_a_live_lock_is_waited_for_and_its_library_used(tmp_path):
    slot, calls = BuildSlot(tmp_path / "key", "ext"), []
    slot.directory.mkdir(parents=True)
    slot.lock.write_text(f"{socket.gethostname()} {os.getpid()}\n")  # a live owner: this very process

    def nap(seconds):  # the owner finishes while we wait
        slot.library.write_bytes(b"theirs")
        slot.lock.unlink()

    assert built_library(slot, library_builder(calls), wait_s=100, sleep=nap) == slot.library
    assert calls == [] and slot.library.read_bytes() == b"theirs"


def test_the_wait_is_bounded_then_it_builds_beside_the_owner(tmp_path):
    slot, calls = BuildSlot(tmp_path / "key", "ext"), []
    slot.directory.mkdir(parents=True)
    slot.lock.write_text("another-host 12345\n")  # never judged dead: another host's
    now = [0.0]
    naps = []

    def nap(seconds):
        naps.append(seconds)
        now[0] += seconds

    assert built_library(slot, library_builder(calls), wait_s=3, poll_s=1, clock=lambda: now[0], sleep=nap) == slot.library
    assert naps == [1, 1, 1] and len(calls) == 1
    assert slot.lock.read_text() == "another-host 12345\n"  # the owner's lock is left to the owner


def test_processes_starting_together_build_once(tmp_path):
    slot, calls, results, errors = BuildSlot(tmp_path / "key", "ext"), [], [], []

    def one():
        try:
            results.append(built_library(slot, library_builder(calls, delay=0.3), wait_s=30, poll_s=0.02))
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == [] and results == [slot.library] * 4 and len(calls) == 1


# ---- the probe: machine facts only ----

def test_the_reasons_it_cannot_run():
    assert build.cuda_topk_availability(FACTS, None).ok
    cases = [
        ({"rocm": True}, None, "torch is a ROCm build"),
        ({"gpu_visible": False}, None, "no CUDA device visible to torch"),
        ({"arch": Arch.GFX942}, None, "arch gfx942 is not among"),
        ({"nvcc": None}, None, "nvcc not found"),
        ({"nvcc_version": None}, None, "nvcc at /opt/cuda/bin/nvcc did not report a release"),
        ({"nvcc_version": "12.8"}, None, "nvcc 12.8 (/opt/cuda/bin/nvcc) but torch was built with CUDA 13.0"),
        ({}, "radix_select.cu(1): error: x", "compile failed: radix_select.cu(1): error: x"),
    ]
    for change, cached, reason in cases:
        facts = build.MachineFacts(**{**FACTS.__dict__, **change})
        availability = build.cuda_topk_availability(facts, cached)
        assert not availability.ok and reason in availability.reason, (change, availability.reason)


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A GPU machine with nvcc, as far as build.py can tell, and a cache of its own; a build fails the test."""
    monkeypatch.setattr(build, "machine_facts", lambda: FACTS)
    monkeypatch.setenv("DISPATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "compile_into", lambda *a, **k: pytest.fail("built"))
    build.extension.cache_clear()
    yield build.build_slot(FACTS)
    build.extension.cache_clear()


def test_the_probe_says_yes_without_building_and_reads_a_cached_failure(machine):
    assert build.probe().ok
    assert not machine.directory.exists()  # not even a folder
    machine.directory.mkdir(parents=True)
    machine.failure.write_text("radix_select.cu(42): error: identifier \"x\" is undefined\n\nthe log ...")
    reason = build.probe().reason
    assert reason.startswith('compile failed: radix_select.cu(42): error: identifier "x" is undefined (cached in ')
    assert "backends --warm" in reason


def test_the_probe_on_this_machine_is_quick_and_names_what_is_missing():
    started = time.monotonic()
    availability = build.probe()
    if not torch.cuda.is_available():
        assert availability.reason == "no CUDA device visible to torch"
    assert time.monotonic() - started < 10


def test_the_first_call_inside_a_capture_is_refused_not_built(machine, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(BackendError, match="first called inside a CUDA-graph capture.*IndexerStep.warm"):
        build.extension()


def test_warm_builds_once_forgets_a_cached_failure_and_loads(machine, monkeypatch):
    calls, loaded = [], []
    monkeypatch.setattr(build, "compile_into", lambda folder, **_: library_builder(calls)(folder))
    monkeypatch.setattr(build, "load_library", lambda name, path: loaded.append((name, path)) or "module")
    machine.directory.mkdir(parents=True)
    machine.failure.write_text("old failure")
    assert build.warm().ok
    assert len(calls) == 1 and loaded == [(machine.name, machine.library)] and not machine.failure.exists()
    assert build.extension() == "module" and len(calls) == 1  # loaded once per process


def test_warm_where_the_machine_rules_it_out_builds_nothing(monkeypatch):
    monkeypatch.setattr(build, "machine_facts", lambda: build.MachineFacts(**{**FACTS.__dict__, "gpu_visible": False}))
    monkeypatch.setattr(build, "compile_into", lambda *a, **k: pytest.fail("built"))
    assert build.warm().reason == "no CUDA device visible to torch"


def test_a_failed_build_at_the_first_call_is_an_error_naming_the_backend_and_is_marked(machine, monkeypatch):
    def refused(folder, **_):
        raise CompileFailed("radix_select.cu(7): error: bad\n\nlog")

    monkeypatch.setattr(build, "compile_into", refused)
    with pytest.raises(BackendError, match=r"`cuda.radix` failed to compile: radix_select.cu\(7\): error: bad"):
        build.extension()
    assert build.probe().reason.startswith("compile failed: radix_select.cu(7): error: bad (cached in")


# ---- the child build and the facts it is keyed by ----

def fake_child(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "child.py"
    script.write_text("import os, sys\nsource, folder, name = sys.argv[1:]\n" + body)
    return script


@pytest.mark.parametrize(("body", "outcome"), [
    ("open(os.path.join(folder, name + '.so'), 'w').write(os.environ['TORCH_CUDA_ARCH_LIST'])", "ok"),
    ("print('[1/2] nvcc ...'); print('radix_select.cu(9): error: no', file=sys.stderr); sys.exit(1)", "compile"),
    ("import signal; os.kill(os.getpid(), signal.SIGKILL)", "signal"),
    ("pass", "nothing"),
])
def test_the_child_build_result_compile_failure_or_signal(tmp_path, monkeypatch, body, outcome):
    monkeypatch.setattr(build, "CHILD", fake_child(tmp_path, body))
    folder = tmp_path / "out"
    folder.mkdir()
    if outcome == "ok":
        library = build.compile_into(folder, facts=FACTS, name="ext")
        assert library == folder / "ext.so" and library.read_text() == "9.0"
    elif outcome == "compile":
        with pytest.raises(CompileFailed, match="^radix_select.cu\\(9\\): error: no"):
            build.compile_into(folder, facts=FACTS, name="ext")
    elif outcome == "signal":  # not the compiler's verdict: no CompileFailed, so no marker
        with pytest.raises(BackendError, match="stopped by signal 9"):
            build.compile_into(folder, facts=FACTS, name="ext")
    else:
        with pytest.raises(CompileFailed, match="left no ext.so"):
            build.compile_into(folder, facts=FACTS, name="ext")


def test_nvcc_release_is_read_from_its_version_text(tmp_path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    assert build.nvcc_release(str(nvcc)) == "13.0"
    nvcc.write_text("#!/bin/sh\necho 'something else'\n")
    assert build.nvcc_release(str(nvcc)) is None
    assert build.nvcc_release(str(tmp_path / "missing")) is None


def test_the_build_cache_is_per_user_and_keyed_by_what_changes_the_binary(monkeypatch, tmp_path):
    base = (b"source", "2.11.0", "13.0", (9, 0), "13.0")
    key = build.build_key(*base)
    assert key == build.build_key(*base)
    changed = [(b"source!",) + base[1:], base[:1] + ("2.12.0",) + base[2:], base[:2] + ("12.8",) + base[3:],
               base[:3] + ((10, 0),) + base[4:], base[:4] + ("13.1",)]
    assert len({key} | {build.build_key(*c) for c in changed}) == 6
    monkeypatch.setenv("DISPATCH_CACHE_DIR", str(tmp_path / "mine"))
    assert build.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("DISPATCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_root() == tmp_path / "xdg" / "dispatch"
