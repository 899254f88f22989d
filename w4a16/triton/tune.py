"""The tuner: sweep a pruned tile space on the current GPU and write `configs/<arch>.json`.

    python -m w4a16.triton.tune [--out PATH] [--results PATH] [--shapes llama3.1-8b,qwen3-4b] [--m 16,32,...]
                                [--merge]

For every benchmark shape (N, K) of the tuned models (the bench catalogue's) and every M bucket it times each candidate config of
that bucket (bf16, symmetric, G = 128; the table serves every dtype and format), the dequant_blas route and, for the
report, torch bf16 matmul on pre-dequantized weights. The candidates are the fused kernel's and, on an sm_90 GPU
with triton's Gluon, the wgmma kernel's (wgmma_kernel.py). Timing: CUDA-graph replay of one call per weight copy over a
rotation of copies of >= 4x the last-level cache (weights come from DRAM as in a model), median of CUDA-event times. Then
the case's fastest configs, dequant_blas and torch are timed again in turn a few times, and their medians kept.

The written table: per bucket an "any" rule holding the config with the best geometric-mean time relative to each
shape's best, plus exact (N, K) overrides where a shape's own best is more than OVERRIDE_GAIN faster, plus
`dequant_blas_min_m`: the smallest bucket from which dequant_blas beats the fused kernel on the geometric mean in
that bucket and every larger one, plus `dequant_blas_overrides`: each shape whose own crossover (the same rule on
its own times) differs from that.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from ..bench.catalogue import LAYERS, MODELS
from ..bench.metrics import rotation_copies
from ..bench.timing import GraphTimer, capture, last_level_cache_bytes
from .configs import CONFIG_DIR, WGMMA_BLOCK_K, TileConfig

# The models tuned on, with their shapes from the bench catalogue: model -> [(layer, N, K)].
SHAPES = {model: [(layer, *MODELS[model][layer]) for layer in LAYERS] for model in ("llama3.1-8b", "qwen3-4b")}
M_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
GROUP_SIZE = 128
OVERRIDE_GAIN = 1.05
# After the sweep of a case its fastest configs (at most FINALISTS, within FINALIST_MARGIN of the best), dequant_blas
# and torch are timed again, in turn, FINAL_ROUNDS times; the medians replace their sweep times. One sweep time per
# config drifts by up to ~10% at large M on the H200 (the same config 348.7 and 379.4 µs in two runs of one day,
# w4a16/triton/PERF.md), enough to pick the wrong tile or route; times taken in turn drift together.
FINALISTS = 4
FINALIST_MARGIN = 1.10
FINAL_ROUNDS = 3
SMEM_BUDGET = 200 * 1024  # bytes, under Hopper's 227 KB per block with room for the layout-conversion buffer


def smem_bytes(c: TileConfig) -> int:
    """Pipelined x and packed-weight tiles per stage, plus one dequantized tile for the operand conversion."""
    per_stage = c.block_m * c.block_k * 2 + c.block_n * c.block_k // 2
    return c.num_stages * per_stage + c.block_n * c.block_k * 2


def wgmma_candidates(m: int) -> list[TileConfig]:
    """The Hopper wgmma kernel's space for bucket m: tokens per tile, one, two or four warpgroups, split-K, x by TMA
    or gathered, and from M = 64 the warp-specialized (producer) form."""
    bm = min(max(16, m), 128)
    out = []
    if m >= 64:  # four warpgroups share each x tile (64 tokens: 128 would leave too few registers)
        out += [TileConfig(64, 256, WGMMA_BLOCK_K, 16, 4, split, kernel="wgmma") for split in (1, 2)]
    # Splits 3 and 6 too: on the narrow layers they beat the nearest powers of two by up to 13% (PERF.md).
    if m <= 64:
        for warps, split, gather in itertools.product((4, 8), (1, 2, 3, 4, 6, 8), (False, True)):
            out.append(TileConfig(bm, 16 * warps, WGMMA_BLOCK_K, warps, 4, split, kernel="wgmma", x_gather=gather))
    elif m <= 256:
        for split, gather in itertools.product((1, 2, 3, 4, 6), (False, True)):
            out.append(TileConfig(bm, 64, WGMMA_BLOCK_K, 4, 3, split, kernel="wgmma", x_gather=gather))
        out += [TileConfig(bm, 128, WGMMA_BLOCK_K, 8, 4, split, kernel="wgmma") for split in (1, 2)]
        out += [TileConfig(64, 128, WGMMA_BLOCK_K, 8, 4, split, kernel="wgmma") for split in (1, 2)]
        for split, gather in itertools.product((2, 4), (False, True)):  # two token tiles: twice the programs
            out.append(TileConfig(64, 64, WGMMA_BLOCK_K, 4, 4, split, kernel="wgmma", x_gather=gather))
    else:
        out += [TileConfig(bm, 64, WGMMA_BLOCK_K, 4, 3, kernel="wgmma"),
                TileConfig(bm, 128, WGMMA_BLOCK_K, 8, 4, kernel="wgmma")]
    if m >= 64:  # the producer form (one TMA warp feeding the consumer warps), 256-token tiles from M = 256
        if m <= 64:  # few weight tiles: the splits of the non-producer configs (PERF.md)
            shapes, splits = [(64, 4, 4)], (1, 2, 3, 4, 6)
        else:
            shapes = [(64, 4, 4), (128, 4, 3), (128, 4, 4)] if m <= 128 else [(128, 4, 3), (128, 4, 4), (128, 8, 4)]
            splits = (1, 2, 3) if m <= 256 else (1, 2)
        if m >= 256:
            shapes += [(256, 4, 3), (256, 8, 3)]
        # Each with x copied into operand order first, and with x read as it is (x_natural: no copy kernel).
        for (tokens, warps, stages), split, natural in itertools.product(shapes, splits, (False, True)):
            out.append(TileConfig(tokens, 16 * warps, WGMMA_BLOCK_K, warps, stages, split, kernel="wgmma",
                                  producer=True, x_natural=natural))
    return out


def wgmma_usable() -> bool:
    """Whether this process can run the wgmma kernel on the current GPU (Gluon importable, an sm_90 device)."""
    try:
        from .wgmma_kernel import unsupported_reason
    except ImportError:
        return False
    return unsupported_reason(torch.device("cuda")) is None


def candidates(m: int, wgmma: bool = False) -> list[TileConfig]:
    """The pruned space for bucket m: orientation and tile sizes that make sense at this M, within budgets; with
    `wgmma`, the Hopper kernel's configs too."""
    out = []
    if m <= 64:  # weight-left: tokens are the MMA's N (16..64); split K to fill the GPU on narrow N
        for bn, bk, split in itertools.product((64, 128), (64, 128), (1, 2, 4, 8)):
            out.append(TileConfig(max(16, m), bn, bk, 4, 4, split, True))
    elif m <= 256:
        for bm, bn, bk, split in itertools.product((64, 128), (64, 128), (64, 128), (1, 2)):
            out.append(TileConfig(bm, bn, bk, 4, 4 if bk == 64 else 3, split, True))
        out += [TileConfig(128, 128, 64, 8, 4, 1, False), TileConfig(64, 128, 64, 4, 4, 1, False)]
    else:
        for bm, bn, bk in itertools.product((128, 256), (64, 128, 256), (64, 128)):
            for wl in (True, False):
                warps = 8 if bm * bn >= 128 * 256 else 4
                out.append(TileConfig(bm, bn, bk, warps, 4 if bk == 64 else 3, 1, wl))
    keep = wgmma_candidates(m) if wgmma else []
    for c in out:
        acc_regs = c.block_m * c.block_n // (32 * c.num_warps)
        if GROUP_SIZE % c.block_k or smem_bytes(c) > SMEM_BUDGET or acc_regs > 128:
            continue
        if c.w_left and c.block_n % (16 * c.num_warps) and c.num_warps >= 4:
            continue  # the weight rows are the wgmma M dimension: 64 per warpgroup
        keep.append(c)
    return keep


