"""Prefill benchmark: generated mla_prefill vs PyTorch SDPA backends and FlexAttention, one GPU, one process.

Both prefill backends where they run: the portable kernel ("mlagen") and, on Hopper, the Gluon kernel
("mlagen_gluon", asked for explicitly: "auto" keeps the portable one until it is verified), each checked against
the reference on the case before it is timed (a failed check is printed and not timed).

Causal, bf16, qk head dim 192 (Dn 128 + Dr 64) / v head dim 128 (DeepSeek-V3 geometry at TP8 and TP1:
16 and 128 heads). For every case the generated kernel is first checked against an fp32 result on the
same random inputs, then it and the baselines are timed with `triton.testing.do_bench` medians:

* SDPA with each backend that accepts the shapes: cuDNN and memory-efficient take qk 192 / v 128 as is;
  flash needs V padded to the qk width (the padding copy is not timed, the output is sliced);
* FlexAttention (`torch.compile`d flex_attention with a causal block mask).

TFLOP/s counts half the causal square: B * H * S^2 * (Dqk + Dv). The cases (--cases picks a subset):

* table: SHAPES at 16 and 128 heads; long: LONG (32768 tokens, 128 heads only), like the table;
* varlen: a ragged batch of VARLEN's 16 seeded prompt lengths (512 to 8192) through one mla_prefill call with
  cu_seqlens, at 16 and 128 heads, checked against each sequence's fp32 SDPA; TFLOP/s = H * sum S_i^2 * (Dqk + Dv).
  Baselines on the same ragged batch (ragged_sdpa_variants): SDPA on nested jagged tensors with cuDNN (torch 2.11
  lets them reach cuDNN only with TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1, which main sets), efficient and
  flash; cuDNN on each sequence with all the calls in one CUDA graph, timed as one replay (no launch overhead);
  FlexAttention with a per-sequence causal mask;
* chunked: CHUNKED (a chunk of new tokens against a long cached latent prefix, one sequence): mlagen's total (the
  prefix expansion included) and prefix attention alone, both backends, beside cuDNN and FlexAttention on the
  equivalent attention with keys pre-expanded (chunked_cudnn says how cuDNN gets the bottom-right mask).

vs cuDNN (each row, each mlagen backend) is the best cuDNN time over ours; the issue's target for the Gluon
backend is >= 1.05x on the table, long and varlen rows and >= 1.0x on chunked prefill. With --sweep, also a set
of tile configurations.

    python benchmarks/bench_prefill.py [--out DIR] [--quick] [--sweep] [--cases table,long,varlen,chunked]
        [--append benchmarks/results/results.jsonl]

Writes prefill.json and prefill.png into DIR (default: $OUT, else ./out) and prints a table last; --append adds
one line per case and chunked case to a results log (harness.py: GPU, date, commit, case, figures).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import harness
import torch
import torch.nn.functional as F
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlagen_compiler import compile_spec, import_module_from_path, spec_from_dict  # noqa: E402
from mlagen_compiler.options import use_options  # noqa: E402
from mlagen_compiler.reference import chunked_prefill, prefill_varlen  # noqa: E402
from mlagen_compiler.registry import resolve_spec  # noqa: E402
from mlagen_compiler.verify import LSE_TOLERANCE, compare, compare_with_lse, paged_block_table  # noqa: E402

SPECS = {16: "deepseek-v3-tp8", 128: "deepseek-v3-tp1"}
SHAPES = [(1, 4096), (4, 4096), (1, 16384), (4, 8192)]  # (B, S)
LONG = {128: [(1, 32768)]}  # heads -> (B, S): the long case, for the 128-head spec only
VARLEN = {"count": 16, "low": 512, "high": 8192, "seed": 43}  # the ragged batch's prompt lengths (varlen_lengths)
CHUNKED = [(4096, 28672), (1024, 8192)]  # (new tokens, cached prefix tokens)
CASES = ("table", "long", "varlen", "chunked")  # what --cases picks from
CUDNN_NAMES = ("sdpa_cudnn", "sdpa_cudnn_graph")  # the cuDNN rows a case's vs_cudnn ratio takes the best of
OURS = ("mlagen", "mlagen_gluon")
SWEEP = [  # (block_m, block_n, num_warps, num_stages)
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 32, 8, 3),
    (128, 32, 8, 4),
    (128, 64, 4, 2),
    (128, 64, 4, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 2),
    (64, 32, 4, 4),
]


SWEEP_NO_TMA = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3)]  # block pointers instead of TMA
SWEEP_PREFIX = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3)]


def build_modules(tmp: Path) -> dict:
    modules = {}
    for heads, name in SPECS.items():
        flat = resolve_spec(name).to_flat_dict()
        spec = spec_from_dict({**flat, "kernels": ["prefill"], "name": f"{name}-bench"})
        modules[heads] = import_module_from_path(compile_spec(spec, tmp))
    return modules


DRY_RUN = False


def bench(fn) -> float:
    """Median milliseconds."""
    if DRY_RUN:  # CPU smoke test of this script: one timed call
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return harness.median_ms(fn, warmup=25, rep=150)


def geometry(module) -> tuple[int, int, int, int, int]:
    """(heads, Dn, Dr, Dv, Dc) of a generated module: the shapes its prefill inputs and latent cache are drawn in."""
    return (
        module.NUM_HEADS,
        module.QK_NOPE_HEAD_DIM,
        module.QK_ROPE_HEAD_DIM,
        module.V_HEAD_DIM,
        module.KV_LORA_RANK,
    )


def make_inputs(module, batch, seqlen, gen, device):
    heads, dn, dr, dv, _ = geometry(module)
    total = batch * seqlen
    dt = module.DTYPE

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    q, k_nope, k_pe, v = rnd(total, heads, dn + dr), rnd(total, heads, dn), rnd(total, dr), rnd(total, heads, dv)
    cu = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * seqlen
    return q, k_nope, k_pe, v, cu


def dense(q, k_nope, k_pe, v, batch, seqlen):
    """[B, H, S, D] views for SDPA / FlexAttention; the rope key broadcast to all heads (they need it)."""
    heads = q.shape[1]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)

    def bhsd(x):
        return x.view(batch, seqlen, heads, x.shape[-1]).transpose(1, 2)

    return bhsd(q), bhsd(k), bhsd(v)


def _judged(out, lse, want, want_lse) -> dict:
    """Output within the bf16 tolerances and LSE within verify.LSE_TOLERANCE (the library's checks)."""
    _, rel, msg = compare_with_lse(out, lse, want, want_lse, "bfloat16")
    lse_err = float((lse.double().cpu() - want_lse.double().cpu()).abs().max())
    return {"rel_err": rel, "lse_max_err": lse_err, "lse_tolerance": LSE_TOLERANCE, "passed": not msg, "msg": msg}


def gluon_available(module, device) -> str:
    """'' when the module's Gluon prefill can run on `device` (asked for explicitly: "auto" keeps the portable
    kernel until it is verified), else why not."""
    try:
        module.prefill_backend(device, "gluon")
    except (ValueError, AttributeError) as error:  # (AttributeError: a module from before the Gluon prefill)
        return str(error)
    return ""


REFERENCE_BYTES = 4 << 30  # the fp32 copies one reference SDPA call may hold (heads are taken in groups)


def causal_reference(module, q, k_nope, k_pe, v, batch, seqlen) -> torch.Tensor:
    """[T, H, Dv] float32: causal attention of `batch` sequences of `seqlen` tokens (fp32 memory-efficient SDPA).

    Heads are taken in groups whose fp32 q, k, v and output copies fit REFERENCE_BYTES (all 128 heads of
    32768 tokens would hold about 11 GB of them at once)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, dqk, dv = q.shape[1], q.shape[-1], v.shape[-1]
    per_head = batch * seqlen * (2 * dqk + 2 * dv) * 4
    group = max(1, min(heads, REFERENCE_BYTES // per_head))
    qd, kd, vd = dense(q, k_nope, k_pe, v, batch, seqlen)
    ref = torch.empty(batch, heads, seqlen, dv, dtype=torch.float32, device=q.device)
    with sdpa_kernel([SDPBackend.MATH if DRY_RUN else SDPBackend.EFFICIENT_ATTENTION]):
        for h in range(0, heads, group):
            ref[:, h : h + group] = F.scaled_dot_product_attention(
                qd[:, h : h + group].float(),
                kd[:, h : h + group].float(),
                vd[:, h : h + group].float(),
                is_causal=True,
                scale=module.SOFTMAX_SCALE,
            )
    return ref.transpose(1, 2).reshape(v.shape)


def varlen_reference(module, q, k_nope, k_pe, v, lengths) -> torch.Tensor:
    """[T, H, Dv] float32: each sequence's causal_reference, concatenated."""
    ref, start = torch.empty(v.shape, dtype=torch.float32, device=v.device), 0
    for length in lengths:
        end = start + length
        ref[start:end] = causal_reference(
            module, q[start:end], k_nope[start:end], k_pe[start:end], v[start:end], 1, length
        )
        start = end
    return ref


def small_reference_check(module, device, gen) -> dict:
    """Varlen lengths around the tile sizes vs the fp64 reference, prefill and chunked prefill."""
    lens = [1, 15, 17, 33] if DRY_RUN else [1, 63, 64, 65, 127, 129, 300, 1000]
    heads, dn, dr, dv, dc = geometry(module)
    total = sum(lens)
    dt = module.DTYPE

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dt)

    q, kn, kp, v = rnd(total, heads, dn + dr), rnd(total, heads, dn), rnd(total, dr), rnd(total, heads, dv)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    results = {}
    out = torch.full((total, heads, dv), float("nan"), dtype=dt, device=device)
    got, lse = module.mla_prefill(q, kn, kp, v, cu, max(lens), return_lse=True, out=out)
    want, want_lse = prefill_varlen(q.double(), kn.double(), kp.double(), v.double(), cu.cpu(), module.SOFTMAX_SCALE)
    results["prefill"] = _judged(got, lse, want, want_lse)

    page = module.PAGE_SIZE
    prefix = [0, 20, 3, 1] if DRY_RUN else [0, 700, 64, 1, 129, 2000, 63, 5]
    table, num_pages = paged_block_table(prefix, page, gen, spare_pages=3)
    cache = rnd(num_pages, page, 1, dc + dr)
    w_uk, w_uv = rnd(heads, dn, dc) / dc**0.5, rnd(heads, dv, dc) / dc**0.5
    plen = torch.tensor(prefix, dtype=torch.int32, device=device)
    got, lse = module.mla_chunked_prefill(q, kn, kp, v, cu, max(lens), cache, table, plen, w_uk, w_uv, return_lse=True)
    want, want_lse = chunked_prefill(
        q.double(),
        kn.double(),
        kp.double(),
        v.double(),
        cu.cpu(),
        cache.double(),
        table,
        plen.cpu(),
        w_uk.double(),
        w_uv.double(),
        module.SOFTMAX_SCALE,
        expanded_dtype=dt,
    )
    results["chunked"] = _judged(got, lse, want, want_lse)

    slots = torch.randperm(cache.shape[0] * page, generator=gen, device=device)[:total]
    slots[::7] = -1
    c_kv, k_pe = rnd(total, dc), rnd(total, dr)
    before = cache.clone()
    module.mla_cache_write(c_kv, k_pe, cache, slots)
    expect = before.clone()
    keep = slots >= 0
    expect.view(-1, dc + dr)[slots[keep].long()] = torch.cat([c_kv, k_pe], -1)[keep]
    results["cache_write"] = {"passed": bool(torch.equal(cache, expect))}
    return results


