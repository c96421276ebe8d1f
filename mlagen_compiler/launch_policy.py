"""Launch policy of the generated wrappers: which decode backend, how many query rows per program, how the
cache is split into runs, which tile configuration, which combine tile, whether tiles come through TMA.

Plain Python on numbers (no torch, no triton, standard library only): unit-tested on its own
(tests/test_launch_policy.py) and imported by every generated module (with mlagen_compiler.runtime), whose
wrappers only gather facts (shapes, strides, SM count, capability), call these functions and launch. Tables
(autotune spaces, defaults, tuned configurations) come from the plan and are passed in as arguments.
"""

# the environment variables a generated module reads, and their check, live in mlagen_compiler.options (the one
# reader of them, `Options.from_env`); re-exported here for callers that knew them here
from .options import ENV_KNOBS as ENV_KNOBS
from .options import env_knob as env_knob

#: decode backends a module may run, in order of preference
DECODE_BACKENDS = ("gluon", "triton")
#: the most split-KV runs one launch takes: the CUDA grid's second dimension
MAX_NUM_PARTS = 65535
#: how sequences split over several runs are merged: by the runs themselves in the one launch, or by a
#: second (combine) launch
DECODE_MERGES = ("fused", "kernel")


def _policy_error(name, message):
    return ValueError(f"{name}: {message}")


def next_pow2(value):
    return 1 << max(0, (int(value) - 1).bit_length())


