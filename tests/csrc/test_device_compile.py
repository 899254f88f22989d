"""The device code compiles alone for sm_90 (nvcc) and gfx1151/gfx1201 (clang-19 HIP), without spills, with the
instructions it was written for, and with the staging budget of the one table (csrc/portability.h)."""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from w4a16_testing import require_tool

from w4a16 import skinny, skinny_build
from w4a16.skinny_build import CSRC, ToolMissing

HERE = Path(__file__).parent
# 2 dtypes x 3 group sizes x {sym, asym} x M = 1..rows: 8 rows on NVIDIA (the mma's columns), where each also has
# a thread-block-cluster twin, 5 on AMD
def instantiations(arch: str) -> int:
    return 2 * 3 * 2 * 8 * 2 if arch == "sm_90" else 2 * 3 * 2 * 5


def _tool_reason(arch: str) -> str | None:
    if arch == "sm_90":
        return None if skinny_build.nvcc_path() else "nvcc is needed to compile the skinny kernel for sm_90"
    if not skinny_build.hip_compiler_path():
        return f"clang-19 is needed to compile the skinny kernel for {arch} (apt-get install clang-19 lld-19)"
    if not skinny_build.hip_headers_present():
        return "Debian's HIP headers are needed (apt-get install libamdhip64-dev)"
    return None


@pytest.fixture(scope="module")
def asm_dir(tmp_path_factory) -> Path:
    """Where `compiled` compiles each target, a folder per arch."""
    return tmp_path_factory.mktemp("asm")


@pytest.fixture(scope="module")
def compiled(asm_dir) -> dict:
    """All three targets compiled once, in parallel (the three compilers take ~15-25 s each)."""
    out = asm_dir

    def one(arch):
        if _tool_reason(arch):
            return arch, None
        try:
            return arch, skinny_build.asm_stats(arch, skinny_build.compile_device(arch, out / arch))
        except ToolMissing:
            return arch, None

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(pool.map(one, skinny_build.ASM_ARCHS))


@pytest.mark.parametrize("arch", skinny_build.ASM_ARCHS)
def test_compiles_without_spills(compiled, arch):
    require_tool(compiled[arch] is not None, _tool_reason(arch) or f"compiler for {arch}")
    stats = compiled[arch]
    assert stats["kernels"] == instantiations(arch)
    assert stats["spills"] == 0, skinny_build.format_summary(stats)
    assert stats["scratch_bytes"] == 0, skinny_build.format_summary(stats)
    if arch.startswith("gfx"):  # every device-library function inlined, as in a ROCm build: no calls, no stack
        assert stats["calls"] == 0 and stats["dynamic_stack_kernels"] == 0, skinny_build.format_summary(stats)
    # Activations live in dynamic shared memory sized by the host from the table; nothing static on top.
    assert stats["static_shared_bytes"] == 0


@pytest.mark.parametrize("arch", skinny_build.ASM_ARCHS)
def test_compiled_for_the_arch_asked_with_nothing_left_behind(compiled, asm_dir, arch):
    """The assembly is for the target named (each AMD target its own, not the other's), and the output folder holds
    the assembly alone: nvcc's --keep files (an object and intermediates, ~75 MB) are removed."""
    require_tool(compiled[arch] is not None, _tool_reason(arch) or f"compiler for {arch}")
    files = sorted(path.name for path in (asm_dir / arch).iterdir())
    if arch == "sm_90":
        sass = ["skinny_sm_90.sass"] if compiled[arch]["kind"] == "sass" else []
        assert files == ["skinny_sm_90.cubin", "skinny_sm_90.ptx", *sass]
        for name, target in (("skinny_sm_90.ptx", r"^\.target sm_90$"), *[(s, r"^\s*code for sm_90$") for s in sass]):
            with open(asm_dir / arch / name) as f:
                assert re.search(target, f.read(2000), re.M), name
    else:
        assert files == [f"skinny_{arch}.s"]
        with open(asm_dir / arch / files[0]) as f:
            head = f.read(2000)
        assert re.search(rf'^\s*\.amdgcn_target "amdgcn-amd-amdhsa--{arch}"$', head, re.M), head


@pytest.mark.parametrize("arch", skinny_build.ASM_ARCHS)
def test_device_staging_budget_is_the_tables(compiled, arch):
    require_tool(compiled[arch] is not None, _tool_reason(arch) or f"compiler for {arch}")
    if arch == "sm_90":
        require_tool(skinny_build.cuobjdump_path() is not None, "cuobjdump (CUDA or Triton's copy) reads the sm_90 probe")
    assert compiled[arch]["probe_staging_elements"] == skinny.limits(arch)[1]


@pytest.mark.parametrize("arch", skinny_build.ASM_ARCHS)
def test_instructions_of_interest(compiled, arch):
    require_tool(compiled[arch] is not None, _tool_reason(arch) or f"compiler for {arch}")
    stats = compiled[arch]
    counts = {label.split(" ")[0]: n for label, n in stats["instructions"].items()}
    summary = skinny_build.format_summary(stats)
    if arch.startswith("gfx"):
        dot2 = counts["v_dot2"]
        assert dot2 > 0, summary
        assert counts["global_load_b128"] > 0 and counts["ds_load_b128"] > 0, summary
        assert counts["cross-lane"] > 0, summary
        # The magic OR did not turn into per-weight int->float conversions: those are per chunk at most.
        assert counts["int->float"] * 16 < dot2, summary
    elif stats["kind"] == "sass":
        # The tensor-core kernel: mma.sync for the dot, magic-number LOP3s and packed FMAs for the unpack.
        assert counts["HMMA"] > 0 and counts["LOP3"] > 0 and counts["HFMA2"] > 0, summary
        assert counts["LDG.E.128"] > 0 and counts["LDS.128"] > 0, summary
        # The magic OR did not turn into int->float conversions per weight (each HMMA takes 128 weights per lane
        # quad; conversions are for indices and zero points at most).
        assert counts["I2F"] < counts["HMMA"], summary
    else:
        assert counts["mma.sync"] > 0, summary


