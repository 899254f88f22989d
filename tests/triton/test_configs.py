"""The tile tables and THE selection function (pure data, no kernels)."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from w4a16 import dispatch
from w4a16.triton import configs
from w4a16.triton.configs import SHIPPED_ARCHS, TileConfig, load_table, select_config

ALL_TABLES = (*SHIPPED_ARCHS, configs.GENERIC)


@pytest.mark.parametrize("arch", ALL_TABLES)
def test_shipped_tables_parse_and_say_how_they_were_made(arch):
    table = load_table(arch)
    assert table.arch == arch
    for key in ("tool", "triton", "date", "device", "how"):
        assert table.meta.get(key), f"{arch}.json meta lacks {key!r}"
    for config in table.all_configs():
        assert config.block_k & (config.block_k - 1) == 0, f"{arch}: BLOCK_K {config.block_k} is not a power of two"
        assert config.block_m >= 16 and config.block_n >= 16 and config.block_k >= 16, f"{arch}: {config}"
        if config.kernel == "wgmma":  # fixed 128-wide K tiles; a lane's 32 k never cross a group
            assert arch == "sm_90" and config.for_group(32) == config, f"{arch}: {config}"
            continue
        for g in (32, 64, 128):
            assert g % config.for_group(g).block_k == 0


def test_sm_90_table_came_from_the_tuner():
    meta = load_table("sm_90").meta
    assert "tune" in meta["tool"] and "H200" in meta["device"], meta


def test_gfx1201_rules_follow_the_public_tuning():
    # M <= 64 bucket: tall (K >= 2N) / N > K / else, as written in the starting points.
    assert select_config("gfx1201", 40, 4096, 14336, 128) == TileConfig(64, 32, 128, 8, 1)
    assert select_config("gfx1201", 64, 28672, 4096, 128) == TileConfig(64, 32, 64, 8, 1)
    assert select_config("gfx1201", 64, 4096, 4096, 128) == TileConfig(32, 64, 128, 4, 1)
    # M > 512: N >= 4K picks 256x64; beyond the last bucket the last bucket still applies.
    assert select_config("gfx1201", 100000, 28672, 4096, 128) == TileConfig(256, 64, 64, 8, 1)


def test_bucket_is_the_nearest_at_or_above_m():
    table = load_table("gfx1151")
    keys = [m for m, _ in table.buckets]
    for m in (1, 32, 33, 64, 65, 1024, 1025, 10**6):
        expected = next((k for k in keys if m <= k), keys[-1])
        assert table.bucket_for(m) == expected


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_block_k_is_clamped_to_the_group(group_size):
    config = select_config("gfx1201", 16, 4096, 4096, group_size)  # 16, 16, 128, 4
    assert config.block_k == min(128, group_size)


def test_exact_overrides_win_over_rules(tmp_path, monkeypatch):
    data = {
        "arch": "sm_00", "meta": {},
        "buckets": [{"m": 64, "rules": [{"when": "any", "config": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64,
                                                                    "num_warps": 4}}]}],
        "overrides": [{"n": 512, "k": 1024, "m": 64, "config": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32,
                                                                 "num_warps": 8, "split_k": 2}}],
        "dequant_blas_min_m": 2048,
        "dequant_blas_overrides": [{"n": 512, "k": 1024, "min_m": 64}, {"n": 256, "k": 1024, "min_m": None}],
    }
    (tmp_path / "sm_00.json").write_text(json.dumps(data))
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs.load_table.cache_clear()
    try:
        assert select_config("sm_00", 10, 512, 1024, 128) == TileConfig(64, 64, 32, 8, 1, 2)
        assert select_config("sm_00", 10, 512, 2048, 128) == TileConfig(16, 32, 64, 4)
        assert configs.dequant_blas_min_m("sm_00") == 2048
        assert configs.dequant_blas_overrides("sm_00") == {(512, 1024): 64, (256, 1024): None}
        rules = dispatch.rules("sm_00")  # where the two meet
        assert rules.dequant_blas_from(512, 1024) == 64
        assert rules.dequant_blas_from(256, 1024) is None
        assert rules.dequant_blas_from(1024, 512) == 2048
    finally:
        configs.load_table.cache_clear()


def test_bad_tables_are_rejected():
    for empty in ({}, {"buckets": []}):  # refused when read, not an IndexError at the first selection
        with pytest.raises(ValueError, match="x.json: no buckets"):
            configs._parse("x", empty)
    with pytest.raises(ValueError, match="unknown rule 'huge'"):
        configs._parse("x", {"buckets": [{"m": 1, "rules": [{"when": "huge", "config": {}}]}]})
    with pytest.raises(ValueError, match="must end with an 'any' rule"):
        configs._parse("x", {"buckets": [{"m": 1, "rules": [
            {"when": "tall", "config": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4}}]}]})
    with pytest.raises(ValueError, match="unknown keys"):
        TileConfig.from_json({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "stages": 2}, {})


def test_every_shipped_config_survives_a_json_round_trip():
    """to_json writes what from_json reads back (the tuner writes tables with to_json), producer form included."""
    seen_producer = False
    for arch in configs.SHIPPED_ARCHS + (configs.GENERIC,):
        for config in load_table(arch).all_configs():
            assert TileConfig.from_json(config.to_json(), {}) == config
            seen_producer |= config.producer
    assert seen_producer, "the sm_90 table selects the producer form"


def test_unknown_arch_falls_back_to_generic_with_one_warning():
    configs.load_table.cache_clear()
    configs._warn_generic.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = select_config("gfx9999", 16, 4096, 4096, 128)
        second = select_config("gfx9999", 2048, 4096, 4096, 128)
    assert len([w for w in caught if "gfx9999" in str(w.message)]) == 1
    generic = load_table(configs.GENERIC)
    assert first == dict(generic.buckets)[generic.bucket_for(16)][0][1].for_group(128)
    assert second == dict(generic.buckets)[generic.bucket_for(2048)][0][1].for_group(128)


def test_the_tuner_writes_per_shape_dequant_blas_thresholds():
    """build_table: the arch's crossover from the geometric mean, an override for each shape whose own differs."""
    from w4a16.triton.tune import build_table

    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}
    fused = {256: 10.0, 512: 20.0, 1024: 40.0}
    blas = {(1024, 512): {256: 12.0, 512: 18.0, 1024: 30.0},   # wins from 512
            (4096, 512): {256: 12.0, 512: 22.0, 1024: 30.0}}   # wins from 1024 only
    results = [{"n": n, "k": k, "m": m, "configs": [(config, fused[m])], "dequant_blas_us": us}
               for (n, k), by_m in blas.items() for m, us in by_m.items()]
    table = build_table(results)
    assert table["dequant_blas_min_m"] == 512  # geometric mean at 512: sqrt(18 * 22) = 19.9 < 20
    assert table["dequant_blas_overrides"] == [{"n": 4096, "k": 512, "min_m": 1024}]
    results[3]["dequant_blas_us"] = 5.0  # (4096, 512) now wins at 256 too, but not at 512: still from 1024
    table = build_table(results)
    assert table["dequant_blas_min_m"] == 256
    assert table["dequant_blas_overrides"] == [{"n": 1024, "k": 512, "min_m": 512}, {"n": 4096, "k": 512, "min_m": 1024}]


