"""The Python side of the skinny kernel that runs anywhere: limits, availability, asm summary."""

from __future__ import annotations

import pytest
import torch
from w4a16_testing import random_activation, random_weight

from w4a16 import skinny, skinny_build


def test_limits_from_the_header_table():
    table = skinny.arch_table()
    assert {"sm_90", "gfx1151", "gfx1201", "generic"} <= set(table)
    # That each row fits its hardware is the header's static_assert, and test_device_compile reads the bytes
    # through C++ (limits_host_check.cpp); here, what the parser reads.
    for rows, elements, _ in table.values():
        assert rows >= 1 and elements % 32 == 0
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
