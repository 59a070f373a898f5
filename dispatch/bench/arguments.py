"""The argument types of `bench` and `tune`: each value is checked by argparse (exit 2, the option named,
no traceback) before anything is measured, against the bounds a cluster's `workload` takes
(dispatch/registry/models.py), so a typo never costs a measurement or a traceback at its end."""

from __future__ import annotations

import argparse
import re
from typing import Callable

from dispatch.contract.limits import MAX_CLI_BATCH, MAX_CLI_NEXT_N, MAX_CLI_SEQ_LEN, cut

MAX_LIST = 16  # values per list, as a workload takes
_SHAPE = re.compile(r"(\d{1,8})x(\d{1,8})(?:\+(\d{1,8}))?")


def _int(text: str, low: int, high: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{cut(text)!r} is not an integer") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{cut(text)} is out of range; it must be from {low} to {high}")
    return value


def positive_int(high: int) -> Callable[[str], int]:
    """An int in 1..high (argparse names the option in its error)."""
    return lambda text: _int(text, 1, high)


def zero_or_positive_int(high: int) -> Callable[[str], int]:
    """An int in 0..high, 0 meaning "none" (tune's --step-up-to)."""
    return lambda text: _int(text, 0, high)


def int_list(high: int) -> Callable[[str], list[int]]:
    """A comma-separated list of at most MAX_LIST ints, each in 1..high."""

    def parse(text: str) -> list[int]:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers; got {cut(text)!r}")
        if len(parts) > MAX_LIST:
            raise argparse.ArgumentTypeError(f"{len(parts)} values; at most {MAX_LIST}")
        return [_int(part, 1, high) for part in parts]

    return parse


def extend_shapes(text: str) -> list[str]:
    """`RxE+P,...`: R in 1..MAX_CLI_BATCH requests, E in 1..2^20 new tokens, P in 0..2^20 cached keys."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or len(parts) > MAX_LIST:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_LIST} shapes RxE+P; got {cut(text)!r}")
    for part in parts:
        match = _SHAPE.fullmatch(part)
        if not match:
            raise argparse.ArgumentTypeError(
                f"{cut(part)!r} is not RxE+P (R requests of E new tokens after P cached keys, "
                "e.g. 4x4096+12288)"
            )
        requests, extend, prefix = (int(group or 0) for group in match.groups())
        if not (1 <= requests <= MAX_CLI_BATCH and 1 <= extend <= MAX_CLI_SEQ_LEN and prefix <= MAX_CLI_SEQ_LEN):
            raise argparse.ArgumentTypeError(
                f"{part}: R must be from 1 to {MAX_CLI_BATCH}, E from 1 to {MAX_CLI_SEQ_LEN}, "
                f"P from 0 to {MAX_CLI_SEQ_LEN}"
            )
    return parts


BATCH_SIZES = int_list(MAX_CLI_BATCH)
NEXT_N = int_list(MAX_CLI_NEXT_N)
LENGTHS = int_list(MAX_CLI_SEQ_LEN)
K = int_list(MAX_CLI_SEQ_LEN)
TOKENS = int_list(MAX_CLI_SEQ_LEN)
