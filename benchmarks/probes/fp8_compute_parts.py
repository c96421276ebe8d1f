"""What limits the fp8 products' decode (cache_compute fp8): one case, the kernel with a part taken out at a time
(dev tool). Each variant is the generated module's source text with plain edits (every pattern must match exactly
once: a stale pattern fails loudly), written to a temporary file and imported; all run in one process on the same
inputs, timed eagerly (do_bench, L2 flushed) and by CUDA-graph replay.

    python benchmarks/probes/fp8_compute_parts.py [--spec deepseek-v3-tp8-fp8] [--batch 128] [--seqlen 8192] \
        [--in-l2] [--variants full,no-v,exact] [--dry-run]

The spec must be one whose launches at Sq 1 take the products (the narrow form: H <= 16, Dc 512). Variants: full
(unedited, checked against the fp32 reference); no-v (the warpgroups' V reads gone: their P V's A operand is zeros,
nothing read or transposed), no-pv-mma (both warpgroups' P V products removed, their V reads with them), no-qk-mma
(the softmax warpgroup's Q K^T replaced by a zero score tile), all three timing only, every barrier kept; one-term
(bench_decode's fp8mma1 overrides), exact (cache_compute exact), slots4 (4 landing slots instead of the plan's 2:
226584 B of shared memory at DeepSeek's geometry) checked. --in-l2: every sequence reads the first sequence's pages
(decode_knobs.py's). --dry-run (no GPU): render the bundled DeepSeek fp8 spec, apply every edit and compile the
edited sources to bytecode (the files it prints compile for sm_90a with `benchmarks/gluon_offline_compile.py FILE
--fp8-compute [--land-slots 4]`). Exit 1 only where full or exact fails its check.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mlagen_compiler import compile_spec, import_module_from_path, spec_from_dict  # noqa: E402
from mlagen_compiler.registry import resolve_spec  # noqa: E402
from mlagen_compiler.tuning_db import tuned_for_spec  # noqa: E402

# ---- edits of the generated module's text (as rendered from templates/decode_gluon.py.jinja) -----------------------
_VA_READ = """\
        read: gl.constexpr = _gluon_f8_va_read_layout()
        words = land_w.index(half).load(read)
"""
_VA_NONE = """\
        return gl.zeros([256, 64], gl.float8e4nv, a_layout)  # (probe no-v: V not read)
"""
_SOFTMAX_PV = """\
        acc = warpgroup_mma(v_a, p_rows.permute((1, 0)), acc, is_async=True)
        mbarrier.arrive(land_free.index(slot))
        acc = warpgroup_mma_wait(0, deps=(acc,))
"""
_PV_PV = """\
        acc = warpgroup_mma(v_a, p_smem.slice(0, NARROW, dim=0).permute((1, 0)), acc, is_async=True)
        mbarrier.arrive(land_free.index(slot))
        acc = warpgroup_mma_wait(0, deps=(acc,))
"""
_LAND_FREE = """\
        mbarrier.arrive(land_free.index(slot))
"""
_QK = """\
        terms = gl.zeros([BLOCK_N, QN], gl.float32, qk_layout)
        for j in gl.static_range(NC):
            terms = warpgroup_mma(land_c.index(slot * NC + j),
                                  q8_c.index(j + opaque_zero).slice(0, QN, dim=0).permute((1, 0)), terms, is_async=True)
        for i in gl.static_range(NR):
            terms = warpgroup_mma(land_r.index(slot * NR + i),
                                  q8_r.index(i + opaque_zero).slice(0, QN, dim=0).permute((1, 0)), terms, is_async=True)
        v_a = _gluon_f8_v_operand(land_w, slot * 2, n_valid, gl.DotOperandLayout(0, s_layout, 4), MASKED)
        terms = warpgroup_mma_wait(0, deps=(terms,))
"""
_QK_NONE = """\
        terms = gl.zeros([BLOCK_N, QN], gl.float32, qk_layout)
        v_a = _gluon_f8_v_operand(land_w, slot * 2, n_valid, gl.DotOperandLayout(0, s_layout, 4), MASKED)
"""
#: variant: [(pattern, replacement)], each pattern matching the rendered module exactly once
EDITS = {
    "no-v": [(_VA_READ, _VA_NONE + _VA_READ)],
    "no-pv-mma": [(_SOFTMAX_PV, _LAND_FREE), (_PV_PV, _LAND_FREE)],
    "no-qk-mma": [(_QK, _QK_NONE)],
}
TIMING_ONLY = set(EDITS)


def edited(text: str, variant: str) -> str:
    for pattern, replacement in EDITS.get(variant, []):
        count = text.count(pattern)
        assert count == 1, f"{variant}: an edit pattern matches {count} times (stale against the template?)"
        text = text.replace(pattern, replacement)
    return text


def render(spec_name: str, compute: str, where: Path) -> Path:
    """The generated module's file for the bundled spec with cache_compute `compute` (exact or fp8)."""
    spec = resolve_spec(spec_name)
    fields = {**spec.to_flat_dict(), "name": f"{spec_name}-{compute}", "cache_compute": compute}
    spec = spec_from_dict(fields)
    return compile_spec(spec, where / spec.name, tuned_for_spec(spec))


