"""transformers integration on tiny models built from configs (no download): quantize_model and load_quantized."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers comes with the eval extra")

from w4a16 import W4A16Linear  # noqa: E402
from w4a16.models import quantize_model, set_backend  # noqa: E402
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
    linear_names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert quantize_model(model, group_size=32, symmetric=symmetric) is model
    quantized = {n for n, m in model.named_modules() if isinstance(m, W4A16Linear)}
    assert quantized == linear_names - {"lm_head"}
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


def test_quantize_model_names_a_layer_that_cannot_be_grouped():
    model = tiny_model("llama", seed=4)
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.q_proj: in_features=64 is not a multiple "
                                         r"of group_size=128; add 'model\.layers\.0\.self_attn\.q_proj' to skip"):
        quantize_model(model, group_size=128)
    assert not any(isinstance(m, W4A16Linear) for m in model.modules()), "nothing replaced on error"


def test_set_backend_and_generate():
    model = quantize_model(tiny_model("qwen3", seed=5), group_size=32)
    assert set_backend(model, "reference") == 14
    assert {m.backend for m in model.modules() if isinstance(m, W4A16Linear)} == {"reference"}
    out = model.generate(tokens(6, batch=1, length=4), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)