def test_weight_ring_waits_once_per_pass(compiled):
    """Each warp's loop keeps the refills it issues in flight until the next pass: no instruction after a pass's
    first refill waits on the weight loads' scoreboard. When ptxas waited before every unit instead, Llama gate_up
    at M = 1 took 26% longer (csrc/PERF.md). Read from the control bits of the SASS (w4a16.sass)."""
    require_tool(compiled["sm_90"] is not None, _tool_reason("sm_90") or "nvcc")
    require_tool(compiled["sm_90"]["kind"] == "sass", "cuobjdump (CUDA or Triton's copy) disassembles the sm_90 cubin")
    waits = compiled["sm_90"]["refill_waits"]
    assert len(waits) == instantiations("sm_90")
    assert not [label for label, count in waits.items() if count is None], "no weight-ring loop found in these"
    waiting = sorted(label for label, count in waits.items() if count)
    assert not waiting, f"these wait on the refills their own pass issued (see the pre-loop use in skinny_mma.cuh): {waiting}"


def test_kernel_waits_for_the_kernel_ahead_before_any_global_access(compiled):
    """The launcher starts the kernel programmatically (before the kernel ahead of it on the stream has finished),
    so every instantiation must wait for that kernel (griddepcontrol.wait, SASS ACQBULK) before it reads x, the
    weights or the bias, or writes its output, and no path may skip the wait (skinny_mma.cuh)."""
    require_tool(compiled["sm_90"] is not None, _tool_reason("sm_90") or "nvcc")
    require_tool(compiled["sm_90"]["kind"] == "sass", "cuobjdump (CUDA or Triton's copy) disassembles the sm_90 cubin")
    early = compiled["sm_90"]["before_grid_wait"]
    assert len(early) == instantiations("sm_90")
    never = sorted(label for label, found in early.items() if found is None)
    assert not never, f"these never wait for the kernel ahead, yet are launched programmatically: {never}"
    touching = {label: found for label, found in early.items() if found}
    assert not touching, f"global accesses or branches past the wait, before it: {touching}"


def test_host_table_matches_python_parser(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++-19")
    require_tool(compiler is not None, "a host C++ compiler is needed to read the table through C++")
    exe = tmp_path / "limits_host_check"
    subprocess.run([compiler, "-std=c++17", f"-I{CSRC}", str(HERE / "limits_host_check.cpp"), "-o", str(exe)],
                   check=True)
    names = [*skinny.arch_table(), "sm_80", "gfx942", "gfx11510"]  # the last starts with a known name
    out = subprocess.run([str(exe), *names], capture_output=True, text=True, check=True).stdout.splitlines()
    for name, line in zip(names, out, strict=True):
        arch, rows, elements, nbytes = line.split()
        assert arch == name
        assert (int(rows), int(elements)) == skinny.limits(name)
        assert int(nbytes) <= skinny.arch_table().get(name, skinny.arch_table()["generic"])[2]


def test_asm_summary_text(compiled, tmp_path):
    require_tool(compiled["gfx1151"] is not None, _tool_reason("gfx1151") or "clang-19 for gfx1151")
    text = skinny_build.format_summary(compiled["gfx1151"])  # what asm_summary prints, from the shared compile
    assert "v_dot2" in text and "spills: 0" in text and "30720 elements" in text
    with pytest.raises(ValueError, match="arch must be one of"):
        skinny_build.asm_summary("sm_75", tmp_path)


_PROBE_LEAVE_OUTS = ["-DLOO_NO_SCALES", "-DLOO_NO_MMA", "-DLOO_NO_ROUND_END", "-DLOO_NO_X"]


@pytest.mark.parametrize(("program", "defines"), [("read_patterns.cu", []), ("time_skinny.cu", []),
                                                  ("time_skinny.cu", ["-DTIME_SKINNY_TMA"]),
                                                  ("time_skinny.cu", ["-DTIME_SKINNY_TMA", "-DTMA_STAGES=8",
                                                                      "-DTMA_CONSUMERS=12", *_PROBE_LEAVE_OUTS])])
def test_timing_programs_compile(program, defines, tmp_path):
    """The standalone timing programs csrc/PERF.md cites (weight-stream ceilings, kernel variants, the TMA-fed
    probe and its switches) still build for sm_90 against the current headers. A table entry missing a field
    compiles to a zero there (read_patterns.cu once divided by a zero grid_rows on the GPU machine), so that warning
    is an error."""
    nvcc = skinny_build.nvcc_path()
    require_tool(nvcc is not None, _tool_reason("sm_90") or "nvcc")
    subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", f"-I{skinny_build.CSRC}",
                    *defines, "-Xcompiler=-Wmissing-field-initializers,-Werror", "-c", str(HERE / program), "-o",
                    str(tmp_path / "program.o")], check=True)
