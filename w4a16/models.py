"""transformers integration: quantize a model's linear layers in place, or load a W4A16 checkpoint.

    quantize_model(model, group_size=128, symmetric=True, skip=("lm_head",))
        replaces every nn.Linear (except the skipped ones) by a W4A16Linear quantized round-to-nearest.
    set_backend(model, backend)
        points every W4A16Linear of the model at one backend ("auto", "reference", ...).
    load_quantized(path, device=None, dtype=None)
        reads a local compressed-tensors (pack-quantized W4A16) or AutoAWQ (GEMM) checkpoint: config.json with a
        quantization_config plus safetensors shards.

Names in `skip` match a module's full name exactly, by its last components ("lm_head" matches
"model.lm_head"), as a glob ("model.layers.0.*"), or as a regular expression with a "re:" prefix (the spelling
of compressed-tensors' `ignore` lists).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .formats import from_awq, from_compressed_tensors
from .layout import check_group_size, check_symmetric
from .linear import W4A16Linear

DEFAULT_SKIP = ("lm_head",)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    """A module is skipped when its name, or the name of a module it sits in, matches a skip pattern."""
    parts = name.split(".")
    return any(_matches(".".join(parts[:end]), skip) for end in range(1, len(parts) + 1))


def _left_unquantized(module: nn.Module) -> str | None:
    """Why quantize_model would leave a module's weights in floating point without a word, or None."""
    if type(module) is nn.Linear or isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return None
    if isinstance(module, nn.Linear):  # MultiheadAttention's out_proj, or a linear that is quantized already
        return (f"{type(module).__name__} subclasses nn.Linear, and it or the module around it may read its "
                f".weight, which W4A16Linear does not have")
    weights = [name for name, p in module.named_parameters(recurse=False) if p.dim() >= 2]
    if weights:
        return (f"{type(module).__name__} holds weight(s) {weights} of 2 or more dimensions but is not an "
                f"nn.Linear, which is all quantize_model replaces")
    return None


def _refuse_tied_weights(model: nn.Module, targets: list[tuple[str, nn.Linear]]) -> None:
    """Refuse a layer whose weight another module that stays in floating point also holds (tied embeddings): the
    replacement would break the tie without a word, and a later `tie_weights()` would hang the float weight on the
    W4A16Linear as an unused parameter."""
    target_ids = {id(m) for _, m in targets}
    holders: dict[int, list[str]] = {}  # id of a parameter -> the modules outside the targets that hold it
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) not in target_ids:
            for pname, param in module.named_parameters(recurse=False):
                holders.setdefault(id(param), []).append(f"{name}.{pname}" if name else pname)
    for name, linear in targets:
        if shared := holders.get(id(linear.weight)):
            raise ValueError(f"{name}: its weight is also {shared[0]} (tied weights, e.g. tie_word_embeddings), which "
                             f"would stay in floating point with the tie broken: add {name!r} to skip, or untie "
                             f"the weights first")


def quantize_model(
    model: nn.Module,
    group_size: int = 128,
    symmetric: bool = True,
    skip: Iterable[str] = DEFAULT_SKIP,
    backend: str = "auto",
) -> nn.Module:
    """Replace the model's nn.Linear layers by W4A16Linear (round-to-nearest), in place; returns the model.

    skip: layer names or patterns (a dotted suffix, a glob, or "re:" and a regular expression); a match skips the
    module and every module inside it. Embeddings are not nn.Linear and stay as they are; `lm_head` is skipped by
    default (pass skip=() to quantize it too). A layer reached under several names (a shared module) becomes one
    W4A16Linear under all of them. Every layer is checked and quantized before any is replaced, so an error leaves
    the model as it was. Errors, each naming the layer: in_features not a multiple of group_size; weights of 2 or
    more dimensions that this would otherwise leave unquantized without a word (GPT-2's Conv1D, the fused 3-D
    experts of a mixture-of-experts layer, MultiheadAttention) and subclasses of nn.Linear (skip them to keep them
    as they are); a shared layer skipped under one of its names only; a layer whose weight another module also holds
    (a tied lm_head); weights it cannot quantize (on the meta device, float64, NaN); no layer to quantize at all;
    and a model that is itself one nn.Linear.
    """
    check_group_size(group_size)  # both checked before any layer is touched
    check_symmetric(symmetric)
    if isinstance(skip, str):
        skip = (skip,)
    skip = tuple(skip)
    modules, kept = [], {}  # kept: id of a module skip keeps as it is -> one of its names
    for name, m in model.named_modules(remove_duplicate=False):
        if _skipped(name, skip):
            kept[id(m)] = name
        else:
            modules.append((name, m))
    unsupported = [(name, reason) for name, m in modules if (reason := _left_unquantized(m))]
    if unsupported:
        name, reason = unsupported[0]
        raise ValueError(f"{name or 'the model'}: {reason}; add it to skip to keep it as is ({len(unsupported)} "
                         f"such module(s): {[n for n, _ in unsupported[:4]]})")
    targets = [(name, m) for name, m in modules if type(m) is nn.Linear]
    if any(not name for name, _ in targets):
        raise ValueError("the model is itself an nn.Linear, which quantize_model cannot replace in place: use "
                         "W4A16Linear.from_linear(layer, group_size, symmetric)")
    if not targets:
        done = sum(isinstance(m, W4A16Linear) for m in model.modules())
        raise ValueError(f"no nn.Linear layer to quantize (skip={skip})"
                         + (f"; the model's {done} W4A16Linear layer(s) are quantized already" if done else ""))
    for name, linear in targets:
        if linear.in_features % group_size:
            raise ValueError(
                f"{name}: in_features={linear.in_features} is not a multiple of group_size={group_size}; "
                f"add {name!r} to skip or choose another group size"
            )
    for name, linear in targets:  # a shared layer skipped under one of its names would be split in two
        if id(linear) in kept:
            raise ValueError(f"{name}: the same layer is also {kept[id(linear)]}, which skip keeps in floating "
                             f"point: skip both names or neither")
    _refuse_tied_weights(model, targets)
    quantized: dict[int, W4A16Linear] = {}  # by id of the nn.Linear: a shared layer is quantized once
    for name, linear in targets:
        if id(linear) not in quantized:
            try:
                quantized[id(linear)] = W4A16Linear.from_linear(linear, group_size, symmetric, backend)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"{name}: {exc}") from exc
    for name, linear in targets:
        _set_submodule(model, name, quantized[id(linear)])
    return model


