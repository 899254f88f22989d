"""Ahead-of-time compilation of the Triton GEMMs for any target, with a summary of what the compiler made.

No GPU is needed: `triton.compile(ASTSource(...), target=GPUTarget(...))` runs the whole pipeline down to PTX +
cubin (ptxas ships with triton) or AMDGCN + hsaco. The summary is what a reviewer checks first: the matrix
instructions (`v_wmma_*` on RDNA 3/4, `wgmma`/`mma.sync` on Hopper), registers, spills / scratch and shared memory.

This needs the real JIT function, so it must run in a process where TRITON_INTERPRET was unset when
`gemm_kernel` was imported (the CLI and the CI check below make sure of that).

    python -m w4a16.triton.asm --check-tables [--json PATH] [--jobs 2]   # every config the shipped tables select
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from ..layout import GROUP_SIZES
from .configs import SHIPPED_ARCHS, TileConfig, last_wave_configs, load_table

_DTYPES = {"fp16": "fp16", "bf16": "bf16"}
_CONSTEXPRS = ("GROUP_SIZE", "HAS_ZEROS", "HAS_BIAS", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "GROUP_M",
               "W_LEFT", "PTX_DEQUANT")


def target_for(arch: str):
    from triton.backends.compiler import GPUTarget

    if arch.startswith("gfx"):
        return GPUTarget("hip", arch, 32)  # RDNA: wave32
    match = re.fullmatch(r"sm_(\d+)", arch)
    if not match:
        raise ValueError(f"arch must be one of gfx1151, gfx1201, sm_90 (or another gfx*/sm_*), got {arch!r}")
    return GPUTarget("cuda", int(match.group(1)), 32)


def _kernel():
    from triton.runtime.jit import JITFunction

    from .gemm_kernel import w4a16_gemm_kernel

    if not isinstance(w4a16_gemm_kernel, JITFunction):
        raise RuntimeError("ahead-of-time compilation needs TRITON_INTERPRET unset when w4a16.triton.gemm_kernel "
                           "is first imported (this process imported it under the interpreter)")
    return w4a16_gemm_kernel


def compile_config(arch: str, config: TileConfig, dtype: str = "fp16", group_size: int = 128,
                   symmetric: bool = True, has_bias: bool = False):
    """Compile the kernel for `arch` with `config`; returns triton's CompiledKernel."""
    import triton
    from triton.compiler import ASTSource

    from .gemm_kernel import GROUP_M, ptx_dequant_for_arch

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be fp16 or bf16, got {dtype!r}")
    if config.kernel == "wgmma":
        return _compile_wgmma(arch, config, dtype, group_size, symmetric, has_bias)
    if group_size % config.block_k:
        raise ValueError(f"BLOCK_K={config.block_k} must divide group_size={group_size}")
    kernel = _kernel()
    signature = {
        "x_ptr": f"*{dtype}", "qw_ptr": "*i32", "scales_ptr": f"*{dtype}", "zeros_ptr": "*u8",
        "bias_ptr": f"*{dtype}", "out_ptr": "*fp32" if config.split_k > 1 else f"*{dtype}",
        "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32", "split_stride": "i32",
        **{name: "constexpr" for name in _CONSTEXPRS},
    }
    constexprs = {
        "GROUP_SIZE": group_size, "HAS_ZEROS": not symmetric, "HAS_BIAS": has_bias,
        "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
        "SPLIT_K": config.split_k, "GROUP_M": GROUP_M, "W_LEFT": config.w_left,
        "PTX_DEQUANT": ptx_dequant_for_arch(arch),  # the launcher's rule
    }
    # What the JIT infers for real calls: 16-byte aligned pointers; N, K and the row strides multiples of 16.
    names = list(signature)
    aligned = ("x_ptr", "qw_ptr", "scales_ptr", "zeros_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_xm",
               "stride_om")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target_for(arch),
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


