"""fp8-cache Gluon decode: source variants of the converting producer against the shipped kernel and the bf16
cache, in one process, every variant checked against the reference (NaN-poisoned outputs) before it is timed
(dev tool, H100).

    python benchmarks/fp8_converter_variants.py [--only H128] [--variants pv160,n32s4] [--bf16-variants n32s4]
        [--out DIR]

A variant is a set of text edits to the generated fp8 module (each edit must match exactly once, so a
template change that moves the edited line fails loudly rather than timing the shipped kernel twice);
variants joined by '+' apply together. Per case: bf16 (the module's own choice: Gluon on Hopper), then the
fp8 module as shipped and each variant, all with their default schedules; --bf16-variants applies edits to the
bf16 module too (n32s4, n32s3). do_bench medians; prints a table,
writes fp8_converter_variants.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import textwrap
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import PAGE_SIZE, bytes_and_flops, lengths, make_inputs, module_for  # noqa: E402
from fp8_decode_sweep import report, timed  # noqa: E402

from mlagen_compiler import import_module_from_path, launch_policy, runtime  # noqa: E402

_TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "decode_gluon.py.jinja"


def _template_functions(first: str, upto: str) -> str:
    """The template's Gluon functions from `def first` up to `def upto`, as a generated module holds them (one
    level in, under its import guard)."""
    source = _TEMPLATE.read_text()
    start = source.index(f"@gluon.jit\ndef {first}(")
    return textwrap.indent(source[start : source.index(f"\n\n\n@gluon.jit\ndef {upto}(", start)] + "\n", "    ")


#: the row-loading converter before 2026-11-26 06:00 UTC: a whole block's fp8 rows loaded into registers, then
#: converted and stored (its loads and its conversion took turns), the record the variant whole_block restores (at
#: any alignment, without prefetches: WORD_ROWS and PREFETCH, which the launch now passes, are not read)
_WHOLE_BLOCK_CONVERTER = textwrap.indent(
    '''\
@gluon.jit
def _gluon_producer_convert(q_desc_c, q_desc_r, KV, stride_kv_page, stride_kv_tok, q_smem_c, q_smem_r, q_c16, q_r16,
                            k_smem_c, k_smem_r, q_landed, q_ready, q_free, qscale_smem, k_ready, k_free, BLOCK_TABLE,
                            stride_bt_b, SEQLENS, row_block, run_lo, run_hi, b_first, b_last, seq_start,
                            SQ: gl.constexpr, H: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr,
                            DC_HALF: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                            QUERY_TO_F16: gl.constexpr, WORD_ROWS: gl.constexpr, PREFETCH: gl.constexpr):
    """fp8 cache (any page size): a block's rows are loaded through the page table in 16-byte vectors (rows
    past the sequence's end read as 0) before the wait on its stage, so the loads are in flight while the
    warpgroups finish with it; then converted to float16 (exact: every e4m3 value is one; one instruction a
    pair, cvt.rn.f16x2.e4m3x2) and stored into the float16 stage the warpgroup MMAs read. kv_scale is not
    applied here."""
    layout_c: gl.constexpr = _gluon_cvt_layout(WARPS, 64)
    layout_r: gl.constexpr = _gluon_cvt_layout(WARPS, DR)
    offs_nc = gl.arange(0, BLOCK_N, gl.SliceLayout(1, layout_c))
    offs_nr = gl.arange(0, BLOCK_N, gl.SliceLayout(1, layout_r))
    offs_c = gl.arange(0, DC, gl.SliceLayout(0, layout_c))
    offs_r = gl.arange(0, DR, gl.SliceLayout(0, layout_r))
    it = 0
    piece = 0
    for b in range(b_first, b_last):
        seqlen, seq_blocks, lo, hi = _gluon_piece(SEQLENS, b, seq_start, run_lo, run_hi, BLOCK_N)
        if lo < hi:
            if QUERY_TO_F16:
                _gluon_load_query(q_desc_c, q_desc_r, q_smem_c, q_smem_r, q_landed, q_free,
                                  b * (SQ * H) + row_block * BLOCK_M, piece, DC, DR)
                _gluon_query_to_f16(q_smem_c, q_smem_r, q_c16, q_r16, q_landed, q_ready, qscale_smem, row_block,
                                    SQ * H, piece, BLOCK_M, DC, DR, BLOCK_M, WARPS)
            else:
                _gluon_load_query(q_desc_c, q_desc_r, q_smem_c, q_smem_r, q_ready, q_free,
                                  b * (SQ * H) + row_block * BLOCK_M, piece, DC, DR)
            bt_row = BLOCK_TABLE + b.to(gl.int64) * stride_bt_b
            # each block's page-table entries are loaded a block ahead, so its rows' loads wait for no other load
            tok_c = lo * BLOCK_N + offs_nc
            page_c = gl.load(bt_row + tok_c // PAGE_SIZE, mask=tok_c < seqlen, other=0)
            tok_r = lo * BLOCK_N + offs_nr
            page_r = gl.load(bt_row + tok_r // PAGE_SIZE, mask=tok_r < seqlen, other=0)
            for blk in range(lo, hi):
                stage = it % STAGES
                tok_c = blk * BLOCK_N + offs_nc
                ok_c = tok_c < seqlen
                rows_c = KV + page_c.to(gl.int64) * stride_kv_page + (tok_c % PAGE_SIZE) * stride_kv_tok
                tok_r = blk * BLOCK_N + offs_nr
                ok_r = tok_r < seqlen
                rows_r = KV + page_r.to(gl.int64) * stride_kv_page + (tok_r % PAGE_SIZE) * stride_kv_tok
                tile_c = gl.load(rows_c[:, None] + offs_c[None, :], mask=ok_c[:, None], other=0.0)
                tile_r = gl.load(rows_r[:, None] + (DC + offs_r)[None, :], mask=ok_r[:, None], other=0.0)
                page_c = gl.load(bt_row + (tok_c + BLOCK_N) // PAGE_SIZE, mask=tok_c + BLOCK_N < seqlen, other=0)
                page_r = gl.load(bt_row + (tok_r + BLOCK_N) // PAGE_SIZE, mask=tok_r + BLOCK_N < seqlen, other=0)
                mbarrier.wait(k_free.index(stage), ((it // STAGES) & 1) ^ 1)
                k_smem_c.index(stage).store(tile_c.to(gl.float16))
                k_smem_r.index(stage).store(tile_r.to(gl.float16))
                # generic-proxy stores read next by the tensor cores (async proxy)
                fence_async_shared()
                mbarrier.arrive(k_ready.index(stage))
                it += 1
            piece += 1
        seq_start += seq_blocks
''',
    "    ",
)
#: the shipped converter (with its word helpers) replaced by _WHOLE_BLOCK_CONVERTER; the variants that edit the
#: whole-block converter's lines apply this first
_WHOLE_BLOCK = [(_template_functions("_gluon_f16_words", "_gluon_land_piece"), _WHOLE_BLOCK_CONVERTER)]

#: the word converter's row load (its address argument)
_WORD_LOAD = "(col0 // 4 + offs_w)[None, :],"
_TILE_C = "tile_c = gl.load(rows_c[:, None] + offs_c[None, :], mask=ok_c[:, None], other=0.0)"
_TILE_R = "tile_r = gl.load(rows_r[:, None] + (DC + offs_r)[None, :], mask=ok_r[:, None], other=0.0)"

#: the generated module defines its Gluon kernels one level in (under the import guard)
_CONVERTER = "    @gluon.jit\n    def _gluon_producer_convert("
#: 16 consecutive fp8 of a thread in one 16-byte load that allocates no L1 line (Triton's loads cannot say
#: L1::no_allocate; `.cg` is a strong load), zeros where the row is masked off (a row's 16 elements share
#: their mask: $20 holds the first four mask bytes)
_LOAD_NO_ALLOCATE = """@gluon.jit
def _gluon_load_no_allocate(ptrs, mask):
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $20, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; "
        "@p ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4]; }",
        "=r,=r,=r,=r,l,l,l,l,l,l,l,l,l,l,l,l,l,l,l,l,r,r,r,r", [ptrs, mask.to(gl.uint8)], dtype=gl.uint8,
        is_pure=True, pack=16)


