"""Tile tables for the Triton GEMM: data in `configs/<arch>.json`, read and selected here and nowhere else.

A table holds:
- `meta`: how it was made (tool, triton version, date, device, method).
- `defaults`: values for keys a config leaves out (`num_stages`, `split_k`, `w_left`, `kernel`, `x_gather`,
  `producer`, `x_natural`).
- `buckets`: a list of `{"m": M, "rules": [{"when": RULE, "config": {...}}, ...]}`, sorted by m. A call with M rows
  uses the nearest bucket at or above M (the largest bucket beyond the last), so a bucket key reads "M <= m", the
  way the public AMD tunings are written. Inside a bucket the first rule whose shape condition holds wins.
- `overrides` (optional): `[{"n": N, "k": K, "m": M, "config": {...}}]`, exact (N, K) entries that win over the
  rules of bucket m (the tuner writes one per benchmark shape and bucket).
- `dequant_blas_min_m` (optional): from this M on the dequantize-then-vendor-GEMM route is faster (None: never).
- `dequant_blas_overrides` (optional): `[{"n": N, "k": K, "min_m": M or null}]`, exact (N, K) entries that win over
  `dequant_blas_min_m` (the tuner writes one per benchmark shape whose own crossover differs from the arch's).

Shape rules (RULES below): "tall" K >= 2N, "n_gt_k" N > K, "n_ge_2k" N >= 2K, "n_ge_4k" N >= 4K, "any".
A fused-kernel config's BLOCK_K is clamped to the group size G (BLOCK_K must divide G: one scale per K tile and
row). A config with "kernel": "wgmma" selects the Hopper kernel of wgmma_kernel.py instead (see TileConfig).
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


KERNELS = ("fused", "wgmma")
# The wgmma kernel's fixed K tile (owned here so configs load without triton's Gluon; wgmma_kernel imports it).
WGMMA_BLOCK_K = 128
INT32_MAX = 2**31 - 1  # the kernels' element offsets are 32-bit
GRID_YZ_MAX = 65535  # a launch grid's y and z extents, on CUDA and HIP alike


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One launch configuration of a Triton GEMM kernel.

    kernel: "fused" (gemm_kernel.py, any GPU) or "wgmma" (wgmma_kernel.py, Hopper only: the weight stays in
    registers as wgmma's operand; BLOCK_K is its fixed 128, BLOCK_N = 16 * num_warps weight rows (64 per warpgroup; 1, 2
    or 4 warpgroups), BLOCK_M tokens).
    w_left (fused): compute the transposed product out^T = W x^T (the dequantized weight is the left `tl.dot`
    operand; see gemm_kernel.py). split_k: programs along K whose fp32 partial sums a second kernel adds in split
    order (for small M, where M x N alone gives too few programs). x_gather (wgmma): read x in natural order with
    4-byte loads instead of permuting it into a copy first (saves a kernel at small M). producer (wgmma): the
    warp-specialized form, one producer warp feeding x and the packed weights by TMA to the num_warps consumer
    warps (BLOCK_M 64, 128 or 256 tokens, 4 or 8 consumer warps; the sm_90 table's pick from M = 64). x_natural
    (producer form): x read by TMA in its natural order, with no operand-ordered copy made first; each lane then reads
    all 16 words of its rows' K tile and dequantizes its quarter (wgmma_kernel.py)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    split_k: int = 1
    w_left: bool = False
    kernel: str = "fused"
    x_gather: bool = False
    producer: bool = False
    x_natural: bool = False

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"tile config kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.kernel == "fused":
            if self.x_gather or self.producer or self.x_natural:
                raise ValueError("x_gather, producer and x_natural apply to the wgmma kernel only")
            return
        problems = []
        if self.block_k != WGMMA_BLOCK_K:
            problems.append(f"BLOCK_K={self.block_k} (must be {WGMMA_BLOCK_K})")
        if self.x_natural and not self.producer:
            problems.append("x_natural without producer (the natural order of x is a mode of the producer form)")
        if self.producer:
            if self.num_warps not in (4, 8) or self.block_n != 16 * self.num_warps:
                problems.append(f"BLOCK_N={self.block_n}, num_warps={self.num_warps} (the producer form needs 4 or "
                                f"8 consumer warps and BLOCK_N = 16 * num_warps)")
            if self.block_m not in (64, 128, 256):
                problems.append(f"BLOCK_M={self.block_m} (the producer form takes 64, 128 or 256)")
            if self.num_stages < 2:
                problems.append(f"num_stages={self.num_stages} (at least 2)")
            if self.x_gather:
                problems.append("x_gather with producer (the producer form reads x by TMA)")
            if problems:
                raise ValueError(f"invalid wgmma tile config: {'; '.join(problems)}")
            return
        if self.num_warps not in (4, 8, 16) or self.block_n != 16 * self.num_warps:
            problems.append(f"BLOCK_N={self.block_n}, num_warps={self.num_warps} (need num_warps 4, 8 or 16 and "
                            f"BLOCK_N = 16 * num_warps)")
        if self.block_m not in (16, 32, 64, 128):
            problems.append(f"BLOCK_M={self.block_m} (must be 16, 32, 64 or 128)")
        elif self.num_warps == 16 and self.block_m < 32:
            problems.append(f"BLOCK_M={self.block_m} with 16 warps (at least 32: four warpgroups on fewer "
                            f"tokens were never built or measured)")
        # The ring starts with num_stages - 1 tiles in flight (one warpgroup) or num_stages - 2 (several): Triton
        # 3.6 fails to compile the kernel with a single one (an assertion in its LLVM lowering).
        if self.num_stages < (3 if self.num_warps == 4 else 4):
            problems.append(f"num_stages={self.num_stages} (at least 3 with 4 warps, 4 with 8 or 16)")
        if problems:
            raise ValueError(f"invalid wgmma tile config: {'; '.join(problems)}")

    @classmethod
    def from_json(cls, entry: dict, defaults: dict) -> TileConfig:
        merged = {**defaults, **entry}
        unknown = set(merged) - {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "split_k", "w_left",
                                 "kernel", "x_gather", "producer", "x_natural"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} in tile config {entry}")
        return cls(merged["BLOCK_M"], merged["BLOCK_N"], merged["BLOCK_K"], merged["num_warps"],
                   merged.get("num_stages", 1), merged.get("split_k", 1), bool(merged.get("w_left", False)),
                   merged.get("kernel", "fused"), bool(merged.get("x_gather", False)),
                   bool(merged.get("producer", False)), bool(merged.get("x_natural", False)))

    def to_json(self) -> dict:
        entry = {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                 "num_warps": self.num_warps, "num_stages": self.num_stages, "split_k": self.split_k}
        if self.kernel == "fused":
            entry["w_left"] = self.w_left
        else:
            entry.update(kernel=self.kernel, x_gather=self.x_gather)
            if self.producer:  # written only where set, so the tables without them read as before
                entry["producer"] = True
            if self.x_natural:
                entry["x_natural"] = True
        return entry

    def for_group(self, group_size: int) -> TileConfig:
        """The fused kernel's BLOCK_K clamped to the group size (all sizes are powers of two, so the result divides
        G). The wgmma kernel's lanes read 32 k, which never cross a group: its config serves every G as it is."""
        if self.kernel == "wgmma":
            return self
        return dataclasses.replace(self, block_k=min(self.block_k, group_size))

    def for_shape(self, m: int, n: int, k: int) -> TileConfig:
        """The config as a launch for [M, K] x [N, K] runs it: at most one K split per K tile (cdiv: the wgmma
        kernel masks a partial last tile; the fused kernel's BLOCK_K divides K), and none where the fp32 slices
        [split, M, N] would outgrow the kernels' 32-bit offsets."""
        split_k = max(1, min(self.split_k, -(-k // self.block_k)))
        if split_k * m * n > INT32_MAX:
            split_k = 1
        return self if split_k == self.split_k else dataclasses.replace(self, split_k=split_k)


# The rows of a last wave may run with token tiles this many times smaller, never below LAST_WAVE_MIN_BLOCK_M
# tokens, with LAST_WAVE_STAGES stages (4 measured faster than 3 for 128-token tiles). See wgmma_kernel.last_wave_rows.
LAST_WAVE_TILE_DIVISORS = (2, 4)
LAST_WAVE_MIN_BLOCK_M = 64
LAST_WAVE_STAGES = 4


@functools.cache  # consulted by launches that end in a partial wave
def last_wave_configs(config: TileConfig) -> tuple[TileConfig, ...]:
    """The configs a producer-form launch of `config` may give the rows of its last wave
    (wgmma_kernel.last_wave_rows), largest token tiles first; none for a config that splits K."""
    if not config.producer or config.split_k > 1:
        return ()
    return tuple(dataclasses.replace(config, block_m=config.block_m // d, num_stages=LAST_WAVE_STAGES)
                 for d in LAST_WAVE_TILE_DIVISORS if config.block_m // d >= LAST_WAVE_MIN_BLOCK_M)


@dataclasses.dataclass(frozen=True)
class Table:
    arch: str
    meta: dict
    buckets: tuple[tuple[int, tuple[tuple[str, TileConfig], ...]], ...]
    overrides: dict[tuple[int, int, int], TileConfig]
    dequant_blas_min_m: int | None
    dequant_blas_overrides: dict[tuple[int, int], int | None] = dataclasses.field(default_factory=dict)

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
    if not data.get("buckets"):
        raise ValueError(f"{arch}.json: no buckets (every M needs a bucket to select from)")
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
    blas_overrides = {(o["n"], o["k"]): o["min_m"] for o in data.get("dequant_blas_overrides", [])}
    return Table(arch, data.get("meta", {}), tuple(buckets), overrides, data.get("dequant_blas_min_m"), blas_overrides)


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
    return config.for_group(group_size).for_shape(m, n, k)


def dequant_blas_min_m(arch: str) -> int | None:
    """The smallest M from which dequantize + vendor GEMM beats the table's kernels on `arch` (None: never), for a
    weight shape without an entry of its own (dequant_blas_overrides; w4a16.dispatch applies the two)."""
    return load_table(arch).dequant_blas_min_m


def dequant_blas_overrides(arch: str) -> dict[tuple[int, int], int | None]:
    """{(N, K): that shape's own dequant_blas_min_m} where it differs from the arch's."""
    return dict(load_table(arch).dequant_blas_overrides)
