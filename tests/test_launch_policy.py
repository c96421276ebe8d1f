"""The launch policy (mlagen_compiler/launch_policy.py): plain functions on numbers, tested without kernels,
and imported by every generated module."""

import pytest

from mlagen_compiler import launch_policy as lp
from mlagen_compiler.module_file import module_source
from mlagen_compiler.spec import spec_from_dict

GLUON_OK = dict(eligible=True, ineligible_reason="", gluon_error="", interpreting=False, capability=(9, 0))


def test_backend_auto_takes_gluon_where_it_runs_and_pays():
    select = lp.select_decode_backend
    assert select("auto", **GLUON_OK) == ("gluon", "")
    assert select("gluon", **GLUON_OK) == ("gluon", "")
    assert select("triton", **GLUON_OK) == ("triton", "MLAGEN_DECODE_BACKEND=triton")
    assert select("auto", **GLUON_OK, knobs_given=True) == (
        "triton",
        "config or block_m given: knobs of the portable kernel",
    )
    assert select("auto", **GLUON_OK, total_rows=16, latency_rows=16) == (
        "triton",
        "latency regime: 16 query rows in all",
    )
    assert select("auto", **GLUON_OK, total_rows=17, latency_rows=16) == ("gluon", "")
    # forced, the knobs and the latency regime do not overrule the caller
    assert select("gluon", **GLUON_OK, knobs_given=True, total_rows=1, latency_rows=16) == ("gluon", "")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (dict(capability=(8, 0)), "compute capability 8.0: the Gluon decode is built for 9.x (Hopper)"),
        (dict(capability=(10, 0)), "compute capability 10.0"),
        (dict(capability=None), "not a CUDA device"),
        (dict(interpreting=True), "TRITON_INTERPRET=1: Triton's interpreter cannot run Gluon kernels"),
        (dict(gluon_error="triton 3.9.0 is not a release"), "triton 3.9.0 is not a release"),
        (dict(eligible=False, ineligible_reason="Dc 1024"), "geometry not taken by the Gluon decode: Dc 1024"),
    ],
)
def test_backend_falls_back_with_the_reason_or_refuses_when_forced(change, words):
    backend, reason = lp.select_decode_backend("auto", **{**GLUON_OK, **change})
    assert backend == "triton" and words in reason
    with pytest.raises(ValueError, match=f"^MLAGEN_DECODE_BACKEND: 'gluon' cannot run here: .*{words[:20]}"):
        lp.select_decode_backend("gluon", **{**GLUON_OK, **change})


def test_backend_name_is_checked():
    with pytest.raises(ValueError, match="^MLAGEN_DECODE_BACKEND: expected auto, gluon or triton, got 'cuda'$"):
        lp.select_decode_backend("cuda", **GLUON_OK)


ROWS = dict(min_block_m=16, max_block_m=64, small_batch=8, small_block_m=16)


@pytest.mark.parametrize(
    ("rows", "batch", "expected"),
    [
        (16, 128, (16, False)),
        (40, 128, (64, False)),  # padded to a power of two
        (128, 128, (64, False)),  # clamped: two row blocks
        (8, 128, (16, False)),  # at least the smallest dot
        (64, 8, (16, True)),  # latency regime: short blocks spread few sequences
        (128, 1, (64, True)),  # more rows than one tall block: the tall block stays
        (64, 9, (64, False)),
    ],
)
def test_row_block(rows, batch, expected):
    assert lp.decode_row_block(None, rows, batch, **ROWS) == expected
    assert lp.decode_row_block(32, rows, batch, **ROWS) == (32, expected[1])  # the caller's block_m wins


def test_split_runs():
    assert lp.decode_num_parts(None, sm_count=132, parts_per_sm=2, row_blocks=2) == 132
    assert lp.decode_num_parts(None, sm_count=132, parts_per_sm=1, row_blocks=200) == 1
    assert lp.decode_num_parts(7, sm_count=132, parts_per_sm=2, row_blocks=2) == 7
    for bad in (0, -1, 10**8, True, 1.5, "4"):
        with pytest.raises(ValueError, match=rf"^num_parts: must be an int in 1\.\.65535, got {bad!r}$"):
            lp.decode_num_parts(bad, sm_count=132, parts_per_sm=2, row_blocks=2)


