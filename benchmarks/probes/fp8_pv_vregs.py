"""The narrow fp8 P . V with V as the MMA's A operand from REGISTERS, read straight from the landed boxes (dev tool)

Offline only (the stand-in Hopper driver of gluon_offline_compile.py; nothing launched). The question: can the
narrow form's O^T[DC_HALF = 256, N] += V^T[DC_HALF, 64 positions] . P^T[64 positions, N] take V^T from registers
loaded by the P . V warpgroup itself from the 4 landed [64 positions, 64 columns] e4m3 boxes of its half, with no
V^T stage in shared memory (no converter V^T work, no vt_ready / vt_free)?

An 8-bit A fragment (DotOperandLayout(0, NVMMA v3 [16, N, 32], k_width 4), [256, 64]): register bits 0-1 are
k 1, 2 (a 32-bit register holds 4 consecutive K: positions), bit 2 m 8, bits 3-4 k 16, 32, bits 5-6 m 64, 128;
lane bits 0-1 k 4, 8, lane bits 2-4 m 1, 2, 4; warps m 16, 32. A thread's rows are m0 + {0, 8, 64, 72, 128, 136,
192, 200}: not consecutive. The MMA's row order is free, so row m stands for latent column sigma(m), a bit
permutation (c the column within the half, bits c7..c0):

    c0 = m3, c1 = m6, c2 = m7, c3 = m0, c4 = m1, c5 = m2, c6 = m4, c7 = m5
    i.e. sigma(m) = (m>>3 & 1) | (m>>6 & 1)<<1 | (m>>7 & 1)<<2 | (m & 7)<<3 | (m>>4 & 3)<<6

so a thread's 8 rows are 8 consecutive columns 8a.. of one box (a = lane // 4; the box = the warp), and for each
of its K groups (positions 4t + 16j.., t = lane % 4) it reads 8 bytes of 4 positions (2 words each: LDS.64), and
2 4 x 4 byte transposes (_GLUON_F8_VT_ASM's prmt.b32) make the 8 registers of that K group. The output store maps
row m to column col0 + sigma(m) (sigma^-1: m = (c>>3 & 7) | (c & 1)<<3 | (c>>6 & 3)<<4 | (c>>1 & 1)<<6 |
(c>>2 & 1)<<7).

KPERM: the MMA's K order is free too (P^T, the B operand, stored in the same order): K index kappa stands for
position pi(kappa), bits 0 and 3 swapped; a half-warp's lanes then reach both row parities of the swizzled box and
the reads take 32 wavefronts a box (the floor) instead of 64. P's side is a rename of the softmax's registers
before its store (here STS.U16 x 4 instead of STS.U8 x 8).

The words -> e4m3 step (4x the K extent, in the dot-operand layout, no shared memory); A_PATH:
  "mov":   the words [256, 16] expanded to [256, 16, 4] (a broadcast: 4 register copies), inline asm
           "mov.b32 $0, $1" with dtype float8e4nv, pack 4 (one packed .b32 out of 4 copies in), reshaped [256, 64]
  "shift": per byte ((w >> 8b) & 0xff) as int8, bitcast to e4m3 (the per-byte control)
Both compile to the same SASS: the A path is LDS.64 + PRMT only, the transposes' outputs are the QGMMA's A
registers (no MOV, no STS / LDS round trip, no SHFL, no byte extracts). pv_loop_kernel: the block loop (full
blocks, then the masked one, MASKED a constexpr of each loop as in the kernel); BRANCH_FP8 shows what a runtime
branch around the e4m3 fragment costs (it is carried byte by byte: 541 PRMT, 193 registers).

The CPU model (cpu_model, rename_model): numpy runs the read layout's bases, the prmt.b32 selectors and the
kernel's reshape / permute chain on random bytes and checks every A register of every thread holds
V[pi(kappa)..pi(kappa + 3), sigma(m)], and only words its own thread loaded.

    python benchmarks/probes/fp8_pv_vregs.py [--dump DIR] [--model-only]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_wgmma_offline import _diagnostics, _kinds, _sass, _stderr_to  # noqa: E402
from gluon_offline_compile import _OfflineHopperDriver, _resource_usage  # noqa: E402

# the production kernel's V^T transpose (templates/decode_gluon.py.jinja: _GLUON_F8_VT_PRMT, _GLUON_F8_VT_ASM)
VT_PRMT = ((0x5140, 0x7362), (0x5410, 0x7632))
VT_ASM = (
    "{ .reg .b32 t<4>; "
    f"prmt.b32 t0, $4, $5, {VT_PRMT[0][0]:#06x}; prmt.b32 t1, $4, $5, {VT_PRMT[0][1]:#06x}; "
    f"prmt.b32 t2, $6, $7, {VT_PRMT[0][0]:#06x}; prmt.b32 t3, $6, $7, {VT_PRMT[0][1]:#06x}; "
    f"prmt.b32 $0, t0, t2, {VT_PRMT[1][0]:#06x}; prmt.b32 $1, t0, t2, {VT_PRMT[1][1]:#06x}; "
    f"prmt.b32 $2, t1, t3, {VT_PRMT[1][0]:#06x}; prmt.b32 $3, t1, t3, {VT_PRMT[1][1]:#06x}; }}"
)

#: the read of the half's 4 landed boxes as 32-bit words [box, position, word] (word w: columns 4w..4w + 3):
#: registers pos 1, 2 (the transpose's 4 inputs), word 1 (the thread's 2nd column quad), pos 16, 32 (its K groups);
#: lanes pos 4, 8 (t = lane % 4: the A fragment's K bits 2-3), word 2, 4, 8 (a = lane // 4: columns 8a..);
#: warps the box
READ_BASES = dict(
    reg_bases=[[0, 1, 0], [0, 2, 0], [0, 0, 1], [0, 16, 0], [0, 32, 0]],
    lane_bases=[[0, 4, 0], [0, 8, 0], [0, 0, 2], [0, 0, 4], [0, 0, 8]],
    warp_bases=[[1, 0, 0], [2, 0, 0]],
)
#: KPERM: the MMA's K index kappa stands for position pi(kappa), pi swapping bits 0 and 3 (P's columns stored in
#: the same order): a half-warp's 16 lanes (t = kappa bits 2-3) then reach both row parities of the swizzled box,
#: and a box's 16 LDS.64 take 32 wavefronts instead of 64; the transpose's 4 registers are positions p, p + 8, p + 2,
#: p + 10
READ_BASES_KPERM = dict(
    reg_bases=[[0, 8, 0], [0, 2, 0], [0, 0, 1], [0, 16, 0], [0, 32, 0]],
    lane_bases=[[0, 4, 0], [0, 1, 0], [0, 0, 2], [0, 0, 4], [0, 0, 8]],
    warp_bases=[[1, 0, 0], [2, 0, 0]],
)
#: the A fragment ([256, 64] e4m3, DotOperandLayout k_width 4 of the [16, 16, 32] v3 layout) as Triton 3.6 gives it
A_BASES = dict(
    reg_bases=[[0, 1], [0, 2], [8, 0], [0, 16], [0, 32], [64, 0], [128, 0]],
    lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]],
)
#: sigma as a bit map: SIGMA_BITS[i] = the bit of m that is bit i of the column
SIGMA_BITS = (3, 6, 7, 0, 1, 2, 4, 5)
#: the permute taking T[c (8 bits, c7 first), q] to A[m (m7 first), q]: dim d of T is c bit 7 - d
SIGMA_PERM = tuple(7 - SIGMA_BITS.index(7 - d) for d in range(8)) + (8,)


def sigma(m):
    return sum(((m >> b) & 1) << i for i, b in enumerate(SIGMA_BITS))


def sigma_inv(c):
    return sum(((c >> i) & 1) << b for i, b in enumerate(SIGMA_BITS))


def pi(kappa, kperm):
    """The position the MMA's K index kappa stands for (KPERM: bits 0 and 3 swapped; an involution)."""
    if not kperm:
        return kappa
    return (kappa & ~9) | ((kappa & 1) << 3) | ((kappa >> 3) & 1)