def sdpa_variants(qd, kd, vd):
    """name -> callable for each SDPA backend (flash with V padded to the qk width, sliced after)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dv, dqk = vd.shape[-1], qd.shape[-1]
    v_pad = F.pad(vd, (0, dqk - dv)) if dv < dqk else vd

    def run(backend, v_in, width):
        def fn():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qd, kd, v_in, is_causal=True)[..., :width]

        return fn

    return {
        "sdpa_cudnn": run(SDPBackend.CUDNN_ATTENTION, vd, dv),
        "sdpa_efficient": run(SDPBackend.EFFICIENT_ATTENTION, vd, dv),
        "sdpa_flash_vpad": run(SDPBackend.FLASH_ATTENTION, v_pad, dv),
    }


_FLEX = {}


def flex_variant(qd, kd, vd, seqlen):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=seqlen, KV_LEN=seqlen, device=qd.device)
    return lambda: _FLEX["fn"](qd, kd, vd, block_mask=block_mask)


def check_and_time_ours(row: dict, module, device, args: tuple, ref: torch.Tensor) -> torch.Tensor:
    """Check mla_prefill(*args) with each backend (the portable kernel, and the Gluon one on Hopper) against
    `ref`, then time each that passed; fills row's max_err, rel_err, passed, impl, config and gluon_* (a failed
    check is printed and not timed). Returns the portable kernel's output buffer."""
    case = row["case"]
    backends = {"mlagen": "triton"}
    why_not = gluon_available(module, device)
    if why_not:
        print(f"#   mlagen_gluon {case}: not run ({why_not})")
    else:
        backends["mlagen_gluon"] = "gluon"
    checks, outs = {}, {}
    for name, backend in backends.items():
        outs[name] = torch.full_like(args[3], float("nan"))
        with use_options(prefill_backend=backend):
            module.mla_prefill(*args, out=outs[name])
        checks[name] = compare(outs[name], ref, "bfloat16")
        if checks[name][2]:
            print(f"#   {name} {case}: CHECK FAILED {checks[name][2]}")
    max_err, rel, msg = checks["mlagen"]
    row.update(max_err=max_err, rel_err=rel, passed=not msg, impl={}, config=list(module.prefill_config(device)))
    for name, backend in backends.items():
        if checks[name][2]:  # (a failed check is reported, never timed)
            row["impl"][name] = None
            continue
        with use_options(prefill_backend=backend):
            row["impl"][name] = bench(lambda: module.mla_prefill(*args))
            if not DRY_RUN:
                row.setdefault("host_us", {})[name] = harness.host_us_per_call(
                    lambda: module.mla_prefill(*args), calls=50
                )
            if HOST_PROFILE and name not in _PROFILED:  # (--host-profile: the first case of each backend)
                _PROFILED.add(name)
                profile_host(f"{name} {case}", lambda: module.mla_prefill(*args))
    if row.get("host_us"):  # (wall time of calls issued back to back: the host's cost unless the GPU is slower)
        print(
            f"#   {case}: µs a call issued back to back: "
            + ", ".join(f"{n} {t:.0f}" for n, t in row["host_us"].items())
        )
    if "mlagen_gluon" in checks:
        row["gluon_max_err"], row["gluon_rel_err"], gluon_msg = checks["mlagen_gluon"]
        row["gluon_passed"] = not gluon_msg
    return outs["mlagen"]