@pytest.mark.parametrize(
    "batch, row_blocks, expected",
    [
        (128, 1, 128),  # one run per sequence fills 128 of 132 SMs: no split
        (64, 1, 128),  # two runs per sequence
        (32, 2, 64),  # two row blocks: 2 runs x 32 sequences x 2 = 128 programs
        (120, 1, 120),  # 120 of 132 (0.91)
        (90, 1, 132),  # one run per sequence would leave 42 SMs idle: the balanced count
        (128, 2, 66),  # more than a wave of whole sequences: balanced
        (128, 4, 33),
        (1, 1, 132),  # 132 runs of one sequence either way
        (2, 2, 66),
    ],
)
def test_split_runs_aligned_with_sequences(batch, row_blocks, expected):
    got = lp.decode_num_parts(
        None, sm_count=132, parts_per_sm=1, row_blocks=row_blocks, batch_size=batch, align_runs=True
    )
    assert got == expected
    assert got * row_blocks <= 132  # one wave
    if got % batch == 0:  # aligned: the wave's slots are busy enough
        assert got * row_blocks >= lp.ALIGNED_RUNS_MIN_OCCUPANCY * 132
    # the caller's count and align_runs=False keep their meaning
    assert lp.decode_num_parts(7, sm_count=132, parts_per_sm=1, row_blocks=row_blocks, batch_size=batch,
                               align_runs=True) == 7  # fmt: skip
    assert lp.decode_num_parts(None, sm_count=132, parts_per_sm=1, row_blocks=row_blocks, batch_size=batch) == max(
        1, 132 // row_blocks
    )


def test_fewest_blocks_per_run():
    table = {(64, 64): 5, (16, 32): 3}
    common = dict(small_block_m=16, cost_table=table)
    assert lp.decode_min_blocks_per_part(None, small=False, block_m=64, block_n=64, **common) == 5
    assert lp.decode_min_blocks_per_part(None, small=True, block_m=64, block_n=64, **common) == 5  # tall: cost rule
    assert lp.decode_min_blocks_per_part(None, small=True, block_m=16, block_n=32, **common) == 1  # short: fine
    assert lp.decode_min_blocks_per_part(None, small=False, block_m=32, block_n=64, **common) == 1  # not in table
    assert lp.decode_min_blocks_per_part(9, small=False, block_m=64, block_n=64, **common) == 9
    with pytest.raises(ValueError, match=r"^min_blocks_per_part: must be an int >= 1, got 0$"):
        lp.decode_min_blocks_per_part(0, small=False, block_m=64, block_n=64, **common)


@pytest.mark.parametrize("config", [(64, 8, 2), [16, 4, 1], (128, 16, 3)])
def test_config_accepted(config):
    assert lp.check_decode_config(config) == tuple(config)


@pytest.mark.parametrize(
    "config",
    [(64, 8), (48, 8, 2), (8, 4, 1), (64, 3, 2), (64, 8, 0), (64.0, 8, 2), None, "64", (512, 4, 2), (64, 4, 7),
     (True, 4, 2), (64, 4, True)],
)  # fmt: skip
def test_config_refused(config):
    with pytest.raises(ValueError, match=r"^config: expected \(block_n: a power of two in 16\.\.256"):
        lp.check_decode_config(config)


def test_tuned_config_device_then_family_then_fallback():
    table = {("sm90", "NVIDIA H100 80GB HBM3", "m16"): (32, 4, 3), ("sm90", "*", "m16"): (64, 8, 2)}
    assert lp.tuned_config(table, ("sm90", "NVIDIA H100 80GB HBM3"), "m16", None) == (32, 4, 3)
    assert lp.tuned_config(table, ("sm90", "NVIDIA H100 PCIe"), "m16", None) == (64, 8, 2)
    assert lp.tuned_config(table, ("sm80", "NVIDIA A100"), "m16", "default") == "default"
    assert lp.tuned_config(table, ("sm90", "NVIDIA H100 80GB HBM3"), "m64", "default") == "default"


