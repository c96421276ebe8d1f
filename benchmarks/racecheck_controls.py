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
    handoff_nowait  handoff_ok without any wait: a real race (the control that the tool reports races)

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


@gluon.jit
def _handoff_producer(buf, ready, free, ITERS: gl.constexpr, N: gl.constexpr, WAIT: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, N, layout)
    for i in range(ITERS):
        if WAIT:
            mbarrier.wait(free, (i & 1) ^ 1)
        buf.store((offs + 1000 * i).to(gl.float32))
        fence_async_shared()  # as the decode does before its arrive (not needed for a generic-proxy reader)
        mbarrier.arrive(ready)


@gluon.jit
def _handoff_consumer(out, buf, ready, free, ITERS: gl.constexpr, N: gl.constexpr, WAIT: gl.constexpr):
    # thread t of this partition (CTA thread 128 + t) reads what thread t of the producer stored
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    acc = gl.zeros([N], gl.float32, layout)
    for i in range(ITERS):
        if WAIT:
            mbarrier.wait(ready, i & 1)
        acc += buf.load(layout)
        mbarrier.arrive(free)
    offs = gl.arange(0, N, layout)
    gl.store(out + offs, acc)


@gluon.jit
def _handoff_kernel(out, ITERS: gl.constexpr, N: gl.constexpr, WAIT: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.init(free, count=1)
    gl.warp_specialize(
        [
            (_handoff_producer, (buf, ready, free, ITERS, N, WAIT)),
            (_handoff_consumer, (out, buf, ready, free, ITERS, N, WAIT)),
        ],
        [4],
        [96],
    )


# one jit function per control, so racecheck names each in its report
@gluon.jit
def handoff_ok_kernel(out, ITERS: gl.constexpr, N: gl.constexpr):
    _handoff_kernel(out, ITERS, N, True)


@gluon.jit
def handoff_once_kernel(out, N: gl.constexpr):
    _handoff_kernel(out, 1, N, True)


@gluon.jit
def handoff_nowait_kernel(out, ITERS: gl.constexpr, N: gl.constexpr):
    _handoff_kernel(out, ITERS, N, False)


def _expected(iters: int) -> torch.Tensor:
    offs = torch.arange(N, dtype=torch.float32)
    return sum(offs + 1000 * i for i in range(iters))


#: name: (launch(out), expected result or None)
CONTROLS = {
    "ws_entry": (
        lambda out: ws_entry_kernel[(1,)](out, 5.0, N, num_warps=4),
        torch.cat([torch.arange(N, dtype=torch.float32) + 5, torch.arange(N, dtype=torch.float32) - 5]),
    ),
    "handoff_ok": (lambda out: handoff_ok_kernel[(1,)](out, ITERS, N, num_warps=4), _expected(ITERS)),
    "handoff_once": (lambda out: handoff_once_kernel[(1,)](out, N, num_warps=4), _expected(1)),
    "handoff_nowait": (lambda out: handoff_nowait_kernel[(1,)](out, ITERS, N, num_warps=4), None),
}


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
        launch, expected = CONTROLS[name]
        if args.ptx:
            out = torch.empty(2 * N, dtype=torch.float32)
            compiled = _warmup(name, out)
            with open(os.path.join(args.ptx, f"{name}.ptx"), "w") as handle:
                handle.write(compiled.asm["ptx"])
            print(f"{name}: ptx written")
            continue
        out = torch.full((2 * N,), float("nan"), dtype=torch.float32, device="cuda")
        launch(out)
        torch.cuda.synchronize()
        got = out.cpu()[: len(expected) if expected is not None else N]
        if expected is None:
            print(f"control {name}: ran (a racing kernel: result not checked)")
        else:
            ok = torch.equal(got, expected)
            failed += not ok
            print(f"control {name}: {'PASS' if ok else 'FAIL'}")
    return 1 if failed else 0


def _warmup(name: str, out: torch.Tensor):
    """Compile one control without launching it (offline PTX)."""
    grid = (1,)
    if name == "ws_entry":
        return ws_entry_kernel.warmup(out, 5.0, N, num_warps=4, grid=grid)
    if name in ("handoff_ok", "handoff_nowait"):
        fn = handoff_ok_kernel if name == "handoff_ok" else handoff_nowait_kernel
        return fn.warmup(out, ITERS, N, num_warps=4, grid=grid)
    return handoff_once_kernel.warmup(out, N, num_warps=4, grid=grid)


if __name__ == "__main__":
    raise SystemExit(main())
