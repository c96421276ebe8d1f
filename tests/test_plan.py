import pytest
from helpers import DEEPSEEK_V3_TP8_SPEC
from hypothesis import given
from hypothesis import strategies as st

from mlagen_compiler.plan import (
    ARCH_BUDGETS,
    GLUON_MAX_SMEM,
    PLAN_ARCH,
    PlanError,
    TileConfig,
    _gluon_smem_bytes,
    combine_step_runs,
    decode_live_regs,
    decode_smem_bytes,
    lower,
    lower_gluon_decode,
    next_pow2,
    prefill_live_regs,
    prefill_smem_bytes,
)
from mlagen_compiler.spec import spec_from_dict


def spec(**over):
    return spec_from_dict({**DEEPSEEK_V3_TP8_SPEC, **over})


def test_next_pow2():
    assert [next_pow2(v) for v in (1, 2, 3, 16, 17, 192, 576, 1024)] == [1, 2, 4, 16, 32, 256, 1024, 1024]


@given(dc=st.integers(4, 64).map(lambda k: 16 * k), dr=st.integers(1, 8).map(lambda k: 16 * k))
def test_padding_is_pow2_and_covers(dc, dr):
    plan = lower(spec(kv_lora_rank=dc, qk_rope_head_dim=dr)).decode
    for real, padded in ((dc, plan.dc_pad), (dr, plan.dr_pad)):
        assert padded >= real and padded & (padded - 1) == 0 and padded < 2 * real


def multiple_of_16(lo, hi):
    return st.integers(lo // 16, hi // 16).map(lambda k: 16 * k)


@given(
    heads=st.integers(1, 256),
    dc=multiple_of_16(64, 1024),
    dr=multiple_of_16(16, 128),
    dn=multiple_of_16(16, 256),
    dv=multiple_of_16(16, 256),
    page_size=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256]),
    cache_dtype=st.sampled_from([None, "float8_e4m3fn"]),
)
def test_plan_never_offers_a_config_over_budget(heads, dc, dr, dn, dv, page_size, cache_dtype):
    """Over the whole range a spec may take: every offered tile fits the target's registers and shared memory."""
    budget = ARCH_BUDGETS[PLAN_ARCH]
    geometry = dict(num_heads=heads, kv_lora_rank=dc, qk_rope_head_dim=dr, qk_nope_head_dim=dn, v_head_dim=dv)
    plan = lower(spec(**geometry, page_size=page_size, cache_dtype=cache_dtype, kernels=["decode", "prefill"]))
    decode = plan.decode
    assert decode.block_ms()[0] == 16 and decode.block_ms() == tuple(sorted(decode.block_ms()))
    offered = [(m, c) for m, configs in decode.space for c in configs]
    offered += [*decode.defaults, *decode.small_batch_defaults]
    for block_m, c in offered:
        assert c in dict(decode.space)[block_m]
        smem = decode_smem_bytes(block_m, c, decode.dc_pad, decode.dr_pad, decode.cache_bytes)
        assert smem <= budget.smem_bytes, (block_m, c)
        assert decode_live_regs(block_m, c, decode.dc_pad) <= budget.live_fp32_regs_per_thread, (block_m, c)
    prefill = plan.prefill
    assert prefill.space and prefill.default in prefill.space
    for c in prefill.space:
        assert prefill_smem_bytes(c, prefill.dn_pad, prefill.dr_pad, prefill.dv_pad) <= budget.smem_bytes, c
        assert prefill_live_regs(c, prefill.dv_pad) <= budget.live_fp32_regs_per_thread, c


def test_decode_smem_model_counts_the_rope_columns():
    """Dr = 128 pads the cache row to 640 columns: 64 query rows + 2 x 64 cache rows need 245,760 B."""
    plan = lower(spec(qk_rope_head_dim=128)).decode
    assert decode_smem_bytes(64, TileConfig(64, 8, 2), plan.dc_pad, plan.dr_pad) == 245760
    assert TileConfig(64, 8, 2) not in dict(plan.space)[64]
    assert dict(plan.defaults)[64] in dict(plan.space)[64]


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_pinned_tiles_over_the_shared_memory_budget_are_an_error(kernel):
    tiles = {"block_m": 64, "block_n": 128, "num_warps": 8, "num_stages": 4}
    with pytest.raises(PlanError, match=rf"^tiles\.{kernel}: block_m=64, block_n=128, num_stages=4 needs [\d,]+ B"):
        lower(spec(kernels=[kernel], tiles={kernel: tiles}))


