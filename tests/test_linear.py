"""W4A16Linear: against reference_gemm, state_dict round trips, dtype casts, repr, bad input."""

from __future__ import annotations

import io
import itertools

import pytest
import torch
from w4a16_testing import assert_matches_reference, random_weight

import w4a16
from w4a16 import W4A16Linear

CASES = [c for c in itertools.product([32, 64, 128], [True, False], [True, False],
                                      [torch.float32, torch.float16, torch.bfloat16])
         if c[0] != 64 or c[3] != torch.float32]  # trim: every value of each axis still appears


@pytest.mark.parametrize(("group_size", "symmetric", "with_bias", "dtype"), CASES)
def test_from_linear_matches_the_reference(group_size, symmetric, with_bias, dtype, generator):
    linear = torch.nn.Linear(256, 40, bias=with_bias, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 256, generator=generator) * 0.05)
        if with_bias:
            linear.bias.copy_(torch.randn(40, generator=generator))
    module = W4A16Linear.from_linear(linear, group_size, symmetric)
    assert module.scales.dtype == dtype and module.symmetric == symmetric and module.group_size == group_size
    qw = module.quantized_weight()
    expected = w4a16.quantize(linear.weight.detach(), group_size, symmetric)
    assert torch.equal(qw.qweight, expected.qweight) and torch.equal(qw.scales, expected.scales)
    assert (qw.zeros is None) == symmetric and (symmetric or torch.equal(qw.zeros, expected.zeros))
    assert (module.bias is None) == (not with_bias) and (not with_bias or torch.equal(module.bias, linear.bias))
    x = torch.randn(2, 3, 256, generator=generator).to(dtype)
    y = module(x)
    assert_matches_reference(y, x, qw, module.bias)
    # Against the float layer itself: round to nearest moves each weight by at most half its group's step, so
    # |y - linear(x)| <= sum_k |x_k| * step_k / 2, plus the rounding of the 16-bit output and its inputs.
    steps = qw.scales.double().abs().repeat_interleave(group_size, dim=1)
    with torch.no_grad():
        exact = linear.double()(x.double())
    bound = x.double().abs() @ (steps / 2).t()
    slack = 1e-2 * (x.double().abs() @ linear.weight.double().abs().t()) + 1e-2 * exact.abs() + 1e-6
    assert ((y.double() - exact).abs() <= 1.01 * bound + slack).all()


@pytest.mark.parametrize("symmetric", [True, False])
def test_unloaded_module_is_a_zero_weight_with_every_buffer_on_its_device(symmetric, generator):
    module = W4A16Linear(128, 8, symmetric=symmetric, dtype=torch.float32)
    x = torch.randn(3, 128, generator=generator)
    assert torch.equal(module(x), torch.zeros(3, 8)), "placeholders: every nibble 8, scale 1, zero point 8, bias 0"
    on_meta = W4A16Linear(128, 8, symmetric=symmetric, device="meta")
    devices = {name: buffer.device.type for name, buffer in on_meta.named_buffers()}
    assert devices == dict.fromkeys(["qweight", "scales", "bias"] + ([] if symmetric else ["zeros"]), "meta"), devices


def test_constructor_and_from_linear_defaults():
    module = W4A16Linear(256, 8)
    assert (module.group_size, module.symmetric, module.bias is not None, module.scales.dtype, module.backend) == (
        128, True, True, torch.float16, "auto"), repr(module)
    module = W4A16Linear.from_linear(torch.nn.Linear(256, 8))
    assert (module.group_size, module.symmetric, module.backend) == (128, True, "auto"), repr(module)


@pytest.mark.parametrize("symmetric", [True, False])
def test_state_dict_round_trip(symmetric, generator):
    qw = random_weight(24, 128, 32, symmetric, torch.bfloat16, generator=generator)
    bias = torch.randn(24, generator=generator).bfloat16()
    module = W4A16Linear.from_quantized(qw, bias)
    state = module.state_dict()
    assert set(state) == ({"qweight", "scales", "bias"} | (set() if symmetric else {"zeros"}))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = W4A16Linear(128, 24, bias=True, group_size=32, symmetric=symmetric, dtype=torch.bfloat16)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    x = torch.randn(5, 128, generator=generator).bfloat16()
    assert torch.equal(fresh(x), module(x))
    for name in state:
        assert torch.equal(getattr(fresh, name), getattr(module, name)), name