def test_the_tuners_arch_crossover_compares_with_what_the_table_runs():
    """The arch's crossover and the shapes' own are measured against the same times: the config the table picks
    for each shape (the bucket's default, within the override margin of the shape's best), not the shape's best."""
    from w4a16.triton.tune import build_table

    a, b, c = ({"BLOCK_M": 64, "BLOCK_N": n, "BLOCK_K": 64, "num_warps": 4} for n in (32, 64, 128))
    # Each shape has its own best (10.0), the bucket's default is b for both (10.4, within the 5% margin), and
    # dequant_blas (10.2) beats what the table runs for either shape, though not their best configs.
    results = [{"n": 1024, "k": 512, "m": 4096, "configs": [(a, 10.0), (b, 10.4), (c, 20.0)], "dequant_blas_us": 10.2},
               {"n": 4096, "k": 512, "m": 4096, "configs": [(a, 20.0), (b, 10.4), (c, 10.0)], "dequant_blas_us": 10.2}]
    table = build_table(results)
    assert table["buckets"][0]["rules"][0]["config"] == b and table["overrides"] == []
    assert table["dequant_blas_min_m"] == 4096 and table["dequant_blas_overrides"] == []


def test_a_merged_retune_replaces_only_its_buckets(tmp_path, monkeypatch):
    """tune --merge: the re-tuned buckets and their overrides come from the new run; every other bucket, override
    and the dequant_blas entries stay; the meta says which buckets came from which run."""
    import json

    from w4a16.triton.tune import build_table, merge_tables, write_table

    old = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}
    new = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}
    base = {"meta": {"date": "2026-01-01", "triton": "3.6.0", "torch": "2.11", "device": "NVIDIA H200"},
            "buckets": [{"m": m, "rules": [{"when": "any", "config": old}]} for m in (16, 64, 512)],
            "overrides": [{"n": 8, "k": 64, "m": m, "config": old} for m in (16, 64)],
            "dequant_blas_min_m": 512, "dequant_blas_overrides": [{"n": 8, "k": 64, "min_m": None}]}
    results = [{"n": 8, "k": 64, "m": 64, "configs": [(new, 1.0), (old, 2.0)], "dequant_blas_us": 9.0}]
    table, meta = merge_tables(base, build_table(results), [64])
    kept = TileConfig.from_json(old, {}).to_json()  # written in full (base's defaults applied)
    assert [(b["m"], b["rules"][0]["config"]) for b in table["buckets"]] == [(16, kept), (64, new), (512, kept)]
    # The re-tuned bucket's best is its default: no override there.
    assert table["overrides"] == [{**base["overrides"][0], "config": kept}]
    assert table["dequant_blas_min_m"] == 512 and table["dequant_blas_overrides"] == base["dequant_blas_overrides"]
    assert meta == {"merged": {"retuned_m": [64], "other_buckets_from": {
        "date": "2026-01-01", "triton": "3.6.0", "torch": "2.11", "device": "NVIDIA H200"}}}
    path = tmp_path / "sm_90.json"
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *args: "NVIDIA H200")  # the tuner runs on a GPU
    write_table("sm_90", table, path, meta)
    assert json.loads(path.read_text())["meta"]["merged"]["retuned_m"] == [64]