"""

#: the landing issuer (generated module: one level in) and the line of its block loop after which it may prefetch
_LAND_WARPS = '"land", DECODE_GLUON_NARROW_LAND_WARPS if narrow else DECODE_GLUON_LAND_WARPS'
_ISSUER = "    @gluon.jit\n    def _gluon_land_issuer(KV, q_desc_c, "
_ISSUER_BLOCK = " " * 20 + "free_phase = ((it // SLOTS) & 1) ^ 1\n"
#: one block's fp8 rows (contiguous: pages of whole blocks, rows Dc + Dr bytes apart) asked into L2 by bulk
#: prefetches, a 32nd of the block a lane of the issuer's warp (cp.async.bulk.prefetch.L2: no shared memory, no
#: barrier; the TMA box that later reads the block then hits L2)
_PREFETCH_BLOCK = """@gluon.jit
def _gluon_prefetch_spread(KV, row0, DC: gl.constexpr, DR: gl.constexpr, BLOCK_N: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    SLICE: gl.constexpr = BLOCK_N * (DC + DR) // 32
    lanes = gl.arange(0, 32, layout)
    ptrs = KV + row0.to(gl.int64) * (DC + DR) + lanes * SLICE
    gl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                              [ptrs, gl.full([32], SLICE, gl.int32, layout)], dtype=gl.int32, is_pure=False, pack=1)


"""


#: one block's rows (contiguous where a page holds whole blocks) asked into L2 by bulk prefetches spread over the
#: converting warps' lanes (variant conv_prefetch)
_PREFETCH_ROWS = """@gluon.jit
def _gluon_prefetch_rows(start, nbytes: gl.constexpr, WARPS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    SLICE: gl.constexpr = nbytes // (32 * WARPS)
    lanes = gl.arange(0, 32 * WARPS, layout)
    gl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                              [start + lanes * SLICE, gl.full([32 * WARPS], SLICE, gl.int32, layout)],
                              dtype=gl.int32, is_pure=False, pack=1)


"""
_CONVERTER_TILE_R = (
    " " * 20 + "tile_r = gl.load(rows_r[:, None] + (DC + offs_r)[None, :], mask=ok_r[:, None], other=0.0)\n"
)


def _convert_prefetch_edits(ahead: int) -> list[tuple[str, str]]:
    """The row-loading converter prefetches the rows of block blk + ahead into L2 when it loads block blk's."""
    body = (
        f"if blk + {ahead} < hi:\n"
        f"    pf_tok = (blk + {ahead}) * BLOCK_N\n"
        "    pf_page = gl.load(bt_row + pf_tok // PAGE_SIZE)\n"
        "    _gluon_prefetch_rows(KV + pf_page.to(gl.int64) * stride_kv_page + (pf_tok % PAGE_SIZE) * stride_kv_tok,\n"
        "                         BLOCK_N * (DC + DR), WARPS)\n"
    )
    return _WHOLE_BLOCK + [
        (_CONVERTER, textwrap.indent(_PREFETCH_ROWS, "    ") + _CONVERTER),
        (_CONVERTER_TILE_R, _CONVERTER_TILE_R + textwrap.indent(body, " " * 20)),
    ]


