"""The hybrid op with the real kernels: routing by M, models, checkpoints, torch.compile, CUDA-graph capture.

Every GEMM call is recorded (backend, M) through `dispatch._run`, and every W4A16Linear call in the model tests
is checked against `reference_gemm` with the tolerance rule, so a failure names the layer, M and the backend.
Needs the skinny extension built (`nox -s build`) and Triton; a missing kernel fails with the reason dispatch gives.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from w4a16_testing import assert_matches_reference, random_activation, random_weight, require_module

import w4a16
from w4a16 import W4A16Linear, dispatch
from w4a16.models import load_quantized, quantize_model, set_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the real skinny and Triton kernels)"),
]
transformers = require_module("transformers", "transformers comes with the eval extra")

DTYPES = (torch.float16, torch.bfloat16)


def expected_backend(m: int, n: int, k: int) -> str:
    """What the hybrid rule must pick on this GPU for M rows times an [N, K] weight, from the shipped numbers."""
    r = dispatch.rules(w4a16.arch())
    if r.skinny_fits(m, n, k):
        return "skinny"
    min_m = r.dequant_blas_from(n, k)
    if min_m is not None and m >= min_m:
        return "dequant_blas"
    return "triton"


@pytest.fixture
def calls(monkeypatch):
    """[(backend, M, N, K)] of every GEMM that ran (or was captured) during the test."""
    record = []
    run = dispatch._run

    def recording_run(backend, x2d, qw, bias):
        record.append((backend, x2d.shape[0], qw.n, qw.k))
        return run(backend, x2d, qw, bias)

    monkeypatch.setattr(dispatch, "_run", recording_run)
    return record


def assert_close_scaled(out: torch.Tensor, ref: torch.Tensor, fraction: float = 2e-2) -> None:
    """Same kernels on both sides, only the order of surrounding ops (or split-K sums) differs."""
    torch.testing.assert_close(out, ref, rtol=fraction, atol=fraction * ref.abs().max().item())


def assert_routed(calls) -> None:
    wrong = [(b, m, n, k, expected_backend(m, n, k)) for b, m, n, k in calls if b != expected_backend(m, n, k)]
    assert not wrong, f"(backend used, M, N, K, backend expected) for misrouted calls: {wrong[:5]}"


@contextlib.contextmanager
def layers_checked(model: nn.Module):
    """Check every W4A16Linear output of the model against the reference while the block runs."""
    failures = []

    def hook(module, args, out, name):
        try:
            assert_matches_reference(out, args[0], module.quantized_weight(), module.bias)
        except AssertionError as exc:
            failures.append(f"{name} (M={args[0].numel() // module.in_features}): {exc}")

    handles = [m.register_forward_hook(lambda mod, a, o, n=n: hook(mod, a, o, n))
               for n, m in model.named_modules() if isinstance(m, W4A16Linear)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    assert not failures, "\n".join(failures[:5])


def gpu_model(family: str = "llama", dtype=torch.bfloat16, symmetric: bool = True, seed: int = 0) -> nn.Module:
    """A small random causal LM on CPU (hidden 512, 2 layers), quantized with group size 128."""
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config}[family]
    config = config_class(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=64, vocab_size=1024, max_position_embeddings=256,
                          tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_(std=0.02)
    return quantize_model(model, group_size=128, symmetric=symmetric)


def test_kernels_are_available_here():
    for backend in ("skinny", "triton"):
        for dtype in DTYPES:
            reason = dispatch.unavailable_reason(backend, "cuda", dtype)
            assert reason is None, f"{backend} for {dtype} is unavailable on {w4a16.arch()}: {reason}"
    r = dispatch.rules(w4a16.arch())
    assert r.skinny_max_m >= 1 and r.skinny_staging_elements >= 4096 * r.skinny_max_m, r


def test_auto_routes_a_tuned_shape_by_its_own_dequant_blas_threshold(calls):
    """A weight shape with its own entry in the arch table's dequant_blas_overrides goes to Triton one row below
    that threshold and to dequant_blas at it, correct both ways."""
    r = dispatch.rules(w4a16.arch())
    tuned = [(n, k, m) for (n, k), m in r.dequant_blas_overrides.items() if m is not None]
    if not tuned:
        pytest.skip(f"the {r.arch} Triton table has no per-shape dequant_blas thresholds")
    n, k, min_m = min(tuned, key=lambda entry: entry[0] * entry[1] * entry[2])  # the cheapest to run
    gen = torch.Generator().manual_seed(3)
    qw = random_weight(n, k, 128, True, torch.bfloat16, "cuda", gen)
    for m in (min_m - 1, min_m):
        x = random_activation(m, k, torch.bfloat16, "cuda", gen)
        assert_matches_reference(w4a16.gemm(x, qw), x, qw)
    assert [b for b, *_ in calls] == ["triton", "dequant_blas"], calls
    assert_routed(calls)


@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_routes_by_m_at_k_n_4096(dtype, calls):
    gen = torch.Generator().manual_seed(1)
    qw = random_weight(4096, 4096, 128, False, dtype, "cuda", gen)
    max_m = dispatch.rules(w4a16.arch()).skinny_max_m
    ms = sorted({1, max_m, max_m + 1, 16, 128, 2048})
    for m in ms:
        x = random_activation(m, 4096, dtype, "cuda", gen)
        assert_matches_reference(w4a16.gemm(x, qw), x, qw)
    assert [m for _, m, _, _ in calls] == ms
    assert_routed(calls)
    assert calls[0][0] == "skinny" and calls[ms.index(max_m + 1)][0] in ("triton", "dequant_blas")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (a weight on cuda:1, cuda:0 current)")
@pytest.mark.parametrize("backend", ["skinny", "triton", "dequant_blas"])
def test_every_backend_runs_on_the_tensors_gpu_not_the_current_one(backend):
    """A model split over GPUs calls its cuda:1 layers while cuda:0 is current: each backend must launch on x's
    device (and its stream), whichever device is current."""
    gen = torch.Generator().manual_seed(7)
    qw = random_weight(1024, 2048, 64, False, torch.bfloat16, "cuda:1", gen)
    x = random_activation(3 if backend == "skinny" else 70, 2048, torch.bfloat16, "cuda:1", gen)
    with torch.cuda.device(0):
        y = w4a16.gemm(x, qw, backend=backend)
    assert y.device == x.device
    assert_matches_reference(y, x, qw)


def test_auto_at_the_staging_limit_and_one_past_it(calls):
    r = dispatch.rules(w4a16.arch())
    m = r.skinny_max_m
    k_fit = r.skinny_staging_elements // m // 128 * 128  # the largest multiple of 128 with K*M within the limit
    gen = torch.Generator().manual_seed(2)
    for k in (k_fit, k_fit + 128):
        qw = random_weight(256, k, 128, True, torch.bfloat16, "cuda", gen)
        x = random_activation(m, k, torch.bfloat16, "cuda", gen)
        assert_matches_reference(w4a16.gemm(x, qw), x, qw)
    assert [c[0] for c in calls] == ["skinny", "triton"], calls
    with pytest.raises(ValueError, match="backend='skinny' takes"):
        w4a16.gemm(x, qw, backend="skinny")


@pytest.mark.parametrize(("family", "dtype", "symmetric"),
                         [("llama", torch.bfloat16, True), ("qwen2", torch.float16, False)])
def test_quantized_model_with_real_kernels(family, dtype, symmetric, calls):
    model = gpu_model(family, dtype, symmetric).cuda()
    ids = torch.randint(0, 1024, (1, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    with torch.no_grad(), layers_checked(model):
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 20)
    assert {b for b, _, _, _ in calls} >= {"skinny", "triton"}, "prefill (M=16) and decode (M=1) both ran"
    assert_routed(calls)


@pytest.mark.parametrize("method", ["compressed-tensors", "awq"])
def test_load_quantized_on_gpu(method, tmp_path, calls):
    from test_models import write_checkpoint

    symmetric = method == "compressed-tensors"
    model = gpu_model("qwen3", torch.bfloat16, symmetric, seed=4)
    write_checkpoint(tmp_path, model, method, symmetric=symmetric, quantization=_config(method))
    loaded = load_quantized(tmp_path, device="cuda", dtype=torch.bfloat16)
    assert all(p.is_cuda for p in loaded.parameters()) and all(b.is_cuda for b in loaded.buffers())
    ids = torch.randint(0, 1024, (2, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    with torch.no_grad(), layers_checked(loaded):
        logits = loaded(ids).logits
    kernel_calls = list(calls)  # the reference pass below is recorded too; only the kernel pass is routed by M
    set_backend(loaded, "reference")
    with torch.no_grad():
        ref = loaded(ids).logits
    rel = ((logits.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert rel < 0.05, f"kernel-backed logits differ from reference-backed ones by {rel:.3g} of max |logit|"
    assert_routed(kernel_calls)


def _config(method: str) -> dict:
    from test_models import quant_config

    config = quant_config(method, symmetric=method == "compressed-tensors")
    if method == "compressed-tensors":
        config["config_groups"]["group_0"]["weights"]["group_size"] = 128
    else:
        config["group_size"] = 128
    return config


def _stack(dtype) -> nn.Module:
    gen = torch.Generator().manual_seed(6)
    return nn.Sequential(
        W4A16Linear.from_quantized(random_weight(1536, 512, 128, True, dtype, "cuda", gen)),
        nn.SiLU(),
        W4A16Linear.from_quantized(random_weight(512, 1536, 64, False, dtype, "cuda", gen),
                                   torch.randn(512, generator=gen).to("cuda", dtype)),
    )


def test_torch_compile_fullgraph_with_real_kernels(calls):
    stack = _stack(torch.bfloat16)
    compiled = torch.compile(stack, fullgraph=True)
    gen = torch.Generator().manual_seed(7)
    for m in (1, 64):
        x = random_activation(m, 512, torch.bfloat16, "cuda", gen)
        with torch.no_grad():
            assert_close_scaled(compiled(x), stack(x))
    assert {b for b, _, _, _ in calls} == {"skinny", "triton"}, calls
    assert_routed(calls)


def test_cuda_graph_capture_of_the_op(calls):
    stack = _stack(torch.float16)
    static_x = torch.randn(1, 512, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():  # warm up (lazy loads, Triton compiles) outside the capture
        for _ in range(2):
            stack(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_y = stack(static_x)
    for seed in range(3):
        static_x.copy_(torch.randn(1, 512, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.half))
        graph.replay()
        with torch.no_grad():
            assert_close_scaled(static_y, stack(static_x))
    assert {b for b, _, _, _ in calls} == {"skinny"}, calls


@pytest.mark.parametrize("m", [16, 64])
def test_cuda_graph_capture_of_the_triton_route(m, calls):
    """The Triton route allocates its split-K slices per call and builds its TMA descriptors at launch: a captured
    call must replay on new x, on the stream it was captured on."""
    gen = torch.Generator().manual_seed(m)
    qw = random_weight(1024, 2048, 128, False, torch.bfloat16, "cuda", gen)
    static_x = random_activation(m, 2048, torch.bfloat16, "cuda", gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        w4a16.gemm(static_x, qw, backend="triton")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = w4a16.gemm(static_x, qw, backend="triton")
    for seed in range(3):
        static_x.copy_(random_activation(m, 2048, torch.bfloat16, "cuda", torch.Generator().manual_seed(100 + seed)))
        static_y.fill_(float("nan"))
        graph.replay()
        assert_matches_reference(static_y, static_x, qw)
    assert {b for b, _, _, _ in calls} == {"triton"}, calls


def test_a_captured_dequant_blas_call_survives_the_shared_workspace_growing():
    """The shared workspace grows (and frees its old buffer) when a larger weight comes: a graph captured before
    must not be writing to that old address (dequant_blas takes a buffer of the graph's pool while capturing)."""
    from w4a16.triton import dequant_blas_gemm

    gen = torch.Generator().manual_seed(11)
    small = random_weight(256, 512, 128, True, torch.bfloat16, "cuda", gen)
    large = random_weight(2048, 4096, 128, True, torch.bfloat16, "cuda", gen)
    static_x = random_activation(64, 512, torch.bfloat16, "cuda", gen)
    dequant_blas_gemm(static_x, small)  # compiled, and the shared workspace sized for the small weight
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_y = dequant_blas_gemm(static_x, small)
    dequant_blas_gemm(random_activation(8, 4096, torch.bfloat16, "cuda", gen), large)  # grows the shared one
    junk = torch.full((2048 * 4096,), float("nan"), dtype=torch.bfloat16, device="cuda")  # may take the old buffer
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(static_y, static_x, small)
    assert torch.isnan(junk).all(), "the replay wrote into memory the graph does not own"


def test_cuda_graph_capture_of_a_model_decode_step(calls):
    """Prefill into a static KV cache, capture one decode step of the whole model, replay it for greedy decoding.

    transformers' StaticCache keeps its write position on the device and advances it on every call (the warmup
    call included), so a step is not idempotent: the eager reference is a second cache driven through the same
    sequence of calls (prefill, warmup step, then one step per replay) with the same tokens.
    """
    model = gpu_model("llama", torch.bfloat16, True, seed=8).cuda()
    ids = torch.randint(0, 1024, (1, 8), device="cuda", generator=torch.Generator("cuda").manual_seed(9))

    def prefilled():
        cache = transformers.StaticCache(config=model.config, max_cache_len=64)
        with torch.no_grad():
            logits = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(8, device="cuda")).logits
        return cache, logits[:, -1:].argmax(-1)

    captured_cache, token = prefilled()
    eager_cache, eager_token = prefilled()
    assert torch.equal(token, eager_token)
    position = torch.tensor([8], device="cuda")

    def step(cache):
        return model(input_ids=token, past_key_values=cache, cache_position=position).logits

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        step(captured_cache)  # warmup
    torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad():
        step(eager_cache)  # the same call on the reference cache
    graph = torch.cuda.CUDAGraph()
    before = len(calls)
    with torch.cuda.graph(graph), torch.no_grad():
        static_logits = step(captured_cache)
    captured = [b for b, _, _, _ in calls[before:]]
    generated = []
    for _ in range(3):  # greedy decode by replay, each step checked against the eager step of the reference cache
        graph.replay()
        replayed = static_logits.clone()
        with torch.no_grad():
            eager = step(eager_cache)
        assert_close_scaled(replayed, eager)
        token.copy_(replayed[:, -1:].argmax(-1))
        position += 1
        generated.append(int(token))
    assert captured and set(captured) == {"skinny"}, f"backends captured in the decode step: {captured}"
    assert len(generated) == 3


def test_info_reports_the_auto_picks():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "w4a16", "info"], check=True, capture_output=True, text=True).stdout
    print(out)
    picks = [line.split() for line in out.splitlines() if line.strip().startswith(("float16", "bfloat16"))]
    header = next(line for line in out.splitlines() if line.startswith("auto picks at K=N=4096:"))
    ms = [int(word.removeprefix("M=")) for word in header.split(":", 1)[1].split()]
    edge = dispatch.rules(w4a16.arch()).skinny_max_m
    assert len(picks) == 2 and ms == [1, edge, edge + 1, 128, 2048], out
    for row in picks:  # either side of the skinny edge: both decode routes show
        assert row[1:3] == ["skinny", "skinny"] and row[3] == "triton", out
        assert row[1:] == [expected_backend(m, 4096, 4096) for m in ms], out