def test_a_merged_retune_of_the_large_buckets_re_derives_the_dequant_blas_crossovers():
    """tune --merge over every bucket from some M up: the dequant_blas crossovers come from the new times; one at
    the smallest re-tuned bucket keeps a lower crossover of the old table (its lower buckets were not re-timed)."""
    from w4a16.triton.tune import build_table, merge_tables

    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}
    base = {"buckets": [{"m": m, "rules": [{"when": "any", "config": config}]} for m in (64, 256, 512, 1024)],
            "dequant_blas_min_m": 512,
            "dequant_blas_overrides": [{"n": 8, "k": 64, "min_m": 64}, {"n": 16, "k": 64, "min_m": None}]}
    fused = {256: 10.0, 512: 20.0, 1024: 40.0}
    blas = {(8, 64): {256: 9.0, 512: 18.0, 1024: 30.0},      # wins from 256 (and from 64 in the old run)
            (16, 64): {256: 12.0, 512: 22.0, 1024: 50.0},    # never wins
            (32, 64): {256: 12.0, 512: 21.0, 1024: 30.0}}    # wins from 1024 only (was the old default, 512)
    results = [{"n": n, "k": k, "m": m, "configs": [(config, fused[m])], "dequant_blas_us": us}
               for (n, k), by_m in blas.items() for m, us in by_m.items()]
    new = build_table(results)
    table, _ = merge_tables(base, new, [256, 512, 1024])
    assert table["dequant_blas_min_m"] == 1024  # geometric mean at 512: (18 * 22 * 21) ** (1/3) = 20.3 > 20
    assert table["dequant_blas_overrides"] == [{"n": 8, "k": 64, "min_m": 64}, {"n": 16, "k": 64, "min_m": None}]
    # Not every bucket from 256 up re-tuned: the crossovers stay the old table's.
    table, _ = merge_tables(base, build_table([r for r in results if r["m"] == 256]), [256])
    assert table["dequant_blas_min_m"] == 512 and table["dequant_blas_overrides"] == base["dequant_blas_overrides"]
    # Nor where the re-tuned buckets leave a gap (256 between 64 and 1024).
    gapped = [{**r, "m": 64} for r in results if r["m"] == 256] + [r for r in results if r["m"] == 1024]
    table, _ = merge_tables(base, build_table(gapped), [64, 1024])
    assert table["dequant_blas_min_m"] == 512 and table["dequant_blas_overrides"] == base["dequant_blas_overrides"]
    # A re-tune in which dequant_blas never wins says so, whatever the old table said.
    slower = [{**r, "dequant_blas_us": 2 * fused[r["m"]]} for r in results]
    table, _ = merge_tables(base, build_table(slower), [256, 512, 1024])
    assert table["dequant_blas_min_m"] is None
    assert table["dequant_blas_overrides"] == [], "an old crossover below 256 needed wins at 256 too"


