"""Where the host time of one decode call goes (GPU machine): back-to-back calls timed with and without the
direct launch (MLAGEN_DIRECT_LAUNCH), with `schedule=`, `out=`, `lse=` passed and bare (none of them), per
backend and batch; then the direct calls profiled with cProfile (top functions by own time).

    python benchmarks/host_profile.py [--spec deepseek_v3_tp8] [--module path/to/module.py] [--batch 1 128]
        [--backend gluon triton] [--profile]

--module times a module file (e.g. a copy of an older generated module, for a before/after comparison).
Times are the host's: the calls are not synchronised (each sample of --calls calls is, before and after).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def load(path: Path, direct: bool):
    """A fresh import of the module file (the direct launch is read at import)."""
    os.environ["MLAGEN_DIRECT_LAUNCH"] = "1" if direct else "0"
    name = f"_host_profile_{path.stem}_{int(direct)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def inputs(module, batch: int, seqlen: int):
    """q, kv_cache, block_table, cache_seqlens of a batch of `batch` sequences of `seqlen` tokens (pages shuffled)."""
    gen = torch.Generator().manual_seed(0)
    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    pages_per_seq = -(-seqlen // module.PAGE_SIZE)
    table = torch.randperm(batch * pages_per_seq, generator=gen).to(torch.int32).view(batch, pages_per_seq)
    kv = torch.randn(batch * pages_per_seq, module.PAGE_SIZE, 1, width, device="cuda").to(module.CACHE_DTYPE)
    q = torch.randn(batch, 1, module.NUM_HEADS, width, dtype=module.DTYPE, device="cuda")
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    return q, kv, table.cuda(), lens


def time_calls(call, calls: int, samples: int = 7) -> list[float]:
    """Host microseconds per call of `samples` runs of `calls` back-to-back calls (synchronised between runs)."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    result = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        result.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="deepseek_v3_tp8")
    parser.add_argument("--module", type=Path, help="module file to time (default: generated/<spec>.py)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--backend", nargs="+", default=["auto"])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--profile", action="store_true", help="cProfile the direct calls with schedule=")
    args = parser.parse_args()
    path = args.module or ROOT / "generated" / f"{args.spec}.py"
    print(f"{path.name} on {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for direct in (False, True):
        module = load(path, direct)
        kv_scale = 1.0 if module.CACHE_SCALED else None
        for backend in args.backend:
            for batch in args.batch:
                q, kv, table, lens = inputs(module, batch, args.seqlen)
                os.environ["MLAGEN_DECODE_BACKEND"] = backend  # what bare calls plan with
                schedule = module.get_decode_schedule(batch, 1, q.device, backend=backend)
                out, lse = module.mla_decode(q, kv, table, lens, schedule=schedule, return_lse=True, kv_scale=kv_scale)

                def with_schedule(
                    q=q, kv=kv, table=table, lens=lens, schedule=schedule, out=out, lse=lse, m=module, s=kv_scale
                ):
                    m.mla_decode(q, kv, table, lens, schedule=schedule, out=out, lse=lse, kv_scale=s)

                def bare(q=q, kv=kv, table=table, lens=lens, m=module, s=kv_scale):
                    m.mla_decode(q, kv, table, lens, kv_scale=s)

                reference = module.mla_decode(q, kv, table, lens, return_lse=True, kv_scale=kv_scale)
                for name, call in (("schedule=", with_schedule), ("bare", bare)):
                    times = time_calls(call, args.calls)
                    print(
                        f"direct={int(direct)} backend={schedule.backend} merge={schedule.merge} B{batch} "
                        f"H{module.NUM_HEADS} S{args.seqlen} {name:9s}: host us per call median "
                        f"{statistics.median(times):7.1f}  min {times[0]:7.1f}  max {times[-1]:7.1f}",
                        flush=True,
                    )
                again = module.mla_decode(q, kv, table, lens, schedule=schedule, return_lse=True, kv_scale=kv_scale)
                torch.cuda.synchronize()
                same = all(torch.equal(a, b) for a, b in zip(reference, again, strict=True))
                print(f"    bare and schedule= results equal: {same}", flush=True)
                if direct and args.profile:
                    profiler = cProfile.Profile()
                    profiler.enable()
                    for _ in range(args.calls):
                        with_schedule()
                    profiler.disable()
                    torch.cuda.synchronize()
                    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
        os.environ.pop("MLAGEN_DECODE_BACKEND", None)


if __name__ == "__main__":
    main()
