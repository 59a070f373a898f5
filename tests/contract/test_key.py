"""DispatchKey validation and host detection (dispatch.contract.key, dispatch.contract.detect)."""

from __future__ import annotations

import dataclasses

import pytest

from dispatch.contract.detect import detect_arch, platform_fp8_dtype
from dispatch.contract.errors import InvalidKeyError
from dispatch.contract.key import FP8_DTYPES_BY_ARCH, Arch, DispatchKey, ForwardMode, Fp8Dtype

VALID = {"arch": "sm90", "forward_mode": "target_verify", "next_n": 2, "fp8_dtype": "e4m3fn"}


def key(**changes) -> DispatchKey:
    return DispatchKey(**{**VALID, **changes})


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"arch": "sm77"}, "arch"),
        ({"arch": "SM90"}, "arch"),
        ({"arch": None}, "arch"),
        ({"forward_mode": "prefill"}, "forward_mode"),
        ({"fp8_dtype": "e5m2"}, "fp8_dtype"),
        ({"next_n": 0}, "next_n"),
        ({"next_n": -1}, "next_n"),
        ({"next_n": True}, "next_n"),
        ({"next_n": 2.0}, "next_n"),
        ({"next_n": "2"}, "next_n"),
        ({"forward_mode": "decode", "next_n": 2}, "next_n"),
    ],
)
def test_invalid_value_names_the_field(changes, field):
    with pytest.raises(InvalidKeyError, match=f"`{field}`"):
        key(**changes)


def test_unknown_value_lists_the_allowed_ones():
    with pytest.raises(InvalidKeyError) as error:
        key(arch="sm77")
    assert "'sm77'" in str(error.value)
    for arch in Arch:
        assert arch.value in str(error.value)


def test_decode_message_points_at_target_verify():
    with pytest.raises(InvalidKeyError, match="decode") as error:
        key(forward_mode="decode", next_n=2)
    assert "target_verify" in str(error.value)


@pytest.mark.parametrize(
    "arch, fp8_dtype",
    [("sm90", "e4m3fnuz"), ("sm100", "e4m3fnuz"), ("sm80", "e4m3fnuz"), ("gfx942", "e4m3fn"), ("gfx950", "e4m3fnuz")],
)
def test_impossible_arch_dtype_pair(arch, fp8_dtype):
    with pytest.raises(InvalidKeyError) as error:
        key(arch=arch, fp8_dtype=fp8_dtype)
    message = str(error.value)
    assert "`fp8_dtype`" in message and "`arch`" in message
    assert arch in message and fp8_dtype in message


def test_invalid_key_error_is_a_value_error():
    with pytest.raises(ValueError):
        key(next_n=0)


@pytest.mark.parametrize("arch", list(Arch))
def test_valid_keys_for_every_arch(arch):
    for fp8_dtype in FP8_DTYPES_BY_ARCH[arch]:
        decode = DispatchKey(arch.value, "decode", 1, fp8_dtype.value)
        assert decode.arch is arch and decode.fp8_dtype is fp8_dtype
        assert decode.forward_mode is ForwardMode.DECODE
        for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.EXTEND):
            for next_n in (1, 2, 4, 8):
                made = DispatchKey(arch, mode, next_n, fp8_dtype)
                assert made.as_dict() == {
                    "arch": arch.value,
                    "forward_mode": mode.value,
                    "next_n": next_n,
                    "fp8_dtype": fp8_dtype.value,
                }


def test_cpu_holds_both_fp8_dtypes():
    assert DispatchKey("cpu", "decode", 1, "e4m3fn").fp8_dtype is Fp8Dtype.E4M3FN
    assert DispatchKey("cpu", "decode", 1, "e4m3fnuz").fp8_dtype is Fp8Dtype.E4M3FNUZ


def test_strings_and_members_make_equal_hashable_keys():
    a = DispatchKey("sm100", "target_verify", 3, "e4m3fn")
    b = DispatchKey(Arch.SM100, ForwardMode.TARGET_VERIFY, 3, Fp8Dtype.E4M3FN)
    assert a == b and hash(a) == hash(b)
    assert len({a, b, key()}) == 2


def test_key_is_frozen():
    made = key()
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.next_n = 3


@pytest.fixture
def fresh_detection(monkeypatch):
    monkeypatch.delenv("DISPATCH_ARCH", raising=False)
    monkeypatch.delenv("DISPATCH_FP8_DTYPE", raising=False)
    detect_arch.cache_clear()
    yield monkeypatch
    detect_arch.cache_clear()


@pytest.mark.parametrize("arch", list(Arch))
def test_dispatch_arch_overrides_detection(fresh_detection, arch):
    fresh_detection.setenv("DISPATCH_ARCH", arch.value)
    assert detect_arch() is arch


def test_dispatch_arch_unknown_value_names_the_variable(fresh_detection):
    fresh_detection.setenv("DISPATCH_ARCH", "sm77")
    with pytest.raises(InvalidKeyError, match="DISPATCH_ARCH"):
        detect_arch()


def test_detection_without_override_on_a_cpu_machine(fresh_detection):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; its arch depends on the GPU")
    assert detect_arch() is Arch.CPU


def test_platform_fp8_dtype(fresh_detection):
    assert platform_fp8_dtype(Arch.GFX942) is Fp8Dtype.E4M3FNUZ
    for arch in set(Arch) - {Arch.GFX942}:
        assert platform_fp8_dtype(arch) is Fp8Dtype.E4M3FN


def test_dispatch_fp8_dtype_overrides_the_platform(fresh_detection):
    fresh_detection.setenv("DISPATCH_FP8_DTYPE", "e4m3fnuz")
    assert platform_fp8_dtype(Arch.CPU) is Fp8Dtype.E4M3FNUZ
    fresh_detection.setenv("DISPATCH_FP8_DTYPE", "e4m3fn")
    assert platform_fp8_dtype(Arch.GFX942) is Fp8Dtype.E4M3FN
    fresh_detection.setenv("DISPATCH_FP8_DTYPE", "e5m2")
    with pytest.raises(InvalidKeyError, match="DISPATCH_FP8_DTYPE"):
        platform_fp8_dtype(Arch.CPU)
