"""Launch policy of the generated wrappers: which decode backend, how many query rows per program, how the
cache is split into runs, which tile configuration, which combine tile, whether tiles come through TMA.

Plain Python on numbers (no torch, no triton, standard library only): unit-tested on its own
(tests/test_launch_policy.py) and imported by every generated module (with mlagen_compiler.runtime), whose
wrappers only gather facts (shapes, strides, SM count, capability), call these functions and launch. Tables
(autotune spaces, defaults, tuned configurations) come from the plan and are passed in as arguments.

Each docstring states its rule; the measurements behind a rule are in docs/performance-log.md, section
"Measurements behind the launch policy and the plan", under the function's name ("Evidence:" below).
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


def _gluon_unavailable(kernel, eligible, ineligible_reason, gluon_error, interpreting, capability):
    """Why a Gluon kernel ("decode" or "prefill") cannot run here, or '' where it can: the plan's geometry, the
    installed Triton's Gluon, the interpreter, the device and its compute capability (9.x), in that order."""
    if not eligible:
        return f"geometry not taken by the Gluon {kernel}: {ineligible_reason}"
    if gluon_error:
        return gluon_error
    if interpreting:
        return "TRITON_INTERPRET=1: Triton's interpreter cannot run Gluon kernels"
    if capability is None:
        return "not a CUDA device"
    if capability[0] != 9:
        return f"compute capability {capability[0]}.{capability[1]}: the Gluon {kernel} is built for 9.x (Hopper)"
    return ""