def test_combine_tile_gives_every_sm_a_program_with_the_largest_tile():
    tiles = {(16, 128): 2, (8, 128): 4, (1, 64): 64}
    assert lp.combine_tile(128, 16, 512, 132, tiles) == ((16, 128), 2)  # 512 programs already
    assert lp.combine_tile(4, 16, 512, 132, tiles) == ((1, 64), 64)  # 4 * 16 * 8 = 512 only at the smallest
    assert lp.combine_tile(1, 1, 64, 132, tiles) == ((1, 64), 64)  # nothing fills the GPU: the smallest
    # small batches of several sequences (possibly skewed): among tiles giving every SM 1 to 16 programs, the
    # largest whose step holds twice a sequence's share of the runs, else the one with the most runs a step
    tiles = {(16, 128): 2, (8, 128): 4, (4, 128): 8, (2, 64): 32, (1, 64): 64}  # the shipped table
    small = dict(small_batch=8)
    assert lp.combine_tile(4, 64, 512, 132, tiles, num_parts=132, **small) == ((1, 64), 64)  # skewed Sq4
    assert lp.combine_tile(4, 64, 512, 132, tiles) == ((4, 128), 8)  # (not a small batch: the rule above)
    assert lp.combine_tile(4, 16, 512, 132, tiles, num_parts=132, **small) == ((1, 64), 64)  # skewed Sq1
    assert lp.combine_tile(8, 16, 512, 132, tiles, num_parts=128, **small) == ((2, 64), 32)  # B8 H16: share 32
    assert lp.combine_tile(8, 16, 512, 132, tiles, num_parts=132, **small) == ((1, 64), 64)  # share 33
    # B8 H128: (2, 64) would be 4096 programs; of those within 16 per SM, (4, 128) merges the most a step
    assert lp.combine_tile(8, 128, 512, 132, tiles, num_parts=64, **small) == ((4, 128), 8)
    assert lp.combine_tile(9, 128, 512, 132, tiles, num_parts=9999, **small) == ((16, 128), 2)  # not small
    # one sequence cannot be skewed: the largest tile giving every SM a program, as for large batches
    assert lp.combine_tile(1, 128, 512, 132, tiles, num_parts=66, **small) == ((2, 64), 32)
    assert lp.combine_tile(1, 16, 512, 132, tiles, num_parts=264, **small) == ((1, 64), 64)


def test_tile_loads():
    base = dict(enabled=True, page_size=64, block_n=64, page_stride=64 * 576, row_stride=576, width=576,
                block_m=64, q_tma_min_block_m=64, q_contiguous=True)  # fmt: skip
    assert lp.decode_tile_loads(**base) == (True, True)
    assert lp.decode_tile_loads(**{**base, "block_m": 16}) == (True, False)  # mma.sync reads q from registers
    assert lp.decode_tile_loads(**{**base, "q_contiguous": False}) == (True, False)
    assert lp.decode_tile_loads(**{**base, "page_size": 16}) == (False, False)  # a block spans pages
    assert lp.decode_tile_loads(**{**base, "row_stride": 640}) == (False, False)  # rows not dense
    assert lp.decode_tile_loads(**{**base, "enabled": False}) == (False, False)


def test_buckets_and_small_helpers():
    assert lp.decode_bucket(64) == "m64" and lp.decode_bucket(16, small=True) == "m16-small"
    assert [lp.next_pow2(v) for v in (1, 2, 3, 17, 576)] == [1, 2, 4, 32, 1024]
    assert [lp.cdiv(a, b) for a, b in ((0, 4), (1, 4), (8, 4), (9, 4))] == [0, 1, 2, 3]


def test_imported_by_generated_modules_not_copied():
    source = module_source(spec_from_dict(dict(name="policy", num_heads=4, kv_lora_rank=64, qk_rope_head_dim=16,
                                               qk_nope_head_dim=16, v_head_dim=16)))  # fmt: skip
    assert "from mlagen_compiler.launch_policy import " in source
    assert "def select_decode_backend(" not in source and "ENV_KNOBS = {" not in source
    module_globals = {"__name__": "policy_module"}
    exec(compile(source, "<policy>", "exec"), module_globals)
    assert module_globals["select_decode_backend"] is lp.select_decode_backend


