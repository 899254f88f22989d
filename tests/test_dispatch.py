"""The hybrid rule (every boundary, on any machine), forced backends, the custom op, bad input."""

from __future__ import annotations

import pytest
import torch
from w4a16_testing import assert_matches_reference, random_activation, random_weight

import w4a16
from w4a16 import dispatch
from w4a16.dispatch import DispatchRules, decide

ALL = {"skinny": True, "triton": True, "dequant_blas": True}
RULES = DispatchRules("test", skinny_max_m=5, skinny_staging_elements=5 * 4096, dequant_blas_min_m=1024)


@pytest.mark.parametrize(("m", "expected"), [(0, "triton"), (1, "skinny"), (5, "skinny"), (6, "triton"),
                                             (1023, "triton"), (1024, "dequant_blas"),
                                             (4096, "dequant_blas")])
def test_decide_at_the_m_boundaries(m, expected):
    # M = 0 is below the skinny kernel's 1 <= M (gemm returns early for it; the rule still says so).
    assert decide(m, 4096, 4096, RULES, **ALL) == expected


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
def test_decide_at_the_staging_limit_and_one_past_it(m):
    # K * M exactly at the limit stays on skinny; one element past it goes to Triton.
    at_limit = DispatchRules("test", 5, skinny_staging_elements=m * 2048, dequant_blas_min_m=None)
    one_short = DispatchRules("test", 5, skinny_staging_elements=m * 2048 - 1, dequant_blas_min_m=None)
    assert decide(m, 4096, 2048, at_limit, **ALL) == "skinny"
    assert decide(m, 4096, 2048, one_short, **ALL) == "triton"


def test_decide_falls_back_when_backends_are_missing():
    assert decide(1, 4096, 4096, RULES, skinny=False, triton=True, dequant_blas=True) == "triton"
    assert decide(2048, 4096, 4096, RULES, skinny=True, triton=True, dequant_blas=False) == "triton"
    assert decide(2048, 4096, 4096, RULES, skinny=False, triton=False, dequant_blas=True) == "dequant_blas"
    assert decide(6, 4096, 4096, RULES, skinny=True, triton=False, dequant_blas=False) == "reference"
    assert decide(1, 4096, 4096, RULES, skinny=False, triton=False, dequant_blas=False) == "reference"
    no_blas = DispatchRules("test", 5, 5 * 4096, dequant_blas_min_m=None)
    assert decide(10**6, 4096, 4096, no_blas, **ALL) == "triton"


def test_a_call_past_the_fused_kernels_offsets_goes_to_dequant_blas():
    """Qwen2.5-7B gate_up at 65536 tokens (e.g. lm-eval's batch of 32 x 2048 flattened): M * N >= 2^31, which the
    fused kernel's 32-bit offsets cannot index; dequant_blas indexes only W and takes it, below its threshold too."""
    from w4a16.triton import index_limit_reason

    m, n, k = 65536, 37888, 3584
    assert "M*N=2483027968 exceeds" in index_limit_reason(m, n, k, "triton")
    assert index_limit_reason(m, n, k, "dequant_blas") is None
    assert "N*K" in index_limit_reason(1, 2**16, 2**16, "dequant_blas")
    fits = {"triton": False, "dequant_blas": True, "skinny": True}  # what choose_backend passes for this call
    no_blas = DispatchRules("test", 5, 5 * 4096, dequant_blas_min_m=None)
    assert decide(m, n, k, no_blas, **fits) == "dequant_blas"
    assert decide(m, n, k, no_blas, skinny=True, triton=False, dequant_blas=False) == "reference"