def _select_backend(kernel, requested, backends, name, forced_triton, auto_keeps, facts):
    """The rule of select_decode_backend and select_prefill_backend: `requested` ("auto" or one of `backends`,
    else an error naming `name`); "triton" asked for: ("triton", forced_triton); where the Gluon `kernel` cannot
    run (_gluon_unavailable of `facts`), an error naming why where "gluon" was asked for, else ("triton", why);
    where it can, ("gluon", '') unless "auto" keeps the portable kernel for the reason `auto_keeps` ('' for no
    reason)."""
    if requested not in ("auto",) + backends:
        raise _policy_error(name, f"expected auto, gluon or triton, got {requested!r}")
    if requested == "triton":
        return "triton", forced_triton
    why = _gluon_unavailable(kernel, *facts)
    if not why:
        return ("triton", auto_keeps) if requested == "auto" and auto_keeps else ("gluon", "")
    if requested == "gluon":
        raise _policy_error(name, f"'gluon' cannot run here: {why}")
    return "triton", why


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
    (knobs_given) or the whole batch has at most latency_rows query rows (B * H * Sq): there the portable
    kernel was first the faster one, and since the Gluon kernel's narrow form and gluon_small_batch_schedule the
    two are too close to move the rule. Evidence: performance log, `select_decode_backend`.
    """
    if knobs_given:
        auto_keeps = "config or block_m given: knobs of the portable kernel"
    elif total_rows is not None and total_rows <= latency_rows:
        auto_keeps = f"latency regime: {total_rows} query rows in all"
    else:
        auto_keeps = ""
    facts = (eligible, ineligible_reason, gluon_error, interpreting, capability)
    return _select_backend(
        "decode", requested, DECODE_BACKENDS, name, "MLAGEN_DECODE_BACKEND=triton", auto_keeps, facts
    )


#: prefill backends a module may run, in order of preference
PREFILL_BACKENDS = ("gluon", "triton")
#: whether "auto" takes the Gluon prefill where it can run: it does, since its launches are prepared for batches of
#: changing shapes (host time a call within a few microseconds of the portable kernel's) and its kernel is the
#: faster on every case measured, chunked prefill included. Evidence: docs/performance-log.md, "The Gluon prefill
#: chosen by auto". MLAGEN_PREFILL_BACKEND=triton (or backend="triton") keeps the portable kernel
PREFILL_AUTO_GLUON = True


def select_prefill_backend(
    requested,
    *,
    eligible,
    ineligible_reason,
    gluon_error,
    interpreting,
    capability,
    knobs_given=False,
    auto_gluon=PREFILL_AUTO_GLUON,
    name="MLAGEN_PREFILL_BACKEND",
):
    """(backend, reason) for prefill launches: "gluon" where it can run (and, for "auto", where auto_gluon says
    it pays), else "triton" with the reason.

    requested: "auto", "gluon" or "triton" (MLAGEN_PREFILL_BACKEND or the call's backend=, named by `name` in an
    error); forcing "gluon" where it cannot run is an error naming why. eligible / ineligible_reason: the plan's
    geometry decision; gluon_error: '' or why the installed Triton's Gluon cannot be used; capability: (major,
    minor) of the CUDA device, or None off CUDA. "auto" keeps the portable kernel when its knobs (config) are
    given, and while auto_gluon is False (PREFILL_AUTO_GLUON).
    """
    if knobs_given:
        auto_keeps = "config given: knobs of the portable kernel"
    elif not auto_gluon:
        auto_keeps = (
            "auto keeps the portable prefill while the Gluon launch's host cost exceeds a short prefill's "
            "kernel time (gluon on request)"
        )
    else:
        auto_keeps = ""
    forced_triton = f"{name}=triton" if name.startswith("MLAGEN_") else f"{name}='triton'"
    facts = (eligible, ineligible_reason, gluon_error, interpreting, capability)
    return _select_backend("prefill", requested, PREFILL_BACKENDS, name, forced_triton, auto_keeps, facts)


#: share of the L2 cache that one section of the Gluon prefill's tile order may fill with keys and values
PREFILL_SECTION_L2_SHARE = 0.5


def prefill_sections(pairs, keys_per_pair, bytes_per_key, l2_bytes, *, share=PREFILL_SECTION_L2_SHARE):
    """Sections of the Gluon prefill's tile order: the (sequence, head) pairs in this many runs of consecutive
    pairs, their sizes differing by at most one.

    Programs start in order of their index, so those of one section (its pairs' row blocks, heaviest first, the
    pairs alternating fastest) run at about the same time and read only their pairs' keys and values. Sections
    whose keys and values fit `share` of the L2 cache read them from memory about once, where one section of
    every pair (row blocks outermost) has each program stream its own pair's keys from memory. Sizes as equal as
    they can be: a last section of a few pairs would leave most SMs idle while its heavy blocks run. At least one
    section, at most one a pair. keys_per_pair: key positions of one sequence (an average for varlen batches);
    bytes_per_key: the bytes of one position of one head's keys and values. Evidence: docs/performance-log.md,
    `prefill_sections`."""
    per_pair = max(1, int(keys_per_pair) * int(bytes_per_key))
    most = max(1, min(int(pairs), int(l2_bytes * share) // per_pair))
    return cdiv(int(pairs), most)


def decode_merge(requested, *, backend, batch_size, num_parts, narrow=0, name="merge"):
    """How split sequences are merged: "fused" or "kernel" as requested (MLAGEN_DECODE_MERGE or the call's
    merge=, named by `name` in the error), or for "auto": "fused" for the Gluon backend with query rows as the
    MMAs' M (narrow = 0) where sequences average at most about five runs (num_parts <= 4 * batch), else "kernel".

    Why: with rows as M the fused merge saves the combine launch on serving batches. Small batches whose
    sequences hold many runs lose with it (a long sequence is merged up the tree by one program a level); so do
    the portable kernel's wide row blocks (the merge adds registers to a kernel at its limit) and the narrow
    form (the combine launch was faster on varied lengths, within a fraction of a percent on equal ones).
    Evidence: performance log, `decode_merge`.
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


#: the tuned-configuration buckets of the Gluon (Hopper) prefill, by the portable prefill's bucket of the same launch:
#: the causal launch (new tokens among themselves) and the non-causal prefix launch of chunked prefill
PREFILL_GLUON_BUCKETS = {"causal": "gluon-causal", "prefix": "gluon-prefix"}