def test_decode_merge_fuses_where_sequences_have_few_runs():
    gluon = dict(backend="gluon")
    assert lp.decode_merge("auto", batch_size=128, num_parts=132, **gluon) == "fused"
    assert lp.decode_merge("auto", batch_size=32, num_parts=128, **gluon) == "fused"
    assert lp.decode_merge("auto", batch_size=32, num_parts=129, **gluon) == "kernel"
    assert lp.decode_merge("auto", batch_size=1, num_parts=132, **gluon) == "kernel"
    # the narrow form (16 query rows as the MMAs' N) keeps the combine launch: faster on varied lengths
    assert lp.decode_merge("auto", batch_size=128, num_parts=128, narrow=16, **gluon) == "kernel"
    assert lp.decode_merge("fused", batch_size=128, num_parts=128, narrow=16, **gluon) == "fused"
    assert lp.decode_merge("auto", batch_size=128, num_parts=132, backend="triton") == "kernel"
    assert lp.decode_merge("fused", batch_size=1, num_parts=132, backend="triton") == "fused"
    assert lp.decode_merge("kernel", batch_size=128, num_parts=66, **gluon) == "kernel"
    with pytest.raises(ValueError, match="merge: expected auto, fused or kernel, got 'both'"):
        lp.decode_merge("both", batch_size=1, num_parts=1, **gluon)


def test_fp8_dots_in_float16_only_below_warpgroup_row_blocks():
    assert lp.fp8_dots_in_float16(16, wgmma_min_block_m=64) and lp.fp8_dots_in_float16(32, wgmma_min_block_m=64)
    assert not lp.fp8_dots_in_float16(64, wgmma_min_block_m=64)


def test_sequence_runs_for_small_batches_of_tall_rows_with_a_run_for_each_sequence():
    assert lp.decode_sequence_runs(4, 64, 8, tall_rows=True) is True
    assert lp.decode_sequence_runs(8, 8, 8, tall_rows=True) is True  # one run each fits
    assert lp.decode_sequence_runs(4, 64, 8, tall_rows=False) is False  # short rows: equal runs measured faster
    assert lp.decode_sequence_runs(1, 132, 8, tall_rows=True) is False  # one sequence: nothing to cross
    assert lp.decode_sequence_runs(9, 132, 8, tall_rows=True) is False  # beyond the small batches: equal runs
    assert lp.decode_sequence_runs(4, 3, 8, tall_rows=True) is False  # fewer runs than sequences


def test_partial_rows_in_the_output_dtype_for_the_portable_kernel_and_kept_in_l2_everywhere():
    assert lp.decode_partials_in_dtype("triton", 16) is True
    assert lp.decode_partials_in_dtype("triton", 1024) is True
    # a few query rows: float32, the precision FlashMLA's suite asks at h_q 1 (see decode_partials_in_dtype)
    assert lp.decode_partials_in_dtype("triton", 15) is False
    assert lp.decode_partials_in_dtype("triton", 1) is False
    assert lp.decode_partials_in_dtype("gluon", 16) is False  # its accumulator layout stores 2-byte pieces: slower
    # MLAGEN_DECODE_PARTIALS: either form asked for, on either backend
    assert lp.decode_partials_in_dtype("gluon", 16, "dtype") is True
    assert lp.decode_partials_in_dtype("triton", 1024, "float32") is False
    assert lp.decode_partials_in_dtype("triton", 1, "dtype") is True
    with pytest.raises(ValueError, match="^MLAGEN_DECODE_PARTIALS: expected auto, float32 or dtype, got 'half'$"):
        lp.decode_partials_in_dtype("triton", 16, "half")
    assert lp.decode_keep_partials() is True


def test_gluon_short_blocks_for_short_runs_of_tall_rows_unless_configured():
    common = dict(small_batch=8, config_given=False)
    assert lp.gluon_short_blocks(narrow=0, batch_size=1, num_parts=66, **common) is True  # B1 H128
    assert lp.gluon_short_blocks(narrow=0, batch_size=4, num_parts=132, **common) is True  # the skewed Sq4 batch
    assert lp.gluon_short_blocks(narrow=0, batch_size=8, num_parts=128, **common) is True  # 16 runs a sequence
    assert lp.gluon_short_blocks(narrow=0, batch_size=8, num_parts=64, **common) is False  # B8 H128: long runs
    assert lp.gluon_short_blocks(narrow=0, batch_size=9, num_parts=264, **common) is False  # not a small batch
    assert lp.gluon_short_blocks(narrow=16, batch_size=1, num_parts=66, **common) is False  # S^T: block as M
    assert lp.gluon_short_blocks(narrow=0, batch_size=1, num_parts=66, **{**common, "config_given": True}) is False


