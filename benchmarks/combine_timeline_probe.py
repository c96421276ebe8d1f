"""Where the combine launch's time goes on small and skewed batches (issue 11; dev tool, H100): the generated
module's combine kernel with %globaltimer stamps at its milestones, written per program into a buffer whose
address is baked into the probe's copy of the module (the module itself is unchanged; the probe's results are
checked against the reference, the stamps do not touch the outputs).

    python benchmarks/combine_timeline_probe.py [--out DIR] [--only NAME,...]

Milestones, per program (sequence, row tile, column tile): entry; split schedule done; the split launch waited
for (gdc_wait, PDL); the first step's partial rows loaded; the rows merged; their stores issued. Per case, for
the programs of split sequences, by how many runs their sequence has ("heavy": more than a quarter of the
launch's runs; "light": the others): the median (min-max) of each milestone since the program's entry, how
the entries spread (waves of programs), and the last store since the first entry; with the replay time of a
CUDA graph of the whole call, with the stamps and without.
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
from gluon_timeline_probe import stamped_run  # noqa: E402

MILESTONES = ["entry", "schedule", "split waited for", "step 1 loaded", "merged", "stores issued"]
#: slot holding the program's sequence's run count (not a time)
RUNS_SLOT = 6
SLOTS = 8

_STAMP = """@triton.jit
def _probe_stamp(slot: tl.constexpr, dep):
    pid = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
    base = tl.full([], {address}, tl.int64).to(tl.pointer_type(tl.int64), bitcast=True)
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64,
                                    is_pure=False, pack=1)
    tl.store(base + pid * {slots} + slot, now)


