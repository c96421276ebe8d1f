"""Shared-memory wavefronts of the fp8 products' V^T write (cache_compute fp8), old and new, by a small bank model
(dev tool, CPU only: no compilation, no GPU).

    python benchmarks/probes/vt_banks.py

The converter warps read each landed [64 positions, 64 latent columns] e4m3 box (NVMMA layout, 64-byte rows,
64-byte swizzle) and write it transposed into the V^T stage ([64 columns, 64 positions], the same layout). For each
register layout of a read or a write (Triton's own linear layout of it: gl.to_linear_layout) the model lists every
warp instruction and counts its wavefronts. Three generations: old (8 positions x 4-8 columns a thread, bytes),
bytes (2 or 4 positions x 16 columns a thread, bytes: gl.permute per byte), words (the kernel's now: the box as
32-bit words, 4 positions x 4 words a thread, a 4 x 4 byte transpose in registers, one word a V^T row's 4
positions stored; _gluon_f8_vt_layout: a warp's lanes over 2 position quads, a word quad, 4 more position quads,
so that a quarter-warp's 8 loads reach all 4 chunks of their rows).

Assumptions (kept simple):
  - swizzle: the hardware's (PTX / TMA / wgmma) 64-byte mode, which Triton's NVMMASharedLayout(swizzle 64, 8-bit)
    follows: the 16-byte chunk index of a 64-byte row r is XORed with (r // 2) % 4, i.e. byte-address bits [5:4]
    ^= bits [8:7]; rows are 64 bytes, so rows 2k and 2k + 1 share one 128-byte line of the 32 banks;
  - an instruction moves, per thread, the largest run of elements contiguous both in the thread's registers and
    in one 16-byte chunk (at most 16 bytes: LDS/STS .32/.64/.128 for 4/8/16 bytes; 1 or 2 bytes are counted as
    such);
  - words: a load moves a thread's 4 consecutive words of one position (LDS.128); the store is counted per 128-byte
    group of one register across the 32 lanes (a word each): what an STS.32 writes, and what one 8 x 16-byte
    matrix of the STSM.16.M88.4 that Triton emits for it writes (lane t: word t % 4 of the matrix's row t / 4);
  - wavefronts of one warp instruction = the sum over its phases of the largest number of distinct 4-byte words
    any one bank is asked for in the phase (a word asked by several threads is one); the phases: 16-byte accesses
    are served a quarter-warp (8 lanes) at a time, 8-byte ones a half-warp, narrower ones the whole warp (as
    Triton's counter has it: 1 extra wavefront a quarter-warp for the bytes read, and 3 for a words read whose
    quarter-warps reach 2 of a row's 4 chunks, a lane order tried first); no pipelining across instructions; 128
    bytes a wavefront at best.
Triton's own counter of a read (GluonOpBuilder.get_shared_bank_conflicts: extra wavefronts, by its own vector
choice) is printed beside it as a cross-check. The old read compiled to LDSM.16.M88.4 (an 8 x 16-byte matrix per
8 lanes, the same rows 8 positions apart): the same addresses, so the same count. A lane basis mixing positions and
columns would do better (2 + 2 wavefronts per 128 bytes with 8-byte stores) but Gluon's distributed layouts take
bases along one dimension only.
"""

from __future__ import annotations

from collections import defaultdict

ROW_BYTES = 64
SWIZZLE_BYTES = 64
#: lanes served together by bytes a thread: 16-byte accesses in quarter-warps, 8-byte in half-warps
_PHASE_LANES = {16: 8, 8: 16}


