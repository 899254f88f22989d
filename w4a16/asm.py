"""`python -m w4a16 asm`: compile a kernel ahead of time for a target, write its assembly, print a summary.

    python -m w4a16 asm --backend triton --arch gfx1151 --m 256 --n 4096 --k 4096 [--dtype bf16] [--group 128]
    python -m w4a16 asm --backend skinny --arch gfx1201

The triton backend compiles the Triton GEMM that the arch's tile table picks for (M, N, K, G): the fused kernel, or
on sm_90 the wgmma kernel where the table says so. The skinny backend compiles the C++ decode kernel's device code,
every instantiation at once, so --m, --n, --k, --dtype, --group and --symmetric/--asymmetric are the triton
backend's only and an error with it. No GPU is needed for either.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .triton.configs import SHIPPED_ARCHS

# The triton backend's options, with their defaults: None in the parser, so that giving one to skinny is an error.
TRITON_DEFAULTS = {"m": 256, "n": 4096, "k": 4096, "dtype": "fp16", "group": 128, "symmetric": True}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("triton", "skinny"), required=True)
    parser.add_argument("--arch", choices=SHIPPED_ARCHS, required=True)
    parser.add_argument("--m", type=int, help="rows of x (selects the M bucket; triton only; default 256)")
    parser.add_argument("--n", type=int, help="output features (triton only; default 4096)")
    parser.add_argument("--k", type=int, help="input features (triton only; default 4096)")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), help="triton only (default fp16)")
    parser.add_argument("--group", type=int, choices=(32, 64, 128), help="group size G (triton only; default 128)")
    sym = parser.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_true", default=None,
                     help="uint4b8, z = 8 (triton only; the default)")
    sym.add_argument("--asymmetric", dest="symmetric", action="store_false",
                     help="uint4 with zero points (triton only)")
    parser.add_argument("--out", type=Path, default=Path("asm-out"), help="directory for the assembly files")


def _run_triton(args: argparse.Namespace) -> int:
    # AOT compilation needs the real JIT function: the interpreter must be off before the kernel module loads.
    os.environ.pop("TRITON_INTERPRET", None)
    from .triton.asm import compile_config, summarize, summary_text, write_assembly
    from .triton.configs import select_config

    for name, value in (("m", args.m), ("n", args.n), ("k", args.k)):
        if value < 1:
            raise SystemExit(f"--{name} must be >= 1, got {value}")
    if args.k % args.group:
        raise SystemExit(f"--k={args.k} must be a multiple of --group={args.group}")
    config = select_config(args.arch, args.m, args.n, args.k, args.group)
    compiled = compile_config(args.arch, config, args.dtype, args.group, args.symmetric)
    stem = f"w4a16_gemm_{args.arch}_{args.dtype}_g{args.group}_m{args.m}_n{args.n}_k{args.k}"
    path = write_assembly(compiled, args.arch, args.out, stem)
    fields = config.to_json()
    print(f"config   {', '.join(f'{k}={v}' for k, v in fields.items())}")
    print(f"assembly {path}")
    print(summary_text(summarize(args.arch, compiled)))
    return 0


def _run_skinny(args: argparse.Namespace) -> int:
    from .skinny_build import ToolMissing, asm_summary

    try:
        asm_path, summary = asm_summary(args.arch, args.out)
    except ToolMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"assembly {asm_path}")
    print(summary)
    return 0


def run(args: argparse.Namespace) -> int:
    given = [name for name in TRITON_DEFAULTS if getattr(args, name) is not None]
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"--out {args.out}: cannot make that directory ({exc.strerror or exc})") from exc
    if args.backend == "skinny":
        if given:
            options = ", ".join("--symmetric/--asymmetric" if n == "symmetric" else f"--{n}" for n in given)
            raise SystemExit(f"{options}: the triton backend's options; --backend skinny compiles every "
                             "instantiation of the decode kernel and takes none of them")
        return _run_skinny(args)
    for name, default in TRITON_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return _run_triton(args)
