"""The bench harness's own logic, on CPU: nothing here is timed.

Rotation sizing, bytes and FLOP counting, the catalogue, tables and ratios, the regression check on two synthetic
stored runs, the no-GPU message, the tinygemm operand format (against torch's CPU int4 kernel), and the
end-to-end measurement flow on a tiny model.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from w4a16_testing import random_weight, require_module

import w4a16
from w4a16.bench import catalogue, cli, metrics, peers, results, timing

# ---------------------------------------------------------------------------------------------------------------
# Rotation sizing and counting


@pytest.mark.parametrize("bytes_per_copy, cache", [(58_720_256, 50 * 2**20), (2_162_688, 50 * 2**20),
                                                  (10**9, 50 * 2**20), (1000, 4 * 2**20), (3_000_000, None)])
def test_rotation_covers_four_times_the_cache(bytes_per_copy, cache):
    copies = metrics.rotation_copies(bytes_per_copy, cache, max_copies=10**9)
    cache_used = cache or metrics.DEFAULT_CACHE_BYTES
    assert copies * bytes_per_copy >= 4 * cache_used
    # the smallest such count: one copy fewer would not cover it (unless one copy alone does)
    assert copies == 1 or (copies - 1) * bytes_per_copy < 4 * cache_used


@pytest.mark.parametrize(("arch", "l2", "expected"), [
    ("gfx1151", 2 * 2**20, 32 * 2**20),   # Strix Halo: L2 2 MiB, Infinity Cache 32 MiB behind it
    ("gfx1201", 8 * 2**20, 64 * 2**20),
    ("sm_90", 50 * 2**20, 50 * 2**20),    # no cache past L2
    ("gfx1100", None, None),              # neither known: rotation_copies falls back to DEFAULT_CACHE_BYTES
])
def test_the_rotation_exceeds_amds_infinity_cache_not_only_l2(monkeypatch, arch, l2, expected):
    import importlib

    monkeypatch.setattr(timing, "l2_cache_bytes", lambda device=None: l2)
    monkeypatch.setattr(importlib.import_module("w4a16.arch"), "arch", lambda device=None: arch)
    assert timing.last_level_cache_bytes() == expected


def test_rotation_limits_and_errors():
    assert metrics.rotation_copies(10**10, 50 * 2**20) == 1
    assert metrics.rotation_copies(1, 50 * 2**20, max_copies=64) == 64
    with pytest.raises(ValueError, match="bytes_per_copy must be positive"):
        metrics.rotation_copies(0, 2**20)


def test_calls_per_replay():
    assert metrics.calls_per_replay(copies=4, seconds_per_call=1e-3, target_seconds=2e-3, max_calls=1000) == 4
    assert metrics.calls_per_replay(copies=4, seconds_per_call=5e-6, target_seconds=2e-3, max_calls=1000) == 400
    assert metrics.calls_per_replay(copies=4, seconds_per_call=1e-7, target_seconds=2e-3, max_calls=1000) == 1000
    assert metrics.calls_per_replay(copies=600, seconds_per_call=1e-7, target_seconds=2e-3, max_calls=500) == 600


def test_settle_replays():
    # 2 ms replays run 125 times to settle for 0.25 s; long replays still get the minimum
    assert metrics.settle_replays(2e-3, 0.25, minimum=2) == 125
    assert metrics.settle_replays(0.3, 0.25, minimum=2) == 2
    assert metrics.settle_replays(2e-3, 0.0, minimum=2) == 2
    assert metrics.settle_replays(0.0, 0.25, minimum=3) == 3  # an unmeasurably short first replay


def test_a_probe_too_short_to_measure_gets_the_most_calls():
    # a probe graph that read 0 s per call says nothing about the call's length: the replay is made as long as allowed
    assert metrics.calls_per_replay(copies=4, seconds_per_call=0.0, target_seconds=2e-3, max_calls=700) == 700


def test_a_cache_size_of_zero_falls_back_on_the_default():
    """A device that reports its cache as 0 bytes has an unknown cache, not none: the rotation still covers 4x the
    default size, as it does for an unreported one."""
    per_copy = 3 * 2**20
    copies = metrics.rotation_copies(per_copy, 0)
    assert copies == metrics.rotation_copies(per_copy, None)
    assert copies * per_copy >= 4 * metrics.DEFAULT_CACHE_BYTES


def test_torch_fp16_reads_its_dense_weight():
    n, k = 96, 384
    dense = torch.empty(n, k, dtype=torch.float16)
    assert metrics.weight_bytes("torch_fp16", n, k, 128, True) == dense.numel() * dense.element_size()


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_bytes_match_the_layout(generator, symmetric, group_size):
    qw = random_weight(96, 256, group_size, symmetric, torch.bfloat16, generator=generator)
    assert metrics.int4_weight_bytes(96, 256, group_size, symmetric) == qw.nbytes()
    m = 3
    expected = qw.nbytes() + m * 256 * 2 + m * 96 * 2
    assert metrics.case_bytes("auto", 96, 256, m, group_size, symmetric) == expected
    assert metrics.case_bytes("naive", 96, 256, m, group_size, symmetric) == expected
    assert metrics.floor_bytes(96, 256, m, group_size, symmetric) == expected


def test_peer_bytes_and_flops(generator):
    n, k, g = 128, 512, 64
    assert metrics.weight_bytes("torch_bf16", n, k, g, True) == n * k * 2
    qw = random_weight(n, k, g, False, torch.bfloat16, generator=generator)
    nibbles, sz = peers.tinygemm_operands(qw)
    assert metrics.weight_bytes("tinygemm", n, k, g, False) == nibbles.numel() + sz.numel() * sz.element_size()
    assert metrics.flops(n, k, 5) == 2 * 5 * n * k
    assert metrics.gbps(4e9, 2.0) == pytest.approx(2.0)
    assert metrics.tflops(1000, 1000, 1000, 1e-3) == pytest.approx(2.0)


# ---------------------------------------------------------------------------------------------------------------
# The catalogue


def test_catalogue_shapes_are_design_md():
    assert catalogue.MODELS["llama3.1-8b"] == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                               "down": (4096, 14336)}
    assert catalogue.MODELS["qwen3-4b"]["down"] == (2560, 9728)
    assert len(catalogue.M_VALUES) == 16 and catalogue.M_VALUES[0] == 1 and catalogue.M_VALUES[-1] == 4096
    for layers in catalogue.MODELS.values():
        for n, k in layers.values():
            assert k % 128 == 0 and n % 8 == 0  # every group size and tinygemm's tiles apply


def test_catalogue_sets():
    quick, baseline = catalogue.cases("quick"), catalogue.cases("baseline")
    assert set(quick) <= set(baseline) <= set(catalogue.cases("full"))
    assert len({c.id for c in baseline}) == len(baseline)
    headline = [c for c in baseline if c.model == "llama3.1-8b" and c.backend == "auto"
                and (c.dtype, c.group_size, c.symmetric) == catalogue.DEFAULT_FORMAT]
    assert {c.m for c in headline} == set(catalogue.M_VALUES)
    assert {c.layer for c in headline} == set(catalogue.LAYERS)
    assert all(c.dtype == "bf16" and c.m <= catalogue.TINYGEMM_MAX_M for c in baseline if c.backend == "tinygemm")
    assert all(c.m <= catalogue.SKINNY_MAX_M for c in baseline if c.backend == "skinny")
    assert not [c for c in baseline if c.backend == "torch_bf16" and c.dtype != "bf16"]
    assert {c.backend for c in baseline if c.dtype == "fp16"} >= {"auto", "torch_fp16"}
    with pytest.raises(ValueError, match="set must be one of"):
        catalogue.cases("everything")


def test_case_info_names():
    case = catalogue.cases("quick")[0]
    info = case.as_info()
    assert set(info) == {"model", "layer", "N", "K", "M", "dtype", "group_size", "symmetric", "backend"}
    assert set(info) == set(results.KEY_FIELDS)


def test_a_cases_key_is_the_key_of_its_stored_record(tmp_path):
    """--compare matches what a run was asked to measure (case_key) against what it stored (Record.key): the two
    spell the same key, or a case that stopped being measured would never count as missing."""
    cases = [c for c in catalogue.cases("baseline") if c.backend in catalogue.OURS][:50]
    benches = [{"name": c.id, "extra_info": {**c.as_info(), "us_per_call": 5.0}, "stats": {"median": 5e-6}}
               for c in cases]
    run = results.load_run(_write_run(tmp_path / "run.json", "2026-01-01T00:00:00", benches))
    assert [results.case_key(c) for c in cases] == list(run.records)


def test_every_models_shapes_and_the_m_values_are_design_md():
    # DESIGN.md's benchmark protocol, (N, K) of qkv, o, gate_up, down per model, and its M values
    design = {
        "qwen3-4b": [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)],
        "llama3.1-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
        "qwen3-8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],
        "qwen2.5-7b": [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)],
        "gemma3-4b": [(4096, 2560), (2560, 2048), (20480, 2560), (2560, 10240)],
        "smollm2-1.7b": [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
    }
    assert {model: [layers[name] for name in ("qkv", "o", "gate_up", "down")]
            for model, layers in catalogue.MODELS.items()} == design
    assert catalogue.M_VALUES == (1, 2, 3, 4, 5, 6, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def test_the_baseline_times_each_backend_at_its_own_m_values():
    """Each backend is timed where it is worth it: skinny up to the most rows any arch's kernel takes (its edge
    included), dequant + BLAS from M = 16, the peers at their own lists, torch_fp16 on fp16 cases only."""
    from w4a16 import skinny

    baseline = catalogue.cases("baseline")
    down = [c for c in baseline if c.model == "llama3.1-8b" and c.layer == "down"
            and (c.dtype, c.group_size, c.symmetric) == catalogue.DEFAULT_FORMAT]

    def ms(backend):
        return {c.m for c in down if c.backend == backend}

    skinny_rows = max(rows for rows, _, _ in skinny.arch_table().values())
    assert ms("skinny") == {m for m in catalogue.M_VALUES if m <= skinny_rows}
    assert ms("dequant_blas") == {m for m in catalogue.M_VALUES if m >= 16}
    assert ms("auto") == ms("triton") == set(catalogue.M_VALUES)
    assert ms("torch_bf16") == set(catalogue.TORCH_M)
    assert ms("tinygemm") == set(catalogue.TINYGEMM_M)
    assert ms("naive") == set(catalogue.NAIVE_M) and len(ms("naive")) < len(ms("auto"))
    assert {c.dtype for c in baseline if c.backend == "torch_fp16"} == {"fp16"}


def test_the_baseline_holds_the_format_variants_of_llama_gate_up_and_down():
    # fp16 activations, asymmetric zero points and group size 32, each against the default bf16 / g128 / sym
    formats = {(c.layer, c.dtype, c.group_size, c.symmetric) for c in catalogue.cases("baseline")
               if c.model == "llama3.1-8b" and c.backend == "auto"}
    for layer in ("gate_up", "down"):
        for fmt in (("fp16", 128, True), ("bf16", 128, False), ("bf16", 32, True)):
            assert (layer, *fmt) in formats


def test_the_full_set_times_every_model_at_every_m():
    full = catalogue.cases("full")
    for model in catalogue.MODELS:
        ours = [c for c in full if c.model == model and c.backend == "auto"
                and (c.dtype, c.group_size, c.symmetric) == catalogue.DEFAULT_FORMAT]
        assert {(c.layer, c.m) for c in ours} == {(layer, m) for layer in catalogue.LAYERS for m in catalogue.M_VALUES}
    assert len(full) > len(catalogue.cases("baseline"))


def test_cases_sharing_a_weight_and_a_backend_run_one_after_another():
    """The bench prepares a weight once per shape and format, and a backend's prepared weights once per weight:
    in a set's order, neither comes back after another has started."""
    cases = catalogue.cases("full")
    for key in (lambda c: c.shape_key, lambda c: (c.shape_key, c.backend)):
        keys = [key(c) for c in cases]
        starts = [k for i, k in enumerate(keys) if i == 0 or k != keys[i - 1]]
        assert len(starts) == len(set(keys))

