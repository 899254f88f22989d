"""Tile tables for the Triton GEMM: data in `configs/<arch>.json`, read and selected here and nowhere else.

A table holds:
- `meta`: how it was made (tool, triton version, date, device, method).
- `defaults`: values for keys a config leaves out (`num_stages`, `split_k`, `w_left`).
- `buckets`: a list of `{"m": M, "rules": [{"when": RULE, "config": {...}}, ...]}`, sorted by m. A call with M rows
  uses the nearest bucket at or above M (the largest bucket beyond the last), so a bucket key reads "M <= m", the
  way the public AMD tunings are written. Inside a bucket the first rule whose shape condition holds wins.
- `overrides` (optional): `[{"n": N, "k": K, "m": M, "config": {...}}]`, exact (N, K) entries that win over the
  rules of bucket m (the tuner writes one per benchmark shape and bucket).
- `dequant_blas_min_m` (optional): from this M on the dequantize-then-vendor-GEMM route is faster (None: never).

Shape rules (RULES below): "tall" K >= 2N, "n_gt_k" N > K, "n_ge_2k" N >= 2K, "n_ge_4k" N >= 4K, "any".
A config's BLOCK_K is clamped to the group size G (BLOCK_K must divide G: one scale per K tile and row).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from pathlib import Path

CONFIG_DIR = Path(__file__).with_name("configs")
GENERIC = "generic"
SHIPPED_ARCHS = ("gfx1151", "gfx1201", "sm_90")

RULES = {
    "any": lambda n, k: True,
    "tall": lambda n, k: k >= 2 * n,
    "n_gt_k": lambda n, k: n > k,
    "n_ge_2k": lambda n, k: n >= 2 * k,
    "n_ge_4k": lambda n, k: n >= 4 * k,
}


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One launch configuration of the fused GEMM kernel.

    w_left: compute the transposed product out^T = W x^T (the dequantized weight is the left `tl.dot` operand,
    which lets Hopper's wgmma read it from registers; see gemm_kernel.py). split_k: programs along K whose fp32
    partial sums a second kernel adds in split order (for small M, where M x N alone gives too few programs)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    split_k: int = 1
    w_left: bool = False

    @classmethod
    def from_json(cls, entry: dict, defaults: dict) -> TileConfig:
        merged = {**defaults, **entry}
        unknown = set(merged) - {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "split_k", "w_left"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} in tile config {entry}")
        return cls(merged["BLOCK_M"], merged["BLOCK_N"], merged["BLOCK_K"], merged["num_warps"],
                   merged.get("num_stages", 1), merged.get("split_k", 1), bool(merged.get("w_left", False)))

    def to_json(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                "num_warps": self.num_warps, "num_stages": self.num_stages, "split_k": self.split_k,
                "w_left": self.w_left}

    def for_group(self, group_size: int) -> TileConfig:
        """BLOCK_K clamped to the group size (all sizes are powers of two, so the result divides G)."""
        return dataclasses.replace(self, block_k=min(self.block_k, group_size))


@dataclasses.dataclass(frozen=True)
class Table:
    arch: str
    meta: dict
    buckets: tuple[tuple[int, tuple[tuple[str, TileConfig], ...]], ...]
    overrides: dict[tuple[int, int, int], TileConfig]
    dequant_blas_min_m: int | None

    def bucket_for(self, m: int) -> int:
        for bucket, _ in self.buckets:
            if m <= bucket:
                return bucket
        return self.buckets[-1][0]

    def all_configs(self) -> list[TileConfig]:
        """Every config this table can select (before clamping BLOCK_K to the group size)."""
        configs = [cfg for _, rules in self.buckets for _, cfg in rules] + list(self.overrides.values())
        return list(dict.fromkeys(configs))


def _parse(arch: str, data: dict) -> Table:
    defaults = data.get("defaults", {})
    buckets = []
    for bucket in sorted(data["buckets"], key=lambda b: b["m"]):
        rules = []
        for rule in bucket["rules"]:
            if rule["when"] not in RULES:
                raise ValueError(f"{arch}.json: unknown rule {rule['when']!r}; known: {sorted(RULES)}")
            rules.append((rule["when"], TileConfig.from_json(rule["config"], defaults)))
        if not rules or rules[-1][0] != "any":
            raise ValueError(f"{arch}.json: bucket m={bucket['m']} must end with an 'any' rule")
        buckets.append((int(bucket["m"]), tuple(rules)))
    overrides = {(o["n"], o["k"], o["m"]): TileConfig.from_json(o["config"], defaults)
                 for o in data.get("overrides", [])}
    return Table(arch, data.get("meta", {}), tuple(buckets), overrides, data.get("dequant_blas_min_m"))


@functools.cache
def load_table(arch: str) -> Table:
    """The shipped table for `arch` (a normalised name) or the generic one, with a one-time warning."""
    path = CONFIG_DIR / f"{arch}.json"
    if not path.exists():
        _warn_generic(arch)
        path = CONFIG_DIR / f"{GENERIC}.json"
    with open(path) as f:
        return _parse(path.stem, json.load(f))


@functools.cache
def _warn_generic(arch: str) -> None:
    warnings.warn(f"no Triton tile table for arch {arch!r} in {CONFIG_DIR}; using {GENERIC}.json "
                  f"(run `nox -s tune` on this GPU to make one)", stacklevel=3)


def select_config(arch: str, m: int, n: int, k: int, group_size: int) -> TileConfig:
    """THE selection function: exact (N, K) override of the bucket, else the bucket's first matching rule."""
    table = load_table(arch)
    bucket = table.bucket_for(m)
    config = table.overrides.get((n, k, bucket))
    if config is None:
        rules = dict(table.buckets)[bucket]
        config = next(cfg for when, cfg in rules if RULES[when](n, k))
    return config.for_group(group_size)


def dequant_blas_min_m(arch: str) -> int | None:
    """The smallest M from which dequantize + vendor GEMM beats the fused kernel on `arch` (None: never)."""
    return load_table(arch).dequant_blas_min_m
