"""The Gluon prefill's tile order, section counts against each other (probe, GPU): for each case, the output with
each count checked bit for bit against the policy's count (the order changes no program's arithmetic), then
each timed (do_bench median, L2 flushed).

    python benchmarks/probes/prefill_sections.py [--counts 1,2,4,8]
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_prefill  # noqa: E402
import harness  # noqa: E402

CASES = [(16, 1, 4096), (16, 4, 4096), (16, 1, 16384), (128, 1, 4096), (128, 1, 16384)]  # (H, B, S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1,2,4,8,16")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        modules = bench_prefill.build_modules(Path(tmp))
        for heads, batch, seqlen in CASES:
            m = modules[heads]
            q, kn, kp, v, cu = bench_prefill.make_inputs(m, batch, seqlen, gen, device)
            flops = batch * heads * seqlen**2 * (q.shape[-1] + v.shape[-1])
            out = torch.full_like(v, float("nan"))
            launch = functools.partial(
                m._launch_prefill_gluon, q, kn, kp, v, cu, cu, seqlen, out, None, m.SOFTMAX_SCALE, True
            )
            launch()
            policy = out.clone()
            cells = []
            for count in [c for c in counts if c <= batch * heads]:
                out.fill_(float("nan"))
                call = functools.partial(launch, sections=count)
                call()
                same = torch.equal(out.view(torch.int16), policy.view(torch.int16))
                ms = harness.median_ms(call, warmup=10, rep=100)
                cells.append(f"{count}: {flops / ms / 1e9:.0f}T{'' if same else ' DIFFERS'}")
            ms = harness.median_ms(launch, warmup=10, rep=100)
            print(f"H{heads} B{batch} S{seqlen}: policy {flops / ms / 1e9:.0f}T | " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
