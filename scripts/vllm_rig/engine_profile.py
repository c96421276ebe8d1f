"""Where an engine's time goes: mlagen's vLLM backend (CUSTOM) beside FLASHMLA under torch.profiler.

    python3 scripts/vllm_rig/engine_profile.py --out-dir DIR       (device.sh profile; after device.sh install)

Model: throughput.py's random-weight DeepseekV3ForCausalLM at 16 heads (8 layers, hidden 2048). Per backend,
after a warm-up generate: a prefill-only pass (max_tokens=1) and a full pass (--new-tokens), each timed and
profiled (CPU and CUDA); host time inside the backend's methods (metadata build, forward_mqa, forward_mha,
do_kv_cache_update) is summed by wrapping them. Prints the top kernels by GPU time and the top CPU ops per
phase; the traces are not kept (too large to bring back).
"""

from __future__ import annotations

import functools
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rig  # noqa: E402

HOST: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])


def timed(cls: type, name: str) -> None:
    """Sum the host time of cls.name per call into HOST."""
    method = getattr(cls, name)

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            entry = HOST[f"{cls.__name__}.{name}"]
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    setattr(cls, name, wrapper)


def main() -> int:
    parser = rig.engine_run_parser(__doc__, "profile", prompts=32, new_tokens=64)
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    parser.add_argument(
        "--backends", default="FLASHMLA,CUSTOM,CUSTOM+FLASH_ATTN", help="BACKEND[+MLA prefill backend],..."
    )
    args = parser.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mlagen_compiler.integrations import vllm as backend_module

    for cls, names in (
        (backend_module.MlagenImpl, ("forward_mqa", "forward_mha", "do_kv_cache_update")),
        (backend_module.MlagenMetadataBuilder, ("build",)),
    ):
        for name in names:
            timed(cls, name)

    body = rig.Body(hidden=2048, vocab=4096, layers=8, max_positions=8192 + args.new_tokens + 64)
    model = rig.write_model(args.work / "dsv3-h16", rig.GEOMETRIES["dsv3-h16"], body, seed=0)
    rng = random.Random(3)
    prompts = rig.random_prompts([rng.randint(1024, 8192) for _ in range(args.prompts)], body.vocab, seed=4)
    requests = [{"prompt_token_ids": p} for p in prompts]
    for name in args.backends.split(","):
        backend, _, prefill = name.partition("+")
        spec = rig.EngineSpec(
            f"dsv3-h16 {name}", backend, prefill=prefill or None, graphs="full_decode", max_num_seqs=args.prompts,
            max_model_len=8192 + args.new_tokens + 64, kv_cache_gib=4.0,
            capture_sizes=[1, 2, 4, 8, 16, 32],
        )  # fmt: skip
        llm, facts = rig.open_engine(spec, model)
        print(f"\n===== {name}: {facts}", flush=True)
        try:
            llm.generate(requests[:4], rig.sampling(4, None, None), use_tqdm=False)  # warm-up
            for phase, tokens in (("prefill only", 1), ("full", args.new_tokens)):
                HOST.clear()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    start = time.perf_counter()
                    llm.generate(requests, rig.sampling(tokens, None, None), use_tqdm=False)
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - start
                print(f"\n--- {name} {phase}: {wall:.3f} s wall (profiled)", flush=True)
                for method, (calls, seconds) in sorted(HOST.items()):
                    print(f"host {method}: {calls} calls, {seconds * 1e3:.1f} ms, {seconds / calls * 1e6:.0f} us/call")
                table = prof.key_averages()
                print(table.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=70))
                print(table.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=70))
        finally:
            rig.close_engine(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
