"""The skinny kernel on a GPU against the fp32 reference: formats, group sizes, dtypes, M = 1..max_rows (8 on sm_90), the bench
catalogue's model shapes and odd shapes, the staging limit and every host check. Skipped (with the reason) without a GPU."""

from __future__ import annotations

import functools
import itertools
import zlib

import pytest
import torch
from w4a16_testing import assert_matches_reference

import w4a16
from w4a16 import skinny

pytestmark = pytest.mark.gpu

GPU = torch.cuda.is_available()
DTYPES = (torch.float16, torch.bfloat16)
FORMATS = ("uint4b8", "uint4")
GROUPS = (32, 64, 128)
# Up to the 8 rows the NVIDIA kernel takes on sm_90; rows past the device's limits are skipped (rows_for).
ROWS = (1, 2, 3, 4, 5, 6, 7, 8)
# (N, K) of qkv, o, gate_up, down
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
QWEN3_4B = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)]
OTHER_MODELS = [(6144, 4096), (24576, 4096), (4096, 12288), (4608, 3584), (3584, 3584), (37888, 3584),
                (3584, 18944), (4096, 2560), (2560, 2048), (20480, 2560), (2560, 10240), (6144, 2048),
                (2048, 2048), (16384, 2048), (2048, 8192)]


@pytest.fixture(scope="module", autouse=True)
def extension():
    if not GPU:
        pytest.skip("needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)")
    reason = skinny.unavailable_reason(torch.device("cuda"), torch.float16)
    if reason and "not built" in reason:
        from w4a16 import skinny_build

        skinny_build.build()
        skinny._load.cache_clear()
        reason = skinny.unavailable_reason(torch.device("cuda"), torch.float16)
    assert reason is None, reason


def _seeded(generator: torch.Generator) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))


def gpu_weight(n, k, group_size, fmt, dtype, gen) -> w4a16.QuantizedWeight:
    """Random weight built on the GPU (model-sized shapes are slow to draw on the CPU)."""
    q = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.int32)
    groups = k // group_size
    scales = (torch.rand(n, groups, device="cuda", generator=gen) * 0.02 + 0.002).to(dtype)
    zeros = None if fmt == "uint4b8" else torch.randint(0, 16, (n, groups), device="cuda", generator=gen,
                                                        dtype=torch.uint8)
    return w4a16.QuantizedWeight(w4a16.pack_int4(q), scales, zeros, group_size)


@functools.lru_cache(maxsize=4)
def _shared_weight(n, k, group_size, fmt, dtype, seed):
    # One weight per (shape, G, format, dtype) serves the five M values of a model shape (fresh x each);
    # drawing 100M+ nibbles per case would dominate the GPU run.
    return gpu_weight(n, k, group_size, fmt, dtype, torch.Generator(device="cuda").manual_seed(seed))


def run(x, qw, bias=None, cluster_blocks=0):
    """The kernel's output, with torch's allocator primed with NaN so that an unwritten element fails."""
    torch.empty(x.shape[0], qw.n, dtype=x.dtype, device="cuda").fill_(float("nan"))
    out = skinny.skinny_gemm(x, qw, bias, cluster_blocks=cluster_blocks)
    torch.cuda.synchronize()
    return out


def rows_for(k):
    """The rows of ROWS this device's kernel takes with K = k (max_rows, and M * K within the staging budget)."""
    max_rows, elements = skinny.device_limits()
    return [m for m in ROWS if m <= max_rows and m * k <= elements]


def x_for(m, k, dtype, gen):
    return torch.randn(m, k, device="cuda", generator=gen).to(dtype)


MODEL_CASES = [(s, g, f, d, m) for s, g, f, d, m in itertools.product(LLAMA_8B + QWEN3_4B, GROUPS, FORMATS, DTYPES, ROWS)]


@pytest.mark.parametrize("shape,group_size,fmt,dtype,m", MODEL_CASES, ids=str)
def test_model_shapes(shape, group_size, fmt, dtype, m, generator):
    n, k = shape
    if m not in rows_for(k):
        pytest.skip(f"M={m}, K={k} is past this device's rows or staging budget {skinny.device_limits()}")
    seed = zlib.crc32(repr((n, k, group_size, fmt, dtype)).encode())
    qw = _shared_weight(n, k, group_size, fmt, dtype, seed)
    x = x_for(m, k, dtype, _seeded(generator))
    assert_matches_reference(run(x, qw), x, qw)


OTHER_CASES = [(s, f, d, m) for s, f, d, m in itertools.product(OTHER_MODELS, FORMATS, DTYPES, (1, 5, 8))]


@pytest.mark.parametrize("shape,fmt,dtype,m", OTHER_CASES, ids=str)
def test_other_model_shapes(shape, fmt, dtype, m, generator):
    n, k = shape
    if m not in rows_for(k):
        pytest.skip(f"M={m}, K={k} is past this device's rows or staging budget {skinny.device_limits()}")
    gen = _seeded(generator)
    qw = gpu_weight(n, k, 128, fmt, dtype, gen)
    x = x_for(m, k, dtype, gen)
    assert_matches_reference(run(x, qw), x, qw)


