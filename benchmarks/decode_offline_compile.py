"""Compile a generated module's portable decode (split) kernel for sm_90 on a machine without a GPU (dev tool).

Like gluon_offline_compile.py: a stand-in driver answers "a compute capability 9.0 GPU", the module's own
`mla_decode` runs on CPU tensors of the right shapes with the kernel launches replaced by `warmup`
(compile only, nothing launched), and ptxas' report is printed per configuration: shared memory, registers
and stack (spills) per thread. For a cache of page_size >= block_n the cache tiles come through TMA, as on
the GPU. Catches compile errors and heavy spills (e.g. of fp8 tiles converted in registers) without device
time; it says nothing about speed.

    python benchmarks/decode_offline_compile.py generated/deepseek_v3_tp8_fp8.py [16:32,4,3 64:64,8,2] [--merge fused]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gluon_offline_compile import _OfflineHopperDriver, _resource_usage  # noqa: E402


class _CompileOnly:
    """Stands in for a Triton kernel: `kernel[grid](...)` compiles it with warmup and records the result."""

    def __init__(self, kernel, compiled: list) -> None:
        self.kernel, self.compiled = kernel, compiled

    def __getattr__(self, name: str):  # arg_names etc.: what the launchers read of a kernel
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        def compile_only(*args, **kwargs):
            self.compiled.append(self.kernel.warmup(*args, grid=grid, **kwargs))

        return compile_only


def compile_configs(
    module_path: str, configs: list[tuple[int, tuple[int, int, int]]], merge: str = "kernel"
) -> list[str]:
    """One report line per (block_m, (block_n, num_warps, num_stages)) of the module's split kernel, with the
    fused merge compiled in (merge="fused") or not ("kernel": the combine launch, the portable default)."""
    from dataclasses import replace

    from triton.runtime.driver import driver

    from mlagen_compiler.cache_format import module_cache_format
    from mlagen_compiler.options import options, set_options

    os.environ.pop("TRITON_INTERPRET", None)
    set_options(replace(options(), direct_launch=False))  # every launch through kernel[grid], which compiles only here
    driver.set_active(_OfflineHopperDriver())
    spec = importlib.util.spec_from_file_location("offline_decode_module", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    compiled: list = []
    module._mla_decode_split_kernel = _CompileOnly(module._mla_decode_split_kernel, compiled)
    module._mla_decode_combine_kernel = _CompileOnly(module._mla_decode_combine_kernel, [])
    if not configs:
        configs = [(m, c) for m, space in module.DECODE_SPACE.items() for c in space]
    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    cache_dtype = getattr(module, "CACHE_DTYPE", module.DTYPE)
    scaled = {"kv_scale": 0.5} if module_cache_format(module).scaled else {}
    lines = []
    for block_m, config in configs:
        seqlen_q, batch = max(1, block_m // module.NUM_HEADS), 4
        q = torch.zeros(batch, seqlen_q, module.NUM_HEADS, width, dtype=module.DTYPE)
        kv = torch.zeros(64, module.PAGE_SIZE, 1, width, dtype=cache_dtype)
        table = torch.zeros(batch, 16, dtype=torch.int32)
        lens = torch.full((batch,), 8, dtype=torch.int32)
        schedule = module.get_decode_schedule(
            batch, seqlen_q, torch.device("cpu"), config=config, block_m=block_m, merge=merge
        )
        compiled.clear()
        module.mla_decode(q, kv, table, lens, schedule=schedule, validate=False, **scaled)
        kernel = compiled[-1]
        lines.append(
            f"m{block_m} n{config[0]} w{config[1]} s{config[2]}: shared {kernel.metadata.shared} "
            f"{_resource_usage(kernel.asm['cubin'])}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module")
    parser.add_argument("configs", nargs="*", help="block_m:block_n,num_warps,num_stages (default: the whole space)")
    parser.add_argument("--merge", default="kernel", choices=["kernel", "fused"], help="the split kernel's merge")
    args = parser.parse_args(argv)
    configs = []
    for text in args.configs:
        block_m, rest = text.split(":")
        configs.append((int(block_m), tuple(int(v) for v in rest.split(","))))
    for line in compile_configs(args.module, configs, args.merge):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
