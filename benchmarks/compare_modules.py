"""Two builds of the same generated modules side by side on one GPU, in one process: the speed of a
change (e.g. a refactor that must leave the kernels as fast as they were), every case checked first.

    python benchmarks/compare_modules.py --before DIR_A --after DIR_B [--out DIR] [--only "tp1 B128,tp8 B1 "]

DIR_A / DIR_B hold generated modules (e.g. `git show REV:generated/x.py > DIR_A/x.py`). Cases run on the
bundled DeepSeek-V3 geometries (TP8/TP4/TP1) and Mistral-Small-4; each timing is the median of
`triton.testing.do_bench`, before and after interleaved (A, B, A, B) and the lower of each pair kept, so
drift between the two measurements does not favour either. Prints a table last; writes compare.json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlagen_compiler.compile import import_module_from_path  # noqa: E402
from mlagen_compiler.reference import decode_paged_batched, prefill_varlen  # noqa: E402
from mlagen_compiler.verify import LSE_TOLERANCE, compare  # noqa: E402

DECODE = [  # (module, B, S, Sq)
    ("deepseek_v3_tp8", 128, 8192, 1),
    ("deepseek_v3_tp8", 128, 8192, 2),
    ("deepseek_v3_tp4", 128, 8192, 1),
    ("deepseek_v3_tp1", 128, 8192, 1),
    ("deepseek_v3_tp1", 128, 8192, 2),
    ("deepseek_v3_tp1", 32, 8192, 1),
    ("mistral_small_4", 128, 8192, 1),
    ("deepseek_v3_tp8", 1, 8192, 1),
    ("deepseek_v3_tp1", 1, 8192, 1),
]
PREFILL = [("deepseek_v3_tp8", 4, 4096), ("deepseek_v3_tp1", 1, 4096)]  # (module, B, S), causal


def decode_inputs(module, batch, seqlen, seqlen_q, gen):
    page, width = module.PAGE_SIZE, module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    pages = -(-seqlen // page)
    table = torch.randperm(batch * pages, generator=gen).view(batch, pages).to(torch.int32).cuda()
    kv = torch.randn(batch * pages, page, 1, width, generator=gen).to(module.DTYPE).cuda()
    q = torch.randn(batch, seqlen_q, module.NUM_HEADS, width, generator=gen).to(module.DTYPE).cuda()
    return q, kv, table, torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")


def median_us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def interleaved(fn_a, fn_b) -> tuple[float, float]:
    a1, b1, a2, b2 = median_us(fn_a), median_us(fn_b), median_us(fn_a), median_us(fn_b)
    return min(a1, a2), min(b1, b2)


def check_decode(module, q, kv, table, lens, seqlen):
    out, lse = module.mla_decode(q, kv, table, lens, return_lse=True)
    want, want_lse = decode_paged_batched(q.float(), kv, table, lens, module.KV_LORA_RANK, module.SOFTMAX_SCALE, seqlen)
    message = compare(out, want, str(module.DTYPE).removeprefix("torch."))[2]
    torch.testing.assert_close(lse, want_lse.float(), **LSE_TOLERANCE)
    assert not message, message


def check_prefill(module, args):
    q, k_nope, k_pe, v, cu, max_len = args
    sample = slice(0, int(cu[1]))  # the first sequence against the float64 reference (whole: slow)
    out = module.mla_prefill(*args)
    one = torch.tensor([0, int(cu[1])], dtype=torch.int32)
    want, _ = prefill_varlen(
        q[sample].double().cpu(), k_nope[sample].double().cpu(), k_pe[sample].double().cpu(),
        v[sample].double().cpu(), one, module.SOFTMAX_SCALE,
    )  # fmt: skip
    message = compare(out[sample], want, "bfloat16")[2]
    assert not message, message


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--only", default="", help="cases whose name contains one of these (a,b,...)")
    args = parser.parse_args()
    only = [part for part in args.only.split(",") if part]

    def wanted(case: str) -> bool:
        return not only or any(part in case for part in only)

    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, batch, seqlen, seqlen_q in DECODE:
        if not wanted(f"{name} B{batch} S{seqlen} Sq{seqlen_q}"):
            continue
        mods = [
            import_module_from_path(d / f"{name}.py", f"cmp_{i}_{name}")
            for i, d in enumerate((args.before, args.after))
        ]
        q, kv, table, lens = decode_inputs(mods[0], batch, seqlen, seqlen_q, gen)
        calls = []
        for m in mods:
            check_decode(m, q, kv, table, lens, seqlen)
            sched = m.get_decode_schedule(batch, seqlen_q)
            out = torch.empty(batch, seqlen_q, m.NUM_HEADS, m.KV_LORA_RANK, dtype=m.DTYPE, device="cuda")
            calls.append(functools.partial(m.mla_decode, q, kv, table, lens, schedule=sched, out=out))
        before, after = interleaved(*calls)
        rows.append(
            dict(kernel="decode", case=f"{name} B{batch} S{seqlen} Sq{seqlen_q}", before_us=before, after_us=after)
        )
        print(rows[-1], flush=True)
    for name, batch, seqlen in PREFILL:
        if not wanted(f"prefill {name} B{batch} S{seqlen}"):
            continue
        mods = [
            import_module_from_path(d / f"{name}.py", f"cmpp_{i}_{name}")
            for i, d in enumerate((args.before, args.after))
        ]
        m0 = mods[0]
        total, h = batch * seqlen, m0.NUM_HEADS
        dn, dr, dv = m0.QK_NOPE_HEAD_DIM, m0.QK_ROPE_HEAD_DIM, m0.V_HEAD_DIM

        def rnd(*shape):
            return torch.randn(*shape, generator=gen).to(torch.bfloat16).cuda()

        cu = torch.arange(0, total + 1, seqlen, dtype=torch.int32, device="cuda")
        inputs = (rnd(total, h, dn + dr), rnd(total, h, dn), rnd(total, dr), rnd(total, h, dv), cu, seqlen)
        for m in mods:
            check_prefill(m, inputs)
        before, after = interleaved(*[functools.partial(m.mla_prefill, *inputs) for m in mods])
        rows.append(dict(kernel="prefill", case=f"{name} B{batch} S{seqlen}", before_us=before, after_us=after))
        print(rows[-1], flush=True)
    if not rows:
        known = [f"{n} B{b} S{s} Sq{q}" for n, b, s, q in DECODE] + [f"prefill {n} B{b} S{s}" for n, b, s in PREFILL]
        parser.error(f"--only {args.only!r} matches no case; cases: {', '.join(known)}")
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes")
    meta = dict(gpu=torch.cuda.get_device_name(), date=now, torch=torch.__version__, triton=triton.__version__)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"\n{meta['gpu']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}; all cases checked first")
    print("| kernel | case | before µs | after µs | after/before |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = r["after_us"] / r["before_us"]
        print(f"| {r['kernel']} | {r['case']} | {r['before_us']:.1f} | {r['after_us']:.1f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