HOST_PROFILE = False
_PROFILED: set[str] = set()


def profile_host(label: str, call, calls: int = 200, top: int = 14) -> None:
    """cProfile of `calls` calls issued back to back: where a call's host time goes (functions by own time)."""
    import cProfile
    import io
    import pstats

    calls = 2 if DRY_RUN else calls  # (the interpreter: a check that the profile runs, not a profile)
    call()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    if not DRY_RUN:
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    print(f"# host profile, {label}, {calls} calls:\n" + text.getvalue(), flush=True)


def run_case(module, heads, batch, seqlen, gen, device, sweep, sweeps) -> dict:
    """Check ours on this shape against fp32 SDPA, then time ours (and the sweep) and the baselines."""
    case = f"H={heads} B={batch} S={seqlen}"
    q, kn, kp, v, cu = make_inputs(module, batch, seqlen, gen, device)
    flops = batch * heads * seqlen**2 * (q.shape[-1] + v.shape[-1])
    qd, kd, vd = dense(q, kn, kp, v, batch, seqlen)
    # correctness of ours (each backend: the portable kernel, and the Gluon one on Hopper) on this very shape vs
    # fp32 memory-efficient SDPA, before anything is timed
    ref = causal_reference(module, q, kn, kp, v, batch, seqlen)
    row = {"case": case, "heads": heads, "batch": batch, "seqlen": seqlen, "flops": flops}
    out = check_and_time_ours(row, module, device, (q, kn, kp, v, cu, seqlen), ref)
    del ref
    if sweep:
        scale = module.SOFTMAX_SCALE
        variants = [(c, True) for c in SWEEP] + [(c, False) for c in SWEEP_NO_TMA]
        for c, tma in variants:
            try:
                t = bench(
                    lambda c=c, tma=tma: module._launch_prefill(
                        q, kn, kp, v, cu, cu, seqlen, out, None, scale, True, c, tma
                    )
                )
            except Exception as error:  # noqa: BLE001 - a config may not compile
                t = None
                print(f"#   sweep {c}: {type(error).__name__}: {str(error)[:120]}")
            sweeps.append(
                {
                    "case": case,
                    "config": list(c),
                    "tma": tma,
                    "ms": t,
                    "tflops": flops / t / 1e9 if t else None,
                }
            )
            print(f"#   sweep {case} {c} tma={tma}: {t and round(flops / t / 1e9, 1)} TFLOP/s", flush=True)
        timed = [x for x in sweeps if x["case"] == case and x["ms"] and x["tma"]]
        if timed:
            best = min(timed, key=lambda x: x["ms"])
            row["best_swept"] = {"config": best["config"], "ms": best["ms"]}
    for name, fn in sdpa_variants(qd, kd, vd).items():
        row["impl"][name] = time_baseline(f"{name} {case}", lambda fn=fn: fn)
    row["impl"]["flex"] = time_baseline(f"flex {case}", lambda: flex_variant(qd, kd, vd, seqlen))
    return finish_row(row)


