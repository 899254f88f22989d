"""transformers integration on tiny models built from configs (no download): quantize_model and load_quantized."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from w4a16_testing import assert_matches_reference, require_module

transformers = require_module("transformers", "transformers comes with the eval extra")
save_file = require_module("safetensors.torch", "safetensors comes with the eval extra").save_file

from w4a16 import W4A16Linear, quantize  # noqa: E402
from w4a16.formats import to_awq, to_compressed_tensors  # noqa: E402
from w4a16.models import load_quantized, quantize_model, set_backend  # noqa: E402
from w4a16.reference import dequantize  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)


def tiny_model(family: str, seed: int, tie: bool = False) -> nn.Module:
    """A tiny random causal LM of a family (Qwen2 has q/k/v biases; Qwen3 q/k norms), in fp32."""
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config}[family]
    extra = {"head_dim": 16} if family == "qwen3" else {}
    config = config_class(**TINY, **extra, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases are zero-initialised: make them count
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_()
    return model.eval()


def dequantized_copy(model: nn.Module) -> nn.Module:
    """The same model with every W4A16Linear turned back into an fp32 nn.Linear over the dequantized weight."""
    out = copy.deepcopy(model)
    for name, module in list(out.named_modules()):
        if isinstance(module, W4A16Linear):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(dequantize(module.quantized_weight()))
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            parent, _, child = name.rpartition(".")
            setattr(out.get_submodule(parent), child, linear)
    return out


def tokens(seed: int, batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("family", "symmetric"), [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_quantize_model_replaces_linears_and_matches_the_dequantized_model(family, symmetric):
    model = tiny_model(family, seed=1)
    originals = {n: copy.deepcopy(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert quantize_model(model, group_size=32, symmetric=symmetric) is model
    quantized = {n for n, m in model.named_modules() if isinstance(m, W4A16Linear)}
    assert quantized == set(originals) - {"lm_head"}
    for name in quantized:  # each layer holds its own weight, quantized, and its own bias
        layer, original = model.get_submodule(name), originals[name]
        torch.testing.assert_close(dequantize(layer.quantized_weight()),
                                   dequantize(quantize(original.weight.detach(), 32, symmetric)), rtol=0, atol=0)
        assert (layer.bias is None) == (original.bias is None)
        assert layer.bias is None or torch.equal(layer.bias, original.bias), name
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.model.embed_tokens, nn.Embedding)
    assert all(model.get_submodule(n).symmetric == symmetric for n in quantized)
    ids = tokens(2)
    with torch.no_grad():
        logits = model(ids).logits
        expected = dequantized_copy(model)(ids).logits
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_quantize_model_skip_patterns():
    model = quantize_model(tiny_model("llama", seed=3), group_size=64, skip=("re:.*mlp\\..*", "lm_head"))
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, (nn.Linear, W4A16Linear))}
    assert all(kind == ("Linear" if ".mlp." in n or n == "lm_head" else "W4A16Linear") for n, kind in kinds.items())
    model = quantize_model(tiny_model("llama", seed=3), group_size=64, skip=("model.layers.1.*",))
    assert isinstance(model.lm_head, W4A16Linear), "an explicit skip list replaces the default"
    assert isinstance(model.model.layers[0].self_attn.q_proj, W4A16Linear)
    assert isinstance(model.model.layers[1].self_attn.q_proj, nn.Linear)
    # A dotted suffix matches whole name components ("proj" is not "q_proj"); "re:" matches from the start of the
    # name, as compressed-tensors' ignore lists do; a str is one pattern, not a sequence of characters.
    for skip, kept in [(("proj", "re:.*self_attn\\.[qk]_"), ("self_attn.q_proj", "self_attn.k_proj")),
                       ("mlp.up_proj", ("mlp.up_proj",))]:
        model = quantize_model(tiny_model("llama", seed=3), group_size=64, skip=skip)
        left = {n for n, m in model.named_modules() if type(m) is nn.Linear}
        assert left == {f"model.layers.{i}.{suffix}" for i in range(2) for suffix in kept}, (skip, left)


def test_quantize_model_names_a_layer_that_cannot_be_grouped():
    model = tiny_model("llama", seed=4)
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.q_proj: in_features=64 is not a multiple "
                                         r"of group_size=128; add 'model\.layers\.0\.self_attn\.q_proj' to skip"):
        quantize_model(model, group_size=128)
    assert not any(isinstance(m, W4A16Linear) for m in model.modules()), "nothing replaced on error"


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"group_size": 0}, ValueError, "group_size must be one of"),
    ({"group_size": "128"}, ValueError, "group_size must be one of"),
    ({"group_size": 128.0}, ValueError, r"group_size must be one of \(32, 64, 128\), got 128\.0 \(float\)"),
    ({"group_size": True}, ValueError, r"group_size must be one of .*, got True \(bool\)"),
    ({"symmetric": "no"}, TypeError, "symmetric must be True"),
])
def test_quantize_model_checks_its_arguments_before_touching_a_layer(kwargs, error, match):
    model = tiny_model("llama", seed=5)
    with pytest.raises(error, match=match):
        quantize_model(model, **kwargs)
    assert not any(isinstance(m, W4A16Linear) for m in model.modules()), "nothing replaced on error"


def test_quantize_model_refuses_what_it_would_leave_unquantized_silently():
    from transformers.pytorch_utils import Conv1D  # GPT-2's projections: a 2-D weight, not an nn.Linear

    model = nn.Sequential(nn.Linear(64, 64), Conv1D(64, 64))
    with pytest.raises(ValueError, match=r"^1: Conv1D holds weight\(s\) \['weight'\] of 2 or more dimensions but "
                                         r"is not an nn.Linear"):
        quantize_model(model, group_size=32)
    assert isinstance(quantize_model(model, group_size=32, skip=("1",))[0], W4A16Linear)
    with pytest.raises(ValueError, match=r"no nn.Linear layer to quantize \(skip=\('0', '1'\)\)"):
        quantize_model(nn.Sequential(nn.Linear(64, 64), Conv1D(64, 64)), group_size=32, skip=("0", "1"))


class _FusedExperts(nn.Module):
    """A mixture-of-experts block as transformers stores it: the experts' weights fused into 3-D parameters."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 4)
        self.gate_up_proj = nn.Parameter(torch.randn(4, 128, 64))
        self.down_proj = nn.Parameter(torch.randn(4, 64, 64))


