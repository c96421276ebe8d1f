"""Compile a generated module's Gluon decode (or, --prefill, prefill) kernel for sm_90a on a machine without a GPU
(dev tool; the portable decode kernel: decode_offline_compile.py).

Triton's front end, its passes and ptxas (shipped in the triton wheel) need no GPU: a stand-in driver
answers "the current device is a compute capability 9.0 GPU", the kernel is compiled with `warmup`
(nothing is launched), and the register / spill report of ptxas is printed. Catches Gluon API and layout
errors and register spills without device time.

    python benchmarks/gluon_offline_compile.py generated/deepseek_v3_tp8.py [--sq 1] [--gather] [--combine-kernel]
    python benchmarks/gluon_offline_compile.py generated/deepseek_v3_tp8.py --prefill [--non-causal] [--persistent]
        [--chunk N]

--chunk is the persistent kernel's chunk argument (MLAGEN_PREFILL_TILE_CHUNK): an unspecialised int, so every
value compiles the same kernel (the printed cubin sha256 says so).

An fp8 module (generated/deepseek_v3_tp8_fp8.py) compiles the producer its launch would choose for --sq (the
landing producer where Sq * H <= 32, else the converting one); --producer picks one.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import os
import sys

import torch


class _OfflineHopperDriver:
    """Enough of triton's active driver for compilation: target, device and stream queries."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _load_offline(module_path):
    """The generated module at module_path, imported with the stand-in Hopper driver active (nothing launches)."""
    from triton.runtime.driver import driver

    os.environ.pop("TRITON_INTERPRET", None)
    driver.set_active(_OfflineHopperDriver())
    spec = importlib.util.spec_from_file_location("offline_module", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_offline(
    module_path: str,
    seqlen_q: int = 1,
    gather: bool = False,
    fused_merge: bool = True,
    consumer_regs: int | None = None,
    producer: str | None = None,
    narrow: bool = True,
    sequence_runs: bool = False,
    short_blocks: bool = False,
    land_slots: int | None = None,
    long_blocks: bool = False,
    causal: bool = True,
    empty_inf: bool = False,
) -> dict:
    """Compile the module's _mla_decode_gluon_kernel for (Sq, producer kind); returns ptxas' numbers. An fp8
    module's landing producer with more query rows than half the tile (the query filling it) lands beside the
    query tile in its landing ring (older modules: in short blocks). long_blocks:
    the long blocks of gluon_long_blocks (a 16-bit cache; pages of the module's size)."""
    from triton.experimental.gluon import language as gl

    module = _load_offline(module_path)
    assert not module._GLUON_IMPORT_ERROR, module._GLUON_IMPORT_ERROR
    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    batch, heads = 4, module.NUM_HEADS
    q = torch.empty(batch * seqlen_q * heads, width, dtype=module.DTYPE)
    from mlagen_compiler.cache_format import module_cache_format  # (importable: the module imports mlagen)

    scaled = module_cache_format(module).scaled
    kv = torch.empty(64, module.PAGE_SIZE, 1, width, dtype=module.CACHE_DTYPE)
    rows = seqlen_q * heads
    # the narrow form's width (0: rows as M; a module generated before the narrow form takes no NARROW)
    narrow_form = {}  # (and other keyword arguments that differ between module generations)
    if hasattr(module, "gluon_narrow_rows"):
        narrow_form["NARROW"] = module.gluon_narrow_rows(rows, module.DECODE_GLUON_NARROW_ROWS if narrow else 0)
    if producer is None:  # the launch's choice (gather: a cache whose pages TMA cannot address)
        # (modules after 0329922 take the schedule's narrow form)
        takes_narrow = "narrow" in inspect.signature(module._gluon_producer_kind).parameters
        kind_args = (narrow_form["NARROW"],) if takes_narrow else ()
        producer, _, _ = module._gluon_producer_kind(kv[:, :, :, 1:] if gather else kv, rows, *kind_args)
    # the landing producer's mbarrier pairs (a module generated before landing pieces has one per chunk)
    if hasattr(module, "DECODE_GLUON_LAND_PIECES"):
        narrow_form["LAND_PIECES"] = module.DECODE_GLUON_LAND_PIECES if producer == "land" else 1
    elif hasattr(module, "_GLUON_LAND_PIECES"):  # (the pieces computed in the module, 2026-11-25 17:30-18:50 UTC)
        narrow_form["LAND_PIECES"] = module._GLUON_LAND_PIECES if producer == "land" else 1
    else:
        narrow_form["LAND_CHUNKS"] = module._GLUON_LAND_CHUNKS if producer == "land" else 1
    if "SEQUENCE_RUNS" in module._mla_decode_gluon_kernel.arg_names:  # (modules after 0329922: runs of one sequence)
        narrow_form["SEQUENCE_RUNS"] = sequence_runs
    if "KEEP_PARTIALS" in module._mla_decode_gluon_kernel.arg_names:  # (9ea7027-8b7840e: L2 hints, a flag)
        narrow_form["KEEP_PARTIALS"] = True
    if "PARTIAL_STORE" in module._mla_decode_gluon_kernel.arg_names:  # (later: L2 hints, the store's policy)
        from mlagen_compiler.runtime import _PARTIAL_EVICTION  # (older modules imported it too)

        narrow_form["PARTIAL_STORE"] = _PARTIAL_EVICTION[True][0]
    if "CAUSAL" in module._mla_decode_gluon_kernel.arg_names:  # (modules with mla_decode(causal=, empty_lse=))
        narrow_form.update(CAUSAL=causal, EMPTY_INF=empty_inf)
    land_warps = module.DECODE_GLUON_NARROW_LAND_WARPS if narrow_form.get("NARROW") else module.DECODE_GLUON_LAND_WARPS
    # cache positions a block and ring stages: the plan's, or (short_blocks) the small batches'
    block_n, stages = module.DECODE_GLUON_BLOCK_N, module.DECODE_GLUON_STAGES
    p_layout = module._GLUON_LAYOUT_P
    if isinstance(p_layout, dict):  # (modules after 44c0e3f: a P layout per block size)
        if short_blocks:
            block_n, stages = module.DECODE_GLUON_SMALL_BATCH_BLOCK_N, module.DECODE_GLUON_SMALL_BATCH_STAGES
        if long_blocks:
            if not module.DECODE_GLUON_LONG_BLOCK_N:
                raise ValueError(f"long_blocks: {module_path} has no long blocks (Dc 512, or an fp8 cache)")
            block_n, stages = module.DECODE_GLUON_LONG_BLOCK_N, module.DECODE_GLUON_LONG_BLOCK_STAGES
            producer = module._gluon_producer_kind(kv[:, :, :, 1:] if gather else kv, rows, 0, block_n)[0]
        # (a query filling the tile lands in the landing ring beside it, gluon_land_ring; modules before
        # 2026-11-26's thirteenth session: in 32-position blocks, gluon_land_apart; forced with --producer land)
        full_query = producer == "land" and rows > module.DECODE_GLUON_LAND_ROWS
        apart_blocks = hasattr(module, "DECODE_GLUON_LAND_APART_BLOCK_N")
        if full_query and not apart_blocks and module.DECODE_GLUON_LAND_RING_SLOTS < 2:
            raise ValueError(f"--producer land with {rows} query rows: {module_path} has no landing ring (Dc 512)")
        # (the constexpr's name: FULL_QUERY since 2026-11-26's fifteenth session, LAND_APART from 2292396)
        arg_names = module._mla_decode_gluon_kernel.arg_names
        full_query_arg = next((name for name in ("FULL_QUERY", "LAND_APART") if name in arg_names), None)
        if full_query_arg:
            narrow_form[full_query_arg] = full_query
        if full_query:
            if apart_blocks:
                block_n, stages = module.DECODE_GLUON_LAND_APART_BLOCK_N, module.DECODE_GLUON_LAND_APART_STAGES
            narrow_form["LAND_PIECES"] = getattr(
                module, "DECODE_GLUON_LAND_FULL_QUERY_PIECES", getattr(module, "DECODE_GLUON_LAND_APART_PIECES", None)
            )
        if "PREFETCH_BLOCKS" in module._mla_decode_gluon_kernel.arg_names:  # (modules after e939bf8)
            narrow_form["PREFETCH_BLOCKS"] = producer == "convert" and not gather
        if "LAND_SLOTS" in module._mla_decode_gluon_kernel.arg_names:  # (modules with a landing ring)
            # (what gluon_land_ring plans where the query takes the tile's upper half)
            if land_slots is None:
                ring = producer == "land" and not (full_query and apart_blocks)
                land_slots = module.DECODE_GLUON_LAND_RING_SLOTS if ring else 1
            narrow_form["LAND_SLOTS"] = land_slots
            if land_slots > 1:
                stages = module.DECODE_GLUON_LAND_RING_STAGES
        if "QUERY_SLICE" in module._mla_decode_gluon_kernel.arg_names:  # (modules after b7bcace)
            query_slice = getattr(
                module,
                "DECODE_GLUON_LAND_FULL_QUERY_SLICE",
                getattr(module, "DECODE_GLUON_LAND_APART_QUERY_SLICE", 0),
            )
            narrow_form["QUERY_SLICE"] = query_slice if full_query else 0
        p_layout = p_layout[block_n]
        if full_query:
            descriptors = module._gluon_launch_descriptors(q, kv, producer, block_n, True)
        else:
            descriptors = module._gluon_launch_descriptors(q, kv, producer, block_n)
        q_desc_c, q_desc_r, kv_desc_c, kv_desc_r = descriptors
    else:
        q_desc_c, q_desc_r, kv_desc_c, kv_desc_r = module._gluon_launch_descriptors(q, kv, producer)
    i32 = torch.empty(16, dtype=torch.int32)
    f32 = torch.empty(16, dtype=torch.float32)
    out = torch.empty(16, dtype=module.DTYPE)
    kernel = module._mla_decode_gluon_kernel.warmup(
        q_desc_c,
        q_desc_r,
        kv_desc_c,
        kv_desc_r,
        kv,
        i32,
        i32,
        out,
        f32,
        f32,
        f32,
        i32,
        torch.empty(1, dtype=torch.float32) if scaled else i32,
        0.1,
        batch,
        8,
        5,
        module.PAGE_SIZE * width,
        width,
        64,
        512,
        512,
        512,
        64,
        1,
        512 * 64,
        512,
        SQ=seqlen_q,
        H=heads,
        DC=module.KV_LORA_RANK,
        DR=module.QK_ROPE_HEAD_DIM,
        DC_HALF=module.DECODE_GLUON_DC_HALF,
        PAGE_SIZE=module.PAGE_SIZE,
        BLOCK_M=module.DECODE_GLUON_BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_B=16,
        STAGES=stages,
        P_LAYOUT=p_layout,
        PRODUCER=producer,
        ZERO_TAIL=producer in ("tma", "land"),
        STAGE_DTYPE=gl.float16 if scaled else module._GLUON_DTYPE,
        PRODUCER_WARPS={"tma": 1, "land": land_warps}.get(producer, module.DECODE_GLUON_GATHER_WARPS),
        ISSUER_REGS=module.DECODE_GLUON_PRODUCER_REGS,
        PRODUCER_REGS={
            "tma": module.DECODE_GLUON_PRODUCER_REGS,
            "gather": module.DECODE_GLUON_GATHER_REGS,
            "convert": module.DECODE_GLUON_CONVERT_REGS,
            "convert_bytes": module.DECODE_GLUON_CONVERT_REGS,
            "land": module.DECODE_GLUON_LAND_REGS,
        }[producer],
        GATHER_COLS=module.DECODE_GLUON_GATHER_COLS,
        FUSED_MERGE=fused_merge,
        MERGE_FANIN=module.DECODE_MERGE_FANIN,
        MERGE_LEVELS=module.DECODE_MERGE_LEVELS,
        MERGE_BLOCK_C=module.DECODE_MERGE_BLOCK_C,
        CONSUMER_REGS=consumer_regs or module.DECODE_GLUON_CONSUMER_REGS,
        LN2=0.6931471805599453,
        SCALED=scaled,
        **narrow_form,
        num_warps=4,
        grid=(1,),
    )
    return {"shared": kernel.metadata.shared, "resources": _resource_usage(kernel.asm["cubin"]), "kernel": kernel}


def compile_prefill_offline(
    module_path: str,
    causal: bool = True,
    store_lse: bool = True,
    float32_out: bool = False,
    block_n: int | None = None,
    stages: int | None = None,
    consumer_regs: int | None = None,
    producer_regs: int | None = None,
    persistent: bool = False,
    chunk: int = 0,
) -> dict:
    """Compile the module's _mla_prefill_gluon_kernel (causal, or the non-causal prefix attention of chunked
    prefill, whose outputs are float32 partials: float32_out), or (persistent) its persistent variant
    _mla_prefill_gluon_persistent_kernel (its chunk argument: `chunk`); returns ptxas' numbers. block_n / stages /
    the registers: the plan's unless given."""
    module = _load_offline(module_path)
    assert not module._PREFILL_GLUON_IMPORT_ERROR, module._PREFILL_GLUON_IMPORT_ERROR
    tokens, heads = 1024, module.NUM_HEADS
    dn, dr, dv = module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM
    block_n = block_n or module.PREFILL_GLUON_BLOCK_N
    q = torch.empty(tokens, heads * (dn + dr), dtype=module.DTYPE)
    k_nope = torch.empty(tokens, heads * dn, dtype=module.DTYPE)
    k_pe = torch.empty(tokens, dr, dtype=module.DTYPE)
    v = torch.empty(tokens, heads * dv, dtype=module.DTYPE)
    descriptors = module._gluon_prefill_descriptors(q, k_nope, k_pe, v, block_n)
    out = torch.empty(tokens, heads, dv, dtype=torch.float32 if float32_out else module.DTYPE)
    cu = torch.empty(5, dtype=torch.int32)
    chosen = module._mla_prefill_gluon_persistent_kernel if persistent else module._mla_prefill_gluon_kernel
    schedule = (chunk,) if persistent else ()
    kernel = chosen.warmup(
        *descriptors,
        out,
        torch.empty(heads, tokens, dtype=torch.float32),
        cu,
        cu,
        0.1,
        out.stride(0),
        out.stride(1),
        tokens,
        4 * heads,  # pairs
        -(-tokens // module.PREFILL_GLUON_BLOCK_M),  # m_blocks
        4,  # sections
        *schedule,
        H=heads,
        DN=dn,
        DR=dr,
        DV=dv,
        BLOCK_N=block_n,
        STAGES=stages or module.PREFILL_GLUON_STAGES,
        CAUSAL=causal,
        STORE_LSE=store_lse,
        CONSUMER_REGS=consumer_regs or module.PREFILL_GLUON_CONSUMER_REGS,
        PRODUCER_REGS=producer_regs or module.PREFILL_GLUON_PRODUCER_REGS,
        LN2=0.6931471805599453,
        num_warps=4,
        grid=(1,),
    )
    return {"shared": kernel.metadata.shared, "resources": _resource_usage(kernel.asm["cubin"]), "kernel": kernel}


def _resource_usage(cubin: bytes) -> str:
    """cuobjdump's register / stack / spill line for the kernel (cuobjdump ships in the triton wheel)."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        report = subprocess.run([tool, "--dump-resource-usage", handle.name], capture_output=True, text=True)
    return " ".join(line.strip() for line in report.stdout.splitlines() if "REG" in line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module")
    parser.add_argument("--sq", type=int, default=1)
    parser.add_argument("--gather", action="store_true", help="the gathering producer (pages < 64)")
    parser.add_argument(
        "--producer",
        choices=["tma", "gather", "convert", "convert_bytes", "land"],
        help="the producer kind (default: the launch's for a page of the module's size)",
    )
    parser.add_argument("--dump", help="write the kernel's ttgir / ptx / cubin here")
    parser.add_argument("--combine-kernel", action="store_true", help="without the fused merge")
    parser.add_argument("--wide", action="store_true", help="rows as the MMAs' M even where the narrow form applies")
    parser.add_argument("--sequence-runs", action="store_true", help="runs that never cross a sequence's end")
    parser.add_argument("--short-blocks", action="store_true", help="the small batches' short cache blocks")
    parser.add_argument("--regs", type=int, help="registers of the P @ V warpgroups (default: the module's)")
    parser.add_argument(
        "--land-slots", type=int, help="fp8 blocks the landing producer lands at a time (default: the plan's)"
    )
    parser.add_argument("--long-blocks", action="store_true", help="the long blocks of two or more row blocks")
    parser.add_argument("--non-causal", action="store_true", help="every new token sees the whole sequence")
    parser.add_argument("--empty-inf", action="store_true", help="lse +inf for a query that sees no key")
    parser.add_argument(
        "--prefill",
        action="store_true",
        help="the Gluon prefill instead (--non-causal: the prefix attention of chunked prefill, float32 out)",
    )
    parser.add_argument("--block-n", type=int, help="(--prefill) key positions a block (default: the plan's)")
    parser.add_argument("--stages", type=int, help="(--prefill) ring stages (default: the plan's)")
    parser.add_argument(
        "--persistent", action="store_true", help="(--prefill) the persistent kernel (MLAGEN_PREFILL_PERSISTENT=1)"
    )
    parser.add_argument("--chunk", type=int, default=0, help="(--persistent) its chunk argument (default 0)")
    args = parser.parse_args(argv)
    if args.persistent and not args.prefill:
        parser.error("--persistent: only with --prefill")
    if args.chunk and not args.persistent:
        parser.error(f"--chunk: only with --persistent, got {args.chunk}")
    if args.chunk < 0:
        parser.error(f"--chunk: must be an int >= 0, got {args.chunk}")
    if args.land_slots is not None and args.land_slots < 1:
        parser.error(f"--land-slots: must be an int >= 1, got {args.land_slots}")
    if args.prefill:
        result = compile_prefill_offline(
            args.module,
            causal=not args.non_causal,
            float32_out=args.non_causal,
            block_n=args.block_n,
            stages=args.stages,
            consumer_regs=args.regs,
            persistent=args.persistent,
            chunk=args.chunk,
        )
    else:
        result = compile_offline(
            args.module,
            args.sq,
            args.gather,
            not args.combine_kernel,
            args.regs,
            args.producer,
            not args.wide,
            args.sequence_runs,
            args.short_blocks,
            args.land_slots,
            args.long_blocks,
            not args.non_causal,
            args.empty_inf,
        )
    kernel = result.pop("kernel")
    print(result)
    print(f"cubin sha256 {hashlib.sha256(kernel.asm['cubin']).hexdigest()[:16]}")
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            if ext in kernel.asm:
                with open(os.path.join(args.dump, f"kernel.{ext}"), "w") as handle:
                    handle.write(kernel.asm[ext])
        with open(os.path.join(args.dump, "kernel.cubin"), "wb") as handle:  # (cuobjdump -sass: spills)
            handle.write(kernel.asm["cubin"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