#: the launch's landing pieces (the plan's: Dc / 64 / plan.LAND_GROUP latent pieces and the rope's), and the same
#: for `group` latent chunks a piece, in a text that every fp8 module shares
_LAND_PIECES = "LAND_PIECES=(DECODE_GLUON_LAND_FULL_QUERY_PIECES if full_query else DECODE_GLUON_LAND_PIECES)"


def _land_pieces(group: int) -> str:
    return f"LAND_PIECES=(KV_LORA_RANK // 64 // {group} + 1)"


def _prefetch_edits(ahead: int) -> list[tuple[str, str]]:
    """The landing issuer prefetches block blk + ahead into L2 when it issues block blk's boxes, a 32nd of the block a
    lane (beside the shipped bulk prefetch of the next block)."""
    body = (
        f"if blk + {ahead} < hi:\n"
        f"    row_a = gl.load(bt_row + ((blk + {ahead}) * BLOCK_N) // PAGE_SIZE) * PAGE_SIZE"
        f" + ((blk + {ahead}) * BLOCK_N) % PAGE_SIZE\n"
        "    _gluon_prefetch_spread(KV, row_a, DC, DR, BLOCK_N)\n"
    )
    return [
        (_ISSUER, textwrap.indent(_PREFETCH_BLOCK, "    ") + _ISSUER),
        (_ISSUER_BLOCK, _ISSUER_BLOCK + textwrap.indent(body, " " * 20)),
    ]


#: the whole-block converter's block loop (a slice of _WHOLE_BLOCK_CONVERTER) and its version that loads two
#: blocks' rows before storing the first (variant convert_pair; carrying the next block's fp8 rows across
#: iterations instead spilled: Triton keeps a carried 8-bit element in a register of its own)
_CONVERT_LOOP = _WHOLE_BLOCK_CONVERTER[
    _WHOLE_BLOCK_CONVERTER.index(" " * 16 + "for blk in range(lo, hi):\n") : _WHOLE_BLOCK_CONVERTER.index(
        " " * 20 + "it += 1\n"
    )
    + len(" " * 20 + "it += 1\n")
]
_CONVERT_LOOP_PAIR = """\
                for blk_a in range(lo, hi, 2):
                    blk_b = blk_a + 1
                    tok_c = blk_a * BLOCK_N + offs_nc
                    ok_c = tok_c < seqlen
                    page_c = gl.load(bt_row + tok_c // PAGE_SIZE, mask=ok_c, other=0)
                    rows_c = KV + page_c.to(gl.int64) * stride_kv_page + (tok_c % PAGE_SIZE) * stride_kv_tok
                    tok_r = blk_a * BLOCK_N + offs_nr
                    ok_r = tok_r < seqlen
                    page_r = gl.load(bt_row + tok_r // PAGE_SIZE, mask=ok_r, other=0)
                    rows_r = KV + page_r.to(gl.int64) * stride_kv_page + (tok_r % PAGE_SIZE) * stride_kv_tok
                    tile_c = gl.load(rows_c[:, None] + offs_c[None, :], mask=ok_c[:, None], other=0.0)
                    tile_r = gl.load(rows_r[:, None] + (DC + offs_r)[None, :], mask=ok_r[:, None], other=0.0)
                    tok_c = blk_b * BLOCK_N + offs_nc
                    ok_c = (tok_c < seqlen) & (blk_b < hi)
                    page_c = gl.load(bt_row + tok_c // PAGE_SIZE, mask=ok_c, other=0)
                    rows_c = KV + page_c.to(gl.int64) * stride_kv_page + (tok_c % PAGE_SIZE) * stride_kv_tok
                    tok_r = blk_b * BLOCK_N + offs_nr
                    ok_r = (tok_r < seqlen) & (blk_b < hi)
                    page_r = gl.load(bt_row + tok_r // PAGE_SIZE, mask=ok_r, other=0)
                    rows_r = KV + page_r.to(gl.int64) * stride_kv_page + (tok_r % PAGE_SIZE) * stride_kv_tok
                    next_c = gl.load(rows_c[:, None] + offs_c[None, :], mask=ok_c[:, None], other=0.0)
                    next_r = gl.load(rows_r[:, None] + (DC + offs_r)[None, :], mask=ok_r[:, None], other=0.0)
                    stage = it % STAGES
                    mbarrier.wait(k_free.index(stage), ((it // STAGES) & 1) ^ 1)
                    k_smem_c.index(stage).store(tile_c.to(gl.float16))
                    k_smem_r.index(stage).store(tile_r.to(gl.float16))
                    fence_async_shared()
                    mbarrier.arrive(k_ready.index(stage))
                    it += 1
                    if blk_b < hi:
                        stage = it % STAGES
                        mbarrier.wait(k_free.index(stage), ((it // STAGES) & 1) ^ 1)
                        k_smem_c.index(stage).store(next_c.to(gl.float16))
                        k_smem_r.index(stage).store(next_r.to(gl.float16))
                        # generic-proxy stores read next by the tensor cores (async proxy)
                        fence_async_shared()
                        mbarrier.arrive(k_ready.index(stage))
                        it += 1
"""

