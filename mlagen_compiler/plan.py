"""Stage 2 of the pipeline: lower a validated spec to a plan of every constant the kernels need.

Plain Python, no templates, no torch: everything a template prints comes from here, so the decisions
(padding, tile shapes, the autotune space, the split-KV policy) can be unit-tested and read in one place.

Comments state each constant's rule; where it was measured, the figures are in docs/performance-log.md,
section "Measurements behind the launch policy and the plan", under the constant's name ("performance log").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .cache_format import CACHE_FORMATS, CacheFormat, cache_format
from .launch_policy import MAX_NUM_PARTS
from .spec import DecodeTiles, MLASpec, PrefillTiles

__all__ = [
    "ARCH_BUDGETS",
    "GLUON_VERIFIED_TRITON",
    "PLAN_ARCH",
    "ArchBudget",
    "CACHE_BYTES",
    "DecodePlan",
    "GluonDecodePlan",
    "GluonPrefillPlan",
    "PlanError",
    "KERNEL_KINDS",
    "KernelKind",
    "KernelPlan",
    "CacheWritePlan",
    "PrefillConfig",
    "PrefillPlan",
    "TileConfig",
    "emitted_kinds",
    "lower",
    "next_pow2",
    "softmax_scale_of",
]


class PlanError(ValueError):
    """A spec that validates but cannot be planned within the target's budget (names the tiles field)."""


@dataclass(frozen=True)
class ArchBudget:
    """What one program may use on one GPU architecture family: every tile the plan offers fits this."""

    #: shared memory per program, bytes: the opt-in maximum per block that Triton reports and enforces
    smem_bytes: int
    #: 32-bit registers per thread that the loop-carried fp32 tiles (accumulator + scores) may take
    #: before spills become likely (255 is the hard limit; the rest holds operands and addresses)
    live_fp32_regs_per_thread: int


#: per-architecture budgets, keyed by compute-capability family
ARCH_BUDGETS = {
    # H100 / H200: 227 KB of shared memory per block (228 KB per SM less 1 KB reserved)
    "sm90": ArchBudget(smem_bytes=232448, live_fp32_regs_per_thread=192),
}
#: the family the autotune spaces and untuned defaults are sized for (where they were measured)
PLAN_ARCH = "sm90"

#: dot operands need at least 16 rows; 64 rows fill one Hopper warpgroup MMA.
MIN_BLOCK_M = 16
MAX_BLOCK_M = 64
#: row blocks this tall run on Hopper's warpgroup MMAs (operands from shared memory); shorter ones on mma.sync
WGMMA_MIN_BLOCK_M = 64
#: combine-kernel tiles (rows, latent columns), largest first; the launcher takes the first that still
#: gives every SM a program, so small batches get small tiles and many programs
COMBINE_TILES = ((16, 128), (8, 128), (4, 128), (2, 64), (1, 64))
#: fp32 elements of partial output the combine kernel loads per step: small tiles (small batches, many
#: runs per sequence) then load many runs at once, so the loads are in flight together. Tiles of at most
#: COMBINE_WIDE_STEP_ROWS rows (small and skewed batches: a long sequence holds up to all the runs) load
#: twice as many, up to COMBINE_MAX_STEP_RUNS runs (faster for small and skewed batches; twice as many for every
#: tile slowed a batch of few runs a sequence). Evidence: performance log, `COMBINE_STEP_ELEMENTS`
COMBINE_STEP_ELEMENTS = 4096
COMBINE_WIDE_STEP_ROWS = 2
COMBINE_MAX_STEP_RUNS = 128
#: the fused merge of split sequences (DecodePlan.merge_fanin): results merged per step of its tree, and
#: latent columns merged at a time (a [64, 128] fp32 tile is 64 registers a thread at 4 warps)
MERGE_FANIN = 8
MERGE_BLOCK_C = 128
#: a run must do at least this many times its fixed cost in cache reads (see DecodePlan.min_blocks_per_part)
SPLIT_OVERHEAD_FACTOR = 1.0


#: bytes per latent-cache element of each cache dtype a spec may name (the cache formats' element_bytes)
CACHE_BYTES = {name: fmt.element_bytes for name, fmt in CACHE_FORMATS.items()}


def next_pow2(value: int) -> int:
    return 1 << max(0, (int(value) - 1).bit_length())


def softmax_scale_of(spec: MLASpec) -> float:
    """1/sqrt(Dn+Dr), times DeepSeek-V3's YaRN mscale^2 when rope_scaling asks for it (see
    MLASpec.derived_softmax_scale: the spec checks it against its bounds when it is validated)."""
    return spec.derived_softmax_scale()


@dataclass(frozen=True, order=True)
class TileConfig:
    """One point of an autotune space."""

    block_n: int
    num_warps: int
    num_stages: int

    def key(self) -> str:
        return f"n{self.block_n}-w{self.num_warps}-s{self.num_stages}"

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.block_n, self.num_warps, self.num_stages)


#: Triton (major, minor) releases the Gluon decode was verified with: the Gluon API moves between releases
#: (3.6's warp_specialize takes a list of (function, args) pairs; later ones changed it), so the generated
#: module defines the Gluon kernels only under these
GLUON_VERIFIED_TRITON: tuple[tuple[int, int], ...] = ((3, 6),)
#: the Gluon decode is for Hopper only: its shared-memory budget is sm90's
GLUON_MAX_SMEM = ARCH_BUDGETS["sm90"].smem_bytes


