"""Converters against an independent spelling of each checkpoint's bit layout, and round trips."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import w4a16
from w4a16 import formats

AWQ_SLOTS = [0, 2, 4, 6, 1, 3, 5, 7]  # slot i holds element AWQ_SLOTS[i]


def _pack_words(values: torch.Tensor, slot_element) -> torch.Tensor:
    """Pack the last dim, 8 per word, slot i <- element slot_element[i]; written with Python ints."""
    rows, cols = values.shape
    out = torch.empty(rows, cols // 8, dtype=torch.int32)
    for r in range(rows):
        for c in range(cols // 8):
            word = sum(int(values[r, 8 * c + slot_element[i]]) << (4 * i) for i in range(8))
            out[r, c] = word - (1 << 32) if word >= 1 << 31 else word
    return out


def _case(seed, n_words, k_groups, group_size, symmetric, min_zero=0):
    """Random nibbles, zero points min_zero..15 (GPTQ stores z - 1, so it cannot hold 0) and scales."""
    g = torch.Generator().manual_seed(seed)
    n, k = 8 * n_words, group_size * k_groups
    q = torch.randint(0, 16, (n, k), generator=g)
    zeros = None if symmetric else torch.randint(min_zero, 16, (n, k // group_size), generator=g)
    scales = torch.rand(n, k // group_size, generator=g).half() + 0.01
    return q, zeros, scales


cases = dict(seed=st.integers(0, 2**31 - 1), n_words=st.integers(1, 3), k_groups=st.integers(1, 2),
             group_size=st.sampled_from([32, 64, 128]), symmetric=st.booleans())


@settings(max_examples=200, deadline=None)
@given(**cases)
def test_awq_bits(seed, n_words, k_groups, group_size, symmetric):
    q, zeros, scales = _case(seed, n_words, k_groups, group_size, symmetric)
    z = torch.full_like(scales, 8, dtype=torch.int64) if zeros is None else zeros
    qweight, qzeros = _pack_words(q.t(), AWQ_SLOTS), _pack_words(z.t(), AWQ_SLOTS)  # packed along N
    qw = formats.from_awq(qweight, qzeros, scales.t().contiguous(), group_size)
    assert torch.equal(w4a16.unpack_int4(qw.qweight).long(), q)
    assert torch.equal(qw.zero_points().long(), z) and torch.equal(qw.scales, scales)
    assert not qw.symmetric  # AWQ always stores zero points: kept as given, all 8 included
    back = formats.to_awq(qw)
    assert torch.equal(back["qweight"], qweight) and torch.equal(back["qzeros"], qzeros)
    assert torch.equal(back["scales"], scales.t())


@settings(max_examples=200, deadline=None)
@given(**cases)
def test_gptq_bits(seed, n_words, k_groups, group_size, symmetric):
    q, zeros, scales = _case(seed, n_words, k_groups, group_size, symmetric, min_zero=1)
    z = torch.full_like(scales, 8, dtype=torch.int64) if zeros is None else zeros
    qweight = _pack_words(q, list(range(8))).t().contiguous()  # [K // 8, N], packed along K
    qzeros = _pack_words((z - 1).t(), list(range(8)))  # [K // G, N // 8], stored as z - 1
    g_idx = torch.arange(q.shape[1]) // group_size
    qw = formats.from_gptq(qweight, qzeros, scales.t().contiguous(), group_size, g_idx=g_idx)
    assert torch.equal(w4a16.unpack_int4(qw.qweight).long(), q)
    assert torch.equal(qw.zero_points().long(), z)
    assert qw.symmetric == bool((z == 8).all())
    back = formats.to_gptq(qw)
    assert torch.equal(back["qweight"], qweight) and torch.equal(back["qzeros"], qzeros)
    assert torch.equal(back["g_idx"].long(), g_idx)


@settings(max_examples=200, deadline=None)
@given(**cases)
def test_gptq_v2_bits(seed, n_words, k_groups, group_size, symmetric):
    # GPTQModel's v2 stores z itself: zero point 0 included, stored 15 is z = 15.
    q, zeros, scales = _case(seed, n_words, k_groups, group_size, symmetric, min_zero=0)
    z = torch.full_like(scales, 8, dtype=torch.int64) if zeros is None else zeros
    qweight = _pack_words(q, list(range(8))).t().contiguous()
    qzeros = _pack_words(z.t(), list(range(8)))
    qw = formats.from_gptq(qweight, qzeros, scales.t().contiguous(), group_size, checkpoint_format="gptq_v2")
    assert torch.equal(w4a16.unpack_int4(qw.qweight).long(), q)
    assert torch.equal(qw.zero_points().long(), z)
    back = formats.to_gptq(qw, checkpoint_format="gptq_v2")
    assert torch.equal(back["qweight"], qweight) and torch.equal(back["qzeros"], qzeros)


def test_gptq_v1_and_v2_read_the_same_qzeros_one_apart():
    qweight = torch.zeros(16, 16, dtype=torch.int32)
    qzeros = torch.full((2, 2), 0x76543210, dtype=torch.int32)  # stored 0..7 along N
    scales = torch.ones(2, 16).half()
    v1 = formats.from_gptq(qweight, qzeros, scales, 64).zero_points()
    v2 = formats.from_gptq(qweight, qzeros, scales, 64, checkpoint_format="gptq_v2").zero_points()
    assert torch.equal(v2[:8, 0].long(), torch.arange(8)) and torch.equal(v1.long(), v2.long() + 1)


@settings(max_examples=200, deadline=None)
@given(**cases)
def test_compressed_tensors_bits(seed, n_words, k_groups, group_size, symmetric):
    q, zeros, scales = _case(seed, n_words, k_groups, group_size, symmetric)
    packed = _pack_words(q, list(range(8)))  # [N, K // 8], sequential along K
    zp = None if zeros is None else _pack_words(zeros.t(), list(range(8))).t().contiguous()  # [N // 8, K // G]
    shape = torch.tensor(q.shape)
    qw = formats.from_compressed_tensors(packed, scales, shape, zp, group_size=group_size)
    assert torch.equal(w4a16.unpack_int4(qw.qweight).long(), q)
    assert qw.symmetric == symmetric
    if zeros is not None:
        assert torch.equal(qw.zeros.long(), zeros)
    assert formats.from_compressed_tensors(packed, scales, shape, zp).group_size == group_size  # inferred
    back = formats.to_compressed_tensors(qw)
    assert torch.equal(back["weight_packed"], packed) and torch.equal(back["weight_shape"], shape)
    assert (zp is None) == ("weight_zero_point" not in back)
    if zp is not None:
        assert torch.equal(back["weight_zero_point"], zp)


@pytest.mark.parametrize("symmetric", [True, False])
def test_every_format_dequantizes_to_the_same_weights(symmetric, generator):
    w = torch.randn(32, 256, generator=generator).half()
    qw = w4a16.quantize(w, 64, symmetric)
    if not symmetric:  # GPTQ v1 cannot store z = 0
        qw = w4a16.QuantizedWeight(qw.qweight, qw.scales, qw.zeros.clamp(min=1), 64)
    expected = w4a16.dequantize(qw)
    a, g, c = formats.to_awq(qw), formats.to_gptq(qw), formats.to_compressed_tensors(qw)
    converted = [
        formats.from_awq(a["qweight"], a["qzeros"], a["scales"], 64),
        formats.from_gptq(g["qweight"], g["qzeros"], g["scales"], 64, g["g_idx"]),
        formats.from_compressed_tensors(c["weight_packed"], c["weight_scale"], c["weight_shape"],
                                        c.get("weight_zero_point"), group_size=64),
    ]
    for other in converted:
        assert torch.equal(w4a16.dequantize(other), expected)


def _awq_parts(k=128, n=16, g=64):
    return torch.zeros(k, n // 8, dtype=torch.int32), torch.zeros(k // g, n // 8, dtype=torch.int32), torch.ones(k // g, n).half()


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: formats.from_awq(*_awq_parts(k=96), 64), ValueError, "K=96 must be a multiple of group_size=64"),
        (lambda: formats.from_awq(torch.zeros(128, 2), *_awq_parts()[1:], 64), TypeError, "qweight must be an int32"),
        (lambda: formats.from_awq(*_awq_parts()[:2], torch.ones(2, 8).half(), 64), ValueError, r"scales must have shape \[K // G, N\]"),
        (lambda: formats.from_gptq(torch.zeros(16, 16, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                                   torch.ones(2, 16).half(), 64, g_idx=torch.arange(128).flip(0) // 64),
         ValueError, "act-order"),
        (lambda: formats.from_gptq(torch.zeros(16, 16, dtype=torch.int32), torch.full((2, 2), -1, dtype=torch.int32),
                                   torch.ones(2, 16).half(), 64), ValueError, "zero point 16"),
        (lambda: formats.from_compressed_tensors(torch.zeros(16, 16, dtype=torch.int32), torch.ones(16, 2).half(),
                                                 (16, 256)), ValueError, r"weight_packed must have shape"),
        (lambda: formats.from_compressed_tensors(torch.zeros(16, 16, dtype=torch.int32), torch.ones(16, 3).half(),
                                                 (16, 128)), ValueError, "cannot infer group_size"),
        (lambda: formats.from_compressed_tensors(torch.zeros(16, 16, dtype=torch.int32), torch.ones(16, 2).half(),
                                                 (16, 128), group_size=32), ValueError, "weight_scale must have shape"),
        (lambda: formats.from_compressed_tensors(torch.zeros(16, 16, dtype=torch.int32), torch.ones(16, 2).half(),
                                                 (16, 128), weight_g_idx=torch.arange(128).flip(0) // 64),
         ValueError, "act-order"),
        # sorted, but groups of 63 and 65 columns: only k // G is the layout's grouping
        (lambda: formats.from_gptq(torch.zeros(16, 16, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                                   torch.ones(2, 16).half(), 64, g_idx=(torch.arange(128) >= 63).long()),
         ValueError, "act-order"),
        (lambda: formats.from_compressed_tensors(torch.zeros(16, 16, dtype=torch.int32), torch.ones(16, 2).half(),
                                                 (16, 127)), ValueError, "K=127 must be a multiple of 8"),
        (lambda: formats.from_compressed_tensors(torch.zeros(16, 16, dtype=torch.int32), torch.ones(16, 2).half(),
                                                 torch.tensor([1, 16, 128])), ValueError,
         r"weight_shape must be two positive integers \[N, K\], got \[1, 16, 128\]"),
        (lambda: formats.from_compressed_tensors(torch.zeros(16, 16, dtype=torch.int32), torch.ones(16, 2).half(),
                                                 (16, 128.5)), ValueError, "weight_shape must be two positive integers"),
        (lambda: formats.from_compressed_tensors(torch.zeros(16, 16, dtype=torch.int32), torch.ones(16, 2).half(),
                                                 torch.tensor(128)), ValueError,
         r"weight_shape must be two positive integers \[N, K\], got \[128\]"),
        # the trivial order as floats, off by a fraction: a cast to int would truncate it into agreement
        (lambda: formats.from_gptq(torch.zeros(16, 16, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                                   torch.ones(2, 16).half(), 64, g_idx=torch.arange(128) // 64 + 0.5),
         TypeError, "g_idx must be an integer tensor, got torch.float32"),
        (lambda: formats.from_compressed_tensors(torch.zeros(16, 16, dtype=torch.int32), torch.ones(16, 2).half(),
                                                 (16, 128), weight_g_idx=torch.arange(64) // 64),
         ValueError, r"g_idx must be a tensor of shape \[K\] = \[128\], got torch.Size\(\[64\]\)"),
        (lambda: formats.to_gptq(w4a16.QuantizedWeight(torch.zeros(8, 16, dtype=torch.int32), torch.ones(8, 1).half(),
                                                       torch.zeros(8, 1, dtype=torch.int32), 128)),
         ValueError, "zero point 0 cannot be represented"),
        (lambda: formats.from_gptq(torch.zeros(16, 16, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                                   torch.ones(2, 16).half(), 64, checkpoint_format="gptq_v3"),
         ValueError, r"checkpoint_format must be one of \['gptq', 'gptq_v2'\], got 'gptq_v3'"),
        (lambda: formats.to_gptq(w4a16.QuantizedWeight(torch.zeros(8, 16, dtype=torch.int32), torch.ones(8, 1).half(),
                                                       None, 128), checkpoint_format="v2"),
         ValueError, "checkpoint_format must be one of"),
    ],
)
def test_converters_reject_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_converters_keep_the_scales_dtype_and_store_the_checkpoints_dtypes(dtype, generator):
    """torch.equal compares values across dtypes, so the bit tests above cannot see a converter that casts the
    scales (bf16 to fp16 would lose range, fp32 would double the bytes) or stores the integer tensors in the wrong
    dtype: pinned here, both ways, for every format."""
    n, k, g = 16, 256, 64
    scales = (torch.rand(n, k // g, generator=generator) + 0.01).to(dtype)
    zeros = torch.randint(1, 16, (n, k // g), generator=generator, dtype=torch.uint8)  # GPTQ v1 cannot store z = 0
    q = torch.randint(0, 16, (n, k), generator=generator)
    qw = w4a16.QuantizedWeight(w4a16.pack_int4(q), scales, zeros, g)
    a, gq, c = formats.to_awq(qw), formats.to_gptq(qw), formats.to_compressed_tensors(qw)
    stored = {"awq": {"qweight": torch.int32, "qzeros": torch.int32, "scales": dtype},
              "gptq": {"qweight": torch.int32, "qzeros": torch.int32, "scales": dtype, "g_idx": torch.int32},
              "ct": {"weight_packed": torch.int32, "weight_zero_point": torch.int32, "weight_scale": dtype,
                     "weight_shape": torch.int64}}
    for fmt, out in (("awq", a), ("gptq", gq), ("ct", c)):
        assert {name: t.dtype for name, t in out.items()} == stored[fmt], fmt
        # safetensors refuses to save a non-contiguous tensor: a converted checkpoint must be writable as it comes
        assert [name for name, t in out.items() if not t.is_contiguous()] == [], fmt
    converted = {
        "awq": formats.from_awq(a["qweight"], a["qzeros"], a["scales"], g),
        "gptq": formats.from_gptq(gq["qweight"], gq["qzeros"], gq["scales"], g, gq["g_idx"]),
        "ct": formats.from_compressed_tensors(c["weight_packed"], c["weight_scale"], c["weight_shape"],
                                              c["weight_zero_point"]),
    }
    for fmt, back in converted.items():
        assert back.scales.dtype == dtype, (fmt, back.scales.dtype)
        assert torch.equal(back.scales.view(torch.uint8), scales.view(torch.uint8)), fmt  # bit for bit
        assert torch.equal(w4a16.unpack_int4(back.qweight).long(), q) and torch.equal(back.zeros, zeros), fmt


def _words(generator, *shape):
    """Random packed words (no all-zero data): the error must come from the shapes or dtypes, whatever the bits."""
    return torch.randint(-(2**31), 2**31, shape, generator=generator, dtype=torch.int32)


def _scales(generator, *shape):
    return (torch.rand(*shape, generator=generator) + 0.01).half()


def _weight(generator, n, k=128, g=64, symmetric=False):
    zeros = None if symmetric else torch.randint(1, 16, (n, k // g), generator=generator, dtype=torch.uint8)
    return w4a16.QuantizedWeight(_words(generator, n, k // 8), _scales(generator, n, k // g), zeros, g)


@pytest.mark.parametrize(
    "call, error, match",
    [
        # each check of a converter's own, named in its terms: dropped, a later check (QuantizedWeight's, unpacking's)
        # or an IndexError would answer instead, in the layout's terms or none
        (lambda r: formats.from_awq(_words(r, 128, 2, 1), _words(r, 2, 2), _scales(r, 2, 16), 64),
         ValueError, r"qweight must be 2-D, got shape \(128, 2, 1\)"),
        (lambda r: formats.from_awq(_words(r, 128, 2), _words(r, 2, 2), _scales(r, 2, 16), 96),
         ValueError, r"group_size must be one of \(32, 64, 128\), got 96"),
        (lambda r: formats.from_awq(_words(r, 128, 2), _words(r, 2, 2).long(), _scales(r, 2, 16), 64),
         TypeError, "qzeros must be an int32 packed tensor, got torch.int64"),
        (lambda r: formats.from_awq(_words(r, 128, 4), _words(r, 4, 2), _scales(r, 2, 32), 64),  # qzeros transposed
         ValueError, r"qzeros must have shape \[K // G, N // 8\] = \[2, 4\], got \[4, 2\]"),
        (lambda r: formats.to_awq(_weight(r, 12)), ValueError, "AWQ packs along N: N=12 must be a multiple of 8"),
        (lambda r: formats.to_awq(_weight(r, 12, symmetric=True)), ValueError,
         "AWQ packs along N: N=12 must be a multiple of 8"),  # symmetric too: qzeros holds z = 8 for every group
        (lambda r: formats.from_awq(_words(r, 128), _words(r, 2, 2), _scales(r, 2, 16), 64),
         ValueError, r"qweight must be 2-D, got shape \(128,\)"),
        # K = 192 with G = 128: a checkpoint has ceil(K / G) = 2 groups; the error is about K, not about the shapes
        (lambda r: formats.from_gptq(_words(r, 24, 16), _words(r, 2, 2), _scales(r, 2, 16), 128),
         ValueError, "K=192 must be a multiple of group_size=128"),
        (lambda r: formats.from_gptq(_words(r, 16, 12), _words(r, 2, 2), _scales(r, 2, 12), 64),
         ValueError, "GPTQ packs qzeros along N: N=12 must be a multiple of 8"),
        (lambda r: formats.from_gptq(_words(r, 16, 32), _words(r, 4, 2), _scales(r, 2, 32), 64),  # qzeros transposed
         ValueError, r"qzeros must have shape \[K // G, N // 8\] = \[2, 4\], got \[4, 2\]"),
        (lambda r: formats.from_gptq(_words(r, 16, 16), _words(r, 2, 2), _scales(r, 16, 2), 64),  # scales transposed
         ValueError, r"scales must have shape \[K // G, N\] = \[2, 16\], got \[16, 2\]"),
        (lambda r: formats.from_gptq(_words(r, 16, 16), _words(r, 2, 2).float(), _scales(r, 2, 16), 64),
         TypeError, "qzeros must be an int32 packed tensor, got torch.float32"),
        (lambda r: formats.to_gptq(_weight(r, 12)), ValueError, "GPTQ packs qzeros along N: N=12 must be a multiple of 8"),
        # the trivial order, as a row: a g_idx of K elements in another shape is not a checkpoint's [K]
        (lambda r: formats.from_gptq(_words(r, 16, 16), _words(r, 2, 2), _scales(r, 2, 16), 64,
                                     g_idx=(torch.arange(128) // 64).reshape(1, 128)),
         ValueError, r"g_idx must be a tensor of shape \[K\] = \[128\], got torch.Size\(\[1, 128\]\)"),
        # the trivial order for K = 2 G, as bools: a flag is not a group index
        (lambda r: formats.from_gptq(_words(r, 16, 16), _words(r, 2, 2), _scales(r, 2, 16), 64,
                                     g_idx=torch.arange(128) >= 64),
         TypeError, "g_idx must be an integer tensor, got torch.bool"),
        (lambda r: formats.from_compressed_tensors(_words(r, 16, 16).long(), _scales(r, 16, 2), (16, 128)),
         TypeError, "weight_packed must be an int32 packed tensor, got torch.int64"),
        (lambda r: formats.from_compressed_tensors(_words(r, 0, 16), _scales(r, 0, 1), (0, 128)),
         ValueError, r"weight_shape must be two positive integers \[N, K\], got \[0, 128\]"),
        (lambda r: formats.from_compressed_tensors(_words(r, 1, 16), _scales(r, 1, 1), (True, 128)),
         ValueError, r"weight_shape must be two positive integers \[N, K\], got \[True, 128\]"),
        (lambda r: formats.from_compressed_tensors(_words(r, 16, 16), _scales(r, 16), (16, 128)),
         ValueError, r"weight_scale must be a 2-D tensor \[N, K // G\], got torch.Size\(\[16\]\)"),
        (lambda r: formats.from_compressed_tensors(_words(r, 16, 16), _scales(r, 16, 0), (16, 128)),
         ValueError, r"cannot infer group_size: K=128 over weight_scale of shape \[16, 0\]"),
        (lambda r: formats.from_compressed_tensors(_words(r, 12, 16), _scales(r, 12, 2), (12, 128), _words(r, 2, 2)),
         ValueError, "weight_zero_point packs along N: N=12 must be a multiple of 8"),
        (lambda r: formats.from_compressed_tensors(_words(r, 32, 16), _scales(r, 32, 2), (32, 128),
                                                   _words(r, 2, 4)),  # the zero points transposed
         ValueError, r"weight_zero_point must have shape \[N // 8, K // G\] = \[4, 2\], got \[2, 4\]"),
        (lambda r: formats.from_compressed_tensors(_words(r, 16, 16), _scales(r, 16, 2), (16, 128),
                                                   _words(r, 2, 2).long()),
         TypeError, "weight_zero_point must be an int32 packed tensor, got torch.int64"),
        (lambda r: formats.to_compressed_tensors(_weight(r, 12)),
         ValueError, "weight_zero_point packs along N: N=12 must be a multiple of 8"),
    ],
)
def test_converters_name_the_bad_argument(call, error, match, generator):
    with pytest.raises(error, match=match):
        call(generator)


def test_gptq_v1_refuses_one_unrepresentable_zero_point_among_good_ones(generator):
    """One group is enough to make a checkpoint wrong: a v1 stored 15 (z = 16) or a zero point 0 to store as z - 1
    is refused wherever it is, not only when every group has it."""
    stored = torch.randint(0, 15, (2, 16), generator=generator)  # [K // G, N], 0..14: z = 1..15
    stored[1, 5] = 15
    qzeros = _pack_words(stored, list(range(8)))
    with pytest.raises(ValueError, match="zero point 16"):
        formats.from_gptq(_words(generator, 16, 16), qzeros, _scales(generator, 2, 16), 64)
    qw = _weight(generator, 16)
    qw.zeros[9, 1] = 0
    with pytest.raises(ValueError, match="zero point 0 cannot be represented"):
        formats.to_gptq(qw)


def test_compressed_tensors_zero_points_all_8_stay_asymmetric(generator):
    """A checkpoint that ships weight_zero_point keeps it both ways, even when every zero point is 8 (the value a
    symmetric weight implies): the round trip is bit-exact, so the tensor comes back rather than being dropped."""
    n, k, g = 16, 128, 64
    packed = _words(generator, n, k // 8)
    zp = _pack_words(torch.full((k // g, n), 8), list(range(8))).t().contiguous()  # [N // 8, K // G]
    qw = formats.from_compressed_tensors(packed, _scales(generator, n, k // g), (n, k), zp)
    assert not qw.symmetric and torch.equal(qw.zeros, torch.full((n, k // g), 8, dtype=torch.uint8))
    back = formats.to_compressed_tensors(qw)
    assert torch.equal(back["weight_packed"], packed) and torch.equal(back["weight_zero_point"], zp)
