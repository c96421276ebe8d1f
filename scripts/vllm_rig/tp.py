"""mlagen's vLLM backend with tensor parallelism (issue 41): needs two GPUs of one host (nvidia-h200-x2).

    python3 scripts/vllm_rig/tp.py --out tp.json          (device.sh tp; after device.sh install)

Model: the tiny random-weight DeepseekV3ForCausalLM of e2e.py with 32 heads (dsv3-h32), so each of two ranks runs
16: the DeepSeek-V3 TP8 geometry per rank. Three parts, in one run:

1. Agreement: mlagen at tensor_parallel_size 2 against mlagen at 1, and vLLM's TRITON_MLA and FLASHMLA at 2 (the
   reference: TRITON_MLA at 2), on e2e.py's prompts and sampling (greedy, logprobs). The verdict is e2e.py's rule
   (rig.OracleRule: as close to transformers' float32 forward as the reference); the direct comparisons with
   the reference and with mlagen at TP 1 are printed beside it.
2. One compile per spec on the node: mlagen's TP-2 engine of part 1 starts on an empty compile cache
   (MLAGEN_CACHE_DIR: a fresh directory), both ranks at the same moment. Reported: the cache entries and their
   manifests afterwards (one entry per spec, built once under the cache's file lock, nothing half-written) and the
   ranks' warm-up lines.
3. Throughput at TP 2, mlagen against FLASHMLA in one run: throughput.py's engine run (its workload, scaled by
   --prompts) on an 8-layer dsv3-h32, and the GPU time in NCCL kernels beside attention, read from vLLM's torch
   profiler traces of a short profiled generate per engine (one trace per rank).

NVLink multicast stays off (device.sh exports NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1; the worker processes vLLM starts inherit them; this script checks they are set).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402
import rig  # noqa: E402
import throughput  # noqa: E402

GEOMETRY = rig.Geometry("dsv3-h32", 32, 512, 64, 128, 128, 1536, flashmla=True)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ORACLE_RULE = rig.OracleRule()


def agreement(work: Path, cache: Path) -> dict[str, Any]:
    """Part 1 and part 2: the engines' outputs judged against the float32 forward; the compile cache afterwards."""
    model = rig.write_model(work / "dsv3-h32", GEOMETRY, rig.Body(), seed=0)
    prompts = e2e.prompts_for("dsv3-h16")
    params = rig.sampling(e2e.NEW_TOKENS, logprobs=5, prompt_logprobs=1)
    engines = [
        ("TRITON_MLA tp2", "TRITON_MLA", 2),
        ("mlagen tp2", "CUSTOM", 2),  # first mlagen engine: both ranks build on the empty cache at once
        ("mlagen tp1", "CUSTOM", 1),
        ("FLASHMLA tp2", "FLASHMLA", 2),
    ]
    outputs, facts = {}, {}
    for label, backend, tp in engines:
        spec = rig.EngineSpec(label, backend, tensor_parallel_size=tp, max_num_batched_tokens=e2e.CHUNK)
        try:
            llm, facts[label] = rig.open_engine(spec, model)
            try:
                outputs[label] = rig.generate(llm, prompts, params)
            finally:
                rig.close_engine(llm)
        except Exception as error:
            facts[label] = {"error": repr(error)[:400]}
        print(f"[tp] {label}: {'ran' if label in outputs else facts[label]['error']}", flush=True)
    errors = {}
    if outputs:
        scored = rig.oracle_logprobs(model, outputs, prompts)
        errors = {label: rig.oracle_error(scored[label], outputs[label]) for label in outputs}
    rows = []
    reference = errors.get("TRITON_MLA tp2")
    for label, backend, _ in engines:
        row: dict[str, Any] = {"label": label, "facts": facts.get(label), "oracle": errors.get(label), "problems": []}
        if label not in outputs:
            row["verdict"] = "ERROR"
        elif label == "TRITON_MLA tp2":
            row["verdict"] = "REFERENCE"
        elif reference is None:
            row["verdict"] = "NO FLOAT32 FORWARD"
        else:
            if facts[label].get("backend") != rig.RUNS_AS[backend]:
                row["problems"].append(f"engine ran {facts[label].get('backend')}")
            row["problems"] += ORACLE_RULE.problems(errors[label], reference)
            row["verdict"] = "PASS" if not row["problems"] else "FAIL"
            row["vs TRITON_MLA tp2"] = rig.compare(outputs["TRITON_MLA tp2"], outputs[label], e2e.BF16)
            if label == "mlagen tp2" and "mlagen tp1" in outputs:
                row["vs mlagen tp1"] = rig.compare(outputs["mlagen tp1"], outputs[label], e2e.BF16)
        rows.append(row)
        print(f"[tp] {label}: {row['verdict']} {row['oracle']} {'; '.join(row['problems'])}", flush=True)
    entries = []
    for manifest in sorted((cache / "modules").glob("*/manifest.json")):
        data = json.loads(manifest.read_text())
        entries.append({"entry": manifest.parent.name, "spec": data["spec_name"], "created": data["created"]})
    leftovers = [str(p) for p in cache.rglob("*.tmp")]
    print(f"[tp] compile cache after both ranks started on it empty: {len(entries)} entries {entries}", flush=True)
    print(f"[tp] half-written files left: {leftovers or 'none'}", flush=True)
    return {"rows": rows, "cache_entries": entries, "cache_leftovers": leftovers}


