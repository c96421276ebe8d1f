"""Can Triton 3.6's Gluon build the pieces of an fp8 tensor-core decode consumer for sm_90a? (dev tool, issue 44)

Compiled offline, nothing launched (the stand-in Hopper driver of gluon_offline_compile.py): small one-warpgroup
kernels, global -> registers -> shared loads in place of a producer, BLOCK_M 64 query rows, BLOCK_N 64 positions,
Dc 512, Dr 64, e4m3 operands:

  1. qk: S = Q_fp8 . K_fp8^T by warpgroup_mma on two shared tiles (Dc and Dr parts), fp32 accumulator
  2. vt: V [BLOCK_N, Dc] from registers written transposed into shared memory, two ways: gl.permute of the
     register tile stored into a [Dc, BLOCK_N] buffer ("permute"), or the [BLOCK_N, Dc] tile stored into a
     buffer whose NVMMASharedLayout has transposed=True ("layout")
  3. pv: O = P_fp8 . V by warpgroup_mma with V^T (either way) as B, P from registers (DotOperandLayout,
     k_width 4) or through shared memory; "plain" V (position-major, not transposed) as the control
  4. block: the consumer's whole block: 1, exp2 softmax numerator quantised to e4m3, 2, 3 over two Dc halves

For each: compiled or the exact error, ptxas' registers / spills / shared memory, and the wgmma kinds in the
PTX and SASS.

    python benchmarks/probes/fp8_wgmma_offline.py [--dump DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gluon_offline_compile import _OfflineHopperDriver, _resource_usage  # noqa: E402

BLOCK_M, BLOCK_N, DC, DR = 64, 64, 512, 64
FP8 = torch.float8_e4m3fn


@gluon.jit
def _load_tile(ptr, ROWS: gl.constexpr, COLS: gl.constexpr, stride, layout: gl.constexpr):
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    return gl.load(ptr + rows[:, None] * stride + cols[None, :])


@gluon.jit
def _store_tile(ptr, value, ROWS: gl.constexpr, COLS: gl.constexpr, stride):
    layout: gl.constexpr = value.type.layout
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    gl.store(ptr + rows[:, None] * stride + cols[None, :], value)


@gluon.jit
def _scores(q_ptr, k_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr):
    """S = Q . K^T (fp8 operands in shared memory, K-major both: K's rows permuted into B)."""
    D: gl.constexpr = DC + DR
    load: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    c_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    r_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    q_c = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, DC], c_layout, _load_tile(q_ptr, BLOCK_M, DC, D, load))
    q_r = gl.allocate_shared_memory(
        gl.float8e4nv, [BLOCK_M, DR], r_layout, _load_tile(q_ptr + DC, BLOCK_M, DR, D, load)
    )
    k_c = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_N, DC], c_layout, _load_tile(k_ptr, BLOCK_N, DC, D, load))
    k_r = gl.allocate_shared_memory(
        gl.float8e4nv, [BLOCK_N, DR], r_layout, _load_tile(k_ptr + DC, BLOCK_N, DR, D, load)
    )
    fence_async_shared()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
    )
    s = warpgroup_mma(q_c, k_c.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout))
    return warpgroup_mma(q_r, k_r.permute((1, 0)), s)


