"""The A/B tool's reading of time_skinny.cu output and its table (the timing itself needs an sm_90 GPU), and the
prepared variants it times (tests/csrc/variants): they apply, build, and keep the kernel's schedule."""

from __future__ import annotations

import re
import subprocess

import ab_skinny as ab  # this directory is on sys.path (pytest's default import mode, no __init__.py here)
import pytest
from w4a16_testing import require_tool

from w4a16 import sass, skinny_build

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
    # 8.10 / 8.50 and 11.00 / 10.66: sqrt(0.953 * 1.032) = 0.992
    assert rows["geometric mean (range)"].endswith("| - | 0.992x (0.953-1.032x) |")
    text, all_ok = ab.table(["a", "b"], [ab.parse(RUN_A), ab.parse(RUN_A)])
    assert all_ok and "sum differs" not in text and "(1.000x)" in text
    assert "| geometric mean (range) | - | 1.000x (1.000-1.000x) |" in text


def test_split_define_reads_a_build_flag_suffix():
    assert ab.split_define(".+TIME_SKINNY_TMA") == (".", ["-DTIME_SKINNY_TMA"])
    assert ab.split_define("HEAD~2+TIME_SKINNY_TMA") == ("HEAD~2", ["-DTIME_SKINNY_TMA"])
    assert ab.split_define("tests/csrc/variants/bound-no-meta-loads.patch") == ("tests/csrc/variants/bound-no-meta-loads.patch", [])
    assert ab.split_define("old+dir/") == ("old+dir/", [])  # a "+" in a path is not a flag
    assert ab.split_define(".+TIME_SKINNY_TMA+NO_MMA") == (".", ["-DTIME_SKINNY_TMA", "-DNO_MMA"])
    assert ab.split_define("old+dir/+A") == ("old+dir/", ["-DA"])
    assert ab.split_define(".+A+STAGES=8") == (".", ["-DA", "-DSTAGES=8"])


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


def test_export_csrc_of_a_patch(tmp_path):
    source = (ab.ROOT / "csrc" / "skinny_mma.cuh").read_text()
    first, *context = source.splitlines()[:4]
    patch = tmp_path / "edit.patch"
    patch.write_text("A description before the diff is ignored.\n\n"
                     "diff --git a/csrc/skinny_mma.cuh b/csrc/skinny_mma.cuh\n--- a/csrc/skinny_mma.cuh\n"
                     f"+++ b/csrc/skinny_mma.cuh\n@@ -1,4 +1,4 @@\n-{first}\n+// edited\n"
                     + "".join(f" {line}\n" for line in context))
    csrc = ab.export_csrc(str(patch), tmp_path / "v")
    assert (csrc / "skinny_mma.cuh").read_text() == source.replace(first, "// edited", 1)
    assert (ab.ROOT / "csrc" / "skinny_mma.cuh").read_text() == source  # the working tree is untouched
    # A patch made on top of another names it; both apply, in order.
    on_top = tmp_path / "on-top.patch"
    on_top.write_text("Applies on top of edit.patch.\n\n"
                      "diff --git a/csrc/skinny_mma.cuh b/csrc/skinny_mma.cuh\n--- a/csrc/skinny_mma.cuh\n"
                      "+++ b/csrc/skinny_mma.cuh\n@@ -1,4 +1,4 @@\n-// edited\n+// edited twice\n"
                      + "".join(f" {line}\n" for line in context))
    assert ab.patch_chain(on_top) == [patch, on_top]
    csrc = ab.export_csrc(str(on_top), tmp_path / "u")
    assert (csrc / "skinny_mma.cuh").read_text() == source.replace(first, "// edited twice", 1)
    patch.write_text(patch.read_text().replace(f"-{first}", "-// a line that is not there"))
    with pytest.raises(SystemExit, match="does not apply"):
        ab.export_csrc(str(patch), tmp_path / "w")


VARIANTS = sorted((ab.ROOT / "tests" / "csrc" / "variants").glob("*.patch"))


@pytest.mark.parametrize("patch", VARIANTS, ids=lambda p: p.stem)
def test_prepared_variant_applies_and_builds(patch, tmp_path):
    """The variants csrc/PERF.md plans to time (tests/csrc/variants) still apply to the current kernel and build
    into the timing harness without spilling; the mergeable ones (all but the bound-* timing bounds) also keep the
    weight ring waiting once per pass, as test_device_compile checks for the shipped kernel."""
    csrc = ab.export_csrc(str(patch), tmp_path / "v")
    nvcc = skinny_build.nvcc_path()
    require_tool(nvcc is not None, "nvcc is needed to build the timing harness for sm_90")
    binary = tmp_path / "time_skinny"
    done = subprocess.run([nvcc, *ab.NVCC_FLAGS, "-Xptxas", "-v", f"-I{csrc}", f"-I{ab.HARNESS.parent}", "-o",
                           str(binary), str(ab.HARNESS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    assert spills and all(a == b == "0" for a, b in spills), f"{patch.stem} spills"
    if patch.stem.startswith("bound-"):
        return
    cuobjdump = skinny_build.cuobjdump_path()
    require_tool(cuobjdump is not None, "cuobjdump (CUDA or Triton's copy) disassembles the harness")
    listing = subprocess.run([cuobjdump, "-sass", str(binary)], capture_output=True, text=True, check=True).stdout
    kernels = {skinny_build.kernel_label(name): sass.refill_waits(instructions)
               for name, instructions in sass.functions(listing).items() if "skinny_gemm_kernel" in name}
    # None: no weight-ring loop found (nothing checked); a non-empty list: waits on the pass's own refills
    assert kernels and not [label for label, waits in kernels.items() if waits is None or waits], kernels
