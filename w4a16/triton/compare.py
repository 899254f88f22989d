"""Quick comparison on the current GPU: the Triton GEMM (table pick) and its variants against torch bf16.

    python -m w4a16.triton.compare [--m 16,128,512,2048] [--shapes llama3.1-8b,qwen3-4b] [--json PATH]

Columns (µs per call, CUDA-graph replay over rotated weight copies, median): torch bf16 matmul on pre-dequantized weights; ours
(`triton_gemm`, the table's config); for a fused-kernel config, the same config with the portable dequantization
instead of inline PTX and in the other orientation (weight-left <-> x-left); dequant_blas; naive
dequantize-then-matmul.
A development aid; the bench session is the measurement of record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from .tune import SHAPES, _make_weights, _rotation, _timer


def main(argv: list[str] | None = None) -> int:
    from ..reference import dequantize
    from . import table_arch, triton_gemm
    from .configs import select_config
    from .dequant_blas import launch_dequant_blas
    from .gemm_kernel import launch_gemm

    parser = argparse.ArgumentParser(prog="python -m w4a16.triton.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="16,128,512,2048")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--json", type=str)
    args = parser.parse_args(argv)
    dtype = torch.bfloat16
    arch = table_arch(torch.device("cuda"))
    rows = []
    header = (f"{'shape':<20}{'M':>6}{'torch':>9}{'ours':>9}{'ratio':>7}{'portable':>10}{'flipped':>9}"
              f"{'dq_blas':>9}{'naive':>9}  config")
    lines = [header]
    for model in args.shapes.split(","):
        for name, n, k in SHAPES[model]:
            qws = _make_weights(n, k, dtype)
            copies = _rotation(n * k * 2)
            dense = [dequantize(qws[i % len(qws)], dtype) for i in range(copies)]
            for m in (int(v) for v in args.m.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                cfg = select_config(arch, m, n, k, qws[0].group_size)
                fused = cfg.kernel == "fused"  # the variant columns apply to the fused kernel only
                flipped = dataclasses.replace(cfg, w_left=not cfg.w_left)
                t = {
                    "torch": _timer(lambda i, x=x, qws=qws, dense=dense: x @ dense[i % len(dense)].t(), copies)(),
                    "ours": _timer(lambda i, x=x, qws=qws, dense=dense: triton_gemm(x, qws[i]), len(qws))(),
                    "portable": _timer(lambda i, x=x, qws=qws, cfg=cfg: launch_gemm(x, qws[i], None, cfg, ptx_dequant=False), len(qws))() if fused else float("nan"),
                    "dequant_blas": _timer(lambda i, x=x, qws=qws, dense=dense: launch_dequant_blas(x, qws[i], None), len(qws))(),
                    "naive": _timer(lambda i, x=x, qws=qws, dense=dense: x @ dequantize(qws[i], dtype).t(), len(qws))(),
                }
                t["flipped"] = float("nan")
                if fused:
                    try:
                        t["flipped"] = _timer(lambda i, x=x, qws=qws, cfg=flipped: launch_gemm(x, qws[i], None, cfg), len(qws))()
                    except Exception:  # the other orientation may not fit this tile (resources)
                        pass
                rows.append({"model": model, "layer": name, "n": n, "k": k, "m": m, "config": cfg.to_json(), **t})
                lines.append(f"{model + ' ' + name:<20}{m:>6}{t['torch']:>9.1f}{t['ours']:>9.1f}"
                             f"{t['ours'] / t['torch']:>7.2f}{t['portable']:>10.1f}{t['flipped']:>9.1f}"
                             f"{t['dequant_blas']:>9.1f}{t['naive']:>9.1f}  {tuple(cfg.to_json().values())}")
                print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    lines.append("")
    lines.append("dequantize kernel alone (µs; tile elements / warps), bf16 G=128:")
    from .dequant_blas import dequantize_into

    for model in args.shapes.split(","):
        for name, n, k in SHAPES[model]:
            qws = _make_weights(n, k, dtype)
            w = torch.empty(n, k, dtype=dtype, device="cuda")
            cells = []
            for tile, warps in ((16384, 8), (8192, 4), (4096, 4), (32768, 8)):
                us = _timer(lambda i, qws=qws, w=w, t=tile, nw=warps: dequantize_into(qws[i], w, t, nw), len(qws))()
                cells.append(f"{tile}/{warps}: {us:.1f} ({(n * k * 2.5 + n * k // 64) / us / 1e6:.2f} TB/s)")
            lines.append(f"{model + ' ' + name:<20}" + "  ".join(cells))
            print(lines[-1], flush=True)
    print("\n".join(["", f"arch {arch}, {torch.cuda.get_device_name()}, bf16 symmetric G=128, µs"] + lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