def test_the_tuner_times_its_finalists_in_turn_and_keeps_the_medians():
    """The re-timing after a sweep: the fastest configs within the margin, at most FINALISTS of them; every timer
    called once per round, in turn; the median of each kept."""
    from w4a16.triton import tune

    sweep = [({"id": i}, us) for i, us in enumerate([10.0, 10.5, 30.0, 10.9, 11.2, 10.2])]
    assert tune._finalists(sweep) == [{"id": 0}, {"id": 5}, {"id": 1}, {"id": 3}][:tune.FINALISTS]
    calls = []
    samples = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}

    def timer(key):
        def measure():
            calls.append(key)
            return next(samples[key])
        return measure

    medians = tune._interleaved_medians({key: timer(key) for key in samples}, 3)
    assert medians == {"a": 3.0, "b": 4.0}
    assert calls == ["a", "b"] * 3


def test_configs_not_timed_again_are_moved_to_the_re_timing_clock():
    """A config left out of the re-timing keeps its sweep time scaled by the finalists' drift: the machine that ran
    the finalists 8% slower would otherwise let an unscaled, 4% slower sweep time win the case."""
    from w4a16.triton import tune

    sweep = [(f"config {i}", us) for i, us in enumerate([10.0, 10.1, 10.2, 10.3, 10.4])]
    final = {cfg: us * 1.08 for cfg, us in sweep[:tune.FINALISTS]}
    timed = tune._on_final_clock(sweep, final)
    best = min(timed, key=lambda entry: entry[1])[0]
    assert best == "config 0", timed
    assert timed[-1][1] == pytest.approx(10.4 * 1.08)
    assert [us for _, us in timed[:tune.FINALISTS]] == [final[cfg] for cfg, _ in sweep[:tune.FINALISTS]]


def test_the_finalists_are_the_configs_within_the_margin_of_the_best_inclusive():
    """A config at exactly FINALIST_MARGIN times the best is timed again, one a hair slower is not; the best is
    found wherever the sweep timed it. The sweep's own drift (the same config 348.7 and 379.4 µs, PERF.md) is
    within the margin."""
    from w4a16.triton import tune

    best = 348.7
    edge = tune.FINALIST_MARGIN * best
    sweep = [("past the margin", math.nextafter(edge, math.inf)), ("at the margin", edge), ("drifted", 379.4),
             ("best", best)]
    assert tune._finalists(sweep) == ["best", "drifted", "at the margin"]


def test_at_most_FINALISTS_configs_are_timed_again():
    from w4a16.triton import tune

    sweep = [(f"config {i}", 100.0 + i) for i in reversed(range(tune.FINALISTS + 2))]  # all within the margin
    assert tune._finalists(sweep) == [f"config {i}" for i in range(tune.FINALISTS)]


def test_the_re_timing_constants_are_those_the_shipped_table_says_it_was_made_with(tmp_path, monkeypatch):
    """The sm_90 table's meta says how many finalists within which margin were timed again, in how many rounds, and
    the override gain: the tuner's constants must still be those (PERF.md: at most 4, within 10%, three rounds)."""
    from w4a16.triton.tune import write_table

    monkeypatch.setattr("torch.cuda.get_device_name", lambda *args: "NVIDIA H200")
    path = tmp_path / "sm_90.json"
    write_table("sm_90", {"buckets": []}, path)
    written = json.loads(path.read_text())["meta"]["how"]
    shipped = load_table("sm_90").meta["how"]
    assert written[written.index("per case"):] == shipped[shipped.index("per case"):]


def test_the_re_timing_keeps_the_median_of_skewed_rounds():
    """One disturbed round must not move the kept time: of 1, 2, 4 and 100 µs the median is 3, where a mean
    (26.75), a minimum (1) or the lower or upper middle value (2, 4) would differ."""
    from w4a16.triton import tune

    rounds = iter([4.0, 100.0, 1.0, 2.0])
    assert tune._interleaved_medians({"config": lambda: next(rounds)}, 4) == {"config": 3.0}


