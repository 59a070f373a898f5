"""The CLI refuses numbers it cannot honour, with exit 2 and before building anything: a huge --next-n
or --seq-lens used to hang the what-if plan or overflow a tensor."""

from __future__ import annotations

import time

import pytest

from dispatch.cli.commands import main
from dispatch.contract.limits import MAX_CLI_BATCH, MAX_CLI_NEXT_N, MAX_CLI_PLAN_TOKENS, MAX_CLI_SEQ_LEN


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--next-n", str(10**23)], f"--next-n is {10**23}; it must be from 1 to {MAX_CLI_NEXT_N}"),
        (["--next-n", "3000000000"], f"it must be from 1 to {MAX_CLI_NEXT_N}"),
        (["--next-n", str(MAX_CLI_NEXT_N + 1)], f"it must be from 1 to {MAX_CLI_NEXT_N}"),
        (["--next-n", "1" * 500], "...(500 digits)"),
        (["--next-n", "2", "--seq-lens", "100000000000"], f"length is 100000000000; it must be from 1 to {MAX_CLI_SEQ_LEN}"),
        (["--next-n", "2", "--seq-lens", f"7,{MAX_CLI_SEQ_LEN + 1}"], f"it must be from 1 to {MAX_CLI_SEQ_LEN}"),
        (["--next-n", "2", "--seq-lens", ",".join(["9"] * (MAX_CLI_BATCH + 1))], f"at most {MAX_CLI_BATCH}"),
        (["--next-n", "2", "--seq-lens", ",".join([str(MAX_CLI_SEQ_LEN)] * 17)], f"past {MAX_CLI_PLAN_TOKENS} tokens"),
        (["--next-n", "2", "--seq-lens", "5,x"], "'x' is not an integer"),
    ],
    ids=["next-n-1e23", "next-n-3e9", "next-n-65", "next-n-500-digits", "len-1e11", "len-past-cap", "batch", "table", "not-int"],
)
def test_huge_numbers_exit_2_at_once(capsys, argv, words):
    started = time.perf_counter()
    assert main(["explain", "--arch", "cpu", "--forward-mode", "target_verify", *argv]) == 2  # a usage error
    assert time.perf_counter() - started < 1.0
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_the_largest_accepted_values_still_explain(capsys):
    assert main(["explain", "--arch", "cpu", "--forward-mode", "target_verify", "--next-n", str(MAX_CLI_NEXT_N)]) == 0
    assert main(["explain", "--arch", "cpu", "--forward-mode", "target_verify", "--next-n", "2", "--seq-lens", "70,3"]) == 0
    capsys.readouterr()