def _rotation(nbytes: int) -> int:
    """Copies of a weight covering 4x the last-level cache so each call reads DRAM (at least 2; at most 64, to bound
    memory)."""
    return max(2, rotation_copies(nbytes, last_level_cache_bytes(), max_copies=64))


def _timer(fn_of_copy, copies: int, replays: int = 10):
    """Time `fn_of_copy(i)` with the bench harness's method: one CUDA graph calls it once per weight copy (each
    call reads its weights from DRAM, no host launch overhead counted); per-call µs = median replay time / copies.
    Returns a thunk so the caller decides when to measure."""

    def measure() -> float:
        graph = capture(fn_of_copy, copies, copies)
        timer = GraphTimer(graph, copies)
        for _ in range(replays):
            timer.round()
        del graph
        return timer.median() * 1e6

    return measure


def _interleaved_medians(timers: dict, rounds: int) -> dict:
    """{key: median of `rounds` calls of timers[key]()}, the timers called in turn each round."""
    samples = {key: [] for key in timers}
    for _ in range(rounds):
        for key, measure in timers.items():
            samples[key].append(measure())
    return {key: statistics.median(values) for key, values in samples.items()}


def _finalists(configs: list[tuple]) -> list:
    """Of the sweep's (config, µs) pairs, the configs worth timing again: the fastest, at most FINALISTS, within
    FINALIST_MARGIN of the best."""
    ranked = sorted(configs, key=lambda entry: entry[1])
    return [cfg for cfg, us in ranked[:FINALISTS] if us <= FINALIST_MARGIN * ranked[0][1]]