def test_the_drift_applied_to_configs_not_timed_again_is_the_finalists_median():
    """One finalist disturbed in its re-timing (3x) must not scale every other config: the drift is the median of
    the finalists' re-timed / swept ratios (1.0, 1.1, 1.2, 3.0: 1.15), not their mean, minimum or an end value."""
    from w4a16.triton import tune

    sweep = [(f"config {i}", 10.0 + i) for i in range(6)]
    final = {cfg: us * ratio for (cfg, us), ratio in zip(sweep[:4], [3.0, 1.1, 1.0, 1.2], strict=True)}
    timed = dict(tune._on_final_clock(sweep, final))
    assert timed["config 4"] == pytest.approx(14.0 * 1.15) and timed["config 5"] == pytest.approx(15.0 * 1.15)
    assert tune._on_final_clock(sweep, {}) == sweep, "nothing re-timed: the sweep times stand"


def test_a_merge_keeps_the_old_buckets_as_the_old_table_read_them(tmp_path, monkeypatch):
    """The AMD tables leave num_stages to their defaults (1); write_table writes the tuner's own defaults (3), so
    kept buckets and overrides must be written in full or they would change stages on a merge."""
    import json

    from w4a16.triton.tune import build_table, merge_tables, write_table

    base = json.loads((configs.CONFIG_DIR / "gfx1151.json").read_text())
    assert base["defaults"].get("num_stages") == 1
    before = configs._parse("gfx1151", base)
    tuned = max(before.buckets)[0]
    new = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
    results = [{"n": 8, "k": 64, "m": tuned, "configs": [(new, 1.0)], "dequant_blas_us": 9.0}]
    table, meta = merge_tables(base, build_table(results), [tuned])
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *args: "gfx1151 test")
    path = tmp_path / "gfx1151.json"
    write_table("gfx1151", table, path, meta)
    after = configs._parse("gfx1151", json.loads(path.read_text()))
    assert dict(after.buckets)[tuned][0][1] == TileConfig.from_json(new, {})
    kept = [b for b in before.buckets if b[0] != tuned]
    assert kept and [b for b in after.buckets if b[0] != tuned] == kept
    assert {key: c for key, c in after.overrides.items() if key[2] != tuned} == \
        {key: c for key, c in before.overrides.items() if key[2] != tuned}


@pytest.mark.parametrize("argv, message", [
    (["--m", "16,48"], "powers of two"),
    (["--m", "x"], "powers of two"),
    (["--shapes", "llama3.1-8b,gpt2"], "--shapes"),
    (["--shapes", "qwen3-4b", "--merge"], "needs all of --shapes"),
])
def test_the_tuner_refuses_bad_arguments_before_timing(argv, message, capsys):
    from w4a16.triton import tune

    with pytest.raises(SystemExit) as exc:
        tune.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_table_meta_names_the_models_tuned(tmp_path, monkeypatch):
    import json

    from w4a16.triton.tune import write_table

    monkeypatch.setattr("torch.cuda.get_device_name", lambda *args: "NVIDIA H200")
    path = tmp_path / "sm_90.json"
    write_table("sm_90", {"buckets": []}, path, {"partial": "1 of 4 cases timed"}, ["qwen3-4b"])
    meta = json.loads(path.read_text())["meta"]
    assert "shapes ['qwen3-4b']" in meta["how"] and meta["partial"] == "1 of 4 cases timed"


def test_a_table_that_selects_the_wgmma_kernel_needs_gluon(monkeypatch):
    """Without Gluon (triton < 3.6) every call the sm_90 table routes to the wgmma kernel would fail: the Triton
    route says so up front, and dispatch falls back. Tables without wgmma configs do not ask."""
    import sys

    import torch

    import w4a16.triton as tri

    monkeypatch.setitem(sys.modules, "w4a16.triton.wgmma_kernel", None)  # its import now raises ImportError
    monkeypatch.setattr(tri, "table_arch", lambda device: "sm_90")
    assert "selects the wgmma kernel, which needs triton's Gluon" in tri._wgmma_reason(torch.device("cuda", 0))
    monkeypatch.setattr(tri, "table_arch", lambda device: "gfx1151")
    assert tri._wgmma_reason(torch.device("cuda", 0)) is None


def test_every_table_on_disk_is_a_shipped_arch():
    """The AOT and round-trip tests walk SHIPPED_ARCHS: a table written for a new arch must join it, or it would
    ship unchecked."""
    on_disk = {path.stem for path in configs.CONFIG_DIR.glob("*.json")}
    assert on_disk == {*SHIPPED_ARCHS, configs.GENERIC}