VARIANTS = ("full", *EDITS, "one-term", "exact", "slots4")
#: slots4: the landing ring's slots (the shared memory has room for 4)
SLOTS4 = 4


def variant_files(spec_name: str, tmp: Path, variants=VARIANTS) -> dict[str, Path]:
    """The variants' module files (edited copies of the fp8 module; exact: its own module)."""
    source = render(spec_name, "fp8", tmp)
    text = source.read_text()
    files = {}
    for name in variants:
        if name == "exact":
            files[name] = render(spec_name, "exact", tmp)
            continue
        path = tmp / f"{source.stem}_{name.replace('-', '_')}.py"
        path.write_text(edited(text, name))
        files[name] = path
    return files


def dry_run(tmp: Path) -> None:
    for spec_name in ("deepseek-v3-tp8-fp8",):
        files = variant_files(spec_name, tmp / spec_name)
        for path in files.values():
            compile(path.read_text(), str(path), "exec")
        print("\n".join(f"  {n}: {p}" for n, p in files.items()))
        print(f"{spec_name}: {len(files)} variants rendered, edited and compiled to bytecode ({', '.join(files)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="deepseek-v3-tp8-fp8")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--in-l2", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, run in this order")
    args = parser.parse_args()
    variants = tuple(args.variants.split(","))
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "full" not in variants:
        parser.error(f"--variants: {', '.join(unknown) or 'full missing'} (of {', '.join(VARIANTS)}; full is needed)")
    tmp = Path(tempfile.mkdtemp())
    if args.dry_run:
        dry_run(tmp)
        return 0

    import bench_decode as bd
    import harness
    import torch

    from mlagen_compiler.reference import decode_paged_batched
    from mlagen_compiler.verify import compare_fp8_compute, compare_with_lse

    files = variant_files(args.spec, tmp, variants)
    modules = {name: import_module_from_path(path) for name, path in files.items()}
    for name, value in bd.CACHE_OVERRIDES["fp8mma1"].items():
        if "one-term" in modules:
            setattr(modules["one-term"], name, value)
    if "slots4" in modules:
        modules["slots4"].DECODE_GLUON_FP8_LAND_SLOTS = SLOTS4
    full = modules["full"]
    gen = torch.Generator().manual_seed(1)
    lens = [args.seqlen] * args.batch
    q, kv, table, seqlens, kv_scale = bd.make_inputs(full, lens, 1, gen)
    if args.in_l2:
        table = table[:1].expand_as(table).contiguous()
    ref_out, ref_lse = decode_paged_batched(
        q.float(), kv, table, seqlens, full.KV_LORA_RANK, full.SOFTMAX_SCALE, max_seqlen=args.seqlen, kv_scale=kv_scale
    )
    nbytes, _ = bd.bytes_and_flops(full, lens, 1)
    print(
        f"# {args.spec} H{full.NUM_HEADS} B{args.batch} S{args.seqlen} Sq1 cache_compute fp8"
        f"{' in L2' if args.in_l2 else ''}: {nbytes / 1e6:.1f} MB"
    )
    failed = False
    for name, module in modules.items():
        try:
            sched = module.get_decode_schedule(args.batch, 1, q.device)
            out = torch.empty(*q.shape[:3], module.KV_LORA_RANK, dtype=q.dtype, device=q.device)
            lse = torch.empty(q.shape[0], module.NUM_HEADS, 1, dtype=torch.float32, device=q.device)
            call = functools.partial(
                module.mla_decode, q, kv, table, seqlens, schedule=sched, out=out, lse=lse, return_lse=True,
                kv_scale=kv_scale,
            )  # fmt: skip
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            if name in TIMING_ONLY:
                checked = "timing only (output not checked)"
            else:
                if name == "exact":
                    max_err, rel, msg = compare_with_lse(out, lse, ref_out, ref_lse, "bfloat16")
                else:
                    max_err, rel, msg = compare_fp8_compute(out, lse, ref_out, ref_lse)
                lse_err = float((lse.double() - ref_lse.double()).abs().nan_to_num(float("inf")).max())
                checked = f"checked: max err {max_err:.3g}, rel err {rel:.4f}, max LSE err {lse_err:.3g}"
                if msg:
                    checked += f" WRONG: {msg}"
                    failed = failed or name in ("full", "exact")
            eager = harness.median_ms(call, warmup=25, rep=200, repeat=2) * 1e3
            graph = bd.time_graph(call) * 1e3
        except Exception as error:  # noqa: BLE001 - a variant that fails is reported; full / exact fail the run
            print(f"{name:>10}: FAILED {type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}")
            failed = failed or name in ("full", "exact")
            continue
        form = f"{'fp8mma' if sched.fp8_compute else 'exact kernel'}, narrow {sched.narrow}"
        if sched.fp8_compute_reason:
            form += f" ({sched.fp8_compute_reason})"
        print(
            f"{name:>10}: eager {eager:8.2f} us, graph {graph:8.2f} us, {nbytes / min(eager, graph) / 1e3:6.0f} GB/s;"
            f" {form}, config {sched.config}, parts {sched.num_parts}; {checked}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
