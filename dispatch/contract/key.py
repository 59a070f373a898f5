"""The dispatch key: the four facts about a batch that choose a path, validated where they are built.
`Op` is here too, its members read from the op files (dispatch/contract/ops/)."""

from __future__ import annotations

import ast
import enum
from dataclasses import dataclass
from pathlib import Path

from dispatch.contract.errors import InvalidKeyError


class Arch(str, enum.Enum):
    SM80 = "sm80"
    SM89 = "sm89"
    SM90 = "sm90"
    SM100 = "sm100"
    SM120 = "sm120"
    GFX942 = "gfx942"
    GFX950 = "gfx950"
    CPU = "cpu"


class ForwardMode(str, enum.Enum):
    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    EXTEND = "extend"
    IDLE = "idle"


class Fp8Dtype(str, enum.Enum):
    E4M3FN = "e4m3fn"
    E4M3FNUZ = "e4m3fnuz"


def op_names(folder: Path = Path(__file__).parent / "ops") -> list[str]:
    """The `name=` of every `CONTRACT = OpContract(...)` in the op files, in file order: read from their
    source, not imported, because the op files import this module (dispatch/contract/ops/__init__.py
    checks that the imported files declare exactly these)."""
    names = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and [getattr(target, "id", None) for target in node.targets] == ["CONTRACT"]):
                continue
            name = next((kw.value for kw in node.value.keywords if kw.arg == "name"), None)
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                raise ImportError(f"{path}:{node.lineno}: CONTRACT needs its op's name as a literal `name=\"...\"`")
            names.append(name.value)
    return names


# One member per op file (dispatch/contract/ops/<op>.py), named by its CONTRACT: adding an op adds its
# file and edits nothing here.
Op = enum.Enum("Op", [(name.upper(), name) for name in op_names()], type=str, module=__name__, qualname="Op")


# Which fp8 encodings each arch can hold natively. gfx942 (MI300) has only the fnuz
# variant; gfx950 (MI355) moved to OCP e4m3fn; NVIDIA never had fnuz. The CPU holds both
# because torch emulates them in software.
FP8_DTYPES_BY_ARCH: dict[Arch, frozenset[Fp8Dtype]] = {
    Arch.SM80: frozenset({Fp8Dtype.E4M3FN}),
    Arch.SM89: frozenset({Fp8Dtype.E4M3FN}),
    Arch.SM90: frozenset({Fp8Dtype.E4M3FN}),
    Arch.SM100: frozenset({Fp8Dtype.E4M3FN}),
    Arch.SM120: frozenset({Fp8Dtype.E4M3FN}),
    Arch.GFX942: frozenset({Fp8Dtype.E4M3FNUZ}),
    Arch.GFX950: frozenset({Fp8Dtype.E4M3FN}),
    Arch.CPU: frozenset({Fp8Dtype.E4M3FN, Fp8Dtype.E4M3FNUZ}),
}

# The largest magnitude the indexer quantises to, per dtype. 224 rather than fnuz's 240 matches
# vLLM's get_fp8_min_max, which keeps headroom on gfx94x.
FP8_MAX: dict[Fp8Dtype, float] = {Fp8Dtype.E4M3FN: 448.0, Fp8Dtype.E4M3FNUZ: 224.0}


def parse_enum(enum_type: type[enum.Enum], value: object, field: str) -> enum.Enum:
    """Turn a string into a member of `enum_type`, naming the field and the allowed values if not."""
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(member.value for member in enum_type)
        raise InvalidKeyError(f"`{field}` is {value!r}; expected one of: {allowed}") from None


def arch_can_hold(arch: Arch, fp8_dtype: Fp8Dtype) -> bool:
    return fp8_dtype in FP8_DTYPES_BY_ARCH[arch]


@dataclass(frozen=True, slots=True)
class DispatchKey:
    """What the dispatcher decides on: (arch, forward_mode, next_n, fp8_dtype)."""

    arch: Arch
    forward_mode: ForwardMode
    next_n: int
    fp8_dtype: Fp8Dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "arch", parse_enum(Arch, self.arch, "arch"))
        object.__setattr__(self, "forward_mode", parse_enum(ForwardMode, self.forward_mode, "forward_mode"))
        object.__setattr__(self, "fp8_dtype", parse_enum(Fp8Dtype, self.fp8_dtype, "fp8_dtype"))
        if isinstance(self.next_n, bool) or not isinstance(self.next_n, int) or self.next_n < 1:
            raise InvalidKeyError(f"`next_n` is {self.next_n!r}; expected an integer >= 1")
        if self.forward_mode is ForwardMode.DECODE and self.next_n != 1:
            raise InvalidKeyError(
                f"`next_n` is {self.next_n} with forward_mode `decode`; decode verifies one token "
                "per request (speculative verification is `target_verify`)"
            )
        if not arch_can_hold(self.arch, self.fp8_dtype):
            held = ", ".join(sorted(d.value for d in FP8_DTYPES_BY_ARCH[self.arch]))
            raise InvalidKeyError(
                f"`fp8_dtype` {self.fp8_dtype.value} cannot occur on `arch` {self.arch.value}, "
                f"which holds only: {held}"
            )

    def as_dict(self) -> dict[str, object]:
        return {
            "arch": self.arch.value,
            "forward_mode": self.forward_mode.value,
            "next_n": self.next_n,
            "fp8_dtype": self.fp8_dtype.value,
        }

    def __str__(self) -> str:
        return (
            f"arch={self.arch.value} forward_mode={self.forward_mode.value} "
            f"next_n={self.next_n} fp8_dtype={self.fp8_dtype.value}"
        )

