"""How a backend was verified on an arch: the evidence `python -m dispatch gpus` prints beside each
decided path. A backend declares it (Backend.verified), since only its plugin knows where it ran."""

from __future__ import annotations

import enum


class Verified(str, enum.Enum):
    """From the strongest evidence to none; the value is how tables print it."""

    MEASURED = "measured on an H200"  # run, checked against the reference and timed on that hardware
    CPU_TESTS = "CPU tests"  # run on the CPU (torch, or Triton's interpreter) against the reference
    EMULATED = "exact emulation"  # the arch's number format emulated bit-exactly elsewhere; not run on it
    COMPILED = "compiled, never run"  # the kernel compiles for the arch; no such GPU ran it
    CONTRACT = "argument contract only"  # the calls checked against a recording stand-in of the library
    NOT_RUN = "never run on it"  # portable code, with no evidence from this arch
    UNDECLARED = "not declared"  # the plugin did not say