def set_backend(model: nn.Module, backend: str) -> int:
    """Set `backend` on every W4A16Linear of the model; returns how many there are."""
    layers = [m for m in model.modules() if isinstance(m, W4A16Linear)]
    for layer in layers:
        layer.backend = backend
    return len(layers)


# ---------------------------------------------------------------------------------------------------------------
# Loading W4A16 checkpoints.

# Tensor names per quantized layer, after the layer's name and a dot.
CT_TENSORS = ("weight_packed", "weight_scale", "weight_shape")  # + weight_zero_point (asymmetric), weight_g_idx
AWQ_TENSORS = ("qweight", "qzeros", "scales")
# Left over by old checkpoints; recomputed from the config.
IGNORED_CHECKPOINT_KEYS = re.compile(r".*rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class CheckpointScheme:
    """What a checkpoint's quantization_config says, reduced to what the loader needs."""

    method: str  # "compressed-tensors" or "awq"
    group_size: int
    symmetric: bool


def _scheme_error(message: str) -> ValueError:
    return ValueError(f"quantization_config: {message}")


def parse_quantization_config(quant: dict) -> CheckpointScheme:
    """Accept compressed-tensors pack-quantized W4A16 and AutoAWQ GEMM; refuse anything else, saying what."""
    if not isinstance(quant, dict):
        raise _scheme_error(f"expected a JSON object, got {type(quant).__name__}")
    method = str(quant.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _parse_compressed_tensors(quant)
    if method == "awq":
        return _parse_awq(quant)
    raise _scheme_error(f"quant_method {quant.get('quant_method')!r} is not supported: "
                        "expected 'compressed-tensors' (pack-quantized) or 'awq' (GEMM)")


def _check_group_size(group_size, where: str) -> int:
    try:
        check_group_size(group_size)
    except ValueError as error:
        raise _scheme_error(f"{where}: {error}") from None
    return group_size


def _parse_compressed_tensors(quant: dict) -> CheckpointScheme:
    if quant.get("format") != "pack-quantized":
        raise _scheme_error(f"compressed-tensors format {quant.get('format')!r} is not supported: "
                            "expected 'pack-quantized' (int4 weights packed 8 per int32)")
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise _scheme_error(f"quantization_status {status!r}: only compressed (packed) checkpoints can be loaded")
    sparsity = quant.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise _scheme_error(f"sparsity_config format {sparsity.get('format')!r}: sparse checkpoints are not supported")
    if quant.get("transform_config"):
        raise _scheme_error("transform_config (rotated weights) is not supported")
    groups = quant.get("config_groups") or {}
    if not groups:
        raise _scheme_error("config_groups is empty: nothing says how the weights are quantized")
    schemes = set()
    for name, group in groups.items():
        where = f"config_groups.{name}"
        weights = group.get("weights") or {}
        if group.get("input_activations") or group.get("output_activations"):
            raise _scheme_error(f"{where} quantizes activations too: only weight-only W4A16 is supported")
        if weights.get("num_bits") != 4:
            raise _scheme_error(f"{where}.weights num_bits={weights.get('num_bits')!r}: only 4-bit weights are supported")
        if weights.get("type", "int") != "int":
            raise _scheme_error(f"{where}.weights type={weights.get('type')!r}: only integer weights are supported")
        if weights.get("strategy") != "group":
            raise _scheme_error(f"{where}.weights strategy={weights.get('strategy')!r}: only per-group scales "
                                "('group') are supported")
        if weights.get("dynamic"):
            raise _scheme_error(f"{where}.weights dynamic=true: only static weight scales are supported")
        symmetric = weights.get("symmetric", True)
        if not isinstance(symmetric, bool):
            raise _scheme_error(f"{where}.weights symmetric={symmetric!r}: expected true or false")
        schemes.add((_check_group_size(weights.get("group_size"), f"{where}.weights"), symmetric))
    if len(schemes) != 1:
        raise _scheme_error(f"config_groups use different weight schemes {sorted(schemes)}: one scheme is supported")
    (group_size, symmetric), = schemes
    return CheckpointScheme("compressed-tensors", group_size, symmetric)


def _parse_awq(quant: dict) -> CheckpointScheme:
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise _scheme_error(f"AWQ version {quant.get('version')!r} is not supported: expected 'gemm'")
    bits = quant.get("bits", quant.get("w_bit"))
    if bits != 4:
        raise _scheme_error(f"AWQ bits={bits!r}: only 4-bit weights are supported")
    if not quant.get("zero_point", True):
        raise _scheme_error("AWQ zero_point=false is not supported: AWQ GEMM checkpoints carry zero points")
    group_size = _check_group_size(quant.get("group_size", quant.get("q_group_size")), "AWQ")
    return CheckpointScheme("awq", group_size, symmetric=False)


def _checkpoint_dir(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if os.path.isfile(path):
        if path.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl")):
            raise ValueError(f"{path}: pickle checkpoints are refused (loading them can run code); "
                             "only safetensors files are read")
        path = os.path.dirname(path) or "."
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory at {path!r} (load_quantized reads local files only)")
    return path


def _shard_files(directory: str) -> list[str]:
    """model.safetensors, or the shards an index names; a pickle checkpoint is refused, never opened."""
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(single):
        names = ["model.safetensors"]
    else:
        pickles = sorted(n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth")))
        if pickles:
            raise ValueError(f"{directory} holds only pickle weights ({', '.join(pickles)}): they are refused "
                             "(loading pickle can run code); convert the checkpoint to safetensors")
        raise FileNotFoundError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")
    for name in names:
        if not name.endswith(".safetensors"):
            raise ValueError(f"{directory}: the index names {name!r}; only safetensors shards are read (no pickle)")
        if not os.path.exists(os.path.join(directory, name)):
            raise FileNotFoundError(f"{directory}: shard {name!r} named by the index is missing")
    return [os.path.join(directory, n) for n in names]


class _Tensors:
    """Lazy access to the tensors of a set of safetensors shards, by name."""

    def __init__(self, files: list[str]) -> None:
        from safetensors import safe_open

        self._stack = contextlib.ExitStack()
        self._where = {}
        for file in files:
            handle = self._stack.enter_context(safe_open(file, framework="pt"))
            for key in handle.keys():
                self._where[key] = handle
        self.unused = set(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> Iterator[str]:
        return iter(self._where)

    def get(self, key: str) -> torch.Tensor:
        self.unused.discard(key)
        return self._where[key].get_tensor(key)

    def close(self) -> None:
        self._stack.close()


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build a module with its parameters on the meta device (no memory, no init) and its buffers real.

    Buffers stay real because some are computed at construction and never saved (rotary inv_freq): the
    checkpoint fills every parameter afterwards, and anything it leaves on meta is reported as missing.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _quantized_layer(name: str, linear: nn.Linear, tensors: _Tensors, scheme: CheckpointScheme,
                     device: torch.device, dtype: torch.dtype) -> W4A16Linear:
    """One layer's tensors -> a W4A16Linear; every failure names the layer."""
    required = CT_TENSORS if scheme.method == "compressed-tensors" else AWQ_TENSORS
    if not scheme.symmetric and scheme.method == "compressed-tensors":
        required = (*required, "weight_zero_point")
    missing = [t for t in required if f"{name}.{t}" not in tensors]
    if missing:
        raise ValueError(f"{name}: missing tensor(s) {', '.join(missing)} for a {scheme.method} layer")
    get = lambda t: tensors.get(f"{name}.{t}").to(device)
    n, k = linear.out_features, linear.in_features
    try:
        if scheme.method == "compressed-tensors":
            shape = [int(v) for v in tensors.get(f"{name}.weight_shape").tolist()]
            if shape != [n, k]:
                raise ValueError(f"weight_shape {shape} does not match the model's layer [N, K] = [{n}, {k}]")
            optional = {t: get(t) for t in ("weight_zero_point", "weight_g_idx") if f"{name}.{t}" in tensors}
            qw = from_compressed_tensors(get("weight_packed"), get("weight_scale"), (n, k),
                                         optional.get("weight_zero_point"), scheme.group_size,
                                         optional.get("weight_g_idx"))
        else:
            qweight = tensors.get(f"{name}.qweight")
            if n % 8:
                raise ValueError(f"the model's layer has N = {n}; AWQ packs N by 8, so N must be a multiple of 8")
            if tuple(qweight.shape) != (k, n // 8):
                raise ValueError(f"qweight has shape {list(qweight.shape)}, expected [K, N // 8] = [{k}, {n // 8}] "
                                 "for the model's layer")
            qw = from_awq(qweight.to(device), get("qzeros"), get("scales"), scheme.group_size)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{name}: {exc}") from exc
    bias = None
    if linear.bias is not None:
        if f"{name}.bias" not in tensors:
            raise ValueError(f"{name}: missing tensor bias (the model's layer has one)")
        bias = get("bias")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"{name}: bias has shape {list(bias.shape)}, expected [{n}]")
    return W4A16Linear.from_quantized(qw, bias, dtype)


def _resolve_dtype(dtype: torch.dtype | str | None, config) -> torch.dtype:
    asked = dtype if dtype is not None else getattr(config, "dtype", None) or torch.float16
    resolved = getattr(torch, asked, None) if isinstance(asked, str) else asked
    if resolved not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {asked!r}")
    return resolved


def load_quantized(path: str | os.PathLike, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> nn.Module:
    """A local W4A16 checkpoint directory -> a transformers causal LM whose quantized layers are W4A16Linear.

    Reads config.json (its quantization_config: compressed-tensors pack-quantized W4A16 or AutoAWQ GEMM) and the
    safetensors shards (model.safetensors or model.safetensors.index.json); never pickle. dtype defaults to the
    config's; device to CPU. A quantized layer whose variant is not supported (act-order g_idx, other bit widths
    or group sizes), a missing tensor or a wrong shape fails with a message naming the layer.
    """
    import transformers

    directory = _checkpoint_dir(path)
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{directory} has no config.json")
    with open(config_path) as f:
        raw = json.load(f)
    if "quantization_config" not in raw:
        raise ValueError(f"{config_path} has no quantization_config: for a float checkpoint, load it with "
                         "transformers and call w4a16.models.quantize_model")
    scheme = parse_quantization_config(raw["quantization_config"])
    files = _shard_files(directory)
    device = torch.device(device) if device is not None else torch.device("cpu")

    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    # The quantization is ours to apply: transformers must not look for a quantizer library of its own.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dtype = _resolve_dtype(dtype, config)
    with _parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)

    tensors = _Tensors(files)
    try:
        marker = CT_TENSORS[0] if scheme.method == "compressed-tensors" else AWQ_TENSORS[0]
        quantized = {key[: -len(marker) - 1] for key in tensors.keys() if key.endswith("." + marker)}
        modules = dict(model.named_modules())
        for name in sorted(quantized):
            if not isinstance(modules.get(name), nn.Linear):
                raise ValueError(f"{name}: the checkpoint quantizes it, but the model has no nn.Linear by that name "
                                 f"(found {type(modules.get(name)).__name__})")
            _set_submodule(model, name, _quantized_layer(name, modules[name], tensors, scheme, device, dtype))
        # Parameters (still on meta) and persistent buffers (made for real, e.g. a router's score-correction
        # bias), each in the dtype the model gave it (dtype, or float32 where the model keeps that); not the
        # buffers of the layers just converted, whose names (AWQ's qweight, scales) may also be checkpoint keys.
        state = {}
        for key, value in model.state_dict(keep_vars=True).items():
            if key in tensors and key.rpartition(".")[0] not in quantized:
                tensor = tensors.get(key)
                if tuple(tensor.shape) != tuple(value.shape):
                    raise ValueError(f"{key}: shape {list(tensor.shape)} in the checkpoint, the model expects "
                                     f"{list(value.shape)}")
                state[key] = tensor.to(device=device, dtype=value.dtype)
        model.load_state_dict(state, strict=False, assign=True)
        unused = sorted(k for k in tensors.unused if not IGNORED_CHECKPOINT_KEYS.match(k))
    finally:
        tensors.close()
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        hint = ""
        if missing[0].endswith(".weight") and missing[0][: -len(".weight")] in modules:
            hint = f" (neither {missing[0]} nor a {scheme.method} {marker} for it)"
        raise ValueError(f"the checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:5])}{hint}")
    if unused:
        raise ValueError(f"the checkpoint has {len(unused)} tensor(s) the model does not use: {', '.join(unused[:5])}")
    return model.to(device).eval()