def prefill_gluon_bucket(causal):
    """The key that tuned Gluon prefill configurations of a causal launch, or of a prefix launch, are recorded under."""
    return PREFILL_GLUON_BUCKETS["causal" if causal else "prefix"]


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
    no run pays for a second query tile and partial result, and no sequence is split when k = 1. Aligned
    runs were faster than the balanced count (SMs / row blocks) with equal lengths and level with varied ones.
    Batches of more than a wave keep the balanced count (whole sequences over two or four waves were no
    faster). Evidence: performance log, `decode_num_parts`.
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
    tile and 128 KB of fp32 partial rows at Dc 512). Runs kept inside sequences were faster on a skewed
    small batch with tall rows and level on equal lengths; the narrow form (16 rows) and the portable kernel
    (its runs grow by a block) gained nothing or lost, so they keep runs across sequences. Evidence:
    performance log, `decode_sequence_runs`.
    """
    return tall_rows and 2 <= batch_size <= small_batch and num_parts >= batch_size


#: fewest query rows (Sq * H) a sequence for which the portable kernel stores partial rows in the output's dtype
PARTIALS_IN_DTYPE_MIN_ROWS = 16


#: what the partial rows of split sequences may be stored as (MLAGEN_DECODE_PARTIALS): the policy's choice, or
#: float32, or the output's dtype
DECODE_PARTIALS = ("auto", "float32", "dtype")


def decode_partials_in_dtype(backend, query_rows, requested="auto"):
    """Whether split sequences' partial rows (normalised outputs of a run) are stored in the output's dtype
    instead of float32: half the bytes the split kernel writes and the merge reads back, but each partial row
    then carries one rounding to the output's dtype before the merge. requested: "float32" or "dtype" decides
    (MLAGEN_DECODE_PARTIALS: every backend's kernels take either form); "auto" is the rule below.

    The portable kernel with at least PARTIALS_IN_DTYPE_MIN_ROWS query rows: there the bytes show in the latency
    of small batches. Fewer rows: float32, FlashMLA's choice. With 16-bit partials FlashMLA's own dense-decoding
    suite failed its output tolerance at h_q 1 (one query row; b 1, s_k 4096, split into many runs): a
    statistic over so few elements needs the output rounded once, and float32 partials of a few rows cost
    nothing measurable. The Gluon kernel: float32 (16-bit partials measured slower: its MMA accumulator stores
    2-byte pieces). Evidence: performance log, `decode_partials_in_dtype` (and "FlashMLA drop-in", "16-bit
    partial rows").
    """
    if requested not in DECODE_PARTIALS:
        raise _policy_error("MLAGEN_DECODE_PARTIALS", f"expected auto, float32 or dtype, got {requested!r}")
    if requested != "auto":
        return requested == "dtype"
    return backend == "triton" and query_rows >= PARTIALS_IN_DTYPE_MIN_ROWS


def decode_keep_partials():
    """Whether the split kernels store partial rows with an L2 evict-last hint and the combine reads them
    evict-first: the cache blocks streamed after a partial row was written could otherwise push it out of
    L2 before the combine reads it back. With the hints the split batches of the latency cases were faster,
    or level within the runs' spread; the time saved is the split kernel's (its stores), not the combine's.
    Evidence: performance log, `decode_keep_partials`.
    """
    return True


def decode_min_blocks_per_part(min_blocks_per_part, *, small, block_m, small_block_m, block_n, cost_table):
    """Fewest cache blocks per run: the caller's, else the plan's cost rule (cost_table[(block_m, block_n)]).

    Short row blocks in the latency regime take one block a run; tall blocks keep the cost rule (one block a
    run was slower for them). Evidence: performance log, `decode_min_blocks_per_part`.
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


def gluon_narrow_limit(narrow_rows, large_batch_rows, *, batch_size, large_batch):
    """The most query rows (Sq * H) the Gluon decode's narrow form takes in a launch of batch_size sequences:
    large_batch_rows (the plan's: 32 with a 16-bit cache) from large_batch sequences on, else narrow_rows (16).

    Why: at 17-32 rows, B64 and B128, the narrow form 32 rows wide read the cache nearer the copy speed than rows
    padded to a 64-row MMA (which computes twice the products it keeps); at B8-B32, where fewer blocks stream per
    run, it was level or slower. Evidence: performance log, `NARROW_ROWS_LARGE_BATCH`.
    """
    return large_batch_rows if batch_size >= large_batch else narrow_rows


def gluon_small_batch_schedule(sm_count, *, narrow, batch_size, small_batch, min_blocks_per_part, fp8_cache):
    """(program slots, fewest cache blocks a run) of a Gluon launch: every SM and the plan's cost rule, but
    for a small batch (at most small_batch sequences) in the narrow form (narrow: its width, 0 where rows are
    the MMAs' M) runs as short as one block, on half the SMs with a 16-bit cache. Such a launch reads a
    16-bit cache no faster with more programs, and every run adds a partial result for the combine to read;
    an fp8 cache keeps every SM, its landing producer keeping one block in flight a program.

    Left out: rows as M (compute-bound small batches need every SM). Evidence: performance log,
    `gluon_small_batch_schedule`.
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

    Short blocks were faster for short runs (bf16 and fp8) and slower for long ones (runs of 16 blocks) and for
    compute-bound batches. The lengths are device data: runs a sequence are what the host knows of a run's
    length. Evidence: performance log, `gluon_short_blocks`.
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

    Long blocks were faster with two row blocks and slightly slower with one (memory-bound), so one row block
    keeps its blocks. Evidence: performance log, `gluon_long_blocks`.
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
    and a query that fills the tile has its blocks' rows loaded by the converting warps. The ring was faster
    than landing in the query tile's lower half, and than landing apart in short blocks (a form since dropped);
    level for the narrow form. Evidence: performance log, `gluon_land_ring` (and plan.LAND_RING_STAGES).
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
    long_stages, land_rows, land_ring_slots, land_ring_stages). config_given: the caller forced config (the
    schedule's config=): it is streamed as given, none of the three apply. A tuned entry, and a candidate the tuner
    times as one (the schedule's tuned=), are not given: they take the same decisions.

    Long blocks keep the cost rule's positions a run (fewest_blocks * block_n / long_block_n, rounded up). Short
    blocks (the latency regime's) count their own blocks: their runs are half as long in positions, as they were
    measured (faster than runs of the same positions).

    Not chosen: an fp8 cache's 32-position blocks landing in a zone of their own beside a query that fills the
    tile (the landing ring does not fit at Dc 512): slower than the rows loaded by the converting warps at every
    batch measured. Evidence: performance log, `gluon_blocks`.
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


def check_decode_config(config, name: str = "config"):
    """(block_n, num_warps, num_stages) as a tuple of ints a launch can take, else a ValueError naming it (as the
    argument `name`: config, or tuned where it stands for the tuned entry)."""
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
            name,
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
    """A tuned configuration as a launch takes it (decode: see check_decode_config; its Gluon bucket: (block_n,
    registers, stages) of positive ints; prefill: see check_prefill_config; its Gluon buckets: (block_n, stages)
    of positive ints), else a ValueError."""
    if kernel not in ("decode", "prefill"):
        raise _policy_error("kernel", f"expected decode or prefill, got {kernel!r}")
    if kernel == "prefill" and bucket not in PREFILL_GLUON_BUCKETS.values():
        return check_prefill_config(config)
    if kernel == "decode" and bucket != DECODE_GLUON_BUCKET:
        return check_decode_config(config)
    names = ("block_n", "registers", "stages") if kernel == "decode" else ("block_n", "stages")
    if not (
        isinstance(config, (tuple, list))
        and len(config) == len(names)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in config)
    ):
        raise _policy_error("config", f"expected ({', '.join(names)}) of ints >= 1, got {config!r}")
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
    2 warps were faster wherever a second wave was saved, level or slightly slower where there was none (a grid
    of fewer programs than SMs); 8 warps and 1 were slower everywhere measured. The larger tiles of big batches
    keep the 4 warps they were tuned with. Evidence: performance log, `combine_warps`.
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

    In grids of about 4 programs an SM fewer runs a step pay or cost depending on the steps a sequence then
    takes, which the host does not know (lengths are device data), so they keep the tile's. Evidence:
    performance log, `combine_step_runs_for_warps`.
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
    else the one with the most runs a step. Evidence: performance log, `combine_tile`.
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
    e4m3 to float16 is one instruction per pair, to bfloat16 one more per value through float16 (float16
    measured faster). Warpgroup MMAs read an unconverted query from shared memory; a float16 copy of it would
    live in registers (measured slower), so their dots keep the query's dtype. Evidence: performance log,
    `fp8_dots_in_float16`.
    """
    return block_m < wgmma_min_block_m