@dataclass(frozen=True)
class GluonDecodePlan:
    """The warp-specialised Gluon decode for compute capability 9.x (Hopper); see decode_gluon.py.jinja.

    One program: ``block_m`` = 64 query rows (one warpgroup MMA tall) x one split-KV run of ``block_n`` =
    64-position cache blocks. The softmax warpgroup computes Q K^T, the online softmax and P V over the
    first ``dc_half`` latent columns; a second warpgroup does P V over the other half; a producer fills a
    ring of ``num_stages`` shared-memory stages (TMA boxes where a page holds whole blocks, else a
    ``gather_warps``-warp gather through the page table).

    Eligible geometries: Dc / 2 a power of two in 64..256 (each warpgroup's accumulator is a power-of-two
    tensor of at most 256 columns: the wgmma N limit, and 128 fp32 registers a thread at 256), Dr a power
    of two in 16..128 (tensor shapes are powers of two; one K step of 16), and the query tile plus two
    cache stages plus P must fit shared memory. Other geometries use the portable Triton kernel.

    An fp8 (float8_e4m3fn) cache: the stages still hold 16-bit rows (warpgroup MMAs take both operands in
    one 16-bit type), float16 ones (e4m3 -> float16 is one instruction a pair; a bfloat16 query is scaled
    into float16 by a power of two, which joins the softmax scale); a converting producer (``gather_warps``
    warps, ``convert_regs`` registers) loads each block's fp8 rows through the page table, any page size, in
    16-byte vectors before waiting for its stage, converts them (exact) and stores them; kv_scale joins the
    softmax scale and multiplies the finished rows. Half the bytes read from memory per block; the same MMAs
    and shared memory.
    Where the query takes at most ``land_rows`` (half the tile) and pages hold whole blocks, a landing
    producer instead lands each fp8 block by TMA in the query tile's unused lower half, a block ahead of its
    conversion, ``land_group`` 64-column chunks per mbarrier handshake: ``land_warps`` converting warps
    (``narrow_land_warps`` with the narrow form; ``land_regs`` registers) beside one warp that issues the TMA
    boxes (``producer_regs``).
    Where Sq * H <= ``narrow_rows`` the MMAs take the query rows as their N (the narrow form: S^T = K Q^T,
    O^T = V^T P^T, 16 rows wide instead of padded to block_m).
    """

    eligible: bool
    #: why the geometry is not eligible ('' when it is)
    reason: str
    block_m: int
    block_n: int
    dc_half: int
    num_stages: int
    #: shared memory of one program, bytes
    smem_bytes: int
    #: registers per thread of the second (P V) warpgroup and of the TMA producer warp (setmaxnreg)
    consumer_regs: int
    producer_regs: int
    #: pages smaller than block_n: gathering producer warps, their registers, columns per gathered tile
    gather_warps: int
    gather_regs: int
    gather_cols: int
    #: fp8 cache: the converting producer fills the stages (any page size); its registers (gather_warps warps)
    convert_cache: bool
    convert_regs: int
    #: fp8 cache with at most land_rows query rows (Sq * H) and pages >= block_n: the landing producer's registers
    land_rows: int
    land_regs: int
    #: its converting warps (beside one warp that issues the TMA boxes): with the narrow form (below), whose
    #: softmax warpgroup holds a quarter of the accumulator, narrow_land_warps; else LAND_WIDE_WARPS where Dc <=
    #: LAND_WIDE_WARPS_MAX_DC, 2 above (ptxas cannot fit 13 warps beside the 64-row accumulator at Dc 512); 4
    #: measured faster (performance log, `GluonDecodePlan.land_warps`)
    land_warps: int
    narrow_land_warps: int
    #: its latent 64-column chunks per landing piece (one mbarrier handshake, read and converted together), and
    #: its pieces: the latent's Dc / 64 / land_group, then one for the rope
    land_group: int
    land_pieces: int
    #: more query rows than land_rows in one row block with the landing ring (launch_policy.gluon_land_ring): the
    #: query fills the tile, the ring beside it lands in land_full_query_pieces handshakes a block
    #: (LAND_FULL_QUERY_GROUP latent chunks a piece)
    land_full_query_pieces: int
    #: ... and the landing converter converts that query this many rows at a time (fewer registers)
    land_full_query_slice: int
    #: one row block of query rows (launch_policy.gluon_land_ring): the landing producer lands land_ring_slots
    #: blocks at a time in a ring of its own beside land_ring_stages 16-bit stages and the whole query tile, where
    #: two or more fit (else 1: one block at a time, in the query tile's lower half)
    land_ring_slots: int
    land_ring_stages: int
    #: Sq * H <= narrow_rows (0: never): the narrow form, whose MMAs take the query rows as their N (16 or 32
    #: wide: S^T = K Q^T, O^T = V^T P^T) instead of padding them to block_m rows
    narrow_rows: int
    #: ... and the same for batches of at least narrow_large_batch sequences (NARROW_ROWS_LARGE_BATCH with a 16-bit
    #: cache, else narrow_rows; launch_policy.gluon_narrow_limit)
    narrow_rows_large_batch: int
    narrow_large_batch: int
    #: short runs of small batches with rows as the MMAs' M and a 16-bit cache (launch_policy.gluon_short_blocks):
    #: cache positions a block and ring stages instead of block_n and the tuned stages
    small_batch_block_n: int
    small_batch_stages: int
    #: two or more row blocks of query rows and a 16-bit cache (launch_policy.gluon_long_blocks): cache positions a
    #: block (Q K^T as m64n128 MMAs) and ring stages instead of block_n and the tuned stages; 0 where
    #: long_block_stages such blocks do not fit beside the query tile (Dc 512), and with an fp8 cache
    long_block_n: int
    long_block_stages: int
    #: split-KV: runs per SM (one program fills an SM's shared memory) and the fewest blocks per run
    parts_per_sm: int
    min_blocks_per_part: int
    verified_triton: tuple[tuple[int, int], ...]
    #: what `mlagen tune` times (bucket "gluon"): (block_n, consumer_regs, num_stages) over the register
    #: splits GLUON_CONSUMER_REGS and every ring depth that fits (empty where not eligible). Rows per program
    #: are fixed at one warpgroup MMA (64).
    space: tuple[tuple[int, int, int], ...] = ()
    #: the spec's cache_compute is fp8 and this geometry takes it: e4m3 tensor-core products (the query quantised
    #: to e4m3 a row at a time, K read straight from the landed fp8 block, P in e4m3, V read from the landed block
    #: into the P V's registers) in the narrow form only (Sq * H <= narrow_rows, Dc 512: FP8_NARROW_DC), with
    #: block_n-position blocks (no short or long blocks; pages hold whole blocks), fp8_land_slots blocks landing at a
    #: time; launches past narrow_rows, and those whose cache layout TMA cannot box, take the exact path
    #: (runtime.gluon_fp8_compute)
    fp8_compute: bool = False
    #: why cache_compute fp8 is not taken ('' when it is, or was not asked for)
    fp8_compute_reason: str = ""
    fp8_land_slots: int = 0
    #: registers of its converter warps (land_warps of them): the query's e4m3 quantisation holds a few rows' loads
    fp8_convert_regs: int = 0
    #: e4m3 terms of the query (FP8_QUERY_TERMS): 1, or 2 (hi + lo, twice the Q K^T products, about 8 bits kept)
    fp8_query_terms: int = 0

    @property
    def default(self) -> tuple[int, int, int]:
        """The untuned configuration of the tuning space: the plan's block, registers and stages."""
        return (self.block_n, self.consumer_regs, self.num_stages)


def _gluon_smem_bytes(dc: int, dr: int, stages: int, block_m: int, block_n: int, land_pieces: int = 0) -> int:
    """Query tile, `stages` cache blocks, P, the alpha, row-sum and query-scale vectors (2-byte data) and the
    mbarriers: a ready / free pair a stage, seven for the query, P and the row sums, and (an fp8 cache's landing
    producer) a pair for each of its land_pieces pieces. Layout conversions take a little scratch on
    top (a few hundred bytes in the offline builds)."""
    data = 2 * (block_m * (dc + dr) + stages * block_n * (dc + dr) + block_m * block_n) + 3 * 4 * block_m
    return data + 8 * (2 * stages + 7 + 2 * land_pieces)


#: fp8 cache, query rows filling the tile, the landing zone a buffer of its own beside it: latent chunks a landing
#: piece: 4, the fastest of 2, 4 and 8 (performance log, `LAND_FULL_QUERY_GROUP`)
LAND_FULL_QUERY_GROUP = 4
#: query rows the landing converter scales into float16 at a time where the query fills the tile: its warps' 80
#: registers then hold a slice, not the whole 64-row query (which they spilled, offline SASS)
LAND_FULL_QUERY_SLICE = 16


def _gluon_fitting_stages(dc: int, dr: int, block_m: int, block_n: int, land_pieces: int) -> list[int]:
    """Ring stages (2..GLUON_MAX_STAGES) of block_n positions whose shared memory fits."""
    return [
        s
        for s in range(2, GLUON_MAX_STAGES + 1)
        if _gluon_smem_bytes(dc, dr, s, block_m, block_n, land_pieces) <= GLUON_MAX_SMEM
    ]


def _gluon_land_ring_slots(dc: int, dr: int, block_m: int, block_n: int, land_pieces: int) -> int:
    """Landing slots of the landing producer's ring of its own: the most, at most LAND_RING_MAX_SLOTS, that fit
    beside the whole query tile and LAND_RING_STAGES stages (a slot: one fp8 block and a mbarrier pair a piece);
    1 where fewer than two fit (one block then lands at a time, in the query tile's lower half)."""
    slot_bytes = block_n * (dc + dr) + 16 * land_pieces
    fitting = [
        slots
        for slots in range(2, LAND_RING_MAX_SLOTS + 1)
        if _gluon_smem_bytes(dc, dr, LAND_RING_STAGES, block_m, block_n, 0) + slots * slot_bytes <= GLUON_MAX_SMEM
    ]
    return max(fitting, default=1)


