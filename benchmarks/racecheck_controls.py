"""Control kernels for compute-sanitizer racecheck on warp-specialised Gluon code (dev tool, Hopper).

The Gluon decode hands shared-memory vectors (alpha, l) from one warpgroup to another through mbarriers,
the way Gluon lowers them: every thread of the producing partition stores, `mbarrier.arrive` becomes a
partition-wide `bar.sync <id>, 128` then one thread's `mbarrier.arrive` (release), and the consumer's
`mbarrier.wait` a `try_wait` loop in every thread (acquire). These kernels isolate that pattern, so
racecheck's verdict on it can be compared with its verdict on a handoff that really races:

    ws_entry        warp_specialize with one captured scalar, no shared buffer of its own: only Triton's
                    partition start/stop protocol (state bytes and captures in shared memory, full-CTA
                    `barrier.sync 1`)
    handoff_ok      ready/free ring of one buffer, ITERS rounds, all 128 threads store and load (the
                    decode's alpha_smem / l_smem protocol): correct
    handoff_once    one round (no reuse), all threads store: correct
    handoff_nowait  handoff_ok without any wait: a real race
    handoff_nosync  neither waits nor arrives: a real race
    decode_like_ok  handoff_ok as the decode does it: the vector in the row layout of the warpgroup MMA
                    result (each value stored by the 4 threads of a quad), dependent arithmetic between
                    rounds, 64 rounds, 132 programs: correct
    decode_like_nowait  decode_like_ok without waits: a real race
    quad_ok, busy_ok    decode_like_ok's row layout alone (1 program, 8 rounds), its rounds and programs
                    alone (one writer per value): correct

Each kernel checks its own result, so a run shows that the correct ones compute the right values.

    python benchmarks/racecheck_controls.py [names...]           # on a Hopper GPU
    python benchmarks/racecheck_controls.py --ptx DIR [names...]  # offline: write each kernel's PTX
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

N = 128  # elements of the handed-over vector: one per thread of a 4-warp partition
ITERS = 8


@gluon.jit
def _ws_entry_default(out, x, N: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, N, layout)
    gl.store(out + offs, offs.to(gl.float32) + x)


@gluon.jit
def _ws_entry_worker(out, x, N: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, N, layout)
    gl.store(out + N + offs, offs.to(gl.float32) - x)


@gluon.jit
def ws_entry_kernel(out, x, N: gl.constexpr):
    gl.warp_specialize([(_ws_entry_default, (out, x, N)), (_ws_entry_worker, (out, x, N))], [4], [96])


#: the decode's score layout: a row vector of it is held by the 4 threads of a quad (redundant stores)
_S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))

OK, NOWAIT, NOSYNC = 0, 1, 2  # handoff modes: waits and arrives; arrives only; neither
#: what of the decode a handoff copies (bits): the row layout of its scores (each value held and stored by
#: the 4 threads of a quad), dependent arithmetic between handoffs
QUAD: gl.constexpr = gl.constexpr(1)
BUSY: gl.constexpr = gl.constexpr(2)


@gluon.jit
def _handoff_producer(
    out, buf, ready, free, ITERS: gl.constexpr, N: gl.constexpr, MODE: gl.constexpr, LIKE: gl.constexpr
):
    if LIKE & QUAD:
        layout: gl.constexpr = gl.SliceLayout(1, _S_LAYOUT)
    else:
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, N, layout)
    base = offs + gl.program_id(0)
    busy = offs.to(gl.float32)
    for i in range(ITERS):
        if LIKE & BUSY:
            # some dependent arithmetic between handoffs, as the softmax step has
            for _ in range(32):
                busy = busy * 0.999 + 1.0
        if MODE == 0:
            mbarrier.wait(free, (i & 1) ^ 1)
        buf.store((base + 1000 * i).to(gl.float32))
        if MODE != 2:
            fence_async_shared()  # as the decode does before its arrive (not needed for a generic-proxy reader)
            mbarrier.arrive(ready)
    if LIKE & BUSY:  # keeps the busy work
        gl.store(out + (gl.num_programs(0) + gl.program_id(0)) * N + offs, busy)


@gluon.jit
def _handoff_consumer(
    out, buf, ready, free, ITERS: gl.constexpr, N: gl.constexpr, MODE: gl.constexpr, LIKE: gl.constexpr
):
    # thread t of this partition (CTA thread 128 + t) reads what thread t of the producer stored
    if LIKE & QUAD:
        layout: gl.constexpr = gl.SliceLayout(1, _S_LAYOUT)
    else:
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    acc = gl.zeros([N], gl.float32, layout)
    for i in range(ITERS):
        if MODE == 0:
            mbarrier.wait(ready, i & 1)
        acc += buf.load(layout)
        if MODE != 2:
            mbarrier.arrive(free)
    offs = gl.arange(0, N, layout)
    gl.store(out + gl.program_id(0) * N + offs, acc)


@gluon.jit
def _handoff_kernel(out, ITERS: gl.constexpr, N: gl.constexpr, MODE: gl.constexpr, LIKE: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.init(free, count=1)
    gl.warp_specialize(
        [
            (_handoff_producer, (out, buf, ready, free, ITERS, N, MODE, LIKE)),
            (_handoff_consumer, (out, buf, ready, free, ITERS, N, MODE, LIKE)),
        ],
        [4],
        [96],
    )


# one jit function per control, so racecheck names each in its report
@gluon.jit
def handoff_ok_kernel(out, ITERS: gl.constexpr, N: gl.constexpr):
    _handoff_kernel(out, ITERS, N, 0, 0)


@gluon.jit
def handoff_once_kernel(out, N: gl.constexpr):
    _handoff_kernel(out, 1, N, 0, 0)


@gluon.jit
def handoff_nowait_kernel(out, ITERS: gl.constexpr, N: gl.constexpr):
    _handoff_kernel(out, ITERS, N, 1, 0)


@gluon.jit
def handoff_nosync_kernel(out, ITERS: gl.constexpr, N: gl.constexpr):
    _handoff_kernel(out, ITERS, N, 2, 0)


@gluon.jit
def decode_like_ok_kernel(out, ITERS: gl.constexpr, N: gl.constexpr):
    _handoff_kernel(out, ITERS, N, 0, 3)


@gluon.jit
def decode_like_nowait_kernel(out, ITERS: gl.constexpr, N: gl.constexpr):
    _handoff_kernel(out, ITERS, N, 1, 3)


@gluon.jit
def quad_ok_kernel(out, ITERS: gl.constexpr, N: gl.constexpr):
    _handoff_kernel(out, ITERS, N, 0, 1)


@gluon.jit
def busy_ok_kernel(out, ITERS: gl.constexpr, N: gl.constexpr):
    _handoff_kernel(out, ITERS, N, 0, 2)


def _expected(iters: int, n: int = N, programs: int = 1) -> torch.Tensor:
    offs = torch.arange(n, dtype=torch.float32)
    return torch.cat([sum(offs + p + 1000 * i for i in range(iters)) for p in range(programs)])


DL_ITERS, DL_N, DL_PROGRAMS = 64, 64, 132  # decode-like: BLOCK_M rows, a block per iteration, an SM each

#: name: (kernel, grid, ITERS or None, N, expected result or None (a racing kernel))
CONTROLS = {
    "ws_entry": (ws_entry_kernel, 1, None, N, None),
    "handoff_ok": (handoff_ok_kernel, 1, ITERS, N, _expected(ITERS)),
    "handoff_once": (handoff_once_kernel, 1, None, N, _expected(1)),
    "handoff_nowait": (handoff_nowait_kernel, 1, ITERS, N, None),
    "handoff_nosync": (handoff_nosync_kernel, 1, ITERS, N, None),
    "decode_like_ok": (decode_like_ok_kernel, DL_PROGRAMS, DL_ITERS, DL_N, _expected(DL_ITERS, DL_N, DL_PROGRAMS)),
    "decode_like_nowait": (decode_like_nowait_kernel, DL_PROGRAMS, DL_ITERS, DL_N, None),
    # which part of decode_like_ok racecheck reports: the quad layout alone, or the busy rounds and programs alone
    "quad_ok": (quad_ok_kernel, 1, ITERS, DL_N, _expected(ITERS, DL_N)),
    "busy_ok": (busy_ok_kernel, DL_PROGRAMS, DL_ITERS, N, _expected(DL_ITERS, N, DL_PROGRAMS)),
}


def _launch(name: str, out: torch.Tensor, warmup: bool = False):
    kernel, grid, iters, n, _ = CONTROLS[name]
    args = (out, 5.0, n) if name == "ws_entry" else (out, n) if iters is None else (out, iters, n)
    if warmup:
        return kernel.warmup(*args, num_warps=4, grid=(grid,))
    return kernel[(grid,)](*args, num_warps=4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(CONTROLS))
    parser.add_argument("--ptx", help="compile offline for sm_90a and write NAME.ptx here (no GPU needed)")
    args = parser.parse_args(argv)
    if args.ptx:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gluon_offline_compile import _OfflineHopperDriver
        from triton.runtime.driver import driver

        driver.set_active(_OfflineHopperDriver())
        os.makedirs(args.ptx, exist_ok=True)
    failed = 0
    for name in args.names:
        _, grid, _, n, expected = CONTROLS[name]
        if name == "ws_entry":
            expected = torch.cat([torch.arange(n, dtype=torch.float32) + 5, torch.arange(n, dtype=torch.float32) - 5])
        if args.ptx:
            compiled = _launch(name, torch.empty(2 * grid * n, dtype=torch.float32), warmup=True)
            with open(os.path.join(args.ptx, f"{name}.ptx"), "w") as handle:
                handle.write(compiled.asm["ptx"])
            print(f"{name}: ptx written")
            continue
        out = torch.full((2 * grid * n,), float("nan"), dtype=torch.float32, device="cuda")
        _launch(name, out)
        torch.cuda.synchronize()
        if expected is None:
            print(f"control {name}: ran (a racing kernel: result not checked)")
        else:
            ok = torch.equal(out.cpu()[: len(expected)], expected)
            failed += not ok
            print(f"control {name}: {'PASS' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