#: an edit whose text starts with one of these edits the host code the generated modules import instead of the
#: module: mlagen_compiler/runtime.py or launch_policy.py, in copies that the variant's module imports
RUNTIME_EDIT = "runtime:"
POLICY_EDIT = "policy:"

#: name -> (why, [(text, replacement)]): edits of the generated fp8 module (or of its runtime: RUNTIME_EDIT,
#: POLICY_EDIT)
VARIANTS = {
    "no_prefetch": (
        "the word converter without its bulk L2 prefetch of the next block (the form before 2026-11-26 06:30 UTC; "
        "measured as the variant conv_bulk1 then: 600.6 against 621.7 us at H128)",
        [('PREFETCH_BLOCKS=producer == "convert" and', "PREFETCH_BLOCKS=False and")],
    ),
    "prefetch_next2": (
        "the word converter's bulk L2 prefetch two blocks ahead instead of one (as the variant conv_bulk2 then: "
        "606.9 us)",
        [
            (
                "_gluon_prefetch_next_block(KV, bt_row, blk, hi, stride_kv_page, stride_kv_tok, DC, DR,",
                "_gluon_prefetch_next_block(KV, bt_row, blk + 1, hi, stride_kv_page, stride_kv_tok, DC, DR,",
            )
        ],
    ),
    "words_cg": (
        "the word converter's row loads cached in L2 only (ld.global.cg): the streamed rows then leave L1 to the "
        "converter's own spilled loop counters, which ncu found reloaded from L2 (2026-11-26, H128)",
        [(_WORD_LOAD, _WORD_LOAD + ' cache_modifier=".cg",')],
    ),
    "words_ef": (
        "the word converter's row loads marked L1 evict-first",
        [(_WORD_LOAD, _WORD_LOAD + ' eviction_policy="evict_first",')],
    ),
    "whole_block": (
        "the row-loading converter as before 2026-11-26 06:00 UTC: a whole block's rows loaded into registers, then "
        "converted and stored (loads and conversion take turns), instead of each 64-column chunk's next-block words "
        "loaded as soon as the chunk is stored",
        _WHOLE_BLOCK,
    ),
    "evict_first": (
        "the converter's row loads marked L1 evict-first (LDG.E.EF.128): the streamed cache rows leave L1 to the "
        "softmax warpgroup's spills (ncu: 4% L1 hits with fp8, 41% with bf16)",
        _WHOLE_BLOCK
        + [
            (_TILE_C, _TILE_C[:-1] + ', eviction_policy="evict_first")'),
            (_TILE_R, _TILE_R[:-1] + ', eviction_policy="evict_first")'),
        ],
    ),
    "no_allocate": (
        "the converter's row loads as ld.global.nc.L1::no_allocate (inline PTX): rows never take L1 lines, "
        "so the softmax warpgroup's spill slots may stay there (the no-load probe ran at the bf16 speed); on "
        "2026-11-26 its outputs were wrong (H128 B128: every element off), so it no longer matches the converter's "
        "layout and is kept as a record only",
        _WHOLE_BLOCK
        + [
            (_CONVERTER, textwrap.indent(_LOAD_NO_ALLOCATE, "    ") + _CONVERTER),
            (
                _TILE_C,
                "tile_c = _gluon_load_no_allocate(rows_c[:, None] + offs_c[None, :], "
                "gl.broadcast(ok_c[:, None], offs_c[None, :])[0])",
            ),
            (
                _TILE_R,
                "tile_r = _gluon_load_no_allocate(rows_r[:, None] + (DC + offs_r)[None, :], "
                "gl.broadcast(ok_r[:, None], offs_r[None, :])[0])",
            ),
        ],
    ),
    "regs88": (
        "converter 104 -> 88 registers, so the softmax warpgroup gets 248 instead of 232 (offline SASS: its two "
        "inner loops' LDL 18/20 -> 10/11; the converter's loop then spills 3 STL / 6-8 LDL)",
        [("DECODE_GLUON_CONVERT_REGS = 104", "DECODE_GLUON_CONVERT_REGS = 88")],
    ),
    "regs96": (
        "converter 104 -> 96 registers, softmax warpgroup 232 -> 240",
        [("DECODE_GLUON_CONVERT_REGS = 104", "DECODE_GLUON_CONVERT_REGS = 96")],
    ),
    "conv112": (
        "converter 104 -> 112 registers, softmax warpgroup 232 -> 224 (offline, with the query views in the loop: "
        "its spills 2 -> 8 instructions, the converter's 32 -> 18)",
        [("DECODE_GLUON_CONVERT_REGS = 104", "DECODE_GLUON_CONVERT_REGS = 112")],
    ),
    "conv120": (
        "converter 104 -> 120 registers, softmax warpgroup 232 -> 216",
        [("DECODE_GLUON_CONVERT_REGS = 104", "DECODE_GLUON_CONVERT_REGS = 120")],
    ),
    "pv160": (
        "P @ V warpgroup 168 -> 160 registers, softmax warpgroup +8 (with regs88: 256, whose inner loops then "
        "load 7 spilled values a block instead of 18-20; offline SASS)",
        [("CONSUMER_REGS=schedule.config[1],", "CONSUMER_REGS=160,")],
    ),
    **{
        f"pv{regs}": (
            f"P @ V warpgroup at {regs} registers instead of the configuration's",
            [("CONSUMER_REGS=schedule.config[1],", f"CONSUMER_REGS={regs},")],
        )
        for regs in (168, 184)
    },
    "pv120": (
        "P @ V warpgroup 168 -> 120 registers (the narrow form's accumulator is 32 a thread): the softmax warpgroup "
        "then spills less beside 4 converting warps (offline: stack 96 -> 40 bytes)",
        [("CONSUMER_REGS=schedule.config[1],", "CONSUMER_REGS=120,")],
    ),
    "pv96": (
        "P @ V warpgroup at 96 registers",
        [("CONSUMER_REGS=schedule.config[1],", "CONSUMER_REGS=96,")],
    ),
    "land104": (
        "the landing producer at 104 registers instead of 80",
        [("DECODE_GLUON_LAND_REGS = 80", "DECODE_GLUON_LAND_REGS = 104")],
    ),
    "ieee_div": (
        "the Gluon kernel's output rows (rows as the MMAs' M) divided by l element by element (an IEEE division "
        "each, ~5 instructions), as before 2026-11-23 08:30 UTC, instead of multiplied by 1 / l",
        [
            (
                "out = acc * gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))[:, None]",
                "out = acc / gl.convert_layout(1.0 / inv_l, gl.SliceLayout(1, o_layout))[:, None]",
            )
        ],
    ),
    "convert": (
        "every block loaded row by row by the converting producer (the choice before the landing producer) where "
        "the landing producer would take it (Sq * H <= 32, pages of whole blocks)",
        [
            (
                "if (query_rows <= DECODE_GLUON_LAND_ROWS or land_slots > 1) and "
                "_gluon_cache_boxes(kv_cache, block_n):",
                "if False:",
            )
        ],
    ),
    "apart_noconv": (
        "probe, wrong output by design: the landing converter stores nothing (no loads, no conversion; the "
        "handshakes and the rope kept), to show what bounds the landing producer",
        [("k_c.slice(g * GROUP, GROUP, dim=0).store(boxes.to(gl.float16))", "pass")],
    ),
    "s1": (
        "probe: one 16-bit stage instead of the tuned two (a block's conversion waits for the MMAs of the block "
        "before), to measure conversion and MMAs in series",
        [("STAGES=schedule.config[2],", "STAGES=1,")],
    ),
    "lsum_each": (
        "the narrow form's row sums summed over the block's positions every block (one more exchange through "
        "shared memory and barrier a block: the form before 2026-11-26) instead of once a piece",
        [
            (
                "l_i = l_i * alpha[None, :] + p",
                "l_i = l_i * alpha[None, :] + gl.where(gl.arange(0, BLOCK_N, gl.SliceLayout(1, s_layout))[:, None] "
                "== 0, gl.sum(p, 0)[None, :], 0.0)",
            )
        ],
    ),
    "hoisted": (
        "the query tile's MMA descriptors hoisted out of the block loop (rows as M; the form before 2026-11-26 04:15 "
        "UTC, which spilled them) instead of views indexed by a value the compiler cannot fold",
        [("opaque_zero = it >> 30", "opaque_zero = 0")],
    ),
    "balanced": (
        "runs balanced over every SM (a run may cross sequences: SMs // row blocks runs) instead of aligned to "
        "sequences where they fill 90% of a wave",
        [(POLICY_EDIT + "ALIGNED_RUNS_MIN_OCCUPANCY = 0.9", "ALIGNED_RUNS_MIN_OCCUPANCY = 1.01")],
    ),
    "pv104": (
        "the P V warpgroup (and the other non-default partitions' budget) at 104 registers instead of the tuned 168",
        [("CONSUMER_REGS=schedule.config[1],", "CONSUMER_REGS=104,")],
    ),
    "land8w": (
        "the narrow form's landing converter in 8 warps at 64 registers (17 warps: the P V warpgroup at 104 "
        "registers so that the partitions fit the register file) instead of 4 at 80",
        [
            ("DECODE_GLUON_NARROW_LAND_WARPS = 4", "DECODE_GLUON_NARROW_LAND_WARPS = 8"),
            ("DECODE_GLUON_LAND_REGS = 80", "DECODE_GLUON_LAND_REGS = 64"),
            ("CONSUMER_REGS=schedule.config[1],", "CONSUMER_REGS=104,"),
        ],
    ),
    "wide": (
        "the query rows as the MMAs' M, padded to 64 (the form before 2026-11-25 16:30 UTC), where the narrow form "
        "(rows as N: 16 or 32 wide) would take them",
        [("DECODE_GLUON_NARROW_ROWS = 16", "DECODE_GLUON_NARROW_ROWS = 0")],
    ),
    "narrow32": (
        "the narrow form 32 query rows wide too (Sq * H in 17..32: Mistral-Small-4, H16 Sq2)",
        [("DECODE_GLUON_NARROW_ROWS = 16", "DECODE_GLUON_NARROW_ROWS = 32")],
    ),
    "prefetch1": (
        "the landing issuer asks the block after next into L2 (bulk prefetch) as it issues a block's boxes: more "
        "bytes in flight than the one landing zone allows",
        _prefetch_edits(1),
    ),
    "issuer_no_prefetch": (
        "the landing issuer without its bulk L2 prefetch of the next block (the form before 2026-11-26 06:40 UTC; "
        "measured as the variant issuer_bulk1 then: H16 B128 235.4 against 242.4 us, B64 S32768 449.3 against 473.7, "
        "Mistral-Small-4 184.1 against 183.0)",
        [
            (
                "_gluon_prefetch_next_block(KV, bt_row, blk, hi, PAGE_SIZE * (DC + DR),",
                "_gluon_prefetch_next_block(KV, bt_row, blk, blk + 1, PAGE_SIZE * (DC + DR),",
            )
        ],
    ),
    "issuer_prefetch_next2": (
        "the landing issuer's bulk L2 prefetch two blocks ahead instead of one (as the variant issuer_bulk2 then: "
        "247.2 / 479.1 / 187.6 us)",
        [
            (
                "_gluon_prefetch_next_block(KV, bt_row, blk, hi, PAGE_SIZE * (DC + DR),",
                "_gluon_prefetch_next_block(KV, bt_row, blk + 1, hi, PAGE_SIZE * (DC + DR),",
            )
        ],
    ),
    "prefetch2": ("as prefetch1, two blocks ahead", _prefetch_edits(2)),
    "prefetch4": ("as prefetch1, four blocks ahead", _prefetch_edits(4)),
    **{
        f"land{warps}w": (
            f"{warps} converting warps for the landing producer of rows as M (Sq * H in 17..64; ptxas refuses 13 "
            "warps beside the 64-row accumulator at Dc 512, C7602, and takes them at Dc 256: Mistral-Small-4)",
            [(_LAND_WARPS, _LAND_WARPS.replace("else DECODE_GLUON_LAND_WARPS", f"else {warps}"))],
        )
        for warps in (2, 4)
    },
    "narrow_land2": (
        "2 converting warps for the landing producer of the narrow form (shipped: 4; 2 before 2026-11-25 16:30 UTC)",
        [("DECODE_GLUON_NARROW_LAND_WARPS = 4", "DECODE_GLUON_NARROW_LAND_WARPS = 2")],
    ),
    "group1": (
        "the landing producer's handshake per 64-column chunk (nine a block at Dc 512: the form before "
        "2026-11-25 18:30 UTC) instead of per piece of plan.LAND_GROUP = 2 chunks",
        [(_LAND_PIECES, _land_pieces(1))],
    ),
    "group4": (
        "landing pieces of 4 latent chunks (three handshakes a block at Dc 512, two at Dc 256)",
        [(_LAND_PIECES, _land_pieces(4))],
    ),
    "group8": (
        "landing pieces of 8 latent chunks (all of Dc 512 in one: the next block's boxes wait for the whole "
        "block; Dc 512 only)",
        [(_LAND_PIECES, _land_pieces(8))],
    ),
    "land72": (
        "the landing producer at 72 registers instead of 80",
        [("DECODE_GLUON_LAND_REGS = 80", "DECODE_GLUON_LAND_REGS = 72")],
    ),
    "land96": (
        "the landing producer at 96 registers instead of 80 (the softmax warpgroup 16 fewer)",
        [("DECODE_GLUON_LAND_REGS = 80", "DECODE_GLUON_LAND_REGS = 96")],
    ),
    "n32s4": (
        "32-position cache blocks in a ring of 4 stages (shared memory as for 64 x 2): a stage frees after half "
        "the work; runs are cut in 32-position blocks",
        [("DECODE_GLUON_BLOCK_N = 64", "DECODE_GLUON_BLOCK_N = 32"), ("STAGES=schedule.config[2],", "STAGES=4,")],
    ),
    "n32_combine": (
        "with n32s3 / n32s4 on a bf16 module: the combine launch counts the Gluon split's 32-position blocks "
        "(it takes the schedule's block_n, 64, otherwise); rows as M only (the narrow form needs 64 positions)",
        [
            (
                RUNTIME_EDIT + "BLOCK_N=schedule.config[0],",
                "BLOCK_N=m.DECODE_GLUON_BLOCK_N if schedule.backend == 'gluon' else schedule.config[0],",
            )
        ],
    ),
    **{
        f"combine_w{warps}": (
            f"the combine launch in {warps} warps a program instead of the schedule's (combine_warps; any module)",
            [
                (
                    RUNTIME_EDIT + "num_warps=schedule.combine_warps,",
                    f"num_warps={warps},",
                )
            ],
        )
        for warps in (1, 2, 8)
    },
    "convert_pair": (
        "the row-loading converter two blocks at a time: both blocks' rows loaded (into registers) before the "
        "first one's stage is waited for, so two blocks are in flight a program instead of one (fp8 values "
        "carried across loop iterations take a register each, so nothing is carried; use with convert)",
        _WHOLE_BLOCK + [(_CONVERT_LOOP, _CONVERT_LOOP_PAIR)],
    ),
    "conv_prefetch1": (
        "the row-loading converter prefetches the rows of the next block into L2 (pages of whole blocks)",
        _convert_prefetch_edits(1),
    ),
    "conv_prefetch2": ("as conv_prefetch1, two blocks ahead", _convert_prefetch_edits(2)),
    "conv8w": (
        "the row-loading converter in 8 warps instead of 4 (DECODE_GLUON_GATHER_WARPS; fp8 modules gather nothing)",
        [("DECODE_GLUON_GATHER_WARPS = 4", "DECODE_GLUON_GATHER_WARPS = 8")],
    ),
    **{
        f"conv{regs}": (
            f"the row-loading converter at {regs} registers instead of 104",
            [("DECODE_GLUON_CONVERT_REGS = 104", f"DECODE_GLUON_CONVERT_REGS = {regs}")],
        )
        for regs in (56, 64, 80, 128, 160, 184, 200)
    },
    **{
        f"ring{slots}": (
            f"the landing producer (query in the tile's upper half) with {slots} fp8 block(s) landing at a time"
            + (
                " in the query tile's lower half, beside the tuned stages (the form before 2026-11-26's eleventh "
                "session)"
                if slots == 1
                else " in a ring of its own"
            ),
            [
                (POLICY_EDIT + 'ring_slots=sizes["land_ring_slots"],', f"ring_slots={slots},"),
                (POLICY_EDIT + 'fewest_blocks, sizes["land_ring_slots"]\n', f"fewest_blocks, {slots}\n"),
            ],
        )
        for slots in (1, 2, 3, 4)
    },
    "ring_rows": (
        "the landing ring for two or more row blocks too (each row block's program lands its blocks in a ring of its "
        "own, its query filling the tile), where the launch policy gives them the row-loading converter",
        [
            (
                POLICY_EDIT + "if gluon_land_ring(\n        query_rows=query_rows,",
                'if gluon_land_ring(\n        query_rows=min(query_rows, sizes["block_m"]),',
            )
        ],
    ),
    "long_fp8": (
        "the long blocks (128 positions) with an fp8 cache where the launch policy gives them to a 16-bit one (two or "
        "more row blocks): the row-loading converter fills 128-position stages",
        [
            ("DECODE_GLUON_LONG_BLOCK_N = 0", "DECODE_GLUON_LONG_BLOCK_N = 128"),
            (
                POLICY_EDIT + 'long_block_n=sizes["long_block_n"],\n        **common,',
                'long_block_n=sizes["long_block_n"],\n        **{**common, "fp8_cache": False},',
            ),
        ],
    ),
    "combine": (
        "split sequences merged by the combine launch where the launch policy fuses the merge (rows as M)",
        [
            (
                POLICY_EDIT + 'return "fused" if backend == "gluon" and not narrow',
                'return "kernel" if backend == "gluon" and not narrow',
            )
        ],
    ),
    "ring_s3": (
        "the landing ring beside 3 16-bit stages instead of the plan's",
        [(POLICY_EDIT + '(block_n, registers, sizes["land_ring_stages"])', "(block_n, registers, 3)")],
    ),
    **{
        f"s{stages}": (
            f"{stages} stages in the ring, whatever the schedule's",
            [("STAGES=schedule.config[2],", f"STAGES={stages},")],
        )
        for stages in (2, 3, 4)
    },
    "n32s3": (
        "32-position cache blocks in a ring of 3 stages",
        [("DECODE_GLUON_BLOCK_N = 64", "DECODE_GLUON_BLOCK_N = 32"), ("STAGES=schedule.config[2],", "STAGES=3,")],
    ),
}