# ---------------------------------------------------------------------------------------------------------------
# Synthetic stored runs: tables, ratios, compare


def _bench(model, layer, m, backend, us, n=4096, k=4096, dtype="bf16", g=128, sym=True):
    info = {"model": model, "layer": layer, "N": n, "K": k, "M": m, "dtype": dtype, "group_size": g,
            "symmetric": sym, "backend": backend, "us_per_call": us}
    return {"name": f"test_gemm[{model}-{layer}-M{m}-{backend}]", "extra_info": info,
            "stats": {"median": us / 1e6, "min": us / 1e6}}


def _write_run(path: Path, when: str, benches: list[dict], copy_gbps=4000.0, gpu="NVIDIA H200") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"datetime": when, "machine_info": {"w4a16": {"copy_gbps": copy_gbps, "gpu": gpu}},
                                "benchmarks": benches}))
    return path


BASE = [_bench("llama3.1-8b", "o", 1, "auto", 10.0), _bench("llama3.1-8b", "o", 1, "torch_bf16", 20.0),
        _bench("llama3.1-8b", "o", 1, "tinygemm", 16.0), _bench("llama3.1-8b", "o", 256, "auto", 50.0),
        _bench("llama3.1-8b", "o", 256, "torch_bf16", 40.0), _bench("llama3.1-8b", "o", 1, "skinny", 9.0)]


def test_rows_ratio_and_bandwidth(tmp_path):
    run = results.load_run(_write_run(tmp_path / "a.json", "2026-01-01T00:00:00", BASE))
    rows = results.shape_rows(run.records.values(), run.copy_gbps)[("llama3.1-8b", "o", 4096, 4096, "bf16", 128, True)]
    assert [r.m for r in rows] == [1, 256]
    decode, prefill = rows
    assert decode.best_peer == "tinygemm" and decode.speedup == pytest.approx(1.6)
    assert decode.ratio == pytest.approx(10 / 16)
    nbytes = metrics.case_bytes("auto", 4096, 4096, 1, 128, True)
    assert decode.ours_gbps == pytest.approx(nbytes / 10e-6 / 1e9)
    assert decode.ours_pct_copy == pytest.approx(100 * decode.ours_gbps / 4000.0)
    assert decode.ours_tflops == pytest.approx(2 * 4096 * 4096 / 10e-6 / 1e12)
    assert prefill.best_peer == "torch_bf16" and prefill.speedup == pytest.approx(0.8)
    text = results.format_tables(run.records.values(), run.copy_gbps)
    assert "**llama3.1-8b o** N=4096 K=4096 bf16 g128 sym" in text
    assert "| 1 | 10.00 | 9.00 | 20.00 | 16.00 |" in text and "1.60x" in text
    assert "decode M<=8: 1.60x over 1 cases" in results.summary(run.records.values())


def test_load_run_ignores_foreign_benchmarks(tmp_path):
    foreign = {"name": "test_other", "extra_info": {}, "stats": {"median": 1.0}}
    run = results.load_run(_write_run(tmp_path / "a.json", "2026-01-01T00:00:00", [*BASE, foreign]))
    assert len(run.records) == len(BASE)


def test_newest_baseline_by_recorded_datetime(tmp_path):
    storage = tmp_path / "sm_90"
    old = _write_run(storage / "Linux-CPython-3.12-64bit" / "0002_baseline.json", "2026-01-01T00:00:00", BASE)
    new = _write_run(storage / "Linux-CPython-3.11-64bit" / "0001_baseline.json", "2026-02-01T00:00:00", BASE)
    quick = _write_run(storage / "Linux-CPython-3.11-64bit" / "0003_quick.json", "2026-02-02T00:00:00", BASE)
    (storage / "e2e-20260301.json").write_text(json.dumps({"datetime": "2026-03-01", "results": []}))
    assert results.stored_runs(storage) == [old, new, quick]
    assert results.newest_baseline(storage) == quick
    # --compare measures against the newest run of the same case set, not the newest of any
    assert results.newest_baseline(storage, "baseline") == new
    assert results.newest_baseline(storage, "quick") == quick
    assert results.newest_baseline(storage, "variants") is None
    assert results.newest_baseline(tmp_path / "gfx1151") is None


def test_newest_baseline_of_this_gpu(tmp_path):
    # an H100 and an H200 are both sm_90: their runs share the arch's folder, and each GPU compares with its own
    storage = tmp_path / "sm_90"
    h200 = _write_run(storage / "m" / "0001_quick.json", "2026-01-01T00:00:00", BASE)
    h100 = _write_run(storage / "m" / "0002_quick.json", "2026-01-02T00:00:00", BASE, gpu="NVIDIA H100 80GB HBM3")
    assert results.newest_baseline(storage, "quick") == h100
    assert results.newest_baseline(storage, "quick", gpu="NVIDIA H200") == h200
    assert results.newest_baseline(storage, "quick", gpu="NVIDIA H100 80GB HBM3") == h100
    assert results.newest_baseline(storage, "quick", gpu="NVIDIA GH200 480GB") is None


def test_per_gpu_names():
    assert results.per_gpu_name("tables.md", "NVIDIA H200") == "tables-nvidia-h200.md"
    assert results.per_gpu_name("llama3.1-8b.png", "NVIDIA H100 80GB HBM3") == "llama3.1-8b-nvidia-h100-80gb-hbm3.png"
    assert results.per_gpu_name("tables.md", "AMD Radeon Graphics (gfx1151)") == "tables-amd-radeon-graphics-gfx1151.md"


def test_store_run_numbers_after_every_stored_run(tmp_path):
    from pytest_benchmark.utils import get_machine_id

    storage = tmp_path / "sm_90"
    _write_run(storage / "Linux-CPython-3.12-64bit" / "0007_quick.json", "2026-01-01T00:00:00", BASE)
    run = _write_run(tmp_path / "out" / "run.json", "2026-01-02T00:00:00", BASE)
    stored = results.store_run(run, storage, "baseline")
    assert stored == storage / get_machine_id() / "0008_baseline.json"
    assert stored.read_bytes() == run.read_bytes()
    assert results.newest_baseline(storage, "baseline") == stored


def test_the_first_run_stored_is_numbered_0001(tmp_path):
    from pytest_benchmark.utils import get_machine_id

    run = _write_run(tmp_path / "out" / "run.json", "2026-01-02T00:00:00", BASE)
    stored = results.store_run(run, tmp_path / "gfx1151", "quick")
    assert stored == tmp_path / "gfx1151" / get_machine_id() / "0001_quick.json"


def test_load_run_keeps_only_usable_timings(tmp_path):
    """A benchmark with only part of our extra_info (another test's) or a median of zero, NaN or infinity is no
    case; one whose stats lack a median is read from the µs per call it recorded."""
    partial = {"name": "test_other[M4]", "extra_info": {"model": "llama3.1-8b", "M": 4}, "stats": {"median": 1e-5}}
    zero = _bench("llama3.1-8b", "o", 2, "auto", 0.0)
    nan, inf = _bench("llama3.1-8b", "o", 3, "auto", 3.0), _bench("llama3.1-8b", "o", 4, "auto", 4.0)
    nan["stats"]["median"], inf["stats"]["median"] = float("nan"), float("inf")
    no_median = _bench("llama3.1-8b", "o", 5, "auto", 7.5)
    no_median["stats"] = {}
    run = results.load_run(_write_run(tmp_path / "a.json", "2026-01-01T00:00:00", [partial, zero, nan, inf, no_median]))
    assert list(run.records) == [("llama3.1-8b", "o", 4096, 4096, 5, "bf16", 128, True, "auto")]
    assert next(iter(run.records.values())).seconds == pytest.approx(7.5e-6)


def test_stored_runs_are_ordered_by_recorded_datetime_not_by_file(tmp_path):
    storage = tmp_path / "sm_90"
    days = [4, 1, 6, 2, 5, 3]  # the run in file i was recorded on day days[i]
    paths = [_write_run(storage / f"m{i % 2}" / f"{i + 1:04d}_quick.json", f"2026-01-{day:02d}T00:00:00", BASE)
             for i, day in enumerate(days)]
    assert results.stored_runs(storage) == [path for _, path in sorted(zip(days, paths, strict=True))]
    assert results.newest_baseline(storage, "quick") == paths[2]


def test_the_chain_of_a_set_holds_only_runs_of_that_set(tmp_path):
    """A run of another set stored between two links of a chain (a deliberate baseline of the full set, say) neither
    ends the chain nor joins it."""
    storage = tmp_path / "sm_90"
    first = _write_run(storage / "m" / "0001_quick.json", "2026-01-01T00:00:00", BASE)
    _write_run(storage / "m" / "0002_baseline.json", "2026-01-02T00:00:00", BASE)
    second = _write_run(storage / "m" / "0003_quick.json", "2026-01-03T00:00:00", BASE)
    results.mark_compared(second, first)
    assert [run.path.name for run in results.baseline_chain(storage, "quick", "NVIDIA H200")] == [
        "0001_quick.json", "0003_quick.json"]


def _scaled(benches, factor, backends):
    out = []
    for b in benches:
        b = json.loads(json.dumps(b))
        if b["extra_info"]["backend"] in backends:
            b["stats"]["median"] *= factor
        out.append(b)
    return out


def test_compare_within_threshold_passes(tmp_path):
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE))
    cur = results.load_run(_write_run(tmp_path / "cur.json", "2026-01-02T00:00:00",
                                      _scaled(BASE, 1.08, catalogue.OURS)))
    comparison = results.compare(cur, base, 0.10)
    assert comparison.ok and not comparison.regressions
    assert len(comparison.changes) == len(BASE)
    assert "compare: PASS" in comparison.report()


@pytest.mark.parametrize("slowdown, passes", [(1.099, True), (1.101, False)])
def test_compare_gates_at_ten_percent_by_default(tmp_path, slowdown, passes):
    """compare() without a threshold gates at the README's default, 10% relative to the anchor."""
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE))
    cur = results.load_run(_write_run(tmp_path / "cur.json", "2026-01-02T00:00:00",
                                      _scaled(BASE, slowdown, catalogue.OURS)))
    comparison = results.compare(cur, base)
    assert comparison.ok == passes, f"ours {slowdown - 1:+.1%} relative to the anchor:\n{comparison.report()}"


def test_compare_regression_of_ours_fails(tmp_path):
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE))
    cur = results.load_run(_write_run(tmp_path / "cur.json", "2026-01-02T00:00:00", _scaled(BASE, 1.2, {"skinny"})))
    comparison = results.compare(cur, base, results.parse_threshold("10%"))
    assert not comparison.ok
    assert [c.key[-1] for c in comparison.failures] == ["skinny"]
    assert comparison.failures[0].ratio == pytest.approx(1.2)
    assert "REGRESSED (ours)" in comparison.report() and "+20.0%" in comparison.report()
    # the peers of the same shape and M are shown next to it
    moved = results.load_run(_write_run(tmp_path / "moved.json", "2026-01-02T00:00:00",
                                        _scaled(_scaled(BASE, 1.2, {"skinny"}), 1.07, {"torch_bf16"})))
    [line] = [ln for ln in results.compare(moved, base, 0.10).report().splitlines() if "+20.0%" in ln]
    assert line.endswith("(+20.0%), +12.1% relative to torch_bf16 (which moved +7.0%, the median of its 1 decode "
                         "case); peers here: torch_bf16 +7.0%, tinygemm +0.0%")
    # a looser threshold lets the same runs pass
    assert results.compare(cur, base, 0.25).ok