def test_fp8_cache_plan():
    """An fp8 cache: 1-byte stages (and, for warpgroup-MMA row blocks, one tile converted to the query's
    dtype), runs of twice the blocks for the same fixed cost; the Gluon decode takes it with its converting
    or landing producer (float16 stages: the same shared memory as a 16-bit cache), and `mlagen show` says so."""
    bf16 = lower(spec()).decode
    fp8 = lower(spec(cache_dtype="float8_e4m3fn"))
    assert fp8.cache_dtype == "float8_e4m3fn" and fp8.cache_format.scaled and fp8.dtype == "bfloat16"
    decode = fp8.decode
    assert (bf16.cache_bytes, decode.cache_bytes) == (2, 1)
    c = TileConfig(64, 8, 2)
    # bytes per column: stages x block_n x element size (+ the converted block) + 2 x query rows
    assert decode_smem_bytes(16, c, 512, 64) == (2 * 64 * 2 + 2 * 16) * 576
    assert decode_smem_bytes(16, c, 512, 64, cache_bytes=1) == (2 * 64 * 1 + 2 * 16) * 576
    assert decode_smem_bytes(64, c, 512, 64, cache_bytes=1) == (2 * 64 * 1 + 64 * 2 + 2 * 64) * 576
    for key, blocks in decode.min_blocks_per_part:  # half the bytes per block: about twice the blocks
        assert dict(bf16.min_blocks_per_part)[key] <= blocks <= 2 * dict(bf16.min_blocks_per_part)[key], key
    assert (dict(bf16.min_blocks_per_part)[(64, 64)], dict(decode.min_blocks_per_part)[(64, 64)]) == (5, 10)
    assert bf16.gluon.eligible and decode.gluon.eligible and not decode.gluon.reason
    assert decode.gluon.convert_cache and not bf16.gluon.convert_cache
    # the same stages; the landing producer's mbarriers on top: a pair for each of its pieces (the 8 latent
    # chunks land_group at a time, then the rope)
    assert decode.gluon.num_stages == bf16.gluon.num_stages
    pieces = 8 // decode.gluon.land_group + 1
    assert 8 % decode.gluon.land_group == 0
    assert decode.gluon.smem_bytes == bf16.gluon.smem_bytes + 2 * pieces * 8
    assert decode.gluon.land_rows == decode.gluon.block_m // 2
    assert fp8.summary()["decode"]["backend"].startswith(
        "gluon (float8_e4m3fn cache converted to float16 in shared memory; landed by TMA in the query tile's"
        " unused half where Sq * H <= 32 and pages hold whole blocks; else loaded row by row) on compute"
        " capability 9.x"
    )
    # a query filling the tile, its landing ring beside it (where the ring fits): 4 latent chunks a piece, the
    # query scaled into float16 a slice of rows at a time
    g = decode.gluon
    assert g.land_full_query_pieces == 8 // 4 + 1
    assert 0 < g.land_full_query_slice <= g.block_m and g.block_m % g.land_full_query_slice == 0


def test_fp8_landing_ring_where_two_blocks_fit_beside_two_stages():
    """Dc 256 (Mistral-Small-4): two fp8 blocks land at a time in a ring of their own beside two 16-bit stages,
    in 4 converting warps; Dc 512: no room beside the query tile and two stages (the tile's lower half takes one
    block), 2 warps; a 16-bit cache: no landing at all."""
    ring = lower_gluon_decode(256, 64, "float8_e4m3fn")
    assert (ring.land_ring_slots, ring.land_ring_stages, ring.land_warps) == (2, 2, 4)
    # what `mlagen show` says of such a module: the ring first, then what takes the launches it does not
    shown = lower(spec(kv_lora_rank=256, cache_dtype="float8_e4m3fn")).summary()["decode"]["backend"]
    assert (
        "landed by TMA 2 blocks at a time in a ring of its own where Sq * H <= 64 and pages hold whole blocks; else"
        " loaded row by row)"
    ) in shown
    slots = 2 * (ring.block_n * 320 + 16 * ring.land_pieces)
    assert _gluon_smem_bytes(256, 64, 2, 64, 64) + slots <= GLUON_MAX_SMEM
    wide = lower_gluon_decode(512, 64, "float8_e4m3fn")
    assert (wide.land_ring_slots, wide.land_warps) == (1, 2)
    one_slot = wide.block_n * 576 + 16 * wide.land_pieces
    assert _gluon_smem_bytes(512, 64, 2, 64, 64) + 2 * one_slot > GLUON_MAX_SMEM
    assert lower_gluon_decode(256, 64).land_ring_slots == 1