def test_per_shape_dequant_blas_thresholds_win_over_the_arch_one():
    r = DispatchRules("test", 5, 5 * 4096, dequant_blas_min_m=512,
                      dequant_blas_overrides={(28672, 4096): 1024, (2560, 4096): 256, (64, 64): None})
    assert decide(512, 4096, 4096, r, **ALL) == "dequant_blas"  # no entry: the arch's threshold
    assert decide(511, 4096, 4096, r, **ALL) == "triton"
    assert decide(1023, 28672, 4096, r, **ALL) == "triton"
    assert decide(1024, 28672, 4096, r, **ALL) == "dequant_blas"
    assert decide(255, 2560, 4096, r, **ALL) == "triton"
    assert decide(256, 2560, 4096, r, **ALL) == "dequant_blas"
    assert decide(10**6, 64, 64, r, **ALL) == "triton"  # null: never for that shape
    assert decide(256, 4096, 2560, r, **ALL) == "triton"  # (N, K), not (K, N)


def test_shipped_per_shape_thresholds_at_their_boundaries():
    r = dispatch.rules("sm_90")
    assert r.dequant_blas_overrides, "the sm_90 table ships per-shape dequant_blas thresholds"
    for (n, k), min_m in r.dequant_blas_overrides.items():
        assert min_m != r.dequant_blas_min_m
        if min_m is not None:
            assert decide(min_m - 1, n, k, r, **ALL) == "triton" and decide(min_m, n, k, r, **ALL) == "dequant_blas"


@pytest.mark.parametrize("arch_name", ["sm_90", "gfx1151", "gfx1201"])
def test_shipped_rules_at_their_boundaries(arch_name):
    """The numbers the owners ship for each arch, evaluated at M = skinny_max_m, +1 and the staging limit, +1."""
    r = dispatch.rules(arch_name)
    if r.skinny_max_m == 0:
        pytest.skip(f"no skinny limits for {arch_name} here: {dispatch._module('w4a16.skinny')[1] or 'limits() said none'}")
    k = 128  # small enough that the staging limit never binds below skinny_max_m
    assert r.skinny_staging_elements >= k * r.skinny_max_m
    assert decide(r.skinny_max_m, 4096, k, r, **ALL) == "skinny"
    assert decide(r.skinny_max_m + 1, 4096, k, r, **ALL) in ("triton", "dequant_blas")
    # The largest K (a multiple of 128) that fits one row, and the next one.
    k_fit = r.skinny_staging_elements // 128 * 128
    assert decide(1, 4096, k_fit, r, **ALL) == "skinny"
    assert decide(1, 4096, k_fit + 128, r, **ALL) == "triton"
    assert not r.skinny_fits(1, 4096, r.skinny_staging_elements + 1)
    if r.dequant_blas_min_m is not None:
        assert r.dequant_blas_min_m > r.skinny_max_m
        assert decide(r.dequant_blas_min_m - 1, 4096, k, r, **ALL) == "triton"
        assert decide(r.dequant_blas_min_m, 4096, k, r, **ALL) == "dequant_blas"


def test_measured_crossover_limits_auto_but_not_a_forced_skinny():
    """A measured crossover (dispatch_rules.json) below the kernel's row limit stops "auto" there; forcing
    backend="skinny" still takes every row the kernel was built for."""
    measured = dispatch._measured_skinny_max_m()["sm_90"]["skinny_max_m"]
    r = dispatch.rules("sm_90")
    assert r.skinny_max_m == measured <= r.skinny_rows == w4a16.skinny.limits("sm_90")[0]
    assert decide(measured, 4096, 4096, r, **ALL) == "skinny"
    assert decide(measured + 1, 4096, 4096, r, **ALL) == "triton"
    below = DispatchRules("test", skinny_max_m=2, skinny_staging_elements=5 * 4096, dequant_blas_min_m=None,
                          skinny_kernel_rows=5)
    assert decide(2, 4096, 4096, below, **ALL) == "skinny" and decide(3, 4096, 4096, below, **ALL) == "triton"
    assert below.skinny_takes(5, 4096) and not below.skinny_takes(6, 4096)
    assert not below.skinny_fits(3, 4096, 4096)
    # Arches without a measured crossover use the kernel's own limit.
    assert dispatch.rules("gfx1151").skinny_max_m == dispatch.rules("gfx1151").skinny_rows