def swizzled(row: int, col: int) -> int:
    """Byte offset of element (row, col) of a [rows, 64] 8-bit tile in the 64-byte NVMMA swizzle."""
    per_phase = 128 // SWIZZLE_BYTES  # rows that share a phase
    max_phase = SWIZZLE_BYTES // 16  # 16-byte chunks a swizzle period
    chunk = (col // 16) ^ ((row // per_phase) % max_phase)
    return row * ROW_BYTES + chunk * 16 + col % 16


def _apply(bases, index):
    """The [row, col] that the set bits of `index` select: the XOR of those bases (a linear layout over GF(2))."""
    out = [0, 0]
    bit = 0
    while index:
        if index & 1:
            out = [out[0] ^ bases[bit][0], out[1] ^ bases[bit][1]]
        index >>= 1
        bit += 1
    return out


def instructions(linear, transpose: bool = False):
    """Per warp instruction (a warp and a vector of registers): (bytes a thread, the 32 threads' [row, col]) of a
    [64, 64] 8-bit tile in a distributed linear layout (reg / lane / warp bases); transpose: the tile addressed is
    the layout's transpose (gl.permute(x, (1, 0)) stored)."""
    reg, lane, warp = linear.reg_bases, linear.lane_bases, linear.warp_bases
    if transpose:
        reg, lane, warp = ([[b[1], b[0]] for b in bs] for bs in (reg, lane, warp))
    # the thread's contiguous run: register bases stepping the column by 1, 2, 4, ... (inside a 16-byte chunk)
    vector = []
    while len(vector) < 4 and [0, 1 << len(vector)] in reg:
        vector.append(reg.index([0, 1 << len(vector)]))
    others = [b for i, b in enumerate(reg) if i not in vector]
    for w in range(1 << len(warp)):
        for r in range(1 << len(others)):
            base = _apply(others, r)
            yield (
                1 << len(vector),
                [
                    [a ^ b ^ c for a, b, c in zip(base, _apply(lane, t), _apply(warp, w), strict=True)]
                    for t in range(32)
                ],
            )


def wavefronts(linear, transpose: bool = False) -> tuple[int, int, int]:
    """(instructions, wavefronts, vector bytes) of one [64, 64] tile read or written in `linear`."""
    total = count = 0
    vec = 1
    for vec, threads in instructions(linear, transpose):
        phase = _PHASE_LANES.get(vec, 32)
        for first in range(0, 32, phase):
            words = defaultdict(set)
            for row, col in threads[first : first + phase]:
                start = swizzled(row, col)
                for byte in range(start, start + vec):
                    words[(byte // 4) % 32].add(byte // 4)
            total += max(len(v) for v in words.values())
        count += 1
    return count, total, vec


def word_wavefronts(linear, boxes: int, write: bool) -> tuple[int, int, int]:
    """(instructions, wavefronts, bytes a thread an instruction) of the words read (write False) or the V^T words
    written (write True) of `boxes` [64, 64] boxes, the register tensor [boxes, 64 positions, 16 words] in
    `linear`: element (b, 4p + k, w) is read from box b's row 4p + k, bytes 4w..4w + 3, and (after the transpose)
    written to V^T row 4w + k of box b, bytes 4p..4p + 3."""
    reg, lane, warp = linear.reg_bases, linear.lane_bases, linear.warp_bases
    vector = []
    if not write:  # the thread's run of words of one position (at most 16 bytes)
        while len(vector) < 2 and [0, 0, 1 << len(vector)] in reg:
            vector.append(reg.index([0, 0, 1 << len(vector)]))
    others = [b for i, b in enumerate(reg) if i not in vector]
    total = count = 0
    for w in range(1 << len(warp)):
        for r in range(1 << len(others)):
            phase = _PHASE_LANES.get(4 << len(vector), 32)
            for first in range(0, 32, phase):
                words = defaultdict(set)
                for t in range(first, first + phase):
                    box, pos, word = (
                        _apply3(others, r)[i] ^ _apply3(lane, t)[i] ^ _apply3(warp, w)[i] for i in range(3)
                    )
                    for v in range(1 << len(vector)):
                        if write:
                            start = box * 4096 + swizzled(4 * word + pos % 4, 4 * (pos // 4))
                        else:
                            start = box * 4096 + swizzled(pos, 4 * (word + v))
                        words[(start // 4) % 32].add(start // 4)
                total += max(len(v) for v in words.values())
            count += 1
    return count // boxes, total // boxes, 4 << len(vector)


def _apply3(bases, index):
    """_apply for rank-3 bases."""
    out = [0, 0, 0]
    bit = 0
    while index:
        if index & 1:
            out = [a ^ b for a, b in zip(out, bases[bit], strict=True)]
        index >>= 1
        bit += 1
    return out


def main() -> None:
    from triton._C.libtriton import gluon_ir, ir, nvidia
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._semantic import GluonSemantic

    ctx = ir.context()
    ir.load_dialects(ctx)
    nvidia.load_dialects(ctx)
    builder = gluon_ir.GluonOpBuilder(ctx)
    semantic = GluonSemantic(builder)
    shared = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float8e4nv)

    def linear(layout, shape=(64, 64)):
        return semantic.to_linear_layout(layout, list(shape)).value

    def triton_count(layout):
        return builder.get_shared_bank_conflicts(layout._to_ir(builder), shared._to_ir(builder), [64, 64], 8)

    for warps in (4, 2):
        old = gl.BlockedLayout([8, max(1, 64 // (4 * warps))], [8, 4], [1, warps], [1, 0])
        # decode_gluon.py.jinja's _gluon_f8_vt_layout
        new = (
            gl.BlockedLayout([2, 16], [32, 1], [1, 4], [1, 0])
            if warps == 4
            else gl.BlockedLayout([4, 16], [16, 2], [1, 2], [1, 0])
        )
        # decode_gluon.py.jinja's _gluon_f8_vt_layout now: [warps / 2 boxes, 64 positions, 16 words] of 32 bits
        boxes = warps // 2
        words = gl.DistributedLinearLayout(
            reg_bases=[[0, 1, 0], [0, 2, 0], [0, 0, 1], [0, 0, 2]],
            lane_bases=[[0, 4, 0], [0, 8, 0], [0, 0, 4], [0, 16, 0], [0, 32, 0]],
            warp_bases=[[0, 0, 8]] + ([[1, 0, 0]] if warps == 4 else []),
            block_bases=[],
            shape=[boxes, 64, 16],
        )
        words_shared = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=3)
        print(f"# {warps} converter warps, one [64, 64] e4m3 box (4096 bytes: 32 wavefronts at best each way)")
        for name, layout, transpose in (
            ("old read   (8 positions x 4-8 columns a thread)", old, False),
            ("old write  (the same, permuted)", old, True),
            (f"bytes read  ({8 // warps} positions x 16 columns a thread)", new, False),
            ("bytes write (the same, permuted)", new, True),
        ):
            n, w, vec = wavefronts(linear(layout), transpose)
            counter = f" (Triton's counter: {triton_count(layout)} conflicts)" if not transpose else ""
            print(f"{name:48s} {n:3d} warp instructions of {vec:2d} bytes, {w:4d} wavefronts{counter}")
        for name, write in (
            ("words read  (4 positions x 4 words a thread)", False),
            ("words write (4 x 4 byte transposes, a word each)", True),
        ):
            n, w, vec = word_wavefronts(linear(words, (boxes, 64, 16)), boxes, write)
            unit = "128-byte groups (4 an STSM.x4)" if write else "warp instructions"
            counter = ""
            if not write:
                extra = builder.get_shared_bank_conflicts(
                    words._to_ir(builder), words_shared._to_ir(builder), [boxes, 64, 16], 32
                )
                counter = f" (Triton's counter: {extra} conflicts)"
            print(f"{name:48s} {n:3d} {unit} of {vec:2d} bytes, {w:4d} wavefronts a box{counter}")


if __name__ == "__main__":
    main()
