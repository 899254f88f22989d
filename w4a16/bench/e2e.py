"""End to end: batch-1 TTFT and TPOT of Llama-3.1-8B- and Qwen3-4B-shaped models, W4A16 vs bf16.

The models are transformers models built from their published configs with random weights (nothing is
downloaded): speed does not depend on the weights' values. One model is built in bf16 and measured, then
quantized in place with `w4a16.models.quantize_model` (group 128, symmetric; lm_head and embeddings stay bf16)
and measured again, so both variants run the same code around the linear layers.

    TTFT@P  prefill of P prompt tokens into a fresh static KV cache, up to the first token (argmax of the last
            logits); replayed as one CUDA graph, so the host's launch cost is not what is measured (the eager
            time is reported beside it)
    TPOT    per-token time of 128 greedy decode steps after a 128-token prompt: one decode step (forward, argmax,
            position + 1, the cache writes its own position) captured once as a CUDA graph and replayed
    linear  the decode step's linear layers alone (every nn.Linear / W4A16Linear called once on one token, in
            model order, as one CUDA graph): the part of TPOT the linear layers own, lm_head included (it stays
            bf16 in both variants, as quantize_model skips it); the rest is transformers'
            unfused glue (norms, rotary, attention, cache writes), the same in both variants
    memory  resident weight bytes (parameters and buffers, shared tensors once) and the peak allocated during
            the measurements

Timing uses device events on the GPU; on CPU (the harness's own test) graphs are off and a host clock is used,
which is exact there because CPU execution is synchronous.
"""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

# name -> (transformers model_type, config fields). Shapes from the published configs; context length and
# RoPE details do not change the cost of these measurements and are left at their defaults.
E2E_MODELS = {
    "llama3.1-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                  max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "qwen3-4b": ("qwen3", dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True)),
}
PROMPT_LENGTHS = (128, 1920)
DECODE_TOKENS = 128
DECODE_PROMPT = 128
# The targets for llama3.1-8b (W4A16 vs bf16): reported next to the measurements, never asserted.
TARGETS = {"tpot_speedup_min": 2.8, "ttft1920_ratio_max": 1.15, "weight_ratio_max": 0.36}


@dataclass
class E2EResult:
    model: str
    variant: str  # "bf16" or "w4a16"
    weight_bytes: int
    ttft_ms: dict[int, float] = field(default_factory=dict)  # graph replay
    ttft_eager_ms: dict[int, float] = field(default_factory=dict)
    tpot_ms: float | None = None
    linear_ms: float | None = None  # the decode step's linear layers alone, per token
    peak_bytes: int | None = None
    finite: bool = True  # the last logits were finite (random weights must not overflow)


def build_model(name: str, device: torch.device | str, overrides: dict | None = None) -> torch.nn.Module:
    """A randomly initialised bf16 transformers model of the named shape (overrides: config fields)."""
    import transformers

    model_type, fields = E2E_MODELS[name]
    config = transformers.AutoConfig.for_model(model_type, **{**fields, **(overrides or {})})
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:  # transformers 4.x spells it torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    return model.eval()


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied embeddings)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


class _Timer:
    """Device events on CUDA, a host clock on CPU; `elapsed_ms(fn)` times one call of fn."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def elapsed_ms(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def _cache_keyword(model: torch.nn.Module) -> str:
    # transformers <= 5.17 names the cache argument past_key_values; later versions call it cache.
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in params else "cache"


def _capture(fn, warmup_setup) -> torch.cuda.CUDAGraph:
    """Warm fn up on a side stream (after warmup_setup each time), then capture one call of it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            warmup_setup()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    warmup_setup()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