def test_compare_measures_ours_against_the_same_runs_torch_matmul(tmp_path):
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE))
    # the whole machine 25% slower (clocks): every time moves, nothing regressed relative to torch
    slow_machine = _write_run(tmp_path / "slow.json", "2026-01-02T00:00:00", _scaled(BASE, 1.25, catalogue.BACKENDS))
    comparison = results.compare(results.load_run(slow_machine), base, 0.10)
    assert comparison.ok and not comparison.failures
    assert all(c.relative_ratio == pytest.approx(1.0) for c in comparison.changes if c.gated)
    # ours 12% slower while torch got 8% faster: within 12% on the median alone, 21% relative to torch
    drifted = _scaled(_scaled(BASE, 1.12, {"auto"}), 1 / 1.08, {"torch_bf16"})
    comparison = results.compare(results.load_run(_write_run(tmp_path / "d.json", "2026-01-02", drifted)), base, 0.10)
    assert [(c.key[4], c.key[-1]) for c in comparison.failures] == [(1, "auto"), (256, "auto")]
    assert comparison.failures[0].relative_ratio == pytest.approx(1.2096)


def _write_collected(kwargs, benches):
    """As tests/bench/conftest.py does where the bench asks: the case keys the child pytest selected."""
    path = kwargs.get("env", {}).get(cli.COLLECTED_ENV)
    if path:
        Path(path).write_text(json.dumps([results._info_key(b["extra_info"]) for b in benches]))


def _fake_bench_run(monkeypatch, benches, selected=None, status=0, calls=None):
    """cli._run_kernels with the child pytest replaced by one that writes `benches` as its JSON and exits with
    `status`, having selected `selected` (default: `benches`); each command it gets is appended to `calls`."""

    def fake_pytest(command, **kwargs):
        if calls is not None:
            calls.append(command)
        [json_arg] = [a for a in command if a.startswith("--benchmark-json=")]
        _write_run(Path(json_arg.split("=", 1)[1]), "2026-01-03T00:00:00", benches)
        _write_collected(kwargs, benches if selected is None else selected)
        return status

    monkeypatch.setattr(cli.subprocess, "call", fake_pytest)
    monkeypatch.setattr(cli, "_plots", lambda *args: [])
    monkeypatch.setattr(cli, "_device_name", lambda: "NVIDIA H200")


@pytest.mark.parametrize("slowdown, saved", [(1.0, True), (1.5, False)])
def test_save_stores_only_a_run_that_passed_its_comparison(tmp_path, monkeypatch, slowdown, saved):
    import argparse

    storage = tmp_path / "sm_90"
    quick = [b for b in BASE if b["extra_info"]["M"] == 1]
    _write_run(storage / "machine" / "0001_quick.json", "2026-01-01T00:00:00", quick)
    # a newer run of another set is not what --quick --compare measures against
    _write_run(storage / "machine" / "0002_baseline.json", "2026-01-02T00:00:00", _scaled(quick, 9.0, {"auto"}))
    # nor is a newer run of the same set from another GPU of the arch
    _write_run(storage / "machine" / "0003_quick.json", "2026-01-02T00:00:00", _scaled(quick, 9.0, {"auto"}),
               gpu="NVIDIA H100 80GB HBM3")
    _fake_bench_run(monkeypatch, _scaled(quick, slowdown, {"auto"}))
    monkeypatch.setattr(cli, "_selected", lambda set_name, models: catalogue.cases("quick")[:1])
    args = argparse.Namespace(set="quick", save=True, compare="newest", pytest_args=["-k", "o"],
                              inject_slowdown=False)
    status = cli._run_kernels(args, "sm_90", None, 0.10, storage, tmp_path / "out", "stamp")
    assert status == (0 if saved else 1)
    assert "baseline: " + str(storage / "machine" / "0001_quick.json") in (tmp_path / "out" / "compare.txt").read_text()
    stored = results.newest_baseline(storage, "quick", gpu="NVIDIA H200")
    assert (stored.name == "0004_quick.json") == saved
    # the stored run's table is kept under its GPU's name, beside those of the arch's other GPUs
    assert (storage / "tables-nvidia-h200.md").is_file() == saved and not (storage / "tables.md").exists()


def test_compare_bounds_the_drift_of_a_chain_of_passing_saves(tmp_path, monkeypatch):
    """Each passing --compare --save becomes the next baseline: 9% slower per round would pass forever against the
    newest alone. Against every run of the chain, ours as a whole must stay within the threshold."""
    import argparse

    storage = tmp_path / "sm_90"
    quick = [b for b in BASE if b["extra_info"]["M"] == 1]
    _write_run(storage / "machine" / "0001_quick.json", "2026-01-01T00:00:00", quick)
    monkeypatch.setattr(cli, "_selected", lambda set_name, models: catalogue.cases("quick")[:1])

    def round_at(factor, compare="newest"):
        _fake_bench_run(monkeypatch, _scaled(quick, factor, catalogue.OURS))
        args = argparse.Namespace(set="quick", save=True, compare=compare, pytest_args=[], inject_slowdown=False)
        status = cli._run_kernels(args, "sm_90", None, 0.10, storage, tmp_path / "out", "stamp")
        return status, results.newest_baseline(storage, "quick", gpu="NVIDIA H200").name

    assert round_at(1.09) == (0, "0002_quick.json")
    assert results.baseline_chain(storage, "quick", "NVIDIA H200")[0].path.name == "0001_quick.json"
    # 9% over 0002, the newest: each case passes, but ours are 19% over 0001, where the chain starts
    assert round_at(1.09**2) == (1, "0002_quick.json")
    report = (tmp_path / "out" / "compare.txt").read_text()
    assert "REGRESSED" not in report and "compare: FAIL" in report
    assert ("DRIFTED: ours' geometric mean relative to the anchor against the 2 stored run(s) since 0001_quick.json, "
            "the last one stored without a passing comparison: worst 1.188 (0001_quick.json)") in report
    # A plain --save (no comparison) is the deliberate new baseline: the chain starts again there.
    assert round_at(1.09**2, compare=None) == (0, "0003_quick.json")
    assert round_at(1.09**2 * 1.05) == (0, "0004_quick.json")
    assert [run.path.name for run in results.baseline_chain(storage, "quick", "NVIDIA H200")] == [
        "0003_quick.json", "0004_quick.json"]
    # Another GPU's runs of the arch, stored between them, are no link of this GPU's chain, nor its end.
    _write_run(storage / "machine" / "0005_quick.json", "2026-01-04T00:00:00", quick, gpu="NVIDIA H100 80GB HBM3")
    assert [run.path.name for run in results.baseline_chain(storage, "quick", "NVIDIA H200")] == [
        "0003_quick.json", "0004_quick.json"]
    assert [run.path.name for run in results.baseline_chain(storage, "quick", "NVIDIA H100 80GB HBM3")] == [
        "0005_quick.json"]


@pytest.mark.parametrize("again_factors, status", [((1.0,), 0), ((1.5, 1.02), 0), ((1.5, 1.5), 1)])
def test_a_regression_must_reproduce_when_measured_again(tmp_path, monkeypatch, again_factors, status):
    import argparse

    storage = tmp_path / "sm_90"
    _write_run(storage / "machine" / "0001_quick.json", "2026-01-01T00:00:00", BASE)
    calls = []

    def fake_pytest(command, **kwargs):
        [json_arg] = [a for a in command if a.startswith("--benchmark-json=")]
        targets = [a for a in command if "test_kernels.py" in a]
        calls.append(targets)
        if len(calls) == 1:  # the whole set: o at M = 1 regressed by 1.5x, M = 256 as before
            benches = [b if b["extra_info"]["M"] == 256 else _scaled([b], 1.5, {"auto", "skinny"})[0] for b in BASE]
        else:  # measured again: only the regressed shape's benchmarks, every backend
            factor = again_factors[len(calls) - 2]
            benches = _scaled([b for b in BASE if b["extra_info"]["M"] == 1], factor, {"auto", "skinny"})
        _write_run(Path(json_arg.split("=", 1)[1]), "2026-01-03T00:00:00", benches)
        _write_collected(kwargs, benches)
        return 0

    monkeypatch.setattr(cli.subprocess, "call", fake_pytest)
    monkeypatch.setattr(cli, "_plots", lambda *args: [])
    monkeypatch.setattr(cli, "_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(cli, "_selected", lambda set_name, models: catalogue.cases("quick")[:1])
    args = argparse.Namespace(set="quick", save=True, compare="newest", pytest_args=["-k", "o"],
                              inject_slowdown=False)
    assert cli._run_kernels(args, "sm_90", None, 0.10, storage, tmp_path / "out", "stamp") == status
    # measured again until it passes or CONFIRM_RUNS fresh measurements all regressed; only the M = 1 shape
    assert len(calls) == 1 + min(len(again_factors), cli.CONFIRM_RUNS)
    assert calls[0][0].endswith("test_kernels.py")
    assert all(len(t) == 4 and all("M1-" in x for x in t) for t in calls[1:])
    report = (tmp_path / "out" / "compare.txt").read_text()
    assert "measured again" in report and ("compare: PASS" if status == 0 else "compare: FAIL") in report
    stored = results.newest_baseline(storage, "quick", gpu="NVIDIA H200")
    if status == 0:  # what is stored is the better measurement, with the rest of the first run
        run = results.load_run(stored)
        assert stored.name == "0002_quick.json" and len(run.records) == len(BASE)
        auto_m1 = run.records[("llama3.1-8b", "o", 4096, 4096, 1, "bf16", 128, True, "auto")]
        assert auto_m1.seconds == pytest.approx(10e-6 * again_factors[-1])
    else:
        assert stored.name == "0001_quick.json"


@pytest.mark.parametrize("pytest_args", [[], ["-v"], ["-k", "o"]])
def test_a_case_selected_but_not_measured_fails_whatever_the_pytest_arguments(tmp_path, monkeypatch, pytest_args):
    import argparse

    storage = tmp_path / "sm_90"
    _write_run(storage / "machine" / "0001_quick.json", "2026-01-01T00:00:00", BASE)
    # selected, but skipped (the skinny build failed, say): absent from the run's JSON
    _fake_bench_run(monkeypatch, [b for b in BASE if b["extra_info"]["backend"] != "skinny"], selected=BASE)
    args = argparse.Namespace(set="quick", save=True, compare="newest", pytest_args=pytest_args,
                              inject_slowdown=False)
    assert cli._run_kernels(args, "sm_90", None, 0.10, storage, tmp_path / "out", "stamp") == 1
    report = (tmp_path / "out" / "compare.txt").read_text()
    assert "MISSING" in report and "M=1 bf16 g128 sym skinny" in report
    assert results.stored_runs(storage) == [storage / "machine" / "0001_quick.json"]


def test_a_measurement_again_that_lacks_a_backend_does_not_replace_the_first(tmp_path):
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE))
    first = _write_run(tmp_path / "first.json", "2026-01-02T00:00:00", _scaled(BASE, 1.5, {"skinny"}))
    m1 = [b for b in BASE if b["extra_info"]["M"] == 1]
    again = _write_run(tmp_path / "again.json", "2026-01-02T00:01:00",
                       [b for b in m1 if b["extra_info"]["backend"] != "skinny"])  # skinny skipped this time
    shape = ("llama3.1-8b", "o", 4096, 4096, 1, "bf16", 128, True)
    lines = results.keep_better(first, again, base, 0.10, {shape})
    assert "the first kept" in lines[0]
    comparison = results.compare(results.load_run(first), base, 0.10)
    assert [c.key[-1] for c in comparison.failures] == ["skinny"]


