"""The Python side of the skinny kernel that runs anywhere: limits, availability, asm summary."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from w4a16_testing import random_activation, random_weight

from w4a16 import skinny, skinny_build


def test_limits_from_the_header_table():
    table = skinny.arch_table()
    assert {"sm_90", "gfx1151", "gfx1201", "generic"} <= set(table)
    # That each row fits its hardware is the header's static_assert, and test_device_compile reads the bytes
    # through C++ (limits_host_check.cpp); here, what the parser reads.
    for name, (rows, elements, _) in table.items():
        assert rows >= 1 and elements % 32 == 0
        assert skinny.limits(name) == (rows, elements)  # the staging elements, not the row's shared-memory bytes
    assert skinny.limits("gfx1151:sramecc-:xnack-") == skinny.limits("gfx1151")
    assert skinny.limits("sm_90a") == skinny.limits("sm_90")
    assert skinny.limits("sm_120") == skinny.limits("generic")[:2]
    with pytest.raises(ValueError, match="unrecognised architecture"):
        skinny.limits("not-an-arch")


def test_a_table_row_the_parser_cannot_read_is_an_error(tmp_path, monkeypatch):
    header = (skinny_build.CSRC / "portability.h").read_text()
    row = "  ROW(generic, 5, 17408, 49152)"
    assert row in header
    (tmp_path / "portability.h").write_text(header.replace(row, row + "     \\\n  ROW(sm_100, 8, 100928, 227 * 1024)"))
    monkeypatch.setattr(skinny_build, "CSRC", tmp_path)
    skinny.arch_table.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"rows Python cannot read: \['ROW\(sm_100, 8, 100928, 227 \* 1024\)"):
            skinny.arch_table()
    finally:
        skinny.arch_table.cache_clear()


def test_unavailable_reasons_are_clear():
    assert "not on cpu" in skinny.unavailable_reason(torch.device("cpu"), torch.float16)
    assert "float16 or bfloat16" in skinny.unavailable_reason(torch.device("cuda"), torch.float32)
    if not torch.cuda.is_available():
        assert "no usable GPU" in skinny.unavailable_reason(torch.device("cuda"), torch.bfloat16)


def test_skinny_gemm_on_cpu_raises_with_the_reason(generator):
    qw = random_weight(8, 64, 32, True, torch.float16, generator=generator)
    x = random_activation(2, 64, torch.float16, generator=generator)
    with pytest.raises(RuntimeError, match="skinny kernel unavailable: .*not on cpu"):
        skinny.skinny_gemm(x, qw)
    with pytest.raises(ValueError, match="last dim must equal K=64"):
        skinny.skinny_gemm(x[:, :32], qw)


def test_a_table_without_the_generic_row_is_an_error(tmp_path, monkeypatch):
    header = (skinny_build.CSRC / "portability.h").read_text()
    without_generic = header.replace("ROW(generic, 5, 17408, 49152)", "ROW(sm_80, 5, 17408, 49152)")
    (tmp_path / "portability.h").write_text(without_generic)
    monkeypatch.setattr(skinny_build, "CSRC", tmp_path)
    skinny.arch_table.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="W4A16_ARCH_TABLE has no 'generic' row"):
            skinny.arch_table()
    finally:
        skinny.arch_table.cache_clear()


def test_device_limits_are_the_rows_of_the_device_asked(monkeypatch):
    """On a machine with two kinds of GPU, each answers with its own arch's row, whichever is current."""
    props = [types.SimpleNamespace(major=8, minor=0), types.SimpleNamespace(major=9, minor=0)]
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: props[device if isinstance(device, int) else device.index])
    assert skinny.limits("sm_90") != skinny.limits("generic")  # else this test could not tell them apart
    assert skinny.device_limits(torch.device("cuda", 1)) == skinny.limits("sm_90")
    assert skinny.device_limits() == skinny.device_limits(0) == skinny.limits("sm_80") == skinny.limits("generic")


def test_unavailable_on_any_device_but_a_gpu():
    assert "not on meta" in skinny.unavailable_reason(torch.device("meta"), torch.float16)


def test_skinny_gemm_takes_2d_activations_only(generator):
    qw = random_weight(8, 64, 32, True, torch.float16, generator=generator)
    x = random_activation(2, 64, torch.float16, generator=generator)
    # checked before availability: the same answer on any machine
    with pytest.raises(ValueError, match=r"x2d must be 2-D \[M, K\], got shape \(1, 2, 64\)"):
        skinny.skinny_gemm(x[None], qw)


