"""The Python side of the skinny kernel that runs anywhere: limits, availability, asm summary."""

from __future__ import annotations

import pytest
import torch
from w4a16_testing import random_activation, random_weight

from w4a16 import skinny


def test_limits_from_the_header_table():
    table = skinny.arch_table()
    assert {"sm_90", "gfx1151", "gfx1201", "generic"} <= set(table)
    for name, (rows, elements, hw_bytes) in table.items():
        assert rows >= 1 and elements % 32 == 0
        # staging_bytes() of portability.h, plus the tensor-core kernel's split-K partials where it may run:
        # kSplitKWarps (12) x rows x kSplitKPartialStride (36) floats, and kClusterRoundSlots (4) x rows x 32
        reserved = (12 * 36 + 4 * 32) * 4 * rows if name in ("sm_90", "generic") else 0
        assert 2 * elements + elements // 32 * 4 + reserved <= hw_bytes
    assert skinny.limits("gfx1151:sramecc-:xnack-") == skinny.limits("gfx1151")
    assert skinny.limits("sm_90a") == skinny.limits("sm_90")
    assert skinny.limits("sm_120") == skinny.limits("generic")[:2]
    with pytest.raises(ValueError, match="unrecognised architecture"):
        skinny.limits("not-an-arch")


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