@gluon.constexpr_function
def _read_layout(kperm):
    return gl.DistributedLinearLayout(block_bases=[], shape=[4, 64, 16], **(READ_BASES_KPERM if kperm else READ_BASES))


@gluon.constexpr_function
def _a3_layout():
    """The A fragment as [256 rows, 16 words, 4 bytes] (the dot operand's linear layout, K split 16 x 4)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0], [0, 4, 0], [0, 8, 0], [64, 0, 0], [128, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]],
        block_bases=[],
        shape=[256, 16, 4],
    )


@gluon.jit
def _sigma(m):
    return ((m >> 3) & 1) | (((m >> 6) & 1) << 1) | (((m >> 7) & 1) << 2) | ((m & 7) << 3) | (((m >> 4) & 3) << 6)


@gluon.jit
def _v_words(land, n_valid, MASKED: gl.constexpr, KPERM: gl.constexpr):
    """The half's 4 landed boxes ([4, 64, 64] e4m3, 64-byte NVMMA swizzle) read as 32-bit words [box, position,
    word] in the read layout; MASKED: the words of positions >= n_valid zeroed."""
    words_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=3)
    read: gl.constexpr = _read_layout(KPERM)
    words = land._reinterpret(gl.int32, [4, 64, 16], words_layout).load(read)
    if MASKED:
        pos = gl.arange(0, 64, gl.SliceLayout(0, gl.SliceLayout(2, read)))
        words = gl.where((pos < n_valid)[None, :, None], words, gl.zeros_like(words))
    return words


@gluon.jit
def _v_fragment(words, A_PATH: gl.constexpr, a_layout: gl.constexpr, asm: gl.constexpr, KPERM: gl.constexpr):
    """The words read -> the A fragment [256 rows, 64 K] in a_layout, row m standing for column sigma(m) of the
    half and K index kappa for position pi(kappa)."""
    cols = gl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r,r,r", [words], dtype=gl.int32, is_pure=True, pack=4)
    if KPERM:  # (box, p5..p0, w): column 4w + 2 p1 + p3 over kappa group q = 8 p5 + 4 p4 + 2 p0 + p2
        t = cols.reshape([4, 2, 2, 2, 2, 2, 2, 16]).permute((0, 7, 5, 3, 1, 2, 6, 4)).reshape([256, 16])
    else:  # (box, 4q + k, w) holds column 4w + k over positions 4q..4q + 3: renamed T[c = 64 box + 4w + k, q]
        t = cols.reshape([4, 16, 4, 16]).permute((0, 3, 2, 1)).reshape([256, 16])
    # row m of the MMA stands for column sigma(m)
    t = t.reshape([2, 2, 2, 2, 2, 2, 2, 2, 16]).permute((5, 6, 0, 1, 7, 2, 3, 4, 8)).reshape([256, 16])
    a3: gl.constexpr = _a3_layout()
    w3 = gl.expand_dims(gl.convert_layout(t, gl.SliceLayout(2, a3)), 2)
    if A_PATH == "mov":
        w3, _ = gl.broadcast(w3, gl.zeros([256, 16, 4], gl.int32, a3))
        a8 = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [w3], dtype=gl.float8e4nv, is_pure=True, pack=4)
    else:
        shift = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, a3)))[None, None, :] * 8
        a8 = ((w3 >> shift) & 0xFF).to(gl.int8).to(gl.float8e4nv, bitcast=True)
    return gl.convert_layout(a8.reshape([256, 64]), a_layout)


@gluon.jit
def _v_regs(
    land,
    n_valid,
    MASKED: gl.constexpr,
    A_PATH: gl.constexpr,
    a_layout: gl.constexpr,
    asm: gl.constexpr,
    KPERM: gl.constexpr,
):
    return _v_fragment(_v_words(land, n_valid, MASKED, KPERM), A_PATH, a_layout, asm, KPERM)


@gluon.jit
def pv_vregs_kernel(
    v_ptr,
    p_ptr,
    o_ptr,
    n_valid,
    N: gl.constexpr,
    MASKED: gl.constexpr,
    A_PATH: gl.constexpr,
    ASM: gl.constexpr,
    KPERM: gl.constexpr,
):
    """v_ptr [64 positions, 256 columns] e4m3 (box b: columns 64b..), p_ptr P^T [64, N] fp32, o_ptr [256, N] fp32:
    O^T[c, n] = sum_k V[k, c] P[n, k] for the half's 256 columns c."""
    f8: gl.constexpr = gl.float8e4nv
    ld: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [4, 1, 1], [2, 1, 0])
    bx = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, ld)))
    ps = gl.arange(0, 64, gl.SliceLayout(0, gl.SliceLayout(2, ld)))
    cs = gl.arange(0, 64, gl.SliceLayout(0, gl.SliceLayout(1, ld)))
    v = gl.load(v_ptr + bx[:, None, None] * 64 + ps[None, :, None] * 256 + cs[None, None, :])
    box_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=3)
    land = gl.allocate_shared_memory(f8, [4, 64, 64], box_layout, v)
    # P as the softmax warpgroup has it: P^T [64 positions, N] in the S^T = K Q^T accumulator's layout, quantised,
    # stored as P [N, 64] (p_ptr: P^T in fp32)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
    pp = gl.arange(0, 64, gl.SliceLayout(1, s_layout))
    pn = gl.arange(0, N, gl.SliceLayout(0, s_layout))
    p8 = gl.load(p_ptr + pp[:, None] * N + pn[None, :]).to(f8)
    if KPERM:  # P^T's row kappa: position pi(kappa) (a rename of the registers: position bits 0 and 3 swapped)
        p8 = p8.reshape([2, 2, 2, 2, 2, 2, N]).permute((0, 1, 5, 3, 4, 2, 6)).reshape([64, N])
    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    p_smem = gl.allocate_shared_memory(f8, [N, 64], p_layout)
    p_smem.store(gl.permute(p8, (1, 0)))
    fence_async_shared()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
    a = _v_regs(land, n_valid, MASKED, A_PATH, a_layout, ASM, KPERM)
    acc = warpgroup_mma(a, p_smem.permute((1, 0)), gl.zeros([256, N], gl.float32, acc_layout))
    m = gl.arange(0, 256, gl.SliceLayout(1, acc_layout))
    n = gl.arange(0, N, gl.SliceLayout(0, acc_layout))
    gl.store(o_ptr + _sigma(m)[:, None] * N + n[None, :], acc)