def _on_final_clock(sweep: list[tuple], final: dict) -> list[tuple]:
    """The sweep's (config, µs) pairs with the re-timed medians in place of the finalists' sweep times, and every
    other config's sweep time scaled by the finalists' median drift (re-timed / swept). The machine's clock moves
    between the sweep and the re-timing, so an unscaled sweep time could beat medians it was never timed beside."""
    swept = dict(sweep)
    drift = statistics.median(final[cfg] / swept[cfg] for cfg in final) if final else 1.0
    return [(cfg, final[cfg] if cfg in final else us * drift) for cfg, us in sweep]


def _make_weights(n: int, k: int, dtype: torch.dtype):
    from ..layout import QuantizedWeight, pack_int4

    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
    scales = (torch.rand(n, k // GROUP_SIZE, device="cuda") * 0.02 + 0.002).to(dtype)
    base = QuantizedWeight(pack_int4(q), scales, None, GROUP_SIZE)
    copies = _rotation(base.nbytes())
    return [QuantizedWeight(base.qweight.clone(), base.scales.clone(), None, GROUP_SIZE) for _ in range(copies)]


def tune(shapes: list[tuple[str, str, int, int]], m_values: list[int], log=print, after_shape=None) -> dict:
    """Time every candidate; returns {"results": [...], "table": {...}} (the table is the JSON to write).

    `after_shape(results)` runs after each shape, so a run cut short still leaves a table of what it measured."""
    from ..reference import dequantize
    from .dequant_blas import launch_dequant_blas
    from .gemm_kernel import launch_gemm

    dtype = torch.bfloat16
    wgmma = wgmma_usable()
    results = []
    total = len(shapes) * len(m_values)
    done = 0
    for model, name, n, k in shapes:
        qws = _make_weights(n, k, dtype)
        dense_copies = _rotation(n * k * 2)
        dense = [dequantize(qws[i % len(qws)], dtype) for i in range(dense_copies)]
        for m in m_values:
            done += 1
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            row = {"model": model, "layer": name, "n": n, "k": k, "m": m, "configs": []}
            timers = {
                "torch": _timer(lambda i, x=x, dense=dense: x @ dense[i % len(dense)].t(), dense_copies),
                "dequant_blas": _timer(lambda i, x=x, qws=qws: launch_dequant_blas(x, qws[i], None), len(qws)),
            }
            for cfg in candidates(m, wgmma):
                timers[cfg] = _timer(lambda i, c=cfg, x=x, qws=qws: launch_gemm(x, qws[i], None, c), len(qws))
                try:
                    us = timers[cfg]()
                except Exception as exc:  # out of resources etc.: the config is simply not a candidate here
                    log(f"    skip {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
                    continue
                row["configs"].append((cfg, us))
            if not row["configs"]:
                raise RuntimeError(f"no candidate config ran for {model} {name} N={n} K={k} M={m} (see the skips)")
            final = _interleaved_medians({key: timers[key] for key in ("torch", "dequant_blas", *_finalists(row["configs"]))},
                                         FINAL_ROUNDS)
            row["torch_us"], row["dequant_blas_us"] = final.pop("torch"), final.pop("dequant_blas")
            row["configs"] = [(cfg.to_json(), us) for cfg, us in _on_final_clock(row["configs"], final)]
            row["retimed"] = [cfg.to_json() for cfg in final]
            best_cfg, best_us = min(row["configs"], key=lambda e: e[1])
            log(f"[{done}/{total}] {model} {name} N={n} K={k} M={m}: best {best_us:.1f} µs {best_cfg} | "
                f"torch bf16 {row['torch_us']:.1f} | dequant_blas {row['dequant_blas_us']:.1f}")
            results.append(row)
        torch.cuda.empty_cache()
        if after_shape is not None:
            after_shape(results)
    return {"results": results, "table": build_table(results)}


def _crossover(blas_wins: dict[int, bool]) -> int | None:
    """The smallest bucket from which dequant_blas wins in that bucket and every larger one (None: not in the
    largest)."""
    min_m = None
    for m in sorted(blas_wins, reverse=True):
        if not blas_wins[m]:
            break
        min_m = m
    return min_m


def build_table(results: list[dict]) -> dict:
    buckets, overrides, blas_wins = [], [], {}
    shape_wins: dict[tuple[int, int], dict[int, bool]] = {}
    for m in sorted({r["m"] for r in results}):
        rows = [r for r in results if r["m"] == m]
        # Configs timed for every shape of the bucket, scored by geometric mean of time / shape's best.
        times = [{json.dumps(c, sort_keys=True): us for c, us in r["configs"]} for r in rows]
        common = set.intersection(*(set(t) for t in times))
        best = [min(t.values()) for t in times]
        score = {c: math.exp(sum(math.log(t[c] / b) for t, b in zip(times, best, strict=True)) / len(rows)) for c in common}
        default = min(score, key=score.get)
        buckets.append({"m": m, "rules": [{"when": "any", "config": json.loads(default)}]})
        picked = []  # what the table will run for each shape: its override, else the bucket's config
        for r, t, b in zip(rows, times, best, strict=True):
            own = min(t, key=t.get)
            overridden = t[default] > OVERRIDE_GAIN * b
            if overridden:
                overrides.append({"n": r["n"], "k": r["k"], "m": m, "config": json.loads(own)})
            picked.append(t[own if overridden else default])
            shape_wins.setdefault((r["n"], r["k"]), {})[m] = r["dequant_blas_us"] < picked[-1]
        # The arch's crossover against the same times as the shapes' own: what the table runs.
        table_us = math.exp(sum(math.log(us) for us in picked) / len(rows))
        blas = math.exp(sum(math.log(r["dequant_blas_us"]) for r in rows) / len(rows))
        blas_wins[m] = blas < table_us
    min_m = _crossover(blas_wins)
    shape_min_m = {shape: _crossover(wins) for shape, wins in sorted(shape_wins.items())}
    blas_overrides = [{"n": n, "k": k, "min_m": own} for (n, k), own in shape_min_m.items() if own != min_m]
    return {"buckets": buckets, "overrides": overrides, "dequant_blas_min_m": min_m,
            "dequant_blas_overrides": blas_overrides}


def _merged_crossover(new: int | None, old: int | None, lowest_retuned: int) -> int | None:
    """A dequant_blas crossover when only the buckets from `lowest_retuned` up were re-timed. A new crossover above
    that bucket is exact (dequant_blas lost in a re-timed bucket below it). One at that bucket says only that it
    wins from there up: the old table's lower crossover, if it had one, still stands for the buckets not re-timed."""
    if new is None or new > lowest_retuned:
        return new
    return old if old is not None and old <= lowest_retuned else lowest_retuned


def _merged_dequant_blas(base: dict, table: dict, lowest_retuned: int) -> dict:
    """The dequant_blas entries of a merge that re-timed every bucket from `lowest_retuned` up."""
    old_min, new_min = base.get("dequant_blas_min_m"), table["dequant_blas_min_m"]
    old = {(o["n"], o["k"]): o["min_m"] for o in base.get("dequant_blas_overrides", [])}
    new = {(o["n"], o["k"]): o["min_m"] for o in table["dequant_blas_overrides"]}
    min_m = _merged_crossover(new_min, old_min, lowest_retuned)
    by_shape = {shape: _merged_crossover(new.get(shape, new_min), old.get(shape, old_min), lowest_retuned)
                for shape in sorted(old.keys() | new.keys())}
    return {"dequant_blas_min_m": min_m,
            "dequant_blas_overrides": [{"n": n, "k": k, "min_m": m} for (n, k), m in by_shape.items() if m != min_m]}


def merge_tables(base: dict, table: dict, m_values: list[int]) -> tuple[dict, dict]:
    """`base` (a written table) with the buckets m_values and their overrides taken from `table` (build_table's
    output for those buckets only). The dequant_blas entries need the larger buckets: they are re-derived when
    every bucket of base from the smallest re-tuned one up was re-tuned, and stay base's otherwise. Returns the
    table and the meta entry saying which buckets came from which run."""
    tuned = set(m_values)
    meta = base.get("meta", {})
    suffix = all(b["m"] in tuned for b in base["buckets"] if b["m"] >= min(tuned))

    def in_full(config: dict) -> dict:  # base's entries rely on base's defaults; write_table writes its own
        return TileConfig.from_json(config, base.get("defaults", {})).to_json()

    kept_buckets = [{**b, "rules": [{**r, "config": in_full(r["config"])} for r in b["rules"]]}
                    for b in base["buckets"] if b["m"] not in tuned]
    kept_overrides = [{**o, "config": in_full(o["config"])} for o in base.get("overrides", []) if o["m"] not in tuned]
    merged = {
        "buckets": sorted(kept_buckets + table["buckets"], key=lambda b: b["m"]),
        "overrides": sorted(kept_overrides + table["overrides"], key=lambda o: (o["m"], o["n"], o["k"])),
        **(_merged_dequant_blas(base, table, min(tuned)) if suffix else {
            "dequant_blas_min_m": base.get("dequant_blas_min_m"),
            "dequant_blas_overrides": base.get("dequant_blas_overrides", [])}),
    }
    earlier = meta.get("merged", {})
    note = {"retuned_m": sorted(tuned), "other_buckets_from": earlier.get("other_buckets_from") or {
        key: meta.get(key) for key in ("date", "triton", "torch", "device")}}
    return merged, {"merged": note}


def write_table(arch: str, table: dict, path: Path, extra_meta: dict | None = None,
                models: list[str] | None = None) -> None:
    """Write `table` with its meta; `models`: the models whose shapes were tuned (default: all of SHAPES)."""
    import triton

    data = {
        "arch": arch,
        "meta": {
            "tool": "python -m w4a16.triton.tune (nox -s tune)",
            "triton": triton.__version__,
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name(),
            "how": f"CUDA-graph replay over rotated weight copies (>= 4x the last-level cache), median of CUDA events; bf16, symmetric, G={GROUP_SIZE}; shapes "
                   f"{sorted(models or SHAPES)}; per case the {FINALISTS} fastest configs within {FINALIST_MARGIN}x, "
                   f"dequant_blas and torch timed again in turn, medians of {FINAL_ROUNDS}; per bucket the best "
                   f"geometric-mean config plus exact-shape overrides where a shape's own best is > {OVERRIDE_GAIN}x faster",
            **(extra_meta or {}),
        },
        "defaults": {"num_stages": 3, "split_k": 1, "w_left": False},
        **table,
    }
    path.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    from ..arch import arch as current_arch

    parser = argparse.ArgumentParser(prog="python -m w4a16.triton.tune", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="table path (default: the package's configs/<arch>.json)")
    parser.add_argument("--results", type=Path, help="also write every timing here (JSON)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"models, from {sorted(SHAPES)}")
    parser.add_argument("--m", default=",".join(map(str, M_BUCKETS)), help="M buckets")
    parser.add_argument("--merge", action="store_true",
                        help="re-tune only the --m buckets of the table at --out (if there is one, else the package's): "
                             "keep its other buckets and their overrides, and its dequant_blas entries unless the --m "
                             "buckets are all of the table's from the smallest up; note the re-tuned buckets in its "
                             "meta")
    args = parser.parse_args(argv)
    models = [name.strip() for name in args.shapes.split(",") if name.strip()]
    if not models or set(models) - set(SHAPES):
        parser.error(f"--shapes {args.shapes!r}: give models from {sorted(SHAPES)}")
    try:
        m_values = sorted({int(v) for v in args.m.split(",") if v.strip()})
    except ValueError:
        m_values = []
    if not m_values or any(m < 1 or m & (m - 1) for m in m_values):
        parser.error(f"--m {args.m!r}: give M buckets that are powers of two (the candidate tiles are sized on them)")
    if args.merge and set(models) != set(SHAPES):
        parser.error("--merge re-tunes whole buckets, whose configs and dequant_blas crossovers are chosen over every "
                     f"shape: it needs all of --shapes ({','.join(SHAPES)})")
    if not torch.cuda.is_available():
        print("tune needs a GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    arch = current_arch()
    shapes = [(model, *s) for model in models for s in SHAPES[model]]
    print(f"tuning {arch} ({torch.cuda.get_device_name()}): {len(shapes)} shapes x {len(m_values)} M buckets, "
          f"{sum(len(candidates(m, wgmma_usable())) for m in m_values)} configs per shape", flush=True)
    path = args.out or CONFIG_DIR / f"{arch}.json"
    # --merge merges into the table at --out where one is there (so merges can follow each other), else the package's.
    base = json.loads((path if path.exists() else CONFIG_DIR / f"{arch}.json").read_text()) if args.merge else None
    total = len(shapes) * len(m_values)

    def save(results: list[dict]) -> None:
        # Written after each shape: until the last, the meta says the table is partial.
        progress = {} if len(results) == total else {"partial": f"{len(results)} of {total} cases timed"}
        if base is None:
            write_table(arch, build_table(results), path, progress, models)
        else:
            table, meta = merge_tables(base, build_table(results), m_values)
            write_table(arch, table, path, {**meta, **progress}, models)
        if args.results:
            args.results.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {path} ({len(results)} cases)", flush=True)

    tune(shapes, m_values, log=lambda s: print(s, flush=True), after_shape=save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
