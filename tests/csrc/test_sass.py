"""w4a16.sass on hand-built listings in cuobjdump's format: the control bits decode, and refill_waits tells a ring
that waits once per pass from one that waits on the loads it has just issued. (test_device_compile.py runs it on
the real kernel.)"""

from __future__ import annotations

import pytest

from w4a16 import sass


def control(stall: int = 1, write: int = sass.NO_SCOREBOARD, read: int = sass.NO_SCOREBOARD, wait: int = 0) -> int:
    return stall << 41 | write << 46 | read << 49 | wait << 52


def listing(functions: dict[str, list[tuple[str, int]]]) -> str:
    """cuobjdump -sass text: per function a header, then each instruction as two lines (low and high word)."""
    out = ["", "Fatbin elf code:", "================", "arch = sm_90"]
    for name, body in functions.items():
        out += ["", f"\t\tFunction : {name}", "\t.headerflags\t@\"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\""]
        for n, (text, high) in enumerate(body):
            out.append(f"        /*{16 * n:04x}*/                   {text} ;{' ' * 20}/* 0x{0x1234 + n:016x} */")
            out.append(f"{' ' * 96}/* 0x{high:016x} */")
        out.append("        ..........")
    return "\n".join(out) + "\n"


LOAD = "LDG.E.NA.LTC256B.128.CONSTANT R20, desc[UR8][R20.64]"


def ring_loop(wait_after_refill: bool) -> list[tuple[str, int]]:
    """A prologue load, then a loop of two units: each computed, then its slot refilled (scoreboard 5)."""
    head = 1  # the loop starts at instruction 1 (address 0x10)
    body = [
        (LOAD, control(write=5)),
        ("ISETP.GE.AND P0, PT, R19, R6, PT", control()),
        ("SHF.R.U32.HI R84, RZ, 0x8, R20", control(wait=1 << 5)),  # the pass's wait, before any refill: fine
        ("HMMA.16816.F32.BF16 R76, R80, R70, R76", control()),
        ("@P1 " + LOAD, control(write=5)),  # refill of unit 0
        ("SHF.R.U32.HI R76, RZ, 0x8, R28", control(wait=(1 << 5) if wait_after_refill else 0)),  # unit 1
        ("HMMA.16816.F32.BF16 R72, R84, R68, R72", control()),
        (LOAD.replace("R20", "R28"), control(write=5)),  # refill of unit 1
        (f"@!P0 BRA 0x{16 * head:x}", control(stall=5)),
        ("EXIT", control(stall=5)),
    ]
    return body


def test_control_bits_decode():
    [ins] = sass.functions(listing({"k": [("LDG.E.128 R4, desc[UR4][R2.64]", control(4, 5, 2, 0b100010))]}))["k"]
    assert (ins.address, ins.text, ins.stall, ins.write_scoreboard, ins.wait_mask) == (
        0, "LDG.E.128 R4, desc[UR4][R2.64]", 4, 5, 0b100010)
    assert ins.waits_on(1) and ins.waits_on(5) and not ins.waits_on(0)


def test_functions_split_by_header():
    fs = sass.functions(listing({"a": ring_loop(False), "b": [("EXIT", control())]}))
    assert list(fs) == ["a", "b"]
    assert [i.address for i in fs["a"]] == [16 * n for n in range(10)]
    with pytest.raises(ValueError, match="cuobjdump -sass"):
        sass.functions("this is not a listing\n")


def test_once_per_pass_is_clean():
    assert sass.refill_waits(sass.functions(listing({"k": ring_loop(False)}))["k"]) == []


def test_wait_on_the_pass_own_refill_is_found():
    [found] = sass.refill_waits(sass.functions(listing({"k": ring_loop(True)}))["k"])
    assert found.address == 0x50 and found.text.startswith("SHF.R.U32.HI R76")


def test_a_wait_on_another_scoreboard_is_not_a_refill_wait():
    body = ring_loop(False)
    body[5] = (body[5][0], control(wait=1 << 2))  # e.g. a shared-memory read's scoreboard
    assert sass.refill_waits(sass.functions(listing({"k": body}))["k"]) == []


def test_no_loop_is_not_a_clean_loop():
    assert sass.refill_waits(sass.functions(listing({"k": [(LOAD, control(write=5)), ("EXIT", control())]}))["k"]) is None


def test_a_load_without_scoreboard_is_a_misread():
    body = ring_loop(False)
    body[4] = (body[4][0], control())
    with pytest.raises(ValueError, match="sets no scoreboard"):
        sass.refill_waits(sass.functions(listing({"k": body}))["k"])


def two_ring_loops(wait_in_second: bool) -> list[tuple[str, int]]:
    """Two copies of ring_loop's loop (a kernel with two code paths), then code placed after them that waits on the
    weight loads' scoreboard and branches back into the first loop (as a reduction called from its body does)."""
    first = ring_loop(False)[:-1]  # without EXIT; its loop is instructions 1..8
    second = [(text.replace("BRA 0x10", "BRA 0x90"), high) for text, high in ring_loop(wait_in_second)[1:-1]]
    tail = [("SHF.R.U32.HI R90, RZ, 0x8, R20", control(wait=1 << 5)), ("BRA 0x20", control(stall=5)),
            ("EXIT", control(stall=5))]
    return first + second + tail


def test_every_ring_loop_is_checked_and_a_branch_back_from_after_them_is_not_one():
    assert sass.refill_waits(sass.functions(listing({"k": two_ring_loops(False)}))["k"]) == []
    [found] = sass.refill_waits(sass.functions(listing({"k": two_ring_loops(True)}))["k"])
    assert found.address == 0xd0 and found.text.startswith("SHF.R.U32.HI R76")


def grid_wait_kernel(*before: str) -> list[sass.Instruction]:
    """A kernel with the given instructions ahead of its griddepcontrol.wait, then a load and a store."""
    body = [("S2R R0, SR_TID.X", control()), *[(text, control()) for text in before], ("ACQBULK", control()),
            ("LDG.E R2, desc[UR4][R2.64]", control(write=2)), ("STG.E desc[UR4][R4.64], R7", control(wait=1 << 2)),
            ("EXIT", control(stall=5))]
    return sass.functions(listing({"kernel": body}))["kernel"]


def test_accesses_after_the_grid_wait_are_clean():
    assert sass.accesses_before_grid_wait(grid_wait_kernel("LDC.64 R2, c[0x0][0x210]", "LDS.128 R4, [R1]")) == []


@pytest.mark.parametrize("access", ["LDG.E.128 R4, desc[UR4][R2.64]", "@P0 STG.E desc[UR4][R4.64], R7",
                                    "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R8.64]", "RED.E.ADD.STRONG.GPU desc[UR4][R2.64], R5"])
def test_a_global_access_before_the_grid_wait_is_found(access):
    assert [i.text for i in sass.accesses_before_grid_wait(grid_wait_kernel(access))] == [access]


def test_a_branch_past_the_grid_wait_is_found():
    # instructions: S2R (0x00), the branch (0x10), ACQBULK (0x20), LDG (0x30): the branch lands on the load
    assert [i.text for i in sass.accesses_before_grid_wait(grid_wait_kernel("@P0 BRA 0x30"))] == ["@P0 BRA 0x30"]


def test_a_kernel_without_the_grid_wait_is_told_apart():
    body = [("LDG.E R2, desc[UR4][R2.64]", control(write=2)), ("EXIT", control(stall=5))]
    assert sass.accesses_before_grid_wait(sass.functions(listing({"kernel": body}))["kernel"]) is None