@pytest.mark.parametrize("measured", [3, 10**6])
def test_rules_cap_a_measured_crossover_at_the_kernel_row_limit(monkeypatch, measured):
    """dispatch_rules.json can lower "auto"'s skinny_max_m but never raise it past the rows the kernel was
    built for; forcing the kernel keeps its own row limit either way."""
    monkeypatch.setattr(dispatch, "_measured_skinny_max_m", lambda: {"sm_90": {"skinny_max_m": measured}})
    r = dispatch.rules.__wrapped__("sm_90")  # uncached: the patched crossover, not the shipped one
    kernel_rows = w4a16.skinny.limits("sm_90")[0]
    assert r.skinny_max_m == min(measured, kernel_rows), (r, measured, kernel_rows)
    assert r.skinny_rows == kernel_rows, "a measured crossover must not change what forced skinny takes"


def test_cpu_rules_offer_no_kernel_route():
    """The arch name "cpu" (what `arch` says for a CPU device) has no skinny build and no dequant_blas
    crossover, although `skinny.limits` answers every name, "cpu" included, with at least the generic row."""
    r = dispatch.rules("cpu")
    assert (r.skinny_max_m, r.skinny_rows, r.skinny_staging_elements) == (0, 0, 0), r
    assert r.dequant_blas_min_m is None and not r.dequant_blas_overrides and not r.skinny_max_m_overrides, r
    assert decide(1, 4096, 128, r, **ALL) == "triton"


def test_shape_override_lowers_auto_for_that_weight_only():
    """A weight shape measured apart (dispatch_rules.json "shape_overrides") stops "auto" earlier for that [N, K]
    alone; other shapes with the same K keep the arch's limit, and forcing the skinny kernel still takes it."""
    r = dispatch.rules("sm_90")
    assert r.skinny_max_m_overrides, "the shipped sm_90 rules measure Llama-3.1-8B down apart"
    for (n, k), rows in r.skinny_max_m_overrides.items():
        assert 0 <= rows < r.skinny_max_m
        assert r.skinny_max_m_for(n, k) == rows
        assert decide(rows + 1, n, k, r, **ALL) == "triton" and r.skinny_takes(rows + 1, k)
        if rows:
            assert decide(rows, n, k, r, **ALL) == "skinny"
        assert decide(rows + 1, n + 16, k, r, **ALL) == "skinny"  # another weight, same K: the arch's limit
    # The Llama-3.1-8B down override, as measured: M = 6 to the skinny kernel, M = 7 to Triton.
    assert decide(6, 4096, 14336, r, **ALL) == "skinny" and decide(7, 4096, 14336, r, **ALL) == "triton"
    # An override above the arch's limit cannot raise it.
    loose = DispatchRules("test", skinny_max_m=4, skinny_staging_elements=8 * 4096, dequant_blas_min_m=None,
                          skinny_kernel_rows=8, skinny_max_m_overrides={(64, 4096): 7})
    assert loose.skinny_max_m_for(64, 4096) == 4 and decide(5, 64, 4096, loose, **ALL) == "triton"


def test_describe_rule_counts_the_shapes_measured_apart(monkeypatch):
    monkeypatch.setattr(dispatch, "unavailable_reason", lambda backend, device, dtype: None)
    monkeypatch.setattr(dispatch, "_device_arch", lambda device: "sm_90")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # an sm_90 GPU, as far as describe_rule asks
    r = dispatch.rules("sm_90")
    apart = len(r.skinny_max_m_overrides)
    text = dispatch.describe_rule("cuda:0", torch.bfloat16)
    assert f"skinny for M <= 8 (K*M <= {r.skinny_staging_elements}; {apart} weight shape" in text, text


