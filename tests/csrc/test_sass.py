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


def test_control_bits_decode_at_full_width_without_their_neighbours():
    # stall 15 and every wait bit, with the bits around the fields set: the yield bit (45) between stall and write
    # scoreboard, the operand-reuse bits (58-61) above the wait mask, and bits 0-15 of the same word.
    neighbours = 1 << 45 | 0xF << 58 | 0xFFFF
    [ins] = sass.functions(listing({"k": [("NOP", control(15, 0, 3, 0x3F) | neighbours)]}))["k"]
    assert (ins.stall, ins.write_scoreboard, ins.wait_mask) == (15, 0, 0x3F)
    assert all(ins.waits_on(s) for s in range(6))
    [ins] = sass.functions(listing({"k": [("NOP", control(0, 6, 7, 0) | neighbours)]}))["k"]
    assert (ins.stall, ins.write_scoreboard, ins.wait_mask) == (0, 6, 0)


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


def test_a_loop_that_starts_at_another_rings_back_edge_holds_it():
    """The boundary of refill_waits' definition: a loop whose first instruction is another ring's back-edge branch
    holds that back edge, as a loop around the ring does, so it is not a ring and its waits are not checked."""
    ring = ring_loop(False)[:-1]  # its loop is instructions 1..8, the back edge at 0x80
    # a second loop from that branch (0x80) to a branch at 0xb0, with a load and a wait on its scoreboard in it
    outer = [(LOAD, control(write=5)), ("SHF.R.U32.HI R90, RZ, 0x8, R20", control(wait=1 << 5)),
             ("BRA 0x80", control(stall=5)), ("EXIT", control(stall=5))]
    assert sass.refill_waits(sass.functions(listing({"k": ring + outer}))["k"]) == []


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
                                    "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R8.64]", "RED.E.ADD.STRONG.GPU desc[UR4][R2.64], R5",
                                    "@!P1 LDG.E.64 R2, desc[UR4][R2.64]", "LD.E R2, [R4.64]",
                                    "ATOMG.E.ADD.STRONG.GPU PT, R3, desc[UR4][R2.64], R5",
                                    "@UP0 UTMALDG.2D [UR8], [UR4]", "UTMASTG.2D [UR4], [UR8]",
                                    "UBLKCP.S.G [UR4], [UR6], UR8"])
def test_a_global_access_before_the_grid_wait_is_found(access):
    assert [i.text for i in sass.accesses_before_grid_wait(grid_wait_kernel(access))] == [access]


def test_a_branch_past_the_grid_wait_is_found():
    # instructions: S2R (0x00), the branch (0x10), ACQBULK (0x20), LDG (0x30): the branch lands on the load
    assert [i.text for i in sass.accesses_before_grid_wait(grid_wait_kernel("@P0 BRA 0x30"))] == ["@P0 BRA 0x30"]


@pytest.mark.parametrize("branch", ["@!P1 BRA P2, 0x30", "BRA.DIV UR4, 0x30", "BRA.U !UP0, 0x30"])
def test_a_branch_past_the_grid_wait_is_found_in_every_form(branch):
    # a second condition, a divergence branch, a uniform branch: each lands on the load at 0x30
    assert [i.text for i in sass.accesses_before_grid_wait(grid_wait_kernel(branch))] == [branch]


def test_a_branch_to_the_grid_wait_itself_does_not_skip_it():
    # S2R (0x00), the branch (0x10), ACQBULK (0x20): landing on the wait still waits
    assert sass.accesses_before_grid_wait(grid_wait_kernel("@P0 BRA 0x20")) == []


def test_an_access_as_the_first_instruction_is_found():
    body = [("LDG.E R2, desc[UR4][R2.64]", control(write=2)), ("ACQBULK", control()), ("EXIT", control(stall=5))]
    [early] = sass.accesses_before_grid_wait(sass.functions(listing({"kernel": body}))["kernel"])
    assert early.address == 0 and early.text.startswith("LDG.E")