@gluon.jit
def _pv_block(
    land,
    slot,
    p_smem,
    acc0,
    acc1,
    n_valid,
    a_layout: gl.constexpr,
    ASM: gl.constexpr,
    KPERM: gl.constexpr,
    HALVES: gl.constexpr,
    MASKED: gl.constexpr,
):
    a0 = _v_regs(land.index(slot * HALVES), n_valid, MASKED, "mov", a_layout, ASM, KPERM)
    acc0 = warpgroup_mma(a0, p_smem.permute((1, 0)), acc0, is_async=True)
    if HALVES == 2:
        a1 = _v_regs(land.index(slot * HALVES + 1), n_valid, MASKED, "mov", a_layout, ASM, KPERM)
        acc1 = warpgroup_mma(a1, p_smem.permute((1, 0)), acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
    else:
        acc0 = warpgroup_mma_wait(0, deps=(acc0,))
    return acc0, acc1


@gluon.jit
def pv_loop_kernel(
    v_ptr,
    p_ptr,
    o_ptr,
    n_blocks,
    n_valid,
    N: gl.constexpr,
    HALVES: gl.constexpr,
    KPERM: gl.constexpr,
    ASM: gl.constexpr,
    BRANCH_FP8: gl.constexpr,
):
    """The P . V warpgroup's block loop (no barriers: registers and code only): per block the A fragment(s) built
    from a landing slot (2 slots, filled once), O^T += A . P^T async then waited, HALVES 256-column halves (2: one
    warpgroup does all of Dc 512, two accumulators); the last block masked."""
    f8: gl.constexpr = gl.float8e4nv
    ld: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [4, 1, 1], [2, 1, 0])
    bx = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, ld)))
    ps = gl.arange(0, 64, gl.SliceLayout(0, gl.SliceLayout(2, ld)))
    cs = gl.arange(0, 64, gl.SliceLayout(0, gl.SliceLayout(1, ld)))
    box_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=3)
    land = gl.allocate_shared_memory(f8, [2 * HALVES, 4, 64, 64], box_layout)
    for i in gl.static_range(2 * HALVES):
        land.index(i).store(
            gl.load(v_ptr + i * 256 + bx[:, None, None] * 64 + ps[None, :, None] * 256 * HALVES + cs[None, None, :])
        )
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
    pp = gl.arange(0, 64, gl.SliceLayout(1, s_layout))
    pn = gl.arange(0, N, gl.SliceLayout(0, s_layout))
    p8 = gl.load(p_ptr + pp[:, None] * N + pn[None, :]).to(f8)
    if KPERM:
        p8 = p8.reshape([2, 2, 2, 2, 2, 2, N]).permute((0, 1, 5, 3, 4, 2, 6)).reshape([64, N])
    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    p_smem = gl.allocate_shared_memory(f8, [N, 64], p_layout)
    p_smem.store(gl.permute(p8, (1, 0)))
    fence_async_shared()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
    acc0 = gl.zeros([256, N], gl.float32, acc_layout)
    acc1 = gl.zeros([256, N], gl.float32, acc_layout)
    if BRANCH_FP8:
        # the mask chosen by a runtime branch around the e4m3 fragment: an e4m3 register tensor carried out of a
        # branch is yielded byte by byte and re-packed
        for blk in range(n_blocks):
            slot = blk % 2
            if blk == n_blocks - 1:
                a0 = _v_regs(land.index(slot * HALVES), n_valid, True, "mov", a_layout, ASM, KPERM)
            else:
                a0 = _v_regs(land.index(slot * HALVES), n_valid, False, "mov", a_layout, ASM, KPERM)
            acc0 = warpgroup_mma(a0, p_smem.permute((1, 0)), acc0, is_async=True)
            acc0 = warpgroup_mma_wait(0, deps=(acc0,))
    else:
        # as the kernel's block loops: the full blocks, then the masked ones (MASKED a constexpr of each loop)
        for blk in range(n_blocks - 1):
            acc0, acc1 = _pv_block(land, blk % 2, p_smem, acc0, acc1, n_valid, a_layout, ASM, KPERM, HALVES, False)
        for blk in range(n_blocks - 1, n_blocks):
            acc0, acc1 = _pv_block(land, blk % 2, p_smem, acc0, acc1, n_valid, a_layout, ASM, KPERM, HALVES, True)
    m = gl.arange(0, 256, gl.SliceLayout(1, acc_layout))
    n = gl.arange(0, N, gl.SliceLayout(0, acc_layout))
    gl.store(o_ptr + _sigma(m)[:, None] * N + n[None, :], acc0)
    if HALVES == 2:
        gl.store(o_ptr + (256 + _sigma(m))[:, None] * N + n[None, :], acc1)


