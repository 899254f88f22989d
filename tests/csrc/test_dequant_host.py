"""csrc/dequant.h compiled for the host and checked exhaustively against the layout reference (no GPU)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from w4a16_testing import require_tool

from w4a16.layout import pack_int4, unpack_int4
from w4a16.skinny_build import CSRC

HERE = Path(__file__).parent
OFFSET = {"f16": 1024, "bf16": 128}


def _host_compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++-19") or shutil.which("clang++")


@pytest.fixture(scope="module")
def dequant_run(tmp_path_factory) -> dict:
    compiler = _host_compiler()
    require_tool(compiler is not None, "a host C++ compiler (g++ or clang++) is needed for the dequant helpers")
    exe = tmp_path_factory.mktemp("dequant") / "dequant_host_check"
    subprocess.run([compiler, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{CSRC}",
                    str(HERE / "dequant_host_check.cpp"), "-o", str(exe)], check=True)
    # Every nibble value at every k offset of a word: row n has q[n, j] = (n + 5 j) % 16 ... and 16 row shifts.
    n = torch.arange(256).unsqueeze(1)
    j = torch.arange(32).unsqueeze(0)
    q = ((n + 5 * j + (n // 16) * j) % 16).to(torch.int32)
    words = pack_int4(q)
    text = "\n".join(f"{int(w) & 0xFFFFFFFF:08x}" for w in words.flatten().tolist())
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout
    return {"q": q, "lines": out.splitlines()}


def test_every_nibble_at_every_position_decodes_to_offset_plus_q(dequant_run):
    q = dequant_run["q"]
    word_lines = [line.split() for line in dequant_run["lines"] if not line.startswith(("qz", "chunk"))]
    assert len(word_lines) == q.numel() // 8
    expected = unpack_int4(pack_int4(q)).reshape(-1, 8).to(torch.float64)  # the layout's own k order
    assert torch.equal(expected, q.reshape(-1, 8).to(torch.float64))
    f16 = torch.tensor([[float(v) for v in parts[2:10]] for parts in word_lines], dtype=torch.float64)
    bf16 = torch.tensor([[float(v) for v in parts[11:19]] for parts in word_lines], dtype=torch.float64)
    assert torch.equal(f16, expected + OFFSET["f16"])
    assert torch.equal(bf16, expected + OFFSET["bf16"])
    f16_high = torch.tensor([[float(v) for v in parts[20:24]] for parts in word_lines], dtype=torch.float64)
    assert torch.equal(f16_high, expected[:, [2, 3, 6, 7]] + 64), "fp16_high_pair: 64 + q at k = 2, 3, 6, 7"
    # every (value, position) pair occurred
    seen = {(int(v), p) for row in expected.tolist() for p, v in enumerate(row)}
    assert seen == {(v, p) for v in range(16) for p in range(8)}


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_offset_removal_is_exact_for_every_q_and_zero_point(dequant_run, dtype):
    values = {}
    for line in dequant_run["lines"]:
        parts = line.split()
        if parts[0] == "qz" and parts[1] == dtype:
            values[(int(parts[2]), int(parts[3]))] = float(parts[4])
    assert len(values) == 256
    for (q, z), value in values.items():
        assert value == q - z, f"{dtype}: (offset + {q}) - raw_zero({z}) = {value}, want {q - z}"
    # symmetric uint4b8 is z = 8
    assert [values[(q, 8)] for q in range(16)] == [q - 8 for q in range(16)]


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_chunk_correction_matches_exact_dot(dtype, dequant_run):
    worst = {int(p[2]): float(p[3]) for p in (line.split() for line in dequant_run["lines"])
             if p[0] == "chunk" and p[1] == dtype}
    assert sorted(worst) == list(range(16))
    # 32 fp32 additions of partial sums up to (offset + 15) * 4 * 32 in magnitude: half an ulp each at most.
    bound = 32 * 0.5 * 2.0**-23 * (OFFSET[dtype] + 15) * 4 * 32
    for z, err in worst.items():
        assert err <= bound, f"{dtype} z={z}: remove_offset error {err} > {bound}"
