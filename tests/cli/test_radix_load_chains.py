"""tools/radix_load_chains.py on SASS listings written here in cuobjdump's layout: the instances are told apart
by their template arguments, a run of row loads is counted up to its first NaN test, a stretch of
load-store pairs ends at a barrier; ptxas's -v report gives each instance its registers and spills. Compiling
needs nvcc, which CI lacks: the tool says so by name."""

import pytest

from tools import radix_load_chains

HEADER = "\t\tFunction : _ZN39_GLOBAL__N__0_7_copy_cu_0_17radix_topk_kernelILi{t}ENS_{n}{config}ELb{pages}EEEvNS_6ParamsE\n"


def sass(*instances):
    """A listing of (threads, config, pages, [instructions]) instances, with cuobjdump's offsets and encodings."""
    lines = []
    for threads, config, pages, code in instances:
        lines.append(HEADER.format(t=threads, n=len(config), config=config, pages=pages))
        for at, op in enumerate(code):
            lines.append(f"        /*{at * 16:04x}*/                   {op} ;   /* 0x000000000000794d */\n")
            lines.append("                                                             /* 0x000fea0003800000 */\n")
    return "".join(lines)


def row_loads(count):
    return [f"@!P{i % 4} LDG.E.CONSTANT R{4 + i}, desc[UR10][R{20 + 2 * i}.64]" for i in range(count)]


NAN_TEST = "@!P0 FSETP.NAN.AND P4, PT, R4, R4, PT"


def test_a_run_of_row_loads_counts_what_issues_before_its_first_nan_test():
    interleaved = [*row_loads(3), NAN_TEST, *row_loads(5), NAN_TEST]
    in_place = [*row_loads(8), NAN_TEST, NAN_TEST]
    found = radix_load_chains.chains(sass((1024, "Wide", 0, interleaved), (512, "ShortList", 1, in_place)))
    assert [(c.instance, c.load_runs) for c in found] == [("1024 Wide pages=0", ((8, 3),)),
                                                          ("512 ShortList pages=1", ((8, 8),))]
    assert "3 of 8 before waiting" in found[0].line()


def test_short_load_runs_are_not_reported():
    found = radix_load_chains.chains(sass((512, "Wide", 0, [*row_loads(radix_load_chains.MIN_RUN - 1), NAN_TEST])))
    assert found[0].load_runs == ()
    assert "short-row loads none" in found[0].line()


def test_load_store_pairs_end_at_a_barrier():
    load, store = "LDG.E R7, desc[UR10][R4.64]", "STG.E desc[UR10][R8.64], R7"
    code = [load, store, load, "IMAD R9, R7, R2, R3", store, load, store, "BAR.SYNC.DEFER_BLOCKING 0x0", load, store,
            load, load, store]
    found = radix_load_chains.chains(sass((1024, "Wide", 1, code)))
    assert found[0].longest_pairs == 3


def test_the_command_reads_a_saved_listing_and_refuses_one_without_the_kernel(tmp_path, capsys):
    listing = tmp_path / "k.sass"
    listing.write_text(sass((1024, "Wide", 1, [*row_loads(6), NAN_TEST])))
    assert radix_load_chains.main(["--sass", str(listing)]) == 0
    assert "1024 Wide pages=1: short-row loads 6 of 6 before waiting" in capsys.readouterr().out
    listing.write_text("\t\tFunction : _Z5otherv\n        /*0000*/    EXIT ;  /* 0x0 */\n")
    assert radix_load_chains.main(["--sass", str(listing)]) == 1
    assert "no radix_topk_kernel instance" in capsys.readouterr().err


def test_compiling_without_nvcc_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(radix_load_chains, "find_nvcc", lambda: None)
    with pytest.raises(SystemExit, match="needs nvcc"):
        radix_load_chains.compiled_sass(radix_load_chains.SOURCE)


PTXAS_LOG = """ptxas info    : Compiling entry function '_ZN48_GLOBAL__N__4eb_17radix_topk_kernelILi1024ENS_4WideELb0EEEvNS_6ParamsE' for 'sm_90'
ptxas info    : Function properties for _ZN48_GLOBAL__N__4eb_17radix_topk_kernelILi1024ENS_4WideELb0EEEvNS_6ParamsE
    24 bytes stack frame, 24 bytes spill stores, 88 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 24 bytes cumulative stack size
ptxas info    : Compiling entry function '_Z5otherv' for 'sm_90'
    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 12 registers
ptxas info    : Compiling entry function '_ZN48_GLOBAL__N__4eb_17radix_topk_kernelILi512ENS_9ShortListELb1EEEvNS_6ParamsE' for 'sm_90'
ptxas info    : Function properties for _ZN48_GLOBAL__N__4eb_17radix_topk_kernelILi512ENS_9ShortListELb1EEEvNS_6ParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers
"""


def test_ptxas_report_gives_each_instance_its_registers_and_spills():
    code = [*row_loads(6), NAN_TEST]
    found = radix_load_chains.chains(sass((1024, "Wide", 0, code), (512, "ShortList", 1, code), (512, "Wide", 0, code)),
                                     PTXAS_LOG)
    used = {c.instance: c.resources for c in found}
    assert used["1024 Wide pages=0"] == radix_load_chains.Resources(64, 24, 88)
    assert used["512 ShortList pages=1"] == radix_load_chains.Resources(40, 0, 0)
    assert used["512 Wide pages=0"] is None  # not in the report: nothing claimed
    assert found[0].line().endswith("64 registers, spills 24/88 bytes (stores/loads)")
