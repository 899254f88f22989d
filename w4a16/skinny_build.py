"""Building the skinny kernel (csrc/) as a torch extension, and compiling it alone for instruction checks.

`build()` compiles csrc/binding.cpp + csrc/skinny_kernel.cu with `torch.utils.cpp_extension` against the running
torch, for the GPUs present (`-gencode=arch=compute_90,code=sm_90` on Hopper, never nvcc's generic default;
`--offload-arch=gfxNNNN` on ROCm, from a hipified copy of the sources in the build directory), in a cached build
directory; loading it registers `torch.ops.w4a16.*`. tests/csrc/test_rocm_build.py runs the ROCm build as far as a
machine without ROCm can: torch's hipify, the ninja file's flags, the hipified kernel compiled by clang-19 and the
binding by the host compiler.

`asm_summary(arch, out_dir)` needs no GPU and no torch build: it compiles csrc/skinny_kernel.cu for sm_90 (nvcc,
then cuobjdump when one is found) or gfx1151/gfx1201 (clang-19 HIP with Debian's libamdhip64-dev headers) and
summarises the instructions that matter (dot2 / packed math, shuffles, the magic-number bit ops, conversions),
registers, spills/scratch and shared memory. `python -m w4a16.skinny_build` is what `nox -s build` runs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from . import sass

CSRC = Path(__file__).resolve().parent.parent / "csrc"
EXTENSION_SOURCES = ("binding.cpp", "skinny_kernel.cu")
DEVICE_SOURCE = "skinny_kernel.cu"
EXTENSION_NAME = "w4a16_skinny"
ASM_ARCHS = ("sm_90", "gfx1151", "gfx1201")
PROBE_SYMBOL = "w4a16_device_staging_elements"
HIP_COMPILER = "clang-19"
# The AMD device-only compile checks: no ROCm device libraries here (-nogpulib), so their few functions that HIP's
# headers call come inline from this header; otherwise each would stay an external call in the checked code.
AMD_CHECK_FLAGS = ("-nogpulib", "-include", str(CSRC / "amd_device_lib_inline.h"))

# Instructions of interest per target: (label, regex over assembly lines).
_AMD_PATTERNS = {
    "v_dot2 (packed dot, fp32 accumulate)": r"\bv_(?:dual_)?dot2\w*",
    "v_pk_* (packed 16-bit math)": r"\bv_pk_\w+",
    "v_and_or_b32 / v_or_b32 (magic-number OR)": r"\bv_(?:and_or|or)_b32\w*",
    "v_cvt_* (conversions)": r"\bv_cvt_\w+",
    "int->float conversions (zero points and indices only; weights use the magic OR)": r"\bv_cvt_f(?:16|32)_[iu](?:8|16|32)\w*|\bv_cvt_f32_ubyte\d\w*",
    "cross-lane (ds_swizzle / ds_bpermute / dpp / v_permlane)": r"\bds_swizzle\w*|\bds_bpermute\w*|\bv_permlane\w*|\bv_\w+_dpp\b",
    "global_load_b128 (16-byte weight loads)": r"\bglobal_load_(?:b128|dwordx4)\b",
    "ds_load_b128 (16-byte LDS reads)": r"\bds_(?:load|read)_(?:b128|b96|2addr_b64|b64)\b",
}
_SASS_PATTERNS = {
    "HMMA (tensor-core mma.sync)": r"\bHMMA\.",
    "FFMA (fp32 FMA)": r"\bFFMA\b",
    "HFMA2 / HADD2 / HMUL2 (packed 16-bit math)": r"\bH(?:FMA2|ADD2|MUL2)\b(?!\.F32)",
    "LOP3 (magic-number bit ops)": r"\bLOP3\b",
    "F2F / HADD2.F32 (conversions)": r"\bF2F\b|\bHADD2\.F32\b",
    "I2F (int->float: zero points and indices only; weights use the magic OR)": r"\bI2F\b",
    "SHFL (lane shuffles)": r"\bSHFL\b",
    "LDG.E.128 (16-byte weight loads)": r"\bLDG\.E\.[A-Z0-9_.]*128\b",
    "LDS.128 (16-byte shared reads)": r"\bLDS\.128\b",
}
_PTX_PATTERNS = {
    "mma.sync (tensor cores)": r"\bmma\.sync\.",
    "fma.rn.f32": r"\bfma\.rn\.f32\b",
    "lop3 / or.b32 (magic-number bit ops)": r"\blop3\.b32\b|\bor\.b32\b",
    "cvt.f32.f16 (conversions)": r"\bcvt\.f32\.f16\b",
    "cvt.rn.f32.[su]32 (int->float: zero points and indices only)": r"\bcvt\.rn\.f32\.[su]32\b",
    "shfl.sync.bfly": r"\bshfl\.sync\.bfly\b",
    "ld.global.nc.v4 (16-byte weight loads; L1::no_allocate where G = 128)":
        r"\bld\.global\.nc(?:\.L1::no_allocate)?(?:\.L2::\d+B)?\.v4\b",
    "ld.shared.v4": r"\bld\.shared\.v4\b",
}


class ToolMissing(RuntimeError):
    """A compiler or disassembler the summary needs is not installed."""


# ---------------------------------------------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------------------------------------------
def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidate = Path(cuda_home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def cuobjdump_path() -> str | None:
    """cuobjdump on PATH, next to nvcc, or the copy Triton's wheel ships (found without importing triton)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = nvcc_path()
    if nvcc:
        for folder in (Path(nvcc).resolve().parent, Path(nvcc).parent):
            if (folder / "cuobjdump").exists():
                return str(folder / "cuobjdump")
    import importlib.util

    spec = importlib.util.find_spec("triton")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "backends" / "nvidia" / "bin" / "cuobjdump"
        if candidate.exists():
            return str(candidate)
    return None