@pytest.mark.parametrize(("r", "expected"), [
    (DispatchRules("sm_90", 8, 100928, 2048, dequant_blas_overrides={(2560, 4096): 1024, (4096, 4096): None},
                   skinny_max_m_overrides={(4096, 14336): 6}),
     "sm_90: skinny for M <= 8 (K*M <= 100928; 1 weight shape measured apart), "
     "dequant_blas for M >= 2048 (2 weight shapes tuned apart), triton otherwise"),
    (DispatchRules("sm_90", 5, 20480, 1024, skinny_max_m_overrides={(64, 4096): 2, (128, 4096): 3}),
     "sm_90: skinny for M <= 5 (K*M <= 20480; 2 weight shapes measured apart), dequant_blas for M >= 1024, "
     "triton otherwise"),
    (DispatchRules("sm_90", 0, 0, None, dequant_blas_overrides={(2560, 4096): 1024, (6144, 4096): 4096}),
     "sm_90: dequant_blas for 2 weight shapes tuned apart, triton otherwise"),
    (DispatchRules("sm_90", 0, 0, 2048, dequant_blas_overrides={(2560, 4096): 1024}),
     "sm_90: dequant_blas for M >= 2048 (1 weight shape tuned apart), triton otherwise"),
])
def test_describe_rule_text(monkeypatch, r, expected):
    """The whole line for given rules: singular and plural shape counts, per-shape dequant_blas thresholds
    with and without an arch-wide one, and no skinny clause where the arch has no skinny kernel."""
    monkeypatch.setattr(dispatch, "unavailable_reason", lambda backend, device, dtype: None)
    monkeypatch.setattr(dispatch, "_device_arch", lambda device: "sm_90")
    monkeypatch.setattr(dispatch, "rules", lambda arch_name: r)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dispatch.describe_rule("cuda:0", torch.bfloat16) == expected


@pytest.mark.parametrize("unavailable", [(), ("triton",), ("dequant_blas",), ("triton", "dequant_blas")])
def test_describe_rule_names_what_decide_picks_past_the_skinny_kernel(monkeypatch, unavailable):
    """Without the fused kernel, decide() sends every M past the skinny kernel to dequant_blas: the description
    must say so, not "reference"."""
    monkeypatch.setattr(dispatch, "unavailable_reason",
                        lambda backend, device, dtype: "not here" if backend in unavailable else None)
    monkeypatch.setattr(dispatch, "_device_arch", lambda device: "sm_90")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    r = dispatch.rules("sm_90")
    available = {b: b not in unavailable for b in ("skinny", "triton", "dequant_blas")}
    text = dispatch.describe_rule("cuda:0", torch.bfloat16)
    below_crossover = decide(r.skinny_max_m + 1, 4096, 4096, r, **available)
    assert text.endswith(f"{below_crossover} otherwise"), (text, below_crossover)
    assert ("dequant_blas for M >=" in text) == (not unavailable), text


def test_shipped_shape_overrides_are_well_formed():
    for arch_name, entry in dispatch._measured_skinny_max_m().items():
        for o in entry.get("shape_overrides", []):
            assert set(o) == {"n", "k", "skinny_max_m", "measured"}, (arch_name, o)
            assert all(isinstance(o[key], int) and o[key] >= 0 for key in ("n", "k", "skinny_max_m")), o
            assert o["measured"].strip(), o


@pytest.mark.parametrize("backend", ["auto", "cublas"])
def test_unavailable_reason_refuses_auto_and_unknown_backends(backend):
    # "auto" is no backend that can be available or not: the message lists only the ones that are.
    with pytest.raises(ValueError, match=rf"backend must be one of \('skinny', .*\), got '{backend}'"):
        dispatch.unavailable_reason(backend, "cpu", torch.float16)


