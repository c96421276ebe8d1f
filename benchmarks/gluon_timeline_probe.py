"""Where a Gluon decode program's time goes on small batches (issue 11; dev tool, H100): the generated
module's kernel with %globaltimer stamps at its milestones, written per program into a buffer whose address
is baked into the probe's copy of the module. The module itself is unchanged; the probe's results are
checked against the reference (the stamps do not touch the outputs).

    python benchmarks/gluon_timeline_probe.py [--out DIR]

Milestones, per program (row block, run): entry; split schedule done; first page-table entry loaded
(producer); query tile landed, first block landed, first block's P @ V done, piece stored (softmax
warpgroup); P @ V warpgroup's piece stored; after the partitions join. Per case: the median over programs of
each milestone's time since the program's entry, the spread of the entries (launch skew) and the last
milestone since the first entry; with the kernel's time under CUDA-graph replay (do_bench_cudagraph), for
which the stamps add nothing measurable (they are one store per warp each).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import make_inputs, module_for  # noqa: E402
from fp8_converter_variants import edited_module, variant_module  # noqa: E402
from fp8_decode_sweep import check  # noqa: E402

MILESTONES = [
    "entry",
    "schedule",
    "page loaded (producer)",
    "query landed",
    "block 1 landed",
    "block 1 P@V done",
    "softmax wg stored",
    "P@V wg stored",
    "joined",
    "softmax wg: row sums handed over",
    "softmax wg: LSE stored",
    "P@V wg: row sums received",
    "softmax wg: last block done",
    "softmax wg store: 1 / row sums",
    "softmax wg store: rows divided",
    "softmax wg store: stores issued",
]
SLOTS = 16

#: the stamp helper, defined beside the module's Gluon kernels (one level in, under the import guard)
_STAMP = """    @gluon.jit
    def _probe_stamp(slot: gl.constexpr, dep):
        pid = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        base = gl.to_tensor({address}).to(gl.int64).to(gl.pointer_type(gl.int64), bitcast=True)
        now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=gl.int64,
                                        is_pure=False, pack=1)
        gl.store(base + pid * {slots} + slot, now)