# ---- the CPU model ------------------------------------------------------------------------------------------------


def _apply(bases, index_bits):
    """A linear layout's coordinates for the given (reg, lane, warp) index: XOR of the bases of the set bits."""
    out = None
    for kind, value in index_bits:
        for i, basis in enumerate(bases[kind]):
            if (value >> i) & 1:
                out = np.array(basis) if out is None else out ^ np.array(basis)
    return out if out is not None else np.zeros(len(bases["reg_bases"][0]), dtype=int)


def prmt_b32(a, b, selector):
    """prmt.b32, default mode, elementwise on uint32 values or arrays (tests/test_fp8_compute.py's model)."""
    a, b = np.asarray(a, dtype=np.uint32), np.asarray(b, dtype=np.uint32)
    pair = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros(a.shape, dtype=np.uint32)
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = ((pair >> np.uint64(8 * (nibble & 7))) & np.uint64(0xFF)).astype(np.uint32)
        if nibble & 8:
            byte = np.where(byte & 0x80, np.uint32(0xFF), np.uint32(0))
        out |= byte << np.uint32(8 * i)
    return out


def vt_transpose(x):
    """_GLUON_F8_VT_ASM on 4 words ($4..$7) -> 4 words ($0..$3)."""
    (s0, s1), (h0, h1) = VT_PRMT
    t0, t1 = prmt_b32(x[0], x[1], s0), prmt_b32(x[0], x[1], s1)
    t2, t3 = prmt_b32(x[2], x[3], s0), prmt_b32(x[2], x[3], s1)
    return [prmt_b32(t0, t2, h0), prmt_b32(t0, t2, h1), prmt_b32(t1, t3, h0), prmt_b32(t1, t3, h1)]