def test_gluon_long_blocks_for_two_row_blocks_of_large_batches_with_a_16_bit_cache_unless_configured():
    common = dict(
        narrow=0,
        batch_size=128,
        small_batch=8,
        fp8_cache=False,
        page_size=64,
        block_n=64,
        long_block_n=128,
        config_given=False,
    )
    assert lp.gluon_long_blocks(row_blocks=2, **common) is True  # Dc 256 H128, or H32 Sq4
    assert lp.gluon_long_blocks(row_blocks=4, **common) is True
    assert lp.gluon_long_blocks(row_blocks=1, **common) is False  # one row block: memory-bound, keeps its blocks
    assert lp.gluon_long_blocks(row_blocks=2, **{**common, "batch_size": 8}) is False  # the latency regime
    assert lp.gluon_long_blocks(row_blocks=2, **{**common, "batch_size": 9}) is True
    assert lp.gluon_long_blocks(row_blocks=2, **{**common, "long_block_n": 0}) is False  # Dc 512: none fit
    assert lp.gluon_long_blocks(row_blocks=2, **{**common, "fp8_cache": True}) is False
    assert lp.gluon_long_blocks(row_blocks=2, **{**common, "page_size": 32}) is False  # boxes under 64 rows
    assert lp.gluon_long_blocks(row_blocks=2, **{**common, "page_size": 128}) is True  # one box a block
    assert lp.gluon_long_blocks(row_blocks=2, **{**common, "narrow": 16}) is False
    assert lp.gluon_long_blocks(row_blocks=2, **{**common, "config_given": True}) is False


def test_gluon_land_ring_for_fp8_caches_of_one_row_block_where_two_slots_fit_unless_configured():
    common = dict(block_m=64, fp8_cache=True, page_size=64, block_n=64, ring_slots=2, config_given=False)
    assert lp.gluon_land_ring(query_rows=32, **common) is True  # Mistral-Small-4 (H32 Sq1): the tile's upper half
    assert lp.gluon_land_ring(query_rows=16, **common) is True  # the narrow form
    assert lp.gluon_land_ring(query_rows=64, **common) is True  # the query fills the tile (Mistral-Small-4 Sq2)
    assert lp.gluon_land_ring(query_rows=65, **common) is False  # two row blocks: the row-loading converter
    assert lp.gluon_land_ring(query_rows=32, **{**common, "ring_slots": 1}) is False  # Dc 512: no room
    assert lp.gluon_land_ring(query_rows=32, **{**common, "fp8_cache": False}) is False
    assert lp.gluon_land_ring(query_rows=32, **{**common, "page_size": 32}) is False  # blocks across pages
    assert lp.gluon_land_ring(query_rows=32, **{**common, "config_given": True}) is False


PLAN_BLOCK_SIZES = dict(
    block_m=64,
    block_n=64,
    short_block_n=32,
    short_stages=3,
    long_block_n=128,
    long_stages=2,
    land_rows=32,
    land_ring_slots=2,
    land_ring_stages=2,
)