"""

_KERNEL = "@triton.jit\ndef _mla_decode_combine_kernel("


def probe_edits(address: int) -> list[tuple[str, str]]:
    """(text, replacement) edits of the generated module; each text must occur exactly once."""
    runs_store = (
        f"    _probe_store_runs = tl.full([], {address}, tl.int64).to(tl.pointer_type(tl.int64), bitcast=True)\n"
    )
    return [
        (_KERNEL, _STAMP.format(address=address, slots=SLOTS) + _KERNEL),
        (
            "    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)\n"
            "    # (cache_seqlens is not written by the split launch: it may be read before waiting for it)\n",
            "    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)\n    _probe_stamp(0, b)\n"
            "    # (cache_seqlens is not written by the split launch: it may be read before waiting for it)\n",
        ),
        (
            "        SEQLENS, batch, num_parts, min_blocks_per_part, BLOCK_N, BLOCK_B, SEQUENCE_RUNS)\n"
            "    if PDL:\n"
            "        # wait for the split launch to end",
            "        SEQLENS, batch, num_parts, min_blocks_per_part, BLOCK_N, BLOCK_B, SEQUENCE_RUNS)\n"
            "    _probe_stamp(1, per_part)\n"
            "    if PDL:\n"
            "        # wait for the split launch to end",
        ),
        (
            "    seq_blocks = tl.cdiv(tl.maximum(tl.load(SEQLENS + b), 0), BLOCK_N)  # as _split_schedule counts it\n"
            "    seq_start = tl.sum(tl.where(offs_b < b, n_blocks, 0), 0)\n",
            "    _probe_stamp(2, b)\n"
            "    seq_blocks = tl.cdiv(tl.maximum(tl.load(SEQLENS + b), 0), BLOCK_N)  # as _split_schedule counts it\n"
            "    seq_start = tl.sum(tl.where(offs_b < b, n_blocks, 0), 0)\n",
        ),
        (
            "    write_lse = tl.program_id(2) == 0\n    if n_runs == 0:\n",
            "    write_lse = tl.program_id(2) == 0\n"
            + runs_store
            + "    _probe_pid = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0)"
            " + tl.program_id(0)\n"
            f"    tl.store(_probe_store_runs + _probe_pid * {SLOTS} + {RUNS_SLOT}, n_runs.to(tl.int64))\n"
            "    if n_runs == 0:\n",
        ),
        (
            "            m_prev = m\n            m = tl.maximum(m, tl.max(lse_i, 0))\n",
            "            if i0 == 0:\n"
            "                _probe_stamp(3, tl.sum(tl.sum(tl.sum(o_i.to(tl.float32), 0), 0), 0))\n"
            "            m_prev = m\n            m = tl.maximum(m, tl.max(lse_i, 0))\n",
        ),
        (
            "        out, lse = _merge_finish(acc, weight, _lse_reference(m))\n"
            "        tl.store(o_ptrs[:, None] + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)\n"
            "        if write_lse:\n            tl.store(lse_ptrs, lse, mask=row_ok)\n",
            "        out, lse = _merge_finish(acc, weight, _lse_reference(m))\n"
            "        _probe_stamp(4, tl.sum(tl.sum(out, 0), 0))\n"
            "        tl.store(o_ptrs[:, None] + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)\n"
            "        if write_lse:\n            tl.store(lse_ptrs, lse, mask=row_ok)\n"
            "        _probe_stamp(5, b)\n",
        ),
    ]


#: (name, bundled spec, heads, lengths, seqlen_q)
CASES = [
    ("B1 H16 S8192", "deepseek-v3-tp8", 16, [8192], 1),
    ("B8 H16 S8192", "deepseek-v3-tp8", 16, [8192] * 8, 1),
    ("skewed H16 Sq1", "deepseek-v3-tp8", 16, [4641, 45118, 1730, 1696], 1),
    ("skewed H16 Sq4", "deepseek-v3-tp8", 16, [4641, 45118, 1730, 1696], 4),
    ("B8 H128 S8192", "deepseek-v3-tp1", 128, [8192] * 8, 1),
]


def _summary(label: str, t: torch.Tensor, chosen: torch.Tensor) -> list[str]:
    """Milestone rows of the chosen programs (t: µs, entry in column 0)."""
    lines = [f"{label}: {int(chosen.sum())} programs"]
    if not chosen.any():
        return lines
    entry = t[chosen, 0]
    lines.append("| milestone | median | min | max |\n|---|---|---|---|")
    for slot, name in enumerate(MILESTONES[1:], start=1):
        seen = t[chosen, slot] > 0
        if not seen.any():
            lines.append(f"| {name} | - | - | - |")
            continue
        d = (t[chosen, slot][seen] - entry[seen]).sort().values
        lines.append(f"| {name} | {float(d.median()):.2f} | {float(d[0]):.2f} | {float(d[-1]):.2f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--only", default="", help="cases whose name contains one of these (a,b,...)")
    parser.add_argument("--variant", default="", help="fp8_converter_variants edits ('+'-joined) of the module")
    args = parser.parse_args()
    only = [text for text in args.only.split(",") if text]
    tmp = args.out / "modules"
    tmp.mkdir(parents=True, exist_ok=True)
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M}Z; combine programs, µs",
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
        batch = len(seqlens)
        base_schedule = base.get_decode_schedule(batch, seqlen_q, q.device, merge="kernel")
        tile_rows, tile_cols = base_schedule.combine_tile
        programs = batch * -(-seqlen_q * heads // tile_rows) * -(-base.KV_LORA_RANK // tile_cols)
        stamps = torch.zeros(programs, SLOTS, dtype=torch.int64, device=q.device)
        module = edited_module(base, probe_edits(stamps.data_ptr()), tmp, f"combine_timeline_{stamps.data_ptr():x}")
        schedule = module.get_decode_schedule(batch, seqlen_q, q.device, merge="kernel")
        msg, graph_us, plain_us = stamped_run(module, schedule, base, base_schedule, (q, kv, table, lens), stamps)
        runs = stamps[:, RUNS_SLOT].cpu()
        t = stamps[:, :RUNS_SLOT].double().cpu() / 1e3  # ns -> µs
        first = float(t[:, 0].min())
        print(
            f"\n## {name}: {schedule.backend} split, {schedule.num_parts} runs, combine tile {schedule.combine_tile} "
            f"x {schedule.combine_runs} runs a step, {programs} programs; graph replay {graph_us:.1f} µs with "
            f"stamps, {plain_us:.1f} without; correct: {msg or 'yes'}"
        )
        entries = (t[:, 0] - first).sort().values
        quantiles = ", ".join(
            f"{share:.0%} {float(entries[int(share * (len(entries) - 1))]):.2f}" for share in (0.25, 0.5, 0.75, 1)
        )
        print(f"entries since the first: {quantiles}")
        stored = t[:, 5] > 0
        if stored.any():
            print(f"last store issued {float(t[stored, 5].max()) - first:.2f} µs after the first entry")
        heavy = runs > schedule.num_parts // 4
        groups = (("heavy sequences", heavy), ("light sequences", (runs > 1) & ~heavy), ("whole", runs <= 1))
        for label, chosen in groups:
            print("\n".join(_summary(f"### {label}", t, chosen)))
        del kv
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
