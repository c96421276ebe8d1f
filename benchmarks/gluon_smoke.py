"""First check of the Gluon decode on a Hopper GPU: a few cases per producer kind, each against the
reference, with a watchdog (a wrong mbarrier phase hangs the GPU instead of failing).

    python benchmarks/gluon_smoke.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlagen_compiler import compile_spec, import_module_from_path, spec_from_dict  # noqa: E402
from mlagen_compiler.verify import (  # noqa: E402
    LSE_TOLERANCE,
    compare,
    decode_reference,
    make_decode_inputs,
    poison_unused_cache,
)


def sync_or_die(what: str, timeout_s: float = 60.0) -> None:
    event = torch.cuda.Event()
    event.record()
    start = time.time()
    while not event.query():
        if time.time() - start > timeout_s:
            print(f"HANG: {what}", flush=True)
            os._exit(3)
        time.sleep(0.001)


def main() -> int:
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    failures = 0
    cases = [  # (H, Dc, Dr, page, dtype, Sq, seqlens, num_parts, min_blocks)
        (16, 512, 64, 64, "bfloat16", 1, [1, 63, 64, 65, 1000, 0], None, None),
        (16, 512, 64, 64, "bfloat16", 2, [2, 64, 65, 66, 1001], 7, 1),
        (128, 512, 64, 64, "bfloat16", 1, [129, 4096, 777], None, None),
        (32, 256, 64, 64, "bfloat16", 2, [200, 4097, 5], 5, 1),
        (40, 256, 32, 128, "float16", 3, [3, 300, 1025], None, None),
        (16, 512, 64, 16, "bfloat16", 1, [1, 15, 17, 700, 0], None, None),
        (16, 512, 64, 1, "float16", 4, [4, 65, 130], 4, 1),
        (16, 512, 64, 256, "bfloat16", 2, [2, 255, 257, 3000], None, None),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (heads, dc, dr, page, dtype, sq, seqlens, parts, min_blocks) in enumerate(cases):
            spec = spec_from_dict(
                dict(name=f"smoke{i}", num_heads=heads, kv_lora_rank=dc, qk_rope_head_dim=dr, qk_nope_head_dim=64,
                     v_head_dim=64, page_size=page, dtype=dtype)
            )  # fmt: skip
            module = import_module_from_path(compile_spec(spec, Path(tmp) / spec.name))
            label = f"H{heads} Dc{dc} Dr{dr} page{page} {dtype} Sq{sq} L={seqlens} parts={parts}"
            try:
                inputs = make_decode_inputs(module, seqlens, sq, torch.Generator().manual_seed(i), device)
                poison_unused_cache(inputs)
                schedule = module.get_decode_schedule(
                    len(seqlens), sq, device, num_parts=parts, min_blocks_per_part=min_blocks, backend="gluon"
                )
                out = torch.full((len(seqlens), sq, heads, dc), float("nan"), dtype=module.DTYPE, device=device)
                lse = torch.full((len(seqlens), heads, sq), float("nan"), device=device)
                start = time.time()
                module.mla_decode(**inputs, return_lse=True, schedule=schedule, out=out, lse=lse)
                sync_or_die(label)
                took = time.time() - start
                want, want_lse = decode_reference(module, inputs)
                max_err, rel, message = compare(out, want, dtype)
                if not message:
                    try:
                        torch.testing.assert_close(lse.double().cpu(), want_lse.cpu(), **LSE_TOLERANCE)
                    except AssertionError as error:
                        message = "lse: " + str(error).splitlines()[0]
                verdict = "ok  " if not message else "FAIL"
                print(f"{verdict} {label}: max_abs {max_err:.2e} rel {rel:.2e} ({took:.1f} s) {message}", flush=True)
                failures += bool(message)
            except Exception as error:  # noqa: BLE001 - report and go on to the next case
                failures += 1
                print(f"ERR  {label}: {type(error).__name__}: {str(error)[:2000]}", flush=True)
    print(f"{failures} failure(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