def _compile_wgmma(arch: str, config: TileConfig, dtype: str, group_size: int, symmetric: bool, has_bias: bool):
    """The Hopper wgmma kernel (Gluon) for `arch` (sm_90 only) with `config`."""
    import torch
    import triton
    from triton.experimental.gluon._runtime import GluonASTSource

    from .wgmma_kernel import (
        BLOCK_K,
        producer_max_registers,
        w4a16_wgmma_kernel,
        w4a16_wgmma_ws_kernel,
        w_tile_layout,
        x_layout_for,
    )

    if arch != "sm_90":
        raise ValueError(f"the wgmma kernel compiles for sm_90 only, not {arch} (config {config})")
    # x comes by TMA (a descriptor argument) unless the config gathers it with cp.async (then no descriptor).
    x_tile = f"{dtype}[{config.block_m}, {BLOCK_K}]"
    layout = x_layout_for(config.block_m, {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    x_desc = "constexpr" if config.x_gather else f"tensordesc<{x_tile},{layout!r}>"
    pointers = {"scales_ptr": f"*{dtype}", "zeros_ptr": "*u8", "bias_ptr": f"*{dtype}",
                "out_ptr": "*fp32" if config.split_k > 1 else f"*{dtype}"}
    constexprs = {
        "GROUP_SIZE": group_size, "HAS_ZEROS": not symmetric, "HAS_BIAS": has_bias, "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n, "STAGES": config.num_stages, "SPLIT_K": config.split_k,
        "WARPS": config.num_warps,
    }
    options = {"num_warps": config.num_warps}
    if config.producer:
        kernel = w4a16_wgmma_ws_kernel
        signature = {"x_desc": x_desc,
                     "w_desc": f"tensordesc<i32[{config.block_n}, {BLOCK_K // 8}],{w_tile_layout(config)!r}>",
                     **pointers, "M": "i32", "N": "i32", "K": "i32", "stride_om": "i32", "split_stride": "i32"}
        options["maxnreg"] = producer_max_registers(config.block_m, config.num_warps, config.num_stages)
        constexprs["X_NATURAL"] = config.x_natural
    else:
        kernel = w4a16_wgmma_kernel
        signature = {"x_ptr": f"*{dtype}", "x_desc": x_desc, "qw_ptr": "*i32", **pointers,
                     "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32", "split_stride": "i32"}
        constexprs["X_GATHER"] = config.x_gather
        if config.x_gather:
            constexprs["x_desc"] = None
    signature.update({name: "constexpr" for name in constexprs if name != "x_desc"})
    names = list(signature)
    aligned = ("x_ptr", "qw_ptr", "scales_ptr", "zeros_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_xm",
               "stride_om")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned if a in names}
    source = GluonASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target_for(arch), options=options)


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _ptxas(arch: str) -> str:
    """The ptxas triton itself uses for `arch` (releases bundle more than one)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(int(arch[3:])).path


def _wgmma_serialized(arch: str, ptx: str) -> list[str]:
    """The codes of ptxas's notes that it serialized the wgmmas (empty: it did not), which silently costs the MMA
    overlap. C7513: an operand or accumulator register is redefined while an earlier wgmma may still read it;
    C7511: too few registers for the wgmma pipeline (e.g. 16 warps with 128-token tiles); C7515: non-wgmma
    instructions define accumulator registers inside the pipeline stage."""
    if "wgmma.mma_async" not in ptx:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        report = subprocess.run([_ptxas(arch), f"-arch={arch}a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                                check=True, capture_output=True, text=True).stderr
    return sorted(set(re.findall(r"\((C75\d\d)\)[^\n]*wgmma[^\n]*serialized", report)))


def summarize(arch: str, compiled) -> dict:
    """Matrix instructions, registers, spills, scratch and shared memory of a compiled kernel."""
    info: dict = {"arch": arch, "shared_bytes": int(compiled.metadata.shared)}
    if arch.startswith("gfx"):
        text = compiled.asm["amdgcn"]

        def meta(key: str) -> int:
            found = re.search(rf"\.{key}:\s+(\d+)", text)
            return int(found.group(1)) if found else -1

        info.update(kind="amdgcn", vgprs=meta("vgpr_count"), sgprs=meta("sgpr_count"),
                    spills=max(meta("vgpr_spill_count"), 0) + max(meta("sgpr_spill_count"), 0),
                    scratch_bytes=meta("private_segment_fixed_size"),
                    # Triton's AMD kernels take their LDS dynamically at launch (the code object's static
                    # .group_segment_fixed_size reads 0): the compiler's own figure is what a launch allocates.
                    lds_bytes=info["shared_bytes"])
        matrix = re.findall(r"\b(v_wmma_\w+)", text)
    else:
        text = compiled.asm["ptx"]
        matrix = re.findall(r"\b(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", text)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], check=True,
                                   capture_output=True, text=True).stdout
        fields = dict(re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", usage))
        # A warp-specialized kernel launches with `registers` per thread, then moves warp groups up or down.
        setmaxnreg = sorted({int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", text)})
        info.update(kind="ptx", registers=int(fields.get("REG", -1)), stack_bytes=int(fields.get("STACK", -1)),
                    local_bytes=int(fields.get("LOCAL", -1)),
                    spills=int(fields.get("STACK", 0)) + int(fields.get("LOCAL", 0)),
                    wgmma_serialized=_wgmma_serialized(arch, text), setmaxnreg=setmaxnreg)
    counts: dict[str, int] = {}
    for name in matrix:
        counts[name] = counts.get(name, 0) + 1
    info["matrix_instructions"] = counts
    return info


def summary_text(info: dict) -> str:
    mma = ", ".join(f"{k} x{v}" for k, v in sorted(info["matrix_instructions"].items())) or "NONE"
    if info["kind"] == "amdgcn":
        regs = f"VGPRs {info['vgprs']}, SGPRs {info['sgprs']}, spills {info['spills']}, " \
               f"scratch {info['scratch_bytes']} B, LDS {info['lds_bytes']} B"
    else:
        serialized = info["wgmma_serialized"]
        registers = f"registers {info['registers']}"
        if info.get("setmaxnreg"):
            registers += f" at launch, then {min(info['setmaxnreg'])}..{max(info['setmaxnreg'])} per warp group"
        regs = f"{registers}, spills/stack {info['stack_bytes']} B, local {info['local_bytes']} B, " \
               f"shared {info['shared_bytes']} B" + (f", wgmma SERIALIZED by ptxas ({', '.join(serialized)})"
                                                     if serialized else "")
    return f"matrix instructions: {mma}\n{regs}"


def write_assembly(compiled, arch: str, out_dir: Path, stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = "amdgcn" if arch.startswith("gfx") else "ptx"
    path = out_dir / f"{stem}.{'s' if kind == 'amdgcn' else 'ptx'}"
    path.write_text(compiled.asm[kind])
    (out_dir / f"{stem}.ttgir").write_text(compiled.asm["ttgir"])
    if kind == "ptx":
        cubin = out_dir / f"{stem}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout
        (out_dir / f"{stem}.sass").write_text(sass)
    return path


def table_cases(archs=SHIPPED_ARCHS, dtypes=("fp16", "bf16")) -> list[dict]:
    """Every distinct (arch, dtype, config, group size) the shipped tables can select, BLOCK_K clamped per G.

    A fused-kernel config is compiled once per clamped config, with the largest group size that selects it (G sets
    only its BLOCK_K). A wgmma config is compiled at every G: its tile is fixed, but how a lane applies the scales
    of G = 32 and 64 changes its code and registers; a producer-form config's launches may run the rows of a last wave
    with smaller token tiles (configs.last_wave_configs), so those configs are compiled as well. fp16 cases compile
    the symmetric kernel and bf16 cases the asymmetric one with bias, so both code paths are covered."""
    cases = []
    for arch in archs:
        fused: dict[TileConfig, int] = {}  # a clamped config -> the largest G that selects it
        wgmma: dict[tuple[TileConfig, int], None] = {}
        for config in load_table(arch).all_configs():
            if config.kernel == "wgmma":
                wgmma.update(dict.fromkeys((config, g) for g in GROUP_SIZES))
                for last_wave in last_wave_configs(config):
                    wgmma.update(dict.fromkeys((last_wave, g) for g in GROUP_SIZES))
            else:
                for g in GROUP_SIZES:
                    fused[config.for_group(g)] = max(g, fused.get(config.for_group(g), 0))
        for config, g in [*fused.items(), *wgmma]:
            for dtype in dtypes:
                cases.append({"arch": arch, "dtype": dtype, "config": config.to_json(), "group_size": g,
                              "symmetric": dtype == "fp16", "has_bias": dtype == "bf16"})
    return cases


def _compile_case(case: dict) -> dict:
    config = TileConfig.from_json(case["config"], {})
    try:
        compiled = compile_config(case["arch"], config, case["dtype"], case["group_size"], case["symmetric"],
                                  case["has_bias"])
        return {**case, **summarize(case["arch"], compiled)}
    except Exception as exc:  # reported per case; the caller decides (CI: a failure)
        return {**case, "error": f"{type(exc).__name__}: {exc}"[:2000]}


def check_tables(jobs: int = 2, archs=SHIPPED_ARCHS) -> list[dict]:
    cases = table_cases(archs)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        return list(pool.map(_compile_case, cases))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m w4a16.triton.asm", description=__doc__.splitlines()[0])
    parser.add_argument("--check-tables", action="store_true", required=True,
                        help="compile every config the shipped tables can select")
    parser.add_argument("--json", type=Path, help="write the per-case summaries here")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--arch", action="append", help="limit to these archs (repeatable)")
    args = parser.parse_args(argv)
    results = check_tables(args.jobs, tuple(args.arch) if args.arch else SHIPPED_ARCHS)
    for r in results:
        cfg = tuple(r["config"].values())
        status = r.get("error") or summary_text(r).replace("\n", "; ")
        print(f"{r['arch']:8} {r['dtype']} G={r['group_size']:<3} {cfg}: {status}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
