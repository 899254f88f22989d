"""The A/B tool's reading of time_skinny.cu output and its table (the timing itself needs an sm_90 GPU)."""

from __future__ import annotations

import ab_skinny as ab  # this directory is on sys.path (pytest's default import mode, no __init__.py here)
import pytest

RUN_A = """llama_qkv              M=1     8.50 us  checksum 1.234500e+02 4.560000e+03  check ok (worst 0.02 of the allowed error)
llama_down             M=8 skipped: 230000 bytes of shared memory
llama_qkv fp16 uint4 g32 M=5    10.66 us  checksum -7.100000e+01 9.900000e+03  check ok (worst 0.10 of the allowed error)
"""
RUN_B = """llama_qkv              M=1     8.10 us  checksum 1.234600e+02 4.560000e+03  check ok (worst 0.02 of the allowed error)
llama_qkv fp16 uint4 g32 M=5    11.00 us  checksum -7.100000e+01 9.900000e+03  check FAILED (row 7, x row 2: nan, expected 1.5)
"""


def test_parse_reads_timed_cases_and_skips_the_rest():
    cases = ab.parse(RUN_A)
    assert list(cases) == ["llama_qkv M=1", "llama_qkv fp16 uint4 g32 M=5"]
    assert cases["llama_qkv M=1"] == ab.Case(8.5, "1.234500e+02 4.560000e+03", True,
                                             "ok (worst 0.02 of the allowed error)")
    assert not ab.parse(RUN_B)["llama_qkv fp16 uint4 g32 M=5"].check_ok


def test_best_of_takes_the_fastest_pass_and_keeps_any_failure():
    slow_ok = ab.parse(RUN_A.replace("10.66", "12.00"))
    best = ab.best_of([slow_ok, ab.parse(RUN_B)])
    assert best["llama_qkv M=1"].us == pytest.approx(8.10)
    failed = best["llama_qkv fp16 uint4 g32 M=5"]
    assert failed.us == pytest.approx(11.00) and not failed.check_ok and failed.check.startswith("FAILED")
    # A failure in the slower pass is kept too.
    best = ab.best_of([ab.parse(RUN_B.replace("11.00", "13.00")), ab.parse(RUN_A)])
    assert best["llama_qkv fp16 uint4 g32 M=5"].us == pytest.approx(10.66)
    assert not best["llama_qkv fp16 uint4 g32 M=5"].check_ok


def test_table_gives_ratios_checksum_changes_and_failures():
    text, all_ok = ab.table(["before", "after"], [ab.parse(RUN_A), ab.parse(RUN_B)])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()[2:]}
    assert "| 8.50 | 8.10 (0.953x) sum differs |" in rows["llama_qkv M=1"]
    assert "11.00 (1.032x) **FAILED (row 7, x row 2: nan, expected 1.5)**" in rows["llama_qkv fp16 uint4 g32 M=5"]
    assert not all_ok
    text, all_ok = ab.table(["a", "b"], [ab.parse(RUN_A), ab.parse(RUN_A)])
    assert all_ok and "sum differs" not in text and "(1.000x)" in text


def test_export_csrc_of_a_revision(tmp_path):
    csrc = ab.export_csrc("HEAD", tmp_path / "v")
    assert (csrc / "skinny_mma.cuh").is_file() and (csrc / "portability.h").is_file()
    assert ab.export_csrc(".", tmp_path / "w") == ab.ROOT / "csrc"


def test_export_csrc_of_a_directory(tmp_path):
    (tmp_path / "old" / "csrc").mkdir(parents=True)
    (tmp_path / "old" / "csrc" / "skinny_mma.cuh").write_text("// old\n")
    assert ab.export_csrc(str(tmp_path / "old"), tmp_path / "v") == tmp_path / "old" / "csrc"
    with pytest.raises(SystemExit, match="without csrc/skinny_mma.cuh"):
        ab.export_csrc(str(tmp_path), tmp_path / "w")
