"""The ROCm build of the extension (`nox -s build` on an AMD GPU), as far as a machine without ROCm can take it.

`skinny_build.build()` runs with torch's cpp_extension believing it is a ROCm build: torch's own hipify converts the
sources and torch writes the ninja file with the flags hipcc would get. Only the steps that need ROCm are left out
(running ninja, loading the library). clang-19 then compiles the hipified kernel with those flags: its device code
must be what the direct compile of csrc/ gives (the one test_device_compile.py checks), and its host code must
compile without warnings. The binding (binding_hip.cpp) is not compiled: it needs the ROCm build of torch's headers.
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


@pytest.fixture
def rocm_build(tmp_path, monkeypatch) -> tuple[Path, str]:
    """build() as on a ROCm machine with one gfx1151: (its build directory, the hipcc flags of its ninja file)."""
    from torch.utils import cpp_extension

    require_tool(skinny_build.hip_compiler_path() is not None, "clang-19 compiles the hipified kernel")
    require_tool(skinny_build.hip_headers_present(), "Debian's HIP headers (libamdhip64-dev)")
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(cpp_extension, "IS_HIP_EXTENSION", True)
    monkeypatch.setattr(cpp_extension, "ROCM_HOME", "/opt/rocm")
    monkeypatch.setattr(skinny_build, "device_archs", lambda: [ARCH])
    monkeypatch.setenv("W4A16_BUILD_DIR", str(tmp_path / "builds"))
    monkeypatch.delenv("PYTORCH_ROCM_ARCH", raising=False)
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
    ninja = (directory / "build.ninja").read_text()
    return directory, re.search(r"^cuda_cflags = (.*)$", ninja, re.M).group(1)


def test_rocm_build_is_found_where_it_was_built(rocm_build):
    directory, _ = rocm_build
    # The loader (w4a16.skinny) looks for the library by the digest of csrc/, taken again after the build.
    assert skinny_build.library_path([ARCH]).parent == directory
    ninja = (directory / "build.ninja").read_text()
    built = re.findall(r"^build \S+: (?:cuda_)?compile (\S+)$", ninja, re.M)
    assert sorted(Path(source).name for source in built) == ["binding_hip.cpp", "skinny_kernel.hip"]
    assert all(Path(source).parent == directory / "csrc" for source in built)


def test_rocm_build_targets_the_visible_arch_only(rocm_build):
    _, flags = rocm_build
    assert re.findall(r"--offload-arch=(\S*)", flags) == [ARCH]
    assert "PYTORCH_ROCM_ARCH" not in os.environ  # build() restores the environment


def test_hipified_kernel_compiles_to_the_checked_device_code(rocm_build, tmp_path):
    directory, flags = rocm_build
    clang = skinny_build.hip_compiler_path()
    kernel = directory / "csrc" / "skinny_kernel.hip"
    # Device and host apart, and -nogpulib: without ROCm's device libraries clang cannot link the device code.
    common = [clang, "-x", "hip", *flags.split(), "-nogpulib", str(kernel)]
    device = subprocess.run([*common, "--cuda-device-only", "-S", "-o", str(tmp_path / "device.s")],
                            capture_output=True, text=True)
    assert device.returncode == 0, device.stderr[-4000:]
    host = subprocess.run([*common, "--cuda-host-only", "-c", "-o", str(tmp_path / "host.o")],
                          capture_output=True, text=True)
    assert host.returncode == 0, host.stderr[-4000:]
    assert "warning" not in host.stderr, host.stderr[-4000:]

    hipified = skinny_build.asm_stats(ARCH, {"asm": tmp_path / "device.s", "log": device.stderr, "kind": "amdgcn"})
    direct = skinny_build.asm_stats(ARCH, skinny_build.compile_device(ARCH, tmp_path / "direct"))
    assert hipified["kernels"] == 2 * 3 * 2 * 5 and hipified["spills"] == 0
    assert hipified == direct