def test_state_dict_of_the_other_format_is_refused(generator):
    asym = W4A16Linear.from_quantized(random_weight(16, 128, 128, False, torch.float16, generator=generator))
    with pytest.raises(RuntimeError, match="zeros"):
        W4A16Linear(128, 16, bias=False, symmetric=True).load_state_dict(asym.state_dict())


def test_state_dict_with_zero_points_outside_0_to_15_is_refused(generator):
    asym = W4A16Linear.from_quantized(random_weight(16, 128, 32, False, torch.float16, generator=generator))
    state = asym.state_dict()
    state["zeros"] = state["zeros"].clone()
    state["zeros"][3, 1] = 16
    fresh = W4A16Linear(128, 16, bias=False, group_size=32, symmetric=False)
    with pytest.raises(ValueError, match=r"zeros values must lie in 0..15, got min \d+ and max 16"):
        fresh.load_state_dict(state)
    nested = torch.nn.Sequential(fresh)
    with pytest.raises(ValueError, match=r"0\.zeros values must lie in 0..15"):
        nested.load_state_dict({f"0.{name}": tensor for name, tensor in state.items()})


def test_from_quantized_casts_scales_once(generator):
    qw = random_weight(16, 256, 128, False, torch.float32, generator=generator)
    bias = torch.randn(16, generator=generator)
    module = W4A16Linear.from_quantized(qw, bias, dtype=torch.float16)
    assert module.scales.dtype == torch.float16 and module.bias.dtype == torch.float16
    assert module.qweight.data_ptr() != qw.qweight.data_ptr(), "the module owns copies of its buffers"
    # Against the weight it was given, cast here: not against the module's own buffers.
    x = torch.randn(3, 256, generator=generator).half()
    assert_matches_reference(module(x), x, qw.to(dtype=torch.float16), bias.half())


def test_from_quantized_owns_copies_of_its_buffers_without_a_cast(generator):
    qw = random_weight(16, 128, 32, False, torch.float16, generator=generator)
    bias = torch.randn(16, generator=generator).half().requires_grad_()
    module = W4A16Linear.from_quantized(qw, bias)  # same dtype: no cast that would copy as a side effect
    for name in ("qweight", "scales", "zeros"):
        assert getattr(module, name).data_ptr() != getattr(qw, name).data_ptr(), f"{name} aliases the QuantizedWeight"
    assert module.bias.data_ptr() != bias.data_ptr(), "bias aliases the tensor it was given"
    assert not module.bias.requires_grad, "the bias buffer is detached from the tensor it was given"


def test_from_quantized_puts_the_bias_on_the_weights_device(generator):
    qw = random_weight(16, 128, 32, True, torch.float16, device="meta", generator=generator)
    module = W4A16Linear.from_quantized(qw, torch.randn(16, generator=generator))
    assert module.bias.device.type == "meta" and module.bias.dtype == torch.float16, module.bias


def test_module_to_dtype_casts_scales_and_bias_but_not_the_packed_weight(generator):
    qw = random_weight(16, 128, 64, False, torch.float16, generator=generator)
    bias = torch.randn(16, generator=generator).half()
    module = W4A16Linear.from_quantized(qw, bias)
    module.to(torch.bfloat16)
    assert module.scales.dtype == torch.bfloat16 and module.bias.dtype == torch.bfloat16
    assert module.qweight.dtype == torch.int32 and module.zeros.dtype == torch.uint8
    x = torch.randn(2, 128, generator=generator).bfloat16()
    assert_matches_reference(module(x), x, qw.to(dtype=torch.bfloat16), bias.bfloat16())