"""

_KERNEL = "    @gluon.jit\n    def _mla_decode_gluon_kernel("
#: a stamp on a partition's first piece only, at the indentation of a piece's body
_FIRST_PIECE = "                if piece == 0:\n                    _probe_stamp({slot}, piece)\n"
#: the end of a partition's store of its output half (the softmax and the P @ V warpgroup differ in `first`)
_STORED = (
    "{first}, stride_o_s, stride_o_h, stride_op_slot, stride_op_row,\n"
    "                                  SQ, H, DC_HALF, BLOCK_M, SCALED, NARROW, PARTIAL_STORE)\n"
)


def probe_edits(address: int) -> list[tuple[str, str]]:
    """(text, replacement) edits of the generated module; each text must occur exactly once."""
    return [
        (_KERNEL, _STAMP.format(address=address, slots=SLOTS) + _KERNEL),
        ("        part = gl.program_id(1)\n", "        part = gl.program_id(1)\n        _probe_stamp(0, part)\n"),
        (
            "            SEQLENS, batch, num_parts, min_blocks_per_part, part, BLOCK_N, BLOCK_B, SEQUENCE_RUNS)\n",
            "            SEQLENS, batch, num_parts, min_blocks_per_part, part, BLOCK_N, BLOCK_B, SEQUENCE_RUNS)\n"
            "        _probe_stamp(1, run_hi)\n",
        ),
        (
            "                    page = gl.load(bt_row + (blk * BLOCK_N) // PAGE_SIZE)\n",
            "                    page = gl.load(bt_row + (blk * BLOCK_N) // PAGE_SIZE)\n"
            "                    if it == 0:\n"
            "                        _probe_stamp(2, page)\n",
        ),
        (
            "                mbarrier.wait(q_ready, piece & 1)\n",
            "                mbarrier.wait(q_ready, piece & 1)\n                if piece == 0:\n"
            "                    _probe_stamp(3, piece)\n",
        ),
        (
            "        mbarrier.wait(k_ready.index(stage), (it // STAGES) & 1)\n        k_c = k_smem_c.index(stage)\n",
            "        mbarrier.wait(k_ready.index(stage), (it // STAGES) & 1)\n        if it == 0:\n"
            "            _probe_stamp(4, it)\n        k_c = k_smem_c.index(stage)\n",
        ),
        (
            "        acc = warpgroup_mma_wait(0, deps=(acc,))\n        mbarrier.arrive(k_free.index(stage))\n",
            "        acc = warpgroup_mma_wait(0, deps=(acc,))\n        if it == 0:\n"
            "            _probe_stamp(5, it)\n        mbarrier.arrive(k_free.index(stage))\n",
        ),
        (
            _STORED.format(first="\n                                  stride_o_b"),
            _STORED.format(first="\n                                  stride_o_b") + "                if piece == 0:\n"
            "                    _probe_stamp(6, piece)\n",
        ),
        (
            _STORED.format(first="DC_HALF, kv_scale, stride_o_b"),
            _STORED.format(first="DC_HALF, kv_scale, stride_o_b") + "                if piece == 0:\n"
            "                    _probe_stamp(7, piece)\n",
        ),
        (
            "                mbarrier.arrive(l_ready)\n",
            "                mbarrier.arrive(l_ready)\n" + _FIRST_PIECE.format(slot=9),
        ),
        (
            "                # every Q K^T of the piece has completed: the producer may load the next query tile\n",
            "                if piece == 0:\n                    _probe_stamp(12, piece)\n"
            "                # every Q K^T of the piece has completed: the producer may load the next query tile\n",
        ),
        (
            "                _gluon_store_half(acc, l_i, OUT, O_PART, b, slot, row_block, final, 0, kv_scale,\n",
            "                if piece == 0:\n                    _probe_stamp(10, piece)\n"
            "                _gluon_store_half(acc, l_i, OUT, O_PART, b, slot, row_block, final, 0, kv_scale,\n",
        ),
        (
            "                mbarrier.arrive(l_free)\n",
            "                mbarrier.arrive(l_free)\n" + _FIRST_PIECE.format(slot=11),
        ),
        (
            "        else:\n            inv_l = 1.0 / gl.where(l_i > 0.0, l_i, 1.0)\n",
            "        else:\n            inv_l = 1.0 / gl.where(l_i > 0.0, l_i, 1.0)\n"
            "        if col0 == 0:\n            _probe_stamp(13, gl.sum(inv_l, 0))\n",
        ),
        (
            "            rows_axis: gl.constexpr = 1\n",
            "            rows_axis: gl.constexpr = 1\n"
            "        if col0 == 0:\n            _probe_stamp(14, gl.sum(gl.sum(out, 1), 0))\n",
        ),
        (
            "                 eviction_policy=PARTIAL_STORE)\n\n\n",
            "                 eviction_policy=PARTIAL_STORE)\n"
            "        if col0 == 0:\n            _probe_stamp(15, b)\n\n\n",
        ),
        (
            "        ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])\n",
            "        ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])\n        _probe_stamp(8, part)\n",
        ),
    ]


def probed_module(module, address: int, folder: Path):
    """A copy of the module with the stamps."""
    return edited_module(module, probe_edits(address), folder, f"timeline_{address:x}")


def stamped_run(module, schedule, base, base_schedule, inputs, stamps: torch.Tensor) -> tuple[str, float, float]:
    """Runs the probed module's call once and checks it against the reference (on NaN-filled outputs), times it
    and the unprobed module's call under CUDA-graph replay, then fills `stamps` from one more call.
    Returns (the check's message, '' when correct; µs with the stamps; µs without)."""
    q, kv, table, lens = inputs
    out = torch.full((*q.shape[:3], base.KV_LORA_RANK), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)

    def call(module=module, schedule=schedule):
        module.mla_decode(*inputs, schedule=schedule, out=out, lse=lse, return_lse=True)

    call()
    _, _, msg = check(module, q, kv, table, lens, out, lse, int(lens.max()), None)
    graph_us = triton.testing.do_bench_cudagraph(call, rep=200) * 1e3
    plain_us = triton.testing.do_bench_cudagraph(lambda: call(base, base_schedule), rep=200) * 1e3
    stamps.zero_()
    call()
    torch.cuda.synchronize()
    return msg, graph_us, plain_us


#: (name, bundled spec, heads, lengths, seqlen_q)
CASES = [
    ("B1 H16 S8192", "deepseek-v3-tp8", 16, [8192], 1),
    ("B1 H128 S8192", "deepseek-v3-tp1", 128, [8192], 1),
    ("B8 H16 S8192", "deepseek-v3-tp8", 16, [8192] * 8, 1),
    ("skewed H16 Sq1", "deepseek-v3-tp8", 16, [4641, 45118, 1730, 1696], 1),
    ("skewed H16 Sq4", "deepseek-v3-tp8", 16, [4641, 45118, 1730, 1696], 4),
    ("B132 H16 S64 (one block a program)", "deepseek-v3-tp8", 16, [64] * 132, 1),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--only", default="", help="cases whose name contains one of these (a,b,...)")
    parser.add_argument("--variant", default="", help="fp8_converter_variants edits ('+'-joined) of the module")
    args = parser.parse_args()
    only = [text for text in args.only.split(",") if text]
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "modules"
    tmp.mkdir(exist_ok=True)
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M}Z; µs since each program's entry, "
        "median over programs (min-max)",
        flush=True,
    )
    gen = torch.Generator().manual_seed(5)
    for name, spec, heads, seqlens, seqlen_q in CASES:
        if only and not any(text in name for text in only):
            continue
        base = module_for(spec, heads, tmp, "bf16")
        if args.variant:
            base = variant_module(base, args.variant.split("+"), tmp)
        q, kv, table, lens, _ = make_inputs(base, seqlens, seqlen_q, gen)
        base_schedule = base.get_decode_schedule(len(seqlens), seqlen_q, q.device, backend="gluon", merge="kernel")
        programs = base_schedule.row_blocks * base_schedule.num_parts
        stamps = torch.zeros(programs, SLOTS, dtype=torch.int64, device=q.device)
        module = probed_module(base, stamps.data_ptr(), tmp)
        schedule = module.get_decode_schedule(len(seqlens), seqlen_q, q.device, backend="gluon", merge="kernel")
        msg, graph_us, plain_us = stamped_run(module, schedule, base, base_schedule, (q, kv, table, lens), stamps)
        t = stamps.double().cpu() / 1e3  # ns -> µs
        entry = t[:, 0]
        print(
            f"\n## {name}: {programs} programs ({schedule.row_blocks} row blocks x {schedule.num_parts} runs); "
            f"graph replay {graph_us:.1f} µs with stamps, {plain_us:.1f} without; correct: {msg or 'yes'}"
        )
        print(f"entries spread over {float(entry.max() - entry.min()):.2f} µs")
        print("| milestone | median | min | max | programs |\n|---|---|---|---|---|")
        for slot, label in enumerate(MILESTONES):
            seen = t[:, slot] > 0
            if not seen.any():
                print(f"| {label} | - | - | - | 0 |")
                continue
            d = (t[seen, slot] - entry[seen]).sort().values
            print(f"| {label} | {float(d.median()):.2f} | {float(d[0]):.2f} | {float(d[-1]):.2f} | {int(seen.sum())} |")
        last = t[:, : len(MILESTONES)].max()
        print(f"last milestone {float(last - entry.min()):.2f} µs after the first entry")
        del kv
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
