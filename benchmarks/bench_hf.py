"""A transformers DeepSeek-V3 model on mlagen kernels vs unpatched (eager and sdpa attention), on one GPU.

A small random DeepSeek-V3 (bf16, realistic MLA geometry: 16 heads, kv_lora_rank 512, rope 64, nope 128,
v 128, YaRN rope; all layers dense so that MoE routing cannot amplify rounding) generates greedily for a
left-padded prompt batch. Sections, each reported on its own (a failure is recorded, the others still run):

- generate: tokens/s of `model.generate` unpatched (attn_implementation "eager", "sdpa") and patched
  (mlagen, PagedMLACache): end to end, and decode only (from the difference to a 1-token generate);
- agreement: the generated tokens of sdpa and mlagen against eager (identical, or the fraction that agree
  and where rows first diverge: random weights give near-ties that bf16 rounding may flip);
- teacher_forced: the eager tokens fed back, logits of sdpa, mlagen prefill and mlagen decode (one token at
  a time) against eager: max |difference| / max |logit| and argmax agreement (sdpa is the yardstick);
- cuda_graph: one patched decode step (every layer) captured in a CUDA graph inside `planned_step` and
  replayed: its logits against the same step run eagerly, time per step of both;
- compile: the same step under torch.compile: graph breaks counted by torch._dynamo.explain, then
  fullgraph=True with the inductor backend (compile time, time per step, logits against eager).

    python benchmarks/bench_hf.py --out OUT.json [--layers 6 --hidden 2048 --batch 8 --prompt 512
                                                  --new-tokens 128]
    TRITON_INTERPRET=1 python benchmarks/bench_hf.py --device cpu --tiny --out /tmp/bench_hf.json

Needs torch, triton, transformers 5.x, jinja2, pyyaml, pydantic (the repository root is put on sys.path).
Prints a table and writes JSON to --out (a file, or a directory to hold bench_hf.json). Exit code 1 if a
section failed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_hf.json"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (for the CPU interpreter)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512, help="longest prompt; others down to half of it")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument(
        "--cache-dtype", default=None, help="the patched model's latent cache: float8_e4m3fn (default: bf16)"
    )
    parser.add_argument("--kv-scale", type=float, default=None, help="(fp8 cache) every layer's scale (default 1)")
    parser.add_argument(
        "--calibrate",
        type=float,
        default=None,
        metavar="MARGIN",
        help="(fp8 cache) each layer's scale from the prompts instead (kv_scales_from with this margin)",
    )
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.vocab = 2, 64, 96
        args.batch, args.prompt, args.new_tokens, args.page_size = 2, 6, 3, 16
    return args


def model_config(args: argparse.Namespace) -> Any:
    from transformers import DeepseekV3Config

    mla = dict(num_attention_heads=16, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
               qk_nope_head_dim=128, v_head_dim=128)  # fmt: skip
    if args.tiny:
        mla = dict(num_attention_heads=2, kv_lora_rank=64, q_lora_rank=32, qk_rope_head_dim=16,
                   qk_nope_head_dim=16, v_head_dim=16)  # fmt: skip
    return DeepseekV3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers, num_key_value_heads=mla["num_attention_heads"], **mla,
        first_k_dense_replace=args.layers, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        moe_intermediate_size=64, num_mtp_layers=0, max_position_embeddings=40 * 4096,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 4096},
        pad_token_id=0, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip


def set_attention(model: Any, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers: the config setter is what set_attn_implementation does for these models
        model.config._attn_implementation = name


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], Any], device: Any, *, min_time: float = 0.5, max_calls: int = 200) -> float:
    """Mean wall time of back-to-back calls (synchronised at the end only, as a decode loop issues them)."""
    fn()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    once = time.perf_counter() - start
    calls = max(3, min(max_calls, int(min_time / max(once, 1e-6))))
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - start) / calls


def timed(fn: Callable[[], Any], device: Any) -> tuple[Any, float]:
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


def relative_error(got: Any, want: Any, rows: Any = None) -> dict[str, float]:
    """max |got - want| / max |want| and the fraction of positions with the same argmax, over `rows`."""
    got, want = got.float(), want.float()
    if rows is not None:
        got, want = got[rows], want[rows]
    return {
        "max_err_rel": float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)),
        "argmax_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
    }


class Bench:
    """State shared by the sections: the models, the prompts and what earlier sections produced."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16
        self.results: dict[str, Any] = {}
        self.tokens: dict[str, Any] = {}

    # ---- setup ------------------------------------------------------------------------------------------
    def setup(self) -> dict[str, Any]:
        import torch
        from transformers import AutoModelForCausalLM

        from mlagen_compiler.integrations.transformers import patch_model

        args = self.args
        self.config = model_config(args)
        torch.manual_seed(args.seed)
        with self.device:  # random initialisation on the device: seconds instead of a minute on the host
            self.reference = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype).eval()
        self.patched = patch_model(
            copy.deepcopy(self.reference), page_size=args.page_size, dtype=self.dtype, cache_dtype=args.cache_dtype
        )
        gen = torch.Generator().manual_seed(args.seed + 1)
        lengths = torch.randint(max(1, args.prompt // 2), args.prompt + 1, (args.batch,), generator=gen).tolist()
        lengths[0] = args.prompt
        self.ids = torch.zeros(args.batch, args.prompt, dtype=torch.long)
        self.mask = torch.zeros_like(self.ids)
        for row, n in enumerate(lengths):  # left-padded, as a tokenizer pads for generation
            self.ids[row, -n:] = torch.randint(1, args.vocab, (n,), generator=gen)
            self.mask[row, -n:] = 1
        self.ids, self.mask = self.ids.to(self.device), self.mask.to(self.device)
        patch = self.patched._mlagen_patch
        self.kv_scale = args.kv_scale
        if args.calibrate is not None:
            from mlagen_compiler.integrations.transformers import kv_scales_from

            self.kv_scale = kv_scales_from(self.patched, self.ids, attention_mask=self.mask, margin=args.calibrate)
        return {
            "spec": patch.spec.name,
            "cache_dtype": patch.spec.cache_dtype,
            "kv_scale": self.kv_scale,
            "softmax_scale": patch.module.SOFTMAX_SCALE,
            "ops_namespace": patch.ops.namespace,
            "parameters_m": sum(p.numel() for p in self.reference.parameters()) / 1e6,
            "prompt_lengths": lengths,
        }

    def cache(self, extra: int = 0) -> Any:
        from mlagen_compiler.integrations.transformers import PagedMLACache

        return PagedMLACache(
            self.patched,
            max_batch_size=self.args.batch,
            max_cache_len=self.args.prompt + self.args.new_tokens + extra,
            kv_scale=self.kv_scale,
        )

    def generate(self, model: Any, new_tokens: int, patched: bool) -> Any:
        import torch

        kwargs = {"past_key_values": self.cache()} if patched else {}
        with torch.no_grad():
            return model.generate(self.ids, attention_mask=self.mask, max_new_tokens=new_tokens, do_sample=False,
                                  **kwargs)  # fmt: skip

    # ---- sections ---------------------------------------------------------------------------------------
    def generate_section(self, impl: str) -> dict[str, Any]:
        patched = impl == "mlagen"
        model = self.patched if patched else self.reference
        if not patched:
            set_attention(model, impl)
        self.generate(model, 2, patched)  # warm-up: kernels compiled, allocator warm
        n = self.args.new_tokens
        out, total = timed(lambda: self.generate(model, n, patched), self.device)
        _, first = timed(lambda: self.generate(model, 1, patched), self.device)
        self.tokens[impl] = out[:, self.ids.shape[1] :]
        batch = self.args.batch
        return {
            "seconds": total,
            "tokens_per_s": batch * n / total,
            "prefill_plus_1_token_s": first,
            "decode_tokens_per_s": batch * (n - 1) / (total - first) if total > first and n > 1 else None,
        }

    def agreement_section(self) -> dict[str, Any]:
        want = self.tokens["eager"]
        result = {}
        for impl in ("sdpa", "mlagen"):
            if impl not in self.tokens:
                result[impl] = "not generated"
                continue
            got = self.tokens[impl]
            same = got == want
            diverge = [int(row.logical_not().nonzero()[0]) if not bool(row.all()) else None for row in same]
            result[impl] = {
                "identical": bool(same.all()),
                "agreement": float(same.float().mean()),
                "first_divergence_per_row": diverge,
            }
        return result

    def reference_logits(self, model: Any, ids: Any, mask: Any) -> Any:
        """Logits of an unpatched model over whole left-padded sequences, positions as generate gives them."""
        import torch

        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            return model(ids, attention_mask=mask, position_ids=positions).logits

    def teacher_forced_section(self) -> dict[str, Any]:
        import torch

        prompt = self.ids.shape[1]
        seq = torch.cat([self.ids, self.tokens["eager"]], dim=1)
        mask = torch.cat([self.mask, torch.ones_like(self.tokens["eager"])], dim=1)
        real = mask.bool()
        set_attention(self.reference, "eager")
        want = self.reference_logits(self.reference, seq, mask)
        result = {}
        set_attention(self.reference, "sdpa")
        result["sdpa"] = relative_error(self.reference_logits(self.reference, seq, mask), want, real)
        set_attention(self.reference, "eager")
        with torch.no_grad():
            whole = self.patched(seq, attention_mask=mask, past_key_values=self.cache()).logits
            result["mlagen_prefill"] = relative_error(whole, want, real)
            cache = self.cache()
            steps = [self.patched(self.ids, attention_mask=self.mask, past_key_values=cache).logits[:, -1:]]
            for j in range(prompt, seq.shape[1] - 1):
                steps.append(self.patched(seq[:, j : j + 1], attention_mask=mask[:, : j + 1],
                                          past_key_values=cache).logits)  # fmt: skip
        result["mlagen_decode"] = relative_error(torch.cat(steps, 1), want[:, prompt - 1 : -1])
        return result

    @contextlib.contextmanager
    def planned_decode_step(self, model: Any = None) -> Any:
        """A patched cache holding the prompts and the next step (one token per row) planned: yields a function
        running that step through `model` (default: the patched model; a compiled one for the compile section)
        and returning its logits."""
        import torch

        from mlagen_compiler.integrations.transformers import planned_step

        cache = self.cache(extra=1)
        with torch.no_grad():
            self.patched(self.ids, attention_mask=self.mask, past_key_values=cache)
        token = self.tokens.get("eager", self.ids[:, -1:])[:, :1].contiguous()
        mask = torch.cat([self.mask, torch.ones_like(token)], dim=1)
        with torch.no_grad(), planned_step(self.patched, cache, batch_size=self.args.batch, attention_mask=mask):
            yield lambda run=None: (self.patched if run is None else run)(token, past_key_values=cache).logits

    def cuda_graph_section(self) -> dict[str, Any]:
        import torch

        if self.device.type != "cuda":
            return {"skipped": "CUDA graphs need a GPU"}
        with self.planned_decode_step() as step:
            eager = step().clone()
            graph, static = harness.capture_graph(step, warmup=2)
            static.zero_()
            graph.replay()
            sync(self.device)
            check = relative_error(static, eager)
            eager_s = seconds_per_call(step, self.device)
            graph_s = seconds_per_call(graph.replay, self.device)
        return {
            "replay_equals_eager": bool(torch.equal(static, eager)),
            **check,
            "eager_step_ms": eager_s * 1e3,
            "graph_step_ms": graph_s * 1e3,
            "graph_tokens_per_s": self.args.batch / graph_s,
            "speedup": eager_s / graph_s,
        }

    def compile_section(self) -> dict[str, Any]:
        import torch

        result: dict[str, Any] = {"backend": self.args.compile_backend}
        with self.planned_decode_step() as step:
            eager = step().clone()
            eager_s = seconds_per_call(step, self.device)
            result["eager_step_ms"] = eager_s * 1e3
            torch._dynamo.reset()
            try:  # diagnostics: how many graphs dynamo makes of a step, and why it breaks if it does
                explained = torch._dynamo.explain(step)()
                result["graphs"] = explained.graph_count
                result["graph_breaks"] = explained.graph_break_count
                result["break_reasons"] = [str(r.reason)[:300] for r in explained.break_reasons[:5]]
            except Exception as error:
                result["explain_error"] = f"{type(error).__name__}: {str(error)[:500]}"
            for fullgraph in (True, False):  # without fullgraph only if fullgraph failed, to time it anyway
                torch._dynamo.reset()
                compiled = torch.compile(self.patched, fullgraph=fullgraph, backend=self.args.compile_backend)
                try:
                    logits, first = timed(lambda compiled=compiled: step(compiled), self.device)
                except Exception as error:
                    result[f"fullgraph_{fullgraph}_error"] = f"{type(error).__name__}: {str(error)[:1500]}"
                    continue
                compiled_s = seconds_per_call(lambda compiled=compiled: step(compiled), self.device)
                result.update(
                    fullgraph=fullgraph,
                    compile_s=first,
                    **relative_error(logits, eager),
                    compiled_step_ms=compiled_s * 1e3,
                    speedup=eager_s / compiled_s,
                )
                break
            else:
                raise RuntimeError(f"torch.compile failed with and without fullgraph: {result}")
        return result


def run_section(report: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    start = time.perf_counter()
    try:
        result = {"ok": True, **fn()}
    except Exception as error:  # one section's failure is reported; the others still run
        lines = traceback.format_exc().strip().splitlines()
        result = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:2000]}", "traceback": lines[-12:]}
    result["section_s"] = round(time.perf_counter() - start, 3)
    report["sections"][name] = result
    status = "ok" if result["ok"] else f"FAILED: {result['error'].splitlines()[0][:200]}"
    print(f"[{name}] {status} ({result['section_s']:.1f} s)", flush=True)


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        "commit": harness.git_commit(),
    }
    if args.device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def print_table(report: dict[str, Any]) -> None:
    print(f"\nbench_hf: {json.dumps(report['env'])}")
    print(f"config: {json.dumps(report['config'])}")
    print("\n| section | metric | value |\n| --- | --- | --- |")
    for name, result in report["sections"].items():
        for key, value in result.items():
            if key in ("traceback", "section_s"):
                continue
            if isinstance(value, dict):
                for sub, item in value.items():
                    print(f"| {name} | {key}.{sub} | {fmt(item)} |")
            else:
                print(f"| {name} | {key} | {fmt(value)} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    # the compile cache of this run (and no platform cache directory needed)
    os.environ.setdefault("MLAGEN_CACHE_DIR", tempfile.mkdtemp(prefix="mlagen-bench-hf-"))
    report: dict[str, Any] = {"env": environment(args), "config": vars(args), "sections": {}}
    bench = Bench(args)
    run_section(report, "setup", bench.setup)
    if report["sections"]["setup"]["ok"]:
        for impl in ("eager", "sdpa", "mlagen"):
            run_section(report, f"generate_{impl}", lambda impl=impl: bench.generate_section(impl))
        run_section(report, "agreement", bench.agreement_section)
        run_section(report, "teacher_forced", bench.teacher_forced_section)
        run_section(report, "cuda_graph", bench.cuda_graph_section)
        run_section(report, "compile", bench.compile_section)
    out = Path(args.out)
    if out.is_dir() or args.out.endswith(("/", os.sep)):
        out = out / "bench_hf.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print_table(report)
    print(f"\nwrote {out}")
    return 0 if all(section["ok"] for section in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
