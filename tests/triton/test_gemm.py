"""The fused Triton GEMM and the dequant_blas route against the fp32 reference.

On CPU the kernels run in the Triton interpreter (fp16 only: the interpreter computes bf16 wrong); on a GPU the
same cases run for real in fp16 and bf16, plus every model shape of the bench catalogue at M in {6, 16, 128, 2048}.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from w4a16_testing import assert_matches_reference, nan_empty, random_activation, random_weight, require_tool

import w4a16
from w4a16.triton import dequant_blas_gemm, triton_gemm, unavailable_reason
from w4a16.triton.configs import TileConfig, select_config

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]


@pytest.fixture(autouse=True)
def _kernels_available():
    require_tool(unavailable_reason(torch.device(DEVICE)) is None, str(unavailable_reason(torch.device(DEVICE))))


def _poisoned(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)


def _bias(n, dtype, generator):
    return torch.randn(n, generator=generator).to(dtype=dtype, device=DEVICE)


# (M, N, K): remainders in M and N against 16/32/64-wide tiles; K spans several K tiles.
ODD_SHAPES = [(1, 40, 256), (17, 72, 384), (33, 130, 512), (6, 200, 256)]
# Both orientations, split-K on and off, BLOCK_K below / at the group size (clamped by for_group).
KERNEL_CONFIGS = [
    TileConfig(16, 64, 128, 4, 2, 1, True),
    TileConfig(32, 64, 64, 4, 2, 2, False),
    TileConfig(16, 32, 32, 4, 1, 3, True),
    TileConfig(64, 128, 128, 4, 2, 1, False),
]
CASES = [
    (shape, cfg, g, sym)
    for i, (cfg, g, sym) in enumerate(itertools.product(KERNEL_CONFIGS, (32, 64, 128), (True, False)))
    for shape in [ODD_SHAPES[i % len(ODD_SHAPES)]]
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "config", "group_size", "symmetric"), CASES,
                         ids=[f"{s}-{c.block_m}x{c.block_n}x{c.block_k}s{c.split_k}{'W' if c.w_left else 'X'}"
                              f"-g{g}-{'sym' if y else 'asym'}" for s, c, g, y in CASES])
def test_tiles(shape, config, group_size, symmetric, dtype, generator):
    from w4a16.triton.gemm_kernel import launch_gemm

    m, n, k = shape
    qw = random_weight(n, k, group_size, symmetric, dtype, DEVICE, generator)
    x = random_activation(m, k, dtype, DEVICE, generator)
    bias = _bias(n, dtype, generator) if (group_size == 64) != symmetric else None
    out = launch_gemm(x, qw, bias, config.for_group(group_size), out=_poisoned(m, n, dtype))
    assert_matches_reference(out, x, qw, bias)


@pytest.mark.skipif(not ON_GPU, reason="on CPU the interpreter always runs the portable integer dequantization")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [32, 128])
def test_the_portable_dequantization_on_the_gpu(group_size, dtype, generator):
    """AMD runs the portable integer dequantization, which an NVIDIA GPU otherwise never takes (ptx_dequant_for
    picks the inline PTX from sm_90): run it here in both dtypes, where the interpreter cannot check bf16."""
    from w4a16.triton.gemm_kernel import launch_gemm

    m, n, k = 33, 130, 512
    qw = random_weight(n, k, group_size, False, dtype, DEVICE, generator)
    x = random_activation(m, k, dtype, DEVICE, generator)
    bias = _bias(n, dtype, generator)
    for config in KERNEL_CONFIGS:
        out = launch_gemm(x, qw, bias, config.for_group(group_size), ptx_dequant=False, out=_poisoned(m, n, dtype))
        assert_matches_reference(out, x, qw, bias)


@pytest.mark.parametrize("w_left", [True, False], ids=["weight-left", "x-left"])
def test_a_long_k_in_narrow_k_tiles_keeps_an_fp32_accumulator(w_left, generator):
    """128 K tiles of 32: an accumulator rounded to 16 bits between tiles drifts by several ulp over them, which
    the tolerance rule sees at this length whatever its floor."""
    from w4a16.triton.gemm_kernel import launch_gemm

    m, n, k = 3, 32, 4096
    qw = random_weight(n, k, 32, False, torch.float16, DEVICE, generator)
    x = random_activation(m, k, torch.float16, DEVICE, generator)
    out = launch_gemm(x, qw, None, TileConfig(16, 32, 32, 4, 1, 1, w_left), out=_poisoned(m, n, torch.float16))
    assert_matches_reference(out, x, qw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_with_an_empty_split(dtype, generator, monkeypatch):
    """K = 128 in BLOCK_K = 32 tiles over 3 splits is 2 + 2 + 0 tiles: the empty split must still write its slice
    of the split-K workspace, which is not initialised (the allocator is primed with NaN of that size first)."""
    from w4a16.triton.gemm_kernel import launch_gemm

    m, n, k = 5, 48, 128
    qw = random_weight(n, k, 32, False, dtype, DEVICE, generator)
    x = random_activation(m, k, dtype, DEVICE, generator)
    bias = _bias(n, dtype, generator)
    monkeypatch.setattr(torch, "empty", nan_empty)  # the workspace starts as NaN, whatever the allocator reuses
    out = launch_gemm(x, qw, bias, TileConfig(16, 32, 32, 4, 1, 3, True), out=_poisoned(m, n, dtype))
    assert_matches_reference(out, x, qw, bias)


def test_more_m_tiles_than_one_group_of_the_programs_order(generator):
    """Programs walk the output in groups of GROUP_M tiles along M: with 10 M tiles the second group is a partial one
    of 2, whose tiles must still each be computed once."""
    from w4a16.triton.gemm_kernel import GROUP_M, launch_gemm

    config = TileConfig(16, 32, 32, 4, 1, 1, False)
    m, n, k = (GROUP_M + 1) * config.block_m + 3, 72, 64
    qw = random_weight(n, k, 32, False, torch.float16, DEVICE, generator)
    x = random_activation(m, k, torch.float16, DEVICE, generator)
    out = launch_gemm(x, qw, None, config, out=_poisoned(m, n, torch.float16))
    assert_matches_reference(out, x, qw)


@pytest.mark.parametrize("config", [TileConfig(16, 32, 32, 4, 1, 1, True), TileConfig(16, 32, 32, 4, 1, 1, False),
                                    TileConfig(16, 32, 32, 4, 1, 2, False)],
                         ids=["weight-left", "x-left", "x-left-split2"])
def test_rows_of_x_and_out_at_their_own_strides(config, generator):
    """triton_gemm keeps a row-strided x (see _validate), and `out` may be a view with rows apart: both kernels
    must step rows by the strides they are given, and leave what lies between out's rows alone."""
    from w4a16.triton.gemm_kernel import launch_gemm

    m, n, k = 19, 40, 128
    qw = random_weight(n, k, 32, False, torch.float16, DEVICE, generator)
    x = random_activation(m, 2 * k, torch.float16, DEVICE, generator)[:, :k]
    bias = _bias(n, torch.float16, generator)
    wide = _poisoned(m, n + 24, torch.float16)
    out = launch_gemm(x, qw, bias, config, out=wide[:, :n])
    assert_matches_reference(out, x, qw, bias)
    assert wide[:, n:].isnan().all(), "written past N"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_keeps_its_partial_sums_in_fp32(dtype, generator):
    """Two splits whose partial sums nearly cancel: the second half of K repeats the first with negated scales and
    x nudged by a 64th, so each partial is some 64 times the result. Partials rounded to 16 bits before they are
    added would err by a fraction of their own ulp, far past the tolerance on the small result."""
    from w4a16.triton.gemm_kernel import launch_gemm

    m, n, k = 5, 40, 256
    half = random_weight(n, k // 2, 32, False, dtype, DEVICE, generator)
    qw = w4a16.QuantizedWeight(torch.cat([half.qweight] * 2, 1), torch.cat([half.scales, -half.scales], 1),
                               torch.cat([half.zeros] * 2, 1), 32)
    first = random_activation(m, k // 2, dtype, DEVICE, generator)
    x = torch.cat([first, first + random_activation(m, k // 2, dtype, DEVICE, generator) / 64], 1)
    out = launch_gemm(x, qw, None, TileConfig(16, 32, 32, 4, 1, 2, True), out=_poisoned(m, n, dtype))
    assert_matches_reference(out, x, qw)


def test_offsets_past_32_bits_drop_the_split_and_the_row_stride(generator, monkeypatch):
    """The kernels index the split-K slices [split, M, N] and x's rows (row * stride) in 32 bits, beyond the
    M * K, M * N and N * K that index_limit_reason bounds: triton_gemm must run such a call unsplit and on a
    contiguous copy of x. The 32-bit limit is lowered here so that small shapes reach it."""
    import w4a16.triton as triton_route
    from w4a16.triton import configs, gemm_kernel

    m, n, k = 64, 40, 256  # M * K = 16384, N * K = 10240, M * N = 2560: within the lowered limit
    monkeypatch.setattr(triton_route, "_INT32_MAX", m * k)
    monkeypatch.setattr(configs, "INT32_MAX", m * k)
    select = configs.select_config
    monkeypatch.setattr(configs, "load_table", lambda arch: configs.Table(
        "test", {}, ((16, (("any", TileConfig(32, 64, 32, 4, 2, 16, False)),)),), {}, None))
    assert select("test", m, n, k, 64).split_k == 1, "8 splits (one per K tile) x M x N = 20480 is past the limit"
    assert select("test", m, n // 8, k, 64).split_k == 8, "one split per K tile, within the limit"
    launched, slices = [], []
    launch, empty = gemm_kernel.launch_gemm, torch.empty
    monkeypatch.setattr(gemm_kernel, "launch_gemm",
                        lambda x2d, qw, bias, config: launched.append(x2d) or launch(x2d, qw, bias, config))
    monkeypatch.setattr(torch, "empty", lambda *shape, **kw: slices.append(shape) or empty(*shape, **kw))
    qw = random_weight(n, k, 64, False, torch.float16, DEVICE, generator)
    rows = random_activation(m, 4 * k, torch.float16, DEVICE, generator)
    x = rows[:, :k]  # row stride 4K: (M - 1) * 4K + K = 64768 past the limit
    assert_matches_reference(triton_gemm(x, qw), x, qw)
    (x2d,) = launched
    assert x2d.is_contiguous()
    assert not [s for s in slices if s and isinstance(s[0], tuple) and len(s[0]) == 3], "no split-K workspace"
    # launch_gemm applies the same limit to a config given directly (the tuner launches its candidates so).
    x = x.contiguous()
    assert_matches_reference(launch(x, qw, None, TileConfig(32, 64, 32, 4, 2, 16, False)), x, qw)
    assert not [s for s in slices if s and isinstance(s[0], tuple) and len(s[0]) == 3], "no split-K workspace"


def test_a_row_stride_is_kept_while_the_last_row_ends_within_32_bits(generator, monkeypatch):
    """x is copied only where (M - 1) * stride + K, the end of its last row, is past the 32-bit limit."""
    import w4a16.triton as tri

    m, k, stride = 4, 128, 512
    last = (m - 1) * stride + k  # 1664: M*K, M*N and N*K below it
    qw = random_weight(8, k, 128, True, torch.float16, DEVICE, generator)
    x = random_activation(m, stride, torch.float16, DEVICE, generator)[:, :k]
    monkeypatch.setattr(tri, "_INT32_MAX", last)
    kept, _ = tri._validate(x, qw, None, "triton")
    assert kept.stride() == (stride, 1) and kept.data_ptr() == x.data_ptr()
    monkeypatch.setattr(tri, "_INT32_MAX", last - 1)
    copied, _ = tri._validate(x, qw, None, "triton")
    assert copied.is_contiguous() and torch.equal(copied, x)


def test_a_config_whose_block_k_does_not_divide_the_group_is_refused(generator):
    """One scale per K tile: a BLOCK_K past G would apply one group's scale to the next (select_config clamps
    BLOCK_K; a config passed to launch_gemm directly must not bypass that)."""
    from w4a16.triton.gemm_kernel import launch_gemm

    qw = random_weight(32, 96, 32, True, torch.float16, DEVICE, generator)
    x = random_activation(3, 96, torch.float16, DEVICE, generator)
    with pytest.raises(ValueError, match="config.block_k=64 must divide group_size=32"):
        launch_gemm(x, qw, None, TileConfig(16, 32, 64, 4, 1, 1, False))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("group_size", "symmetric"), [(32, False), (64, True), (128, False)])
def test_dequant_blas(group_size, symmetric, dtype, generator):
    from w4a16.triton.dequant_blas import dequantize_into

    m, n, k = 5, 136, 384
    qw = random_weight(n, k, group_size, symmetric, dtype, DEVICE, generator)
    w = dequantize_into(qw, torch.full((n, k), float("nan"), dtype=dtype, device=DEVICE))
    torch.testing.assert_close(w, w4a16.dequantize(qw, dtype), rtol=0, atol=0)  # one rounding, same as the spec
    x = random_activation(m, k, dtype, DEVICE, generator)
    bias = _bias(n, dtype, generator)
    assert_matches_reference(dequant_blas_gemm(x, qw, bias), x, qw, bias)


def test_dequant_blas_keeps_its_shared_workspace_out_of_autograd(generator):
    """The workspace is shared by every layer: a graph holding it would hand a later backward another layer's
    weight. The route's result holds no graph; w4a16.gemm's gradient is its own formula, right after the workspace
    was overwritten."""
    dtype = torch.float16
    first, second = (random_weight(32, 128, 64, False, dtype, DEVICE, generator) for _ in range(2))
    x = random_activation(3, 128, dtype, DEVICE, generator).requires_grad_()
    assert dequant_blas_gemm(x, first).grad_fn is None
    y = w4a16.gemm(x, first, backend="dequant_blas")
    w4a16.gemm(x.detach(), second, backend="dequant_blas")  # overwrites the workspace
    y.float().sum().backward()
    expected = torch.ones(3, 32) @ w4a16.dequantize(first, torch.float32).cpu()
    torch.testing.assert_close(x.grad.float().cpu(), expected, rtol=1e-3, atol=1e-3)


def test_dequant_blas_refuses_k_tiles_past_the_grid_limit(generator):
    from w4a16.triton.configs import GRID_YZ_MAX

    k = 32 * (GRID_YZ_MAX + 1)  # one 32-wide K tile more than a grid's y extent holds
    qw = random_weight(1, k, 32, True, torch.float16, DEVICE, generator)
    x = random_activation(1, k, torch.float16, DEVICE, generator)
    from w4a16.triton import dequant_blas

    before = {key: flat.numel() for key, flat in dequant_blas._WORKSPACES.items()}
    with pytest.raises(ValueError, match=rf"K={k} with group_size=32 makes {GRID_YZ_MAX + 1} K tiles of 32"):
        dequant_blas_gemm(x, qw)
    assert {key: flat.numel() for key, flat in dequant_blas._WORKSPACES.items()} == before, "no workspace for it"


def test_dequant_blas_takes_k_tiles_up_to_the_grid_limit(generator, monkeypatch):
    """A K tile past a grid's y extent is refused (above); one at the extent still runs. The extent is lowered here
    so that a small K reaches it."""
    from w4a16.triton import dequant_blas

    m, n, k = 3, 24, 256
    monkeypatch.setattr(dequant_blas, "GRID_YZ_MAX", k // 32)
    qw = random_weight(n, k, 32, False, torch.float16, DEVICE, generator)
    x = random_activation(m, k, torch.float16, DEVICE, generator)
    assert_matches_reference(dequant_blas_gemm(x, qw), x, qw)


def test_dequant_blas_workspace_grows_to_the_largest_weight_and_is_reused(generator):
    """One workspace per device and dtype: a larger weight replaces it with a larger one, a smaller weight
    dequantizes into the front of it, and another dtype has a workspace of its own."""
    from w4a16.triton import dequant_blas

    dtype = torch.float16
    small = random_weight(24, 128, 32, False, dtype, DEVICE, generator)
    large = random_weight(40, 256, 64, True, dtype, DEVICE, generator)
    dequant_blas.release_workspaces()
    used = []
    for qw in (small, large, small):
        x = random_activation(3, qw.k, dtype, DEVICE, generator)
        assert_matches_reference(dequant_blas_gemm(x, qw), x, qw)
        used.append(dequant_blas._WORKSPACES[(x.device, dtype)])
    assert [flat.numel() for flat in used] == [small.n * small.k, large.n * large.k, large.n * large.k]
    assert used[2] is used[1], "the larger workspace is reused, not replaced"
    other = dequant_blas.workspace(x.device, torch.bfloat16, small.n, small.k)
    assert other.dtype == torch.bfloat16 and other.shape == (small.n, small.k)


@pytest.mark.parametrize("route", [triton_gemm, dequant_blas_gemm], ids=["triton", "dequant_blas"])
def test_public_entry_points(route, generator):
    """Table-selected config, non-contiguous x and bias (made contiguous), M = 0."""
    dtype = torch.float16
    qw = random_weight(48, 256, 128, False, dtype, DEVICE, generator)
    x = random_activation(256, 9, dtype, DEVICE, generator).t()  # [9, 256], column-major
    bias = _bias(96, dtype, generator)[::2]
    assert not x.is_contiguous() and not bias.is_contiguous()
    assert_matches_reference(route(x, qw, bias), x, qw, bias)
    assert route(x[:0], qw).shape == (0, 48)


def test_errors(generator):
    qw = random_weight(16, 128, 128, True, torch.float16, DEVICE, generator)
    x = random_activation(4, 128, torch.float16, DEVICE, generator)
    with pytest.raises(ValueError, match="2-D"):
        triton_gemm(x[None], qw)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        triton_gemm(x.float(), qw)
    with pytest.raises(TypeError, match="scales dtype torch.bfloat16 must equal x's dtype torch.float16"):
        triton_gemm(x, qw.to(dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="K=128"):
        triton_gemm(x[:, :64], qw)
    with pytest.raises(ValueError, match="bias must be a tensor of shape"):
        triton_gemm(x, qw, torch.zeros(3, dtype=torch.float16, device=DEVICE))


def test_calls_past_32_bit_offsets_are_refused(generator, monkeypatch):
    """The fused kernel indexes x, y and W in 32 bits, dequant_blas only W: each route refuses a call past its own
    limits (lowered here so that small shapes reach them) and takes the rest."""
    import w4a16.triton as triton_route

    m, n, k = 8, 4, 128  # M * K = 1024, N * K = 512, M * N = 32
    qw = random_weight(n, k, 32, False, torch.float16, DEVICE, generator)
    x = random_activation(m, k, torch.float16, DEVICE, generator)
    monkeypatch.setattr(triton_route, "_INT32_MAX", m * k - 1)
    with pytest.raises(ValueError, match=r"triton_gemm: M\*K=1024 exceeds the kernel's 32-bit indexing"):
        triton_gemm(x, qw)
    assert_matches_reference(dequant_blas_gemm(x, qw), x, qw)
    monkeypatch.setattr(triton_route, "_INT32_MAX", n * k - 1)
    with pytest.raises(ValueError, match=r"dequant_blas_gemm: N\*K=512 exceeds the kernel's 32-bit indexing"):
        dequant_blas_gemm(x, qw)


def test_triton_gemm_launches_the_tables_config_for_the_weights_shape(generator, monkeypatch):
    """triton_gemm selects by the weight's (N, K) and group size: a tall weight (K >= 2N) gets the table's "tall"
    rule with BLOCK_K clamped to G, a wide one the "any" rule."""
    from w4a16.triton import configs, gemm_kernel

    tall, wide = TileConfig(16, 32, 64, 4, 1, 2, True), TileConfig(32, 64, 32, 4, 1, 1, False)
    monkeypatch.setattr(configs, "load_table", lambda arch: configs.Table(
        "test", {}, ((16, (("tall", tall), ("any", wide))),), {}, None))
    launched = []
    launch = gemm_kernel.launch_gemm
    monkeypatch.setattr(gemm_kernel, "launch_gemm",
                        lambda x2d, qw, bias, config: launched.append(config) or launch(x2d, qw, bias, config))
    for n, k in ((24, 128), (72, 64)):
        qw = random_weight(n, k, 32, False, torch.float16, DEVICE, generator)
        x = random_activation(5, k, torch.float16, DEVICE, generator)
        assert_matches_reference(triton_gemm(x, qw), x, qw)
    assert launched == [tall.for_group(32), wide]


@pytest.mark.skipif(ON_GPU, reason="the interpreter's bf16 limitation: CPU only")
def test_the_interpreter_refuses_bf16(generator):
    # Its bf16 arithmetic is wrong upstream (off by ~1e10 here): both routes must refuse, not answer.
    qw = random_weight(16, 128, 128, True, torch.bfloat16, DEVICE, generator)
    x = random_activation(2, 128, torch.bfloat16, DEVICE, generator)
    for route in (triton_gemm, dequant_blas_gemm):
        with pytest.raises(RuntimeError, match="interpreter computes bfloat16 wrong"):
            route(x, qw)
    for backend in ("triton", "dequant_blas"):
        with pytest.raises(RuntimeError, match=f"backend='{backend}' is unavailable on cpu for torch.bfloat16"):
            w4a16.gemm(x, qw, backend=backend)
    assert_matches_reference(w4a16.gemm(x, qw), x, qw)  # auto routes bf16 to the reference on CPU


# --- GPU only: every model shape of the bench catalogue --------------------------------------------------------
MODEL_SHAPES = [
    (6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728),      # Qwen3-4B
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),     # Llama-3.1-8B
    (24576, 4096), (4096, 12288),                                 # Qwen3-8B (qkv, o as Llama)
    (4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944),     # Qwen2.5-7B
    (4096, 2560), (2560, 2048), (20480, 2560), (2560, 10240),     # gemma-3-4b
    (6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192),      # SmolLM2-1.7B
]
MODEL_CASES = [(nk, m) for nk in MODEL_SHAPES for m in (6, 16, 128, 2048)] if ON_GPU else []


def _gpu_weight(n, k, group_size, symmetric, dtype, seed):
    """random_weight built on the GPU (the CPU packing of 100M-element weights would dominate the test)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, k // group_size, device="cuda", generator=gen) * 0.02 + 0.002).to(dtype)
    zeros = None if symmetric else torch.randint(0, 16, (n, k // group_size), device="cuda", generator=gen,
                                                 dtype=torch.uint8)
    return w4a16.QuantizedWeight(w4a16.pack_int4(q), scales, zeros, group_size)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="model-shape tests need a GPU (CPU runs the interpreter on small shapes)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("nk", "m"), MODEL_CASES, ids=[f"N{n}K{k}-M{m}" for (n, k), m in MODEL_CASES])
def test_model_shapes(nk, m, dtype, generator):
    from w4a16.triton.gemm_kernel import launch_gemm

    n, k = nk
    index = MODEL_CASES.index((nk, m))
    group_size, symmetric = (32, 64, 128)[index % 3], index % 2 == 0
    qw = _gpu_weight(n, k, group_size, symmetric, dtype, int(torch.randint(0, 2**31, (1,), generator=generator)))
    x = random_activation(m, k, dtype, DEVICE, generator)
    bias = _bias(n, dtype, generator) if index % 4 == 1 else None
    config = select_config(w4a16.triton.table_arch(x.device), m, n, k, group_size)
    out = launch_gemm(x, qw, bias, config, out=_poisoned(m, n, dtype))
    assert_matches_reference(out, x, qw, bias)
    if m == 2048:
        assert_matches_reference(dequant_blas_gemm(x, qw, bias), x, qw, bias)


# --- The PTX dequantization (sm_90), read by a small emulator of the instructions it uses ----------------------


def _halves(bits: int, dtype: torch.dtype) -> list[float]:
    lanes = torch.tensor([bits & 0xFFFF, bits >> 16], dtype=torch.int32).to(torch.int16)
    return lanes.view(dtype).float().tolist()


def _bits(values: list[float], dtype: torch.dtype) -> int:
    low, high = (int(v) & 0xFFFF for v in torch.tensor(values).to(dtype).view(torch.int16).tolist())
    return low | high << 16


def _run_ptx(text: str, inputs: dict[str, int], dtype: torch.dtype) -> dict[str, int]:
    """Runs the straight-line PTX of dequant_tile on 32-bit registers; $n inputs and outputs are 16-bit."""
    regs = dict(inputs)

    def value(operand: str) -> int:
        return int(operand, 16) if operand.startswith("0x") else int(operand) if operand.isdigit() else regs[operand]

    for line in text.splitlines():
        op, _, rest = line.rstrip(";").partition(" ")
        if op in ("{", "}", ".reg"):
            continue
        unpack = re.fullmatch(r"\{(\S+), (\S+)\}, (\S+)", rest)  # mov.b32 {low, high}, register
        pack = re.fullmatch(r"(\S+), \{(\S+), (\S+)\}", rest)  # mov.b32 register, {low, high}
        if op == "mov.b32" and unpack:
            low, high, src = unpack.groups()
            regs[low], regs[high] = regs[src] & 0xFFFF, regs[src] >> 16
            continue
        if op == "mov.b32" and pack:
            dst, low, high = pack.groups()
            regs[dst] = regs[low] | regs[high] << 16
            continue
        dst, *args = (part.strip() for part in rest.split(","))
        if op == "lop3.b32":
            a, b, c, lut = (value(s) for s in args)
            regs[dst] = sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i for i in range(32))
        elif op == "shr.u32":
            regs[dst] = value(args[0]) >> value(args[1])
        elif op.startswith(("sub.rn.", "mul.rn.")):
            assert op.endswith({torch.float16: "f16x2", torch.bfloat16: "bf16x2"}[dtype]), op
            (a0, a1), (b0, b1) = _halves(value(args[0]), dtype), _halves(value(args[1]), dtype)
            # exact in Python's floats and in fp32 (integers below 2^11, products of 11-bit mantissas): one rounding
            regs[dst] = _bits([a0 - b0, a1 - b1] if op.startswith("sub") else [a0 * b0, a1 * b1], dtype)
        else:
            raise AssertionError(f"instruction the emulator does not know: {line}")
    return regs


def test_the_ptx_dequantization_is_taken_from_sm_90_on():
    """Its packed bf16x2 sub and mul exist from sm_90; older NVIDIA GPUs, AMD and the interpreter run the portable
    form."""
    from w4a16.triton.gemm_kernel import ptx_dequant_for, ptx_dequant_for_arch

    archs = ("sm_80", "sm_89", "sm_90", "sm_100", "gfx1151", "gfx1201")
    assert [ptx_dequant_for_arch(arch) for arch in archs] == [False, False, True, True, False, False]
    assert not ptx_dequant_for(torch.device("cpu"))


@pytest.mark.parametrize(("dtype", "magic"), [(torch.float16, 1024.0), (torch.bfloat16, 128.0)], ids=str)
def test_the_ptx_dequantization_computes_the_layouts_weights(dtype, magic, generator):
    """$0..$7 = (q_k - z) * s in k order for one packed word, with $9 = MAGIC + z and $10 = s: the nibbles as the
    layout's unpack_int4 reads them. MAGIC is the power of two whose ulp in the dtype is 1 (2^10 fp16, 2^7 bf16)."""
    from w4a16.triton.dequant_tile import ptx_dequant_asm

    words = torch.randint(-(2**31), 2**31, (16, 1), dtype=torch.int32, generator=generator)
    q = w4a16.unpack_int4(words)
    text = ptx_dequant_asm(dtype == torch.bfloat16)
    for row in range(words.shape[0]):
        z = int(torch.randint(0, 16, (1,), generator=generator))
        s = float(torch.randn(1, generator=generator).mul(0.01).to(dtype))
        half = lambda v: _bits([v, 0.0], dtype)  # noqa: E731 - a 16-bit input in the low lane
        regs = _run_ptx(text, {"$8": int(words[row, 0]) & 0xFFFFFFFF, "$9": half(magic + z), "$10": half(s)}, dtype)
        got = [_halves(regs[f"${j}"], dtype)[0] for j in range(8)]
        expected = ((q[row].float() - z) * s).to(dtype).float().tolist()
        assert got == expected, (row, z, s)


def test_the_magic_constants_are_one_ulp_floats_and_their_pairs():
    """OR-ing a nibble into the low mantissa bits of MAGIC gives MAGIC + q exactly only if MAGIC's ulp is 1; the
    *_PAIR words are MAGIC's 16 bits in both lanes, as magic_pair_hex writes them into the PTX."""
    from w4a16.triton import dequant_tile as dt

    for dtype, magic, pair, is_bf16 in ((torch.float16, dt.FP16_MAGIC, dt.FP16_MAGIC_PAIR, False),
                                        (torch.bfloat16, dt.BF16_MAGIC, dt.BF16_MAGIC_PAIR, True)):
        bits = int(torch.tensor(magic.value, dtype=dtype).view(torch.int16))
        assert pair.value == bits | bits << 16
        assert int(magic.value) & 0xF == 0 and bits & 0xF == 0
        for q in range(16):
            assert torch.tensor(bits | q, dtype=torch.int16).view(dtype).item() == magic.value + q
        assert dt.magic_pair_hex(is_bf16) == f"{pair.value:#010x}"
    assert dt.magic_pair_hex(True) == "0x43004300" and dt.magic_pair_hex(False) == "0x64006400"
