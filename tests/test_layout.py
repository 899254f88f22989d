import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import w4a16
from w4a16.layout import SEQUENTIAL_ORDER, SHUFFLE_ORDER, pack_nibbles


def test_shuffle_order_matches_the_spec_shifts():
    # k-offset j sits at bit shift (j // 2) * 4 + (j % 2) * 16.
    for j in range(8):
        q = torch.zeros(1, 8, dtype=torch.int32)
        q[0, j] = 0xF
        word = w4a16.pack_int4(q).item() & 0xFFFFFFFF
        assert word == 0xF << ((j // 2) * 4 + (j % 2) * 16)
    assert SHUFFLE_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)


def test_pair_mask_yields_natural_k_order():
    q = torch.arange(8, dtype=torch.int32).reshape(1, 8) + 3
    word = w4a16.pack_int4(q).item() & 0xFFFFFFFF
    for p in range(4):
        pair = (word >> (4 * p)) & 0x000F000F
        assert (pair & 0xFFFF, pair >> 16) == (q[0, 2 * p].item(), q[0, 2 * p + 1].item())


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 9), words=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(n, words, seed):
    q = torch.randint(0, 16, (n, 8 * words), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    packed = w4a16.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (n, words)
    assert torch.equal(w4a16.unpack_int4(packed).to(torch.int64), q)


def test_unpack_handles_the_sign_bit():
    q = torch.full((2, 8), 15, dtype=torch.uint8)
    packed = w4a16.pack_int4(q)
    assert (packed == -1).all()  # 0xFFFFFFFF as int32
    assert torch.equal(w4a16.unpack_int4(packed), q)


@pytest.mark.parametrize(
    "q, error, match",
    [
        (torch.tensor([[16] + [0] * 7]), ValueError, "0..15"),
        (torch.tensor([[-1] + [0] * 7]), ValueError, "0..15"),
        (torch.zeros(2, 12, dtype=torch.int32), ValueError, "multiple of 8"),
        (torch.zeros(2, 8), TypeError, "integer"),
        (torch.zeros(8, dtype=torch.int32), ValueError, "2-D"),
    ],
)
def test_pack_rejects_bad_input(q, error, match):
    with pytest.raises(error, match=match):
        w4a16.pack_int4(q)


def test_empty_tensors_pack_and_unpack():
    # No values to range-check: an empty tensor packs to an empty one (min/max of nothing would raise).
    packed = w4a16.pack_int4(torch.zeros(0, 16, dtype=torch.uint8))
    assert packed.dtype == torch.int32 and packed.shape == (0, 2)
    assert w4a16.unpack_int4(packed).shape == (0, 16)


def test_pack_nibbles_rejects_a_scalar():
    # pack_nibbles takes any leading dims (the checkpoint converters use it), but it needs a last dim to pack.
    with pytest.raises(ValueError, match=r"last dim must be a multiple of 8, got shape \(\)"):
        pack_nibbles(torch.tensor(3), SEQUENTIAL_ORDER)


@pytest.mark.parametrize(
    "qweight, error, match",
    [
        (torch.zeros(2, 2, dtype=torch.int64), TypeError, "int32"),
        (torch.zeros(4, dtype=torch.int32), ValueError, r"must be 2-D \[N, K // 8\], got shape \(4,\)"),
    ],
)
def test_unpack_rejects_bad_input(qweight, error, match):
    with pytest.raises(error, match=match):
        w4a16.unpack_int4(qweight)


def _parts(n=16, k=256, g=128):
    return torch.zeros(n, k // 8, dtype=torch.int32), torch.ones(n, k // g, dtype=torch.float16)


def test_quantized_weight_properties():
    qweight, scales = _parts()
    qw = w4a16.QuantizedWeight(qweight, scales)  # group_size defaults to 128
    assert (qw.n, qw.k, qw.group_size, qw.symmetric, qw.format) == (16, 256, 128, True, "uint4b8")
    zeros = torch.full((16, 2), 3, dtype=torch.int32)
    asym = w4a16.QuantizedWeight(qweight, scales, zeros, group_size=128)
    assert not asym.symmetric and asym.zeros.dtype == torch.uint8
    from_floats = w4a16.QuantizedWeight(qweight, scales, zeros.float(), group_size=128)  # integer-valued
    assert torch.equal(from_floats.zeros, torch.full((16, 2), 3, dtype=torch.uint8))
    moved = asym.to("cpu", dtype=torch.bfloat16)
    assert torch.equal(moved.scales, torch.ones(16, 2, dtype=torch.bfloat16))
    assert torch.equal(moved.zeros, torch.full((16, 2), 3, dtype=torch.uint8))
    assert torch.equal(moved.qweight, torch.zeros(16, 32, dtype=torch.int32))
    on_meta = asym.to("meta")  # no values to check there: a model built on the meta device, filled later
    assert on_meta.zeros.device.type == "meta" and on_meta.scales.shape == (16, 2)
    assert asym.to(torch.bfloat16).scales.dtype == torch.bfloat16  # a dtype alone, as Tensor.to takes it
    assert "N=16" in repr(qw) and "K=256" in repr(qw)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"qweight": torch.zeros(16, 32)}, TypeError, "qweight must be an int32"),
        ({"qweight": torch.zeros(16, 0, dtype=torch.int32)}, ValueError, "non-empty"),
        ({"qweight": torch.zeros(0, 32, dtype=torch.int32)}, ValueError, "non-empty"),
        ({"group_size": 16}, ValueError, r"group_size must be one of \(32, 64, 128\)"),
        ({"group_size": 128.0}, ValueError, r"group_size must be one of \(32, 64, 128\), got 128\.0 \(float"),
        ({"qweight": torch.zeros(16, 20, dtype=torch.int32)}, ValueError, "K=160 must be a multiple of group_size=128"),
        ({"scales": torch.ones(16, 3, dtype=torch.float16)}, ValueError, r"scales must have shape \[N, K // G\] = \[16, 2\]"),
        ({"scales": torch.ones(16, 2, dtype=torch.int32)}, TypeError, "scales must be a float16"),
        ({"scales": torch.ones(16, 2, dtype=torch.float16, device="meta")}, ValueError,
         "scales are on meta but qweight is on cpu"),
        ({"zeros": [[3, 3]] * 16}, TypeError, "zeros must be a tensor or None, got list"),
        ({"zeros": torch.zeros(16, 3, dtype=torch.int32)}, ValueError, r"zeros must have shape"),
        ({"zeros": torch.zeros(16, 2, dtype=torch.uint8, device="meta")}, ValueError,
         "zeros are on meta but qweight is on cpu"),
        ({"zeros": torch.full((16, 2), 16, dtype=torch.int32)}, ValueError, "zeros values must lie in 0..15"),
        ({"zeros": torch.full((16, 2), 2.5)}, ValueError, "integer-valued"),
    ],
)
def test_quantized_weight_validation(kwargs, error, match):
    qweight, scales = _parts()
    args = {"qweight": qweight, "scales": scales, "zeros": None, "group_size": 128} | kwargs
    with pytest.raises(error, match=match):
        w4a16.QuantizedWeight(**args)


def test_quantized_weight_holds_contiguous_tensors_and_copies_strided_ones(generator):
    """The kernels index qweight, scales and zeros as dense row-major arrays: strided ones are made contiguous
    once here (same values); contiguous ones are held, not copied."""
    qweight = torch.randint(-(2**31), 2**31 - 1, (16, 32), generator=generator, dtype=torch.int32)
    scales = torch.rand(2, 16, generator=generator).half().t()
    zeros = torch.randint(0, 16, (2, 16), generator=generator, dtype=torch.uint8).t()
    assert not scales.is_contiguous() and not zeros.is_contiguous()
    qw = w4a16.QuantizedWeight(qweight, scales, zeros, group_size=128)
    assert qw.scales.is_contiguous() and torch.equal(qw.scales, scales), "strided scales must be copied"
    assert qw.zeros.is_contiguous() and torch.equal(qw.zeros, zeros), "strided zeros must be copied"
    held = w4a16.QuantizedWeight(qweight, qw.scales, qw.zeros, group_size=128)
    assert held.qweight is qweight and held.scales is qw.scales and held.zeros is qw.zeros