def time_baseline(label: str, make) -> float | None:
    """Median ms of the callable make() returns, after one untimed call; None (and why, printed) where building
    or calling it fails: a baseline that does not take these shapes is reported, not fatal."""
    try:
        fn = make()
        fn()
        return bench(fn)
    except Exception as error:  # noqa: BLE001 - reported as the row's outcome
        print(f"#   {label}: not available ({type(error).__name__}: {str(error)[:160]})")
        return None


def finish_row(row: dict) -> dict:
    """Adds vs_cudnn (each mlagen backend's speed over cuDNN's, best_cudnn_ms over its time) and prints the row."""
    cudnn = [row["impl"].get(n) for n in CUDNN_NAMES if row["impl"].get(n)]
    row["best_cudnn_ms"] = min(cudnn) if cudnn else None
    row["vs_cudnn"] = {n: row["best_cudnn_ms"] / row["impl"][n] if cudnn and row["impl"].get(n) else None for n in OURS}
    flops = row["flops"]
    print(
        f"# {row['case']}: "
        + ", ".join(f"{k} {flops / t / 1e9:.0f}" for k, t in row["impl"].items() if t)
        + " TFLOP/s",
        flush=True,
    )
    return row


def varlen_lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    """`count` prompt lengths drawn uniformly from [low, high] by a seeded CPU generator (the same every run)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (count,), generator=gen).tolist()


def run_varlen(module, heads, lengths, gen, device) -> dict:
    """A ragged batch of causal prompts through one mla_prefill call (cu_seqlens), checked against each sequence's
    fp32 SDPA, then timed beside SDPA on the same ragged batch: nested jagged tensors for each backend that takes
    them, cuDNN's per-sequence calls replayed from one CUDA graph, FlexAttention with a document mask."""
    n, case = len(lengths), f"H={heads} varlen {len(lengths)}x{min(lengths)}-{max(lengths)}"
    total, max_len = sum(lengths), max(lengths)
    _, dn, dr, dv, _ = geometry(module)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(module.DTYPE)

    q, kn, kp, v = rnd(total, heads, dn + dr), rnd(total, heads, dn), rnd(total, dr), rnd(total, heads, dv)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    flops = heads * sum(s * s for s in lengths) * (dn + dr + dv)
    row = {"case": case, "heads": heads, "batch": n, "seqlen": max_len, "lengths": lengths, "flops": flops}
    ref = varlen_reference(module, q, kn, kp, v, lengths)
    check_and_time_ours(row, module, device, (q, kn, kp, v, cu, max_len), ref)
    del ref
    k = torch.cat([kn, kp[:, None, :].expand(-1, heads, -1)], dim=-1)
    for name, fn in ragged_sdpa_variants(q, k, v, cu, lengths).items():
        row["impl"][name] = time_baseline(f"{name} {case}", lambda fn=fn: fn)
    if q.numel() >= 2**31:
        # (FlexAttention ended with an illegal memory access on the 128-head ragged batch, a q of about 2.4e9
        # elements, and the error ends the process's CUDA context; 32-bit offsets are the likely cause)
        row["impl"]["flex"] = None
        print(f"#   flex {case}: not run (q has {q.numel()} elements, 2**31 or more)")
        return finish_row(row)
    row["impl"]["flex"] = time_baseline(f"flex {case}", lambda: flex_document_variant(q, k, v, lengths))
    return finish_row(row)