def test_quantize_model_refuses_fused_experts_and_linear_subclasses():
    model = nn.Sequential(nn.Linear(64, 64), _FusedExperts())
    with pytest.raises(ValueError, match=r"^1: _FusedExperts holds weight\(s\) \['gate_up_proj', 'down_proj'\]"):
        quantize_model(model, group_size=32)
    # MultiheadAttention reads in_proj_weight and out_proj.weight itself; skipping it skips what is inside it
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(64, 4), "proj": nn.Linear(64, 64)})
    with pytest.raises(ValueError, match=r"^attn: MultiheadAttention holds weight\(s\) \['in_proj_weight'\] .* "
                                         r"\(2 such module\(s\): \['attn', 'attn.out_proj'\]\)"):
        quantize_model(model, group_size=32)
    quantize_model(model, group_size=32, skip=("attn",))
    assert type(model["attn"].out_proj) is not W4A16Linear and isinstance(model["proj"], W4A16Linear)
    x = torch.randn(3, 1, 64)
    model["attn"](x, x, x)


@pytest.mark.parametrize("bad", ["meta", "nan", "float64"])
def test_quantize_model_changes_nothing_when_a_layer_cannot_be_quantized(bad):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    if bad == "meta":
        model[2] = nn.Linear(64, 64, device="meta")
    elif bad == "nan":
        with torch.no_grad():
            model[2].weight[0, 0] = float("nan")
    else:
        model[2].double()
    match = {"meta": "meta device", "nan": "NaN", "float64": "dtype must be float16, bfloat16 or float32"}[bad]
    with pytest.raises((ValueError, TypeError), match=rf"^2: .*{match}"):
        quantize_model(model, group_size=32)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear], "nothing replaced on error"