def hip_compiler_path() -> str | None:
    return shutil.which(HIP_COMPILER)


def hip_headers_present() -> bool:
    return Path("/usr/include/hip/hip_runtime.h").exists()


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return result


# ---------------------------------------------------------------------------------------------------------------
# Device-only compilation and the instruction summary
# ---------------------------------------------------------------------------------------------------------------
def compile_device(arch: str, out_dir: str | os.PathLike, defines: tuple[str, ...] = ()) -> dict:
    """Compile csrc/skinny_kernel.cu for `arch` into out_dir; return {'asm': path, 'log': compiler stderr, 'kind'}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = str(CSRC / DEVICE_SOURCE)
    flags = ["-O3", "-std=c++17", *(f"-D{d}" for d in defines)]
    if arch == "sm_90":
        nvcc = nvcc_path()
        if not nvcc:
            raise ToolMissing("nvcc (CUDA 12+) is needed to compile for sm_90")
        # An object, not just the cubin: the host code (the launcher) compiles too, and --keep leaves the cubin and
        # the PTX of the device pass beside it.
        kept = out / "nvcc"
        kept.mkdir(exist_ok=True)
        stem = Path(DEVICE_SOURCE).stem
        cubin = out / "skinny_sm_90.cubin"
        ptx = out / "skinny_sm_90.ptx"
        try:
            log = _run([nvcc, "-arch=sm_90", "-c", "--keep", f"--keep-dir={kept}", "-Xptxas", "-v", *flags, source,
                        "-o", str(kept / "skinny_sm_90.o")]).stderr
            shutil.copyfile(kept / f"{stem}.sm_90.cubin", cubin)
            shutil.copyfile(kept / f"{stem}.ptx", ptx)
        finally:
            shutil.rmtree(kept)  # the object and nvcc's intermediate files, about 75 MB, also after a failure
        cuobjdump = cuobjdump_path()
        if cuobjdump:
            listing = _run([cuobjdump, "-sass", str(cubin)]).stdout
            asm = out / "skinny_sm_90.sass"
            asm.write_text(listing)
            return {"asm": asm, "log": log, "kind": "sass"}
        return {"asm": ptx, "log": log, "kind": "ptx"}
    if arch in ("gfx1151", "gfx1201"):
        clang = hip_compiler_path()
        if not clang:
            raise ToolMissing(f"{HIP_COMPILER} is needed to compile for {arch} (apt-get install clang-19 lld-19)")
        if not hip_headers_present():
            raise ToolMissing("HIP headers are needed (apt-get install libamdhip64-dev)")
        asm = out / f"skinny_{arch}.s"
        log = _run([clang, "-x", "hip", f"--offload-arch={arch}", *AMD_CHECK_FLAGS, "--cuda-device-only", "-S",
                    *flags, source, "-o", str(asm)]).stderr
        return {"asm": asm, "log": log, "kind": "amdgcn"}
    raise ValueError(f"arch must be one of {ASM_ARCHS}, got {arch!r}")


def _count(patterns: dict[str, str], text: str) -> dict[str, int]:
    return {label: len(re.findall(pattern, text)) for label, pattern in patterns.items()}


def asm_stats(arch: str, compiled: dict) -> dict:
    """Numbers from a compile_device result: instruction counts, registers, spills, shared memory, probe value."""
    text = Path(compiled["asm"]).read_text()
    log = compiled["log"]
    stats: dict = {"arch": arch, "kind": compiled["kind"]}
    if arch.startswith("gfx"):
        stats["instructions"] = _count(_AMD_PATTERNS, text)
        # Kernel metadata: .symbol comes a few lines before .vgpr_count; keep the GEMM kernels (not the probe).
        vgprs = [int(v) for v in re.findall(
            r"^\s+\.symbol:\s+\S*skinny_gemm_kernel\S*\n(?:.*\n){0,6}?\s+\.vgpr_count:\s+(\d+)", text, re.M)]
        stats["kernels"] = len(re.findall(r"^\s+\.symbol:\s+\S*skinny_gemm_kernel", text, re.M))
        stats["registers"] = (min(vgprs), max(vgprs)) if vgprs else (0, 0)
        stats["spills"] = sum(int(v) for v in re.findall(r"^\s+\.[vs]gpr_spill_count:\s+(\d+)", text, re.M))
        stats["scratch_bytes"] = max((int(v) for v in re.findall(r"^\s+\.private_segment_fixed_size:\s+(\d+)", text, re.M)), default=0)
        stats["static_shared_bytes"] = max((int(v) for v in re.findall(r"^\s+\.group_segment_fixed_size:\s+(\d+)", text, re.M)), default=0)
        # A call (an unresolved device-library function, say) makes the kernel another one: AMD_CHECK_FLAGS.
        stats["calls"] = len(re.findall(r"\bs_swappc_b64\b", text))
        stats["dynamic_stack_kernels"] = len(re.findall(r"^\s+\.uses_dynamic_stack:\s+true", text, re.M))
        probe = re.search(rf"^{PROBE_SYMBOL}:\s*\n\s*\.long\s+(\d+)", text, re.M)
    else:
        if compiled["kind"] == "sass":
            functions = sass.functions(text)
            # Counted over the instructions alone: the listing is mostly hex words, and 10x faster to skip.
            stats["instructions"] = _count(_SASS_PATTERNS, "\n".join(i.text for f in functions.values() for i in f))
            # None for an instantiation without a weight-ring loop (nothing to check there: a failure of the check)
            stats["refill_waits"] = {kernel_label(name): None if (waits := sass.refill_waits(instructions)) is None
                                     else len(waits)
                                     for name, instructions in functions.items() if "skinny_gemm_kernel" in name}
            # Launched programmatically, so nothing may touch global memory before the wait (skinny_mma.cuh): the
            # accesses (and skipping branches) placed before it, or None where it never waits.
            stats["before_grid_wait"] = {kernel_label(name): None if (early := sass.accesses_before_grid_wait(
                                             instructions)) is None else [i.text for i in early]
                                         for name, instructions in functions.items() if "skinny_gemm_kernel" in name}
        else:
            stats["instructions"] = _count(_PTX_PATTERNS, text)
        regs = [int(v) for v in re.findall(r"skinny_gemm_kernel[^\n]*\n[^\n]*\n[^\n]*Used (\d+) registers", log)]
        stats["kernels"] = len(re.findall(r"Compiling entry function '\S*skinny_gemm_kernel", log))
        stats["registers"] = (min(regs), max(regs)) if regs else (0, 0)
        stats["spills"] = sum(int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log))
        stats["scratch_bytes"] = max((int(v) for v in re.findall(r"(\d+) bytes stack frame", log)), default=0)
        stats["static_shared_bytes"] = max((int(v) for v in re.findall(r"(\d+) bytes smem", log)), default=0)
        probe = None
        cubin = Path(compiled["asm"]).with_suffix(".cubin")
        if cubin.exists():
            probe = _cubin_probe(cubin)
    stats["probe_staging_elements"] = int(probe.group(1)) if hasattr(probe, "group") else probe
    return stats


_KERNEL_ARGS = re.compile(r"skinny_gemm_kernelINS_\d+(\w+?)TagELi(\d+)ELb([01])ELi(\d+)ELb([01])E")


def kernel_label(mangled: str) -> str:
    """'bf16 G=128 sym M=8 cluster' for a mangled tensor-core skinny_gemm_kernel instantiation."""
    args = _KERNEL_ARGS.search(mangled)
    if not args:
        return mangled
    dtype, group, symmetric, rows, clustered = args.groups()
    return (f"{dtype.lower()} G={group} {'sym' if symmetric == '1' else 'asym'} M={rows} "
            f"{'cluster' if clustered == '1' else 'single'}")


def _cubin_probe(cubin: Path) -> int | None:
    """The initial value of the probe variable in an sm_90 cubin (cuobjdump -elf shows the .nv.global.init bytes)."""
    cuobjdump = cuobjdump_path()
    if not cuobjdump:
        return None
    elf = subprocess.run([cuobjdump, "-elf", str(cubin)], capture_output=True, text=True).stdout
    # The section dump: a line ".nv.global.init" followed by its 32-bit words; the probe is the only variable.
    words = re.search(r"^\.nv\.global\.init\s*\n\s*0x([0-9a-fA-F]{8})", elf, re.M)
    return int(words.group(1), 16) if words else None


def format_summary(stats: dict) -> str:
    lines = [f"skinny kernel, {stats['arch']} ({stats['kind']}): {stats['kernels']} kernel instantiations"]
    lo, hi = stats["registers"]
    unit = "VGPRs" if stats["arch"].startswith("gfx") else "registers"
    lines.append(f"  {unit} per thread: {lo}..{hi}; spills: {stats['spills']} ; scratch/stack: {stats['scratch_bytes']} B;"
                 f" static shared: {stats['static_shared_bytes']} B (activations use dynamic shared memory)")
    lines.append(f"  staging budget compiled into the device code: {stats['probe_staging_elements']} elements")
    if "calls" in stats:
        lines.append(f"  calls: {stats['calls']}; kernels with a dynamic stack: {stats['dynamic_stack_kernels']}")
    if "refill_waits" in stats:
        waiting = sorted(label for label, n in stats["refill_waits"].items() if n)
        no_loop = sorted(label for label, n in stats["refill_waits"].items() if n is None)
        clean = len(stats["refill_waits"]) - len(waiting) - len(no_loop)
        lines.append(f"  weight-ring loop waits once per pass in {clean} of {len(stats['refill_waits'])} instantiations"
                     + (f"; waits on its own refills in: {', '.join(waiting)}" if waiting else "")
                     + (f"; no weight-ring loop found in: {', '.join(no_loop)}" if no_loop else ""))
    for label, count in stats["instructions"].items():
        lines.append(f"  {count:8d}  {label}")
    return "\n".join(lines)


def asm_summary(arch: str, out_dir: str | os.PathLike) -> tuple[Path, str]:
    """Compile the device code for `arch` (sm_90, gfx1151, gfx1201); return (assembly path, summary text)."""
    compiled = compile_device(arch, out_dir)
    return Path(compiled["asm"]), format_summary(asm_stats(arch, compiled))


# ---------------------------------------------------------------------------------------------------------------
# The torch extension
# ---------------------------------------------------------------------------------------------------------------
EXTENSION_CFLAGS = ["-O3"]


def _device_flags(archs: list[str], rocm: bool) -> list[str]:
    """The device compiler's flags (the C++ standard is left to cpp_extension: it matches this torch's headers)."""
    return ["-O3", *arch_flags(archs, rocm)]


@functools.cache
def _device_compiler_version(rocm: bool) -> str:
    """The version banner of the compiler cpp_extension runs (nvcc, or hipcc on ROCm)."""
    from torch.utils import cpp_extension

    # A torch that found no toolkit has None here: the digest then records the missing compiler, not a crash.
    home = (cpp_extension.ROCM_HOME if rocm else cpp_extension.CUDA_HOME) or ""
    tool = Path(home, "bin", "hipcc" if rocm else "nvcc")
    try:
        return subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{tool}: {type(exc).__name__}"


def _source_files() -> list[Path]:
    """csrc/'s sources and headers: everything in it but the notes beside them."""
    return sorted(path for path in CSRC.glob("*") if path.is_file() and path.suffix != ".md")


