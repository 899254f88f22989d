"""The ROCm build of the extension (`nox -s build` on an AMD GPU), as far as a machine without ROCm can take it.

`skinny_build.build()` runs with torch's cpp_extension believing it is a ROCm build: torch's own hipify converts the
sources and torch writes the ninja file with the flags hipcc would get. Only the steps that need ROCm are left out
(running ninja, loading the library). clang-19 then compiles the hipified kernel with those flags: its device code
must be what the direct compile of csrc/ gives (the one test_device_compile.py checks), and its host code must
compile without warnings. The hipified binding compiles against torch's headers as a ROCm torch ships them.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from w4a16_testing import require_tool

from w4a16 import skinny_build
from w4a16.skinny_build import CSRC

ARCH = "gfx1151"


def ninja_variable(directory: Path, name: str) -> str:
    """A variable of the build directory's ninja file (cxx, cflags, post_cflags, cuda_cflags, ...)."""
    return re.search(rf"^{name} = (.*)$", (directory / "build.ninja").read_text(), re.M).group(1)


@pytest.fixture
def rocm_build(tmp_path, monkeypatch) -> Path:
    """build() as on a ROCm machine with one gfx1151: its build directory."""
    monkeypatch.delenv("PYTORCH_ROCM_ARCH", raising=False)
    return build_as_on_rocm(tmp_path, monkeypatch, [ARCH])


def build_as_on_rocm(tmp_path, monkeypatch, archs: list[str]) -> Path:
    """build() as on a ROCm machine with GPUs of these archs: its build directory."""
    from torch.utils import cpp_extension

    require_tool(skinny_build.hip_compiler_path() is not None, "clang-19 compiles the hipified kernel")
    require_tool(skinny_build.hip_headers_present(), "Debian's HIP headers (libamdhip64-dev)")
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(cpp_extension, "IS_HIP_EXTENSION", True)
    monkeypatch.setattr(cpp_extension, "ROCM_HOME", "/opt/rocm")
    monkeypatch.setattr(skinny_build, "device_archs", lambda: archs)
    monkeypatch.setenv("W4A16_BUILD_DIR", str(tmp_path / "builds"))
    # cpp_extension numbers rebuilds of one extension name per process: a fresh count, so that a real build later in
    # this process keeps its plain library name.
    monkeypatch.setattr(cpp_extension, "JIT_EXTENSION_VERSIONER", type(cpp_extension.JIT_EXTENSION_VERSIONER)())
    # The ROCm-only steps: ninja would call hipcc, and loading needs the library it links.
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(cpp_extension, "_run_ninja_build", lambda *args, **kwargs: None)
    monkeypatch.setattr(cpp_extension, "_import_module_from_library", lambda *args, **kwargs: None)
    sources_before = sorted(path.name for path in CSRC.iterdir())
    directory = skinny_build.build()
    assert sorted(path.name for path in CSRC.iterdir()) == sources_before, "the build wrote into csrc/"
    return directory


def test_rocm_build_is_found_where_it_was_built(rocm_build):
    directory = rocm_build
    # The loader (w4a16.skinny) looks for the library by the digest of csrc/, taken again after the build.
    assert skinny_build.library_path([ARCH]).parent == directory
    ninja = (directory / "build.ninja").read_text()
    built = re.findall(r"^build \S+: (?:cuda_)?compile (\S+)$", ninja, re.M)
    assert sorted(Path(source).name for source in built) == ["binding_hip.cpp", "skinny_kernel.hip"]
    assert all(Path(source).parent == directory / "csrc" for source in built)


def test_rocm_build_targets_the_visible_arch_only(rocm_build):
    assert re.findall(r"--offload-arch=(\S*)", ninja_variable(rocm_build, "cuda_cflags")) == [ARCH]
    assert "PYTORCH_ROCM_ARCH" not in os.environ  # build() restores the environment


def test_rocm_build_targets_every_visible_arch_and_restores_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTORCH_ROCM_ARCH", "gfx942")  # the user's own setting, for their other builds
    directory = build_as_on_rocm(tmp_path, monkeypatch, ["gfx1151", "gfx1201"])
    assert directory == skinny_build.library_path(["gfx1151", "gfx1201"]).parent
    assert re.findall(r"--offload-arch=(\S*)", ninja_variable(directory, "cuda_cflags")) == ["gfx1151", "gfx1201"]
    assert os.environ["PYTORCH_ROCM_ARCH"] == "gfx942"


def test_hipified_kernel_compiles_to_the_checked_device_code(rocm_build, tmp_path):
    clang = skinny_build.hip_compiler_path()
    kernel = rocm_build / "csrc" / "skinny_kernel.hip"
    # Device and host apart, and without ROCm's device libraries, as the direct compile (AMD_CHECK_FLAGS).
    common = [clang, "-x", "hip", *ninja_variable(rocm_build, "cuda_cflags").split(), *skinny_build.AMD_CHECK_FLAGS,
              str(kernel)]
    device = subprocess.run([*common, "--cuda-device-only", "-S", "-o", str(tmp_path / "device.s")],
                            capture_output=True, text=True)
    assert device.returncode == 0, device.stderr[-4000:]
    host = subprocess.run([*common, "--cuda-host-only", "-c", "-o", str(tmp_path / "host.o")],
                          capture_output=True, text=True)
    assert host.returncode == 0, host.stderr[-4000:]
    assert "warning" not in host.stderr, host.stderr[-4000:]

    hipified = skinny_build.asm_stats(ARCH, {"asm": tmp_path / "device.s", "log": device.stderr, "kind": "amdgcn"})
    direct = skinny_build.asm_stats(ARCH, skinny_build.compile_device(ARCH, tmp_path / "direct"))
    assert hipified == direct  # test_device_compile.py checks the direct compile's kernel count and spills


def test_hipified_binding_compiles_against_torchs_rocm_headers(rocm_build, tmp_path):
    from torch.utils.hipify import hipify_python

    # A ROCm torch ships c10/hip/*.h, made at its own build by hipifying c10/cuda/*.h: the same hipify of this
    # torch's c10/cuda headers stands in for them, with the one header that torch's cmake writes there.
    include = Path(torch.__file__).parent / "include"
    rocm_include = tmp_path / "include"
    hipify_python.hipify(project_directory=str(include), output_directory=str(rocm_include),
                         includes=[str(include / "c10" / "cuda" / "*")], is_pytorch_extension=False,
                         show_detailed=False, show_progress=False)
    (rocm_include / "c10" / "hip" / "impl" / "hip_cmake_macros.h").write_text(
        "#pragma once\n#define C10_HIP_BUILD_SHARED_LIBS\n")
    # The ninja file's own host compile ($cxx $cflags -c $in -o $out $post_cflags), those headers searched first.
    command = [ninja_variable(rocm_build, "cxx"), "-isystem", str(rocm_include),
               *ninja_variable(rocm_build, "cflags").split(), "-c", str(rocm_build / "csrc" / "binding_hip.cpp"),
               "-o", str(tmp_path / "binding.o"), *ninja_variable(rocm_build, "post_cflags").split()]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "binding_hip.cpp" not in result.stderr, result.stderr[-4000:]  # no warning in the binding itself