def _varied(batch: int, seqlen: int, seed: int) -> list[int]:
    """bench_decode.py's varied lengths (uniform in [S/2, 3S/2)), drawn from `seed`."""
    return lengths(batch, seqlen, True, torch.Generator().manual_seed(seed))


#: (name, bundled spec, heads, lengths)
CASES = [
    ("H128 B128 S8192", "deepseek-v3-tp1", 128, [8192] * 128),
    ("H64 B128 S8192", "deepseek-v3-tp2", 64, [8192] * 128),
    ("H64 B32 S8192", "deepseek-v3-tp2", 64, [8192] * 32),
    ("H64 B16 S8192", "deepseek-v3-tp2", 64, [8192] * 16),
    # 32 query rows at Dc 512 (one block landing in the query tile's lower half)
    ("H32 B128 S8192", "deepseek-v3-tp4", 32, [8192] * 128),
    ("H16 B128 S8192", "deepseek-v3-tp8", 16, [8192] * 128),
    ("H16 B64 S32768", "deepseek-v3-tp8", 16, [32768] * 64),
    ("Mistral-S4 H32 B128 S8192", "mistral-small-4", 32, [8192] * 128),
    # Dc 256 with 16 query rows (the narrow form) and with 64 (the query fills the tile)
    ("Dc256 H16 B128 S8192", "mistral-small-4", 16, [8192] * 128),
    ("Dc256 H64 B128 S8192", "mistral-small-4", 64, [8192] * 128),
    # Dc 256 with two row blocks (as Mistral-Small-4 at Sq 4)
    ("Dc256 H128 B128 S8192", "mistral-small-4", 128, [8192] * 128),
    # varied lengths: split sequences merged (rows as M: the fused merge, decode_merge)
    ("H64 B128 S8192 var", "deepseek-v3-tp2", 64, _varied(128, 8192, 5)),
    ("H128 B128 S8192 var", "deepseek-v3-tp1", 128, _varied(128, 8192, 6)),
    ("H128 B32 S8192 var", "deepseek-v3-tp1", 128, _varied(32, 8192, 7)),
]