def cpu_model(seed=0, n_valid=64, kperm=False) -> str:
    """Per thread: the words its read layout loads from the boxes (logical [box, pos, word]; the swizzle is the
    load's business), the prmt transposes on registers 4i..4i + 3, then each output register placed where the
    rename (reshape / permute / sigma) puts it, and the A fragment register it lands in (the dot operand's
    linear layout) checked: its 4 bytes are V[k..k + 3, sigma(m)] for that register's (m, k); and each thread
    only ever needs words it loaded itself (register-only)."""
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 256, size=(64, 256), dtype=np.uint8)  # V [positions, the half's columns]
    v[n_valid:] = 0  # (the masked read)
    boxes = v.reshape(64, 4, 64).transpose(1, 0, 2)  # [box, pos, col]
    words = boxes.copy().view("<u4")  # [box, pos, word]
    assert sorted(map(sigma_inv, range(256))) == list(range(256)) and all(sigma_inv(sigma(m)) == m for m in range(256))
    checked = 0
    for warp in range(4):
        for lane in range(32):
            # the A fragment's (m, k) of each of this thread's registers (32 words: a register = reg index >> 2)
            a_at = {}
            for reg in range(0, 128, 4):
                m, k = _apply(A_BASES, [("reg_bases", reg), ("lane_bases", lane), ("warp_bases", warp)])
                assert k % 4 == 0
                a_at[(m, k)] = reg // 4
            fragment = {}
            for group in range(8):  # the transposes: read registers 4 group.. 4 group + 3
                loaded = []
                coords = []
                for kk in range(4):
                    box, pos, word = _apply(
                        READ_BASES_KPERM if kperm else READ_BASES,
                        [("reg_bases", 4 * group + kk), ("lane_bases", lane), ("warp_bases", warp)],
                    )
                    coords.append((box, pos, word))
                    loaded.append(int(words[box, pos, word]))
                box, pos0, word = coords[0]
                kappa0 = pi(pos0, kperm)  # the K group of the 4 positions read (pi is an involution)
                assert [c[1] for c in coords] == [pi(kappa0 + kk, kperm) for kk in range(4)] and kappa0 % 4 == 0
                for kk, out in enumerate(vt_transpose(loaded)):
                    # output register kk of the group: column 4w + kk of the box over the group's 4 positions
                    c = 64 * box + 4 * word + kk
                    m = sigma_inv(c)
                    assert (m, kappa0) in a_at, (warp, lane, m, kappa0)  # the thread's own A register
                    fragment[(m, kappa0)] = out
            assert set(fragment) == set(a_at)  # every A register of the thread filled, once
            for (m, k), word_value in fragment.items():
                got = np.frombuffer(np.uint32(word_value).tobytes(), np.uint8)
                np.testing.assert_array_equal(got, v[[pi(k + i, kperm) for i in range(4)], sigma(m)])
                checked += 1
    # the product: A[m, k] = V[k, sigma(m)], so (A P^T)[m] = (V^T P^T)[sigma(m)]
    p = rng.standard_normal((16, 64))
    vf = v.astype(np.float64)
    kp = [pi(k, kperm) for k in range(64)]
    a = vf[kp][:, [sigma(m) for m in range(256)]].T  # A[m, kappa] = V[pi(kappa), sigma(m)]
    o = np.empty((256, 16))
    o[[sigma(m) for m in range(256)]] = a @ p[:, kp].T  # B[kappa, n] = P[n, pi(kappa)]
    np.testing.assert_allclose(o, vf.T @ p.T)
    return f"{checked} A registers (4 bytes each) checked over 128 threads, n_valid {n_valid}, kperm {kperm}"


