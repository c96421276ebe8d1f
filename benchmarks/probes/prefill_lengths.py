"""The Gluon prefill's speed against sequence length at a fixed token count (dev tool, issue 43): B sequences of
S tokens with B * S constant, each batch checked against bench_prefill's reference, then timed beside cuDNN on the
same tensors. A causal row block of S tokens streams about S / 2 key blocks on average, so if the kernel's rate
rises with S at equal work, a cost paid once per row block (the query's load, the output's store and the LSE, the
pipeline's fill and drain: what a persistent kernel overlaps with the next tile's) is what holds the short
sequences back.

    python benchmarks/probes/prefill_lengths.py [--heads 128] [--tokens 16384] [--lengths 1024,2048,4096,8192,16384]
        [--persistent] [--chunks 1,2,4] [--no-triton]

--persistent adds the Gluon prefill's persistent variant (MLAGEN_PREFILL_PERSISTENT=1: a program per SM looping over
the tiles, the next tile's query and first key blocks landing during the current one's epilogue) beside the tile
per program kernel, checked and timed the same way in the same process; --chunks N,... adds the persistent kernel
with contiguous chunks (MLAGEN_PREFILL_TILE_CHUNK=N: ceil(tiles / N) programs of N consecutive tiles each) as
gluon-chunkN, checked and timed the same way; --no-triton leaves the portable kernel out.
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

from mlagen_compiler.options import KNOBS, use_options  # noqa: E402

#: the variants a row times: (label, prefill_backend option, prefill_persistent option, prefill_tile_chunk option);
#: --chunks adds chunkN (variant_options)
VARIANTS = {
    "triton": ("triton", "triton", False, 0),
    "gluon": ("gluon", "gluon", False, 0),
    "persistent": ("gluon-persistent", "gluon", True, 0),
}


def variant_options(variant: str) -> tuple[str, str, bool, int]:
    """A variant's (label, prefill_backend, prefill_persistent, prefill_tile_chunk): VARIANTS's, or chunkN's
    (the persistent kernel with N consecutive tiles a program)."""
    if variant.startswith("chunk"):
        chunk = int(variant.removeprefix("chunk"))
        return f"gluon-chunk{chunk}", "gluon", False, chunk
    return VARIANTS[variant]


def time_length(module, device, tokens: int, seqlen: int, variants=("triton", "gluon")) -> str:
    """One row: B = tokens / S sequences of S tokens, each variant (variant_options') checked then timed, then
    cuDNN."""
    heads, dn, dr, dv, _ = bp.geometry(module)
    batch = tokens // seqlen
    gen = torch.Generator(device=device).manual_seed(seqlen)
    q, kn, kp, v, cu = bp.make_inputs(module, batch, seqlen, gen, device)
    want = bp.causal_reference(module, q, kn, kp, v, batch, seqlen)
    flops = batch * heads * seqlen * seqlen * (dn + dr + dv)  # (2 * S^2 / 2 per head and dot width)
    row = []
    for variant in variants:
        label, backend, persistent, chunk = variant_options(variant)
        with use_options(prefill_backend=backend, prefill_persistent=persistent, prefill_tile_chunk=chunk):
            out = torch.full_like(v, float("nan"))
            module.mla_prefill(q, kn, kp, v, cu, seqlen, out=out)
            wrong = bp.compare(out, want, "bfloat16")[2]
            ms = bp.bench(lambda: module.mla_prefill(q, kn, kp, v, cu, seqlen))
        row.append(f"{label} {flops / ms / 1e9:4.0f}{' WRONG ' + wrong[:80] if wrong else ''}")
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
        "--persistent", action="store_true", help="the Gluon prefill's persistent variant too (prefill_persistent)"
    )
    parser.add_argument(
        "--chunks", default="", help="N,...: the persistent kernel with N consecutive tiles a program too (1-8)"
    )
    parser.add_argument("--no-triton", action="store_true", help="leave the portable kernel out")
    args = parser.parse_args()
    chunks = [text.strip() for text in args.chunks.split(",") if text.strip()]
    allowed = KNOBS["MLAGEN_PREFILL_TILE_CHUNK"][1].allowed[1:]  # (0 is the stride: --persistent)
    for chunk in chunks:
        if chunk not in allowed:
            parser.error(f"--chunks: each must be one of {', '.join(allowed)}, got {chunk!r}")
    variants = [v for v in ("triton", "gluon", "persistent") if (v != "triton" or not args.no_triton)]
    variants = [v for v in variants if v != "persistent" or args.persistent] + [f"chunk{c}" for c in chunks]
    device = torch.device("cuda")
    module = bp.build_modules(Path(tempfile.mkdtemp()))[args.heads]
    print(f"# H{args.heads}, {args.tokens} tokens a batch; TFLOP/s counting the causal half")
    for seqlen in map(int, args.lengths.split(",")):
        print(time_length(module, device, args.tokens, seqlen, variants), flush=True)


if __name__ == "__main__":
    main()