def _build_digest(archs: list[str], rocm: bool) -> str:
    """What decides the built library besides torch and the archs: the sources, the flags and the device compiler.
    A library built from anything else is never loaded for this one."""
    digest = hashlib.sha256()
    for path in _source_files():
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(repr((EXTENSION_CFLAGS, _device_flags(archs, rocm), _device_compiler_version(rocm))).encode())
    return digest.hexdigest()[:12]


def device_archs() -> list[str]:
    """Normalised architectures of the visible GPUs (empty without a GPU torch)."""
    import torch

    from .arch import arch

    if not torch.cuda.is_available():
        return []
    return sorted({arch(torch.device("cuda", i)) for i in range(torch.cuda.device_count())})


def build_directory(archs: list[str], create: bool = True) -> Path:
    """Cached per torch version, GPU architectures, sources, flags and device compiler (_build_digest);
    W4A16_BUILD_DIR overrides the root."""
    import torch

    root = Path(os.environ.get("W4A16_BUILD_DIR", Path.home() / ".cache" / "w4a16" / "skinny"))
    rocm = bool(getattr(torch.version, "hip", None))
    tag = f"torch{torch.__version__}-{'-'.join(archs)}-{_build_digest(archs, rocm)}".replace("+", "_")
    path = root / tag
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def library_path(archs: list[str]) -> Path:
    """Where build() leaves the shared library for these architectures and the current sources."""
    return build_directory(archs, create=False) / f"{EXTENSION_NAME}.so"


