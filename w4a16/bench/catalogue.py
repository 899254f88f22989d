"""What the bench measures: the (N, K) of each model's linear layers, the M values, the backends, and named sets.

Shapes: qkv, o, gate_up (fused gate and up projections) and down of each model, as nn.Linear
weights [N, K]. A `Case` is one benchmark: a shape, an M, a weight format and a backend. The sets:

    quick     llama3.1-8b gate_up and down at a few M, every backend: a fast check that the harness and kernels run
    baseline  what is stored per arch and gated by --compare: llama3.1-8b and qwen3-4b, every layer, every M for
              our backends and most M for the peers; the other models at 4 M against torch and tinygemm; and a
              few format variants (fp16, asymmetric zero points, group size 32) on llama3.1-8b gate_up and down
    full      every model, every layer, every M, every backend, plus the variants

Backend applicability is data here too (`applies`), with the reason for each limit next to it.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from .. import skinny

# model -> layer -> (N, K): nn.Linear weight shapes, out_features x in_features.
MODELS: dict[str, dict[str, tuple[int, int]]] = {
    "qwen3-4b": {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
    "llama3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
    "qwen2.5-7b": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)},
    "gemma3-4b": {"qkv": (4096, 2560), "o": (2560, 2048), "gate_up": (20480, 2560), "down": (2560, 10240)},
    "smollm2-1.7b": {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
}
LAYERS = ("qkv", "o", "gate_up", "down")
M_VALUES = (1, 2, 3, 4, 5, 6, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

OURS = ("auto", "skinny", "triton", "dequant_blas")
PEERS = ("torch_bf16", "torch_fp16", "naive", "tinygemm")
BACKENDS = OURS + PEERS

# The skinny kernel is a decode kernel (auto sends it M <= 5 by default, M <= 8 on sm_90 but for the weight shapes
# w4a16/dispatch_rules.json measures apart);
# up to the most rows any arch's kernel takes (csrc/portability.h's table) the bench times it forced too, so the
# edge shows, and a forced call it refuses is skipped with its message.
SKINNY_MAX_M = max(rows for rows, _, _ in skinny.arch_table().values())
# dequant + BLAS pays a full dequantization per call: it only competes at prefill sizes.
DEQUANT_BLAS_MIN_M = 16
# tinygemm's time grows about linearly in M past decode sizes (measured on the H200: 16455 us at M = 2048 for
# llama3.1-8b gate_up, 24x torch bf16): past 256 it would spend the bench's time budget on a known loser.
TINYGEMM_MAX_M = 256
# The peers are timed at fewer M than ours (the bench must fit in a few minutes): their curves are smooth between
# these points, while ours are timed at every M because the dispatch edges (M = 5/6, 8/16) live there.
TORCH_M = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TINYGEMM_M = (1, 4, 8, 16, 64, 256)
# naive dequantizes the whole weight in fp32 every call (~70x our time): a few points show its level.
NAIVE_M = (1, 16, 256, 2048)

HEADLINE_MODELS = ("llama3.1-8b", "qwen3-4b")
QUICK_M = (1, 4, 16, 256, 2048)
OTHER_MODELS_M = (1, 16, 256, 2048)
OTHER_MODELS_BACKENDS = ("auto", "torch_bf16", "torch_fp16", "tinygemm")
VARIANT_LAYERS = ("gate_up", "down")
VARIANT_M = (1, 16, 512)
VARIANT_BACKENDS = ("auto", "skinny", "triton", "torch_bf16", "torch_fp16", "tinygemm")
# (dtype, group_size, symmetric) beyond the default bf16 / 128 / symmetric.
DEFAULT_FORMAT = ("bf16", 128, True)
VARIANT_FORMATS = (("fp16", 128, True), ("bf16", 128, False), ("bf16", 32, True))

SETS = ("quick", "baseline", "full")


@dataclass(frozen=True, order=True)
class Case:
    """One benchmark: a model layer's weight shape, M rows of activations, a weight format and a backend."""

    model: str
    layer: str
    n: int
    k: int
    m: int
    dtype: str  # "bf16" or "fp16": activations, scales and output
    group_size: int
    symmetric: bool
    backend: str

    @property
    def id(self) -> str:
        fmt = f"{self.dtype}-g{self.group_size}-{'sym' if self.symmetric else 'asym'}"
        return f"{self.model}-{self.layer}-M{self.m}-{fmt}-{self.backend}"

    @property
    def shape_key(self) -> tuple:
        """The (model, layer, N, K, format) a per-shape table groups by."""
        return (self.model, self.layer, self.n, self.k, self.dtype, self.group_size, self.symmetric)

    def as_info(self) -> dict:
        """The identifying part of a benchmark's extra_info (names as stored: N, K, M)."""
        d = asdict(self)
        d["N"], d["K"], d["M"] = d.pop("n"), d.pop("k"), d.pop("m")
        return d


def applies(backend: str, m: int, dtype: str) -> bool:
    """Whether a case is worth timing (not whether the backend is available: that is asked at run time)."""
    if backend == "torch_bf16":
        return dtype == "bf16" and m in TORCH_M
    if backend == "torch_fp16":
        return dtype == "fp16" and m in TORCH_M
    if backend == "tinygemm":  # bf16 activations only (torch's _weight_int4pack_mm)
        return dtype == "bf16" and m in TINYGEMM_M and m <= TINYGEMM_MAX_M
    if backend == "naive":
        return m in NAIVE_M
    if backend == "skinny":
        return m <= SKINNY_MAX_M
    if backend == "dequant_blas":
        return m >= DEQUANT_BLAS_MIN_M
    return backend in BACKENDS


def _cases(models, layers, ms, formats, backends) -> list[Case]:
    out = []
    for model, layer, m, (dtype, group, sym), backend in itertools.product(models, layers, ms, formats, backends):
        if applies(backend, m, dtype):
            n, k = MODELS[model][layer]
            out.append(Case(model, layer, n, k, m, dtype, group, sym, backend))
    return out


def cases(set_name: str) -> list[Case]:
    """The cases of a named set, sorted so that cases sharing a weight run one after another."""
    if set_name not in SETS:
        raise ValueError(f"set must be one of {SETS}, got {set_name!r}")
    default = (DEFAULT_FORMAT,)
    if set_name == "quick":
        selected = _cases(("llama3.1-8b",), ("gate_up", "down"), QUICK_M, default, BACKENDS)
    else:
        headline = HEADLINE_MODELS if set_name == "baseline" else tuple(MODELS)
        others = tuple(m for m in MODELS if m not in headline)
        selected = (
            _cases(headline, LAYERS, M_VALUES, default, BACKENDS)
            + _cases(others, LAYERS, OTHER_MODELS_M, default, OTHER_MODELS_BACKENDS)
            + _cases(("llama3.1-8b",), VARIANT_LAYERS, VARIANT_M, VARIANT_FORMATS, VARIANT_BACKENDS)
        )
    return sorted(set(selected), key=_order)


def _order(case: Case) -> tuple:
    # Group by weight (shape and format), then by backend (a backend's prepared weights are reused over M).
    return (case.model, LAYERS.index(case.layer), case.dtype, case.group_size, not case.symmetric,
            BACKENDS.index(case.backend), case.m)