def cdiv(a, b):
    return -(-a // b)


def select_decode_backend(
    requested,
    *,
    eligible,
    ineligible_reason,
    gluon_error,
    interpreting,
    capability,
    knobs_given=False,
    total_rows=None,
    latency_rows=0,
    name="MLAGEN_DECODE_BACKEND",
):
    """(backend, reason): "gluon" where it can run and pays, else "triton" with the reason.

    requested: "auto", "gluon" or "triton" (MLAGEN_DECODE_BACKEND or the call's backend=, named by `name` in
    an error); forcing "gluon" where it cannot run is an error naming why. eligible / ineligible_reason: the
    plan's geometry decision; gluon_error: '' or why the installed Triton's Gluon cannot be used; capability:
    (major, minor) of the CUDA device, or None off CUDA. "auto" also keeps the portable kernel when its knobs are given
    (knobs_given) or the whole batch has at most latency_rows query rows (B * H * Sq): measured on the
    H100 (S=8192, graph-replayed), B=1, H=16 ran 13.9 us portable against 21.9 us Gluon, B=8 47.7 Gluon
    against 58.8 us; with the Gluon kernel's narrow form (2026-11-25) B=1 13.3 against 16.2, B=8 39.5 Gluon
    against 58.8; with gluon_small_batch_schedule B=1 13.3-13.4 portable against 12.6-12.7 Gluon (bf16), and
    15.5-15.6 against 16.2-21.6 with an fp8 cache: too close to move the rule.
    """
    if requested not in ("auto",) + DECODE_BACKENDS:
        raise _policy_error(name, f"expected auto, gluon or triton, got {requested!r}")
    if requested == "triton":
        return "triton", "MLAGEN_DECODE_BACKEND=triton"
    if not eligible:
        why = f"geometry not taken by the Gluon decode: {ineligible_reason}"
    elif gluon_error:
        why = gluon_error
    elif interpreting:
        why = "TRITON_INTERPRET=1: Triton's interpreter cannot run Gluon kernels"
    elif capability is None:
        why = "not a CUDA device"
    elif capability[0] != 9:
        why = f"compute capability {capability[0]}.{capability[1]}: the Gluon decode is built for 9.x (Hopper)"
    elif requested == "auto" and knobs_given:
        return "triton", "config or block_m given: knobs of the portable kernel"
    elif requested == "auto" and total_rows is not None and total_rows <= latency_rows:
        return "triton", f"latency regime: {total_rows} query rows in all"
    else:
        return "gluon", ""
    if requested == "gluon":
        raise _policy_error(name, f"'gluon' cannot run here: {why}")
    return "triton", why


def decode_merge(requested, *, backend, batch_size, num_parts, narrow=0, name="merge"):
    """How split sequences are merged: "fused" or "kernel" as requested (MLAGEN_DECODE_MERGE or the call's
    merge=, named by `name` in the error), or for "auto": "fused" for the Gluon backend with query rows as the
    MMAs' M (narrow = 0) where sequences average at most about five runs (num_parts <= 4 * batch), else "kernel".

    Measured on the H100 (bf16, S=8192, 2026-11-22), fused against the combine launch. Gluon: H128 B32 (p66)
    182 against 215 us, H64 B128 479 / 495, H32 B128 Sq2 479 / 496, H128 B128 553 / 570, Mistral-Small-4
    264 / 268, H16 B128 452 / 447 (the one loss, 1.2%). Small batches lose: B1 H16 graph-replayed 43-51
    against 14-22 us (a 128-run sequence merged up the tree by one program a level), the skewed B4 batch
    84-104 against 54-68. The portable kernel's wide row blocks lose too (the merge adds registers to a
    kernel at its limit): Mistral-Small-4 360 against 260 us, H64 B128 692 / 642.

    Measured again on the H100 (2026-11-26, B128 lengths uniform in [S/2, 3S/2), two runs in one process each,
    bench_decode.py --merges fused,kernel): rows as M keep the fused merge (H64 S8192 bf16 483.4 against 491.1
    us, fp8 359.5 / 371.7; H128 B32 146.2 / 154.0); the narrow form (16 query rows) is faster with the combine
    launch, bf16 H16 S8192 441.8-442.0 against 448.4-448.9 us, S4096 244.5-244.6 / 248.5-249.0, fp8 275.7-276.1 /
    283.2-284.1 and 173.7-173.9 / 179.8-180.4; with equal lengths (no sequence split at S8192) it costs 0.3-0.6%
    (bf16 413.7-413.9 against 412.6-412.8, fp8 237.2-237.5 / 235.8-236.1), at S32768 B64 it is level or ahead
    (814.0-814.5 / 816.0-816.4, fp8 446.5-446.7 / 449.4-449.9).
    """
    if requested == "auto":
        return "fused" if backend == "gluon" and not narrow and num_parts <= 4 * batch_size else "kernel"
    if requested not in DECODE_MERGES:
        raise _policy_error(name, f"expected auto, fused or kernel, got {requested!r}")
    return requested


def decode_pdl(requested, *, merge, capability, interpreting):
    """Whether the combine launch (merge "kernel") is a programmatic dependent launch of the split launch:
    its programs start while the split launch runs and wait (griddepcontrol.wait) for it to end before
    reading its partial rows, so the gap between the two launches is hidden (also inside a CUDA graph).
    requested: None (the default: wherever it can run) or a bool (MLAGEN_DECODE_PDL or the call's pdl=);
    never without a combine launch, under the interpreter, or before compute capability 9 (Hopper).
    """
    if requested not in (None, True, False):
        raise _policy_error("pdl", f"expected None, True or False, got {requested!r}")
    if merge != "kernel" or interpreting or capability is None or capability[0] < 9:
        return False
    return requested is not False


#: the tuned-configuration bucket of the Gluon (Hopper) decode: one for every batch it takes
DECODE_GLUON_BUCKET = "gluon"


def decode_bucket(block_m, small=False):
    """The key that tuned decode configurations are recorded under (small: the latency regime)."""
    return f"m{block_m}-small" if small else f"m{block_m}"


def decode_row_block(block_m, rows, batch_size, *, min_block_m, max_block_m, small_batch, small_block_m):
    """(block_m, small): query rows per program of the portable kernel for H * Sq = rows (the caller's
    block_m if given) and whether the batch is in the latency regime (tuned under its own buckets).

    Rows are padded to a power of two within [min_block_m, max_block_m]. In the latency regime (at most
    small_batch sequences) rows that fit one tall block go in short blocks instead: more programs, each
    on the cheaper mma.sync path, spread the few sequences over the GPU.
    """
    small = batch_size <= small_batch
    if block_m is None:
        block_m = min(max_block_m, max(min_block_m, next_pow2(rows)))
        if small and rows <= max_block_m:
            block_m = small_block_m
    return block_m, small


#: aligned runs (decode_num_parts) are taken where they keep at least this share of a wave's program slots
ALIGNED_RUNS_MIN_OCCUPANCY = 0.9


def decode_num_parts(num_parts, *, sm_count, parts_per_sm, row_blocks, batch_size=None, align_runs=False):
    """Split-KV runs: the caller's, else parts_per_sm programs per SM over the row blocks; checked.

    align_runs (with batch_size): k runs per sequence instead, k * batch_size runs for the largest k whose
    programs fit one wave, where they keep at least ALIGNED_RUNS_MIN_OCCUPANCY of its slots busy. The
    runs split the batch's blocks equally, so with equal lengths each run is one piece of one sequence:
    no run pays for a second query tile and partial result, and no sequence is split when k = 1. Measured
    on the H100 (Gluon, bf16, S=8192, 2026-11-23; gluon_tune.py --parts), aligned against balanced
    (SMs / row blocks): H16 B128 411-413 against 439-446 us, H64 B128 420 / 475, Mistral-Small-4 H32
    B128 234-235 / 256, H16 B64 S32768 812-814 / 825-842 (k = 2), H128 B32 152 / 175-181 (k = 2); lengths
    uniform in [S/2, 3S/2): H16 B128 455-465 / 455-464, H128 B32 177-186 / 175-184. Batches of more than a
    wave keep the balanced count: whole sequences over two or four waves measured 539-564 against 556-561
    us (H128 B128) and 1064 against 1031 (H128 B128 Sq2).
    """
    if num_parts is None:
        slots = sm_count * parts_per_sm
        num_parts = max(1, slots // row_blocks)
        if align_runs and batch_size:
            per_sequence = slots // (batch_size * row_blocks)
            if per_sequence >= 1 and per_sequence * batch_size * row_blocks >= ALIGNED_RUNS_MIN_OCCUPANCY * slots:
                num_parts = per_sequence * batch_size
    if not (isinstance(num_parts, int) and not isinstance(num_parts, bool) and 1 <= num_parts <= MAX_NUM_PARTS):
        raise _policy_error("num_parts", f"must be an int in 1..{MAX_NUM_PARTS}, got {num_parts!r}")
    return num_parts


def decode_sequence_runs(batch_size, num_parts, small_batch, *, tall_rows):
    """Whether no split-KV run may cross the end of a sequence (the kernels' SEQUENCE_RUNS, see
    _split_schedule): for batches of 2 to small_batch sequences, given at least one run per sequence, where
    a program's rows are tall (tall_rows: the Gluon kernel with query rows as the MMAs' M).

    Equal runs cut across the batch make the runs that straddle two sequences the slowest: they load a
    second query tile and write a second partial result, which costs most with tall rows (a 74 KB query
    tile and 128 KB of fp32 partial rows at Dc 512). Measured on the H100 (2026-11-25, graph replay, bf16,
    latency_probe.py --runs): lengths [4641, 45118, 1730, 1696] at H16 Sq4 (64 rows as M) 54.8-55.0 us
    against 61.6-61.9, B8 H128 (equal lengths: the same runs) 65.1-66.1 against 65.3
    (latency_runs_final_h100_2026-11-25.log). Left out, measured with a first version that searched for
    per_part in a loop (latency_runs_h100_2026-11-25.log): the same batch at Sq1 (narrow form, 16 rows)
    36.5-36.8 against 36.7-37.0, B8 H16 40.9-41.1 against 39.7-39.8, and the portable kernel (16-row
    blocks; its runs grow by a block) at Sq4 124.2-124.5 against 117.9-118.9.
    """
    return tall_rows and 2 <= batch_size <= small_batch and num_parts >= batch_size


#: fewest query rows (Sq * H) a sequence for which the portable kernel stores partial rows in the output's dtype
PARTIALS_IN_DTYPE_MIN_ROWS = 16


def decode_partials_in_dtype(backend, query_rows):
    """Whether split sequences' partial rows (normalised outputs of a run) are stored in the output's dtype
    instead of float32: half the bytes the split kernel writes and the merge reads back, but each partial row
    then carries one rounding to the output's dtype before the merge.

    The portable kernel with at least PARTIALS_IN_DTYPE_MIN_ROWS query rows: there the bytes show in the latency
    of small batches (B1 H16 S8192, graph replay: 11.3 us against 11.7-11.9 with float32 partials on the H200).
    Fewer rows: float32, FlashMLA's choice. With 16-bit partials FlashMLA's own dense-decoding suite failed its
    output tolerance at h_q 1 (one query row; b 1, s_k 4096, split into many runs): cosine difference 5.0-5.3e-6
    against 5e-6. A statistic over so few elements needs the output rounded once, and float32 partials of a
    few rows cost nothing measurable. The Gluon kernel: float32 (16-bit partials measured slower: its MMA
    accumulator stores 2-byte pieces). Measurements: docs/performance-log.md ("16-bit partial rows",
    "FlashMLA drop-in").
    """
    return backend == "triton" and query_rows >= PARTIALS_IN_DTYPE_MIN_ROWS


def decode_keep_partials():
    """Whether the split kernels store partial rows with an L2 evict-last hint and the combine reads them
    evict-first: the cache blocks streamed after a partial row was written could otherwise push it out of
    L2 before the combine reads it back. Measured on the H100 (2026-11-25, graph replay, bf16,
    latency_probe.py --keep), with the hints against without: the skewed [4641, 45118, 1730, 1696] H16 Sq4
    batch 51.2 / 51.2 against 52.9 / 52.7 us, Sq1 35.0 / 34.7 against 36.0 / 35.7, B8 H16 39.0 / 38.9 against
    39.7 / 39.5, B8 H128 64.4 / 64.6 against 65.0 / 65.2, B1 H128 24.1 both, B1 H16 (portable) 11.5 / 11.5
    against 11.3 / 11.5. The time saved is the split kernel's (its stores), not the combine's.
    """
    return True


def decode_min_blocks_per_part(min_blocks_per_part, *, small, block_m, small_block_m, block_n, cost_table):
    """Fewest cache blocks per run: the caller's, else the plan's cost rule (cost_table[(block_m, block_n)]).

    Short row blocks in the latency regime take one block a run (B=1, H=16 on the H100: 13.8 us at one
    block a run, 15.4 us at two); tall blocks keep the cost rule (B=1, H=128: 38 us at 5, 63 us at 1).
    """
    if min_blocks_per_part is None:
        fine = small and block_m == small_block_m
        min_blocks_per_part = 1 if fine else cost_table.get((block_m, block_n), 1)
    if not (
        isinstance(min_blocks_per_part, int) and not isinstance(min_blocks_per_part, bool) and min_blocks_per_part >= 1
    ):
        raise _policy_error("min_blocks_per_part", f"must be an int >= 1, got {min_blocks_per_part!r}")
    return min_blocks_per_part


def gluon_narrow_rows(query_rows, narrow_rows):
    """N of the Gluon decode's narrow form for Sq * H = query_rows: the MMAs take the query rows as their N,
    padded to 16 or 32 (a multiple of 16: one K step of P^T), where query_rows <= narrow_rows; else 0 (rows as
    the MMAs' M, padded to 64)."""
    if query_rows > narrow_rows:
        return 0
    return 16 if query_rows <= 16 else 32


def gluon_small_batch_schedule(sm_count, *, narrow, batch_size, small_batch, min_blocks_per_part, fp8_cache):
    """(program slots, fewest cache blocks a run) of a Gluon launch: every SM and the plan's cost rule, but
    for a small batch (at most small_batch sequences) in the narrow form (narrow: its width, 0 where rows are
    the MMAs' M) runs as short as one block, on half the SMs with a 16-bit cache. Such a launch reads a
    16-bit cache no faster with more programs, and every run adds a partial result for the combine to read;
    an fp8 cache keeps every SM (below).

    Measured on the H100 (bf16, 2026-11-25, graph-replayed; latency_probe.py --parts, bench_decode.py):
    lengths [4641, 45118, 1730, 1696] H16 Sq1 36.4-36.7 us at 64-66 runs against 38.3-38.9 at 132 (combine
    3.8 against 5.5), B8 H16 39.9-40.2 at 64 against 39.9 at 128, B1 H16 12.6-13.3 at 66 runs of one or two
    blocks against 16.2 at 132 with the cost rule's five (26 runs). Left out: rows as M (Sq4 of that batch:
    57.7 at 66 against 61.7, but B8 H128 and other compute-bound small batches need every SM), and an fp8
    cache, whose landing producer keeps one block in flight a program (B8 H16 46.2 against 33.1 us, the
    skewed batch 47.8 against 36.1). With an fp8 cache every SM, runs as short as one block (H100, 2026-11-26,
    fp8, graph-replayed, latency_probe.py, latency_fp8_small_sweep_h100_2026-11-26.log): B8 H16 at bench_hf.py's
    lengths (266-520) 16.4 us against 27.4 with the cost rule's five blocks, S2048 17.1 against 26.8, S8192
    33.3 against 33.0-33.5 (128 runs of 8 blocks either way).
    """
    if narrow and batch_size <= small_batch:
        return (sm_count if fp8_cache else max(1, sm_count // 2)), 1
    return sm_count, min_blocks_per_part


#: gluon_short_blocks: the fewest split-KV runs a sequence averages (num_parts / batch) for short blocks
SHORT_BLOCK_RUNS = 16


def gluon_short_blocks(*, narrow, batch_size, num_parts, small_batch, config_given):
    """Whether a Gluon launch streams the cache in the plan's short blocks (32 positions, a ring of 3 stages:
    less shared memory than 64 x 2) instead of its tuned (block_n, stages): small batches (at most
    small_batch sequences) whose sequences average at least SHORT_BLOCK_RUNS runs (num_parts / batch: short
    runs, whose first and last blocks' waits are most of their time), with rows as the MMAs' M (narrow = 0;
    the narrow form's S^T takes the block as its M, at least 64), no configuration given. A short block frees
    its stage after half the work, so more of the cache is in flight a program. An fp8 cache takes them where
    its rows are loaded by the converting warps (gluon_blocks chooses the landing ring first).

    Measured on the H100 (bf16, 2026-11-25, graph-replayed, short against tuned blocks in turn, every result
    checked; latency_probe.py --blocks): lengths [4641, 45118, 1730, 1696] H16 Sq4 (132 runs) 48.5-48.9 us
    against 50.8-50.9, B1 H128 S8192 (66 runs) 22.8 against 24.0-24.2; but B8 H128 S8192 (64 runs, 8 a
    sequence: runs of 16 blocks) 67.7-68.8 against 64.0, and H128 B128 (compute-bound, 2026-11-23) 32 x 4
    657.9 against 549.9 us. The lengths are device data: runs a sequence are what the host knows of a run's
    length. With an fp8 cache (2026-11-26, rows loaded by the converter; latency_probe.py --cache fp8 --blocks):
    B1 H128 27.1-27.3 against 28.5-28.8, the Sq4 batch 44.2-44.6 against 46.1-46.3; B8 H128 72.8 against
    65.1-66.0 (not taken: runs of 16 blocks).
    """
    return not narrow and batch_size <= small_batch and num_parts >= SHORT_BLOCK_RUNS * batch_size and not config_given


def gluon_long_blocks(
    *, row_blocks, narrow, batch_size, small_batch, fp8_cache, page_size, block_n, long_block_n, config_given
):
    """Whether a Gluon launch streams the cache in the plan's long blocks (long_block_n positions, 128: Q K^T as
    m64n128 warpgroup MMAs, fewer and better-fed than m64n64) instead of its tuned (block_n, stages): two or more
    row blocks of query rows (rows as the MMAs' M, narrow = 0: the compute-bound launches), more than small_batch
    sequences (the latency regime keeps its runs of 64-position blocks), a 16-bit cache (an fp8 cache has no
    room left for its landing zone), pages of at least block_n positions (a long block is then block_n-row TMA
    boxes, one per page it spans), no configuration given, and long blocks that fit (long_block_n > 0: Dc <= 256
    beside 64 query rows; not Dc 512).

    Measured on the H100 (2026-11-26, bf16 Dc 256 B128 S8192, every result checked; benchmarks/block_n_probe.py):
    H128 (two row blocks) 305.8 us against 337.2 with the tuned 64-position blocks; with one row block (H64,
    memory-bound) 246.0 against 243.7, so one row block keeps its blocks.
    """
    return (
        long_block_n > 0
        and not narrow
        and row_blocks >= 2
        and batch_size > small_batch
        and not fp8_cache
        and page_size >= block_n
        and not config_given
    )


def gluon_land_ring(*, query_rows, block_m, fp8_cache, page_size, block_n, ring_slots, config_given):
    """Whether a Gluon launch with an fp8 cache and one row block of query rows (at most block_m) lands ring_slots
    blocks of block_n positions at a time in a ring of its own (the plan's land_ring_slots, beside its
    land_ring_stages 16-bit stages), whether the query takes the tile's upper half or all of it: where two or
    more slots fit beside the whole query tile (Dc 256), pages hold whole blocks, and no configuration is given.
    Otherwise one block lands at a time in the query tile's lower half where the query takes at most its upper
    half (the next block's boxes are then issued only once the block before has been converted out of the zone),
    and a query that fills the tile has its blocks' rows loaded by the converting warps. Measured on the H100
    (2026-11-26, fp8, Dc 256, B128 S8192, fp8_converter_variants.py; plan.LAND_RING_STAGES): Mistral-Small-4 (H32)
    169.3-169.5 us with 2 slots against 175.9-177.3 in the query tile's lower half (bf16 241.4-242.0); 64 query
    rows (H64) 184.0 against 237.2 landing apart in 32-position blocks (a form since dropped; bf16 243.6); 16 rows
    (the narrow form) 151.7 against 152.5.
    """
    return fp8_cache and ring_slots > 1 and query_rows <= block_m and page_size >= block_n and not config_given


def gluon_blocks(
    config,
    *,
    fewest_blocks,
    sizes,
    query_rows,
    narrow,
    batch_size,
    num_parts,
    small_batch,
    fp8_cache,
    page_size,
    config_given,
):
    """(config, fewest_blocks, land_slots) of a Gluon launch: the cache blocks it streams, as the one place that
    chooses among the tuned configuration (config: block_n, registers, stages), the short and long blocks and the
    fp8 landing ring (gluon_land_ring, gluon_short_blocks, gluon_long_blocks, in that order); the cost rule's
    fewest blocks a run (fewest_blocks, in the plan's block_n-position blocks) counted in the chosen blocks; how
    many fp8 blocks land at a time (land_slots; more than 1: the landing ring, a zone of its own beside the query
    tile, whether the query takes the tile's upper half or fills it).

    sizes: the plan's block sizes by name (block_m, block_n, short_block_n, short_stages, long_block_n,
    long_stages, land_rows, land_ring_slots, land_ring_stages).

    Long blocks keep the cost rule's positions a run (fewest_blocks * block_n / long_block_n, rounded up). Short
    blocks (the latency regime's) count their own blocks: their runs are half as long in positions, as they were
    measured (H100, 2026-11-26, graph-replayed, latency_probe.py --minblocks: B1 H128 S8192 21.3-21.4 us with the
    plan's 5 short blocks a run against 24.5-24.7 with 10; lengths [4641, 45118, 1730, 1696] at H16 Sq4
    43.5-43.9 against 43.9-44.2).

    Not chosen: an fp8 cache's 32-position blocks landing in a zone of their own beside a query that fills the
    tile (the landing ring does not fit at Dc 512). Measured on the H100 (2026-11-26, fp8, Dc 512, 64 query
    rows, every result checked) against the rows loaded by the converting warps: B128 S8192 379.4 us against
    317.1 (bf16 422.7), B32 150.2 against 116.7, B16 116.2 against 82.1 (fp8_converter_variants.py), lengths
    [4641, 45118, 1730, 1696] at H16 Sq4 77.3-78.0 against 46.8 graph-replayed (latency_probe.py --landing).
    """
    block_n, registers, _ = config
    common = dict(fp8_cache=fp8_cache, config_given=config_given)
    if gluon_land_ring(
        query_rows=query_rows,
        block_m=sizes["block_m"],
        page_size=page_size,
        block_n=block_n,
        ring_slots=sizes["land_ring_slots"],
        **common,
    ):
        return (block_n, registers, sizes["land_ring_stages"]), fewest_blocks, sizes["land_ring_slots"]
    # (an fp8 cache takes short blocks only where its rows are loaded: a query in the tile's upper half lands its
    # blocks in the lower half, a form measured with 64-position blocks only)
    rows_loaded = not fp8_cache or query_rows > sizes["land_rows"]
    if rows_loaded and gluon_short_blocks(
        narrow=narrow, batch_size=batch_size, num_parts=num_parts, small_batch=small_batch, config_given=config_given
    ):
        return (sizes["short_block_n"], registers, sizes["short_stages"]), fewest_blocks, 1
    if gluon_long_blocks(
        row_blocks=cdiv(query_rows, sizes["block_m"]),
        narrow=narrow,
        batch_size=batch_size,
        small_batch=small_batch,
        page_size=page_size,
        block_n=sizes["block_n"],
        long_block_n=sizes["long_block_n"],
        **common,
    ):
        fewest_long = cdiv(fewest_blocks * sizes["block_n"], sizes["long_block_n"])
        return (sizes["long_block_n"], registers, sizes["long_stages"]), fewest_long, 1
    return config, fewest_blocks, 1


def check_decode_config(config):
    """(block_n, num_warps, num_stages) as a tuple of ints a launch can take, else a ValueError naming it."""
    ok = (
        isinstance(config, (tuple, list))
        and len(config) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) for v in config)
    )
    if ok:
        block_n, num_warps, num_stages = config
        ok = 16 <= block_n <= 256 and next_pow2(block_n) == block_n and num_warps in (1, 2, 4, 8, 16)
        ok = ok and 1 <= num_stages <= 6
    if not ok:
        raise _policy_error(
            "config",
            f"expected (block_n: a power of two in 16..256, num_warps: 1, 2, 4, 8 or 16, num_stages: 1..6), "
            f"got {config!r}",
        )
    return tuple(config)


def check_prefill_config(config):
    """(block_m, block_n, num_warps, num_stages) as a tuple of ints a prefill launch can take, else a
    ValueError naming it."""
    ok = (
        isinstance(config, (tuple, list))
        and len(config) == 4
        and all(isinstance(v, int) and not isinstance(v, bool) for v in config)
    )
    if ok:
        block_m, block_n, num_warps, num_stages = config
        ok = (
            all(16 <= v <= 256 and next_pow2(v) == v for v in (block_m, block_n))
            and num_warps in (1, 2, 4, 8, 16)
            and 1 <= num_stages <= 6
        )
    if not ok:
        raise _policy_error(
            "config",
            f"expected (block_m, block_n: powers of two in 16..256, num_warps: 1, 2, 4, 8 or 16, num_stages: "
            f"1..6), got {config!r}",
        )
    return tuple(config)


def check_tuned_config(kernel, bucket, config):
    """A tuned configuration as a launch takes it (decode: see check_decode_config; the Gluon bucket: (block_n,
    registers, stages) of positive ints; prefill: see check_prefill_config), else a ValueError."""
    if kernel not in ("decode", "prefill"):
        raise _policy_error("kernel", f"expected decode or prefill, got {kernel!r}")
    if kernel == "prefill":
        return check_prefill_config(config)
    if bucket != DECODE_GLUON_BUCKET:
        return check_decode_config(config)
    if not (
        isinstance(config, (tuple, list))
        and len(config) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in config)
    ):
        raise _policy_error("config", f"expected (block_n, registers, stages) of ints >= 1, got {config!r}")
    return tuple(config)


def tuned_config(table, gpu_key, bucket, fallback):
    """The tuned configuration for this (arch, device name) and bucket, else the arch's ("*"), else fallback."""
    arch, name = gpu_key
    return table.get((arch, name, bucket), table.get((arch, "*", bucket), fallback))


#: the most programs per SM a small batch's combine launch is given (combine_tile)
COMBINE_MAX_PROGRAMS_PER_SM = 16


#: combine_warps: tiles of at most this many elements (rows x columns) may run in 2 warps a program
COMBINE_SMALL_TILE = 512


def combine_warps(tile, programs, sm_count):
    """Warps of a combine program for its (rows, columns) tile and a grid of `programs`: 2 for tiles of at most
    COMBINE_SMALL_TILE elements in a grid of more programs than SMs (more programs an SM, fewer waves), else 4.
    Measured on the H100 (bf16, 2026-11-25, graph-replayed, every result checked; gluon_timeline_probe.py /
    combine_timeline_probe.py, variants combine_w1 / w2 / w8 of fp8_converter_variants.py, 2 warps against 4
    in the same run): B8 H128 S8192 (tile (4, 128), 1024 programs) 57.0 / 57.0 us against 63.1-63.3; lengths
    [4641, 45118, 1730, 1696] H16 Sq4 ((1, 64), 2048) 46.0-46.1 against 47.2-47.3, Sq1 ((2, 64), 256) 33.0-33.3
    against 33.4-34.1; B8 H16 ((2, 64), 512) 36.8-36.9 against 37.5-37.6; but B1 H16 (portable split, (1, 64),
    128 programs: no second wave to save) 10.3-10.4 against 10.1-10.3. 8 warps and 1 were slower everywhere
    measured (Sq4 64.2 and 53.6). The larger tiles of big batches keep the 4 warps they were tuned with.
    """
    rows, columns = tile
    return 2 if rows * columns <= COMBINE_SMALL_TILE and programs > sm_count else 4


#: combine_step_runs_for_warps: fp32 partial elements a thread loads a step at most, in a grid of at least
#: COMBINE_CROWDED_PROGRAMS_PER_SM programs an SM
COMBINE_THREAD_ELEMENTS = 64
COMBINE_CROWDED_PROGRAMS_PER_SM = 8


def combine_step_runs_for_warps(runs, tile, warps, programs, sm_count):
    """Runs a combine program merges a step: the tile's (combine_tile; the plan sizes a step at up to 64 fp32
    a thread of 4 warps), fewer where that leaves more than COMBINE_THREAD_ELEMENTS a thread (programs of 2
    warps, combine_warps) in a grid of at least COMBINE_CROWDED_PROGRAMS_PER_SM programs an SM: there registers
    decide how many programs an SM holds at once, and the waves of programs are the launch's time, even where
    a long sequence then takes one step more.

    Measured on the H100 (bf16, 2026-11-26, graph-replayed, every result checked; latency_probe.py --steps
    --step-scales 1,0.5 and --thread-steps, in turn twice): lengths [4641, 45118, 1730, 1696] H16 Sq4 ((1, 64),
    2048 programs of 2 warps: 64 runs a step instead of 128) 45.2-45.8 us against 47.1-47.6 (combine 8.1-8.5
    against 10.2-10.7), and 47.2-47.6 with 32 (--step-scales 1,0.25). In grids of about 4 programs an SM it
    depends on the steps: B8 H16 ((2, 64), 512 programs, 8 runs a sequence: 32 runs a step, still one)
    37.8-38.0 against 38.3-38.5, but B1 H128 ((2, 64), 512 programs, 66 runs: three steps instead of two)
    22.5-22.8 against 21.9-22.3; the host does not know a sequence's runs (lengths are device data), so both
    keep the tile's. B8 H128 ((4, 128), 1024 programs, 64 a thread already) 59.0-59.1 with half its runs
    against 57.3-58.2.
    """
    rows, columns = tile
    if programs < COMBINE_CROWDED_PROGRAMS_PER_SM * sm_count:
        return runs
    threads = 32 * warps
    return max(2, min(runs, COMBINE_THREAD_ELEMENTS * threads // (rows * columns)))


def combine_tile(batch_size, rows, dc, sm_count, tiles, small_batch=0, num_parts=0):
    """((tile rows, tile columns), runs merged per step) of the combine kernel: the largest tile of `tiles`
    ({(rows, columns): runs}) that still gives every SM a program, else the smallest.

    Small batches of several sequences (2 to small_batch) may be skewed: one sequence can hold nearly all of
    the num_parts runs (lengths [4641, 45118, 1730, 1696]: 101 of 119), and each step of a program is a
    round trip to memory. Among the tiles giving every SM one to COMBINE_MAX_PROGRAMS_PER_SM programs they
    take the largest whose step holds twice a sequence's share of the runs (2 * num_parts / batch_size),
    else the one with the most runs a step. Measured on the H100 (2026-11-23, graph-replayed, Gluon split,
    combine µs; latency_probe.py --tiles): that skewed batch at H16 Sq4 43 with (4, 128) (8 runs a step),
    12 with (1, 64) (64 runs, 2048 programs); at Sq1 25 / 5.7; B8 H16 (16 runs a sequence) 4.5 with (2, 64)
    (32 runs), 6.1 with (1, 64); B8 H128 (8 runs) 14.8 with (4, 128), 15.4 with (16, 128), 23.1 with
    (2, 64) (4096 programs).
    """
    ordered = sorted(tiles.items(), reverse=True)

    def programs(tile):
        return batch_size * cdiv(rows, tile[0]) * cdiv(dc, tile[1])

    if 2 <= batch_size <= small_batch:
        share = cdiv(2 * num_parts, batch_size)
        fit = [(tile, runs) for tile, runs in ordered
               if sm_count <= programs(tile) <= COMBINE_MAX_PROGRAMS_PER_SM * sm_count]  # fmt: skip
        if fit:
            return next(((tile, runs) for tile, runs in fit if runs >= share), max(fit, key=lambda item: item[1]))
    for tile, runs in ordered:
        if programs(tile) >= sm_count:
            return tile, runs
    return ordered[-1]


def decode_tile_loads(
    *, enabled, page_size, block_n, page_stride, row_stride, width, block_m, q_tma_min_block_m, q_contiguous
):
    """(cache through TMA, q through TMA) for the portable decode kernel.

    TMA needs every cache block inside one page and the cache viewable as one [pages * page_size, Dc + Dr]
    matrix; q goes through TMA only where the tensor cores read it from shared memory (warpgroup MMA, row
    blocks of q_tma_min_block_m and more: measured on the H100, 64-row blocks gain, 16-row mma.sync lose).
    """
    cache = enabled and page_size >= block_n and row_stride == width and page_stride == page_size * width
    return cache, cache and block_m >= q_tma_min_block_m and q_contiguous


def fp8_dots_in_float16(block_m, *, wgmma_min_block_m):
    """Whether the portable decode computes an fp8 cache's dots in float16 (else in the query's dtype).

    Row blocks under wgmma_min_block_m run on mma.sync, whose operands the kernel converts in registers:
    e4m3 to float16 is one instruction per pair, to bfloat16 one more per value through float16 (measured
    on the H100, H16 B128: 425 µs against 630). Warpgroup MMAs read an unconverted query from shared memory;
    a float16 copy of it would live in registers (H128 B128: 5031 µs against 1782), so their dots keep the
    query's dtype.
    """
    return block_m < wgmma_min_block_m