# ---------------------------------------------------------------------------------------------------------------
# Loading: what _load answers on a machine with one sm_90 GPU, the op not registered yet
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def gpu_without_op(tmp_path, monkeypatch) -> dict:
    """The loader's view of one sm_90 GPU with nothing loaded; `state` says whether the op is registered and
    records what build() and load_library were asked. _load's cached answer is cleared around the test."""
    state = {"registered": False, "built": 0, "loaded": []}
    monkeypatch.setattr(skinny, "_registered", lambda: state["registered"])
    monkeypatch.setattr(skinny_build, "device_archs", lambda: ["sm_90"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("W4A16_BUILD_DIR", str(tmp_path / "builds"))
    monkeypatch.delenv("W4A16_SKINNY_AUTOBUILD", raising=False)

    def build():
        state["built"] += 1

    def load_library(path):
        state["loaded"].append(path)
        state["registered"] = True

    monkeypatch.setattr(skinny_build, "build", build)
    monkeypatch.setattr(torch.ops, "load_library", load_library)
    skinny._load.cache_clear()
    yield state
    skinny._load.cache_clear()


def test_an_unbuilt_extension_says_where_it_looked_and_how_to_build(gpu_without_op):
    reason = skinny.unavailable_reason(torch.device("cuda"), torch.bfloat16)
    expected = skinny_build.library_path(["sm_90"])
    assert expected.name == "w4a16_skinny.so"
    assert reason.startswith(f"the skinny extension is not built for sm_90 (expected {expected}): "), reason
    assert "`nox -s build`" in reason and "`python -m w4a16.skinny_build`" in reason
    assert gpu_without_op["built"] == 0 and gpu_without_op["loaded"] == []  # no build without W4A16_SKINNY_AUTOBUILD=1


def cached_sm_90_library() -> Path:
    """An (empty) sm_90 library where the build cache keeps it: what a finished build leaves to load."""
    library = skinny_build.library_path(["sm_90"])
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    return library


@pytest.mark.parametrize("autobuild", [None, "1"])
def test_a_built_extension_is_loaded_from_the_build_cache(gpu_without_op, monkeypatch, autobuild):
    """A library already in the cache is loaded, not built again, also with W4A16_SKINNY_AUTOBUILD=1."""
    if autobuild:
        monkeypatch.setenv("W4A16_SKINNY_AUTOBUILD", autobuild)
    library = cached_sm_90_library()
    assert skinny.unavailable_reason(torch.device("cuda"), torch.float16) is None
    assert gpu_without_op["loaded"] == [str(library)] and gpu_without_op["built"] == 0


def test_a_build_directory_without_the_library_is_not_a_build(gpu_without_op):
    """A build that stopped half way leaves its directory without the library: nothing to load there."""
    skinny_build.library_path(["sm_90"]).parent.mkdir(parents=True)
    assert skinny._load().startswith("the skinny extension is not built for sm_90")
    assert gpu_without_op["loaded"] == []


def test_an_op_already_registered_is_used_as_it_is(gpu_without_op, monkeypatch):
    """Registered already (loaded by hand, or by `nox -s build` in this process): no build cache is looked at."""
    gpu_without_op["registered"] = True
    monkeypatch.setenv("W4A16_SKINNY_AUTOBUILD", "1")
    assert skinny._load() is None
    assert gpu_without_op["loaded"] == [] and gpu_without_op["built"] == 0


def test_the_answer_is_kept_for_the_process(gpu_without_op):
    """BUILD_HINT says to start a new process after building: the first answer stands until then."""
    first = skinny._load()
    cached_sm_90_library()
    assert skinny._load() == first and gpu_without_op["loaded"] == []


def test_a_library_that_does_not_load_is_a_reason_not_an_exception(gpu_without_op, monkeypatch):
    """torch.ops.load_library raises OSError for a library the loader rejects (truncated, or built for another
    torch): `auto` must still get a reason to fall back on."""
    library = cached_sm_90_library()

    def load_library(path):
        raise OSError(f"{path}: file too short")

    monkeypatch.setattr(torch.ops, "load_library", load_library)
    assert skinny._load() == (f"loading the skinny extension failed (OSError: {library}: file too short); rebuild: "
                              f"{skinny.BUILD_HINT}")


@pytest.mark.parametrize(("namespace", "registered"), [
    (types.SimpleNamespace(), False),  # no such op: torch's namespaces raise AttributeError
    (types.SimpleNamespace(skinny_gemm=types.SimpleNamespace(default="op")), True),
])
def test_registered_looks_up_the_op_itself(monkeypatch, namespace, registered):
    """The op itself: torch.ops makes a namespace for any name, so only the op says a library registered it."""
    monkeypatch.setattr(torch, "ops", types.SimpleNamespace(w4a16=namespace))
    assert skinny._registered() is registered


def test_registered_is_false_where_torch_raises_runtime_error(monkeypatch):
    """Some torch releases raise RuntimeError, not AttributeError, for an op no library registered."""
    class Namespace:
        @property
        def skinny_gemm(self):
            raise RuntimeError("No such operator w4a16::skinny_gemm")

    monkeypatch.setattr(torch, "ops", types.SimpleNamespace(w4a16=Namespace()))
    assert skinny._registered() is False


def test_skinny_gemm_passes_the_weight_and_options_to_the_op(monkeypatch, generator):
    """What reaches torch.ops.w4a16.skinny_gemm (the schema in csrc/binding.cpp), with the kernel reported usable
    for x's own device and dtype (patched: no CPU build exists)."""
    qw = random_weight(16, 64, 32, False, torch.bfloat16, generator=generator)
    x = random_activation(3, 64, torch.bfloat16, generator=generator)
    bias = random_activation(1, 16, torch.bfloat16, generator=generator)[0]
    asked, calls = [], []
    monkeypatch.setattr(skinny, "unavailable_reason", lambda device, dtype: asked.append((device, dtype)))
    monkeypatch.setattr(torch, "ops", types.SimpleNamespace(w4a16=types.SimpleNamespace(
        skinny_gemm=lambda *args: calls.append(args) or "y")))
    assert skinny.skinny_gemm(x, qw, bias, cluster_blocks=2) == "y"
    assert skinny.skinny_gemm(x, qw) == "y"
    assert asked == [(x.device, torch.bfloat16)] * 2
    expected = (x, qw.qweight, qw.scales, qw.zeros, bias, 32, 2)
    assert all(a is b for a, b in zip(calls[0], expected, strict=True))
    assert calls[1][4:] == (None, 32, 0)  # no bias; cluster_blocks 0: chosen from the shape


def test_no_visible_gpu_is_the_reason(gpu_without_op, monkeypatch):
    monkeypatch.setattr(skinny_build, "device_archs", lambda: [])
    assert skinny._load() == "no GPU is visible to torch"


@pytest.mark.parametrize("value", ["0", "", "yes"])
def test_autobuild_only_when_asked_with_1(gpu_without_op, monkeypatch, value):
    monkeypatch.setenv("W4A16_SKINNY_AUTOBUILD", value)
    assert "is not built for sm_90" in skinny._load()
    assert gpu_without_op["built"] == 0


def test_autobuild_builds_and_a_build_without_the_op_says_rebuild(gpu_without_op, monkeypatch):
    monkeypatch.setenv("W4A16_SKINNY_AUTOBUILD", "1")
    assert skinny._load() == f"the skinny extension loaded but registered no op; rebuild: {skinny.BUILD_HINT}"
    assert gpu_without_op["built"] == 1


def test_a_failed_build_is_a_reason_not_an_exception(gpu_without_op, monkeypatch):
    def broken_build():
        raise RuntimeError("Error building extension 'w4a16_skinny'")

    monkeypatch.setattr(skinny_build, "build", broken_build)
    monkeypatch.setenv("W4A16_SKINNY_AUTOBUILD", "1")
    reason = skinny.unavailable_reason(torch.device("cuda"), torch.float16)
    assert reason == ("loading the skinny extension failed (RuntimeError: Error building extension 'w4a16_skinny'); "
                      f"rebuild: {skinny.BUILD_HINT}")
    assert "`nox -s build`" in reason


@pytest.mark.parametrize("rocm", [True, False])
def test_a_torch_that_found_no_toolkit_is_a_reason_not_an_exception(gpu_without_op, monkeypatch, rocm):
    """cpp_extension's ROCM_HOME / CUDA_HOME are None where torch found no toolkit: the build directory's name
    records the missing compiler, and `auto` still gets a reason to fall back on."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "hip", "6.4.0" if rocm else None)
    monkeypatch.setattr(cpp_extension, "ROCM_HOME" if rocm else "CUDA_HOME", None)
    monkeypatch.setattr(skinny_build, "device_archs", lambda: ["gfx1151" if rocm else "sm_90"])
    reason = skinny.unavailable_reason(torch.device("cuda"), torch.float16)
    assert reason.startswith(f"the skinny extension is not built for {'gfx1151' if rocm else 'sm_90'}"), reason


# ---------------------------------------------------------------------------------------------------------------
# The build directory: named by everything that decides the library
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def copied_csrc(tmp_path, monkeypatch) -> Path:
    """csrc/ copied, and read from there; builds under tmp_path/builds; fixed compiler banners."""
    csrc = tmp_path / "csrc"
    shutil.copytree(skinny_build.CSRC, csrc)
    monkeypatch.setattr(skinny_build, "CSRC", csrc)
    monkeypatch.setenv("W4A16_BUILD_DIR", str(tmp_path / "builds"))
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    banners = {False: "nvcc: Cuda compilation tools, release 13.0", True: "HIP version: 6.4.0"}
    monkeypatch.setattr(skinny_build, "_device_compiler_version", lambda rocm: banners[rocm])
    return csrc


def test_build_directory_is_under_W4A16_BUILD_DIR_per_torch_and_archs(copied_csrc, tmp_path):
    path = skinny_build.library_path(["sm_80", "sm_90"])
    assert path.name == "w4a16_skinny.so" and path.parent.parent == tmp_path / "builds"
    assert path.parent.name.startswith(f"torch{torch.__version__}-sm_80-sm_90-".replace("+", "_"))
    assert "+" not in path.parent.name
    assert not path.parent.exists()  # asked where, not built
    assert skinny_build.build_directory(["sm_90"]).is_dir()
    assert skinny_build.library_path(["sm_90"]).parent != path.parent


def test_build_directory_follows_sources_flags_and_compiler(copied_csrc, monkeypatch):
    first = skinny_build.library_path(["sm_90"])
    (copied_csrc / "PERF.md").write_text("a note, not a source\n")
    assert skinny_build.library_path(["sm_90"]) == first
    kernel = copied_csrc / "skinny_mma.cuh"
    source = kernel.read_text()
    kernel.write_text(source + "// changed\n")  # the same file, other bytes
    assert skinny_build.library_path(["sm_90"]) != first
    kernel.write_text(source)
    assert skinny_build.library_path(["sm_90"]) == first
    kernel.rename(copied_csrc / "skinny_mma_old.cuh")  # the same bytes under another name: the includes break
    assert skinny_build.library_path(["sm_90"]) != first
    (copied_csrc / "skinny_mma_old.cuh").rename(kernel)
    monkeypatch.setattr(skinny_build, "EXTENSION_CFLAGS", ["-O2"])
    assert skinny_build.library_path(["sm_90"]) != first
    monkeypatch.setattr(skinny_build, "EXTENSION_CFLAGS", ["-O3"])  # the shipped flags again
    assert skinny_build.library_path(["sm_90"]) == first
    monkeypatch.setattr(skinny_build, "_device_compiler_version", lambda rocm: "nvcc: release 12.8")
    assert skinny_build.library_path(["sm_90"]) != first


def test_build_directory_on_rocm_follows_hipcc(copied_csrc, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    banners = {False: "nvcc", True: "HIP version: 6.4.0"}
    monkeypatch.setattr(skinny_build, "_device_compiler_version", lambda rocm: banners[rocm])
    first = skinny_build.library_path(["gfx1151"])
    banners[False] = "another nvcc"  # not the compiler a ROCm build runs
    assert skinny_build.library_path(["gfx1151"]) == first
    banners[True] = "HIP version: 7.0.0"
    assert skinny_build.library_path(["gfx1151"]) != first


def test_device_archs_of_every_visible_gpu(monkeypatch):
    props = [types.SimpleNamespace(major=9, minor=0), types.SimpleNamespace(major=8, minor=0),
             types.SimpleNamespace(major=9, minor=0)]
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props[torch.device(device).index])
    assert skinny_build.device_archs() == ["sm_80", "sm_90"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert skinny_build.device_archs() == []


def test_cuda_build_targets_each_arch_exactly(tmp_path, monkeypatch):
    """build() for two NVIDIA GPUs, as far as writing the ninja file: one -gencode per arch, real code (sm_NN) and
    no PTX, and nothing that torch adds of its own (TORCH_CUDA_ARCH_LIST, nvcc's generic default)."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(cpp_extension, "IS_HIP_EXTENSION", False)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    # a banner of its own, so that this build's compiler is not the one remembered for real builds in this process
    monkeypatch.setattr(skinny_build, "_device_compiler_version", lambda rocm: "nvcc: release 13.0")
    monkeypatch.setattr(skinny_build, "device_archs", lambda: ["sm_80", "sm_90"])
    monkeypatch.setenv("W4A16_BUILD_DIR", str(tmp_path / "builds"))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5+PTX")  # what torch would add were our flags missing
    monkeypatch.setattr(cpp_extension, "JIT_EXTENSION_VERSIONER", type(cpp_extension.JIT_EXTENSION_VERSIONER)())
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(cpp_extension, "_run_ninja_build", lambda *args, **kwargs: None)
    monkeypatch.setattr(cpp_extension, "_import_module_from_library", lambda *args, **kwargs: None)
    directory = skinny_build.build()
    assert directory == skinny_build.library_path(["sm_80", "sm_90"]).parent
    ninja = (directory / "build.ninja").read_text()
    flags = re.search(r"^cuda_cflags = (.*)$", ninja, re.M).group(1) + " " + re.search(
        r"^cuda_post_cflags = (.*)$", ninja, re.M).group(1)
    assert re.findall(r"\S*(?:arch|code)\S*", flags) == ["-gencode=arch=compute_80,code=sm_80",
                                                        "-gencode=arch=compute_90,code=sm_90"], flags
    assert "-O3" in flags.split() and "-Xptxas" not in flags, flags  # register counts only with build(verbose=True)
    assert skinny_build.arch_flags(["gfx1151"], rocm=True) == []  # on ROCm, PYTORCH_ROCM_ARCH (test_rocm_build)


def test_build_without_a_gpu_says_why_and_fails(tmp_path, monkeypatch, capsys):
    """`nox -s build` on a machine without a GPU torch: a clear message and exit 1, and no compile attempted."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(skinny_build, "device_archs", lambda: [])
    monkeypatch.setenv("W4A16_BUILD_DIR", str(tmp_path / "builds"))
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: pytest.fail("build() compiled without a GPU"))
    assert skinny_build.main([]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("nox -s build: building the skinny kernel needs a CUDA or ROCm build of torch and "
                                   f"a visible GPU; this torch is {torch.__version__}"), captured.err
    assert captured.out == ""


@pytest.mark.parametrize(("argv", "verbose"), [([], False), (["-v"], True), (None, True)])
def test_build_command_is_verbose_with_v_only(monkeypatch, argv, verbose):
    """main(argv) reads the arguments given, even an empty list; the command line only when given none."""
    asked = []

    def build(verbose=False):
        asked.append(verbose)
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(skinny_build, "build", build)
    monkeypatch.setattr(sys, "argv", ["python -m w4a16.skinny_build", "-v"])
    assert skinny_build.main(argv) == 1 and asked == [verbose]


# ---------------------------------------------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------------------------------------------
def test_nvcc_and_cuobjdump_under_CUDA_HOME(tmp_path, monkeypatch):
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "nvcc").write_text("")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert skinny_build.nvcc_path() == str(bin_dir / "nvcc")
    with monkeypatch.context() as no_triton:
        no_triton.setattr(importlib.util, "find_spec", lambda name: None)
        assert skinny_build.cuobjdump_path() is None  # nvcc alone is no cuobjdump
    (bin_dir / "cuobjdump").write_text("")
    assert skinny_build.cuobjdump_path() == str(bin_dir / "cuobjdump")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    assert skinny_build.nvcc_path() is None


def test_cuobjdump_from_tritons_wheel(tmp_path, monkeypatch):
    import importlib.machinery
    import importlib.util

    wheel = tmp_path / "site" / "triton"
    (wheel / "backends" / "nvidia" / "bin").mkdir(parents=True)
    (wheel / "backends" / "nvidia" / "bin" / "cuobjdump").write_text("")
    spec = importlib.machinery.ModuleSpec("triton", None, is_package=True)
    spec.submodule_search_locations = [str(wheel)]
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "triton" else None)
    assert skinny_build.cuobjdump_path() == str(wheel / "backends" / "nvidia" / "bin" / "cuobjdump")


@pytest.fixture
def recorded_tools(tmp_path, monkeypatch) -> list[list[str]]:
    """compile_device with every tool found and none run: the commands it gives, nvcc's kept cubin and PTX faked."""
    commands = []

    def run(cmd):
        commands.append(cmd)
        keep = next((arg.removeprefix("--keep-dir=") for arg in cmd if arg.startswith("--keep-dir=")), None)
        if keep:
            for suffix in ("sm_90.cubin", "ptx"):
                (Path(keep) / f"skinny_kernel.{suffix}").write_text(suffix)
        return subprocess.CompletedProcess(cmd, 0, "", "compiler log")

    monkeypatch.setattr(skinny_build, "_run", run)
    monkeypatch.setattr(skinny_build, "nvcc_path", lambda: "/cuda/bin/nvcc")
    monkeypatch.setattr(skinny_build, "cuobjdump_path", lambda: None)
    monkeypatch.setattr(skinny_build, "hip_compiler_path", lambda: "/usr/bin/clang-19")
    monkeypatch.setattr(skinny_build, "hip_headers_present", lambda: True)
    return commands


@pytest.mark.parametrize("arch", ["gfx1151", "gfx1201"])
def test_compile_device_command_for_amd(recorded_tools, tmp_path, arch):
    """Each target its own --offload-arch, the device-only flags of AMD_CHECK_FLAGS and the defines asked for."""
    compiled = skinny_build.compile_device(arch, tmp_path, defines=("W4A16_TRIAL=2",))
    assert recorded_tools == [["/usr/bin/clang-19", "-x", "hip", f"--offload-arch={arch}", *skinny_build.AMD_CHECK_FLAGS,
                               "--cuda-device-only", "-S", "-O3", "-std=c++17", "-DW4A16_TRIAL=2",
                               str(skinny_build.CSRC / "skinny_kernel.cu"), "-o", str(tmp_path / f"skinny_{arch}.s")]]
    assert compiled == {"asm": tmp_path / f"skinny_{arch}.s", "log": "compiler log", "kind": "amdgcn"}


def test_compile_device_for_sm_90_without_cuobjdump_gives_the_ptx(recorded_tools, tmp_path):
    """No disassembler: the PTX is what gets summarised, and nvcc's kept files are gone all the same."""
    compiled = skinny_build.compile_device("sm_90", tmp_path, defines=("W4A16_TRIAL=2",))
    [command] = recorded_tools
    assert command[:2] == ["/cuda/bin/nvcc", "-arch=sm_90"]
    assert ["-O3", "-std=c++17", "-DW4A16_TRIAL=2", str(skinny_build.CSRC / "skinny_kernel.cu")] == command[-6:-2]
    assert compiled == {"asm": tmp_path / "skinny_sm_90.ptx", "log": "compiler log", "kind": "ptx"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["skinny_sm_90.cubin", "skinny_sm_90.ptx"]
    assert compiled["asm"].read_text() == "ptx"


def test_device_compiler_version_asks_the_compiler_cpp_extension_runs(tmp_path, monkeypatch):
    """The banner that names a build comes from nvcc under CUDA_HOME, or hipcc under ROCM_HOME on ROCm; a missing
    compiler is recorded, not raised."""
    from torch.utils import cpp_extension

    for home, tool in (("cuda", "nvcc"), ("rocm", "hipcc")):
        (tmp_path / home / "bin").mkdir(parents=True)
        (tmp_path / home / "bin" / tool).write_text(f'#!/bin/sh\necho "{tool} $*"\n')
        (tmp_path / home / "bin" / tool).chmod(0o755)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setattr(cpp_extension, "ROCM_HOME", str(tmp_path / "rocm"))
    skinny_build._device_compiler_version.cache_clear()
    try:
        assert skinny_build._device_compiler_version(False) == "nvcc --version\n"
        assert skinny_build._device_compiler_version(True) == "hipcc --version\n"
        monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "nowhere"))
        skinny_build._device_compiler_version.cache_clear()
        assert skinny_build._device_compiler_version(False) == f"{tmp_path / 'nowhere' / 'bin' / 'nvcc'}: FileNotFoundError"
    finally:
        skinny_build._device_compiler_version.cache_clear()  # the real compiler's again for the tests after this


def test_a_failing_tool_raises_with_its_stderr():
    with pytest.raises(RuntimeError, match=r"failed \(exit 3\):\nptxas fatal"):
        skinny_build._run([sys.executable, "-c", "import sys; sys.stderr.write('ptxas fatal'); sys.exit(3)"])


# ---------------------------------------------------------------------------------------------------------------
# The asm summary's numbers, read from hand-built compiler output (test_device_compile.py reads the real kernel's,
# where every spill, scratch, call and static shared count is zero)
# ---------------------------------------------------------------------------------------------------------------
def amd_kernel(symbol: str, *, vgprs: int, sgpr_spills: int = 0, vgpr_spills: int = 0, scratch: int = 0,
               lds: int = 0, dynamic_stack: bool = False) -> str:
    """One kernel's metadata, fields in the order clang-19 writes them."""
    return f"""  - .args:
      - .address_space:  global
        .offset:         0
        .size:           8
        .value_kind:     global_buffer
    .group_segment_fixed_size: {lds}
    .kernarg_segment_align: 8
    .kernarg_segment_size: 40
    .max_flat_workgroup_size: 256
    .name:           {symbol}
    .private_segment_fixed_size: {scratch}
    .sgpr_count:     36
    .sgpr_spill_count: {sgpr_spills}
    .symbol:         {symbol}.kd
    .uniform_work_group_size: 1
    .uses_dynamic_stack: {'true' if dynamic_stack else 'false'}
    .vgpr_count:     {vgprs}
    .vgpr_spill_count: {vgpr_spills}
    .wavefront_size: 32
    .workgroup_processor_mode: 1
"""


AMD_KERNEL = "_ZN5w4a1618skinny_gemm_kernelINS_7Bf16TagELi32ELb0ELi{}EEEvPKtPKNS_6Words4ES3_PKhS3_Ptii"
AMD_LISTING = "\n".join([
    '\t.amdgcn_target "amdgcn-amd-amdhsa--gfx1151"',
    "\tv_dot2_f32_bf16 v80, v80, v71, 0",
    "\tv_dot2acc_f32_f16 v1, v2, v3",
    "\tv_dual_dot2acc_f32_f16 v4, v5, v6 :: v_dual_mov_b32 v7, v8",
    "\tv_pk_fma_f16 v4, v5, v6, v7",
    "\tv_and_or_b32 v1, v2, v3, v4",
    "\tv_or_b32_e32 v1, 0x64006400, v2",
    "\tv_cvt_f32_f16_e32 v1, v2",
    "\tv_cvt_f32_u32_e32 v3, v4",
    "\tv_cvt_f32_ubyte0_e32 v5, v6",
    "\tds_bpermute_b32 v1, v2, v3",
    "\tds_swizzle_b32 v1, v2 offset:swizzle(SWAP,16)",
    "\tv_permlanex16_b32 v1, v2, s0, s1",
    "\tv_add_f32_dpp v1, v2, v3 row_shr:1 row_mask:0xf bank_mask:0xf",  # one instruction, one count
    "\tglobal_load_b128 v[6:9], v[14:15], off",
    "\tglobal_load_b128 v[10:13], v[14:15], off offset:16",
    "\tds_load_b128 v[71:74], v66",
    "\ts_swappc_b64 s[30:31], s[16:17]",
    "\t.globl\tw4a16_device_staging_elements",
    "w4a16_device_staging_elements:",
    "\t.long\t30720                           ; 0x7800",
    "\t.amdgpu_metadata",
    "---",
    "amdhsa.kernels:",
    amd_kernel("_ZN5w4a1619skinny_limits_probeEPi", vgprs=3),
    amd_kernel(AMD_KERNEL.format(1), vgprs=93, sgpr_spills=2, vgpr_spills=5, scratch=48, lds=256, dynamic_stack=True),
    amd_kernel(AMD_KERNEL.format(2), vgprs=139, vgpr_spills=1, scratch=16),
    amd_kernel(AMD_KERNEL.format(3), vgprs=120),
    "\t.end_amdgpu_metadata",
    "",
])


def test_amd_stats_from_the_kernel_metadata(tmp_path):
    (tmp_path / "k.s").write_text(AMD_LISTING)
    stats = skinny_build.asm_stats("gfx1151", {"asm": tmp_path / "k.s", "log": "", "kind": "amdgcn"})
    assert stats["kernels"] == 3  # the probe is not a GEMM kernel
    assert stats["registers"] == (93, 139)  # nor are its 3 VGPRs
    assert stats["spills"] == 2 + 5 + 1  # SGPR and VGPR spills, summed over the kernels
    assert stats["scratch_bytes"] == 48 and stats["static_shared_bytes"] == 256  # the largest kernel's
    assert stats["calls"] == 1 and stats["dynamic_stack_kernels"] == 1
    assert stats["probe_staging_elements"] == 30720
    counts = {label.split(" ")[0]: n for label, n in stats["instructions"].items()}
    assert counts == {"v_dot2": 3, "v_pk_*": 1, "v_and_or_b32": 2, "v_cvt_*": 3, "int->float": 2, "cross-lane": 4,
                      "global_load_b128": 2, "ds_load_b128": 1}


NV_KERNEL = "_ZN5w4a1611tensor_core18skinny_gemm_kernelINS_7Fp16TagELi128ELb1ELi8ELb{}EEEvPKtPKNS_6Words4ES4_PKhS4_Ptii"
CLUSTER, SINGLE = NV_KERNEL.format(1), NV_KERNEL.format(0)
PTXAS_LOG = f"""ptxas info    : 4 bytes gmem
ptxas info    : Compiling entry function '{CLUSTER}' for 'sm_90'
ptxas info    : Function properties for {CLUSTER}
    40 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 40 bytes cumulative stack size, 2048 bytes smem
ptxas info    : Compile time = 394.098 ms
ptxas info    : Compiling entry function '{SINGLE}' for 'sm_90'
ptxas info    : Function properties for {SINGLE}
    8 bytes stack frame, 0 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 149 registers, used 1 barriers
ptxas info    : Compile time = 133.300 ms
ptxas info    : Compiling entry function '_ZN5w4a1619skinny_limits_probeEPi' for 'sm_90'
ptxas info    : Function properties for _ZN5w4a1619skinny_limits_probeEPi
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
ptxas info    : Compile time = 1.233 ms
"""
PTX = """
\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1,%f2,%f3,%f4}, {%r1,%r2,%r3,%r4}, {%r5,%r6}, {%f1,%f2,%f3,%f4};
\tfma.rn.f32 %f5, %f6, %f7, %f5;
\tlop3.b32 %r7, %r8, 983055, 1677747200, 234;
\tor.b32 %r9, %r10, 1677747200;
\tcvt.f32.f16 %f8, %rs1;
\tcvt.rn.f32.u32 %f9, %r11;
\tcvt.rn.f32.s32 %f10, %r12;
\tshfl.sync.bfly.b32 %r13|%p1, %r14, 1, 31, -1;
\tld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%r15, %r16, %r17, %r18}, [%rd1];
\tld.global.nc.v4.u32 {%r15, %r16, %r17, %r18}, [%rd2];
\tld.shared.v4.u32 {%r19, %r20, %r21, %r22}, [%r23];
"""


def test_nvidia_stats_from_the_ptxas_log(tmp_path):
    (tmp_path / "k.ptx").write_text(PTX)  # no cubin beside it: no probe value
    stats = skinny_build.asm_stats("sm_90", {"asm": tmp_path / "k.ptx", "log": PTXAS_LOG, "kind": "ptx"})
    assert stats["kernels"] == 2
    assert stats["registers"] == (149, 255)  # the probe's 10 are not the kernel's
    assert stats["spills"] == 24 + 16 + 0 + 4  # stores and loads
    assert stats["scratch_bytes"] == 40 and stats["static_shared_bytes"] == 2048  # not the 4 bytes of gmem
    assert stats["probe_staging_elements"] is None
    counts = {label.split(" ")[0]: n for label, n in stats["instructions"].items()}
    assert counts == {"mma.sync": 1, "fma.rn.f32": 1, "lop3": 2, "cvt.f32.f16": 1, "cvt.rn.f32.[su]32": 2,
                      "shfl.sync.bfly": 1, "ld.global.nc.v4": 2, "ld.shared.v4": 1}


@pytest.mark.parametrize(("mangled", "label"), [
    ("_ZN5w4a1611tensor_core18skinny_gemm_kernelINS_7Fp16TagELi128ELb1ELi8ELb1EEEvPKtPKNS_6Words4ES4_PKhS4_Ptii",
     "fp16 G=128 sym M=8 cluster"),
    ("_ZN5w4a1611tensor_core18skinny_gemm_kernelINS_8Bf16TagELi32ELb0ELi3ELb0EEEvPKtPKNS_6Words4ES4_PKhS4_Ptii",
     "bf16 G=32 asym M=3 single"),
    ("_ZN5w4a1619skinny_limits_probeEPi", "_ZN5w4a1619skinny_limits_probeEPi"),  # not an instantiation: as is
])
def test_kernel_label(mangled, label):
    assert skinny_build.kernel_label(mangled) == label


def summary_stats(arch: str, **extra) -> dict:
    return {"arch": arch, "kind": "sass" if arch == "sm_90" else "amdgcn", "kernels": 4, "registers": (90, 168),
            "spills": 12, "scratch_bytes": 32, "static_shared_bytes": 1024, "probe_staging_elements": 100928,
            "instructions": {"HMMA (tensor-core mma.sync)": 77}, **extra}


def test_format_summary_nvidia():
    text = skinny_build.format_summary(summary_stats(
        "sm_90", refill_waits={"fp16 G=128 sym M=8 cluster": 0, "fp16 G=128 sym M=7 cluster": 2,
                               "bf16 G=32 asym M=1 single": None, "bf16 G=32 asym M=2 single": 0}))
    assert text.splitlines() == [
        "skinny kernel, sm_90 (sass): 4 kernel instantiations",
        "  registers per thread: 90..168; spills: 12 ; scratch/stack: 32 B; static shared: 1024 B (activations use"
        " dynamic shared memory)",
        "  staging budget compiled into the device code: 100928 elements",
        "  weight-ring loop waits once per pass in 2 of 4 instantiations; waits on its own refills in: fp16 G=128 sym"
        " M=7 cluster; no weight-ring loop found in: bf16 G=32 asym M=1 single",
        "        77  HMMA (tensor-core mma.sync)",
    ]


def test_format_summary_amd():
    text = skinny_build.format_summary(summary_stats("gfx1201", calls=1, dynamic_stack_kernels=2))
    assert "  VGPRs per thread: 90..168; spills: 12 ; scratch/stack: 32 B;" in text
    assert "  calls: 1; kernels with a dynamic stack: 2" in text.splitlines()
    assert "weight-ring" not in text


@pytest.fixture
def fake_amd_compile(monkeypatch) -> None:
    """compile_device writing AMD_LISTING instead of running clang."""
    def compile_device(arch, out_dir, defines=()):
        asm = Path(out_dir) / f"skinny_{arch}.s"
        asm.write_text(AMD_LISTING)
        return {"asm": asm, "log": "", "kind": "amdgcn"}

    monkeypatch.setattr(skinny_build, "compile_device", compile_device)


def test_asm_summary_returns_the_assembly_and_its_summary(fake_amd_compile, tmp_path):
    path, text = skinny_build.asm_summary("gfx1151", tmp_path)
    assert path == tmp_path / "skinny_gfx1151.s" and path.read_text() == AMD_LISTING
    assert text.startswith("skinny kernel, gfx1151 (amdgcn): 3 kernel instantiations\n  VGPRs per thread: 93..139;")


def test_asm_command_skinny_prints_the_assembly_path_and_summary(fake_amd_compile, tmp_path, capsys):
    from w4a16.__main__ import main

    assert main(["asm", "--backend", "skinny", "--arch", "gfx1151", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"assembly {tmp_path / 'out' / 'skinny_gfx1151.s'}"
    assert out[1] == "skinny kernel, gfx1151 (amdgcn): 3 kernel instantiations"