def test_choose_backend_drops_routes_past_their_32_bit_offsets(monkeypatch):
    """On a GPU (patched: every kernel reported usable, sm_90 rules), choose_backend hands decide() only the
    routes whose offsets fit the call: the fused kernel bounds M*K, M*N and N*K, dequant_blas only N*K."""
    monkeypatch.setattr(dispatch, "unavailable_reason", lambda backend, device, dtype: None)
    monkeypatch.setattr(dispatch, "_device_arch", lambda device: "sm_90")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    r = dispatch.rules("sm_90")
    assert r.dequant_blas_from(4096, 4096) is None, "sm_90 never sends a [4096, 4096] weight to dequant_blas"
    assert dispatch.choose_backend(2**18, 4096, 4096, torch.bfloat16, "cuda:0") == "triton"
    # M*N = 2^31: past the fused kernel, so dequant_blas takes it although its table never would.
    assert dispatch.choose_backend(2**19, 4096, 4096, torch.bfloat16, "cuda:0") == "dequant_blas"
    # N*K = 2^32: past both routes, and M = 9 is past the skinny kernel.
    assert dispatch.choose_backend(r.skinny_max_m + 1, 2**16, 2**16, torch.bfloat16, "cuda:0") == "reference"


@pytest.mark.parametrize("m", [1, 5, 6, 128, 2048])
def test_auto_on_cpu_is_the_reference(m):
    assert dispatch.choose_backend(m, 4096, 4096, torch.float16, "cpu") == "reference"


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape", [(3, 256), (2, 3, 256), (1, 1, 1, 256)])
def test_auto_matches_the_reference_with_leading_dims(shape, symmetric, generator):
    qw = random_weight(48, 256, 64, symmetric, torch.float16, generator=generator)
    x = torch.randn(shape, generator=generator).half()
    bias = torch.randn(48, generator=generator).half()
    out = w4a16.gemm(x, qw, bias)
    assert_matches_reference(out, x, qw, bias)


def test_empty_m_returns_an_empty_result(generator):
    qw = random_weight(40, 128, 32, False, torch.bfloat16, generator=generator)
    for shape in [(0, 128), (2, 0, 128)]:
        out = w4a16.gemm(torch.empty(shape, dtype=torch.bfloat16), qw)
        assert out.shape == (*shape[:-1], 40) and out.dtype == torch.bfloat16


def test_non_contiguous_x_is_handled(generator):
    qw = random_weight(32, 128, 128, True, torch.float16, generator=generator)
    base = torch.randn(128, 6, generator=generator).half()
    x = base.t()  # [6, 128], stride (1, 6)
    assert not x.is_contiguous()
    out = w4a16.gemm(x, qw)
    assert_matches_reference(out, x, qw)
    assert torch.equal(out, w4a16.gemm(x.contiguous(), qw))


def test_backends_get_aligned_rows_and_a_contiguous_bias(monkeypatch, generator):
    # The skinny kernel refuses x off a 16-byte boundary and a strided bias: "auto" must not send it either.
    seen = []
    run = dispatch._run
    monkeypatch.setattr(dispatch, "_run", lambda backend, x2d, qw, bias: seen.append((x2d, bias))
                        or run(backend, x2d, qw, bias))
    qw = random_weight(32, 128, 128, True, torch.float16, generator=generator)
    buf = torch.randn(2 * 128 + 1, generator=generator).half()
    x = buf[1:].view(2, 128)  # contiguous, 2 bytes off
    bias = torch.randn(64, generator=generator).half()[::2]
    assert x.is_contiguous() and x.data_ptr() % 16 and not bias.is_contiguous()
    assert_matches_reference(w4a16.gemm(x, qw, bias), x, qw, bias)
    [(x2d, b)] = seen
    assert x2d.data_ptr() % 16 == 0 and b.is_contiguous()