def host_sources() -> dict[str, str]:
    """The host code a generated module imports, as the edits see it: {"runtime": ..., "policy": ...}."""
    return {"runtime": Path(runtime.__file__).read_text(), "policy": Path(launch_policy.__file__).read_text()}


def apply_edits(source: str, edits: list[tuple[str, str]], suffix: str) -> dict[str, str]:
    """{"module", "runtime", "policy": text} with the edits applied in turn, each to the text its prefix names
    (none: the module). Each edit's text must occur exactly once, so a change that moves an edited line fails."""
    sources = {"module": source, **host_sources()}
    for text, replacement in edits:
        where = next((name for name, prefix in (("runtime", RUNTIME_EDIT), ("policy", POLICY_EDIT))
                      if text.startswith(prefix)), "module")  # fmt: skip
        text = text.split(":", 1)[1] if where != "module" else text
        count = sources[where].count(text)
        if count != 1:
            raise ValueError(f"{suffix}: expected one {text!r} in the {where} source, found {count}")
        sources[where] = sources[where].replace(text, replacement)
    return sources


def edited_module(module, edits: list[tuple[str, str]], folder: Path, suffix: str):
    """A copy of a generated module with text edits applied, imported from its own file `<stem>__<suffix>.py`;
    where an edit changes its runtime (apply_edits), beside it its own copies of mlagen_compiler.runtime and
    launch_policy (`<stem>__<suffix>_runtime.py`, `..._policy.py`), which it imports instead."""
    sources = apply_edits(Path(module.__file__).read_text(), edits, suffix)
    stem = f"{Path(module.__file__).stem}__{suffix}"
    source = sources["module"]
    if any(sources[name] != text for name, text in host_sources().items()):
        policy, copied_runtime = f"{stem}_policy", f"{stem}_runtime"
        (folder / f"{policy}.py").write_text(sources["policy"])
        (folder / f"{copied_runtime}.py").write_text(
            sources["runtime"].replace("from .launch_policy import", f"from {policy} import")
        )
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
        source = source.replace(
            "from mlagen_compiler import runtime as _runtime", f"import {copied_runtime} as _runtime"
        )
        source = source.replace("from mlagen_compiler.runtime import", f"from {copied_runtime} import")
        source = source.replace("from mlagen_compiler.launch_policy import", f"from {policy} import")
    path = folder / f"{stem}.py"
    path.write_text(source)
    return import_module_from_path(path)


