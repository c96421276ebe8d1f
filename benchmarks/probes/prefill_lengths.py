"""The Gluon prefill's speed against sequence length at a fixed token count (dev tool, issue 43): B sequences of
S tokens with B * S constant, each batch checked against bench_prefill's reference, then timed beside cuDNN on the
same tensors. A causal row block of S tokens streams about S / 2 key blocks on average, so if the kernel's rate
rises with S at equal work, a cost paid once per row block (the query's load, the output's store and the LSE, the
pipeline's fill and drain: what a persistent kernel overlaps with the next tile's) is what holds the short
sequences back.

Backends (--backends): "triton" (the portable kernel), "gluon" (the Gluon prefill, its warpgroups running free, as
auto launches it) and "gluon-pingpong" (its warpgroups' MMAs in turns, MLAGEN_PREFILL_GLUON_PINGPONG=1), each
checked against the reference before it is timed; a backend that raises is reported in its column and the row goes
on.

    python benchmarks/probes/prefill_lengths.py [--heads 128] [--tokens 16384] [--lengths 1024,2048,4096,8192,16384]
        [--backends triton,gluon,gluon-pingpong]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_prefill as bp  # noqa: E402

from mlagen_compiler.options import use_options  # noqa: E402

#: --backends' names: (mla_prefill's backend, the options it runs under besides)
BACKENDS = {
    "triton": ("triton", {}),
    "gluon": ("gluon", {"prefill_gluon_pingpong": "0"}),
    "gluon-pingpong": ("gluon", {"prefill_gluon_pingpong": "1"}),
}


def time_length(module, device, tokens: int, seqlen: int, backends=("triton", "gluon", "gluon-pingpong")) -> str:
    """One row: B = tokens / S sequences of S tokens, each backend checked then timed, then cuDNN."""
    heads, dn, dr, dv, _ = bp.geometry(module)
    batch = tokens // seqlen
    gen = torch.Generator(device=device).manual_seed(seqlen)
    q, kn, kp, v, cu = bp.make_inputs(module, batch, seqlen, gen, device)
    want = bp.causal_reference(module, q, kn, kp, v, batch, seqlen)
    flops = batch * heads * seqlen * seqlen * (dn + dr + dv)  # (2 * S^2 / 2 per head and dot width)
    row = []
    for name in backends:
        backend, extra = BACKENDS[name]
        try:
            with use_options(prefill_backend=backend, **extra):
                out = torch.full_like(v, float("nan"))
                module.mla_prefill(q, kn, kp, v, cu, seqlen, out=out)
                wrong = bp.compare(out, want, "bfloat16")[2]
                ms = bp.bench(lambda: module.mla_prefill(q, kn, kp, v, cu, seqlen))
        except Exception as error:  # (the turns before their first GPU run: say so, go on)
            row.append(f"{name} FAILED {type(error).__name__}: {str(error).splitlines()[0][:120]}")
            continue
        row.append(f"{name} {flops / ms / 1e9:4.0f}{' WRONG ' + wrong[:80] if wrong else ''}")
    qd, kd, vd = bp.dense(q, kn, kp, v, batch, seqlen)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ms = bp.bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=module.SOFTMAX_SCALE))
    return f"B{batch} S{seqlen}: " + ", ".join(row) + f", cudnn {flops / ms / 1e9:4.0f} TFLOP/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument(
        "--backends", default="triton,gluon,gluon-pingpong", help=f"comma-separated, of {', '.join(BACKENDS)}"
    )
    args = parser.parse_args()
    backends = tuple(args.backends.split(","))
    unknown = [name for name in backends if name not in BACKENDS]
    if unknown:
        parser.error(f"--backends: {', '.join(unknown)} not of {', '.join(BACKENDS)}")
    device = torch.device("cuda")
    module = bp.build_modules(Path(tempfile.mkdtemp()))[args.heads]
    print(f"# H{args.heads}, {args.tokens} tokens a batch; TFLOP/s counting the causal half")
    for seqlen in map(int, args.lengths.split(",")):
        print(time_length(module, device, args.tokens, seqlen, backends), flush=True)


if __name__ == "__main__":
    main()
