"""Where a short chunked prefill's time goes (dev tool, issue 43): bench_prefill's chunked problem (one sequence,
--chunk new tokens over a --prefix-token cached prefix) at --heads, each part timed alone, device time (do_bench,
L2 flushed) beside host time a call (calls issued back to back): the public expand_latent_prefix (checked), the
module's unchecked expansion, the prefix gather alone, the two up-projection GEMMs alone, and mla_chunked_prefill
with each backend. Every full call is checked against bench_prefill's reference first.

    python benchmarks/probes/chunked_parts.py [--heads 16] [--chunk 1024] [--prefix 8192]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_prefill as bp  # noqa: E402
import harness  # noqa: E402

from mlagen_compiler import runtime  # noqa: E402
from mlagen_compiler.options import use_options  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--prefix", type=int, default=8192)
    args = parser.parse_args()
    device = torch.device("cuda")
    module = bp.build_modules(Path(tempfile.mkdtemp()))[args.heads]
    problem = bp.chunked_problem(module, device, torch.Generator(device=device).manual_seed(0), args.chunk, args.prefix)
    q, kn, kp, v, cu, chunk, cache, table, plen, w_uk, w_uv = problem.args
    cu_p, prefix = problem.prefix_cu, args.prefix
    want = bp.chunked_reference(module, problem)
    view = module._M
    dc = module.KV_LORA_RANK
    c_kv = cache.view(-1, cache.shape[-1])[:prefix, :dc]  # (latent rows laid out as the gather packs them)
    uk = w_uk.reshape(-1, dc).t()
    uv = w_uv.reshape(-1, dc).t()
    parts = {
        "expand (public, checked)": lambda: module.expand_latent_prefix(cache, table, cu_p, prefix, w_uk, w_uv),
        "expand (unchecked)": lambda: runtime._expand_latent_prefix(view, cache, table, cu_p, prefix, w_uk, w_uv, None),
        "two GEMMs alone": lambda: (c_kv @ uk, c_kv @ uv),
        "empty rows alone": lambda: torch.empty((prefix, cache.shape[-1]), dtype=module.DTYPE, device=device),
    }
    for backend in ("triton", "gluon"):

        def full(backend=backend):
            with use_options(prefill_backend=backend):
                return module.mla_chunked_prefill(*problem.args, num_prefix_tokens=prefix)

        _, _, wrong = bp.compare(full(), want, "bfloat16")
        parts[f"mla_chunked_prefill {backend}{' WRONG: ' + wrong if wrong else ''}"] = full
    print(f"# chunked H{args.heads}: {args.chunk} new tokens over {args.prefix}")
    for name, call in parts.items():
        call()
        device_us = harness.median_ms(call, warmup=25, rep=150) * 1e3
        host_us = harness.host_us_per_call(call, 200)
        print(f"{name:>40}: {device_us:8.1f} us (do_bench), {host_us:8.1f} us a call back to back")


if __name__ == "__main__":
    main()