@gluon.jit
def _v_operand(v_ptr, BLOCK_N: gl.constexpr, DC: gl.constexpr, D: gl.constexpr, V_FORM: gl.constexpr):
    """V [BLOCK_N, Dc] from registers into shared memory as P . V's B operand (a [BLOCK_N, Dc] view):
    "permute" / "layout" / "cols" K-major over the positions, "plain" position rows (N-major, the control)."""
    load: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    v = _load_tile(v_ptr, BLOCK_N, DC, D, load)
    if V_FORM == "permute":
        vt_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        vt = gl.allocate_shared_memory(gl.float8e4nv, [DC, BLOCK_N], vt_layout, gl.permute(v, (1, 0)))
        view = vt.permute((1, 0))
    elif V_FORM == "cols" or V_FORM == "sq4" or V_FORM == "sq8":  # (the landed tile read back and permuted)
        landed_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        landed = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_N, DC], landed_layout, v)
        if V_FORM == "cols":  # 16 positions of one column a thread
            read: gl.constexpr = gl.BlockedLayout([16, 1], [4, 8], [1, 4], [0, 1])
        elif V_FORM == "sq4":  # a 4 x 4 byte square a thread
            read: gl.constexpr = gl.BlockedLayout([4, 4], [8, 4], [1, 4], [1, 0])
        else:  # an 8 x 8 byte square a thread
            read: gl.constexpr = gl.BlockedLayout([8, 8], [8, 4], [1, 4], [1, 0])
        vt_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        vt = gl.allocate_shared_memory(gl.float8e4nv, [DC, BLOCK_N], vt_layout, gl.permute(landed.load(read), (1, 0)))
        view = vt.permute((1, 0))
    elif V_FORM == "layout":
        t_layout: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=64, element_bitwidth=8, rank=2, transposed=True
        )
        view = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_N, DC], t_layout, v)
    else:
        plain: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        view = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_N, DC], plain, v)
    return view


@gluon.jit
def _pv(p8, view, o_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DC: gl.constexpr, A_FORM: gl.constexpr):
    """O = P_fp8 . V over two Dc halves (a [64, 256] fp32 accumulator each), stored to o_ptr."""
    HALF: gl.constexpr = DC // 2
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 32])
    if A_FORM == "smem":
        p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        a = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, BLOCK_N], p_layout, p8)
    else:
        a = gl.convert_layout(p8, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4))
    fence_async_shared()
    for h in gl.static_range(2):
        o = warpgroup_mma(a, view.slice(h * HALF, HALF, dim=1), gl.zeros([BLOCK_M, HALF], gl.float32, o_layout))
        _store_tile(o_ptr + h * HALF, o, BLOCK_M, HALF, DC)


@gluon.jit
def qk_kernel(q_ptr, k_ptr, s_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr):
    s = _scores(q_ptr, k_ptr, BLOCK_M, BLOCK_N, DC, DR)
    _store_tile(s_ptr, s, BLOCK_M, BLOCK_N, BLOCK_N)


@gluon.jit
def vt_kernel(v_ptr, out_ptr, BLOCK_N: gl.constexpr, DC: gl.constexpr, D: gl.constexpr, V_FORM: gl.constexpr):
    view = _v_operand(v_ptr, BLOCK_N, DC, D, V_FORM)
    back: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # (V^T rows: 16-byte loads)
    _store_tile(out_ptr, view.permute((1, 0)).load(back), DC, BLOCK_N, BLOCK_N)


@gluon.jit
def pv_kernel(
    p_ptr,
    v_ptr,
    o_ptr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    DC: gl.constexpr,
    D: gl.constexpr,
    V_FORM: gl.constexpr,
    A_FORM: gl.constexpr,
):
    view = _v_operand(v_ptr, BLOCK_N, DC, D, V_FORM)
    load: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    p8 = _load_tile(p_ptr, BLOCK_M, BLOCK_N, BLOCK_N, load).to(gl.float8e4nv)
    _pv(p8, view, o_ptr, BLOCK_M, BLOCK_N, DC, A_FORM)


@gluon.jit
def block_kernel(
    q_ptr,
    k_ptr,
    o_ptr,
    qk_scale,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    DC: gl.constexpr,
    DR: gl.constexpr,
    V_FORM: gl.constexpr,
    A_FORM: gl.constexpr,
):
    """One block of the fp8 consumer: the same landed K tile gives K (Dc + Dr) and V (its Dc part)."""
    s = _scores(q_ptr, k_ptr, BLOCK_M, BLOCK_N, DC, DR) * qk_scale  # (the query's e4m3 row scale folded in)
    p = gl.exp2(s - gl.max(s, axis=1)[:, None])
    view = _v_operand(k_ptr, BLOCK_N, DC, DC + DR, V_FORM)
    _pv(p.to(gl.float8e4nv), view, o_ptr, BLOCK_M, BLOCK_N, DC, A_FORM)