def test_quantizing_a_quantized_model_again_says_so():
    model = quantize_model(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), group_size=32)
    with pytest.raises(ValueError, match=r"no nn.Linear layer to quantize .*; the model's 2 W4A16Linear layer\(s\) "
                                         r"are quantized already"):
        quantize_model(model, group_size=32)


def test_quantize_model_quantizes_a_shared_layer_once_under_every_name():
    shared = nn.Linear(64, 64)
    model = quantize_model(nn.Sequential(shared, nn.ReLU(), shared), group_size=32)
    assert isinstance(model[0], W4A16Linear) and model[2] is model[0]


def test_quantize_model_refuses_to_split_a_shared_layer_skipped_under_one_name():
    shared = nn.Linear(64, 64)
    model = nn.ModuleDict({"a": nn.ModuleDict({"x": shared}), "mid": nn.Linear(64, 64),
                           "b": nn.ModuleDict({"y": shared})})
    with pytest.raises(ValueError, match=r"^b\.y: the same layer is also a\.x, which skip keeps in floating point"):
        quantize_model(model, group_size=32, skip=("a",))
    assert model["a"]["x"] is shared and model["b"]["y"] is shared, "an error leaves the model as it was"
    quantize_model(model, group_size=32, skip=("a", "b"))  # both names skipped: the shared layer stays whole
    assert model["a"]["x"] is shared and model["b"]["y"] is shared and isinstance(model["mid"], W4A16Linear)


def test_quantize_model_refuses_a_tied_lm_head_and_a_bare_linear():
    model = tiny_model("llama", seed=3, tie=True)
    with pytest.raises(ValueError, match=r"^lm_head: its weight is also model\.embed_tokens\.weight \(tied weights"):
        quantize_model(model, group_size=32, skip=())
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert isinstance(quantize_model(model, group_size=32).model.layers[0].mlp.down_proj, W4A16Linear)
    layer = nn.Linear(64, 8)
    with pytest.raises(ValueError, match=r"the model is itself an nn.Linear.*W4A16Linear\.from_linear"):
        quantize_model(layer, group_size=32)
    assert not list(layer.children())


def test_quantize_model_defaults_and_backend():
    model = quantize_model(nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)))
    assert [(m.group_size, m.format, m.backend) for m in (model[0], model[2])] == [(128, "uint4b8", "auto")] * 2
    model = quantize_model(nn.Sequential(nn.Linear(128, 8)), group_size=32, backend="reference")
    assert model[0].backend == "reference", "quantize_model passes its backend to every layer"


def test_set_backend_and_generate():
    model = quantize_model(tiny_model("qwen3", seed=5), group_size=32)
    assert set_backend(model, "reference") == 14
    assert {m.backend for m in model.modules() if isinstance(m, W4A16Linear)} == {"reference"}
    out = model.generate(tokens(6, batch=1, length=4), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints written with the converters, read back with load_quantized.

CT_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True,
                    "actorder": None, "dynamic": False, "observer": "minmax"}}},
}
AWQ_CONFIG = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32, "zero_point": True,
              "modules_to_not_convert": None}


def quant_config(method: str, symmetric: bool = True) -> dict:
    config = copy.deepcopy(CT_CONFIG if method == "compressed-tensors" else AWQ_CONFIG)
    if method == "compressed-tensors":
        config["config_groups"]["group_0"]["weights"]["symmetric"] = symmetric
    return config


def checkpoint_tensors(model: nn.Module, method: str) -> dict[str, torch.Tensor]:
    """The model's state as a checkpoint of `method` would hold it (quantized layers through the to_* converters)."""
    out = {}
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, W4A16Linear)}
    for name, module in quantized.items():
        convert = to_compressed_tensors if method == "compressed-tensors" else to_awq
        for key, value in convert(module.quantized_weight()).items():
            out[f"{name}.{key}"] = value
        if module.bias is not None:
            out[f"{name}.bias"] = module.bias
    for key, value in model.state_dict().items():
        owner = key.rpartition(".")[0]
        if owner not in quantized and not (model.config.tie_word_embeddings and key == "lm_head.weight"):
            out[key] = value
    return {k: v.contiguous() for k, v in out.items()}