def arch_flags(archs: list[str], rocm: bool) -> list[str]:
    """The device compiler's target flags. None on ROCm: there cpp_extension adds `--offload-arch` for each entry
    of PYTORCH_ROCM_ARCH, which build() sets to these archs. (Unset, torch takes every visible card, or in older
    releases every architecture torch was built for; it decides before it reads extra_cuda_cflags, so flags given
    there would come on top of its own.)"""
    if rocm:
        return []
    flags = []
    for a in archs:
        cc = a.removeprefix("sm_")
        flags.append(f"-gencode=arch=compute_{cc},code=sm_{cc}")
    return flags


def build(verbose: bool = False) -> Path:
    """Build (or reuse) the extension for the GPUs present and load it; returns the build directory."""
    import torch
    from torch.utils import cpp_extension

    archs = device_archs()
    if not archs:
        raise RuntimeError(
            "building the skinny kernel needs a CUDA or ROCm build of torch and a visible GPU; "
            f"this torch is {torch.__version__} (cuda available: {torch.cuda.is_available()})"
        )
    rocm = bool(getattr(torch.version, "hip", None))
    directory = build_directory(archs)
    # On ROCm, cpp_extension runs torch's hipify, which writes a converted copy of every source and header beside
    # it (skinny_kernel.hip, portability_hip.h, ...). Given csrc/ itself, that would write into the source tree
    # (read-only where the package is installed) and change the digest that names this build, so the library
    # would not be found where it was built. It gets a copy inside the build directory instead.
    sources = _staged_sources(directory) if rocm else CSRC
    # -Xptxas=-v only prints register counts; the code is the same, so it is not part of the digest.
    verbose_flags = ["-Xptxas=-v"] if verbose and not rocm else []
    with _environment({"PYTORCH_ROCM_ARCH": ";".join(archs)} if rocm else {}):
        cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(sources / s) for s in EXTENSION_SOURCES],
            extra_cflags=EXTENSION_CFLAGS,
            extra_cuda_cflags=_device_flags(archs, rocm) + verbose_flags,
            extra_include_paths=[str(sources)],
            build_directory=str(directory),
            is_python_module=False,
            verbose=verbose,
        )
    return directory


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """These environment variables set for the duration, then restored."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _staged_sources(directory: Path) -> Path:
    """A copy of csrc/'s sources in the build directory (the files the digest naming it was taken over)."""
    staged = directory / "csrc"
    staged.mkdir(exist_ok=True)
    for path in _source_files():
        shutil.copy2(path, staged / path.name)
    return staged


def main(argv: list[str] | None = None) -> int:
    """`nox -s build`: build and load the extension, then print what the device reports."""
    import torch

    try:
        directory = build(verbose="-v" in (sys.argv[1:] if argv is None else argv))
    except RuntimeError as exc:
        print(f"nox -s build: {exc}", file=sys.stderr)
        return 1
    for i in range(torch.cuda.device_count()):
        host = list(torch.ops.w4a16.skinny_limits(i))
        dev = list(torch.ops.w4a16.skinny_device_limits(i))
        print(f"device {i} {torch.cuda.get_device_name(i)}: max_rows, staging_elements host={host} device={dev}")
        if host != dev:
            print("the host table and the compiled device code disagree", file=sys.stderr)
            return 1
    print(f"built {EXTENSION_NAME} in {directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
