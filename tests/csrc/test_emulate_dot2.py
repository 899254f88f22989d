"""The AMD dot2 kernel (csrc/skinny_kernel.cuh) run on the CPU by tests/csrc/emulate_dot2.cpp, against the reference.

No AMD GPU is here, and the kernel is NVIDIA's no longer: this is where its indexing, staging, row split, chunk loop,
offset removal, wave reduction and epilogue run. Its arithmetic is the kernel's own but for dot2 (portability.h's
emulation: the products summed in double, rounded to fp32 once) and the lane exchange. Every instantiation the
HIP build compiles (fp16/bf16 x G x sym/asym x M = 1..5), and the shapes where the row split and the chunk loop
have edges. Outputs start as NaN, so one the kernel does not write fails; blocks run last first, so one that writes
past its rows overwrites a finished neighbour's outputs and fails; shared memory starts as NaN too, and a
block that writes past the LDS its launcher allocates fails; every operand ends at an inaccessible page, so a read or
write past its end fails. The epilogue's rounding (from_float) is also checked alone, against torch's casts.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from w4a16_testing import assert_matches_reference, random_activation, random_weight, require_tool

from w4a16 import skinny
from w4a16.skinny_build import CSRC

HERE = Path(__file__).parent
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MAX_ROWS, STAGING = skinny.limits("gfx1151")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> Path:
    compiler = shutil.which("clang++-19")
    require_tool(compiler is not None, "clang++-19 compiles the emulation (_Float16 and __bf16 on the host)")
    exe = tmp_path_factory.mktemp("emulate") / "emulate_dot2"
    subprocess.run([compiler, "-std=c++20", "-O1", "-Wall", "-Werror", "-DW4A16_EMULATION", f"-I{CSRC}",
                    str(HERE / "emulate_dot2.cpp"), "-o", str(exe), "-lpthread"], check=True)
    return exe


def run_dot2_kernel(emulator: Path, workdir: Path, dtype: str, group: int, symmetric: bool, m: int, n: int, k: int,
                    blocks: int, with_bias: bool, seed: int) -> None:
    """One emulated launch on fresh random operands, checked against the reference."""
    generator = torch.Generator().manual_seed(seed)
    qw = random_weight(n, k, group, symmetric, DTYPES[dtype], generator=generator)
    x = random_activation(m, k, DTYPES[dtype], generator=generator)
    bias = torch.randn(n, generator=generator).to(DTYPES[dtype]) if with_bias else None
    for name, tensor in (("x", x), ("qweight", qw.qweight), ("scales", qw.scales), ("zeros", qw.zeros),
                         ("bias", bias)):
        if tensor is not None:
            tensor.contiguous().view(torch.uint8).numpy().tofile(workdir / f"{name}.bin")
    run = subprocess.run([str(emulator), str(workdir), dtype, str(group), str(int(symmetric)), str(m), str(n),
                          str(k), str(blocks), str(int(with_bias))], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = torch.from_numpy(np.fromfile(workdir / "out.bin", dtype=np.int16)).view(DTYPES[dtype]).reshape(m, n)
    assert_matches_reference(out, x, qw, bias)


@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_every_instantiation(emulator, tmp_path, dtype, group, symmetric, m):
    # 37 rows over 2 blocks of 16 (or 12) waves: one or two rows a wave, an odd last pair; K = 4224 is 132 chunks,
    # two full steps of the chunk loop (32 lanes x 2) and four chunks past them.
    run_dot2_kernel(emulator, tmp_path, dtype, group, symmetric, m, n=37, k=4224, blocks=2, with_bias=m % 2 == 1,
                    seed=1000 * group + 10 * m + symmetric)


@pytest.mark.parametrize(("dtype", "group", "symmetric", "m", "n", "k", "blocks"), [
    ("bf16", 128, False, MAX_ROWS, 19, STAGING // MAX_ROWS, 1),  # x at the staging budget
    ("fp16", 32, False, 3, 1, 64, 3),  # one row: all waves but one have none
    ("bf16", 64, True, 2, 300, 128, 1),  # many rows per wave, K of two chunks
    ("fp16", 128, True, 3, 97, 8192, 4),  # long K: four steps of the chunk loop
    ("fp16", 64, False, 2, 45, 3328, 2),  # 104 chunks: the last step's second chunk is past K on lanes 8..31
])
def test_row_split_and_chunk_loop_edges(emulator, tmp_path, dtype, group, symmetric, m, n, k, blocks):
    run_dot2_kernel(emulator, tmp_path, dtype, group, symmetric, m, n, k, blocks, with_bias=True, seed=n * k + m)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_epilogue_rounds_like_torch(emulator, tmp_path, dtype):
    """from_float, the epilogue's cast of the fp32 sum, gives torch's cast bit for bit: the nearest value, ties to
    even, overflow to infinity, NaN kept. Checked on random values, on the ties halfway between random 16-bit values
    and the next ones up (exact in fp32), and on the fp32 values just either side of those ties."""
    torch_dtype = DTYPES[dtype]
    generator = torch.Generator().manual_seed(7 if dtype == "fp16" else 8)
    # Random 16-bit patterns and the next pattern up (both signs, subnormals too; the bound leaves room for + 1).
    low_bits = torch.randint(-2**15, 2**15 - 1, (4096,), generator=generator, dtype=torch.int16)
    low, high = low_bits.view(torch_dtype).float(), (low_bits + 1).view(torch_dtype).float()
    both_finite = torch.isfinite(low) & torch.isfinite(high)
    ties = ((low + high) / 2)[both_finite]
    largest = torch.finfo(torch_dtype).max
    values = torch.cat([
        ties, torch.nextafter(ties, torch.tensor(float("inf"))), torch.nextafter(ties, torch.tensor(-float("inf"))),
        torch.randn(4096, generator=generator) * 2.0 ** torch.randint(-30, 20, (4096,), generator=generator),
        torch.tensor([largest * 1.01, -largest * 1.01, float("inf"), -float("inf"), float("nan")]),
    ])
    values = values[values != 0]
    values.numpy().tofile(tmp_path / "values.bin")
    run = subprocess.run([str(emulator), "round", str(tmp_path), dtype, str(values.numel())], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    got = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype=np.int16)).view(torch_dtype)
    want = values.to(torch_dtype)
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    wrong = (~same).nonzero().flatten()[:5].tolist()
    assert same.all(), (f"{int((~same).sum())} of {values.numel()} casts differ from torch's; first: "
                        f"{[(values[i].item(), got[i].item(), want[i].item()) for i in wrong]}")