def test_a_measurement_again_replaces_the_first_where_its_worst_change_of_ours_is_smaller(tmp_path):
    """keep_better: per shape, the worst change of ours relative to the anchor decides, down to changes below the
    baseline's; a first measurement in which nothing of ours compared is replaced by a complete one."""
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE))
    shape = ("llama3.1-8b", "o", 4096, 4096, 1, "bf16", 128, True)
    m1 = [b for b in BASE if b["extra_info"]["M"] == 1]
    first = _write_run(tmp_path / "first.json", "2026-01-02T00:00:00",
                       _scaled(_scaled(BASE, 1.5, {"auto"}), 1.2, {"skinny"}))
    again = _write_run(tmp_path / "again.json", "2026-01-02T00:01:00",
                       _scaled(_scaled(m1, 0.9, {"auto"}), 0.95, {"skinny"}))
    assert results.keep_better(first, again, base, 0.10, {shape}) == [
        "  llama3.1-8b o N=4096 K=4096 M=1 bf16 g128 sym: worst change of ours relative to the anchor +50.0%, "
        "then -5.0% (the second kept)"]
    kept = results.load_run(first)
    assert kept.records[(*shape, "auto")].seconds == pytest.approx(9e-6), "the second measurement's time"
    assert len(kept.records) == len(BASE), "the other shapes' benchmarks stay the first run's"
    nothing_of_ours = [b for b in BASE if b["extra_info"]["M"] != 1 or b["extra_info"]["backend"] not in catalogue.OURS]
    first = _write_run(tmp_path / "first2.json", "2026-01-02T00:00:00", nothing_of_ours)
    [line] = results.keep_better(first, again, base, 0.10, {shape})
    assert line.endswith("then -5.0% (the second kept)"), line
    # a tie keeps the first: the measurement again replaces it only where it is better
    tie = _write_run(tmp_path / "tie.json", "2026-01-02T00:00:00", _scaled(BASE, 0.95, {"auto", "skinny"}))
    [line] = results.keep_better(tie, again, base, 0.10, {shape})
    assert line.endswith("-5.0%, then -5.0% (the first kept)"), line


def test_the_report_says_what_software_changed_under_the_anchor(tmp_path):
    def run(name, torch_version):
        path = _write_run(tmp_path / name, "2026-01-01T00:00:00", BASE)
        data = json.loads(path.read_text())
        data["machine_info"]["w4a16"].update(torch=torch_version, driver="580.159.04")
        path.write_text(json.dumps(data))
        return results.load_run(path)

    report = results.compare(run("current.json", "2.12.0"), run("base.json", "2.11.0"), 0.10).report()
    assert "software changed since the baseline (the anchor, torch's matmul, may have moved with it): " \
           "torch 2.11.0 -> 2.12.0" in report
    assert "software changed" not in results.compare(run("c.json", "2.11.0"), run("d.json", "2.11.0")).report()


def test_a_case_without_its_own_anchor_is_measured_against_its_phase(tmp_path):
    # the peers are timed at fewer M than ours: M = 2 and 3 of ours have no torch case of their own
    extra = [_bench("llama3.1-8b", "o", 2, "auto", 11.0), _bench("llama3.1-8b", "o", 3, "auto", 12.0)]
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE + extra))
    everything_slower = _scaled(BASE + extra, 1.3, {"auto", "skinny", "torch_bf16", "tinygemm"})
    comparison = results.compare(results.load_run(_write_run(tmp_path / "c.json", "2026-01-02", everything_slower)),
                                 base, 0.10)
    assert comparison.ok, comparison.report()  # a machine-wide drift, not a regression
    m3 = next(c for c in comparison.changes if c.key[4] == 3 and c.key[-1] == "auto")
    assert (m3.anchor_ratio, m3.anchor_cases) == (pytest.approx(1.3), 1) and m3.relative_ratio == pytest.approx(1.0)
    ours_slower = _scaled(BASE + extra, 1.3, {"auto"})
    comparison = results.compare(results.load_run(_write_run(tmp_path / "d.json", "2026-01-02", ours_slower)),
                                 base, 0.10)
    assert sorted(c.key[4] for c in comparison.failures) == [1, 2, 3, 256]
    assert "+30.0% relative to torch_bf16 (which moved +0.0%, the median of its 1 decode case)" in comparison.report()


def _anchored_run(tmp_path, name, torch_us: dict, ours_us: dict, dtype="bf16"):
    """A run of torch_<dtype> and auto cases, {(layer, M): µs} each."""
    benches = ([_bench("llama3.1-8b", layer, m, f"torch_{dtype}", us, dtype=dtype) for (layer, m), us in torch_us.items()]
               + [_bench("llama3.1-8b", layer, m, "auto", us, dtype=dtype) for (layer, m), us in ours_us.items()])
    return results.load_run(_write_run(tmp_path / name, "2026-01-01T00:00:00", benches))


DECODE_TORCH = {("qkv", 1): 10.0, ("o", 1): 8.0, ("gate_up", 1): 80.0, ("down", 1): 40.0}
PREFILL_TORCH = {("qkv", 256): 30.0, ("o", 256): 20.0, ("gate_up", 256): 160.0}


def test_one_torch_case_that_read_slow_in_the_baseline_does_not_fail_ours(tmp_path):
    """The anchor is the median over the phase's torch cases: the baseline's torch time of one shape 6% slow and the
    current one 4% fast (as a stored H100 run and the next had it on gate_up at M = 1) with ours unchanged would read
    +10.2% against that shape's own torch time, and passes."""
    ours = {("gate_up", 1): 31.0, ("down", 1): 20.0}
    base = _anchored_run(tmp_path, "base.json", {**DECODE_TORCH, ("gate_up", 1): 80.0 * 1.06}, ours)
    current = _anchored_run(tmp_path, "cur.json", {**DECODE_TORCH, ("gate_up", 1): 80.0 * 0.96}, ours)
    comparison = results.compare(current, base, 0.10)
    assert comparison.ok, comparison.report()
    gate_up = next(c for c in comparison.changes if c.key[1] == "gate_up" and c.key[-1] == "auto")
    assert gate_up.anchor_cases == 4 and gate_up.relative_ratio == pytest.approx(1.0)
    # ours 11% slower on the same runs fails
    current = _anchored_run(tmp_path, "slow.json", {**DECODE_TORCH, ("gate_up", 1): 80.0 * 0.96},
                            {**ours, ("gate_up", 1): 31.0 * 1.11})
    assert [c.key[1] for c in results.compare(current, base, 0.10).failures] == ["gate_up"]


def test_decode_and_prefill_cases_have_anchors_of_their_own_phase(tmp_path):
    """Decode reads memory and prefill computes, and a clock can move one and not the other: with every decode
    torch case 20% slower and the prefill ones unchanged, ours 20% slower passes at M = 1 and fails at M = 256."""
    ours = {("o", 1): 6.0, ("o", 256): 25.0}
    base = _anchored_run(tmp_path, "base.json", {**DECODE_TORCH, **PREFILL_TORCH}, ours)
    slower_decode = {key: us * 1.2 for key, us in DECODE_TORCH.items()}
    current = _anchored_run(tmp_path, "cur.json", {**slower_decode, **PREFILL_TORCH},
                            {key: us * 1.2 for key, us in ours.items()})
    comparison = results.compare(current, base, 0.10)
    assert [c.key[4] for c in comparison.failures] == [256], comparison.report()
    m1, m256 = sorted((c for c in comparison.changes if c.key[-1] == "auto"), key=lambda c: c.key[4])
    assert (m1.anchor_ratio, m1.anchor_cases) == (pytest.approx(1.2), 4)
    assert (m256.anchor_ratio, m256.anchor_cases) == (pytest.approx(1.0), 3)


def test_the_anchor_is_the_median_not_the_mean_of_the_phase(tmp_path):
    """Three decode torch cases unchanged and one 2x slower: the median (1.0) leaves ours unchanged; a mean (1.25)
    would hide a 20% regression of ours."""
    ours = {("o", 1): 6.0}
    base = _anchored_run(tmp_path, "base.json", DECODE_TORCH, ours)
    current = _anchored_run(tmp_path, "cur.json", {**DECODE_TORCH, ("gate_up", 1): 160.0}, {("o", 1): 6.0 * 1.2})
    [change] = results.compare(current, base, 0.10).failures
    assert change.anchor_ratio == pytest.approx(1.0)


def test_the_anchor_is_torch_in_the_case_dtype(tmp_path):
    """An fp16 case of ours is anchored on torch_fp16 alone: bf16's torch 30% slower leaves it unanchored."""
    fp16_ours = _bench("llama3.1-8b", "o", 1, "auto", 6.0, dtype="fp16")
    base = _anchored_run(tmp_path, "base.json", DECODE_TORCH, {})
    current = _anchored_run(tmp_path, "cur.json", {key: us * 1.3 for key, us in DECODE_TORCH.items()}, {})
    for run, name in ((base, "base16.json"), (current, "cur16.json")):
        benches = [_bench(*key[:2], key[4], key[-1], r.us) for key, r in run.records.items()] + [fp16_ours]
        _write_run(tmp_path / name, "2026-01-01T00:00:00", benches)
    comparison = results.compare(results.load_run(tmp_path / "cur16.json"), results.load_run(tmp_path / "base16.json"))
    [change] = [c for c in comparison.changes if c.gated]
    assert change.anchor_ratio is None and change.anchor_cases == 0


def test_a_selection_that_measures_nothing_fails_clearly(tmp_path, monkeypatch, capsys):
    import argparse

    def fake_pytest(command, **kwargs):  # as pytest-benchmark leaves it when -k deselects every case
        [json_arg] = [a for a in command if a.startswith("--benchmark-json=")]
        Path(json_arg.split("=", 1)[1]).write_text("")
        return 5

    monkeypatch.setattr(cli.subprocess, "call", fake_pytest)
    args = argparse.Namespace(set="quick", save=True, compare=None, pytest_args=["-k", "no-such-case"],
                              inject_slowdown=False)
    tmp_path.joinpath("out").mkdir()
    assert cli._run_kernels(args, "sm_90", None, 0.10, tmp_path / "sm_90", tmp_path / "out", "stamp") == 1
    assert "no benchmark was selected (pytest exit status 5; its arguments: -k no-such-case)" in capsys.readouterr().err
    assert not (tmp_path / "sm_90").exists()


def test_compare_without_a_baseline_of_this_gpu_names_the_gpus_that_have_one(tmp_path, monkeypatch, capsys):
    import argparse

    storage = tmp_path / "sm_90"
    _write_run(storage / "machine" / "0001_quick.json", "2026-01-01T00:00:00", BASE, gpu="NVIDIA H100 80GB HBM3")
    _fake_bench_run(monkeypatch, BASE)
    args = argparse.Namespace(set="quick", save=True, compare="newest", pytest_args=[], inject_slowdown=False)
    assert cli._run_kernels(args, "sm_90", None, 0.10, storage, tmp_path / "out", "stamp") == 2
    err = capsys.readouterr().err
    assert "measured on NVIDIA H200" in err and "runs of NVIDIA H100 80GB HBM3" in err
    assert results.stored_runs(storage) == [storage / "machine" / "0001_quick.json"]  # nothing measured or stored