def write_checkpoint(directory, model: nn.Module, method: str, tensors: dict | None = None,
                     symmetric: bool = True, shards: int = 1, quantization: dict | None = None) -> None:
    tensors = checkpoint_tensors(model, method) if tensors is None else tensors
    config = model.config.to_dict()
    config["quantization_config"] = quantization or quant_config(method, symmetric)
    (directory / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return
    keys = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: tensors[k] for k in part}, str(directory / name))
        weight_map.update(dict.fromkeys(part, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


LOAD_CASES = [("llama", "compressed-tensors", True, 1, False), ("qwen2", "compressed-tensors", False, 3, False),
              ("qwen3", "awq", False, 2, True), ("qwen2", "awq", False, 1, False)]


@pytest.mark.parametrize(("family", "method", "symmetric", "shards", "tie"), LOAD_CASES)
def test_load_quantized_reproduces_the_model(family, method, symmetric, shards, tie, tmp_path):
    model = quantize_model(tiny_model(family, seed=7, tie=tie), group_size=32, symmetric=symmetric)
    write_checkpoint(tmp_path, model, method, symmetric=symmetric, shards=shards)
    loaded = load_quantized(tmp_path)
    assert type(loaded) is type(model)
    names = {n for n, m in model.named_modules() if isinstance(m, W4A16Linear)}
    assert names == {n for n, m in loaded.named_modules() if isinstance(m, W4A16Linear)}
    for name in names:
        ours, theirs = model.get_submodule(name), loaded.get_submodule(name)
        assert torch.equal(dequantize(ours.quantized_weight()), dequantize(theirs.quantized_weight())), name
    if tie:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = tokens(8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert not loaded.training, "load_quantized returns the model in eval mode"
    out = loaded.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16"])
def test_load_quantized_casts_to_the_requested_dtype(dtype, tmp_path):
    model = quantize_model(tiny_model("llama", seed=9), group_size=32, symmetric=False)
    write_checkpoint(tmp_path, model, "awq")
    loaded = load_quantized(tmp_path, dtype=dtype)
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    layer = loaded.model.layers[0].mlp.down_proj
    assert layer.scales.dtype == torch.bfloat16
    # Against the layer that was written, cast here: not against the loaded layer's own buffers.
    written = model.model.layers[0].mlp.down_proj.quantized_weight().to(dtype=torch.bfloat16)
    x = torch.randn(3, layer.in_features).bfloat16()
    assert_matches_reference(layer(x), x, written)
    with torch.no_grad():
        assert torch.isfinite(loaded(tokens(10)).logits).all()


@pytest.fixture
def ct_model():
    return quantize_model(tiny_model("llama", seed=11), group_size=32, symmetric=True)


@pytest.mark.parametrize(("dtype", "shown"), [(torch.float64, r"torch\.float64"), ("float8", "'float8'"),
                                              ("Tensor", "'Tensor'")])
def test_load_quantized_refuses_an_unsupported_dtype(tmp_path, ct_model, dtype, shown):
    # a string is named as given, not as what torch has under that name (None, or a class)
    write_checkpoint(tmp_path, ct_model, "compressed-tensors")
    with pytest.raises(ValueError, match=rf"dtype must be float16, bfloat16 or float32, got {shown}$"):
        load_quantized(tmp_path, dtype=dtype)


def _refused(tmp_path, model, method, match, tensors=None, quantization=None):
    write_checkpoint(tmp_path, model, method, tensors=tensors, quantization=quantization)
    with pytest.raises(ValueError, match=match):
        load_quantized(tmp_path)


@pytest.mark.parametrize(("symmetric", "tensor"), [(True, "weight_scale"), (False, "weight_zero_point")])
def test_missing_quantized_tensor_names_the_layer(symmetric, tensor, tmp_path):
    model = quantize_model(tiny_model("llama", seed=11), group_size=32, symmetric=symmetric)
    tensors = checkpoint_tensors(model, "compressed-tensors")
    del tensors[f"model.layers.1.mlp.up_proj.{tensor}"]
    _refused(tmp_path, model, "compressed-tensors", rf"^model\.layers\.1\.mlp\.up_proj: missing tensor\(s\) {tensor}",
             tensors, quantization=quant_config("compressed-tensors", symmetric))


def test_layer_with_none_of_its_tensors_is_named_with_both_spellings(tmp_path, ct_model):
    tensors = {k: v for k, v in checkpoint_tensors(ct_model, "compressed-tensors").items()
               if not k.startswith("model.layers.1.mlp.up_proj.")}
    _refused(tmp_path, ct_model, "compressed-tensors",
             r"missing 1 tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight \(neither "
             r"model\.layers\.1\.mlp\.up_proj\.weight nor a compressed-tensors weight_packed for it\)", tensors)


def test_missing_plain_tensor_is_named(tmp_path, ct_model):
    tensors = checkpoint_tensors(ct_model, "compressed-tensors")
    del tensors["model.norm.weight"]
    _refused(tmp_path, ct_model, "compressed-tensors", r"missing 1 tensor\(s\): model\.norm\.weight", tensors)


def test_missing_or_misshapen_bias_names_the_layer(tmp_path):
    model = quantize_model(tiny_model("qwen2", seed=12), group_size=32, symmetric=False)
    tensors = checkpoint_tensors(model, "awq")
    del tensors["model.layers.0.self_attn.k_proj.bias"]
    _refused(tmp_path, model, "awq", r"^model\.layers\.0\.self_attn\.k_proj: missing tensor bias", tensors)
    tensors = checkpoint_tensors(model, "awq")
    key = "model.layers.1.self_attn.v_proj.bias"
    tensors[key] = tensors[key][:-1].contiguous()
    _refused(tmp_path, model, "awq", r"^model\.layers\.1\.self_attn\.v_proj: bias has shape \[31\], expected \[32\]",
             tensors)


def test_wrong_shapes_name_the_layer(tmp_path, ct_model):
    tensors = checkpoint_tensors(ct_model, "compressed-tensors")
    tensors["model.layers.0.self_attn.o_proj.weight_shape"] = torch.tensor([64, 32])
    _refused(tmp_path, ct_model, "compressed-tensors",
             r"^model\.layers\.0\.self_attn\.o_proj: weight_shape \[64, 32\] does not match", tensors)
    tensors = checkpoint_tensors(ct_model, "compressed-tensors")
    key = "model.layers.0.mlp.gate_proj.weight_scale"
    tensors[key] = tensors[key][:, :1].contiguous()
    _refused(tmp_path, ct_model, "compressed-tensors", r"^model\.layers\.0\.mlp\.gate_proj: weight_scale must have "
             r"shape \[N, K // G\]", tensors)
    awq = quantize_model(tiny_model("llama", seed=13), group_size=32, symmetric=False)
    tensors = checkpoint_tensors(awq, "awq")
    key = "model.layers.1.mlp.down_proj.qweight"
    tensors[key] = tensors[key][:64].contiguous()
    _refused(tmp_path, awq, "awq", r"^model\.layers\.1\.mlp\.down_proj: qweight has shape \[64, 8\], expected "
             r"\[K, N // 8\] = \[128, 8\]", tensors)
    tensors = checkpoint_tensors(awq, "awq")
    tensors["model.norm.weight"] = torch.ones(32)
    _refused(tmp_path, awq, "awq", r"model\.norm\.weight: shape \[32\] in the checkpoint, the model expects \[64\]",
             tensors)


def test_act_order_g_idx_is_refused_naming_the_layer(tmp_path, ct_model):
    tensors = checkpoint_tensors(ct_model, "compressed-tensors")
    tensors["model.layers.0.mlp.down_proj.weight_g_idx"] = torch.randperm(128, dtype=torch.int32) // 32
    _refused(tmp_path, ct_model, "compressed-tensors", r"^model\.layers\.0\.mlp\.down_proj: g_idx must be the trivial "
             r"order k // group_size: act-order", tensors)


def test_quantized_tensors_for_a_module_that_is_not_a_linear_are_refused(tmp_path, ct_model):
    tensors = checkpoint_tensors(ct_model, "compressed-tensors")
    tensors["model.norm.weight_packed"] = tensors["model.layers.0.mlp.up_proj.weight_packed"].clone()
    _refused(tmp_path, ct_model, "compressed-tensors",
             r"^model\.norm: the checkpoint quantizes it, but the model has no nn\.Linear by that name "
             r"\(found LlamaRMSNorm\)", tensors)


def test_rotary_inv_freq_left_by_old_checkpoints_is_ignored(tmp_path, ct_model):
    tensors = checkpoint_tensors(ct_model, "compressed-tensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    write_checkpoint(tmp_path, ct_model, "compressed-tensors", tensors=tensors)
    loaded = load_quantized(tmp_path)
    assert torch.equal(loaded.model.rotary_emb.inv_freq, ct_model.model.rotary_emb.inv_freq), "recomputed, not read"


def test_a_persistent_buffer_is_read_from_the_checkpoint(tmp_path, generator):
    """A buffer the model makes for real, such as DeepSeek-V3's router score-correction bias, is read from the
    checkpoint: not refused as unused, and not left at the zeros the model made it with."""
    import transformers

    config = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=96, max_position_embeddings=64, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    bias.copy_(torch.randn(bias.shape, generator=generator))
    quantize_model(model, group_size=32, skip=("lm_head", "experts", "mlp.gate"))
    write_checkpoint(tmp_path, model, "compressed-tensors")
    loaded = load_quantized(tmp_path, dtype=torch.float32).model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(loaded, bias), "the checkpoint's bias, not the model's initial zeros"


def test_unexpected_tensor_is_refused(tmp_path, ct_model):
    tensors = checkpoint_tensors(ct_model, "compressed-tensors")
    tensors["model.layers.0.mlp.extra.weight"] = torch.ones(4)
    _refused(tmp_path, ct_model, "compressed-tensors", r"does not use: model\.layers\.0\.mlp\.extra\.weight", tensors)


@pytest.mark.parametrize(("change", "match"), [
    (("config_groups", "group_0", "weights", "num_bits", 8), r"num_bits=8: only 4-bit weights"),
    (("config_groups", "group_0", "weights", "group_size", 256),
     r"config_groups\.group_0\.weights: group_size must be one of \(32, 64, 128\), got 256"),
    (("config_groups", "group_0", "weights", "group_size", 128.0), r"weights: group_size must be .*, got 128\.0"),
    (("config_groups", "group_0", "weights", "strategy", "channel"), r"strategy='channel': only per-group"),
    (("format", "marlin-24"), r"format 'marlin-24' is not supported"),
    (("config_groups", "group_0", "input_activations", {"num_bits": 8}), r"quantizes activations too"),
    (("sparsity_config", {"format": "sparse-24-bitmask"}), r"sparse checkpoints are not supported"),
    (("config_groups", "group_0", "weights", "type", "float"), r"type='float': only integer weights"),
    (("config_groups", "group_0", "weights", "symmetric", "false"), r"symmetric='false': expected true or false"),
    (("config_groups", "group_0", "weights", "dynamic", True), r"dynamic=true: only static weight scales"),
    (("quantization_status", "frozen"), r"quantization_status 'frozen': only compressed"),
    (("transform_config", {"config_groups": {"R1": {"type": "hadamard"}}}), r"transform_config \(rotated weights\)"),
    (("config_groups", {}), r"config_groups is empty"),
    (("config_groups", "group_1", dict(CT_CONFIG["config_groups"]["group_0"],
                                       weights=dict(CT_CONFIG["config_groups"]["group_0"]["weights"], group_size=64))),
     r"config_groups use different weight schemes \[\(32, True\), \(64, True\)\]"),
])
def test_unsupported_compressed_tensors_variants(change, match, tmp_path, ct_model):
    quantization = quant_config("compressed-tensors")
    *path, key, value = change
    node = quantization
    for part in path:
        node = node[part]
    node[key] = value
    _refused(tmp_path, ct_model, "compressed-tensors", "quantization_config: .*" + match, quantization=quantization)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("bits", 3, r"AWQ bits=3"), ("version", "gemv", r"AWQ version 'gemv'"), ("group_size", 16, r"AWQ: group_size must be one of .*, got 16"),
    ("quant_method", "gptq", r"quant_method 'gptq' is not supported"),
    ("zero_point", False, r"AWQ zero_point=false is not supported"),
])
def test_unsupported_awq_variants(key, value, match, tmp_path):
    model = quantize_model(tiny_model("llama", seed=14), group_size=32, symmetric=False)
    quantization = dict(AWQ_CONFIG, **{key: value})
    _refused(tmp_path, model, "awq", "quantization_config: " + match, quantization=quantization)


def test_quantization_config_defaults_and_older_spellings():
    from w4a16.models import CheckpointScheme, parse_quantization_config

    awq = {"quant_method": "AWQ", "version": "GEMM", "w_bit": 4, "q_group_size": 64}  # AutoAWQ's older key names
    assert parse_quantization_config(awq) == CheckpointScheme("awq", 64, symmetric=False)
    ct = quant_config("compressed-tensors")
    del ct["config_groups"]["group_0"]["weights"]["symmetric"]
    assert parse_quantization_config(ct) == CheckpointScheme("compressed-tensors", 32, symmetric=True), \
        "compressed-tensors weights are symmetric unless they say otherwise"


def test_awq_layer_whose_n_is_not_a_multiple_of_8_is_refused():
    # qweight [K, N // 8] has the shape the truncating division expects, which alone would load 8 of the 12 rows
    from w4a16.models import CheckpointScheme, _quantized_layer

    awq = to_awq(quantize(torch.randn(8, 64, dtype=torch.float16), 32, symmetric=False))
    tensors = {f"layer.{name}": tensor for name, tensor in awq.items()}
    with pytest.raises(ValueError, match=r"^layer: the model's layer has N = 12; AWQ packs N by 8"):
        _quantized_layer("layer", nn.Linear(64, 12, bias=False), tensors, CheckpointScheme("awq", 32, False),
                         torch.device("cpu"), torch.float16)


def test_checkpoint_path_may_name_a_file_in_the_directory(tmp_path, ct_model):
    write_checkpoint(tmp_path, ct_model, "compressed-tensors")
    loaded = load_quantized(tmp_path / "model.safetensors")
    assert isinstance(loaded.model.layers[0].mlp.down_proj, W4A16Linear)


def test_missing_shard_is_named(tmp_path, ct_model):
    write_checkpoint(tmp_path, ct_model, "compressed-tensors", shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"shard 'model-00002-of-00002\.safetensors' named by the index"):
        load_quantized(tmp_path)


def test_pickle_checkpoints_are_refused(tmp_path, ct_model):
    write_checkpoint(tmp_path, ct_model, "compressed-tensors")
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(ValueError, match=r"only pickle weights \(pytorch_model\.bin\): they are refused"):
        load_quantized(tmp_path)
    with pytest.raises(ValueError, match="pickle checkpoints are refused"):
        load_quantized(tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "pytorch_model.bin"}}))
    with pytest.raises(ValueError, match="only safetensors shards are read"):
        load_quantized(tmp_path)


def test_float_checkpoint_points_at_quantize_model(tmp_path):
    model = tiny_model("llama", seed=15)
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    with pytest.raises(ValueError, match="has no quantization_config.*quantize_model"):
        load_quantized(tmp_path)