def rename_model(seed=1, kperm=False) -> str:
    """The kernel's tensor-level steps in numpy (reshape / permute are row-major in both): the read tensor [box,
    pos, word], each 4 positions of a transpose group (registers 0-3: READ_BASES' first two register bases)
    transposed in place (output register kk at input register kk's coordinate), _v_regs' reshape / permute
    chain verbatim, the words as bytes: A[m, kappa] must be V[pi(kappa), sigma(m)]."""
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 256, size=(64, 256), dtype=np.uint8)
    words = v.reshape(64, 4, 64).transpose(1, 0, 2).copy().view("<u4")  # [box, pos, word]
    steps = [8, 2] if kperm else [1, 2]  # the position steps of a group's registers 1 and 2
    cols = np.empty_like(words)
    for pos0 in range(64):
        if pos0 & (steps[0] | steps[1]):
            continue
        group = [pos0 + (i & 1) * steps[0] + (i >> 1) * steps[1] for i in range(4)]
        out = vt_transpose([words[:, p, :] for p in group])  # (elementwise over box, word)
        for i, p in enumerate(group):
            cols[:, p, :] = out[i]
    if kperm:
        t = cols.reshape([4, 2, 2, 2, 2, 2, 2, 16]).transpose((0, 7, 5, 3, 1, 2, 6, 4)).reshape([256, 16])
    else:
        t = cols.reshape([4, 16, 4, 16]).transpose((0, 3, 2, 1)).reshape([256, 16])
    assert SIGMA_PERM == (5, 6, 0, 1, 7, 2, 3, 4, 8)  # (the kernel's literal)
    t = t.reshape([2, 2, 2, 2, 2, 2, 2, 2, 16]).transpose(SIGMA_PERM).reshape([256, 16])
    a = t.astype("<u4").view(np.uint8).reshape(256, 64)
    expect = v[[pi(k, kperm) for k in range(64)]][:, [sigma(m) for m in range(256)]].T
    np.testing.assert_array_equal(a, expect)
    return f"the kernel's reshape / permute chain gives A[m, kappa] = V[pi(kappa), sigma(m)] (kperm {kperm})"