def ragged_sdpa_variants(q, k, v, cu, lengths) -> dict:
    """name -> callable: SDPA on the ragged batch as nested jagged tensors ([B, H, {S}, D]) for cuDNN, efficient
    and flash (V padded to the qk width, the copy not timed); and "sdpa_cudnn_graph": cuDNN on each sequence
    (dense [1, H, S_i, D] views), all the calls captured in one CUDA graph and timed as one replay, so no launch
    overhead is counted (not in a dry run: no CUDA graphs on the CPU).

    torch 2.11 routes nested jagged SDPA to cuDNN only when TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1 is in the
    environment when its first SDPA call is checked (main sets it) and on SM 9.x / 10.x."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    offsets = cu.long()

    def jagged(x):
        nt = torch.nested.nested_tensor_from_jagged(x, offsets, min_seqlen=min(lengths), max_seqlen=max(lengths))
        return nt.transpose(1, 2)  # [B, {S}, H, D] -> [B, H, {S}, D]

    dqk, dv = q.shape[-1], v.shape[-1]
    qj, kj, vj, vj_pad = jagged(q), jagged(k), jagged(v), jagged(F.pad(v, (0, dqk - dv)))

    def run(backend, v_in):
        def fn():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qj, kj, v_in, is_causal=True)

        return fn

    variants = {
        "sdpa_cudnn": run(SDPBackend.CUDNN_ATTENTION, vj),
        "sdpa_efficient": run(SDPBackend.EFFICIENT_ATTENTION, vj),
        "sdpa_flash_vpad": run(SDPBackend.FLASH_ATTENTION, vj_pad),
    }
    if not DRY_RUN:
        variants["sdpa_cudnn_graph"] = cudnn_graph_variant(q, k, v, lengths)
    return variants


def cudnn_graph_variant(q, k, v, lengths):
    """A callable replaying one CUDA graph of cuDNN SDPA on each sequence in turn (captured on the first call)."""
    from bench_decode import capture_graph
    from torch.nn.attention import SDPBackend, sdpa_kernel

    views, start = [], 0
    for length in lengths:
        views.append([x[start : start + length].unsqueeze(0).transpose(1, 2) for x in (q, k, v)])
        start += length

    def calls():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return [F.scaled_dot_product_attention(*qkv, is_causal=True) for qkv in views]

    graph = {}

    def replay():
        if "g" not in graph:
            graph["g"], graph["outs"] = capture_graph(calls)
        graph["g"].replay()

    return replay


def flex_document_variant(q, k, v, lengths):
    """FlexAttention over the packed batch ([1, H, T, D]) with a causal mask within each sequence."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    fn = _FLEX.setdefault("fn", torch.compile(flex_attention, dynamic=False))
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), torch.tensor(lengths, device=q.device))

    def causal_document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    total = q.shape[0]
    # (compiled: evaluated eagerly, the mask of ~94k x 94k tokens would be materialised with int64 indices)
    block_mask = create_block_mask(
        causal_document, B=None, H=None, Q_LEN=total, KV_LEN=total, device=q.device, _compile=True
    )
    qd, kd, vd = (x.transpose(0, 1)[None] for x in (q, k, v))
    return lambda: fn(qd, kd, vd, block_mask=block_mask)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "out")
    parser.add_argument("--quick", action="store_true", help="only the first shape per head count")
    parser.add_argument("--sweep", action="store_true", help="time every configuration in SWEEP")
    parser.add_argument("--no-chunked", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU interpreter (tests the script)")
    parser.add_argument(
        "--host-profile", action="store_true", help="cProfile the host side of each backend's calls on the first case"
    )
    parser.add_argument("--append", type=Path, help="also append each case to this results log (JSON lines)")
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated subset of {','.join(CASES)} (default: all): table = SHAPES at 16 and 128 heads, "
        "long = LONG, varlen = the ragged VARLEN batch at 16 and 128 heads, chunked = CHUNKED at 16 and 128 heads",
    )
    args = parser.parse_args()
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    if not cases or cases - set(CASES):
        parser.error(f"--cases: {sorted(cases - set(CASES)) or 'none'}: pick from {', '.join(CASES)}")
    if args.no_chunked:
        cases.discard("chunked")
    global DRY_RUN, HOST_PROFILE, SHAPES, SWEEP, LONG, VARLEN, CHUNKED  # noqa: PLW0603
    HOST_PROFILE = args.host_profile
    if args.dry_run:
        DRY_RUN = True
        SHAPES, SWEEP = [(1, 48), (2, 32)], [(16, 16, 4, 1), (32, 16, 4, 1)]
        SWEEP_PREFIX[:] = [(16, 16, 4, 1)]
        SWEEP_NO_TMA[:] = [(16, 16, 4, 1)]
        LONG, VARLEN = {128: [(1, 64)]}, {**VARLEN, "count": 3, "low": 8, "high": 40}
        CHUNKED = [(40, 100), (16, 48)]
    # torch 2.11 reads this once, at its first SDPA backend check, before it lets nested tensors reach cuDNN
    os.environ.setdefault("TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED", "1")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch._dynamo.config.cache_size_limit = 64
    device = torch.device("cpu" if DRY_RUN else "cuda")
    gpu = "cpu (dry run)" if DRY_RUN else torch.cuda.get_device_name()
    meta = harness.environment(timespec="seconds", gpu=gpu)
    print(f"# {gpu} | torch {torch.__version__} | triton {triton.__version__} | {meta['date']}", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    rows, checks, sweeps, chunked = [], {}, [], []
    with tempfile.TemporaryDirectory() as tmp:
        modules = build_modules(Path(tmp))
        for heads, module in modules.items():
            checks[heads] = small_reference_check(module, device, gen)
            print(f"# reference check H={heads}: {json.dumps(checks[heads])}", flush=True)

        shapes = SHAPES[:1] if args.quick else SHAPES
        plan = []  # (module, heads, batch, seqlen)
        if "table" in cases:
            plan += [(module, heads, b, s) for heads, module in modules.items() for b, s in shapes]
        if "long" in cases:
            plan += [(modules[heads], heads, b, s) for heads, sizes in LONG.items() for b, s in sizes]
        for module, heads, batch, seqlen in plan:
            rows.append(run_case(module, heads, batch, seqlen, gen, device, args.sweep, sweeps))
            if not DRY_RUN:
                torch.cuda.empty_cache()

        if "varlen" in cases:
            lengths = varlen_lengths(**VARLEN)
            print(f"# varlen prompt lengths: {lengths}", flush=True)
            for heads, module in modules.items():
                rows.append(run_varlen(module, heads, lengths, gen, device))
                if not DRY_RUN:
                    torch.cuda.empty_cache()

        if "chunked" in cases:
            for chunk, prefix in CHUNKED:
                for module in modules.values():
                    try:
                        chunked.append(time_chunked(module, device, gen, chunk=chunk, prefix=prefix))
                    except Exception:  # noqa: BLE001
                        traceback.print_exc()
                    if not DRY_RUN:
                        torch.cuda.empty_cache()

    report = {
        "meta": meta,
        "checks": {str(k): v for k, v in checks.items()},
        "rows": rows,
        "sweep": sweeps,
        "chunked": chunked,
    }
    (out_dir / "prefill.json").write_text(json.dumps(report, indent=2))
    try:
        plot(rows, out_dir / "prefill.png", gpu)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    print_table(rows, chunked, meta)
    if args.append:
        logged = [(row["case"], {k: v for k, v in row.items() if k != "case"}) for row in rows]
        logged += [(f"chunked H={c['heads']} chunk={c['chunk']} prefix={c['prefix']}", c) for c in chunked]
        print(f"# appended {harness.append_results(args.append, 'prefill', meta, logged)} rows to {args.append}")


@dataclass
class ChunkedProblem:
    """One sequence: `chunk` new tokens (q, k_nope, k_pe, v) against a `prefix`-token cached latent prefix."""

    chunk: int
    prefix: int
    args: tuple  # mla_chunked_prefill's positional arguments
    prefix_cu: torch.Tensor


def chunked_problem(module, device, gen, chunk: int, prefix: int) -> ChunkedProblem:
    heads, dn, dr, dv, dc = geometry(module)
    page = module.PAGE_SIZE
    dt = module.DTYPE

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dt)

    q, kn, kp, v = rnd(chunk, heads, dn + dr), rnd(chunk, heads, dn), rnd(chunk, dr), rnd(chunk, heads, dv)
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    table, num_pages = paged_block_table([prefix], page, gen, spare_pages=8)
    cache = rnd(num_pages, page, 1, dc + dr)
    plen = torch.tensor([prefix], dtype=torch.int32, device=device)
    w_uk, w_uv = rnd(heads, dn, dc) / dc**0.5, rnd(heads, dv, dc) / dc**0.5
    cu_p = torch.tensor([0, prefix], dtype=torch.int32, device=device)
    return ChunkedProblem(chunk, prefix, (q, kn, kp, v, cu, chunk, cache, table, plen, w_uk, w_uv), cu_p)


