"""The Hopper wgmma kernel (wgmma_kernel.py) against the fp32 reference, and its operand order.

The kernel runs on sm_90 only (there is no interpreter for Gluon), so its GPU cases skip elsewhere; the operand
order of x and the config checks run everywhere. The model shapes at the M the sm_90 table gives it are covered by
test_gemm.py::test_model_shapes.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch
from w4a16_testing import assert_matches_reference, nan_empty, random_activation, random_weight

import w4a16
from w4a16.triton.configs import WGMMA_BLOCK_K, TileConfig, load_table

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _documented_operand_order(x: torch.Tensor) -> torch.Tensor:
    """The operand order column by column: column 16b + 8s + 2t + e of a 128-wide tile holds physical k = 32t + 4b
    + 2s + e, zero past K."""
    m, k = x.shape
    tiles = -(-k // 128)
    physical = torch.tensor([tile * 128 + 32 * (c // 2 % 4) + 4 * (c // 16) + 2 * (c // 8 % 2) + c % 2
                             for tile in range(tiles) for c in range(128)], device=x.device)
    padded = torch.nn.functional.pad(x, (0, tiles * 128 - k))
    return padded[:, physical]


def test_operand_order_is_the_documented_permutation():
    from w4a16.triton.wgmma_kernel import operand_order

    m, k = 3, 2 * 128 + 32  # a partial last tile: zero padded
    x = torch.arange(1, m * k + 1, dtype=torch.float32).reshape(m, k)
    assert torch.equal(operand_order(x), _documented_operand_order(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the operand-order kernel runs on a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_operand_order_kernel_matches_the_documented_permutation(dtype, generator):
    from w4a16.triton.wgmma_kernel import operand_order

    for m, k in [(1, 32), (17, 160), (64, 4096), (130, 2592)]:
        # Rows of a wider tensor (a row stride other than K) with K not always a multiple of the 128-wide tile.
        wide = torch.randn(m, k + 96, generator=generator).to(dtype=dtype, device="cuda")
        x = wide[:, 64:64 + k]
        assert torch.equal(operand_order(x), _documented_operand_order(x)), (m, k)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(block_k=64), "BLOCK_K=64"),
    (dict(block_n=128), "BLOCK_N=128, num_warps=4"),
    (dict(block_m=48), "BLOCK_M=48"),
    (dict(num_stages=2), "num_stages=2"),
    (dict(block_n=128, num_warps=8), "num_stages=3 \\(at least 3 with 4 warps, 4 with 8 or 16\\)"),
    (dict(block_n=256, num_warps=16, num_stages=4, block_m=16), "BLOCK_M=16 with 16 warps"),
    (dict(block_m=256), "BLOCK_M=256 \\(must be 16, 32, 64 or 128\\)"),
    (dict(producer=True, block_m=32), "BLOCK_M=32 \\(the producer form takes 64, 128 or 256\\)"),
    (dict(producer=True, block_n=256, num_warps=16, num_stages=4), "the producer form needs 4 or 8 consumer warps"),
    (dict(producer=True, block_n=128), "BLOCK_N=128, num_warps=4 \\(the producer form needs"),
    (dict(producer=True, num_stages=1), "num_stages=1 \\(at least 2\\)"),
    (dict(producer=True, x_gather=True), "x_gather with producer"),
    (dict(x_natural=True), "x_natural without producer"),
])
def test_bad_wgmma_configs_are_rejected(fields, message):
    base = dict(block_m=64, block_n=64, block_k=WGMMA_BLOCK_K, num_warps=4, num_stages=3, kernel="wgmma")
    with pytest.raises(ValueError, match=message):
        TileConfig(**{**base, **fields})
    for wgmma_only in ("x_gather", "producer", "x_natural"):
        with pytest.raises(ValueError, match="x_gather, producer and x_natural apply to the wgmma kernel only"):
            TileConfig(64, 64, 64, 4, **{wgmma_only: True})


def test_producer_register_budget_fits_the_register_file():
    """maxnreg of the producer form: one CTA (the producer warp counts as a whole warpgroup) always fits the 64K
    register file, and where the budget is sized for two CTAs per SM, their rings fit shared memory too."""
    from w4a16.triton.wgmma_kernel import PRODUCER_REGISTERS, producer_max_registers

    # Up to 6 stages: rings of 5 and 6 stages of 64 tokens fall either side of room for two CTAs.
    for block_m, warps, stages in itertools.product((64, 128, 256), (4, 8), range(2, 7)):
        regs = producer_max_registers(block_m, warps, stages)
        threads = 32 * (warps + 4)
        ring = stages * (block_m * WGMMA_BLOCK_K * 2 + 16 * warps * WGMMA_BLOCK_K // 2)
        case = (block_m, warps, stages, regs)
        assert regs % 8 == 0 and PRODUCER_REGISTERS < regs <= 232 and regs * threads <= 65536, case
        if 2 * regs * threads <= 65536:
            assert 2 * ring <= 227 * 1024, case


@pytest.mark.parametrize(("capability", "reason"), [
    ((9, 0), None), ((8, 0), "needs an sm_90 GPU \\(this is sm_80\\)"), ((10, 0), "\\(this is sm_100\\)"),
    ((12, 0), "\\(this is sm_120\\)"),
])
def test_only_sm_90_runs_the_wgmma_kernel(monkeypatch, capability, reason):
    """wgmma and setmaxnreg are sm_90a instructions: neither older nor newer GPUs can run the kernel."""
    from w4a16.triton.wgmma_kernel import unsupported_reason

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    found = unsupported_reason.__wrapped__(torch.device("cuda", 0))  # uncached: the capability is faked
    if reason is None:
        assert found is None
    else:
        assert re.search(reason, found), found
    assert unsupported_reason.__wrapped__(torch.device("cpu")) == "the wgmma kernel is NVIDIA-only"


# (M, N, K, G): remainders in M against 16..128-token tiles, in N against 64/128 weight rows, K not a multiple of
# the 128-wide K tile (G = 32, 64), and splits that leave the last split empty.
SHAPES = [(1, 40, 256, 128), (17, 72, 160, 32), (33, 200, 448, 64), (130, 130, 1056, 32), (64, 4096, 640, 128),
          (257, 520, 384, 64), (100, 600, 1280, 128), (40, 264, 224, 32)]
CONFIGS = [
    TileConfig(16, 64, WGMMA_BLOCK_K, 4, 4, 1, kernel="wgmma"),
    TileConfig(32, 64, WGMMA_BLOCK_K, 4, 3, 3, kernel="wgmma", x_gather=True),
    TileConfig(64, 128, WGMMA_BLOCK_K, 8, 4, 2, kernel="wgmma"),
    TileConfig(128, 64, WGMMA_BLOCK_K, 4, 3, 1, kernel="wgmma", x_gather=True),
    TileConfig(128, 128, WGMMA_BLOCK_K, 8, 4, 4, kernel="wgmma"),
    TileConfig(16, 128, WGMMA_BLOCK_K, 8, 4, 8, kernel="wgmma", x_gather=True),
    TileConfig(64, 256, WGMMA_BLOCK_K, 16, 4, 2, kernel="wgmma"),
    TileConfig(32, 256, WGMMA_BLOCK_K, 16, 5, 1, kernel="wgmma", x_gather=True),
]
# The producer form, paired with the same shapes: 64/128/256-token tiles, one or two consumer warpgroups, splits.
CONFIGS_PRODUCER = [
    TileConfig(256, 128, WGMMA_BLOCK_K, 8, 3, 1, kernel="wgmma", producer=True),
    TileConfig(64, 64, WGMMA_BLOCK_K, 4, 4, 3, kernel="wgmma", producer=True),
    TileConfig(128, 64, WGMMA_BLOCK_K, 4, 3, 2, kernel="wgmma", producer=True),
    TileConfig(256, 64, WGMMA_BLOCK_K, 4, 3, 1, kernel="wgmma", producer=True),
    TileConfig(128, 128, WGMMA_BLOCK_K, 8, 4, 1, kernel="wgmma", producer=True),
    TileConfig(128, 64, WGMMA_BLOCK_K, 4, 4, 8, kernel="wgmma", producer=True),
    TileConfig(256, 128, WGMMA_BLOCK_K, 8, 3, 2, kernel="wgmma", producer=True),
    TileConfig(64, 64, WGMMA_BLOCK_K, 4, 2, 1, kernel="wgmma", producer=True),
]
# x in its natural order (no operand-ordered copy), paired with the same shapes: every G (a lane's K tile spans 1, 2
# or 4 groups), 64/128/256-token tiles, one or two consumer warp groups, splits, K not a multiple of 128.
CONFIGS_NATURAL = [
    TileConfig(128, 128, WGMMA_BLOCK_K, 8, 4, 1, kernel="wgmma", producer=True, x_natural=True),
    TileConfig(64, 64, WGMMA_BLOCK_K, 4, 4, 3, kernel="wgmma", producer=True, x_natural=True),
    TileConfig(128, 64, WGMMA_BLOCK_K, 4, 3, 2, kernel="wgmma", producer=True, x_natural=True),
    TileConfig(256, 64, WGMMA_BLOCK_K, 4, 3, 1, kernel="wgmma", producer=True, x_natural=True),
    TileConfig(64, 64, WGMMA_BLOCK_K, 4, 4, 1, kernel="wgmma", producer=True, x_natural=True),
    TileConfig(128, 64, WGMMA_BLOCK_K, 4, 4, 6, kernel="wgmma", producer=True, x_natural=True),
    TileConfig(256, 128, WGMMA_BLOCK_K, 8, 3, 2, kernel="wgmma", producer=True, x_natural=True),
    TileConfig(64, 64, WGMMA_BLOCK_K, 4, 2, 1, kernel="wgmma", producer=True, x_natural=True),
]
CASES = [(shape, config, symmetric, dtype)
         for configs in (CONFIGS, CONFIGS_PRODUCER, CONFIGS_NATURAL)
         for (shape, config), symmetric, dtype in itertools.product(zip(SHAPES, configs, strict=True), (True, False),
                                                                    (torch.float16, torch.bfloat16))]
# Every config on every shape once more, in bf16 (the cases above pair each shape with one config).
CASES += [(shape, config, i % 2 == 0, torch.bfloat16)
          for i, (shape, config) in enumerate(itertools.product(SHAPES, CONFIGS + CONFIGS_PRODUCER
                                                                    + CONFIGS_NATURAL[:4]))]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="the wgmma kernel needs an sm_90 GPU")
@pytest.mark.parametrize(("shape", "config", "symmetric", "dtype"), CASES,
                         ids=[f"M{s[0]}N{s[1]}K{s[2]}g{s[3]}-{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}"
                              f"k{c.split_k}{'G' if c.x_gather else ''}{'P' if c.producer else ''}"
                              f"{'N' if c.x_natural else ''}-{'sym' if y else 'asym'}-{d}".replace("torch.", "")
                              for s, c, y, d in CASES])
def test_wgmma_kernel(shape, config, symmetric, dtype, generator):
    from w4a16.triton.gemm_kernel import launch_gemm

    m, n, k, group_size = shape
    qw = random_weight(n, k, group_size, symmetric, dtype, "cuda", generator)
    x = random_activation(m, k, dtype, "cuda", generator)
    bias = torch.randn(n, generator=generator).to(dtype=dtype, device="cuda") if (m + n) % 2 == 0 else None
    out = launch_gemm(x, qw, bias, config, out=torch.full((m, n), float("nan"), dtype=dtype, device="cuda"))
    assert_matches_reference(out, x, qw, bias)


# K no larger than one 128-wide K tile: a single partial tile, weight rows of 16 or 32 bytes for TMA, and most of a
# lane's groups masked in the natural form.
SMALL_K = [(5, 72, 32, 32), (70, 200, 64, 64), (70, 200, 64, 32), (130, 130, 128, 128)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="the wgmma kernel needs an sm_90 GPU")
@pytest.mark.parametrize("shape", SMALL_K, ids=[f"M{m}N{n}K{k}g{g}" for m, n, k, g in SMALL_K])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_every_form_with_k_within_one_k_tile(shape, symmetric, generator):
    from w4a16.triton.gemm_kernel import launch_gemm

    m, n, k, group_size = shape
    qw = random_weight(n, k, group_size, symmetric, torch.bfloat16, "cuda", generator)
    x = random_activation(m, k, torch.bfloat16, "cuda", generator)
    bias = torch.randn(n, generator=generator).to(dtype=torch.bfloat16, device="cuda")
    for config in CONFIGS + CONFIGS_PRODUCER + CONFIGS_NATURAL:
        out = launch_gemm(x, qw, bias, config, out=torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda"))
        assert_matches_reference(out, x, qw, bias)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="the wgmma kernel needs an sm_90 GPU")
@pytest.mark.parametrize(("shape", "config"), [
    ((64, 4096, 640, 128), TileConfig(128, 128, WGMMA_BLOCK_K, 8, 4, 4, kernel="wgmma")),
    ((100, 600, 1280, 128), TileConfig(128, 64, WGMMA_BLOCK_K, 4, 4, 8, kernel="wgmma", producer=True)),
    ((100, 600, 1280, 128), TileConfig(128, 64, WGMMA_BLOCK_K, 4, 4, 6, kernel="wgmma", producer=True,
                                       x_natural=True)),
], ids=["plain-split4", "producer-split8", "natural-split6"])
def test_empty_splits_write_their_slice_of_a_nan_workspace(shape, config, generator, monkeypatch):
    """Splits whose K range is empty (5 K tiles over 4 splits; 10 over 8) must still write zeros into the split-K
    slices, which are not initialised: the allocator hands them out as NaN here."""
    from w4a16.triton.gemm_kernel import launch_gemm

    m, n, k, group_size = shape
    qw = random_weight(n, k, group_size, False, torch.bfloat16, "cuda", generator)
    x = random_activation(m, k, torch.bfloat16, "cuda", generator)
    bias = torch.randn(n, generator=generator).to(dtype=torch.bfloat16, device="cuda")
    out = torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda")
    monkeypatch.setattr(torch, "empty", nan_empty)
    assert_matches_reference(launch_gemm(x, qw, bias, config, out=out), x, qw, bias)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="the wgmma kernel needs an sm_90 GPU")
@pytest.mark.parametrize("config", [
    TileConfig(64, 64, WGMMA_BLOCK_K, 4, 4, 1, kernel="wgmma", producer=True, x_natural=True),
    TileConfig(32, 64, WGMMA_BLOCK_K, 4, 3, 3, kernel="wgmma", x_gather=True),
], ids=["natural", "gather"])
def test_forms_that_read_x_itself_take_views_they_cannot_vectorise(config, generator):
    """The natural form reads x by TMA, the gather form by 16-byte cp.async: both need a 16-byte aligned base and
    row stride, and views with neither are copied first."""
    from w4a16.triton.gemm_kernel import launch_gemm

    m, n, k, g = 70, 200, 512, 32
    qw = random_weight(n, k, g, True, torch.bfloat16, "cuda", generator)
    misaligned = random_activation(1, m * k + 2, torch.bfloat16, "cuda", generator)[0, 2:].view(m, k)
    strided = random_activation(m, k + 4, torch.bfloat16, "cuda", generator)[:, :k]  # rows 1032 bytes apart
    assert misaligned.data_ptr() % 16 != 0 and strided.stride(0) * 2 % 16 != 0
    for x in (misaligned, strided):
        out = launch_gemm(x, qw, None, config, out=torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda"))
        assert_matches_reference(out, x, qw)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="the wgmma kernel needs an sm_90 GPU")
def test_producer_form_reads_a_misaligned_weight_view(generator):
    """TMA needs a 16-byte aligned base: a packed weight viewed 4 bytes into a larger buffer still works."""
    from w4a16.triton.gemm_kernel import launch_gemm

    m, n, k, g = 130, 200, 512, 64
    qw = random_weight(n, k, g, False, torch.bfloat16, "cuda", generator)
    buffer = torch.empty(n * k // 8 + 1, dtype=torch.int32, device="cuda")
    view = buffer[1:].view(n, k // 8)
    view.copy_(qw.qweight)
    assert view.data_ptr() % 16 != 0
    shifted = w4a16.QuantizedWeight(view, qw.scales, qw.zeros, g)
    x = random_activation(m, k, torch.bfloat16, "cuda", generator)
    config = TileConfig(128, 64, WGMMA_BLOCK_K, 4, 3, 1, kernel="wgmma", producer=True)
    out = launch_gemm(x, shifted, None, config, out=torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda"))
    assert_matches_reference(out, x, shifted)


SHIPPED_SM90 = sorted(load_table("sm_90").all_configs(), key=lambda c: tuple(c.to_json().items()))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="the wgmma kernel needs an sm_90 GPU")
@pytest.mark.parametrize("config", SHIPPED_SM90, ids=lambda c: "-".join(f"{v}" for v in c.to_json().values()))
def test_every_config_the_sm90_table_ships(config, generator):
    """Each distinct config of the shipped table once, on a shape with remainders in M, N and K (G = 64), bf16
    with zero points and bias: the model-shape tests reach only the buckets their M values select."""
    from w4a16.triton.gemm_kernel import launch_gemm

    m, n, k, g = 70, 200, 640, 64
    qw = random_weight(n, k, g, False, torch.bfloat16, "cuda", generator)
    x = random_activation(m, k, torch.bfloat16, "cuda", generator)
    bias = torch.randn(n, generator=generator).to(dtype=torch.bfloat16, device="cuda")
    config = config.for_group(g)
    out = launch_gemm(x, qw, bias, config, out=torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda"))
    assert_matches_reference(out, x, qw, bias)


@pytest.mark.skipif(not ON_HOPPER, reason="the wgmma kernel needs an sm_90 GPU")
def test_token_tiles_past_the_grid_limit_are_refused():
    """Token tiles are the grid's y extent, which stops at 65535: one tile more is a clear error, not a failed
    launch."""
    from w4a16.triton.configs import GRID_YZ_MAX
    from w4a16.triton.wgmma_kernel import launch_wgmma

    m = 16 * GRID_YZ_MAX + 1
    qw = random_weight(64, 128, 128, True, torch.float16, "cuda", torch.Generator().manual_seed(0))
    x = torch.ones(m, 128, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match=rf"M={m} makes {GRID_YZ_MAX + 1} token tiles of 16, past the {GRID_YZ_MAX}"):
        launch_wgmma(x, qw, None, TileConfig(16, 64, WGMMA_BLOCK_K, 4, 4, 1, kernel="wgmma"))


_P256 = TileConfig(256, 64, WGMMA_BLOCK_K, 4, 3, 1, kernel="wgmma", producer=True, x_natural=True)
_P128 = TileConfig(128, 64, WGMMA_BLOCK_K, 4, 3, 1, kernel="wgmma", producer=True)


def _rest(config, block_m):
    return dataclasses.replace(config, block_m=block_m, num_stages=4)


@pytest.mark.parametrize(("config", "shape", "sms", "plan"), [
    # Llama-3.1-8B qkv at M = 512 on 132 SMs: 96 x 2 tiles of one CTA per SM; 66 row tiles fill the wave, the other
    # 30 rows run as 120 tiles of 128 tokens (as 240 of 64 tokens they would be more than one per SM).
    (_P256, (512, 6144, 4096), 132, (4224, _rest(_P256, 128))),
    # A partial row tile among the rows left.
    (_P256, (512, 64 * 95 + 8, 4096), 132, (4224, _rest(_P256, 128))),
    # Qwen3-4B down at M = 1024: 40 x 4 tiles, 7 rows left: even as 112 tiles of 64 tokens one per SM.
    (_P256, (1024, 2560, 9728), 132, (2112, _rest(_P256, 64))),
    # Two CTAs per SM (a 108 KB ring): 304 tiles on 264 slots; the 40 rows left as 80 tiles of 64 tokens.
    (_P128, (128, 19456, 2560), 132, (16896, _rest(_P128, 64))),
    # None: Qwen3-4B gate_up at M = 512, 40 rows left, 160 tiles of 128 tokens or 320 of 64, both more than the SMs;
    # the same at M = 256 with 128-token tiles; no whole wave; the waves full; a config that splits K; token tiles
    # already the smallest; the non-producer form.
    (_P256, (512, 19456, 2560), 132, None),
    (_P128, (256, 19456, 2560), 132, None),
    (_P256, (512, 2560, 4096), 132, None),
    (_P256, (512, 64 * 132, 4096), 132, None),
    (dataclasses.replace(_P256, split_k=2), (512, 6144, 4096), 132, None),
    (TileConfig(64, 64, WGMMA_BLOCK_K, 4, 4, 1, kernel="wgmma", producer=True), (128, 19456, 2560), 132, None),
    (TileConfig(128, 64, WGMMA_BLOCK_K, 4, 3, 1, kernel="wgmma"), (512, 6144, 4096), 132, None),
])
def test_last_wave_rows_plan(config, shape, sms, plan):
    """Which weight rows fill whole waves, and the config the rest run with."""
    from w4a16.triton.wgmma_kernel import last_wave_rows

    m, n, _ = shape  # K does not enter the plan
    assert last_wave_rows(config, m, n, sms) == plan


# (config, (M, N, K, G), SMs the launcher is told of, token tile of the second launch): shapes small enough for a GPU
# test that end in a partial wave on that many SMs, so the rows of the last wave run as a second launch of smaller
# token tiles (partial row and token tiles among them).
LAST_WAVE = [
    (_P256, (300, 200, 640, 64), 3, 128),
    (_P256, (300, 200, 640, 64), 7, 64),
    (TileConfig(128, 128, WGMMA_BLOCK_K, 8, 4, 1, kernel="wgmma", producer=True), (130, 600, 1056, 32), 4, 64),
    (dataclasses.replace(_P128, x_natural=True), (100, 700, 1280, 128), 5, 64),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="the wgmma kernel needs an sm_90 GPU")
@pytest.mark.parametrize(("config", "shape", "sms", "rest_block_m"), LAST_WAVE,
                         ids=[f"M{s[0]}N{s[1]}K{s[2]}g{s[3]}sm{sms}" for _, s, sms, _ in LAST_WAVE])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_last_wave_rows_launched_apart(config, shape, sms, rest_block_m, symmetric, dtype, generator, monkeypatch):
    from w4a16.triton import wgmma_kernel
    from w4a16.triton.gemm_kernel import launch_gemm

    m, n, k, group_size = shape
    monkeypatch.setattr(wgmma_kernel, "_sm_count", lambda device: sms)
    plan = wgmma_kernel.last_wave_rows(config, m, n, sms)
    assert plan is not None and plan[1].block_m == rest_block_m  # the case takes the two launches it is meant to
    qw = random_weight(n, k, group_size, symmetric, dtype, "cuda", generator)
    x = random_activation(m, k, dtype, "cuda", generator)
    bias = torch.randn(n, generator=generator).to(dtype=dtype, device="cuda")
    out = launch_gemm(x, qw, bias, config, out=torch.full((m, n), float("nan"), dtype=dtype, device="cuda"))
    assert_matches_reference(out, x, qw, bias)