@torch.inference_mode()
def measure(model: torch.nn.Module, name: str, variant: str, prompt_lengths=PROMPT_LENGTHS,
            decode_tokens: int = DECODE_TOKENS, decode_prompt: int = DECODE_PROMPT, reps: int = 5,
            graphs: bool | None = None) -> E2EResult:
    from transformers import StaticCache

    device = next(model.parameters()).device
    graphs = device.type == "cuda" if graphs is None else graphs
    timer = _Timer(device)
    config = model.config
    cache_kw = _cache_keyword(model)
    result = E2EResult(name, variant, resident_bytes(model))
    longest = max(*prompt_lengths, decode_prompt)
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, longest), device=device, generator=gen)
    positions = torch.arange(longest, device=device).unsqueeze(0)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def forward(cache, tokens, pos):
        out = model(input_ids=tokens, position_ids=pos, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        return out.logits[:, -1]

    for p in prompt_lengths:
        cache = StaticCache(config=config, max_cache_len=p)
        static = {}

        def prefill(cache=cache, p=p, static=static):
            static["logits"] = forward(cache, ids[:, :p], positions[:, :p])
            static["token"] = static["logits"].argmax(-1)

        eager = []
        for i in range(reps + 1):  # the first run compiles and allocates: not timed
            cache.reset()
            t = timer.elapsed_ms(prefill)
            if i:
                eager.append(t)
        result.ttft_eager_ms[p] = statistics.median(eager)
        if graphs:
            graph = _capture(prefill, cache.reset)
            replays = []
            for _ in range(reps):
                cache.reset()
                replays.append(timer.elapsed_ms(graph.replay))
            result.ttft_ms[p] = statistics.median(replays)
            del graph
        result.finite &= bool(torch.isfinite(static["logits"]).all())
        del cache, static

    # TPOT: a greedy decode of decode_tokens after a decode_prompt-token prompt.
    cache = StaticCache(config=config, max_cache_len=decode_prompt + decode_tokens + 4)
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    pos = torch.zeros(1, 1, dtype=torch.long, device=device)
    static = {}

    def step():
        static["logits"] = forward(cache, token, pos)
        token.copy_(static["logits"].argmax(-1, keepdim=True))
        pos.add_(1)

    def start_decode():
        cache.reset()
        first = forward(cache, ids[:, :decode_prompt], positions[:, :decode_prompt]).argmax(-1, keepdim=True)
        token.copy_(first)
        pos.fill_(decode_prompt)

    run_step = step
    if graphs:
        graph = _capture(step, start_decode)
        run_step = graph.replay

    def decode():
        for _ in range(decode_tokens):
            run_step()

    per_token = []
    for _ in range(max(1, reps // 2)):
        start_decode()
        per_token.append(timer.elapsed_ms(decode) / decode_tokens)
    result.tpot_ms = statistics.median(per_token)
    result.finite &= bool(torch.isfinite(static["logits"]).all())
    if graphs:
        try:
            result.linear_ms = _linear_layers_ms(model, timer, reps)
        except RuntimeError as exc:  # an extra figure: report it missing rather than lose the table
            print(f"e2e {name} {variant}: linear-layer timing failed: {str(exc).splitlines()[0]}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        result.peak_bytes = torch.cuda.max_memory_allocated()
    return result


def _linear_layers_ms(model: torch.nn.Module, timer: _Timer, reps: int) -> float:
    """Replay time of every linear layer of the model called once on a single token, as one graph."""
    from w4a16.linear import W4A16Linear

    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, W4A16Linear))]
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    inputs = {}
    for layer in layers:
        k = layer.in_features
        if k not in inputs:
            inputs[k] = torch.randn(1, 1, k, device=device).to(dtype)

    def all_linears():
        for layer in layers:
            layer(inputs[layer.in_features])

    graph = _capture(all_linears, lambda: None)
    return statistics.median(timer.elapsed_ms(graph.replay) for _ in range(reps))


def run(names=tuple(E2E_MODELS), device: str | torch.device = "cuda", overrides: dict | None = None,
        log=print, **kwargs) -> list[E2EResult]:
    """bf16 then W4A16 for each named model; `kwargs` go to `measure`."""
    from w4a16.models import quantize_model

    results = []
    for name in names:
        model = None
        try:
            t0 = time.perf_counter()
            model = build_model(name, device, overrides)
            log(f"e2e {name}: built ({time.perf_counter() - t0:.1f} s), measuring bf16")
            results.append(measure(model, name, "bf16", **kwargs))
            t0 = time.perf_counter()
            quantize_model(model, group_size=128, symmetric=True)
            log(f"e2e {name}: quantized ({time.perf_counter() - t0:.1f} s), measuring w4a16")
            results.append(measure(model, name, "w4a16", **kwargs))
        except Exception as exc:  # one model failing must not cost the other's table; the run still fails
            log(f"e2e {name}: FAILED: {type(exc).__name__}: {exc}")
            results.append(E2EResult(name, "failed", 0, finite=False))
        del model
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return results


def _gb(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f}"


def format_table(results: list[E2EResult]) -> str:
    """Markdown: one row per model and variant, then a ratio row per model with the targets."""
    lengths = sorted({p for r in results for p in r.ttft_eager_ms})
    head = ["model", "weights", "resident GB", *[f"TTFT@{p} ms" for p in lengths],
            *[f"eager TTFT@{p} ms" for p in lengths], "TPOT ms", "linear layers ms/token", "peak GB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_model: dict[str, dict[str, E2EResult]] = {}
    for r in results:
        if r.variant == "failed":
            lines.append(f"| {r.model} | FAILED (see the log) |" + " |" * (len(head) - 2))
            continue
        by_model.setdefault(r.model, {})[r.variant] = r
        cells = [r.model, r.variant + ("" if r.finite else " (NON-FINITE LOGITS)"), _gb(r.weight_bytes),
                 *[_fmt(r.ttft_ms.get(p)) for p in lengths], *[_fmt(r.ttft_eager_ms.get(p)) for p in lengths],
                 _fmt(r.tpot_ms), _fmt(r.linear_ms), _gb(r.peak_bytes)]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for model, variants in by_model.items():
        base, quant = variants.get("bf16"), variants.get("w4a16")
        if not (base and quant):
            continue
        parts = [f"weights {quant.weight_bytes / base.weight_bytes:.3f}x"]
        if base.tpot_ms and quant.tpot_ms:
            parts.append(f"TPOT {base.tpot_ms / quant.tpot_ms:.2f}x faster")
        if base.linear_ms and quant.linear_ms:
            parts.append(f"linear layers {base.linear_ms / quant.linear_ms:.2f}x faster")
        for p in lengths:
            b, q = base.ttft_ms.get(p) or base.ttft_eager_ms.get(p), quant.ttft_ms.get(p) or quant.ttft_eager_ms.get(p)
            if b and q:
                parts.append(f"TTFT@{p} {q / b:.2f}x of bf16")
        if base.peak_bytes and quant.peak_bytes:
            parts.append(f"peak memory {quant.peak_bytes / base.peak_bytes:.3f}x")
        notes.append(f"- {model} W4A16 vs bf16: " + ", ".join(parts))
        if model == "llama3.1-8b":
            notes.append(f"  targets: TPOT >= {TARGETS['tpot_speedup_min']}x faster, TTFT@1920 <= "
                         f"{TARGETS['ttft1920_ratio_max']}x, weights <= {TARGETS['weight_ratio_max']}x")
    return "\n".join(lines + [""] + notes)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def to_json(results: list[E2EResult]) -> list[dict]:
    return [{**asdict(r), "ttft_ms": {str(k): v for k, v in r.ttft_ms.items()},
             "ttft_eager_ms": {str(k): v for k, v in r.ttft_eager_ms.items()}} for r in results]