def variant_module(module, names: list[str], folder: Path):
    """The module with the edits of every variant in `names` applied."""
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise ValueError(f"variant: unknown {unknown}; known: {sorted(VARIANTS)}")
    return edited_module(module, [edit for name in names for edit in VARIANTS[name][1]], folder, "_".join(names))


def timed_variant(module, names: list[str], folder: Path, *inputs) -> tuple[float, str, str]:
    """timed() of a variant of the module (the module itself for no names); a variant that does not compile
    is reported in the message, not raised."""
    try:
        return timed(variant_module(module, names, folder) if names else module, *inputs)
    except Exception as exc:
        return float("nan"), "", f"{type(exc).__name__}: {exc}"[:200]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="cases whose name contains one of these (a,b,...)")
    parser.add_argument(
        "--variants",
        default="pv160,n32s4",
        help=f"comma-separated; '+' combines ({', '.join(VARIANTS)})",
    )
    parser.add_argument("--bf16-variants", default="", help="variants of the bf16 module, as --variants")
    parser.add_argument(
        "--l2-resident",
        action="store_true",
        help="probe: every sequence reads the first sequence's pages (its cache stays in L2), so a case's time is "
        "what the kernel costs beside reading memory",
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = parser.parse_args()
    variants = [v.split("+") for v in args.variants.split(",") if v]
    bf16_variants = [v.split("+") for v in args.bf16_variants.split(",") if v]
    unknown = sorted({n for names in variants + bf16_variants for n in names} - VARIANTS.keys())
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {sorted(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "modules"
    tmp.mkdir(exist_ok=True)
    gen = torch.Generator().manual_seed(11)
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M}Z, page {PAGE_SIZE}",
        flush=True,
    )
    for name, (why, _) in VARIANTS.items():
        print(f"# {name}: {why}")
    rows = []
    only = [s for s in args.only.split(",") if s]
    for case, spec, heads, seqlens in CASES:
        if only and not any(s in case for s in only):
            continue
        max_len = max(seqlens)
        if args.l2_resident:
            case += " L2-resident"
        bf16 = module_for(spec, heads, tmp, "bf16")
        q, kv, table, lens, _ = make_inputs(bf16, seqlens, 1, gen)
        if args.l2_resident:
            table = table[:1].expand_as(table).contiguous()
        bf16_us, config, msg = timed(bf16, q, kv, table, lens, None, max_len)
        rows.append((case, "bf16", config, bf16_us, bf16_us, msg, bytes_and_flops(bf16, seqlens, 1)[0]))
        print(rows[-1], flush=True)
        for names in bf16_variants:
            us, text, msg = timed_variant(bf16, names, tmp, q, kv, table, lens, None, max_len)
            rows.append((case, "bf16 " + "+".join(names), text, us, bf16_us, msg, rows[-1][-1]))
            print(rows[-1], flush=True)
        del kv
        fp8 = module_for(spec, heads, tmp, "fp8")
        q, kv, table, lens, kv_scale = make_inputs(fp8, seqlens, 1, gen)
        if args.l2_resident:
            table = table[:1].expand_as(table).contiguous()
        nbytes = bytes_and_flops(fp8, seqlens, 1)[0]
        for names in [[]] + variants:
            label = "fp8 " + ("+".join(names) or "shipped")
            us, text, msg = timed_variant(fp8, names, tmp, q, kv, table, lens, kv_scale, max_len)
            rows.append((case, label, text, us, bf16_us, msg, nbytes))
            print(rows[-1], flush=True)
        del kv
        torch.cuda.empty_cache()
    report(rows, args.out / "fp8_converter_variants.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