@pytest.mark.parametrize("backend", ["skinny", "triton", "dequant_blas", "reference", "reference_fp64"])
def test_forcing_each_backend_runs_or_says_why(backend, generator):
    """A forced backend either computes the right answer or raises naming the reason dispatch reports."""
    qw = random_weight(64, 128, 32, False, torch.float16, generator=generator)
    x = random_activation(3, 128, torch.float16, generator=generator)
    reason = dispatch.unavailable_reason(backend, "cpu", torch.float16)
    if backend in dispatch.REFERENCES:
        assert reason is None
    if backend == "skinny":
        assert reason is not None, "the skinny kernel has no CPU build"
    if reason is None:
        assert_matches_reference(w4a16.gemm(x, qw, backend=backend), x, qw)
    else:
        for rows in (x, x[:0]):  # an empty x too: the empty result is no answer to "can it run here"
            with pytest.raises(RuntimeError, match=f"backend='{backend}' is unavailable on cpu") as info:
                w4a16.gemm(rows, qw, backend=backend)
            assert reason in str(info.value)


def test_kernel_backends_refuse_fp32_activations(generator):
    qw = random_weight(16, 128, 128, True, torch.float32, generator=generator)
    x = random_activation(2, 128, torch.float32, generator=generator)
    for backend in ("skinny", "triton", "dequant_blas"):
        with pytest.raises(RuntimeError, match="float16 or bfloat16"):
            w4a16.gemm(x, qw, backend=backend)


def test_bad_input_is_a_clear_error(generator):
    qw = random_weight(16, 128, 64, True, torch.float16, generator=generator)
    x = random_activation(2, 128, torch.float16, generator=generator)
    with pytest.raises(ValueError, match="backend must be one of"):
        w4a16.gemm(x, qw, backend="cublas")
    with pytest.raises(TypeError, match="x must be a float16, bfloat16 or float32 tensor, got torch.int32"):
        w4a16.gemm(x.to(torch.int32), qw)
    with pytest.raises(ValueError, match=r"last dim must equal K=128, got x of shape \(2, 64\)"):
        w4a16.gemm(x[:, :64], qw)
    with pytest.raises(ValueError, match="x is on meta but the weight is on cpu"):
        w4a16.gemm(x.to("meta"), qw)
    with pytest.raises(TypeError, match="scales are torch.float16 but x is torch.bfloat16"):
        w4a16.gemm(x.bfloat16(), qw)
    with pytest.raises(TypeError, match="bias is torch.float32 but x is torch.float16"):
        w4a16.gemm(x, qw, torch.zeros(16))
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \[N\] = \[16\]"):
        w4a16.gemm(x, qw, torch.zeros(15, dtype=torch.float16))
    with pytest.raises(TypeError, match="qw must be a QuantizedWeight"):
        w4a16.gemm(x, torch.zeros(16, 16))
    # The reference takes mixed dtypes (it computes in fp32); only the kernels need them to match.
    assert_matches_reference(w4a16.gemm(x.bfloat16(), qw, backend="reference"), x.bfloat16(), qw)