# Odd N (wave/row-tile remainders, fewer rows than waves) and K (chunk remainders per lane, single chunk; with
# G = 32 and 64, K-steps of 128 that end inside K: 96, 160, 192, 1056, 4128, 4160).
ODD_K = (32, 96, 160, 192, 640, 1056, 4128, 4160)
ODD = [(n, k, g) for n, k, g in itertools.product((1, 3, 7, 33, 257, 1000, 4099), ODD_K, GROUPS) if k % g == 0]


@pytest.mark.parametrize("n,k,group_size", ODD, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_odd_shapes_all_rows_bias(n, k, group_size, dtype, generator):
    gen = _seeded(generator)
    for fmt, m, with_bias in itertools.product(FORMATS, rows_for(k), (False, True)):
        qw = gpu_weight(n, k, group_size, fmt, dtype, gen)
        x = x_for(m, k, dtype, gen)
        bias = torch.randn(n, device="cuda", generator=gen).to(dtype) if with_bias else None
        assert_matches_reference(run(x, qw, bias), x, qw, bias)


def _at_odd_address(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t that starts one element past an aligned address."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = storage[1:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("group_size", (32, 64), ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_metadata_at_odd_addresses(group_size, dtype, generator):
    """Scales and zero points that start one element past an aligned address (views with a storage offset, which
    the op accepts) are read correctly: the kernel may assume no more than their element alignment (a wider load
    of a row's groups was tried, csrc/PERF.md)."""
    gen = _seeded(generator)
    for fmt, m in itertools.product(FORMATS, (1, 5)):
        qw = gpu_weight(4096, 4096, group_size, fmt, dtype, gen)
        odd = w4a16.QuantizedWeight(qw.qweight, _at_odd_address(qw.scales),
                                    None if qw.zeros is None else _at_odd_address(qw.zeros), group_size)
        assert odd.scales.data_ptr() % 4 != 0
        x = x_for(m, 4096, dtype, gen)
        assert_matches_reference(run(x, odd), x, odd)


def clusters_available() -> bool:
    return torch.version.cuda is not None and torch.cuda.get_device_capability() >= (9, 0)


# Every cluster size, whatever the shape would pick: one row tile (all blocks of one cluster), fewer k-steps than
# blocks (blocks with no work), chunk remainders, more rounds per cluster than round slots (Llama gate_up), and
# Qwen3-4B o and down. (The model-shape tests above cover the sizes the rule picks.)
CLUSTER_SHAPES = [(1, 4128, 32), (7, 32, 32), (33, 640, 64), (257, 4224, 128), (1000, 1056, 32), (4099, 4096, 128),
                  (28672, 4096, 128), (2560, 4096, 64), (2560, 9728, 128)]


@pytest.mark.parametrize("n,k,group_size", CLUSTER_SHAPES, ids=str)
@pytest.mark.parametrize("cluster_blocks", (1, 2, 4))
def test_cluster_sizes(cluster_blocks, n, k, group_size, generator):
    if cluster_blocks > 1 and not clusters_available():
        pytest.skip("thread-block clusters need NVIDIA sm_90 or later")
    gen = _seeded(generator)
    for fmt, dtype in itertools.product(FORMATS, DTYPES):
        qw = gpu_weight(n, k, group_size, fmt, dtype, gen)
        for m in rows_for(k):
            x = x_for(m, k, dtype, gen)
            bias = torch.randn(n, device="cuda", generator=gen).to(dtype) if m % 2 else None
            assert_matches_reference(run(x, qw, bias, cluster_blocks), x, qw, bias)


def test_cluster_sizes_a_device_cannot_run(generator):
    if clusters_available():
        pytest.skip("this device runs every cluster size")
    gen = _seeded(generator)
    qw = gpu_weight(64, 256, 64, "uint4", torch.float16, gen)
    with pytest.raises(ValueError, match="cluster_blocks=2 needs thread-block clusters"):
        skinny.skinny_gemm(x_for(2, 256, torch.float16, gen), qw, cluster_blocks=2)


def test_large_activations_and_scales(generator):
    # x far from N(0, 1) and scales spanning magnitudes: the raw-dot offset correction must hold up.
    gen = _seeded(generator)
    for dtype in DTYPES:
        qw = gpu_weight(512, 4096, 64, "uint4", dtype, gen)
        qw.scales.mul_(torch.logspace(-3, 1, qw.scales.shape[1], device="cuda").to(dtype))
        x = (x_for(5, 4096, dtype, gen) * 30 + 7).to(dtype)
        assert_matches_reference(run(x, qw), x, qw)


@pytest.mark.alone
def test_staging_limit_exactly_and_one_past(generator):
    gen = _seeded(generator)
    max_rows, elements = skinny.device_limits()
    for m in sorted({1, 4, max_rows}):
        k = elements // m // 32 * 32
        qw = gpu_weight(64, k, 32, "uint4", torch.bfloat16, gen)
        x = x_for(m, k, torch.bfloat16, gen)
        assert_matches_reference(run(x, qw), x, qw)
        # k is the largest multiple of 32 within the budget, so one chunk more is past it
        assert m * (k + 32) > elements
        over = gpu_weight(64, k + 32, 32, "uint4", torch.bfloat16, gen)
        with pytest.raises(ValueError, match=f"exceed the staging budget of {elements}"):
            skinny.skinny_gemm(x_for(m, k + 32, torch.bfloat16, gen), over)


@pytest.mark.alone
def test_limits_agree_host_device_python():
    for i in range(torch.cuda.device_count()):
        host = tuple(torch.ops.w4a16.skinny_limits(i))
        device = tuple(torch.ops.w4a16.skinny_device_limits(i))
        assert host == device == skinny.limits(w4a16.arch(torch.device("cuda", i)))


@pytest.mark.alone
def test_host_checks(generator):
    gen = _seeded(generator)
    qw = gpu_weight(64, 256, 64, "uint4", torch.float16, gen)
    x = x_for(2, 256, torch.float16, gen)
    max_rows, _ = skinny.device_limits()
    op = torch.ops.w4a16.skinny_gemm
    args = dict(x=x, qweight=qw.qweight, scales=qw.scales, zeros=qw.zeros, bias=None, group_size=64, cluster_blocks=0)

    def call(**changes):
        a = {**args, **changes}
        return op(a["x"], a["qweight"], a["scales"], a["zeros"], a["bias"], a["group_size"], a["cluster_blocks"])

    call()  # the baseline is valid
    cases = [
        (TypeError, "x must be float16 or bfloat16", dict(x=x.float())),
        (ValueError, "x must be 2-D", dict(x=x[None])),
        (ValueError, "x must be contiguous", dict(x=torch.randn(512, 2, device="cuda").half().t())),
        (TypeError, "qweight must be int32", dict(qweight=qw.qweight.to(torch.int64))),
        (ValueError, r"qweight must be \[N, K // 8\] = \[64, 32\] for x with K=256",
         dict(qweight=qw.qweight[:, :16].contiguous())),
        (ValueError, r"K=40 \(x's last dim\) must be a positive multiple of 16",
         dict(x=x_for(2, 40, torch.float16, gen), qweight=qw.qweight[:, :5].contiguous())),
        (ValueError, "group_size must be one of", dict(group_size=16)),
        (ValueError, r"cluster_blocks must be 0 \(chosen from the shape\), 1, 2 or 4, got 3", dict(cluster_blocks=3)),
        (ValueError, "K=192 must be a multiple of group_size=128",
         dict(x=x_for(2, 192, torch.float16, gen), qweight=qw.qweight[:, :24].contiguous(), group_size=128)),
        (TypeError, "scales must have the activation dtype", dict(scales=qw.scales.bfloat16())),
        (ValueError, r"scales must have shape \[N, K // G\] = \[64, 4\]", dict(scales=qw.scales[:, :3].contiguous())),
        (ValueError, "scales must be contiguous", dict(scales=qw.scales.t().contiguous().t())),
        (TypeError, "zeros must be uint8", dict(zeros=qw.zeros.int())),
        (ValueError, r"zeros must have shape \[N, K // G\] = \[64, 4\]", dict(zeros=qw.zeros[:32].contiguous())),
        (ValueError, r"bias must have shape \[N\] = \[64\]", dict(bias=torch.zeros(63, device="cuda").half())),
        (TypeError, "bias must have the activation dtype", dict(bias=torch.zeros(64, device="cuda"))),
        (ValueError, f"takes 1..{max_rows} activation rows .* got M={max_rows + 1}",
         dict(x=x_for(max_rows + 1, 256, torch.float16, gen))),
        (ValueError, r"x must have at least one row, got shape \[0, 256\]", dict(x=x[:0])),
        (ValueError, "16-byte boundary", dict(x=torch.randn(2 * 256 + 1, device="cuda").half()[1:].view(2, 256))),
        (NotImplementedError, "CPU", dict(x=x.cpu(), qweight=qw.qweight.cpu(), scales=qw.scales.cpu(),
                                          zeros=qw.zeros.cpu())),
        (ValueError, "all operands must be on x's device", dict(scales=qw.scales.cpu())),
    ]
    for error, message, changes in cases:
        with pytest.raises(error, match=message):
            call(**changes)


@pytest.mark.alone
def test_opcheck_and_graph_capture(generator):
    gen = _seeded(generator)
    qw = gpu_weight(256, 1024, 128, "uint4", torch.bfloat16, gen)
    x = x_for(3, 1024, torch.bfloat16, gen)
    bias = torch.randn(256, device="cuda", generator=gen).bfloat16()
    torch.library.opcheck(torch.ops.w4a16.skinny_gemm.default, (x, qw.qweight, qw.scales, qw.zeros, bias, 128),
                          test_utils=("test_schema", "test_faketensor"))
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    skinny.skinny_gemm(static_x, qw, bias)  # warm up outside the capture
    with torch.cuda.graph(graph):
        out = skinny.skinny_gemm(static_x, qw, bias)
    for _ in range(2):
        static_x.copy_(x_for(3, 1024, torch.bfloat16, gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, static_x, qw, bias)