def chunked_reference(module, problem: ChunkedProblem) -> torch.Tensor:
    """[chunk, H, Dv] float32: causal attention of the chunk over prefix + chunk (fp32 SDPA, the prefix's keys
    and values expanded from the latent cache)."""
    q, kn, kp, v, _, chunk, cache, table, _, w_uk, w_uv = problem.args
    prefix, heads, device = problem.prefix, module.NUM_HEADS, q.device
    pk, pr, pv = module.expand_latent_prefix(cache, table, problem.prefix_cu, prefix, w_uk, w_uv)
    k_all = torch.cat([torch.cat([pk, kn]), torch.cat([pr, kp])[:, None, :].expand(-1, heads, -1)], -1)
    v_all = torch.cat([pv, v])
    mask = torch.ones(chunk, prefix + chunk, dtype=torch.bool, device=device).tril(prefix)
    ref = torch.empty(chunk, heads, module.V_HEAD_DIM, dtype=torch.float32, device=device)
    for h in range(0, heads, 8):  # a few heads at a time: the fp32 score matrix is chunk x (prefix + chunk)
        ref[:, h : h + 8] = F.scaled_dot_product_attention(
            q[:, h : h + 8].float().transpose(0, 1),
            k_all[:, h : h + 8].float().transpose(0, 1),
            v_all[:, h : h + 8].float().transpose(0, 1),
            attn_mask=mask,
            scale=module.SOFTMAX_SCALE,
        ).transpose(0, 1)
    return ref