def test_compare_without_an_anchor_gates_the_median(tmp_path):
    no_torch = [b for b in BASE if b["extra_info"]["backend"] != "torch_bf16"]
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", no_torch))
    cur = results.load_run(_write_run(tmp_path / "cur.json", "2026-01-02T00:00:00",
                                      _scaled(no_torch, 1.2, {"auto"})))
    comparison = results.compare(cur, base, 0.10)
    assert [c.key[-1] for c in comparison.failures] == ["auto", "auto"]
    assert all(c.anchor_ratio is None for c in comparison.changes)
    assert "no anchor: gated on its own median" in comparison.report()


def test_compare_fails_when_nothing_of_ours_is_compared_or_a_case_is_not_in_the_baseline(tmp_path):
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE))
    other = [_bench("qwen3-4b", "o", 1, "auto", 5.0, n=2560)]
    comparison = results.compare(results.load_run(_write_run(tmp_path / "o.json", "2026-01-02", other)), base, 0.10)
    assert not comparison.ok and not comparison.changes
    report = comparison.report()
    assert "NOTHING OF OURS COMPARED" in report and "NOT IN THE BASELINE" in report and "qwen3-4b o" in report
    # a new case of ours next to cases that compare well still fails: nothing gates it
    comparison = results.compare(results.load_run(_write_run(tmp_path / "n.json", "2026-01-02", [*BASE, *other])),
                                 base, 0.10)
    assert not comparison.ok and comparison.unbaselined and not comparison.failures


def test_compare_refuses_a_baseline_from_another_gpu(tmp_path):
    def run_on(gpu, name):
        path = _write_run(tmp_path / name, "2026-01-01T00:00:00", BASE)
        data = json.loads(path.read_text())
        data["machine_info"]["w4a16"]["gpu"] = gpu
        path.write_text(json.dumps(data))
        return results.load_run(path)

    comparison = results.compare(run_on("NVIDIA H100 80GB HBM3", "a.json"), run_on("NVIDIA H200", "b.json"), 0.10)
    assert not comparison.ok and "OTHER GPU" in comparison.report()
    assert results.compare(run_on("NVIDIA H200", "c.json"), run_on("NVIDIA H200", "d.json"), 0.10).ok


def test_compare_peer_regression_does_not_gate(tmp_path):
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE))
    cur = results.load_run(_write_run(tmp_path / "cur.json", "2026-01-02T00:00:00",
                                      _scaled(BASE, 2.0, {"torch_bf16"})))
    comparison = results.compare(cur, base, 0.10)
    assert comparison.ok and len(comparison.regressions) == 2 and not comparison.failures
    assert "regressed (peers, not gating)" in comparison.report()


def test_compare_missing_case_of_ours_fails(tmp_path):
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE))
    without_skinny = [b for b in BASE if b["extra_info"]["backend"] != "skinny"]
    cur = results.load_run(_write_run(tmp_path / "cur.json", "2026-01-02T00:00:00", without_skinny))
    asked = list(base.records)
    comparison = results.compare(cur, base, 0.10, expected=asked)
    assert not comparison.ok and [k[-1] for k in comparison.missing] == ["skinny"]
    # a subset run (not asked for the case) compares only what it measured
    assert results.compare(cur, base, 0.10, expected=list(cur.records)).ok


def test_the_chain_holds_ours_geometric_mean_to_the_threshold():
    key = ("llama3.1-8b", "o", 4096, 4096, 1, "auto")
    changes = [results.Change(key, 1.0, 1.0, 1.0), results.Change(key[:-1] + ("skinny",), 1.0, 1.44, 1.0),
               results.Change(key[:-1] + ("torch_bf16",), 1.0, 3.0)]  # a peer: not in ours' mean
    comparison = results.Comparison(0.20, changes)
    assert comparison.relative_mean() == pytest.approx(1.2)  # sqrt(1.44), not the arithmetic 1.22
    comparison.chain = [("0001_quick.json", 1.2), ("0002_quick.json", 1.2 + 1e-9)]
    assert comparison.drifted == [("0002_quick.json", 1.2 + 1e-9)]


def test_only_ours_gate_what_is_missing_or_new(tmp_path):
    """A peer case asked for but not measured, or measured but not in the baseline, is information; a run in which
    only peers compared gates nothing and so fails."""
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE))
    without_tinygemm = [b for b in BASE if b["extra_info"]["backend"] != "tinygemm"]
    new_peer = _bench("llama3.1-8b", "o", 256, "tinygemm", 900.0)
    cur = results.load_run(_write_run(tmp_path / "cur.json", "2026-01-02", [*without_tinygemm, new_peer]))
    comparison = results.compare(cur, base, 0.10, expected=list(base.records))
    assert comparison.ok and not comparison.missing and not comparison.unbaselined, comparison.report()
    peers_only = [b for b in BASE if b["extra_info"]["backend"] in ("torch_bf16", "tinygemm")]
    peers = results.load_run(_write_run(tmp_path / "peers.json", "2026-01-02", peers_only))
    comparison = results.compare(peers, results.load_run(_write_run(tmp_path / "b2.json", "2026-01-01", peers_only)),
                                 0.10)
    assert comparison.changes and not comparison.ok


@pytest.mark.parametrize("text, value", [("10%", 0.10), ("2.5%", 0.025), ("0.05", 0.05), (0.2, 0.2)])
def test_parse_threshold(text, value):
    assert results.parse_threshold(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["10", "ten", "-5%", "0%"])
def test_parse_threshold_rejects(text):
    with pytest.raises(ValueError, match="threshold"):
        results.parse_threshold(text)


@pytest.mark.parametrize("text", ["1", "1.0", "1000%", 12.0])
def test_parse_threshold_refuses_a_bare_one_and_thresholds_that_gate_nothing(text):
    # "1" could mean 1% or 100%; 1000% (or a fraction of 10 and more) would let any slowdown through
    with pytest.raises(ValueError, match="threshold"):
        results.parse_threshold(text)


def _one_case_run(seconds: float, backend: str = "auto") -> results.Run:
    key = ("llama3.1-8b", "o", 4096, 4096, 1, "bf16", 128, True, backend)
    return results.Run(None, "", {}, {key: results.Record(*key, seconds)})


def test_a_slowdown_of_exactly_the_threshold_passes():
    """The gate fails a case slower by more than the threshold: exactly +25% (exact in binary) passes a 25% gate,
    a hair more fails."""
    base = _one_case_run(2.0**-17)
    assert results.compare(_one_case_run(1.25 * 2.0**-17), base, 0.25).ok
    assert not results.compare(_one_case_run(1.2501 * 2.0**-17), base, 0.25).ok


def test_a_run_without_a_recorded_gpu_is_not_another_gpus(tmp_path):
    """Only two recorded GPU names that differ refuse a comparison: a run stored without one compares."""
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE, gpu=None))
    cur = results.load_run(_write_run(tmp_path / "cur.json", "2026-01-02T00:00:00", BASE))
    comparison = results.compare(cur, base, 0.10)
    assert comparison.ok and not comparison.other_gpu, comparison.report()


def test_the_other_gpu_line_says_which_gpu_measured_the_baseline(tmp_path):
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE, gpu="NVIDIA H200"))
    cur = results.load_run(_write_run(tmp_path / "cur.json", "2026-01-02T00:00:00", BASE,
                                      gpu="NVIDIA H100 80GB HBM3"))
    report = results.compare(cur, base, 0.10).report()
    assert "the baseline was measured on NVIDIA H200, this run on NVIDIA H100 80GB HBM3" in report


def test_an_fp16_case_of_ours_moves_with_torch_fp16(tmp_path):
    """fp16 cases of ours are anchored on torch's fp16 matmul: both 30% slower is the machine, and passes."""
    base = _anchored_run(tmp_path, "base.json", {("o", 1): 9.0}, {("o", 1): 5.0}, dtype="fp16")
    cur = _anchored_run(tmp_path, "cur.json", {("o", 1): 9.0 * 1.3}, {("o", 1): 5.0 * 1.3}, dtype="fp16")
    comparison = results.compare(cur, base, 0.10)
    assert comparison.ok, comparison.report()
    [change] = [c for c in comparison.changes if c.gated]
    assert (change.anchor_ratio, change.anchor_cases) == (pytest.approx(1.3), 1)


def test_the_anchor_of_an_even_number_of_torch_cases_averages_the_middle_two(tmp_path):
    # two decode torch cases unchanged and two 20% slower: the median is +10%, not either side's
    base = _anchored_run(tmp_path, "base.json", DECODE_TORCH, {("o", 1): 6.0})
    slower = {**DECODE_TORCH, ("gate_up", 1): 80.0 * 1.2, ("down", 1): 40.0 * 1.2}
    [change] = [c for c in results.compare(_anchored_run(tmp_path, "cur.json", slower, {("o", 1): 6.0}), base).changes
                if c.gated]
    assert change.anchor_ratio == pytest.approx(1.1) and change.anchor_cases == 4


def test_the_chain_mean_is_relative_to_the_anchor(tmp_path):
    """Against a run of the chain, ours' geometric mean is taken relative to torch's matmul: the whole machine 30%
    slower is no drift, ours unchanged while torch got 20% faster is."""
    base = results.load_run(_write_run(tmp_path / "base.json", "2026-01-01T00:00:00", BASE))
    slow_machine = results.load_run(_write_run(tmp_path / "slow.json", "2026-01-02T00:00:00",
                                               _scaled(BASE, 1.3, catalogue.BACKENDS)))
    assert results.compare(slow_machine, base).relative_mean() == pytest.approx(1.0)
    fast_torch = results.load_run(_write_run(tmp_path / "fast.json", "2026-01-02T00:00:00",
                                             _scaled(BASE, 0.8, {"torch_bf16"})))
    assert results.compare(fast_torch, base).relative_mean() == pytest.approx(1.25)


def test_summary_counts_m_8_as_decode_and_takes_the_geometric_mean(tmp_path):
    """M = 8 is the last decode size; auto 2x faster than the best peer at M = 1 and 2x slower at M = 8 average to
    1.00x (geometric), not 1.25x."""
    benches = [_bench("qwen3-4b", "o", 1, "auto", 10.0), _bench("qwen3-4b", "o", 1, "torch_bf16", 20.0),
               _bench("qwen3-4b", "o", 8, "auto", 20.0), _bench("qwen3-4b", "o", 8, "torch_bf16", 10.0)]
    run = results.load_run(_write_run(tmp_path / "a.json", "2026-01-01T00:00:00", benches))
    text = results.summary(run.records.values())
    assert "decode M<=8: 1.00x over 2 cases" in text and "prefill" not in text


# ---------------------------------------------------------------------------------------------------------------
# Device clock, CLI without a GPU


def test_device_clock_moves_only_by_reported_time():
    clock = timing.DeviceClock()
    t0 = clock()
    clock.advance(2.5e-6)
    clock.advance(0.5e-6)
    assert clock() - t0 == pytest.approx(3e-6)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="device time"):
            clock.advance(bad)
    from pytest_benchmark.utils import NameWrapper

    assert str(NameWrapper(timing.device_clock)) == "w4a16.bench.timing.device_clock"


class FakeNvml:
    """NVML's two calls that ClockState makes, answering from a script of throttle reasons (the last one repeats)."""

    NVML_CLOCK_SM = 1

    def __init__(self, reasons: list[int], sm_mhz: int = 1980) -> None:
        self.reasons, self.mhz, self.reads = list(reasons), sm_mhz, 0

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        self.reads += 1
        return self.reasons.pop(0) if len(self.reasons) > 1 else self.reasons[0]

    def nvmlDeviceGetClockInfo(self, handle, clock):
        assert clock == self.NVML_CLOCK_SM
        return self.mhz