def test_long_blocks_where_two_fit_beside_the_query_tile_with_a_16_bit_cache():
    """128-position blocks in a ring of 2 (launch_policy.gluon_long_blocks): Dc 256 and 128 fit them beside the
    64-row query tile and P; Dc 512 does not, and an fp8 cache never takes them."""
    for dc in (128, 256):
        plan = lower_gluon_decode(dc, 64)
        assert (plan.long_block_n, plan.long_block_stages) == (128, 2)
        assert _gluon_smem_bytes(dc, 64, 2, 64, 128) <= GLUON_MAX_SMEM
    assert lower_gluon_decode(512, 64).long_block_n == 0
    assert _gluon_smem_bytes(512, 64, 2, 64, 128) > GLUON_MAX_SMEM
    assert lower_gluon_decode(256, 64, "float8_e4m3fn").long_block_n == 0


def test_wide_latent_needs_eight_warps_for_64_rows():
    plan = lower(spec(kv_lora_rank=512)).decode
    assert 4 not in {c.num_warps for c in dict(plan.space)[64]}
    assert dict(plan.defaults)[64].num_warps >= 8


def test_overrides_pin_the_space():
    plan = lower(spec(tiles={"decode": {"block_n": 32, "num_warps": 4, "num_stages": 3, "block_m": 32}})).decode
    assert plan.space == ((32, (TileConfig(32, 4, 3),)),)
    assert plan.min_block_m == plan.max_block_m == 32


def test_prefill_only_spec_has_no_decode_plan():
    plan = lower(spec(kernels=["prefill"]))
    assert plan.decode is None and plan.prefill is not None
    assert "prefill" in plan.summary() and "decode" not in plan.summary()


def test_prefill_plan_splits_qk_into_pow2_parts():
    plan = lower(spec(kernels=["decode", "prefill"])).prefill
    assert (plan.dn_pad, plan.dr_pad, plan.dv_pad) == (128, 64, 128)  # qk 192 = 128 + 64, v stays 128
    assert plan.default in plan.space and plan.interpreter.block_m == plan.interpreter.block_n == 16


@given(
    dn=st.integers(1, 16).map(lambda k: 16 * k),
    dr=st.integers(1, 8).map(lambda k: 16 * k),
    dv=st.integers(1, 16).map(lambda k: 16 * k),
)
def test_prefill_padding_is_pow2_and_covers(dn, dr, dv):
    plan = lower(spec(qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=dv, kernels=["prefill"])).prefill
    for real, padded in ((dn, plan.dn_pad), (dr, plan.dr_pad), (dv, plan.dv_pad)):
        assert padded >= real and padded & (padded - 1) == 0 and padded < 2 * real
    assert plan.space and plan.space == tuple(sorted(plan.space)) and plan.default in plan.space


def test_prefill_smem_model_matches_what_triton_refused():
    """Triton 3.6 on an H100 asked for these many bytes for qk 128+64 / v 128 (2026-11-22)."""
    from mlagen_compiler.plan import PrefillConfig

    limit = ARCH_BUDGETS["sm90"].smem_bytes
    for config, asked in (((128, 64, 8, 4), 245760), ((128, 128, 8, 2), 245760), ((128, 128, 8, 3), 327680)):
        assert prefill_smem_bytes(PrefillConfig(*config), 128, 64, 128) == asked > limit
    assert prefill_smem_bytes(PrefillConfig(128, 64, 8, 3), 128, 64, 128) <= limit


def test_prefill_overrides_pin_the_space():
    tiles = {"prefill": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}}
    plan = lower(spec(kernels=["prefill"], tiles=tiles)).prefill
    assert [c.as_tuple() for c in plan.space] == [(64, 32, 4, 2)] and plan.default.as_tuple() == (64, 32, 4, 2)


def test_decode_only_spec_has_no_prefill_plan():
    plan = lower(spec(kernels=["decode"]))
    assert plan.prefill is None and plan.decode is not None
    assert "decode" in plan.summary() and "prefill" not in plan.summary()


def test_combine_steps_of_the_small_batches_tiles_hold_twice_the_runs():
    # 4096 fp32 elements a step, 8192 for tiles of at most two rows, 2 to 128 runs
    assert [combine_step_runs(tile) for tile in [(16, 128), (8, 128), (4, 128), (2, 64), (1, 64)]] == [2, 4, 8, 64, 128]
    assert combine_step_runs((1, 32)) == 128  # at most 128 runs a step
    assert combine_step_runs((16, 256)) == 2  # at least 2