def chunked_cudnn(module, qd, kd, vd, prefix, want) -> dict:
    """cuDNN SDPA on the equivalent attention, keys and values pre-expanded ([1, H, prefix + chunk, D]; the
    expansion is not timed for it): cudnn_ms, the chunk over prefix + chunk with query i seeing keys up to
    prefix + i; cudnn_prefix_ms, the chunk over the prefix alone (no mask: what mlagen's prefix attention does).

    torch 2.11 gives cuDNN no bottom-right causal mask: CausalBias(LOWER_RIGHT) goes to flash or efficient, else
    materialises a mask, and is_causal is expected to be cuDNN's top-left diagonal (wrong when the query is
    shorter than the keys). So the ways are tried in turn, each checked against the reference, and the first whose
    output passes is timed (cudnn_mask names it): is_causal (in case this build aligns it bottom-right), then an
    additive bf16 bias (0 / -inf, [1, 1, chunk, prefix + chunk], built once and not timed: a boolean mask would
    be converted on every call), then that bias per head. cuDNN reads a bias rather than skipping the masked
    blocks, so a bias row does the full chunk x (prefix + chunk) square. When none passes, the first bias that
    ran is timed all the same (cudnn_passed false): it is a baseline, not ours."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chunk, heads, dt = qd.shape[2], qd.shape[1], qd.dtype
    allowed = torch.ones(chunk, prefix + chunk, dtype=torch.bool, device=qd.device).tril(prefix)
    bias = torch.zeros(allowed.shape, dtype=dt, device=qd.device).masked_fill(~allowed, float("-inf"))[None, None]
    ways = {"is_causal": {"is_causal": True}, "bias [1, 1, Sq, Skv]": {"attn_mask": bias}}
    if bias.numel() * heads * 2 <= 8 << 30:  # if cuDNN takes no head-broadcast bias: one per head
        ways["bias [1, H, Sq, Skv]"] = {"attn_mask": bias.expand(1, heads, -1, -1).contiguous()}
    del allowed, bias

    def call(kwargs):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qd, kd, vd, scale=module.SOFTMAX_SCALE, **kwargs)

    def prefix_only():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qd, kd[:, :, :prefix], vd[:, :, :prefix], scale=module.SOFTMAX_SCALE)

    result, fallback = {"cudnn_ms": None, "cudnn_mask": None}, None
    for way, kwargs in ways.items():
        try:
            got = call(kwargs)[0].transpose(0, 1)
        except Exception as error:  # noqa: BLE001 - backend does not take these shapes
            print(f"#   chunked sdpa_cudnn H={heads} {way}: not available ({type(error).__name__}: {str(error)[:160]})")
            continue
        _, rel, msg = compare(got, want, "bfloat16")
        del got
        if msg:
            print(f"#   chunked sdpa_cudnn H={heads} {way}: its output differs from the reference ({msg[:160]})")
            if fallback is None and way != "is_causal":
                fallback = (way, kwargs, rel)
            continue
        fallback = (way, kwargs, rel)
        result["cudnn_passed"] = True
        break
    if fallback is not None:
        way, kwargs, result["cudnn_rel_err"] = fallback
        result["cudnn_mask"], result["cudnn_passed"] = way, result.get("cudnn_passed", False)
        result["cudnn_ms"] = bench(lambda: call(kwargs))
    del ways, fallback
    result["cudnn_prefix_ms"] = time_baseline(f"chunked sdpa_cudnn prefix H={heads}", lambda: prefix_only)
    return result


def time_chunked(module, device, gen, chunk=4096, prefix=28672) -> dict:
    """One sequence: `chunk` new tokens against a `prefix`-token cached latent prefix; mlagen's total (the
    expansion included) and its prefix attention alone, each backend, beside cuDNN (chunked_cudnn) and
    FlexAttention on the pre-expanded keys."""
    heads, dn, dr, dv, dc = geometry(module)
    problem = chunked_problem(module, device, gen, chunk, prefix)
    q, kn, kp, v, cu, _, cache, table, _, w_uk, w_uv = problem.args
    cu_p = problem.prefix_cu

    def full():  # (the prefix total as a host int, as a serving engine passes it: no read of prefix_lens)
        return module.mla_chunked_prefill(*problem.args, num_prefix_tokens=prefix)

    want = chunked_reference(module, problem)
    with use_options(prefill_backend="triton"):
        out = full()
        max_err, rel, msg = compare(out, want, "bfloat16")
        total_ms = bench(full)
    gluon = {}
    why_not = gluon_available(module, device)
    if why_not:
        print(f"#   chunked mlagen_gluon H={heads}: not run ({why_not})")
    else:
        with use_options(prefill_backend="gluon"):
            out = full()
            g_err, g_rel, g_msg = compare(out, want, "bfloat16")
            gluon = {"gluon_max_err": g_err, "gluon_rel_err": g_rel, "gluon_passed": not g_msg}
            if g_msg:
                print(f"#   chunked mlagen_gluon H={heads}: CHECK FAILED {g_msg}")
            else:
                gluon["gluon_total_ms"] = bench(full)
    pk, pr, pv = module.expand_latent_prefix(cache, table, cu_p, prefix, w_uk, w_uv)
    expand_ms = bench(lambda: module.expand_latent_prefix(cache, table, cu_p, prefix, w_uk, w_uv))
    attn_flops = heads * (chunk * prefix + chunk * chunk / 2) * 2 * (dn + dr + dv)
    expand_flops = 2 * prefix * dc * heads * (dn + dv)
    o_p = torch.empty(chunk, heads, dv, dtype=torch.float32, device=device)
    l_p = torch.empty(heads, chunk, dtype=torch.float32, device=device)
    cfg = module.prefill_config(device, "prefix")
    prefix_ms = bench(
        lambda: module._launch_prefill(q, pk, pr, pv, cu, cu_p, chunk, o_p, l_p, module.SOFTMAX_SCALE, False, cfg)
    )
    prefix_sweep = {}
    for c in SWEEP_PREFIX:
        try:
            prefix_sweep["m{}n{}w{}s{}".format(*c)] = bench(
                lambda c=c: module._launch_prefill(
                    q, pk, pr, pv, cu, cu_p, chunk, o_p, l_p, module.SOFTMAX_SCALE, False, c
                )
            )
        except Exception as error:  # noqa: BLE001
            print(f"#   prefix sweep {c}: {type(error).__name__}: {str(error)[:100]}")
    result = {
        "heads": heads,
        "chunk": chunk,
        "prefix": prefix,
        "total_ms": total_ms,
        "expand_ms": expand_ms,
        "prefix_attn_ms": prefix_ms,
        "attn_flops": attn_flops,
        "expand_flops": expand_flops,
        "attn_tflops_overall": attn_flops / total_ms / 1e9,
        "prefix_attn_tflops": heads * chunk * prefix * 2 * (dn + dr + dv) / prefix_ms / 1e9,
        "max_err": max_err,
        "rel_err": rel,
        "passed": not msg,
        "prefix_sweep_ms": prefix_sweep,
        **gluon,
    }
    if gluon.get("gluon_total_ms"):
        result["gluon_prefix_attn_ms"] = bench(
            lambda: module._launch_prefill_gluon(q, pk, pr, pv, cu, cu_p, chunk, o_p, l_p, module.SOFTMAX_SCALE, False)
        )
    k_all = torch.cat([torch.cat([pk, kn]), torch.cat([pr, kp])[:, None, :].expand(-1, heads, -1)], -1)
    v_all = torch.cat([pv, v])
    qd, kd, vd = (x.transpose(0, 1)[None] for x in (q, k_all, v_all))
    result.update(chunked_cudnn(module, qd, kd, vd, prefix, want))
    del want
    for key, ours in (("vs_cudnn", "total_ms"), ("gluon_vs_cudnn", "gluon_total_ms")):
        result[key] = result["cudnn_ms"] / result[ours] if result.get("cudnn_ms") and result.get(ours) else None
    for key, ours in (("prefix_vs_cudnn", "prefix_attn_ms"), ("gluon_prefix_vs_cudnn", "gluon_prefix_attn_ms")):
        mine, theirs = result.get(ours), result.get("cudnn_prefix_ms")
        result[key] = theirs / mine if mine and theirs else None
    # FlexAttention on the same problem (keys already expanded: the expansion is not timed for it)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        fn = _FLEX.setdefault("fn", torch.compile(flex_attention, dynamic=False))
        bm = create_block_mask(
            lambda b, h, qi, ki: qi + prefix >= ki, B=None, H=None, Q_LEN=chunk, KV_LEN=prefix + chunk, device=device
        )
        fn(qd, kd, vd, block_mask=bm)
        result["flex_ms"] = bench(lambda: fn(qd, kd, vd, block_mask=bm))
    except Exception as error:  # noqa: BLE001
        result["flex_ms"] = None
        print(f"#   flex chunked: failed ({type(error).__name__}: {str(error)[:200]})")
    print(f"# chunked H={heads}: {json.dumps(result)}", flush=True)
    return result


NAMES = ["mlagen", "mlagen_gluon", "sdpa_cudnn", "sdpa_cudnn_graph", "sdpa_efficient", "sdpa_flash_vpad", "flex"]
TARGET = {"prefill": 1.05, "chunked": 1.0}  # the aim for the Gluon backend: its speed over cuDNN's


def ratio(x) -> str:
    return f"{x:.2f}x" if x else "n/a"


def print_table(rows, chunked, meta) -> None:
    print()
    print(
        f"Prefill, causal, bf16, qk 192 / v 128 -- {meta['gpu']}, {meta['date']}, torch {meta['torch']}, "
        f"triton {meta['triton']}; do_bench medians; TFLOP/s = B*H*S^2*(192+128) (varlen: H*sum S_i^2*(192+128)); "
        f"vs cuDNN = the best cuDNN row's time over ours (target for the Gluon backend: >= {TARGET['prefill']}x)"
    )
    head = (
        f"{'case':<27} {'config':<16} {'check':<6}"
        + "".join(f" {n:>17}" for n in NAMES)
        + f" {'vs flex':>8} {'triton/cuDNN':>12} {'gluon/cuDNN':>11}"
    )
    print(head)
    for r in rows:
        cells = []
        for n in NAMES:
            t = r["impl"].get(n)
            cells.append(f" {t * 1e3:>8.0f}us {r['flops'] / t / 1e9:>5.0f}T" if t else f" {'n/a':>17}")
        flex, ours = r["impl"].get("flex"), r["impl"].get("mlagen")
        speed = f"{flex / ours:>7.2f}x" if flex and ours else f"{'n/a':>8}"
        vs = r.get("vs_cudnn", {})
        versus = f" {ratio(vs.get('mlagen')):>12} {ratio(vs.get('mlagen_gluon')):>11}"
        cfg = "m{}n{}w{}s{}".format(*r["config"])
        best = r.get("best_swept")
        swept = (
            "  best swept m{}n{}w{}s{} {:.0f}T".format(*best["config"], r["flops"] / best["ms"] / 1e9) if best else ""
        )
        check = "ok" if r["passed"] else "FAIL"
        print(f"{r['case']:<27} {cfg:<16} {check:<6}" + "".join(cells) + f" {speed}{versus}{swept}")
    for c in chunked:
        flex = f", flex (keys pre-expanded) {c['flex_ms'] * 1e3:.0f} us" if c.get("flex_ms") else ""
        cudnn = (
            f"; cuDNN (keys pre-expanded, mask: {c['cudnn_mask']}) {c['cudnn_ms'] * 1e3:.0f} us"
            f" (its check {'ok' if c.get('cudnn_passed') else 'FAIL'}), over the prefix alone "
            + (f"{c['cudnn_prefix_ms'] * 1e3:.0f} us" if c.get("cudnn_prefix_ms") else "n/a")
            if c.get("cudnn_ms")
            else "; cuDNN n/a"
        )
        print(
            f"chunked H={c['heads']}: {c['chunk']} new tokens over a {c['prefix']}-token prefix: "
            f"{c['total_ms'] * 1e3:.0f} us total ({c['attn_tflops_overall']:.0f} attention TFLOP/s overall), "
            f"of which expand {c['expand_ms'] * 1e3:.0f} us, prefix attention {c['prefix_attn_ms'] * 1e3:.0f} us "
            f"({c['prefix_attn_tflops']:.0f} TFLOP/s){flex}{cudnn}; check {'ok' if c['passed'] else 'FAIL'} "
            f"(rel {c['rel_err']:.1e}); vs cuDNN: total {ratio(c.get('vs_cudnn'))}, "
            f"prefix attention {ratio(c.get('prefix_vs_cudnn'))}"
        )
        if "gluon_passed" in c:
            timing = (
                f"{c['gluon_total_ms'] * 1e3:.0f} us total, prefix attention {c['gluon_prefix_attn_ms'] * 1e3:.0f} us"
                if c.get("gluon_total_ms")
                else "not timed"
            )
            print(
                f"chunked H={c['heads']} gluon: {timing}; check {'ok' if c['gluon_passed'] else 'FAIL'} "
                f"(rel {c['gluon_rel_err']:.1e}); vs cuDNN: total {ratio(c.get('gluon_vs_cudnn'))} "
                f"(target >= {TARGET['chunked']}x), prefix attention {ratio(c.get('gluon_prefix_vs_cudnn'))}"
            )


def plot(rows, path: Path, gpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(NAMES)
    for i, name in enumerate(NAMES):
        vals = [r["flops"] / r["impl"][name] / 1e9 if r["impl"].get(name) else 0 for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], vals, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels([r["case"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel("TFLOP/s (causal, half square)")
    ax.set_title(f"MLA prefill, bf16, qk 192 / v 128 -- {gpu}")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