def _gluon_land_pieces(dc: int, group: int) -> tuple[int, int]:
    """(latent chunks a landing piece, pieces a block): `group` 64-column chunks a piece (at least one: a latent
    narrower than 64 columns is not eligible, but is still lowered), then one piece for the rope."""
    chunks = max(1, min(group, dc // 64))
    return chunks, dc // 64 // chunks + 1


#: the landing producer's ring of its own (one row block of query rows): 16-bit stages beside it and the most fp8
#: blocks landing at a time: 2 slots were the fastest of 1 to 4, with 4 converting warps and with 2, and with
#: the query filling the tile. Evidence: performance log, `LAND_RING_STAGES`
LAND_RING_STAGES = 2
LAND_RING_MAX_SLOTS = 2
#: converting warps of the landing producer with rows as the MMAs' M where Dc <= LAND_WIDE_WARPS_MAX_DC (faster
#: than 2: performance log, `LAND_RING_STAGES`); 2 above, where ptxas cannot fit them
LAND_WIDE_WARPS = 4
LAND_WIDE_WARPS_MAX_DC = 256
#: query rows (Sq * H) up to which the Gluon decode computes the narrow form (its MMAs 16 query rows wide):
#: faster than rows padded to 64 at 16 rows, bf16 and fp8. Evidence: performance log, `NARROW_ROWS`
NARROW_ROWS = 16
#: ... and up to which a batch of at least NARROW_LARGE_BATCH sequences does with a 16-bit cache (32 rows wide at
#: 17-32 rows): faster than rows padded to 64 on the H200 at H32 Sq 1 (Dc 256 and 512) and H16 Sq 2, B64 and B128;
#: level or slower at B8-B32. An fp8 cache keeps NARROW_ROWS: slower 32 wide at Dc 256; faster at Dc 512, but that
#: path has not been through the GPU tests. Evidence: performance log, `NARROW_ROWS_LARGE_BATCH`
NARROW_ROWS_LARGE_BATCH = 32
NARROW_LARGE_BATCH = 64
#: latent 64-column chunks the fp8 landing producer lands, reads and converts per mbarrier handshake (a power
#: of two; Dc / 64 at most): 2 the fastest of 1 to 8 at Dc 512, level with 1 at Dc 256. Evidence: performance
#: log, `LAND_GROUP`
LAND_GROUP = 2
#: short runs of small batches (launch_policy.gluon_short_blocks): 32-position blocks in a ring of 3 (faster
#: than a ring of 4 and than 64-position blocks in a ring of 2). Evidence: performance log, `SMALL_BATCH_BLOCK_N`
SMALL_BATCH_BLOCK_N = 32
SMALL_BATCH_STAGES = 3
#: two or more row blocks of query rows, a 16-bit cache (launch_policy.gluon_long_blocks): 128-position blocks in a
#: ring of 2, where they fit (faster with two row blocks; one row block, memory-bound, keeps the tuned blocks).
#: Evidence: performance log, `LONG_BLOCK_N`
LONG_BLOCK_N = 128
LONG_BLOCK_STAGES = 2
#: most ring stages offered: past 4 a 64-position block's transfers are already far ahead of their use
#: (performance log, `GLUON_MAX_STAGES`)
GLUON_MAX_STAGES = 4
#: registers of the second (P V) warpgroup offered to the tuner (setmaxnreg: multiples of 8; the softmax
#: warpgroup gets what the second one and the producer leave, at most 256)
GLUON_CONSUMER_REGS = (152, 168, 184, 200)
GLUON_DEFAULT_CONSUMER_REGS = 168


#: fp8 products (cache_compute fp8): fp8 blocks landing at a time
FP8_LAND_SLOTS = 2
#: ... and the only latent width they take: the narrow form reads each warpgroup's half of V (Dc / 2 = 256
#: columns) as 4 landed 64-column boxes. The products run only in the narrow form (Sq * H <= NARROW_ROWS query
#: rows as the MMAs' N), where they beat the exact fp8 path; with rows as the MMAs' M (the wide form, since
#: removed) they lost to it. Evidence: performance log, "The fp8 products' narrow form landed, two prefill
#: schedules measured", items 3 and 5
FP8_NARROW_DC = 512
#: ... and the e4m3 terms of the query (1: hi = e4m3(q / scale); 2: hi + lo, lo = e4m3(q / scale - hi), lo's rows
#: stacked under hi's and both multiplied by K in one MMA chain twice as wide). 2: an emulation of the kernel's
#: rounding in float64 (N(0, 1) query and latent, DeepSeek-V3's softmax scale, 64 to 8192 positions) put one term's
#: output at 0.048-0.059 relative error and its LSE 0.06-0.12 off, past tests/test_fp8_compute.py's bound (0.05,
#: 0.05); two terms 0.009-0.011 and 0.008-0.014 (Mistral-Small-4's geometry: 0.031-0.040 and 0.018-0.040 with one
#: term)
FP8_QUERY_TERMS = 2
#: ... and its converter warps' registers (80, the exact landing converter's, spilled the query's loads at Sq 2)
FP8_CONVERT_REGS = 80


def _gluon_fp8_smem_bytes(dc: int, dr: int, slots: int, block_m: int, block_n: int) -> int:
    """Shared memory of the fp8-product decode: the e4m3 query tile (its terms' rows stacked in it), `slots` landed
    fp8 blocks, e4m3 P, the alpha, row-sum and query-scale vectors and the mbarriers (a pair a slot, six for the
    query, P and the row sums)."""
    data = block_m * (dc + dr) + slots * block_n * (dc + dr) + block_m * block_n
    return data + 3 * block_m * 4 + 8 * (2 * slots + 6)


def fp8_products_narrow_only(num_heads: int, dc: int, page_size: int, block_n: int) -> str:
    """Why cache_compute fp8 never runs for this geometry ('' where it can: H <= NARROW_ROWS and Dc =
    FP8_NARROW_DC, the narrow form at Sq * H <= NARROW_ROWS, and pages holding whole block_n-position blocks, which
    the products' TMA boxes land)."""
    where = f"they run only in the narrow form (Sq * H <= {NARROW_ROWS}, Dc {FP8_NARROW_DC})"
    evidence = "the wide form lost to the exact path on the H200 (docs/performance-log.md)"
    if dc != FP8_NARROW_DC:
        return f"Dc = {dc}: {where}; {evidence}"
    if num_heads > NARROW_ROWS:
        return f"H = {num_heads} > {NARROW_ROWS} query rows: {where}; {evidence}"
    if page_size < block_n:
        return f"pages of {page_size} positions hold no whole {block_n}-position block (the products land whole blocks)"
    return ""


def _gluon_fp8_compute(
    dc: int,
    dr: int,
    num_heads: int,
    page_size: int,
    block_m: int,
    block_n: int,
    convert: bool,
    cache_compute: str,
    eligible: bool,
) -> tuple[bool, str, int]:
    """(taken, why not, landing slots) of cache_compute fp8 for this geometry."""
    if cache_compute != "fp8" or not convert:
        return False, "", 0
    if not eligible:
        return False, "the Gluon decode does not take this geometry", 0
    narrow_only = fp8_products_narrow_only(num_heads, dc, page_size, block_n)
    if narrow_only:
        return False, narrow_only, 0
    need = _gluon_fp8_smem_bytes(dc, dr, FP8_LAND_SLOTS, block_m, block_n)
    if need > GLUON_MAX_SMEM:
        return False, f"the fp8 products' buffers need {need} B of shared memory > {GLUON_MAX_SMEM}", 0
    return True, "", FP8_LAND_SLOTS


def lower_gluon_decode(
    dc: int,
    dr: int,
    cache_dtype: str | None = None,
    cache_compute: str = "exact",
    num_heads: int = 1,
    page_size: int = 64,
) -> GluonDecodePlan:
    """cache_dtype: the spec's cache dtype, None for the spec's dtype (16-bit). A scaled (fp8) cache's rows are
    converted into 16-bit stages by the producer, or (cache_compute fp8, where the geometry takes it: the narrow
    form, fp8_products_narrow_only) multiplied as e4m3 by the tensor cores. num_heads, page_size: the spec's (only
    cache_compute fp8 reads them)."""
    convert = cache_dtype is not None and cache_format(cache_dtype).scaled
    block_m = block_n = 64
    dc_half = dc // 2
    reasons = []
    if dc % 2 or dc_half not in (64, 128, 256):
        reasons.append(f"Dc/2 = {dc / 2:g} is not a power of two in 64..256 (the columns each warpgroup accumulates)")
    if dr not in (16, 32, 64, 128):
        reasons.append(f"Dr = {dr} is not a power of two in 16..128")
    # the landing producer's pieces: land_group 64-column latent chunks each, and one for the rope
    land_group, land_pieces = _gluon_land_pieces(dc, LAND_GROUP)
    land_full_query_pieces = _gluon_land_pieces(dc, LAND_FULL_QUERY_GROUP)[1]
    # (its mbarriers take shared memory only with an fp8 cache)
    smem_pieces = land_pieces if convert else 0
    fitting = _gluon_fitting_stages(dc, dr, block_m, block_n, smem_pieces)
    if not fitting:
        need = _gluon_smem_bytes(dc, dr, 2, block_m, block_n, smem_pieces)
        reasons.append(f"query tile + 2 cache stages need {need} B of shared memory > {GLUON_MAX_SMEM}")
    stages = max(fitting) if fitting else 2
    fixed_bytes = block_m * (dc + dr) * 2 + block_m * dc * 4 * 2  # query in; partial out and back in
    # (fp8 only: a 16-bit cache lands nothing)
    land_ring_slots = _gluon_land_ring_slots(dc, dr, block_m, block_n, land_pieces) if smem_pieces else 1
    fp8_compute, fp8_reason, fp8_slots = _gluon_fp8_compute(
        dc, dr, num_heads, page_size, block_m, block_n, convert, cache_compute, not reasons
    )
    return GluonDecodePlan(
        eligible=not reasons,
        reason="; ".join(reasons),
        block_m=block_m,
        block_n=block_n,
        dc_half=dc_half,
        num_stages=stages,
        smem_bytes=_gluon_smem_bytes(dc, dr, stages, block_m, block_n, smem_pieces),
        consumer_regs=GLUON_DEFAULT_CONSUMER_REGS,
        producer_regs=40,
        gather_warps=4,
        gather_regs=88,
        gather_cols=64,
        convert_cache=convert,
        convert_regs=104,
        land_rows=block_m // 2,
        land_regs=80,
        land_warps=LAND_WIDE_WARPS if dc <= LAND_WIDE_WARPS_MAX_DC else 2,
        narrow_land_warps=4,
        land_group=land_group,
        land_pieces=land_pieces,
        land_full_query_pieces=land_full_query_pieces,
        land_full_query_slice=LAND_FULL_QUERY_SLICE,
        land_ring_slots=land_ring_slots,
        land_ring_stages=LAND_RING_STAGES,
        narrow_rows=NARROW_ROWS,
        narrow_rows_large_batch=NARROW_ROWS if convert else NARROW_ROWS_LARGE_BATCH,
        narrow_large_batch=NARROW_LARGE_BATCH,
        small_batch_block_n=SMALL_BATCH_BLOCK_N,
        small_batch_stages=SMALL_BATCH_STAGES,
        # (a 16-bit cache only: an fp8 cache's landing zone would not fit beside them)
        long_block_n=LONG_BLOCK_N
        if not smem_pieces and LONG_BLOCK_STAGES in _gluon_fitting_stages(dc, dr, block_m, LONG_BLOCK_N, 0)
        else 0,
        long_block_stages=LONG_BLOCK_STAGES,
        parts_per_sm=1,
        min_blocks_per_part=max(1, math.ceil(SPLIT_OVERHEAD_FACTOR * fixed_bytes / (block_n * (dc + dr) * 2))),
        verified_triton=GLUON_VERIFIED_TRITON,
        space=tuple((block_n, regs, s) for regs in GLUON_CONSUMER_REGS for s in fitting) if not reasons else (),
        fp8_compute=fp8_compute,
        fp8_compute_reason=fp8_reason,
        fp8_land_slots=fp8_slots,
        fp8_convert_regs=FP8_CONVERT_REGS if fp8_compute else 0,
        fp8_query_terms=FP8_QUERY_TERMS if fp8_compute else 0,
    )


@dataclass(frozen=True)
class DecodePlan:
    """Absorbed decode over the paged latent cache.

    Rows of a program are (query token, head) pairs, Sq folded into the head dimension, so one program
    serves up to ``max_block_m`` rows and its dots are tensor-core sized. Split-KV: the cache blocks of
    the whole batch are cut into ``num_parts`` equal runs (one program per run and row block), computed on
    the device from ``cache_seqlens``; ``num_parts = max(1, sm_count * parts_per_sm // row_blocks)``, or on
    the Gluon backend k runs per sequence where that fills the SMs (launch_policy.decode_num_parts).

    A run has a fixed cost: loading block_m query rows of Dc+Dr and writing block_m fp32 partial rows of
    Dc that the combine kernel reads back. ``min_blocks_per_part[(block_m, block_n)]`` keeps every run at
    least ``split_overhead_factor`` times that cost in cache reads, so a single long sequence is not cut
    into slivers that cost more to merge than to read.
    """

    dc: int
    dr: int
    dc_pad: int
    dr_pad: int
    #: bytes per cache element (2 for a 16-bit cache, 1 for fp8): sizes the shared-memory stages and the cost rule
    cache_bytes: int
    min_block_m: int
    max_block_m: int
    parts_per_sm: int
    split_overhead_factor: float
    min_blocks_per_part: tuple[tuple[tuple[int, int], int], ...]
    combine_tiles: tuple[tuple[int, int], ...]
    #: row blocks at least this tall load q with TMA into shared memory, where warpgroup MMAs read it
    #: (measured on the H100: 64-row blocks gain, 16-row mma.sync blocks lose badly)
    q_tma_min_block_m: int
    #: latency regime: batches of at most this many sequences are split finely (one cache block per run
    #: at least), use `small_batch_block_m` rows per program where H * Sq fits one block of max_block_m,
    #: and `small_batch_defaults` (bucket "m<block_m>-small" in tuning databases)
    small_batch_max: int
    small_batch_block_m: int
    small_batch_defaults: tuple[tuple[int, TileConfig], ...]
    #: the fused merge (the last run of a split sequence to finish merges, up a tree of merge_fanin results
    #: per step with at most merge_levels levels, merge_block_c latent columns at a time)
    merge_fanin: int
    merge_levels: int
    merge_block_c: int
    #: combine tile -> runs loaded per step
    combine_block_runs: tuple[tuple[tuple[int, int], int], ...]
    #: autotune space per block_m (as a sorted list of pairs so the plan stays hashable/printable)
    space: tuple[tuple[int, tuple[TileConfig, ...]], ...]
    #: configuration used when no tuned one is recorded for the GPU and bucket
    defaults: tuple[tuple[int, TileConfig], ...]
    #: configuration used under TRITON_INTERPRET (small tiles keep numpy fast)
    interpreter: TileConfig
    #: the Hopper backend (Gluon): eligibility and its constants
    gluon: GluonDecodePlan

    def block_ms(self) -> tuple[int, ...]:
        return tuple(m for m, _ in self.space)

    def template_tables(self, tuned: dict[str, Any]) -> dict[str, Any]:
        """The tables decode.py.jinja prints (plain data; render writes each as a Python literal). tuned:
        {"<arch>|<gpu>|<bucket>": config} from the tuning databases."""
        return {
            "decode_space": {m: [c.as_tuple() for c in cfgs] for m, cfgs in self.space},
            "decode_defaults": {m: c.as_tuple() for m, c in self.defaults},
            "decode_interpreter": self.interpreter.as_tuple(),
            "decode_min_blocks": dict(self.min_blocks_per_part),
            "decode_small_defaults": {m: c.as_tuple() for m, c in self.small_batch_defaults},
            "decode_combine_tiles": dict(self.combine_block_runs),
            "decode_tuned": {tuple(k.split("|")): tuple(v) for k, v in tuned.items()},
            "decode_gluon_reason": self.gluon.reason,
        }


@dataclass(frozen=True, order=True)
class PrefillConfig:
    """One point of the prefill autotune space: a BLOCK_M x BLOCK_N tile of (query, key) tokens."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def key(self) -> str:
        return f"m{self.block_m}-n{self.block_n}-w{self.num_warps}-s{self.num_stages}"

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.block_m, self.block_n, self.num_warps, self.num_stages)


@dataclass(frozen=True)
class PrefillPlan:
    """Prefill in the decompressed (MHA) form and chunked prefill over the latent cache.

    The qk head dim Dn + Dr (192 for DeepSeek) is not a power of two, so the score dot is split into a
    nope part (Dn padded to ``dn_pad``) and a rope part (Dr padded to ``dr_pad``): two power-of-two dots
    instead of one padded to 256. V keeps its own width ``dv_pad`` (never padded to the qk width).
    One program serves ``block_m`` query tokens of one head and walks ``block_n`` keys at a time.
    """

    dn: int
    dr: int
    dv: int
    dc: int
    dn_pad: int
    dr_pad: int
    dv_pad: int
    #: autotune space (sorted)
    space: tuple[PrefillConfig, ...]
    #: configuration used when no tuned one is recorded for the GPU
    default: PrefillConfig
    #: configuration used under TRITON_INTERPRET (small tiles keep numpy fast)
    interpreter: PrefillConfig
    #: tokens per program of the LSE merge kernel
    merge_block_t: int
    #: the Hopper backend (Gluon): eligibility and its constants
    gluon: GluonPrefillPlan

    def template_tables(self, tuned: dict[str, Any]) -> dict[str, Any]:
        """The tables prefill.py.jinja prints; tuned: {"<arch>|<gpu>|<bucket>": config}, buckets "causal" and
        "prefix" (the portable kernel's (block_m, block_n, num_warps, num_stages)), "gluon-causal" and
        "gluon-prefix" (the Gluon kernel's (block_n, stages))."""
        return {
            "prefill_space": [c.as_tuple() for c in self.space],
            "prefill_default": self.default.as_tuple(),
            "prefill_interpreter": self.interpreter.as_tuple(),
            "prefill_tuned": {tuple(k.split("|")): tuple(v) for k, v in tuned.items()},
            "prefill_gluon_reason": self.gluon.reason,
            "prefill_gluon_space": self.gluon.space,
            "prefill_gluon_default": self.gluon.default,
        }


@dataclass(frozen=True)
class CacheWritePlan:
    """Writing new tokens' [c_kv ; k_pe] rows into the paged cache: emitted for every spec, since every
    user of decode or chunked prefill fills the cache. One program per block_t tokens."""

    dc_pad: int
    dr_pad: int
    block_t: int

    def template_tables(self, tuned: dict[str, Any]) -> dict[str, Any]:
        return {}  # nothing to tune


@dataclass(frozen=True)
class KernelPlan:
    spec: MLASpec = field(repr=False)
    spec_hash: str
    module_name: str
    num_heads: int
    dtype: str
    #: the latent cache's dtype (the spec's dtype, or float8_e4m3fn) and its format (storage, scale, quantisation)
    cache_dtype: str
    cache_format: CacheFormat
    page_size: int
    softmax_scale: float
    #: kind name -> its plan, for every kind the module holds (see KERNEL_KINDS), in table order
    kernels: dict[str, Any]

    @property
    def cache_compute(self) -> str:
        """The spec's cache_compute: exact, or fp8 (e4m3 products where the Gluon decode takes them:
        decode.gluon)."""
        return self.spec.cache_compute

    # the kinds' plans by name: what the templates and the tuner read
    @property
    def decode(self) -> DecodePlan | None:
        return self.kernels.get("decode")

    @property
    def prefill(self) -> PrefillPlan | None:
        return self.kernels.get("prefill")

    @property
    def cache_write(self) -> CacheWritePlan | None:
        return self.kernels.get("cache_write")

    def summary(self) -> dict[str, Any]:
        """The plan as plain data (what `mlagen show` prints)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("spec", "kernels")}
        out["kernels"] = list(self.kernels)
        out["cache_compute"] = self.cache_compute
        for name, kind_plan in self.kernels.items():
            if name not in ("decode", "prefill"):
                out[name] = asdict(kind_plan)
        if self.decode is not None:
            dec = asdict(self.decode)
            dec["space"] = {m: [c.key() for c in cfgs] for m, cfgs in self.decode.space}
            dec["defaults"] = {m: c.key() for m, c in self.decode.defaults}
            dec["interpreter"] = self.decode.interpreter.key()
            gluon = self.decode.gluon
            verified = ", ".join(f"{major}.{minor}" for major, minor in gluon.verified_triton)
            # (launch_policy.gluon_land_ring and the module's _gluon_producer_kind, in that order)
            if gluon.land_ring_slots > 1:
                landing = (
                    f"landed by TMA {gluon.land_ring_slots} blocks at a time in a ring of its own where Sq * H <="
                    f" {gluon.block_m} and pages hold whole blocks"
                )
            else:
                landing = (
                    f"landed by TMA in the query tile's unused half where Sq * H <= {gluon.land_rows} and pages hold"
                    " whole blocks"
                )
            landing += "; else loaded row by row"
            converted = f" ({self.spec.cache_dtype} cache converted to float16 in shared memory; {landing})"
            if gluon.fp8_compute:
                converted = (
                    f" ({self.spec.cache_dtype} cache, cache_compute fp8: e4m3 tensor-core products, the query"
                    " quantised to e4m3 with a scale a row and P to e4m3, where pages hold whole blocks and the"
                    f" cache is one matrix TMA can box: the query as {gluon.fp8_query_terms} e4m3 term(s),"
                    f" {gluon.fp8_land_slots} blocks landed at a time, V read from them into the P V's registers,"
                    f" {gluon.block_n}-position blocks (no short or long blocks), in the narrow form only (Sq * H <="
                    f" {gluon.narrow_rows}); other launches the exact path: {self.spec.cache_dtype}"
                    f" cache converted to float16 in shared memory; {landing})"
                )
            dec["backend"] = (
                f"gluon{converted if gluon.convert_cache else ''} on compute capability 9.x with triton {verified}, "
                "else triton"
                if gluon.eligible
                else f"triton (not gluon: {gluon.reason})"
            )
            if self.spec.cache_compute == "fp8":
                # (the portable kernel, and so the interpreter, has no fp8 products)
                dec["cache_compute"] = (
                    f"fp8 on the Gluon decode where Sq * H <= {gluon.narrow_rows} (the narrow form, where the products"
                    " beat the exact path on the H200: docs/performance-log.md), exact elsewhere (see backend); the"
                    " portable Triton kernel keeps the exact path"
                    if gluon.fp8_compute
                    else f"exact everywhere (fp8 products not taken: {gluon.fp8_compute_reason})"
                )
            out["decode"] = dec
        if self.prefill is not None:
            pre = asdict(self.prefill)
            pre["space"] = [c.key() for c in self.prefill.space]
            pre["default"] = self.prefill.default.key()
            pre["interpreter"] = self.prefill.interpreter.key()
            gluon = self.prefill.gluon
            verified = ", ".join(f"{major}.{minor}" for major, minor in gluon.verified_triton)
            pre["backend"] = (
                f"gluon on compute capability 9.x with triton {verified} (auto or MLAGEN_PREFILL_BACKEND=gluon), "
                "triton elsewhere and where the portable kernel's config is given"
                if gluon.eligible
                else f"triton (not gluon: {gluon.reason})"
            )
            out["prefill"] = pre
        return out


def _pinned(values: tuple[int, ...], pin: int | None) -> tuple[int, ...]:
    return (pin,) if pin is not None else values


def decode_live_regs(block_m: int, c: TileConfig, dc_pad: int) -> int:
    """fp32 registers per thread of the loop-carried decode tiles: accumulator (block_m x dc_pad) + scores."""
    return (block_m * dc_pad + block_m * c.block_n) // (32 * c.num_warps)


def decode_smem_bytes(block_m: int, c: TileConfig, dc_pad: int, dr_pad: int, cache_bytes: int = 2) -> int:
    """Shared memory of one decode program: num_stages buffers of the block_n x (Dc + Dr) cache tile and the
    block_m x (Dc + Dr) query tile (TMA lands it there for warpgroup MMAs), 2 bytes each. An fp8 cache
    (cache_bytes 1) has 1-byte stages, and row blocks of WGMMA_MIN_BLOCK_M rows and more one 2-byte tile
    more: warpgroup MMAs read their operands from shared memory, so the block converted to the query's
    dtype in registers goes back there (an estimate, not yet checked against what Triton allocates;
    shorter blocks use mma.sync, whose operands stay in registers)."""
    converted = c.block_n * 2 if cache_bytes < 2 and block_m >= WGMMA_MIN_BLOCK_M else 0
    return (c.num_stages * c.block_n * cache_bytes + converted + 2 * block_m) * (dc_pad + dr_pad)


def _decode_space(
    block_m: int, dc_pad: int, dr_pad: int, tiles: DecodeTiles, pinned: bool, cache_bytes: int = 2
) -> tuple[TileConfig, ...]:
    """Tile candidates for one row-block size within the PLAN_ARCH budget.

    The accumulator is block_m x dc_pad fp32 held in registers, so wide latents need more warps; the
    cache tile is block_n x (dc_pad + dr_pad) and is multi-buffered in shared memory, so wide tiles with
    deep pipelines are dropped where they do not fit. Returns () when nothing fits (then this block_m is
    not offered). A pinned combination over the register heuristic is still what the user asked; one
    over the shared-memory budget could never launch and is a PlanError.
    """
    budget = ARCH_BUDGETS[PLAN_ARCH]
    # Pruned by a sweep: 16-token tiles only pay for mma.sync row blocks (< 64 rows), and 16 warps only where
    # the accumulator needs them (a 1024-wide latent); elsewhere they always lost (performance log, `_decode_space`).
    block_ns = _pinned((16, 32, 64, 128) if block_m < 64 else (32, 64, 128), tiles.block_n)
    warps = _pinned((4, 8, 16) if dc_pad >= 1024 else (4, 8), tiles.num_warps)
    stages = _pinned((1, 2, 3), tiles.num_stages)
    candidates = [TileConfig(n, w, s) for n in block_ns for w in warps for s in stages]
    fits_smem = [
        c for c in candidates if decode_smem_bytes(block_m, c, dc_pad, dr_pad, cache_bytes) <= budget.smem_bytes
    ]
    out = [c for c in fits_smem if decode_live_regs(block_m, c, dc_pad) <= budget.live_fp32_regs_per_thread]
    if not out and pinned:
        if not fits_smem:
            c = candidates[0]
            raise PlanError(
                f"tiles.decode: block_m={block_m}, block_n={c.block_n}, num_stages={c.num_stages} needs "
                f"{decode_smem_bytes(block_m, c, dc_pad, dr_pad, cache_bytes):,} B of shared memory per program; "
                f"{PLAN_ARCH} allows {budget.smem_bytes:,} B: pin smaller tiles or fewer stages"
            )
        out = fits_smem[:1]
    return tuple(sorted(out))


#: untuned defaults per block_m, the best of a sweep on an H100 (Dc 512 / 256, page 64; performance log,
#: `_MEASURED_DEFAULTS`); where a spec's space lacks them, the heuristic below picks
_MEASURED_DEFAULTS = {16: TileConfig(32, 4, 3), 32: TileConfig(128, 4, 2), 64: TileConfig(64, 8, 2)}
#: an fp8 cache keeps those, except where compiling for sm_90 offline (Triton 3.6's ptxas) showed 4 warps
#: spill heavily on the converted tiles: the 32-row block takes n64 w8 s2, which spilled least at Dc 512
#: (performance log, `_FP8_DEFAULTS`)
_FP8_DEFAULTS = {32: TileConfig(64, 8, 2)}


#: the latency regime (see DecodePlan.small_batch_max): at most this many sequences run 64-token tiles, 8
#: warps, 1 stage and one block per run in short row blocks, faster there than the large-batch configuration
#: and than one tall row block. Evidence: performance log, `SMALL_BATCH_MAX`
SMALL_BATCH_MAX = 8
_SMALL_BATCH_DEFAULTS = {16: TileConfig(64, 8, 1)}


def _default_decode_config(
    block_m: int, dc_pad: int, space: tuple[TileConfig, ...], cache_bytes: int = 2
) -> TileConfig:
    """A reasonable untuned choice: the measured one, else 64-token tiles with enough warps, 2 stages."""
    want_warps = 8 if block_m * dc_pad >= 32 * 1024 else 4
    preference = [
        _FP8_DEFAULTS.get(block_m) if cache_bytes == 1 else None,
        _MEASURED_DEFAULTS.get(block_m),
        TileConfig(64, want_warps, 2),
        TileConfig(32, want_warps, 2),
        TileConfig(64, 4, 2),
    ]
    for candidate in preference:
        if candidate in space:
            return candidate
    return space[0]


def combine_step_runs(tile: tuple[int, int]) -> int:
    """Runs the combine kernel merges per step with a (rows, columns) tile (see COMBINE_STEP_ELEMENTS)."""
    rows, cols = tile
    elements = COMBINE_STEP_ELEMENTS * (2 if rows <= COMBINE_WIDE_STEP_ROWS else 1)
    return max(2, min(COMBINE_MAX_STEP_RUNS, elements // (rows * cols)))


def merge_levels(fanin: int) -> int:
    """Levels of a merge tree of `fanin` results per step over the most runs a launch has."""
    levels, spanned = 1, fanin
    while spanned < MAX_NUM_PARTS:
        levels, spanned = levels + 1, spanned * fanin
    return levels


def _min_blocks_per_part(
    space: tuple[tuple[int, tuple[TileConfig, ...]], ...], dc: int, dr: int, factor: float, cache_bytes: int = 2
) -> tuple[tuple[tuple[int, int], int], ...]:
    table = {}
    for block_m, configs in space:
        fixed_bytes = block_m * (dc + dr) * 2 + block_m * dc * 4 * 2  # query in; partial out and back in
        for block_n in sorted({c.block_n for c in configs} | {16}):
            block_bytes = block_n * (dc + dr) * cache_bytes  # an fp8 block costs half: runs get twice the blocks
            table[(block_m, block_n)] = max(1, math.ceil(factor * fixed_bytes / block_bytes))
    return tuple(sorted(table.items()))


def lower_decode(spec: MLASpec) -> DecodePlan:
    dc, dr = spec.kv_lora_rank, spec.qk_rope_head_dim
    dc_pad, dr_pad = next_pow2(dc), next_pow2(dr)
    cache_bytes = CACHE_BYTES[spec.cache_dtype]
    tiles = spec.tiles.decode
    pinned = any(v is not None for v in (tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages))
    candidates = (tiles.block_m,) if tiles.block_m is not None else (16, 32, 64)
    space = tuple(
        (m, cfgs) for m in candidates if (cfgs := _decode_space(m, dc_pad, dr_pad, tiles, pinned, cache_bytes))
    )
    block_ms = tuple(m for m, _ in space)
    defaults = tuple((m, _default_decode_config(m, dc_pad, cfgs, cache_bytes)) for m, cfgs in space)
    combine_tiles = tuple((r, min(c, dc_pad)) for r, c in COMBINE_TILES)
    return DecodePlan(
        dc=dc,
        dr=dr,
        dc_pad=dc_pad,
        dr_pad=dr_pad,
        cache_bytes=cache_bytes,
        min_block_m=min(block_ms),
        max_block_m=max(block_ms),
        parts_per_sm=2,
        split_overhead_factor=SPLIT_OVERHEAD_FACTOR,
        min_blocks_per_part=_min_blocks_per_part(space, dc, dr, SPLIT_OVERHEAD_FACTOR, cache_bytes),
        q_tma_min_block_m=64,
        small_batch_max=SMALL_BATCH_MAX,
        small_batch_block_m=min(block_ms),
        small_batch_defaults=tuple(
            (m, _SMALL_BATCH_DEFAULTS[m] if _SMALL_BATCH_DEFAULTS.get(m) in cfgs else dict(defaults)[m])
            for m, cfgs in space
        ),
        combine_tiles=combine_tiles,
        merge_fanin=MERGE_FANIN,
        merge_levels=merge_levels(MERGE_FANIN),
        merge_block_c=min(MERGE_BLOCK_C, dc_pad),
        combine_block_runs=tuple((tile, combine_step_runs(tile)) for tile in combine_tiles),
        space=space,
        defaults=defaults,
        interpreter=TileConfig(block_n=16, num_warps=4, num_stages=1),
        gluon=lower_gluon_decode(dc, dr, spec.cache_dtype, spec.cache_compute, spec.num_heads, spec.page_size),
    )


#: the Gluon prefill's rows: two consumer warpgroups of one warpgroup MMA (64 rows) each, 128 query rows a program
GLUON_PREFILL_WARPGROUP_ROWS = 64
GLUON_PREFILL_BLOCK_M = 2 * GLUON_PREFILL_WARPGROUP_ROWS
#: key positions a block, largest first: the first whose loop-carried registers and two ring stages fit is the plan's
GLUON_PREFILL_BLOCK_NS = (128, 64)
#: most ring stages offered (a stage: one key block's k_nope, k_pe and v rows)
GLUON_PREFILL_MAX_STAGES = 4
#: fp32 registers a thread of a consumer warpgroup may give the loop-carried tiles (scores, P, accumulator): of the
#: GLUON_PREFILL_CONSUMER_REGS setmaxnreg gives it, the rest holds addresses, row statistics and MMA descriptors
GLUON_PREFILL_LIVE_REGS = 176
#: setmaxnreg of the two consumer warpgroups and of the producer warp (FlashAttention-3's split: 2 x 128 x 240 +
#: 128 x 24 <= 64K registers, the producer warp's partition counted as a warpgroup)
GLUON_PREFILL_CONSUMER_REGS = 240
GLUON_PREFILL_PRODUCER_REGS = 24


@dataclass(frozen=True)
class GluonPrefillPlan:
    """The warp-specialised Gluon prefill for compute capability 9.x (Hopper); see prefill_gluon.py.jinja.

    One program: ``block_m`` = 128 query rows of one sequence and head, two consumer warpgroups of 64 rows (one
    warpgroup MMA tall) each, over key blocks of ``block_n`` positions that a producer warp lands by TMA in a
    ring of ``num_stages`` shared-memory stages (k_nope, k_pe and v rows of one block a stage, K and V behind
    mbarriers of their own so Q K^T starts before V has landed). Each warpgroup computes S = Q_nope K_nope^T +
    Q_rope K_pe^T, the online softmax in base 2 and O += P V with P in registers.

    Eligible geometries: Dn, Dr and Dv powers of two in 16..256 (the MMAs' K and N and the TMA boxes; never
    padded in memory) whose scores, P and accumulator fit GLUON_PREFILL_LIVE_REGS registers a thread with some
    block_n of GLUON_PREFILL_BLOCK_NS, and whose query tile and two stages fit shared memory. Other geometries,
    and the interpreter, keep the portable kernel.

    The tile: every (block_n, stages) of GLUON_PREFILL_BLOCK_NS x 2..GLUON_PREFILL_MAX_STAGES whose loop-carried
    registers and shared memory fit is in ``space`` (what `mlagen tune` times, buckets "gluon-causal" and
    "gluon-prefix"); untuned, a launch takes ``default``: the largest block_n that fits, with the most stages that
    fit beside it.
    """

    eligible: bool
    #: why the geometry is not eligible ('' when it is)
    reason: str
    block_m: int
    #: rows of each of the two consumer warpgroups
    warpgroup_rows: int
    block_n: int
    num_stages: int
    #: shared memory of one program, bytes
    smem_bytes: int
    #: setmaxnreg of the consumer warpgroups and of the producer warp
    consumer_regs: int
    producer_regs: int
    verified_triton: tuple[tuple[int, int], ...]
    #: what `mlagen tune` times (buckets "gluon-causal" and "gluon-prefix"): (block_n, stages) of every key block
    #: and ring depth that fit, largest block first (empty where not eligible). Rows per program are fixed at two
    #: warpgroups of one warpgroup MMA (128).
    space: tuple[tuple[int, int], ...] = ()

    @property
    def default(self) -> tuple[int, int]:
        """The untuned configuration of the tuning space: the plan's block_n and stages."""
        return (self.block_n, self.num_stages)


def _gluon_prefill_smem_bytes(dn: int, dr: int, dv: int, block_m: int, block_n: int, stages: int) -> int:
    """Query tile, `stages` key blocks (k_nope, k_pe, v; 2-byte data) and the mbarriers: the query's, and a
    ready / free pair for K and for V a stage."""
    return 2 * (block_m * (dn + dr) + stages * block_n * (dn + dr + dv)) + 8 * (1 + 4 * stages)


def _gluon_prefill_live_regs(dv: int, rows: int, block_n: int) -> int:
    """fp32 registers a consumer thread holds across its block loop: scores, P (16-bit: half) and accumulator."""
    return (rows * block_n + rows * block_n // 2 + rows * dv) // 128


def lower_gluon_prefill(dn: int, dr: int, dv: int) -> GluonPrefillPlan:
    rows, block_m = GLUON_PREFILL_WARPGROUP_ROWS, GLUON_PREFILL_BLOCK_M
    reasons = []
    for name, width in (("Dn", dn), ("Dr", dr), ("Dv", dv)):
        if width not in (16, 32, 64, 128, 256):
            reasons.append(f"{name} = {width} is not a power of two in 16..256")
    fitting = [
        (block_n, s)
        for block_n in GLUON_PREFILL_BLOCK_NS
        if _gluon_prefill_live_regs(dv, rows, block_n) <= GLUON_PREFILL_LIVE_REGS
        for s in range(2, GLUON_PREFILL_MAX_STAGES + 1)
        if _gluon_prefill_smem_bytes(dn, dr, dv, block_m, block_n, s) <= GLUON_MAX_SMEM
    ]
    if not reasons and not fitting:
        need = _gluon_prefill_smem_bytes(dn, dr, dv, block_m, GLUON_PREFILL_BLOCK_NS[-1], 2)
        reasons.append(f"query tile + 2 key stages need {need} B of shared memory > {GLUON_MAX_SMEM}")
    # the largest block that fits, and the most stages for it
    block_n = fitting[0][0] if fitting else GLUON_PREFILL_BLOCK_NS[0]
    stages = max((s for n, s in fitting if n == block_n), default=2)
    return GluonPrefillPlan(
        eligible=not reasons,
        reason="; ".join(reasons),
        block_m=block_m,
        warpgroup_rows=rows,
        block_n=block_n,
        num_stages=stages,
        smem_bytes=_gluon_prefill_smem_bytes(dn, dr, dv, block_m, block_n, stages),
        consumer_regs=GLUON_PREFILL_CONSUMER_REGS,
        producer_regs=GLUON_PREFILL_PRODUCER_REGS,
        verified_triton=GLUON_VERIFIED_TRITON,
        space=tuple(fitting) if not reasons else (),
    )


def prefill_smem_bytes(c: PrefillConfig, dn_pad: int, dr_pad: int, dv_pad: int) -> int:
    """Shared memory of one prefill program: the query tile, num_stages buffers of one key tile (k_nope,
    k_pe and v rows) and a block_m x max(block_n, dv_pad) staging tile, 2 bytes each. This matches what
    Triton 3.6 asked for on an H100 for every configuration it refused (e.g. 245760 B for m128 n64 s4)."""
    key_tile = c.block_n * (dn_pad + dr_pad + dv_pad)
    return 2 * (c.block_m * (dn_pad + dr_pad) + c.num_stages * key_tile + c.block_m * max(c.block_n, dv_pad))


def prefill_live_regs(c: PrefillConfig, dv_pad: int) -> int:
    """fp32 registers per thread of the loop-carried prefill tiles: accumulator (block_m x dv_pad) + scores."""
    return (c.block_m * dv_pad + c.block_m * c.block_n) // (32 * c.num_warps)


def _prefill_space(dn_pad: int, dr_pad: int, dv_pad: int, tiles: PrefillTiles) -> tuple[PrefillConfig, ...]:
    block_ms = _pinned((64, 128), tiles.block_m)
    block_ns = _pinned((32, 64, 128), tiles.block_n)
    warps = _pinned((4, 8), tiles.num_warps)
    stages = _pinned((1, 2, 3, 4), tiles.num_stages)
    """Tile candidates within the PLAN_ARCH budget (see _decode_space for pinned knobs)."""
    budget = ARCH_BUDGETS[PLAN_ARCH]
    candidates = [PrefillConfig(m, n, w, s) for m in block_ms for n in block_ns for w in warps for s in stages]
    fits_smem = [c for c in candidates if prefill_smem_bytes(c, dn_pad, dr_pad, dv_pad) <= budget.smem_bytes]
    space = [c for c in fits_smem if prefill_live_regs(c, dv_pad) <= budget.live_fp32_regs_per_thread]
    pinned = any(v is not None for v in (tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages))
    if not space and pinned:
        if not fits_smem:
            c = candidates[0]
            raise PlanError(
                f"tiles.prefill: block_m={c.block_m}, block_n={c.block_n}, num_stages={c.num_stages} needs "
                f"{prefill_smem_bytes(c, dn_pad, dr_pad, dv_pad):,} B of shared memory per program; "
                f"{PLAN_ARCH} allows {budget.smem_bytes:,} B: pin smaller tiles or fewer stages"
            )
        space = fits_smem[:1]
    return tuple(sorted(space))


def _default_prefill_config(space: tuple[PrefillConfig, ...]) -> PrefillConfig:
    """Untuned choice for Hopper: 128 query rows on 8 warps (one 64-row wgmma per warpgroup), 2-3 stages."""
    preference = [
        PrefillConfig(128, 64, 8, 3),
        PrefillConfig(128, 64, 8, 2),
        PrefillConfig(128, 32, 8, 2),
        PrefillConfig(64, 64, 4, 2),
        PrefillConfig(64, 32, 4, 2),
    ]
    for candidate in preference:
        if candidate in space:
            return candidate
    return space[0]


def lower_prefill(spec: MLASpec) -> PrefillPlan:
    dn, dr, dv, dc = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    dn_pad, dr_pad, dv_pad = next_pow2(dn), next_pow2(dr), next_pow2(dv)
    space = _prefill_space(dn_pad, dr_pad, dv_pad, spec.tiles.prefill)
    return PrefillPlan(
        dn=dn,
        dr=dr,
        dv=dv,
        dc=dc,
        dn_pad=dn_pad,
        dr_pad=dr_pad,
        dv_pad=dv_pad,
        space=space,
        default=_default_prefill_config(space),
        interpreter=PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1),
        merge_block_t=16,
        gluon=lower_gluon_prefill(dn, dr, dv),
    )


def lower_cache_write(spec: MLASpec) -> CacheWritePlan:
    return CacheWritePlan(dc_pad=next_pow2(spec.kv_lora_rank), dr_pad=next_pow2(spec.qk_rope_head_dim), block_t=16)


@dataclass(frozen=True)
class KernelKind:
    """One kind of kernel a generated module can hold, and what each pipeline stage needs of it.

    Adding a kind is one entry in KERNEL_KINDS plus its files: a plan class with `template_tables` and its
    `lower_*` here, `templates/<template>`, its reference in reference.py and its cases in verify.py (and,
    if it has tile knobs, tuner buckets). The stages iterate this table; none names a kind itself.
    """

    name: str
    lower: Any  # Callable[[MLASpec], plan of this kind]
    template: str  # in templates/
    #: what the generated module offers for it (the verify cases call these)
    entry_points: tuple[str, ...]
    #: emitted when the spec's `kernels` names it; False: in every module (every decode user fills the cache)
    on_request: bool
    #: the function of mlagen_compiler.verify that runs its cases: (module, seed, on_gpu, progress) -> results
    verify: str


KERNEL_KINDS: tuple[KernelKind, ...] = (
    KernelKind("decode", lower_decode, "decode.py.jinja", ("mla_decode", "get_decode_schedule"), True, "verify_decode"),
    KernelKind(
        "prefill",
        lower_prefill,
        "prefill.py.jinja",
        ("mla_prefill", "mla_chunked_prefill", "merge_attn_states"),
        True,
        "verify_prefill",
    ),  # fmt: skip
    KernelKind(
        "cache_write", lower_cache_write, "cache_write.py.jinja", ("mla_cache_write",), False, "verify_cache_write"
    ),  # fmt: skip
)


def emitted_kinds(spec: MLASpec) -> tuple[KernelKind, ...]:
    """The kinds a spec's module holds, in table order."""
    return tuple(k for k in KERNEL_KINDS if not k.on_request or k.name in spec.kernels)


def lower(spec: MLASpec) -> KernelPlan:
    plans = {kind.name: kind.lower(spec) for kind in emitted_kinds(spec)}
    return KernelPlan(
        spec=spec,
        spec_hash=spec.content_hash(),
        module_name=spec.module_name,
        num_heads=spec.num_heads,
        dtype=spec.dtype,
        cache_dtype=spec.cache_dtype,
        cache_format=spec.cache_format,
        page_size=spec.page_size,
        softmax_scale=softmax_scale_of(spec),
        kernels=plans,
    )