def test_only_the_first_grid_wait_counts():
    # An access between two waits comes after the kernel ahead has finished: not early.
    body = [("S2R R0, SR_TID.X", control()), ("ACQBULK", control()), ("LDG.E R2, desc[UR4][R2.64]", control(write=2)),
            ("ACQBULK", control()), ("STG.E desc[UR4][R4.64], R7", control()), ("EXIT", control(stall=5))]
    assert sass.accesses_before_grid_wait(sass.functions(listing({"kernel": body}))["kernel"]) == []


def test_a_kernel_without_the_grid_wait_is_told_apart():
    body = [("LDG.E R2, desc[UR4][R2.64]", control(write=2)), ("EXIT", control(stall=5))]
    assert sass.accesses_before_grid_wait(sass.functions(listing({"kernel": body}))["kernel"]) is None


SKINNY = "_ZN5w4a1611tensor_core18skinny_gemm_kernelINS_7{}TagELi{}ELb{}ELi{}ELb{}EEEvPKtPKNS_6Words4ES4_PKhS4_Ptii"


def test_asm_stats_of_a_sass_listing(tmp_path):
    """skinny_build.asm_stats on a listing: every instruction class counted by its own pattern over all functions,
    and the two checks per skinny_gemm_kernel instantiation, by label (test_device_compile.py runs it on the real
    kernel, where most counts are only checked to be non-zero)."""
    from w4a16 import skinny_build

    math = ["I2F.U32.RP R4, R0", "I2F R3, R2", "HADD2.F32 R4, -RZ, R5.H0_H0", "F2F.F16.F32 R6, R7",
            "HFMA2.MMA R8, R9, R10, R11", "HADD2 R1, R2, R3", "HMUL2 R1, R2, R3", "FFMA R1, R2, R3, R4",
            "LOP3.LUT R1, R2, 0xf000f, R3, 0xea, !PT", "SHFL.BFLY PT, R1, R2, 0x1, 0x1f", "LDS.128 R4, [R1]",
            "HMMA.16816.F32.BF16 R76, R80, R70, R76"]
    grid_wait = [("S2R R0, SR_TID.X", control()), *[(text, control()) for text in math], ("ACQBULK", control()),
                 ("LDG.E R2, desc[UR4][R2.64]", control(write=2)), ("EXIT", control(stall=5))]
    probe = [("STG.E desc[UR4][R2.64], R5", control()), ("EXIT", control())]
    text = listing({SKINNY.format("Fp16", 128, 1, 8, 1): ring_loop(False),
                    SKINNY.format("Bf16", 32, 0, 3, 0): ring_loop(True),
                    SKINNY.format("Fp16", 64, 0, 1, 1): grid_wait, "_ZN5w4a1619skinny_limits_probeEPi": probe})
    (tmp_path / "k.sass").write_text(text)  # no cubin beside it: no probe value
    stats = skinny_build.asm_stats("sm_90", {"asm": tmp_path / "k.sass", "log": "", "kind": "sass"})
    counts = {label.split(" ")[0]: n for label, n in stats["instructions"].items()}
    # ring_loop: 3 weight loads and 2 HMMAs each; HADD2.F32 is a conversion, not packed math
    assert counts == {"HMMA": 5, "FFMA": 1, "HFMA2": 3, "LOP3": 1, "F2F": 2, "I2F": 2, "SHFL": 1, "LDG.E.128": 6,
                      "LDS.128": 1}
    clean, waiting, no_loop = "fp16 G=128 sym M=8 cluster", "bf16 G=32 asym M=3 single", "fp16 G=64 asym M=1 cluster"
    assert stats["refill_waits"] == {clean: 0, waiting: 1, no_loop: None}  # the probe is no instantiation
    assert stats["before_grid_wait"] == {clean: None, waiting: None, no_loop: []}
    assert stats["probe_staging_elements"] is None