def nccl_share(trace_dir: Path) -> dict[str, float]:
    """GPU time (ms) of NCCL kernels, MLA attention kernels and all kernels in the traces under trace_dir."""
    totals = {"nccl_ms": 0.0, "attention_ms": 0.0, "all_kernels_ms": 0.0, "traces": 0}
    for path in sorted(trace_dir.rglob("*.json*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as handle:
            events = json.load(handle).get("traceEvents", [])
        totals["traces"] += 1
        for event in events:
            if event.get("cat") != "kernel":
                continue
            name, ms = event.get("name", "").lower(), event.get("dur", 0) / 1e3
            totals["all_kernels_ms"] += ms
            if "nccl" in name or "allreduce" in name or "all_reduce" in name:
                totals["nccl_ms"] += ms
            elif "mla" in name or "flash" in name:
                totals["attention_ms"] += ms
    return totals


def tp_throughput(
    work: Path, prompts_count: int, new_tokens: int, save: Callable[[list[dict[str, Any]]], None]
) -> list[dict[str, Any]]:
    """Part 3: throughput.py's run at TP 2 for FLASHMLA and mlagen, and their NCCL share. Each row is printed and
    saved as soon as its timed run ends, before its profiled engine starts (a call that runs out of time keeps
    the rows it finished)."""
    body = rig.Body(hidden=2048, vocab=4096, layers=8, max_positions=8192 + new_tokens + 64)
    model = rig.write_model(work / "dsv3-h32-8l", GEOMETRY, body, seed=0)
    rng = random.Random(3)
    prompts = rig.random_prompts([rng.randint(1024, 8192) for _ in range(prompts_count)], body.vocab, seed=4)
    rows = []
    for label, backend in (("FLASHMLA tp2", "FLASHMLA"), ("mlagen tp2", "CUSTOM")):
        trace_dir = work / "traces" / backend
        spec = rig.EngineSpec(
            label, backend, tensor_parallel_size=2, graphs="full_decode", max_num_seqs=prompts_count,
            max_model_len=8192 + new_tokens + 64, kv_cache_gib=8.0, capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128],
        )  # fmt: skip
        try:
            row = {"label": label, **throughput.run_engine(spec, model, prompts, new_tokens)}
            row.pop("check")
        except Exception as error:
            rows.append({"label": label, "error": repr(error)[:400]})
            print(f"[tp] {label}: ERROR {error!r}"[:400], flush=True)
            save(rows)
            continue
        rows.append(row)
        print(
            f"[tp] {label}: {row['decode_tok_s']:.0f} decode tok/s, {row['output_tok_s']:.0f} output tok/s, TTFT "
            f"median {row['ttft_median_ms']:.1f} ms, ITL median {row['itl_median_ms']:.2f} ms",
            flush=True,
        )
        save(rows)
        try:  # a short profiled generate in an engine of its own (the profiler is configured at engine start)
            from vllm import LLM

            kwargs = spec.llm_kwargs(model) | {
                "profiler_config": {"profiler": "torch", "torch_profiler_dir": str(trace_dir)}
            }
            llm = LLM(**kwargs)
            try:
                llm.generate([{"prompt_token_ids": p[:2048]} for p in prompts[:32]], rig.sampling(4, None, None))
                llm.start_profile()
                llm.generate([{"prompt_token_ids": p[:2048]} for p in prompts[:32]], rig.sampling(32, None, None))
                llm.stop_profile()
            finally:
                rig.close_engine(llm)
            row["gpu_time"] = nccl_share(trace_dir)
        except Exception as error:
            row["gpu_time"] = {"error": repr(error)[:300]}
        print(f"[tp] {label}: GPU time {row['gpu_time']}", flush=True)
        save(rows)
    by_label = {r["label"]: r for r in rows if "decode_tok_s" in r}
    if len(by_label) == 2:
        ratio = by_label["mlagen tp2"]["decode_tok_s"] / by_label["FLASHMLA tp2"]["decode_tok_s"]
        print(f"[tp] mlagen/FLASHMLA decode throughput at TP 2: {ratio:.2f}", flush=True)
    return rows


def main() -> int:
    parser = rig.engine_run_parser(__doc__, "tp", prompts=128, new_tokens=256)
    parser.add_argument("--out", type=Path, default=Path("tp.json"))
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-agreement", action="store_true", help="only part 3 (e.g. a second call)")
    args = parser.parse_args()
    import torch

    if torch.cuda.device_count() < 2:
        print(f"[tp] needs two GPUs of one host (nvidia-h200-x2); this machine has {torch.cuda.device_count()}")
        return 2
    unset = {k: v for k, v in MULTICAST_OFF.items() if os.environ.get(k) != v}
    if unset:
        print(f"[tp] NVLink multicast must stay off: set {unset} (device.sh does)")
        return 2
    cache = args.work / f"mlagen-cache-{int(time.time())}"
    os.environ["MLAGEN_CACHE_DIR"] = str(cache)  # empty: both ranks of the first mlagen engine build at once
    t0 = time.time()
    result: dict[str, Any] = {} if args.skip_agreement else {"agreement": agreement(args.work, cache)}
    rig.write_json(args.out, result)
    if not args.skip_throughput:

        def save(rows: list[dict[str, Any]]) -> None:
            rig.write_json(args.out, result | {"throughput": rows})

        result["throughput"] = tp_throughput(args.work, args.prompts, args.new_tokens, save)
    rig.write_json(args.out, result)
    print(f"[tp] {time.time() - t0:.0f} s", flush=True)
    rows = result.get("agreement", {}).get("rows", [])
    return 0 if all(r["verdict"] in ("PASS", "REFERENCE") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