def test_op_rejects_inconsistent_tensors(generator):
    qw = random_weight(16, 128, 64, False, torch.float16, generator=generator)
    x = random_activation(2, 128, torch.float16, generator=generator)
    with pytest.raises(ValueError, match=r"scales must have shape \[N, K // G\] = \[16, 1\] for group_size=128"):
        torch.ops.w4a16.gemm(x, qw.qweight, qw.scales, qw.zeros, 128, None, "auto")
    with pytest.raises(ValueError, match="zeros must be uint8"):
        torch.ops.w4a16.gemm(x, qw.qweight, qw.scales, qw.zeros.to(torch.int32), 64, None, "auto")
    with pytest.raises(ValueError, match=r"zeros must be uint8 of the scales' shape \(16, 2\), got torch.uint8"):
        torch.ops.w4a16.gemm(x, qw.qweight, qw.scales, qw.zeros[:, :1].contiguous(), 64, None, "auto")
    with pytest.raises(ValueError, match=r"qweight must be int32 \[N, K // 8\], got torch.int64 \(16, 16\)"):
        torch.ops.w4a16.gemm(x, qw.qweight.to(torch.int64), qw.scales, qw.zeros, 64, None, "auto")
    # K = 96 is no multiple of G = 64, although K // G = 1 matches the scales' one column.
    with pytest.raises(ValueError, match=r"must have shape \[N, K // G\] = \[16, 1\] for group_size=64"):
        torch.ops.w4a16.gemm(x[:, :96], qw.qweight[:, :12].contiguous(), qw.scales[:, :1].contiguous(),
                             qw.zeros[:, :1].contiguous(), 64, None, "auto")
    # The op skips QuantizedWeight's constructor: the group size and the layout are checked here too.
    for group_size in (0, 16, 96):
        with pytest.raises(ValueError, match=rf"group_size must be one of \(32, 64, 128\), got {group_size}"):
            torch.ops.w4a16.gemm(x, qw.qweight, qw.scales, qw.zeros, group_size, None, "reference")
    strided = qw.scales.t().contiguous().t()
    with pytest.raises(ValueError, match=r"scales must be contiguous .* got strides \(1, 16\)"):
        torch.ops.w4a16.gemm(x, qw.qweight, strided, qw.zeros, 64, None, "auto")
    with pytest.raises(ValueError, match=r"qweight \[N, K // 8\] and scales \[N, K // G\] must be 2-D, got shapes "
                                         r"\(256,\) and \(16, 2\)"):
        torch.ops.w4a16.gemm(x, qw.qweight.flatten(), qw.scales, qw.zeros, 64, None, "auto")
    with pytest.raises(ValueError, match="scales is on meta but x is on cpu"):
        torch.ops.w4a16.gemm(x, qw.qweight, qw.scales.to("meta"), qw.zeros, 64, None, "auto")
    with pytest.raises(ValueError, match="zeros is on meta but x is on cpu"):
        torch.ops.w4a16.gemm(x, qw.qweight, qw.scales, qw.zeros.to("meta"), 64, None, "auto")


@pytest.mark.parametrize(("symmetric", "with_bias", "shape"), [(True, False, (3, 128)), (False, True, (2, 4, 128))])
def test_opcheck(symmetric, with_bias, shape, generator):
    qw = random_weight(24, 128, 32, symmetric, torch.float16, generator=generator)
    x = torch.randn(shape, generator=generator).half()
    bias = torch.randn(24, generator=generator).half() if with_bias else None
    torch.library.opcheck(torch.ops.w4a16.gemm.default, (x, qw.qweight, qw.scales, qw.zeros, 32, bias, "auto"))


def test_torch_compile_fullgraph(generator):
    qw = random_weight(32, 128, 64, False, torch.float16, generator=generator)
    bias = torch.randn(32, generator=generator).half()

    def f(x):
        return torch.relu(w4a16.gemm(x, qw, bias)) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for m in (1, 7):
        x = random_activation(m, 128, torch.float16, generator=generator)
        assert torch.equal(compiled(x), f(x))


def test_forced_skinny_checks_its_row_and_staging_limits_before_launch(monkeypatch, generator):
    """With skinny reported usable (patched: no CPU build exists), a call past its limits is refused clearly;
    one within them runs, past "auto"'s own crossover too; an empty x launches nothing and raises nothing."""
    launched = []
    monkeypatch.setattr(dispatch, "unavailable_reason", lambda backend, device, dtype: None)
    # "auto" stops at M = 1; the kernel takes M <= 5 with K*M <= 640.
    monkeypatch.setattr(dispatch, "rules", lambda arch_name: DispatchRules(arch_name, 1, 5 * 128, None,
                                                                           skinny_kernel_rows=5))
    monkeypatch.setattr(dispatch, "_run", lambda backend, x2d, qw, bias: launched.append(backend) or
                        torch.zeros(x2d.shape[0], qw.n, dtype=x2d.dtype))
    qw = random_weight(16, 256, 128, True, torch.float16, generator=generator)
    with pytest.raises(ValueError, match=r"backend='skinny' takes 1 <= M <= 5 rows with K\*M <= 640 on cpu, got M=6"):
        w4a16.gemm(random_activation(6, 256, torch.float16, generator=generator), qw, backend="skinny")
    with pytest.raises(ValueError, match=r"got M=3, K=256 \(K\*M=768\)"):
        w4a16.gemm(random_activation(3, 256, torch.float16, generator=generator), qw, backend="skinny")
    empty = w4a16.gemm(random_activation(0, 256, torch.float16, generator=generator), qw, backend="skinny")
    assert empty.shape == (0, 16)
    assert launched == []
    w4a16.gemm(random_activation(2, 256, torch.float16, generator=generator), qw, backend="skinny")
    assert launched == ["skinny"]