def test_a_buckets_config_is_the_best_geometric_mean_of_its_ratios_to_each_shapes_best():
    """A config twice as slow on one shape and best on the other (geometric mean 1.41) beats one 1.45x slower on
    both; an arithmetic mean (1.5 against 1.45) would pick the other."""
    from w4a16.triton.tune import build_table

    a, b, only_1, only_2 = ({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": 64, "num_warps": 4} for bn in (32, 64, 128, 256))
    results = [{"n": 8, "k": 64, "m": 16, "configs": [(a, 10.0), (b, 14.5), (only_1, 10.0)], "dequant_blas_us": 99.0},
               {"n": 16, "k": 64, "m": 16, "configs": [(a, 20.0), (b, 14.5), (only_2, 10.0)], "dequant_blas_us": 99.0}]
    assert build_table(results)["buckets"][0]["rules"][0]["config"] == a


def _table(monkeypatch, buckets: list[dict]):
    """Route select_config("test", ...) to a table parsed from `buckets` (no file, no cache)."""
    table = configs._parse("test", {"buckets": buckets})
    monkeypatch.setattr(configs, "load_table", lambda arch: table)
    return table


def _tile(block_n: int, **extra) -> dict:
    return {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": 64, "num_warps": 4, **extra}


def test_shape_rules_hold_at_their_boundaries_and_the_first_that_holds_wins(monkeypatch):
    """"tall" K >= 2N, "n_ge_4k" N >= 4K, "n_ge_2k" N >= 2K, "n_gt_k" N > K (the module docstring), tried in the
    bucket's order: a shape exactly at a bound meets it, one step short of it falls through to the next rule."""
    order = ("tall", "n_ge_4k", "n_ge_2k", "n_gt_k", "any")
    _table(monkeypatch, [{"m": 64, "rules": [{"when": when, "config": _tile(16 * 2**i)}
                                             for i, when in enumerate(order)]}])
    picks = {(1024, 2048): "tall", (1024, 2047): "any", (4096, 1024): "n_ge_4k", (4095, 1024): "n_ge_2k",
             (2048, 1024): "n_ge_2k", (2047, 1024): "n_gt_k", (1025, 1024): "n_gt_k", (1024, 1024): "any"}
    for (n, k), when in picks.items():
        assert select_config("test", 64, n, k, 64).block_n == 16 * 2 ** order.index(when), (n, k, when)


def test_buckets_are_looked_up_in_m_order_whatever_the_files_order(monkeypatch):
    table = _table(monkeypatch, [{"m": m, "rules": [{"when": "any", "config": _tile(bn)}]}
                                 for m, bn in ((256, 128), (16, 32), (64, 64))])
    assert [m for m, _ in table.buckets] == [16, 64, 256]
    assert [select_config("test", m, 512, 512, 64).block_n for m in (1, 16, 17, 64, 65, 256, 4096)] == \
        [32, 32, 64, 64, 128, 128, 128]


def test_a_bucket_without_rules_is_refused():
    with pytest.raises(ValueError, match="x.json: bucket m=16 must end with an 'any' rule"):
        configs._parse("x", {"buckets": [{"m": 16, "rules": []}]})


def test_a_table_naming_a_kernel_this_package_lacks_is_refused():
    # "wgmma2" is not one of the kernels: with the wgmma kernel's fields it must not be run as the wgmma kernel.
    entry = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "kernel": "wgmma2"}
    with pytest.raises(ValueError, match=r"kernel must be one of \('fused', 'wgmma'\), got 'wgmma2'"):
        TileConfig.from_json(entry, {})


def test_split_k_is_at_most_one_split_per_k_tile_a_partial_last_tile_included():
    """K = 160 in the wgmma kernel's 128-deep tiles is one full tile and one partial (masked) tile: two splits at
    most; K = 128 one; K = 4096 leaves the config's 8 as they are."""
    config = TileConfig(16, 64, 128, 4, 4, 8, kernel="wgmma")
    assert [config.for_shape(1, 64, k).split_k for k in (128, 160, 256, 4096)] == [1, 2, 2, 8]
    assert TileConfig(16, 64, 32, 4, 2, 3).for_shape(5, 48, 64).split_k == 2  # fused: 64 = two 32-deep tiles


def test_the_split_stays_while_its_slices_fit_32_bit_offsets(monkeypatch):
    """The fp32 slices [split, M, N] must be indexable in 32 bits: with the limit lowered to 4 * 8 * 16 elements,
    4 splits of 8 x 16 exactly fit (largest offset one less), 4 splits of 8 x 17 do not and run unsplit."""
    monkeypatch.setattr(configs, "INT32_MAX", 4 * 8 * 16)
    config = TileConfig(16, 64, 32, 4, 2, 4)
    assert config.for_shape(8, 16, 128).split_k == 4
    assert config.for_shape(8, 17, 128).split_k == 1


def test_selection_clamps_block_k_to_the_group_before_counting_k_tiles(monkeypatch):
    """A 128-deep config at G = 32 runs 32-deep tiles: K = 64 is then two tiles, so its 8 splits become 2 (not 8,
    which would leave splits without work, nor 1, counted on the unclamped 128)."""
    _table(monkeypatch, [{"m": 16, "rules": [{"when": "any", "config": {
        "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "split_k": 8}}]}])
    assert select_config("test", 16, 64, 64, 32) == TileConfig(16, 64, 32, 4, 1, 2)


def test_an_override_needs_more_than_the_gain_over_the_buckets_config():
    """A shape whose own best is exactly OVERRIDE_GAIN times faster than the bucket's config keeps the bucket's
    config; a hair more and it gets an override."""
    from w4a16.triton.tune import OVERRIDE_GAIN, build_table

    a, b = _tile(32), _tile(64)
    for slowdown, overridden in ((1.0, False), (math.nextafter(1.0, 2.0), True)):
        at_gain = OVERRIDE_GAIN * 10.0 * slowdown
        # a: at the gain on shape 8 and best on shape 16 (the bucket's pick); b: best on 8, twice as slow on 16.
        results = [{"n": 8, "k": 64, "m": 16, "configs": [(a, at_gain), (b, 10.0)], "dequant_blas_us": 99.0},
                   {"n": 16, "k": 64, "m": 16, "configs": [(a, 10.0), (b, 20.0)], "dequant_blas_us": 99.0}]
        table = build_table(results)
        assert table["buckets"][0]["rules"][0]["config"] == a
        assert table["overrides"] == ([{"n": 8, "k": 64, "m": 16, "config": b}] if overridden else []), slowdown


def test_dequant_blas_as_fast_as_the_table_is_no_crossover():
    """dequant_blas must be faster to win a bucket: equal times, for the arch and for each shape, leave the fused
    kernel in place (no dequant_blas_min_m, no per-shape entry)."""
    from w4a16.triton.tune import build_table

    config = _tile(64)
    results = [{"n": n, "k": 64, "m": m, "configs": [(config, us)], "dequant_blas_us": us}
               for n in (8, 16) for m, us in ((256, 10.0), (512, 20.0), (1024, 40.0))]
    table = build_table(results)
    assert table["dequant_blas_min_m"] is None and table["dequant_blas_overrides"] == []


def test_a_merge_into_a_table_without_a_crossover_takes_the_retunes():
    """The old table never chose dequant_blas; a re-tune of every bucket from 256 up in which it wins from 256 on
    sets the crossover at 256 (the buckets below were not re-timed, and never won before)."""
    from w4a16.triton.tune import build_table, merge_tables

    config = _tile(64)
    base = {"buckets": [{"m": m, "rules": [{"when": "any", "config": config}]} for m in (64, 256, 512)],
            "dequant_blas_min_m": None, "dequant_blas_overrides": []}
    results = [{"n": 8, "k": 64, "m": m, "configs": [(config, 10.0)], "dequant_blas_us": 5.0} for m in (256, 512)]
    table, _ = merge_tables(base, build_table(results), [256, 512])
    assert table["dequant_blas_min_m"] == 256 and table["dequant_blas_overrides"] == []


def test_a_merge_keeps_each_shapes_old_lower_crossover_where_the_retune_wins_from_its_lowest_bucket():
    """Re-tuning 256..1024: a shape that wins from 256 in the re-tune keeps the crossover below 256 that the old
    table gave it, be that its own entry or the old arch default; a shape that now wins from 1024 only gets 1024."""
    from w4a16.triton.tune import build_table, merge_tables

    config = _tile(64)
    fused = {256: 10.0, 512: 20.0, 1024: 40.0}

    def merged(base_min_m, base_overrides, blas):
        base = {"buckets": [{"m": m, "rules": [{"when": "any", "config": config}]} for m in (64, 128, 256, 512, 1024)],
                "dequant_blas_min_m": base_min_m, "dequant_blas_overrides": base_overrides}
        results = [{"n": n, "k": 64, "m": m, "configs": [(config, fused[m])], "dequant_blas_us": us}
                   for n, by_m in blas.items() for m, us in by_m.items()]
        return merge_tables(base, build_table(results), [256, 512, 1024])[0]

    # Every shape wins from 256 in the re-tune; shape 8 had its own crossover at 64 before, the arch one was 512.
    table = merged(512, [{"n": 8, "k": 64, "min_m": 64}], {n: {256: 5.0, 512: 10.0, 1024: 20.0} for n in (8, 16)})
    assert table["dequant_blas_min_m"] == 256
    assert table["dequant_blas_overrides"] == [{"n": 8, "k": 64, "min_m": 64}]
    # The old arch crossover was 64, with no shape of its own; the re-tune puts the arch's at 512, shape 8 wins
    # from 256 (so from the old 64), shape 16 from 1024 only, shape 32 with the arch.
    table = merged(64, [], {8: {256: 9.0, 512: 18.0, 1024: 30.0}, 16: {256: 12.0, 512: 21.0, 1024: 30.0},
                            32: {256: 12.0, 512: 19.0, 1024: 30.0}})
    assert table["dequant_blas_min_m"] == 512  # geometric mean at 256: 10.9 > 10, at 512: 19.3 < 20
    assert table["dequant_blas_overrides"] == [{"n": 8, "k": 64, "min_m": 64}, {"n": 16, "k": 64, "min_m": 1024}]


def test_a_merge_of_a_merged_table_keeps_where_its_other_buckets_came_from():
    """The buckets a second merge keeps may come from the first full run, not from the first merge: the meta keeps
    naming that run."""
    from w4a16.triton.tune import build_table, merge_tables

    config = _tile(64)
    first_run = {"date": "2026-01-01", "triton": "3.6.0", "torch": "2.11", "device": "NVIDIA H200"}
    base = {"meta": {"date": "2026-02-01", "triton": "3.7.0", "torch": "2.12", "device": "NVIDIA H100",
                     "merged": {"retuned_m": [64], "other_buckets_from": first_run}},
            "buckets": [{"m": m, "rules": [{"when": "any", "config": config}]} for m in (16, 64, 512)],
            "dequant_blas_min_m": None, "dequant_blas_overrides": []}
    results = [{"n": 8, "k": 64, "m": 16, "configs": [(config, 1.0)], "dequant_blas_us": 9.0}]
    _, meta = merge_tables(base, build_table(results), [16])
    assert meta == {"merged": {"retuned_m": [16], "other_buckets_from": first_run}}


# --- Routing and argument checks that need no kernel launch ------------------------------------------------------


def test_offsets_are_refused_only_past_int32_max():
    """2^31 - 1 elements still index in 32 bits; one more does not (x [M, K] for the fused kernel)."""
    from w4a16.triton import index_limit_reason

    assert index_limit_reason(1, 1, 2**31 - 1, "triton") is None
    assert index_limit_reason(1, 1, 2**31, "triton") == "M*K=2147483648 exceeds the kernel's 32-bit indexing (2^31 - 1)"
    assert index_limit_reason(2**31, 1, 1, "dequant_blas") is None  # its matmul is torch's: any M


def test_the_routes_reasons_by_device(monkeypatch):
    import torch

    import w4a16.triton as tri

    monkeypatch.setattr(tri, "_interpreting", lambda: True)  # a process that imported the kernels interpreted
    assert "TRITON_INTERPRET=1 was set" in tri.unavailable_reason("cuda")
    assert tri.unavailable_reason("meta") == "no Triton backend for device type 'meta'"
    assert tri.table_arch(torch.device("cpu")) == "generic"
    # On a GPU only the fused route depends on the table's kernels (wgmma); dequant_blas has its own kernel.
    monkeypatch.setattr(tri, "_interpreting", lambda: False)
    monkeypatch.setattr(tri, "_wgmma_reason", lambda device: "the wgmma kernel cannot run here")
    assert tri.unavailable_reason("cuda", "triton") == "the wgmma kernel cannot run here"
    assert tri.unavailable_reason("cuda", "dequant_blas") is None
    assert "set TRITON_INTERPRET=1" in tri.unavailable_reason("cpu")
