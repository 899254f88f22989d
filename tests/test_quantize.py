import pytest
import torch

import w4a16
from w4a16.layout import GROUP_SIZES


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_to_nearest_error_is_within_half_a_step(symmetric, group_size, dtype, generator):
    w = (torch.randn(24, 4 * group_size, generator=generator) * 0.05).to(dtype)
    qw = w4a16.quantize(w, group_size=group_size, symmetric=symmetric)
    assert qw.symmetric == symmetric and qw.scales.dtype == dtype and qw.group_size == group_size
    err = (w4a16.dequantize(qw) - w.float()).abs().reshape(24, -1, group_size)
    step = qw.scales.float().unsqueeze(-1)
    # RTN: half a step, the extreme values included (the scale is rounded up to its dtype, so none is clamped
    # further), give or take float32's rounding of w / s.
    assert (err <= step * 0.5 * (1 + 2**-16)).all(), f"{(err / step).max().item():.6f} of a step"
    assert err.mean() < 0.3 * step.mean()


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive", "negative"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_groups_of_one_sign_are_within_half_a_step(sign, symmetric, generator):
    """The code range always holds 0 (an asymmetric group of one sign gets zero point 0 or 15), and RTN stays
    within half a step there too; every row's groups are of one sign, unlike random data's."""
    w = sign * (torch.rand(16, 256, generator=generator) * 0.04 + 0.01)
    qw = w4a16.quantize(w, group_size=64, symmetric=symmetric)
    if not symmetric:
        assert (qw.zeros == (0 if sign > 0 else 15)).all(), qw.zeros
    err = (w4a16.dequantize(qw) - w).abs().reshape(16, -1, 64)
    step = qw.scales.float().unsqueeze(-1)
    assert (err <= step * 0.5 * (1 + 2**-16)).all(), f"{(err / step).max().item():.6f} of a step"


def test_float64_weights_get_float32_scales(generator):
    w = torch.randn(8, 128, generator=generator, dtype=torch.float64)
    qw = w4a16.quantize(w, group_size=64, symmetric=False)
    assert qw.scales.dtype == torch.float32
    err = (w4a16.dequantize(qw) - w.float()).abs().reshape(8, -1, 64)
    assert (err <= qw.scales.unsqueeze(-1) * 0.5 * (1 + 2**-16)).all()


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scales_are_rounded_up_to_their_dtype(symmetric, dtype, generator):
    # Rounded to nearest, about half the 16-bit scales come out below max|w| / 7.5 (or the range / 15), and the
    # group's largest value lands past code 15: up to 0.526 of a step off with bf16 scales.
    w = (torch.randn(64, 1024, generator=generator) * 0.05).to(dtype)
    qw = w4a16.quantize(w, 128, symmetric)
    groups = w.float().reshape(64, 8, 128)
    exact = (groups.abs().amax(-1) / 7.5 if symmetric
             else groups.amax(-1).clamp(min=0) / 15 - groups.amin(-1).clamp(max=0) / 15)
    stored = qw.scales.float()
    assert (stored >= exact).all()
    below = exact.to(dtype).float() < exact
    assert below.float().mean() > 0.25, "the data must have scales that rounding to nearest would lower"
    # One ulp up from the nearest rounding where that was below, the same value elsewhere.
    assert torch.equal(stored[~below], exact.to(dtype).float()[~below])
    assert (stored[below] > exact.to(dtype).float()[below]).all()


def test_quantize_uses_the_whole_code_range(generator):
    w = torch.randn(64, 256, generator=generator)
    for symmetric in (True, False):
        q = w4a16.unpack_int4(w4a16.quantize(w, 128, symmetric).qweight)
        assert q.min() == 0 and q.max() == 15


def test_all_zero_groups_dequantize_to_zero():
    w = torch.zeros(8, 128)
    for symmetric in (True, False):
        assert torch.equal(w4a16.dequantize(w4a16.quantize(w, 128, symmetric)), w)


@pytest.mark.parametrize("symmetric", [True, False])
def test_an_all_zero_group_gets_scale_one_and_codes_equal_to_its_zero_point(symmetric, generator):
    """The documented choice for a group with nothing to scale: s = 1 and q = z, next to groups that have values.
    (A scale of 0 would divide 0 by 0 and store whatever NaN casts to.)"""
    w = torch.randn(8, 256, generator=generator)
    w[:, 64:128] = 0.0  # group 1 of every row
    w[3, 192:] = 0.0  # and one more
    qw = w4a16.quantize(w, 64, symmetric)
    zero = torch.zeros(8, 4, dtype=torch.bool)
    zero[:, 1] = zero[3, 3] = True
    assert torch.equal(qw.scales[zero], torch.ones(int(zero.sum()))), qw.scales[zero]
    assert (qw.scales[~zero] < 1).all(), "the other groups' scales are below 1 (|w| < 7.5 here)"
    q = w4a16.unpack_int4(qw.qweight).reshape(8, 4, 64)
    assert torch.equal(q[zero], qw.zero_points()[zero].unsqueeze(-1).expand(-1, 64))
    assert torch.equal(w4a16.dequantize(qw).reshape(8, 4, 64)[zero], torch.zeros(int(zero.sum()), 64))