def fake_time():
    """(sleep, now) advancing a fake monotonic clock only when slept."""
    t = [0.0]
    return (lambda seconds: t.__setitem__(0, t[0] + seconds)), (lambda: t[0])


def test_slowdown_reasons_are_the_power_and_thermal_ones():
    gpu_idle, app_clocks, sw_power_cap, sw_thermal = 0x1, 0x2, 0x4, 0x20
    clocks = timing.ClockState(FakeNvml([gpu_idle | app_clocks, gpu_idle | sw_power_cap, sw_thermal]), None)
    assert clocks.slowdown() == 0
    assert clocks.slowdown() == sw_power_cap
    assert clocks.slowdown() == sw_thermal
    assert clocks.sm_mhz() == 1980


def test_cool_down_waits_idle_until_the_power_cap_clears():
    nvml = FakeNvml([0x4, 0x4, 0x4, 0x1])
    sleep, now = fake_time()
    waited = timing.cool_down(timing.ClockState(nvml, None), max_seconds=3.0, poll_seconds=0.02, sleep=sleep, now=now)
    assert waited == pytest.approx(0.06) and nvml.reads == 4
    # already clear: no wait at all
    assert timing.cool_down(timing.ClockState(FakeNvml([0x0]), None), sleep=sleep, now=now) == 0.0


def test_cool_down_gives_up_after_its_limit():
    sleep, now = fake_time()
    waited = timing.cool_down(timing.ClockState(FakeNvml([0x40]), None), max_seconds=0.5, poll_seconds=0.02,
                              sleep=sleep, now=now)
    assert 0.5 <= waited < 0.5 + 0.02 + 1e-9


def test_cool_down_stops_once_its_limit_is_reached():
    # two polls of 0.25 s reach a 0.5 s limit exactly: no third poll past it
    sleep, now = fake_time()
    waited = timing.cool_down(timing.ClockState(FakeNvml([0x4]), None), max_seconds=0.5, poll_seconds=0.25,
                              sleep=sleep, now=now)
    assert waited == 0.5


def test_clock_state_finds_the_torch_device_by_uuid(monkeypatch):
    """torch's device index is not NVML's under CUDA_VISIBLE_DEVICES: the handle comes from the device's UUID."""
    import types

    asked = []
    nvml = FakeNvml([0x1])
    fake = types.SimpleNamespace(nvmlInit=lambda: None, NVML_CLOCK_SM=FakeNvml.NVML_CLOCK_SM,
                                 nvmlDeviceGetHandleByUUID=lambda uuid: asked.append(uuid) or "handle",
                                 nvmlDeviceGetCurrentClocksThrottleReasons=nvml.nvmlDeviceGetCurrentClocksThrottleReasons,
                                 nvmlDeviceGetClockInfo=nvml.nvmlDeviceGetClockInfo)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    uuids = {1: "5c2b0e3a-0000-1111-2222-333344445555"}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i]))
    clocks = timing.ClockState.open()
    assert clocks is not None and clocks.slowdown() == 0 and clocks.sm_mhz() == 1980
    assert asked == ["GPU-5c2b0e3a-0000-1111-2222-333344445555"]

    def refuse():
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(fake, "nvmlInit", refuse)  # no driver: no clock state, no error
    assert timing.ClockState.open() is None
    monkeypatch.setattr(torch.version, "hip", "6.4")  # ROCm: NVML is not asked
    monkeypatch.setattr(fake, "nvmlInit", lambda: None)
    assert timing.ClockState.open() is None


@pytest.mark.parametrize("reason", [0x4, 0x8, 0x20, 0x40, 0x80])
def test_every_power_and_thermal_reason_is_a_slowdown(reason):
    # nvml.h: SW power cap 0x4, HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, HW power brake 0x80
    gpu_idle = 0x1
    assert timing.ClockState(FakeNvml([reason | gpu_idle]), None).slowdown() == reason


def test_a_uuid_that_already_has_its_prefix_is_asked_as_it_is(monkeypatch):
    import types

    asked = []
    nvml = types.SimpleNamespace(nvmlDeviceGetHandleByUUID=lambda uuid: asked.append(uuid) or "handle")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid="GPU-9d1e4f70-aaaa-bbbb-cccc-ddddeeeeffff"))
    assert timing.nvml_handle(nvml, 0) == "handle"
    assert asked == ["GPU-9d1e4f70-aaaa-bbbb-cccc-ddddeeeeffff"]


def test_a_timed_round_is_per_call_and_notes_a_slowed_clock(monkeypatch):
    """GraphTimer.round: one replay's device time divided by the calls in the graph, advancing the device clock by
    it; a round after which a slowdown reason is set counts as slowed."""
    import types

    replays = iter([1e-3, 8e-5, 40e-5, 24e-5])  # the warm-up's first replay, then three timed rounds
    monkeypatch.setattr(timing, "time_replay", lambda graph: next(replays))
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    clock = timing.DeviceClock()
    monkeypatch.setattr(timing, "device_clock", clock)
    # read before the warm-up (clear), then after each of the three rounds
    clocks = timing.ClockState(FakeNvml([0x0, 0x0, 0x4, 0x0], sm_mhz=1755), None)
    timer = timing.GraphTimer(types.SimpleNamespace(replay=lambda: None), calls=8, clocks=clocks)
    assert [timer.round() for _ in range(3)] == pytest.approx([1e-5, 5e-5, 3e-5])
    assert timer.median() == pytest.approx(3e-5) and clock() == pytest.approx(9e-5)
    assert timer.slowed_rounds == 1 and timer.sm_mhz == [1755, 1755, 1755]


def test_cases_timed_at_a_lowered_clock_are_listed(tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"benchmarks": [
        {"name": "test_gemm[a-M1-skinny]", "extra_info": {"M": 1, "rounds": 10, "slowed_rounds": 3,
                                                          "sm_mhz_min": 1590, "sm_mhz_max": 1965}},
        {"name": "test_gemm[a-M1-auto]", "extra_info": {"M": 1, "rounds": 10, "slowed_rounds": 0, "sm_mhz_min": 1980,
                                                        "sm_mhz_max": 1980}},
        # the power cap at the full clock (a memory-bound case's own power): not listed
        {"name": "test_gemm[a-M4-skinny]", "extra_info": {"M": 4, "rounds": 10, "slowed_rounds": 10,
                                                          "sm_mhz_min": 1965, "sm_mhz_max": 1965}},
        {"name": "test_gemm[a-M4-auto]", "extra_info": {"rounds": 10}},  # no NVML: nothing recorded
    ]}))
    assert results.lowered_clock_cases(run) == [
        "  test_gemm[a-M1-skinny]: 3 of 10 rounds slowed, SM 1590-1965 of 1980 MHz"]
    heavy = {"name": "test_gemm[a-M2048-auto]", "extra_info": {"M": 2048, "rounds": 10, "slowed_rounds": 10,
                                                               "sm_mhz_min": 1470, "sm_mhz_max": 1470}}
    data = json.loads(run.read_text())
    data["benchmarks"].append(heavy)
    run.write_text(json.dumps(data))
    assert results.lowered_clock_cases(run)[-1] == "  and 1 case(s) with M > 8, which reach the power cap by themselves"
    run.write_text(json.dumps({"benchmarks": [{"name": "test_gemm[a-M4-auto]", "extra_info": {"rounds": 10}}]}))
    assert results.lowered_clock_cases(run) == []


def test_a_lowered_clock_is_one_under_97_percent_of_the_runs_highest_by_default(tmp_path):
    """The bench lists lowered-clock cases with lowered_clock_cases' default fraction: with 2000 MHz the run's
    highest clock, a slowed case that fell to 1939 MHz is listed, one that fell to 1940 MHz (97%) is not."""
    def slowed(name, sm_mhz_min):
        return {"name": name, "extra_info": {"M": 1, "rounds": 10, "slowed_rounds": 2, "sm_mhz_min": sm_mhz_min,
                                             "sm_mhz_max": 2000}}

    run = tmp_path / "run.json"
    run.write_text(json.dumps({"benchmarks": [slowed("test_gemm[a-M1-auto]", 1940),
                                              slowed("test_gemm[a-M1-skinny]", 1939)]}))
    assert results.lowered_clock_cases(run) == [
        "  test_gemm[a-M1-skinny]: 2 of 10 rounds slowed, SM 1939-2000 of 2000 MHz"]


def test_a_lowered_clock_at_m_8_is_listed_as_a_decode_case(tmp_path):
    """M = 8 is the last decode size: a slowed case there is suspect and named, while M = 16 is a prefill case that
    may reach the power cap by itself and is only counted."""
    def slowed(m):
        return {"name": f"test_gemm[a-M{m}-auto]", "extra_info": {"M": m, "rounds": 10, "slowed_rounds": 4,
                                                                  "sm_mhz_min": 1500, "sm_mhz_max": 1980}}

    run = tmp_path / "run.json"
    run.write_text(json.dumps({"benchmarks": [slowed(8), slowed(16)]}))
    lines = results.lowered_clock_cases(run)
    assert len(lines) == 2 and lines[0].startswith("  test_gemm[a-M8-auto]: 4 of 10 rounds slowed")
    assert lines[1].startswith("  and 1 case(s)")


