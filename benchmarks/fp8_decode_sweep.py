"""fp8-cache decode on the GPU: tile configurations of the portable kernel against the bf16 cache's best, in
one process, every case checked against the reference first (dev tool for tuning the fp8 path).

    python benchmarks/fp8_decode_sweep.py [--before DIR] [--only H16,Mistral] [--configs 16:32,4,3 ...]

Per case: the bf16 cache with the module's own choice (backend auto: Gluon on Hopper), then the fp8 cache
on the portable kernel for every configuration asked (default: its row block's whole autotune space), and,
with --before, the fp8 modules of an earlier build (DIR/<module>.py, e.g. `git show REV:generated/...`)
with their default configuration. Timings are do_bench medians; prints a table, writes fp8_sweep.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import PAGE_SIZE, bytes_and_flops, check, make_inputs, median_ms, module_for  # noqa: E402

from mlagen_compiler import import_module_from_path  # noqa: E402

#: (name, bundled spec, heads, lengths, generated fp8 module of that geometry or None)
CASES = [
    ("H16 B128 S8192", "deepseek-v3-tp8", 16, [8192] * 128, "deepseek_v3_tp8_fp8"),
    ("H16 B64 S32768", "deepseek-v3-tp8", 16, [32768] * 64, "deepseek_v3_tp8_fp8"),
    ("H32 B128 S8192", "deepseek-v3-tp4", 32, [8192] * 128, None),
    ("H128 B128 S8192", "deepseek-v3-tp1", 128, [8192] * 128, None),
    ("Mistral-S4 H32 B128 S8192", "mistral-small-4", 32, [8192] * 128, "mistral_small_4_fp8"),
]


def timed(module, q, kv, table, lens, kv_scale, max_len, **schedule_args) -> tuple[float, str, str]:
    """(median µs, config text, error message or '') of one schedule, checked before it is timed."""
    batch, seqlen_q = q.shape[0], q.shape[1]
    schedule = module.get_decode_schedule(batch, seqlen_q, q.device, **schedule_args)
    out = torch.full((*q.shape[:3], module.KV_LORA_RANK), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((batch, module.NUM_HEADS, seqlen_q), float("nan"), device=q.device)
    scaled = {} if kv_scale is None else {"kv_scale": kv_scale}

    def call():
        module.mla_decode(q, kv, table, lens, schedule=schedule, out=out, lse=lse, return_lse=True, **scaled)

    call()
    _, _, msg = check(module, q, kv, table, lens, out, lse, max_len, kv_scale)
    config = (
        f"{schedule.backend} m{schedule.block_m} n{schedule.config[0]} "
        f"{'r' if schedule.backend == 'gluon' else 'w'}{schedule.config[1]} "
        f"s{schedule.config[2]} p{schedule.num_parts}"
    )
    return median_ms(call) * 1e3, config, msg


def report(rows: list[tuple], path: Path) -> None:
    """Print rows (case, cache, config, µs, bf16 µs, error, bytes) as a table and write them to `path` as JSON."""
    print("\n| case | cache | config | µs | vs bf16 | GB/s | ok |\n|---|---|---|---|---|---|---|")
    for name, label, text, us, bf16_us, msg, nbytes in rows:
        print(
            f"| {name} | {label} | {text} | {us:.1f} | {us / bf16_us:.2f}x | {nbytes / (us * 1e-6) / 1e9:.0f} | "
            f"{'yes' if not msg else 'NO: ' + msg} |"
        )
    keys = ("case", "cache", "config", "us", "bf16_us", "error", "bytes")
    path.write_text(json.dumps([dict(zip(keys, r, strict=True)) for r in rows], indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a folder of generated fp8 modules of an earlier build")
    parser.add_argument("--only", default="", help="cases whose name contains one of these (a,b,...)")
    parser.add_argument("--configs", nargs="*", default=[], help="block_m:block_n,num_warps,num_stages")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "modules"
    forced = [(int(m), tuple(int(v) for v in rest.split(","))) for m, rest in (t.split(":") for t in args.configs)]
    gen = torch.Generator().manual_seed(7)
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M}Z, page {PAGE_SIZE}",
        flush=True,
    )
    rows = []
    only = [s for s in args.only.split(",") if s]
    for name, spec, heads, seqlens, generated in CASES:
        if only and not any(s in name for s in only):
            continue
        max_len = max(seqlens)
        bf16 = module_for(spec, heads, tmp, "bf16")
        q, kv, table, lens, _ = make_inputs(bf16, seqlens, 1, gen)
        bf16_us, config, msg = timed(bf16, q, kv, table, lens, None, max_len)
        rows.append((name, "bf16", config, bf16_us, bf16_us, msg, bytes_and_flops(bf16, seqlens, 1)[0]))
        print(rows[-1], flush=True)
        del kv
        fp8 = module_for(spec, heads, tmp, "fp8")
        q, kv, table, lens, kv_scale = make_inputs(fp8, seqlens, 1, gen)
        nbytes = bytes_and_flops(fp8, seqlens, 1)[0]
        builds = [("fp8", fp8)]
        if args.before is not None and generated is not None and (args.before / f"{generated}.py").exists():
            builds.append(("fp8 before", import_module_from_path(args.before / f"{generated}.py")))
        for label, module in builds:
            schedule = module.get_decode_schedule(len(seqlens), 1, q.device)
            space = (
                []
                if label != "fp8"
                else (forced or [(schedule.block_m, c) for c in module.DECODE_SPACE[schedule.block_m]])
            )
            for block_m, config in [(None, None)] + space:
                knobs = {} if config is None else {"block_m": block_m, "config": config}
                try:
                    us, text, msg = timed(module, q, kv, table, lens, kv_scale, max_len, **knobs)
                except Exception as exc:  # a configuration that does not compile or fit: reported, not fatal
                    us, text, msg = float("nan"), f"m{block_m} {config}", f"{type(exc).__name__}: {exc}"[:200]
                rows.append((name, label, text, us, bf16_us, msg, nbytes))
                print(rows[-1], flush=True)
        del kv
        torch.cuda.empty_cache()
    report(rows, args.out / "fp8_sweep.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
