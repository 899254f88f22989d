import pytest
import torch
import w4a16_testing
from w4a16_testing import full_precision_reductions, random_weight

import w4a16
from w4a16.layout import GROUP_SIZES


def _float64_gemm(x, qw, bias):
    """An independent spelling of the spec in float64: per-element loops over the packed words."""
    words = qw.qweight.to(torch.int64) & 0xFFFFFFFF
    k = torch.arange(qw.k)
    shifts = (k % 8 // 2) * 4 + (k % 8 % 2) * 16
    q = (words[:, k // 8] >> shifts) & 0xF
    z = 8 if qw.zeros is None else qw.zeros.to(torch.int64)[:, k // qw.group_size]
    w = (q - z).double() * qw.scales.double()[:, k // qw.group_size]
    y = x.double() @ w.t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_gemm_matches_float64(symmetric, group_size, with_bias, generator):
    qw = random_weight(40, 2 * group_size, group_size, symmetric, torch.float32, generator=generator)
    x = torch.randn(3, 5, qw.k, generator=generator)
    bias = torch.randn(qw.n, generator=generator) if with_bias else None
    y = w4a16.reference_gemm(x, qw, bias)
    assert y.shape == (3, 5, 40) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _float64_gemm(x.reshape(-1, qw.k), qw, bias).reshape(3, 5, 40),
                               rtol=1e-5, atol=1e-5)


def _assert_rounded_once(y: torch.Tensor, exact: torch.Tensor, x: torch.Tensor, w_abs: torch.Tensor) -> None:
    """y is exact (float64) rounded once to y's dtype, after an fp32 accumulation: within half an ulp of y, plus
    fp32's accumulation error bound (K * 2^-24 of sum |x| |w|). A reference that rounded the weight or the
    products to 16 bits is off by far more."""
    half_ulp = (torch.nextafter(y.abs(), torch.tensor(float("inf"), dtype=y.dtype)) - y.abs()).double() / 2
    accumulation = x.shape[-1] * 2.0**-24 * (x.double().abs() @ w_abs.t())
    err = (y.double() - exact).abs()
    assert (err <= half_ulp + accumulation).all(), (err - half_ulp - accumulation).max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_reference_gemm_returns_the_activation_dtype_rounded_once(dtype, symmetric, generator):
    qw = random_weight(16, 512, 128, symmetric, dtype, generator=generator)
    x = torch.randn(2, qw.k, generator=generator).to(dtype)
    y = w4a16.reference_gemm(x, qw)
    assert y.dtype == dtype
    _assert_rounded_once(y, _float64_gemm(x, qw, None), x, w4a16.dequantize(qw, torch.float64).abs())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float64_accumulation_is_the_more_exact_reference(dtype, generator):
    """accumulate=float64 (the accuracy gate's control) is closer to the float64 spelling than fp32 accumulation,
    and lands on the nearest 16-bit value of it."""
    qw = random_weight(64, 4096, 128, False, dtype, generator=generator)
    x = torch.randn(4, qw.k, generator=generator).to(dtype)
    exact = _float64_gemm(x, qw, None)
    y64 = w4a16.reference_gemm(x, qw, accumulate=torch.float64)
    assert y64.dtype == dtype and torch.equal(y64, exact.to(dtype))
    _assert_rounded_once(w4a16.reference_gemm(x, qw), exact, x, w4a16.dequantize(qw, torch.float64).abs())
    with pytest.raises(ValueError, match="accumulate must be torch.float32 or torch.float64"):
        w4a16.reference_gemm(x, qw, accumulate=torch.float16)


def test_reference_gemm_accumulates_in_float32_by_default(generator):
    """The default is the fp32 reference every kernel is compared with, not the accuracy gate's float64 control.
    float32 activations: 16-bit outputs mostly round both sums to the same value."""
    qw = random_weight(32, 2048, 128, False, torch.float32, generator=generator)
    x = torch.randn(4, qw.k, generator=generator)
    fp32 = x @ w4a16.dequantize(qw).t()  # spelled out: fp32 weights, fp32 products and sums
    fp64 = w4a16.reference_gemm(x, qw, accumulate=torch.float64)
    assert not torch.equal(fp32, fp64), "the data must tell the two accumulations apart"
    assert torch.equal(w4a16.reference_gemm(x, qw), fp32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_gemm_adds_a_float32_bias_before_rounding_to_the_activation_dtype(dtype, generator):
    """A float32 bias is added in the accumulation dtype, rounded once with the rest: rounding it to x's dtype
    first rounds twice, up to a whole ulp off where the bias dominates the output."""
    qw = random_weight(64, 256, 64, True, dtype, generator=generator)
    x = torch.randn(8, qw.k, generator=generator).to(dtype)
    bias = torch.randn(qw.n, generator=generator) * 64  # float32, mostly not representable in x's dtype
    assert not torch.equal(bias, bias.to(dtype).float())
    y = w4a16.reference_gemm(x, qw, bias)
    assert y.dtype == dtype
    _assert_rounded_once(y, _float64_gemm(x, qw, bias), x, w4a16.dequantize(qw, torch.float64).abs())


def test_dequantize_subtracts_zero_then_scales():
    q = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 15] * 4])
    zeros = torch.tensor([[3]])
    qw = w4a16.QuantizedWeight(w4a16.pack_int4(q), torch.tensor([[0.5]]), zeros, group_size=32)
    assert torch.equal(w4a16.dequantize(qw), ((q - 3) * 0.5).float())
    sym = w4a16.QuantizedWeight(w4a16.pack_int4(q), torch.tensor([[2.0]]), None, group_size=32)
    assert torch.equal(w4a16.dequantize(sym, torch.float16), ((q - 8) * 2.0).half())


def test_float64_dequantization_is_exact_with_float32_scales():
    """(q - z) * s formed in float64: in fp32, 15 * (1 + 2^-23) would round to 15 + 2 * 2^-23."""
    q = torch.tensor([[15, 1] * 16])
    s = torch.tensor([[1 + 2.0**-23]])
    qw = w4a16.QuantizedWeight(w4a16.pack_int4(q), s, torch.zeros(1, 1, dtype=torch.uint8), group_size=32)
    exact = q.double() * (1 + 2.0**-23)
    assert not torch.equal(exact.float().double(), exact), "the product must not be representable in fp32"
    assert torch.equal(w4a16.dequantize(qw, torch.float64), exact)


@pytest.mark.parametrize(
    "make_args, error, match",
    [
        (lambda qw: (torch.zeros(2, 64), qw, None), ValueError, "last dim must equal K=128"),
        (lambda qw: (torch.zeros(2, 128, dtype=torch.int32), qw, None), TypeError, "x must be a float16"),
        (lambda qw: (torch.zeros(2, 128), qw, torch.zeros(3)), ValueError, r"bias must be a tensor of shape \[N\]"),
        (lambda qw: (torch.zeros(2, 128), "weight", None), TypeError, "qw must be a QuantizedWeight"),
        (lambda qw: (torch.ones(2, 128, dtype=torch.float64), qw, None), TypeError,
         "x must be a float16, bfloat16 or float32 tensor, got torch.float64"),
        (lambda qw: (torch.tensor(1.0), qw, None), ValueError, r"x's last dim must equal K=128, got x of shape \(\)"),
        # no second device on a CPU-only run: the meta device stands in for one
        (lambda qw: (torch.ones(2, 128, device="meta"), qw, None), ValueError, "x is on meta but the weight is on cpu"),
        (lambda qw: (torch.ones(2, 128), qw, torch.ones(16, device="meta")), ValueError,
         "bias is on meta but x is on cpu"),
    ],
)
def test_reference_gemm_rejects_bad_input(make_args, error, match):
    qw = random_weight(16, 128, 128, True, torch.float32)
    with pytest.raises(error, match=match):
        w4a16.reference_gemm(*make_args(qw))


@pytest.mark.parametrize("symmetric", [True, False])
def test_random_weight_puts_every_value_in_play(symmetric, generator):
    """Every kernel test draws its weights here: a kernel that ignores zero points, or reads one group's scale for
    all, passes on data whose zero points are all 8 or whose scales are all equal. Pin the spread."""
    qw = random_weight(64, 512, 32, symmetric, torch.float16, generator=generator)
    assert set(w4a16.unpack_int4(qw.qweight).unique().tolist()) == set(range(16))
    assert (qw.scales.double().std(dim=1) > 0).all(), "scales vary within every row"
    assert (qw.scales != 0).all()
    assert (qw.scales > 0).any() and (qw.scales < 0).any(), "scales of both signs"
    if not symmetric:
        assert set(qw.zeros.unique().tolist()) == set(range(16))
        assert (qw.zeros.double().std(dim=1) > 0).all(), "zero points vary within every row"


def test_the_tolerance_rule_times_torch_with_fp32_reductions():
    """The rule's plain matmul must be torch at its most exact: with 16-bit split-K reductions allowed (cuBLAS's
    default) its error, and so the kernel's bound, grows. The flags come back afterwards, also on an error."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction
    with pytest.raises(RuntimeError, match="inside"), full_precision_reductions():
        assert not matmul.allow_fp16_reduced_precision_reduction
        assert not matmul.allow_bf16_reduced_precision_reduction
        raise RuntimeError("inside")
    assert (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction) == saved


def test_the_tolerance_rules_matmul_runs_with_fp32_reductions(monkeypatch, generator):
    matmul, seen, torch_matmul = torch.backends.cuda.matmul, [], torch.matmul

    def recording_matmul(*args):
        seen.append((matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction))
        return torch_matmul(*args)

    monkeypatch.setattr(torch, "matmul", recording_matmul)
    qw = random_weight(16, 128, 64, False, torch.float16, generator=generator)
    x = torch.randn(3, 128, generator=generator).half()
    w4a16_testing.assert_matches_reference(w4a16.reference_gemm(x, qw), x, qw)
    assert seen == [(False, False)]
