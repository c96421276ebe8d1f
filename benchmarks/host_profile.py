"""Where the host time of one decode call goes (GPU machine): back-to-back calls with schedule/out/lse
passed, timed with and without the direct launch, then profiled with cProfile (top functions by own time).

    python benchmarks/host_profile.py [--spec deepseek-v3-tp8] [--batch 1] [--backend auto]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlagen_compiler.verify import paged_block_table  # noqa: E402


def load(module_name: str, direct: bool):
    os.environ["MLAGEN_DIRECT_LAUNCH"] = "1" if direct else "0"
    sys.modules.pop(f"generated.{module_name}", None)
    return importlib.import_module(f"generated.{module_name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="deepseek_v3_tp8")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    for direct in (False, True):
        module = load(args.spec, direct)
        width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
        seqlens = [args.seqlen] * args.batch
        table, pages = paged_block_table(seqlens, module.PAGE_SIZE, gen)
        kv = torch.randn(pages, module.PAGE_SIZE, 1, width, dtype=module.DTYPE, device="cuda")
        q = torch.randn(args.batch, 1, module.NUM_HEADS, width, dtype=module.DTYPE, device="cuda")
        table, lens = table.cuda(), torch.tensor(seqlens, dtype=torch.int32, device="cuda")
        schedule = module.get_decode_schedule(args.batch, 1, q.device, backend=args.backend)
        out, lse = module.mla_decode(q, kv, table, lens, schedule=schedule, return_lse=True)

        def call(q=q, kv=kv, table=table, lens=lens, schedule=schedule, out=out, lse=lse, module=module):
            module.mla_decode(q, kv, table, lens, schedule=schedule, out=out, lse=lse)

        for _ in range(20):
            call()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            samples.append((time.perf_counter() - start) / args.calls * 1e6)
            torch.cuda.synchronize()
        compiled = {k.__name__ if hasattr(k, "__name__") else str(k): len(v) for k, v in module._COMPILED.items()}
        print(
            f"direct={direct} backend={schedule.backend} merge={schedule.merge}: host us per call "
            f"{sorted(samples)} compiled keys {compiled}",
            flush=True,
        )
        if direct:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.calls):
                call()
            profiler.disable()
            torch.cuda.synchronize()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