def wavefronts(kperm=False) -> int:
    """Shared-memory wavefronts of a warp's 16 LDS.64 over its box (64-byte NVMMA swizzle: rows 2k, 2k + 1 share
    a 128-byte line, 16-byte chunks XORed with (row / 2) % 4): a half-warp a phase, its wavefronts the most
    distinct 4-byte words on one bank. 32 is the floor (4096 bytes, 128 a wavefront)."""
    bases = READ_BASES_KPERM if kperm else READ_BASES
    total = 0
    for reg in range(32):
        if reg & 4:  # (register bit 2: the load's second word)
            continue
        for half in range(2):
            banks: dict[int, set[int]] = {}
            for lane in range(16 * half, 16 * half + 16):
                for second in (0, 4):
                    _, pos, word = _apply(bases, [("reg_bases", reg | second), ("lane_bases", lane)])
                    col = 4 * word
                    at = pos * 64 + (((col // 16) ^ ((pos // 2) % 4)) * 16) + col % 16
                    banks.setdefault((at // 4) % 32, set()).add(at // 4)
            total += max(len(words) for words in banks.values())
    return total


def triton_conflicts(kperm=False) -> int:
    """Triton's own counter (GluonOpBuilder.get_shared_bank_conflicts: extra wavefronts) of the words read."""
    from triton._C.libtriton import gluon_ir, ir, nvidia

    ctx = ir.context()
    ir.load_dialects(ctx)
    nvidia.load_dialects(ctx)
    builder = gluon_ir.GluonOpBuilder(ctx)
    read = gl.DistributedLinearLayout(block_bases=[], shape=[4, 64, 16], **(READ_BASES_KPERM if kperm else READ_BASES))
    shared = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=3)
    return builder.get_shared_bank_conflicts(read._to_ir(builder), shared._to_ir(builder), [4, 64, 16], 32)


# ---- compile -------------------------------------------------------------------------------------------------


def _sass_counts(sass: str) -> dict[str, int]:
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[\w.]+)?)", sass)
    counts: dict[str, int] = {}
    for op in ops:
        key = op.split(".")[0]
        if key in ("LDS", "STS", "LDSM", "STSM"):
            key = op
        counts[key] = counts.get(key, 0) + 1
    return counts


def _loop_bodies(sass: str) -> list[str]:
    """Each loop of the SASS (a predicated backward BRA): its instruction count and kinds."""
    ops = [
        (int(at, 16), op)
        for at, op in re.findall(r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*(?:\.[\w.]+)?)", sass)
    ]
    out = []
    for match in re.finditer(r"/\*([0-9a-f]{4})\*/\s+@!?P\d\s+BRA\s+0x([0-9a-f]+)", sass):
        at, to = int(match.group(1), 16), int(match.group(2), 16)
        if to < at:
            body = [op for where, op in ops if to <= where <= at]
            kinds: dict[str, int] = {}
            for op in body:
                key = op if op.startswith("LDS") else op.split(".")[0]
                kinds[key] = kinds.get(key, 0) + 1
            out.append(f"{len(body)} instructions {dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", help="write each compiled kernel's ttgir / ptx / sass here")
    parser.add_argument("--model-only", action="store_true")
    args = parser.parse_args(argv)
    for kperm in (False, True):
        for n_valid in (64, 37):
            print(f"== model: {cpu_model(n_valid=n_valid, kperm=kperm)}")
        print(f"== model: {rename_model(kperm=kperm)}")
    for kperm in (False, True):
        print(
            f"== banks (kperm {kperm}): {wavefronts(kperm)} wavefronts a box (floor 32); Triton's counter: "
            f"{triton_conflicts(kperm)} conflicts"
        )
    print(
        "   sigma(m) for m = 0..15:",
        [sigma(m) for m in range(16)],
        "| sigma^-1(c) for c = 0..15:",
        [sigma_inv(c) for c in range(16)],
    )
    if args.model_only:
        return 0
    from triton.runtime.driver import driver

    os.environ.pop("TRITON_INTERPRET", None)
    driver.set_active(_OfflineHopperDriver())
    scratch = tempfile.mkdtemp()
    failures = 0
    f8 = torch.empty(64, 256, dtype=torch.float8_e4m3fn)
    p32 = torch.empty(64, 16, dtype=torch.float32)
    out = torch.empty(256, 16, dtype=torch.float32)
    for a_path, masked, kperm in [
        ("mov", False, False),
        ("mov", True, False),
        ("shift", False, False),
        ("mov", False, True),
        ("mov", True, True),
    ]:
        name = f"pv V:regs A_PATH:{a_path} masked:{masked} kperm:{kperm}"
        print(f"== {name}")
        log = os.path.join(scratch, "stderr.txt")
        try:
            with _stderr_to(log):
                kernel = pv_vregs_kernel.warmup(
                    f8,
                    p32,
                    out,
                    37,
                    N=16,
                    MASKED=masked,
                    A_PATH=a_path,
                    ASM=VT_ASM,
                    KPERM=kperm,
                    num_warps=4,
                    grid=(1,),
                )
        except Exception as error:
            failures += 1
            text = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
            print(f"   FAILED: {type(error).__name__}: {' | '.join(text[-3:])}")
            if _diagnostics(log):
                print(f"   stderr: {_diagnostics(log)}")
            continue
        ptx, sass_kinds = _kinds(kernel)
        sass = _sass(kernel.asm["cubin"])
        print(f"   compiled: shared {kernel.metadata.shared} B | {_resource_usage(kernel.asm['cubin'])}")
        print(f"   ptx {ptx} | sass {sass_kinds}")
        region = sass[sass.index("BAR.SYNC") : sass.index("WARPGROUP.ARRIVE")]
        print(f"   the A path (from the barrier after the fills to WARPGROUP.ARRIVE): {_sass_counts(region)}")
        fill = sass[: sass.index("BAR.SYNC")]
        print(
            f"   the fills (V boxes and P's store): {_sass_counts(fill).get('PRMT', 0)} PRMT, "
            f"{ {k: v for k, v in _sass_counts(fill).items() if k.startswith(('STS', 'STSM'))} }"
        )
        print(
            f"   whole kernel: byte extracts (PRMT ..0x77..) {len(re.findall(r'PRMT.*0x77', sass))}, "
            f"{ {k: v for k, v in _sass_counts(sass).items() if k in ('SHFL', 'LDL', 'STL', 'I2F', 'F2I')} }"
        )
        print("   " + "\n   ".join(sorted(set(re.findall(r"QGMMA\.[^;]*", sass)))[:2]))
        if args.dump:
            stem = os.path.join(args.dump, re.sub(r"\W+", "_", name))
            os.makedirs(args.dump, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                Path(f"{stem}.{ext}").write_text(kernel.asm[ext])
            Path(f"{stem}.sass").write_text(sass)
    for halves, kperm, branch in [
        (1, False, True),
        (1, False, False),
        (1, True, False),
        (2, False, False),
        (2, True, False),
    ]:
        name = f"loop halves:{halves} kperm:{kperm} branch_fp8:{branch}"
        print(f"== {name}")
        log = os.path.join(scratch, "stderr.txt")
        try:
            with _stderr_to(log):
                kernel = pv_loop_kernel.warmup(
                    f8,
                    p32,
                    out,
                    100,
                    37,
                    N=16,
                    HALVES=halves,
                    KPERM=kperm,
                    ASM=VT_ASM,
                    BRANCH_FP8=branch,
                    num_warps=4,
                    grid=(1,),
                )
        except Exception as error:
            failures += 1
            text = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
            print(f"   FAILED: {type(error).__name__}: {' | '.join(text[-3:])}")
            if _diagnostics(log):
                print(f"   stderr: {_diagnostics(log)}")
            continue
        sass = _sass(kernel.asm["cubin"])
        print(f"   compiled: shared {kernel.metadata.shared} B | {_resource_usage(kernel.asm['cubin'])}")
        for i, body in enumerate(_loop_bodies(sass)):
            print(f"   loop {i} (a block a thread): {body}")
        if args.dump:
            stem = os.path.join(args.dump, re.sub(r"\W+", "_", name))
            os.makedirs(args.dump, exist_ok=True)
            Path(f"{stem}.sass").write_text(sass)
    print(f"{failures} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