def test_no_gpu_message(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_gpu_available", lambda: False)
    assert cli.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "no GPU" in err and "Traceback" not in err


def test_no_gpu_message_from_the_command_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "w4a16.bench", "--compare"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode != 0
    assert "no GPU" in done.stderr and "Traceback" not in done.stderr


def test_cli_rejects_bad_options(capsys):
    assert cli.main(["--threshold", "ten"]) == 2
    assert cli.main(["--models", "llama9"]) == 2
    err = capsys.readouterr().err
    assert "threshold" in err and "llama9" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--quick", "--inject-slowdown", "--save"], "--inject-slowdown makes a deliberately slow run, which must never"),
    (["--e2e", "--e2e-models", ","], "--e2e-models ',': name at least one model"),
    (["--models", ""], "--models '': name at least one model"),
    (["--e2e", "--compare"], "--e2e times whole models and takes none of --compare"),
    (["--e2e", "--models", "llama3.1-8b", "--inject-slowdown"], "takes none of --models, --inject-slowdown"),
])
def test_cli_refuses_options_that_would_store_or_compare_the_wrong_thing(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_gpu_available", lambda: True)  # refused before anything is measured
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_names_an_out_or_storage_path_that_is_a_file(tmp_path, monkeypatch, capsys):
    import w4a16.info

    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    monkeypatch.setattr(w4a16.info, "run", lambda args: None)
    monkeypatch.setattr(w4a16, "arch", lambda: "sm_90")
    monkeypatch.setattr(cli, "_run_kernels", lambda *args: pytest.fail("nothing may be measured"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["--quick", "--no-build", "--out", str(blocker)]) == 2
    assert f"--out {blocker}: cannot make that directory" in capsys.readouterr().err
    assert cli.main(["--quick", "--no-build", "--save", "--storage", str(blocker), "--out", str(tmp_path)]) == 2
    assert f"--storage {blocker}/sm_90: cannot make that directory" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["not json", "[]"])
def test_an_unreadable_compare_file_fails_before_the_run(tmp_path, monkeypatch, capsys, text):
    import argparse

    monkeypatch.setattr(cli.subprocess, "call", lambda *a, **k: pytest.fail("the run must not start"))
    monkeypatch.setattr(cli, "_device_name", lambda: "NVIDIA H200")
    bad = tmp_path / "base.json"
    bad.write_text(text)
    args = argparse.Namespace(set="quick", save=False, compare=str(bad), pytest_args=[], inject_slowdown=False)
    assert cli._run_kernels(args, "sm_90", None, 0.10, tmp_path / "sm_90", tmp_path, "stamp") == 2
    assert f"--compare {bad}: not a readable benchmark run" in capsys.readouterr().err


def test_an_e2e_run_that_measured_nothing_fails_and_stores_nothing(tmp_path, monkeypatch):
    from w4a16.bench import e2e

    monkeypatch.setattr(e2e, "run", lambda names, **kwargs: [])
    monkeypatch.setattr(cli, "_device_name", lambda: "NVIDIA H200")
    assert cli._run_e2e([], tmp_path, tmp_path / "storage", "stamp") == 1
    assert not (tmp_path / "storage").exists()


def test_without_save_the_storage_is_only_read(tmp_path, monkeypatch):
    # a run without --save may compare with a storage it cannot write to: nothing is made there
    import w4a16.info

    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    monkeypatch.setattr(w4a16.info, "run", lambda args: None)
    monkeypatch.setattr(w4a16, "arch", lambda: "sm_90")
    monkeypatch.setattr(cli, "_run_kernels", lambda *args: 0)
    storage = tmp_path / "baselines"
    assert cli.main(["--quick", "--no-build", "--storage", str(storage), "--out", str(tmp_path / "out")]) == 0
    assert not storage.exists() and (tmp_path / "out").is_dir()


@pytest.mark.parametrize("slowdown", [1.0, 1.5])
def test_a_benchmark_run_that_failed_is_neither_measured_again_nor_saved(tmp_path, monkeypatch, slowdown):
    """The child pytest exiting 1 (a benchmark errored) fails the bench whatever the comparison says, and a
    regression it shows is not measured again."""
    import argparse

    storage = tmp_path / "sm_90"
    _write_run(storage / "machine" / "0001_quick.json", "2026-01-01T00:00:00", BASE)
    calls = []
    _fake_bench_run(monkeypatch, _scaled(BASE, slowdown, {"auto"}), status=1, calls=calls)
    args = argparse.Namespace(set="quick", save=True, compare="newest", pytest_args=[], inject_slowdown=False)
    assert cli._run_kernels(args, "sm_90", None, 0.10, storage, tmp_path / "out", "stamp") == 1
    assert len(calls) == 1
    assert results.stored_runs(storage) == [storage / "machine" / "0001_quick.json"]


def test_compare_with_a_given_run_is_held_to_that_run_alone(tmp_path, monkeypatch):
    """--compare RUN.json compares with that run: the chain of this arch's newest stored baseline (here 20% faster
    than the given run and this one) does not gate it."""
    import argparse

    storage = tmp_path / "sm_90"
    quick = [b for b in BASE if b["extra_info"]["M"] == 1]
    _write_run(storage / "machine" / "0001_quick.json", "2026-01-01T00:00:00", quick)
    given = _write_run(tmp_path / "older" / "given.json", "2025-12-01T00:00:00", _scaled(quick, 1.2, catalogue.OURS))
    _fake_bench_run(monkeypatch, _scaled(quick, 1.2, catalogue.OURS))
    args = argparse.Namespace(set="quick", save=False, compare=str(given), pytest_args=[], inject_slowdown=False)
    assert cli._run_kernels(args, "sm_90", None, 0.10, storage, tmp_path / "out", "stamp") == 0
    report = (tmp_path / "out" / "compare.txt").read_text()
    assert "compare: PASS" in report and "DRIFTED" not in report


def test_models_that_the_set_does_not_hold_select_no_case(tmp_path, monkeypatch, capsys):
    # the quick set is llama3.1-8b alone: --quick --models qwen3-4b is refused before anything runs
    import argparse

    monkeypatch.setattr(cli.subprocess, "call", lambda *a, **k: pytest.fail("nothing may be measured"))
    args = argparse.Namespace(set="quick", save=False, compare=None, pytest_args=[], inject_slowdown=False)
    assert cli._run_kernels(args, "sm_90", ["qwen3-4b"], 0.10, tmp_path / "sm_90", tmp_path, "stamp") == 2
    assert "no cases selected" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# tinygemm's operands, checked with torch's own CPU int4 kernel (same dequantization formula as CUDA's)


@pytest.mark.parametrize("symmetric", [True, False])
def test_tinygemm_operands(generator, symmetric):
    n, k, g = 64, 256, 64
    qw = random_weight(n, k, g, symmetric, torch.bfloat16, generator=generator)
    nibbles, sz = peers.tinygemm_operands(qw)
    assert nibbles.shape == (n, k // 2) and nibbles.dtype == torch.uint8 and sz.shape == (k // g, n, 2)
    q = w4a16.unpack_int4(qw.qweight)
    assert torch.equal(nibbles >> 4, q[:, ::2]) and torch.equal(nibbles & 0xF, q[:, 1::2])
    # (q - 8) * scale + zero, tinygemm's formula, reproduces our weight up to bf16 rounding of the zero term
    s, z = sz[..., 0].float().t(), sz[..., 1].float().t()
    w_tg = (q.float() - 8) * s.repeat_interleave(g, 1) + z.repeat_interleave(g, 1)
    w = w4a16.dequantize(qw)
    assert (w_tg - w).abs().max() <= 8 * qw.scales.float().max() * 2**-8
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("this torch has no CPU int4 kernel to cross-check with")
    x = torch.randn(4, k, generator=generator).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz).float()
    ref = x.float() @ w.t()
    assert ((y - ref).norm() / ref.norm()).item() < 1e-2


# ---------------------------------------------------------------------------------------------------------------
# Plots and the end-to-end flow


def test_plots_written(tmp_path):
    require_module("matplotlib", "matplotlib comes with the bench extra, which nox -s tests installs")
    run = results.load_run(_write_run(tmp_path / "a.json", "2026-01-01T00:00:00", BASE))
    paths = plots_module().plot_models(run.records.values(), run.copy_gbps, tmp_path / "plots")
    assert [p.name for p in paths] == ["llama3.1-8b.png"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def plots_module():
    from w4a16.bench import plots

    return plots


def test_e2e_flow_on_a_tiny_model():
    require_module("transformers", "transformers comes with the bench extra, which nox -s tests installs")
    from w4a16.bench import e2e

    tiny = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
    measured = e2e.run(["llama3.1-8b"], device="cpu", overrides=tiny, log=lambda m: None,
                       prompt_lengths=(8, 16), decode_tokens=4, decode_prompt=8, reps=1)
    base, quant = measured
    assert (base.variant, quant.variant) == ("bf16", "w4a16")
    assert base.finite and quant.finite
    assert set(base.ttft_eager_ms) == {8, 16} and base.tpot_ms > 0 and quant.tpot_ms > 0
    # 7 linears per layer quantized: 128x128 (q), 64x128 (k, v), 128x128 (o), 256x128 (gate, up), 128x256 (down)
    linear_params = 2 * (128 * 128 * 2 + 64 * 128 * 2 + 256 * 128 * 3)
    saved = linear_params * 2 - linear_params // 2 - linear_params // 128 * 2
    assert base.weight_bytes - quant.weight_bytes == saved
    table = e2e.format_table(measured)
    assert "| llama3.1-8b | w4a16 |" in table and "W4A16 vs bf16" in table
    assert math.isclose(quant.weight_bytes / base.weight_bytes,
                        float(table.split("vs bf16: weights ")[1].split("x")[0]), rel_tol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# The plumbing into pytest-benchmark: what it stores is what the device clock was advanced by

_FAKE_BENCH = '''
from w4a16.bench import timing

def test_fake(benchmark):
    times = iter([3e-6, 1e-6, 2e-6, 5e-6, 4e-6])
    benchmark.extra_info.update(model="m", layer="o", N=8, K=128, M=1, dtype="bf16", group_size=128,
                                symmetric=True, backend="auto")
    benchmark.pedantic(lambda: timing.device_clock.advance(next(times)), rounds=5, iterations=1)
'''


def test_pytest_benchmark_stores_device_clock_seconds(tmp_path):
    (tmp_path / "test_fake.py").write_text(_FAKE_BENCH)
    out = tmp_path / "run.json"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_fake.py"),
               f"--rootdir={tmp_path}", f"--benchmark-timer={timing.DEVICE_CLOCK_NAME}",
               f"--benchmark-storage=file://{tmp_path / 'store'}", "--benchmark-save=baseline",
               f"--benchmark-json={out}", "-p", "no:xdist"]
    # A pytest of its own: under an xdist worker, the worker's PYTEST_* variables would reach it.
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    run = results.load_run(out)
    (record,) = run.records.values()
    assert record.seconds == pytest.approx(3e-6)  # the median of the five advances
    assert json.loads(out.read_text())["benchmarks"][0]["stats"]["min"] == pytest.approx(1e-6)
    # what the bench stores is that JSON itself (results.store_run): pytest-benchmark's own stored run is the same
    [own] = results.stored_runs(tmp_path / "store")
    stored = results.store_run(out, tmp_path / "ours", "baseline")
    assert results.load_run(stored).records == results.load_run(own).records == run.records


@pytest.mark.parametrize("finite", [True, False])
def test_e2e_table_is_stored_under_its_gpus_name_if_it_passed(tmp_path, monkeypatch, finite):
    from types import SimpleNamespace

    from w4a16.bench import e2e

    monkeypatch.setattr(e2e, "run", lambda names, device, log: [SimpleNamespace(finite=finite)])
    monkeypatch.setattr(e2e, "format_table", lambda measured: "| table |")
    monkeypatch.setattr(e2e, "to_json", lambda measured: [])
    monkeypatch.setattr(cli, "_device_name", lambda: "NVIDIA H100 80GB HBM3")
    (tmp_path / "out").mkdir()
    assert cli._run_e2e(["llama3.1-8b"], tmp_path / "out", tmp_path / "sm_90", "stamp") == (0 if finite else 1)
    assert (tmp_path / "out" / "e2e.md").is_file()  # the run's own output, stored or not
    if not finite:  # a failed run leaves the stored table as it was
        assert not (tmp_path / "sm_90").exists()
        return
    stored = tmp_path / "sm_90" / "e2e-nvidia-h100-80gb-hbm3.md"
    assert "NVIDIA H100 80GB HBM3" in stored.read_text() and "| table |" in stored.read_text()
    assert (tmp_path / "sm_90" / "e2e-stamp.json").is_file() and not (tmp_path / "sm_90" / "e2e.md").exists()


def test_e2e_reports_a_failing_model_and_goes_on():
    require_module("transformers", "transformers comes with the bench extra, which nox -s tests installs")
    from w4a16.bench import e2e

    # hidden_size 96 is not a multiple of group_size 128: quantize_model refuses, naming the layer
    tiny = dict(vocab_size=256, hidden_size=96, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64)
    logs = []
    measured = e2e.run(["qwen3-4b"], device="cpu", overrides=tiny, log=logs.append,
                       prompt_lengths=(8,), decode_tokens=2, decode_prompt=8, reps=1)
    assert [r.variant for r in measured] == ["bf16", "failed"]
    assert any("FAILED: ValueError" in line and "group_size=128" in line for line in logs)
    assert "FAILED (see the log)" in e2e.format_table(measured)


# ---------------------------------------------------------------------------------------------------------------
# The peers' preparation on CPU: the rotation, the dtype each peer stands for, and what cannot run here


@pytest.mark.parametrize("symmetric", [True, False])
def test_the_benchs_random_weight_has_every_zero_point_and_no_zero_scale(symmetric):
    """A zero scale would make a kernel's wrong zero point invisible; a weight without zeros is the symmetric
    format, and asymmetric ones must hold every zero point 0..15."""
    gen = torch.Generator().manual_seed(3)
    qw = peers.random_weight(64, 512, 32, symmetric, torch.bfloat16, gen)
    assert qw.symmetric == symmetric and qw.scales.shape == (64, 512 // 32)
    assert (qw.scales.float() > 0).all()
    if not symmetric:
        assert set(qw.zeros.unique().tolist()) == set(range(16))


@pytest.mark.parametrize(("backend", "dtype"), [("auto", torch.bfloat16), ("naive", torch.float16),
                                                ("torch_bf16", torch.bfloat16), ("torch_fp16", torch.float16)])
def test_every_weight_copy_of_a_prepared_backend_computes_the_same_product(backend, dtype, generator):
    """The rotation's copies are clones of copy 0, zero points included: each computes x @ dequant(W)^T."""
    qw = random_weight(32, 256, 64, False, dtype, generator=generator)
    x = torch.randn(3, 256, generator=generator).to(dtype)
    per_copy = metrics.weight_bytes(backend, 32, 256, 64, False)
    prepared = peers.prepare(backend, qw, cache_bytes=per_copy)  # copies to cover 4x a cache of one copy
    assert prepared.copies == metrics.rotation_copies(per_copy, per_copy) == 4 and prepared.weight is qw
    expected = x.float() @ w4a16.dequantize(qw).t()
    for i in range(prepared.copies):
        y = prepared.call(x, i)
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)


def test_the_dense_peers_take_only_their_own_dtype(generator):
    for backend, wrong in (("torch_bf16", torch.float16), ("torch_fp16", torch.bfloat16)):
        qw = random_weight(16, 128, 128, True, wrong, generator=generator)
        with pytest.raises(peers.Unavailable, match=f"{backend} is the peer for .* the weight's scales are {wrong}"):
            peers.prepare(backend, qw, None)


def test_tinygemm_is_not_prepared_on_cpu_and_an_unknown_backend_is_an_error(generator):
    qw = random_weight(16, 128, 128, True, torch.bfloat16, generator=generator)
    with pytest.raises(peers.Unavailable, match="timed on CUDA builds only"):
        peers.prepare("tinygemm", qw, None)
    with pytest.raises(ValueError, match="unknown backend 'marlin'"):
        peers.prepare("marlin", qw, None)


def test_the_injected_slowdown_runs_our_backend_twice_per_timed_call(generator, monkeypatch):
    """--inject-slowdown must make each timed call of ours cost two (and only with the variable set to 1)."""
    qw = random_weight(16, 128, 128, True, torch.float16, generator=generator)
    x = torch.randn(1, 128, generator=generator).to(torch.float16)
    calls = []
    gemm = w4a16.gemm
    monkeypatch.setattr(w4a16, "gemm", lambda *args, **kwargs: calls.append(kwargs["backend"]) or gemm(*args, **kwargs))
    for value, expected in (("1", 2), ("0", 1), (None, 1)):
        if value is None:
            monkeypatch.delenv(peers.SLOWDOWN_ENV, raising=False)
        else:
            monkeypatch.setenv(peers.SLOWDOWN_ENV, value)
        calls.clear()
        peers.prepare("auto", qw, None).call(x, 0)
        assert calls == ["auto"] * expected, value


def test_the_bench_asks_dispatch_why_a_backend_of_ours_cannot_run(monkeypatch):
    """auto and the peers always run; ours report dispatch's reason, and skinny its own row and staging limits
    on the arch (also where dispatch would let the call through)."""
    cpu = torch.device("cpu")
    for backend in ("auto", "naive", "torch_bf16", "tinygemm"):
        assert peers.unavailable_reason(backend, 1, 4096, torch.float16, cpu) is None
    assert peers.unavailable_reason("skinny", 1, 4096, torch.float16, cpu) == w4a16.dispatch.unavailable_reason(
        "skinny", cpu, torch.float16)
    monkeypatch.setattr(w4a16.dispatch, "unavailable_reason", lambda backend, device, dtype: None)
    monkeypatch.setattr(w4a16, "arch", lambda device: "sm_90")
    rules = w4a16.dispatch.rules("sm_90")
    rows, staging = rules.skinny_rows, rules.skinny_staging_elements
    assert peers.unavailable_reason("skinny", rows, staging // rows, torch.float16, cpu) is None
    assert peers.unavailable_reason("skinny", rows + 1, 64, torch.float16, cpu) == (
        f"skinny takes 1 <= M <= {rows} with K*M <= {staging} on sm_90; M={rows + 1}, K=64")
    assert "M=1, K=" in peers.unavailable_reason("skinny", 1, staging + 1, torch.float16, cpu)
    assert peers.unavailable_reason("triton", 4096, 4096, torch.float16, cpu) is None


# ---------------------------------------------------------------------------------------------------------------
# The end-to-end table, from results built here (no model)


def _e2e_results():
    from w4a16.bench.e2e import E2EResult

    base = E2EResult("llama3.1-8b", "bf16", 16_000_000_000, ttft_ms={128: 20.0}, ttft_eager_ms={128: 30.0, 1920: 200.0},
                     tpot_ms=24.0, linear_ms=20.0, peak_bytes=17_000_000_000)
    quant = E2EResult("llama3.1-8b", "w4a16", 5_600_000_000, ttft_ms={128: 22.0}, ttft_eager_ms={128: 35.0, 1920: 230.0},
                      tpot_ms=8.0, linear_ms=5.0, peak_bytes=6_800_000_000)
    return base, quant


def test_the_e2e_table_rows_and_ratios():
    """GB are 1e9 bytes; TTFT columns take the graph replay, then the eager time; the ratio line has W4A16 over
    bf16 for sizes and times to first token, bf16 over W4A16 for the per-token speed-ups (the issue's targets)."""
    from w4a16.bench import e2e

    base, quant = _e2e_results()
    lines = e2e.format_table([base, quant]).splitlines()
    assert lines[0] == ("| model | weights | resident GB | TTFT@128 ms | TTFT@1920 ms | eager TTFT@128 ms | "
                        "eager TTFT@1920 ms | TPOT ms | linear layers ms/token | peak GB |")
    assert lines[2] == "| llama3.1-8b | bf16 | 16.00 | 20.00 | - | 30.00 | 200.00 | 24.00 | 20.00 | 17.00 |"
    assert lines[3] == "| llama3.1-8b | w4a16 | 5.60 | 22.00 | - | 35.00 | 230.00 | 8.00 | 5.00 | 6.80 |"
    assert lines[5] == ("- llama3.1-8b W4A16 vs bf16: weights 0.350x, TPOT 3.00x faster, linear layers 4.00x "
                        "faster, TTFT@128 1.10x of bf16, TTFT@1920 1.15x of bf16, peak memory 0.400x")
    assert lines[6].startswith("  targets: TPOT >= 2.8x faster")


def test_the_e2e_table_keeps_its_columns_for_failed_models_and_targets_for_llama_only():
    from w4a16.bench import e2e
    from w4a16.bench.e2e import E2EResult

    base, quant = _e2e_results()
    qwen = [E2EResult("qwen3-4b", v, r.weight_bytes, r.ttft_ms, r.ttft_eager_ms, r.tpot_ms) for v, r in
            (("bf16", base), ("w4a16", quant))]
    quant.finite = False
    table = e2e.format_table([base, quant, *qwen, E2EResult("gemma", "failed", 0, finite=False)])
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len({row.count("|") for row in rows}) == 1, rows  # header, separator and every row: the same columns
    assert "| llama3.1-8b | w4a16 (NON-FINITE LOGITS) |" in table and "| llama3.1-8b | bf16 |" in table
    notes = [line for line in table.splitlines() if line.startswith(("-", " "))]
    assert [n.split(" W4A16")[0] for n in notes if n.startswith("-")] == ["- llama3.1-8b", "- qwen3-4b"]
    assert sum("targets" in n for n in notes) == 1 and "targets" in notes[1]
    assert "peak memory" not in notes[2] and "linear layers" not in notes[2]  # not measured: not compared


def test_the_e2e_table_compares_a_model_only_with_both_variants():
    from w4a16.bench import e2e

    base, _ = _e2e_results()
    assert "W4A16 vs bf16" not in e2e.format_table([base])


def test_the_e2e_host_timer_reports_milliseconds():
    import time

    from w4a16.bench import e2e

    ms = e2e._Timer(torch.device("cpu")).elapsed_ms(lambda: time.sleep(0.05))
    assert 45 <= ms < 1000


def test_resident_bytes_count_a_shared_storage_once():
    """Tied embeddings and views share one storage: counted once. A view counts the whole storage it keeps
    alive."""
    from w4a16.bench import e2e

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(100, 16, dtype=torch.bfloat16)  # 3200 bytes
    model.head = torch.nn.Linear(16, 100, bias=False, dtype=torch.bfloat16)
    model.head.weight = model.embed.weight  # tied
    model.register_buffer("first_rows", model.embed.weight.detach()[:10])  # another tensor, the same storage
    model.norm = torch.nn.Parameter(torch.ones(8, dtype=torch.float32))  # 32 bytes
    model.register_buffer("window", torch.zeros(10, dtype=torch.float32)[2:6])  # 4 of a 40-byte storage
    assert e2e.resident_bytes(model) == 100 * 16 * 2 + 8 * 4 + 10 * 4


_TINY_E2E = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, max_position_embeddings=64)


def test_e2e_measure_times_after_a_warm_up_and_reports_per_token(monkeypatch):
    """TTFT is the median of the timed prefills after the untimed first one; TPOT is a decode's time over its
    tokens; the decode's prompt is decode_prompt tokens long even where it is longer than every TTFT prompt."""
    require_module("transformers", "transformers comes with the bench extra, which nox -s tests installs")
    from w4a16.bench import e2e

    model = e2e.build_model("llama3.1-8b", "cpu", _TINY_E2E)
    prompts = []
    model.register_forward_pre_hook(lambda module, args, kwargs: prompts.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    times = iter([100.0, 5.0, 9.0, 6.0, 40.0])  # 1 warm-up + 3 prefills, then one decode of 4 tokens
    monkeypatch.setattr(e2e._Timer, "elapsed_ms", lambda self, fn: fn() or next(times))
    result = e2e.measure(model, "tiny", "bf16", prompt_lengths=(8,), decode_tokens=4, decode_prompt=12, reps=3)
    assert result.ttft_eager_ms == {8: 6.0} and result.ttft_ms == {}
    assert result.tpot_ms == 10.0
    assert prompts == [8] * 4 + [12] + [1] * 4


def test_e2e_a_non_finite_prefill_is_reported_whatever_the_later_ones_give():
    require_module("transformers", "transformers comes with the bench extra, which nox -s tests installs")
    from w4a16.bench import e2e

    model = e2e.build_model("llama3.1-8b", "cpu", _TINY_E2E)

    def overflow_at_8_tokens(module, args, kwargs, output):
        if kwargs["input_ids"].shape[1] == 8:
            output.logits = torch.full_like(output.logits, float("inf"))
        return output

    model.register_forward_hook(overflow_at_8_tokens, with_kwargs=True)
    result = e2e.measure(model, "tiny", "bf16", prompt_lengths=(8, 16), decode_tokens=2, decode_prompt=16, reps=1)
    assert not result.finite


def test_e2e_passes_the_static_cache_under_the_name_the_models_forward_takes():
    """A cache under a keyword forward does not name would be swallowed by **kwargs: the model would build its own
    dynamic cache and the static-cache measurement would silently not be one."""
    from w4a16.bench import e2e

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class Newer(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs): ...

    assert e2e._cache_keyword(Older()) == "past_key_values" and e2e._cache_keyword(Newer()) == "cache"
