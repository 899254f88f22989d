"""The tuner's candidate space (tune.candidates): its pruning rules at their limits, on CPU (nothing is timed)."""

from __future__ import annotations

import pytest

from w4a16.triton import tune
from w4a16.triton.configs import TileConfig

HOPPER_SMEM_PER_BLOCK = 227 * 1024


def _accumulator_registers(c: TileConfig) -> int:
    """fp32 accumulator registers per thread: the tile's outputs over its warps' threads."""
    return c.block_m * c.block_n // (32 * c.num_warps)


def _fits(c: TileConfig) -> bool:
    """The pruning rules as documented in tune.py: BLOCK_K divides the group (one scale per K tile), the shared
    memory within SMEM_BUDGET, at most 128 accumulator registers per thread, and a weight-left tile of 4 or more
    warps holds whole warpgroups of weight rows (the wgmma M dimension, 64 per 4 warps)."""
    whole_warpgroups = not c.w_left or c.num_warps < 4 or c.block_n % (16 * c.num_warps) == 0
    return (tune.GROUP_SIZE % c.block_k == 0 and tune.smem_bytes(c) <= tune.SMEM_BUDGET
            and _accumulator_registers(c) <= 128 and whole_warpgroups)


def _space(monkeypatch, m: int, make=TileConfig) -> tuple[list[TileConfig], list[TileConfig]]:
    """candidates(m) and every tile it considered before pruning, each built by `make` (default: as it is)."""
    considered = []

    def record(*args, **kwargs):
        considered.append(make(*args, **kwargs))
        return considered[-1]

    monkeypatch.setattr(tune, "TileConfig", record)
    kept = tune.candidates(m)
    monkeypatch.setattr(tune, "TileConfig", TileConfig)
    return kept, considered


@pytest.mark.parametrize("m", tune.M_BUCKETS)
def test_the_space_is_every_tile_considered_that_fits_the_budgets(monkeypatch, m):
    kept, considered = _space(monkeypatch, m)
    assert kept, f"no candidate at M={m}"
    assert kept == [c for c in considered if _fits(c)], \
        f"M={m}: pruned {[c for c in considered if _fits(c) and c not in kept]}, kept {[c for c in kept if not _fits(c)]}"
    assert tune.SMEM_BUDGET < HOPPER_SMEM_PER_BLOCK


def test_the_budgets_prune_at_their_limits():
    """At M = 512: 128 accumulator registers per thread fit, 256 do not; 208 KB of shared memory does not."""
    kept = tune.candidates(512)
    at_the_register_limit = TileConfig(128, 256, 64, 8, 4, 1, True)
    over_the_register_limit = TileConfig(256, 256, 64, 8, 4, 1, True)
    over_the_smem_budget = TileConfig(128, 256, 128, 8, 3, 1, True)
    assert _accumulator_registers(at_the_register_limit) == 128 and at_the_register_limit in kept
    assert _accumulator_registers(over_the_register_limit) == 256 and over_the_register_limit not in kept
    assert tune.smem_bytes(over_the_smem_budget) == 208 * 1024 and over_the_smem_budget not in kept


def test_a_tile_using_exactly_the_shared_memory_budget_is_kept(monkeypatch):
    tile = TileConfig(128, 128, 128, 4, 3, 1, True)  # 152 KB, in the M = 128 space
    monkeypatch.setattr(tune, "SMEM_BUDGET", tune.smem_bytes(tile))
    assert tile in tune.candidates(128), "a tile using exactly the budget fits"
    monkeypatch.setattr(tune, "SMEM_BUDGET", tune.smem_bytes(tile) - 1)
    assert tile not in tune.candidates(128), "a tile one byte over the budget is pruned"


def test_no_k_tile_straddles_a_scale_group(monkeypatch):
    """With a group of 64 the 128-deep K tiles go (a K tile reads one scale per row); the 64-deep ones stay."""
    monkeypatch.setattr(tune, "GROUP_SIZE", 64)
    for m in tune.M_BUCKETS:
        depths = {c.block_k for c in tune.candidates(m)}
        assert depths == {64}, f"M={m}: BLOCK_K {sorted(depths)} with G=64"


@pytest.mark.parametrize("m", [16, 512])
def test_weight_left_tiles_hold_whole_warpgroups_of_weight_rows(monkeypatch, m):
    """The shipped space builds only whole-warpgroup tiles, so the rule is checked on the space with every BLOCK_N
    halved: a weight-left tile of 32 rows on 4 warps (or 64 on 8) is pruned, the same tile not weight-left is kept."""
    def narrow(block_m, block_n, *rest, **kwargs):
        return TileConfig(block_m, block_n // 2, *rest, **kwargs)

    kept, considered = _space(monkeypatch, m, narrow)
    assert kept == [c for c in considered if _fits(c)]
    split_warpgroups = [c for c in considered if c.w_left and c.block_n % (16 * c.num_warps)]
    assert split_warpgroups and not set(split_warpgroups) & set(kept), f"M={m}: {split_warpgroups}"
    if m > 256:  # the space holds both orientations there
        assert {TileConfig(128, 32, 64, 4, 4, 1, True), TileConfig(128, 32, 64, 4, 4, 1, False)} & set(kept) == {
            TileConfig(128, 32, 64, 4, 4, 1, False)}


@pytest.mark.parametrize("m", [16, 32, 64])
def test_up_to_64_rows_the_fused_tiles_are_weight_left_with_the_rows_as_block_m(m):
    """Weight-left puts the tokens on the MMA's N side (16..64): up to M = 64 that is the whole fused space, one
    token tile of exactly the bucket's rows; from M = 128 both orientations are tried."""
    assert {(c.w_left, c.block_m) for c in tune.candidates(m)} == {(True, m)}
    assert {c.w_left for c in tune.candidates(128)} == {True, False}


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_below_16_rows_every_candidate_keeps_16_row_tiles(m):
    # `tune --m` takes any power of two; an MMA tile has at least 16 rows, for the fused and the wgmma kernel alike.
    space = tune.candidates(m, wgmma=True)
    assert {c.kernel for c in space} == {"fused", "wgmma"}
    assert {c.block_m for c in space} == {16}


@pytest.mark.parametrize("m", tune.M_BUCKETS)
def test_from_64_rows_the_wgmma_space_adds_four_warpgroups_and_the_producer_form(m):
    """From M = 64 on, 64-token tiles are shared by four warpgroups (16 warps) and the warp-specialized producer
    form is tried (the sm_90 table picks it from M = 64); below, neither has the tokens to share."""
    wgmma = [c for c in tune.candidates(m, wgmma=True) if c.kernel == "wgmma"]
    assert any(c.num_warps == 16 for c in wgmma) is (m >= 64)
    assert any(c.producer for c in wgmma) is (m >= 64)


def test_the_tuner_refuses_an_m_bucket_of_zero(capsys):
    with pytest.raises(SystemExit) as exc:
        tune.main(["--m", "0,16"])
    assert exc.value.code == 2 and "powers of two" in capsys.readouterr().err