def test_repr_names_shape_group_format_and_backend(generator):
    module = W4A16Linear.from_quantized(random_weight(48, 256, 64, False, torch.float16, generator=generator))
    text = repr(module)
    for part in ("in_features=256", "out_features=48", "group_size=64", "format=uint4", "backend=auto",
                 "reference on cpu", "bias=False", "dtype=torch.float16"):
        assert part in text, text
    module.backend = "reference"
    assert "backend=reference" in repr(module)
    assert "format=uint4b8" in repr(W4A16Linear(128, 8))
    text = repr(W4A16Linear(128, 8, device="meta"))
    assert text.endswith("backend=auto)"), f"no rule is named for a module on the meta device: {text}"


def test_backend_is_forced_per_module(generator):
    module = W4A16Linear.from_quantized(random_weight(16, 128, 128, True, torch.float16, generator=generator))
    module.backend = "skinny"  # no CPU build: the call says why
    with pytest.raises(RuntimeError, match="backend='skinny' is unavailable on cpu"):
        module(torch.randn(1, 128).half())
    assert W4A16Linear.from_linear(torch.nn.Linear(128, 8), backend="reference").backend == "reference"


def test_bad_arguments(generator):
    with pytest.raises(ValueError, match="group_size must be one of"):
        W4A16Linear(128, 8, group_size=16)
    with pytest.raises(ValueError, match="in_features=100 must be a positive multiple of group_size=32"):
        W4A16Linear(100, 8, group_size=32)
    with pytest.raises(ValueError, match="in_features=0 must be a positive multiple of group_size=128"):
        W4A16Linear(0, 8)
    with pytest.raises(ValueError, match="out_features must be positive, got 0"):
        W4A16Linear(128, 0)
    with pytest.raises(ValueError, match="backend must be one of"):
        W4A16Linear(128, 8, backend="fast")
    with pytest.raises(TypeError, match="symmetric must be True"):
        W4A16Linear(128, 8, symmetric="no")
    with pytest.raises(TypeError, match="linear must be an nn.Linear"):
        W4A16Linear.from_linear(torch.nn.Conv1d(1, 1, 1))
    with pytest.raises(ValueError, match="in_features=96 must be a multiple of group_size=128"):
        W4A16Linear.from_linear(torch.nn.Linear(96, 8))
    with pytest.raises(ValueError, match="linear's weight is on the meta device"):
        W4A16Linear.from_linear(torch.nn.Linear(128, 8, device="meta"))
    for group_size in (0, None):
        with pytest.raises(ValueError, match="group_size must be one of"):
            W4A16Linear.from_linear(torch.nn.Linear(128, 8), group_size=group_size)
    with pytest.raises(TypeError, match="out_features must be an int, got 8.5"):
        W4A16Linear(128, 8.5)
    with pytest.raises(TypeError, match="in_features must be an int, got 128.0"):
        W4A16Linear(128.0, 8)
    with pytest.raises(TypeError, match="out_features must be an int, got True"):
        W4A16Linear(128, True)
    with pytest.raises(TypeError, match="qw must be a QuantizedWeight, got Tensor"):
        W4A16Linear.from_quantized(torch.zeros(8, 16, dtype=torch.int32))
    qw = random_weight(8, 128, 128, True, torch.float16, generator=generator)
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \[N\] = \[8\], got \(7,\)"):
        W4A16Linear.from_quantized(qw, torch.zeros(7))
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \[N\] = \[8\], got list"):
        W4A16Linear.from_quantized(qw, [0.0] * 8)
    module = W4A16Linear(128, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"last dim must equal K=128, got x of shape \(2, 64\)"):
        module(torch.randn(2, 64).half())
    with pytest.raises(TypeError, match="scales are torch.float16 but x is torch.float32"):
        module(torch.randn(2, 128))


def test_torch_compile_of_a_module_stack(generator):
    stack = torch.nn.Sequential(
        W4A16Linear.from_quantized(random_weight(64, 128, 32, True, torch.float16, generator=generator)),
        torch.nn.SiLU(),
        W4A16Linear.from_quantized(random_weight(128, 64, 64, False, torch.float16, generator=generator)),
    )
    compiled = torch.compile(stack, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 128, generator=generator).half()
    assert torch.equal(compiled(x), stack(x))