def test_auto_runs_the_backend_choose_backend_names(monkeypatch, generator):
    calls = []
    monkeypatch.setattr(dispatch, "choose_backend", lambda m, n, k, dtype, device: calls.append((m, n, k)) or "reference")
    qw = random_weight(16, 128, 64, True, torch.float16, generator=generator)
    x = torch.randn(2, 3, 128, generator=generator).half()
    assert_matches_reference(w4a16.gemm(x, qw), x, qw)
    assert calls == [(6, 16, 128)], "auto decides on the flattened M and the weight's shape"


def test_gradient_flows_to_x(generator):
    qw = random_weight(24, 128, 32, False, torch.float32, generator=generator)
    x = torch.randn(2, 3, 128, generator=generator, dtype=torch.float64).float().requires_grad_()
    grad = torch.randn(2, 3, 24, generator=generator)
    w4a16.gemm(x, qw).backward(grad)
    torch.testing.assert_close(x.grad, grad @ w4a16.dequantize(qw))
    x16 = x.detach().half().requires_grad_()
    torch.library.opcheck(torch.ops.w4a16.gemm.default,
                          (x16, qw.qweight, qw.scales.half(), qw.zeros, 32, None, "auto"))


def test_gradient_flows_to_a_trainable_bias(generator):
    qw = random_weight(24, 128, 32, True, torch.float16, generator=generator)
    x = random_activation(6, 128, torch.float16, generator=generator).reshape(2, 3, 128).requires_grad_()
    bias = torch.randn(24, generator=generator).half().requires_grad_()
    grad = torch.randn(2, 3, 24, generator=generator).half()
    w4a16.gemm(x, qw, bias).backward(grad)
    torch.testing.assert_close(bias.grad, grad.float().sum((0, 1)).half())
    bias.grad = None
    w4a16.gemm(x.detach(), qw, bias).backward(grad)  # the bias alone trainable
    torch.testing.assert_close(bias.grad, grad.float().sum((0, 1)).half())
    torch.library.opcheck(torch.ops.w4a16.gemm.default, (x, qw.qweight, qw.scales, None, 32, bias, "auto"))


def test_trainable_scales_are_refused_at_backward(generator):
    qw = random_weight(24, 128, 32, True, torch.float32, generator=generator)
    scales = qw.scales.clone().requires_grad_()
    y = w4a16.gemm(torch.randn(2, 128, generator=generator), w4a16.QuantizedWeight(qw.qweight, scales, None, 32))
    with pytest.raises(RuntimeError, match="scales require grad, but the quantized weight is frozen"):
        y.sum().backward()


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a torch without a GPU answers for a cuda device")
def test_a_cuda_device_without_a_gpu_gets_reasons_not_a_crash():
    for backend in ("skinny", "triton", "dequant_blas"):
        for device in ("cuda", "cuda:0"):
            assert "no usable GPU" in dispatch.unavailable_reason(backend, device, torch.float16)
    assert dispatch.choose_backend(1, 4096, 4096, torch.float16, "cuda") == "reference"
    assert dispatch.describe_rule("cuda") == "reference on cuda (torch sees no GPU)"