def test_gluon_blocks_chooses_in_one_place_and_counts_long_runs_in_positions():
    tuned = (64, 168, 2)
    common = dict(
        fewest_blocks=5,
        sizes=PLAN_BLOCK_SIZES,
        narrow=0,
        small_batch=8,
        fp8_cache=False,
        page_size=64,
        config_given=False,
    )
    large = dict(common, batch_size=128, num_parts=132)
    # two row blocks of a large batch, 16-bit cache: long blocks, the cost rule's 320 positions in 128-blocks
    assert lp.gluon_blocks(tuned, query_rows=128, **large) == ((128, 168, 2), 3, 1)
    assert lp.gluon_blocks(tuned, query_rows=128, **{**large, "fewest_blocks": 1}) == ((128, 168, 2), 1, 1)
    assert lp.gluon_blocks(tuned, query_rows=64, **large) == (tuned, 5, 1)  # one row block keeps its blocks
    # short runs of a small batch: short blocks, counted in their own blocks (as measured)
    small = dict(common, batch_size=1, num_parts=66)
    assert lp.gluon_blocks(tuned, query_rows=128, **small) == ((32, 168, 3), 5, 1)
    # an fp8 cache: the landing ring in the query tile's lower half or beside a query that fills it, where it fits
    fp8 = dict(large, fp8_cache=True)
    for batch_size, num_parts in ((128, 132), (4, 32)):  # (4 sequences in 8 runs each: long runs)
        fp8.update(batch_size=batch_size, num_parts=num_parts)
        assert lp.gluon_blocks(tuned, query_rows=32, **fp8) == ((64, 168, 2), 5, 2)
        assert lp.gluon_blocks(tuned, query_rows=64, **fp8) == ((64, 168, 2), 5, 2)
        # Dc 512 (no ring): the tuned blocks (one landing in the query tile's lower half, or rows loaded), in the
        # latency regime's short blocks where the runs are short
        no_ring = {**PLAN_BLOCK_SIZES, "land_ring_slots": 1}
        assert lp.gluon_blocks(tuned, query_rows=64, **{**fp8, "sizes": no_ring}) == (tuned, 5, 1)
        assert lp.gluon_blocks(tuned, query_rows=32, **{**fp8, "sizes": no_ring}) == (tuned, 5, 1)
        assert lp.gluon_blocks(tuned, query_rows=128, **fp8) == (tuned, 5, 1)  # rows loaded
    short_runs = dict(fp8, batch_size=1, num_parts=66)
    assert lp.gluon_blocks(tuned, query_rows=128, **short_runs) == ((32, 168, 3), 5, 1)  # B1 H128
    assert lp.gluon_blocks(tuned, query_rows=64, **{**short_runs, "sizes": no_ring}) == ((32, 168, 3), 5, 1)
    assert lp.gluon_blocks(tuned, query_rows=64, **short_runs) == ((64, 168, 2), 5, 2)  # the ring first
    # a query in the tile's upper half lands its 64-position blocks in the lower half, short runs or not
    assert lp.gluon_blocks(tuned, query_rows=32, **{**short_runs, "sizes": no_ring}) == (tuned, 5, 1)
    # a configuration given by the caller is run as given
    given = (64, 200, 2)
    for kwargs in (large, small, fp8):
        assert lp.gluon_blocks(given, query_rows=128, **{**kwargs, "config_given": True}) == (given, 5, 1)


def test_combine_step_runs_fewer_for_two_warp_programs_in_crowded_grids():
    # the skewed Sq4 batch: (1, 64), 2048 programs of 2 warps: 64 runs a step (45.4 against 47.1 us with 128)
    assert lp.combine_step_runs_for_warps(128, (1, 64), 2, 2048, 132) == 64
    # B8 H16 and B1 H128: (2, 64), 512 programs (under 8 an SM): the tile's 64 (B1 H128: 22.5-22.8 with 32)
    assert lp.combine_step_runs_for_warps(64, (2, 64), 2, 512, 132) == 64
    assert lp.combine_step_runs_for_warps(64, (2, 64), 2, 1056, 132) == 32  # 8 an SM: at most 64 fp32 a thread
    assert lp.combine_step_runs_for_warps(8, (4, 128), 2, 1024, 132) == 8  # B8 H128: 64 a thread already
    assert lp.combine_step_runs_for_warps(128, (1, 64), 4, 2048, 132) == 128  # 4 warps: 64 a thread already
    assert lp.combine_step_runs_for_warps(2, (16, 128), 4, 4096, 132) == 2  # large tiles keep theirs
    assert lp.combine_step_runs_for_warps(2, (64, 128), 2, 4096, 132) == 2  # never fewer than 2


def test_combine_warps_two_for_small_tiles_in_more_than_a_wave_of_programs():
    assert lp.combine_warps((1, 64), 2048, 132) == 2  # the skewed Sq4 batch: 46.0 against 47.2 us with 4
    assert lp.combine_warps((4, 128), 1024, 132) == 2  # B8 H128: 57.0 against 63.1 us
    assert lp.combine_warps((1, 64), 128, 132) == 4  # B1 H16: one wave, no gain measured
    assert lp.combine_warps((8, 128), 4096, 132) == 4  # large tiles keep their tuning
    assert lp.combine_warps((16, 128), 4096, 132) == 4