def _sass(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.run([tool, "-sass", handle.name], capture_output=True, text=True).stdout


def _kinds(kernel) -> tuple[list[str], list[str]]:
    ptx = sorted(set(re.findall(r"wgmma\.mma_async[\w.]*", kernel.asm["ptx"])))
    sass = sorted(set(re.findall(r"\b[A-Z]?GMMA\.[\w.]+", _sass(kernel.asm["cubin"]))))
    return ptx, sass


def _shared_traffic(ptx: str) -> str:
    """The kernel's shared-memory instruction kinds and their counts in the PTX (unrolled: per thread)."""
    kinds = re.findall(r"\b(st\.shared[\w.]*|ld\.shared[\w.]*|ldmatrix[\w.]*|stmatrix[\w.]*|prmt\.b32)", ptx)
    return " ".join(f"{kind}:{kinds.count(kind)}" for kind in sorted(set(kinds)))


@contextlib.contextmanager
def _stderr_to(path: str):
    """fd 2 (where MLIR and LLVM write their diagnostics) into path for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as handle:
        os.dup2(handle.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _diagnostics(path: str) -> str:
    """The assertion / error lines of a failed compile (not the IR dump)."""
    lines = Path(path).read_text().splitlines()
    keep = [line.strip() for line in lines if "Assertion" in line or re.search(r"\berror\b", line)]
    return " / ".join(dict.fromkeys(keep))


def _cases():
    d = DC + DR
    q = torch.empty(BLOCK_M, d, dtype=FP8)
    k = torch.empty(BLOCK_N, d, dtype=FP8)
    f32 = torch.empty(BLOCK_M, DC, dtype=torch.float32)
    shapes = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DC=DC)
    yield "1 qk", qk_kernel, (q, k, f32), dict(shapes, DR=DR)
    for v_form in ("permute", "layout", "cols", "sq4", "sq8"):
        yield f"2 vt {v_form}", vt_kernel, (k, k), dict(BLOCK_N=BLOCK_N, DC=DC, D=d, V_FORM=v_form)
    for v_form in ("permute", "layout", "cols", "sq8", "plain"):
        for a_form in ("registers", "smem"):
            args = (f32, k, f32)
            yield f"3 pv V:{v_form} P:{a_form}", pv_kernel, args, dict(shapes, D=d, V_FORM=v_form, A_FORM=a_form)
    for v_form in ("permute", "sq8"):
        for a_form in ("registers", "smem"):
            args = (q, k, f32, 0.1)
            yield (
                f"4 block V:{v_form} P:{a_form}",
                block_kernel,
                args,
                dict(shapes, DR=DR, V_FORM=v_form, A_FORM=a_form),
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", help="write each compiled kernel's ttgir / ptx / sass here")
    args = parser.parse_args(argv)
    from triton.runtime.driver import driver

    os.environ.pop("TRITON_INTERPRET", None)
    driver.set_active(_OfflineHopperDriver())
    failures = 0
    scratch = tempfile.mkdtemp()
    for name, kernel_fn, kernel_args, constexprs in _cases():
        print(f"== {name}")
        log = os.path.join(scratch, "stderr.txt")
        try:
            with _stderr_to(log):
                kernel = kernel_fn.warmup(*kernel_args, **constexprs, num_warps=4, grid=(1,))
        except Exception as error:  # (the compiler's own message is the finding)
            failures += 1
            text = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
            print(f"   FAILED: {type(error).__name__}: {text[-1]}")
            if _diagnostics(log):
                print(f"   stderr: {_diagnostics(log)}")
            continue
        ptx, sass = _kinds(kernel)
        print(f"   compiled: shared {kernel.metadata.shared} B | {_resource_usage(kernel.asm['cubin'])}")
        print(f"   ptx  {ptx}")
        print(f"   sass {sass}")
        print(f"   shared-memory instructions: {_shared_traffic(kernel.asm['ptx'])}")
        if args.dump:
            stem = os.path.join(args.dump, re.sub(r"\W+", "_", name))
            os.makedirs(args.dump, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                Path(f"{stem}.{ext}").write_text(kernel.asm[ext])
            Path(f"{stem}.sass").write_text(_sass(kernel.asm["cubin"]))
    print(f"{failures} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