def test_a_group_that_dequantizes_exactly_to_fp16s_largest_is_accepted(generator):
    """The overflow refusal is strict: 65504 - (-57312) over 15 rounds up to the scale 8188, and the largest value
    comes back as (15 - 7) * 8188 = 65504 exactly, finite, so it is kept. Only beyond the largest is refused."""
    w = (torch.rand(4, 128, generator=generator) * 110000 - 50000).half()  # inside [-57312, 65504]
    w[:, 0], w[:, 1] = 65504.0, -57312.0
    qw = w4a16.quantize(w, 128, symmetric=False)
    assert torch.equal(qw.scales, torch.full((4, 1), 8188.0, dtype=torch.float16))
    assert torch.equal(qw.zeros, torch.full((4, 1), 7, dtype=torch.uint8))
    deq = w4a16.dequantize(qw)
    assert torch.equal(deq[:, 0], torch.full((4,), 65504.0)) and torch.isfinite(deq.half()).all()
    assert ((deq - w.float()).abs() <= 8188 / 2).all()


def test_quantize_defaults_to_symmetric_groups_of_128(generator):
    w = torch.randn(16, 512, generator=generator)
    qw = w4a16.quantize(w)
    assert qw.group_size == 128 and qw.symmetric and qw.scales.shape == (16, 4)
    explicit = w4a16.quantize(w, 128, True)
    assert torch.equal(qw.qweight, explicit.qweight) and torch.equal(qw.scales, explicit.scales)


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantizing_a_parameter_that_requires_grad_stores_plain_tensors(symmetric, generator):
    """nn.Linear weights require grad: the stored scales must not carry the autograd graph back to them."""
    w = torch.nn.Parameter(torch.randn(16, 256, generator=generator))
    qw = w4a16.quantize(w, 64, symmetric)
    assert not qw.scales.requires_grad and qw.scales.grad_fn is None
    plain = w4a16.quantize(w.detach().clone(), 64, symmetric)
    assert torch.equal(qw.qweight, plain.qweight) and torch.equal(qw.scales, plain.scales)


def test_a_group_whose_scale_is_below_fp16s_smallest_subnormal_keeps_its_values():
    # max |w| / 7.5 (and the range / 15) is below fp16's smallest subnormal, 6e-8, where rounding to nearest would
    # give a scale of 0: rounded up it is that subnormal, and the values are 2 of its steps, exactly.
    w = torch.full((4, 128), 1.2e-7, dtype=torch.float16)
    w[:, ::2] = -1.2e-7
    smallest = torch.tensor(2.0**-24, dtype=torch.float16)
    for symmetric in (True, False):
        qw = w4a16.quantize(w, 128, symmetric)
        assert torch.equal(qw.scales, torch.full_like(qw.scales, smallest))
        assert torch.equal(w4a16.dequantize(qw), w.float())


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_groups_spanning_most_of_the_dtype_range_quantize_to_finite_weights(symmetric, dtype, generator):
    # The asymmetric range max - min overflows float32 here if computed as such.
    big = torch.finfo(dtype).max * 0.6
    w = (torch.randn(8, 128, generator=generator) * (big / 8)).to(dtype)
    w[:, 0], w[:, 1] = big, -big
    qw = w4a16.quantize(w, 128, symmetric)
    deq = w4a16.dequantize(qw)
    assert torch.isfinite(deq.to(dtype)).all()
    assert ((deq - w.float()).abs() <= qw.scales.float().repeat_interleave(128, dim=1) * 1.01).all()


@pytest.mark.parametrize(
    "w, group_size, error, match",
    [
        (torch.zeros(8, 128, dtype=torch.int32), 128, TypeError, "floating-point"),
        (torch.zeros(128), 128, ValueError, "2-D"),
        (torch.randn(2, 8, 128), 128, ValueError, r"w must be 2-D \[N, K\], got shape \(2, 8, 128\)"),
        (torch.empty(8, 128, device="meta"), 128, ValueError, "w is on the meta device"),
        (torch.zeros(8, 192), 128, ValueError, "K=192 must be a multiple of group_size=128"),
        (torch.zeros(8, 128), 96, ValueError, "group_size must be one of"),
        (torch.full((8, 128), float("nan")), 128, ValueError, "NaN"),
        (torch.full((8, 128), 1e300, dtype=torch.float64), 128, ValueError, "beyond float32's range"),
        (torch.full((8, 128), -torch.finfo(torch.float32).max), 128, ValueError, "would dequantize to inf"),
        # s = 61440 / 7.5 = 8192 exactly in fp16, and -7.5 rounds to -8: (0 - 8) * 8192 = -65536, past fp16's -65504
        (torch.full((8, 128), -61440.0, dtype=torch.float16), 128, ValueError, "too close to torch.float16's largest"),
    ],
)
def test_quantize_rejects_bad_input(w, group_size, error, match):
    with pytest.raises(error, match=match):
        w4a16.quantize(w, group_size=group_size)


@pytest.mark.parametrize("symmetric", ["no", "False", 0, 1, None])
def test_quantize_takes_symmetric_only_as_a_bool(symmetric):
    with pytest.raises(TypeError, match=rf"symmetric must be True \(uint4b8\) or False .* got {symmetric!r}"):
        w4a16.quantize(torch.randn(8, 128), symmetric=symmetric)