def test_decode_pdl_only_for_a_combine_launch_on_hopper_or_later():
    hopper = dict(capability=(9, 0), interpreting=False)
    assert lp.decode_pdl(None, merge="kernel", **hopper) is True
    assert lp.decode_pdl(True, merge="kernel", capability=(10, 0), interpreting=False) is True
    assert lp.decode_pdl(False, merge="kernel", **hopper) is False  # asked off
    assert lp.decode_pdl(None, merge="fused", **hopper) is False  # one launch: nothing depends on it
    assert lp.decode_pdl(True, merge="fused", **hopper) is False
    assert lp.decode_pdl(True, merge="kernel", capability=(8, 0), interpreting=False) is False  # before Hopper
    assert lp.decode_pdl(True, merge="kernel", capability=None, interpreting=False) is False  # not CUDA
    assert lp.decode_pdl(True, merge="kernel", capability=(9, 0), interpreting=True) is False
    with pytest.raises(ValueError, match="^pdl: expected None, True or False, got 'yes'$"):
        lp.decode_pdl("yes", merge="kernel", **hopper)


def test_gluon_narrow_form_up_to_its_row_limit():
    # query rows as the MMAs' N: 16 wide up to 16 rows, 32 up to 32, never past the plan's limit
    assert [lp.gluon_narrow_rows(rows, 32) for rows in (1, 15, 16, 17, 32, 33, 64)] == [16, 16, 16, 32, 32, 0, 0]
    assert lp.gluon_narrow_rows(16, 16) == 16 and lp.gluon_narrow_rows(17, 16) == 0
    assert lp.gluon_narrow_rows(1, 0) == 0  # off


def test_gluon_narrow_limit_is_wider_in_large_batches():
    limit = [lp.gluon_narrow_limit(16, 32, batch_size=b, large_batch=64) for b in (1, 8, 32, 63, 64, 128)]
    assert limit == [16, 16, 16, 16, 32, 32]
    assert lp.gluon_narrow_limit(16, 16, batch_size=128, large_batch=64) == 16  # (an fp8 cache's plan)


def test_gluon_small_narrow_batches_take_half_the_sms_and_short_runs():
    common = dict(small_batch=8, min_blocks_per_part=5, fp8_cache=False)
    assert lp.gluon_small_batch_schedule(132, narrow=16, batch_size=1, **common) == (66, 1)
    # an fp8 cache's landing producer needs every SM (short runs all the same)
    assert lp.gluon_small_batch_schedule(132, narrow=16, batch_size=1, **{**common, "fp8_cache": True}) == (132, 1)
    assert lp.gluon_small_batch_schedule(132, narrow=16, batch_size=9, **{**common, "fp8_cache": True}) == (132, 5)
    assert lp.gluon_small_batch_schedule(132, narrow=16, batch_size=8, **common) == (66, 1)
    # a larger batch, or rows as the MMAs' M (narrow 0): every SM and the cost rule
    assert lp.gluon_small_batch_schedule(132, narrow=16, batch_size=9, **common) == (132, 5)
    assert lp.gluon_small_batch_schedule(132, narrow=0, batch_size=1, **common) == (132, 5)
    assert lp.gluon_small_batch_schedule(1, narrow=16, batch_size=1, **common) == (1, 1)
    # the slots then go through decode_num_parts: aligned runs for B8 (8 a sequence), balanced for B4 skewed
    slots, _ = lp.gluon_small_batch_schedule(132, narrow=16, batch_size=8, **common)
    assert lp.decode_num_parts(None, sm_count=slots, parts_per_sm=1, row_blocks=1, batch_size=8, align_runs=True) == 64


def test_prefill_sections_fit_the_l2_share():
    mib = 2**20
    # 16 heads of 4096 keys at 512 bytes a key: 2 MiB a pair; half of a 50 MiB L2 holds 12 pairs: 2 sections
    assert lp.prefill_sections(16, 4096, 512, 50 * mib) == 2
    # everything fits: one section
    assert lp.prefill_sections(16, 1024, 512, 50 * mib) == 1
    # a pair larger than the share: one pair a section
    assert lp.prefill_sections(128, 131072, 512, 50 * mib) == 128
    for pairs in (1, 7, 21, 64, 129, 512):
        for keys in (1, 300, 8192, 32768):
            sections = lp.prefill_sections(pairs, keys, 512, 50 * mib)
            assert 1 <= sections <= pairs
            largest = -(-pairs // sections)  # sections hold pairs // sections or one more
            assert largest * keys * 512 <= 25 * mib or largest == 1
