"""Shared pieces of the vLLM GPU rig (e2e.py, throughput.py): tiny random-weight MLA models written with
transformers, one vLLM engine per call, and the comparison of two engines' logprobs.

Runs on the GPU machine with vLLM 0.26.0 unpacked by device.sh; imports of vllm/transformers stay inside functions
so that the scripts parse and `--help` works anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Engines run in this process (no engine-core subprocess per LLM): faster starts, and gc + cleanup between engines.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@dataclass(frozen=True)
class Geometry:
    """MLA attention geometry of a real model (per tensor-parallel rank), on a tiny dense body."""

    name: str
    heads: int
    kv_lora_rank: int  # Dc
    qk_rope_head_dim: int  # Dr
    qk_nope_head_dim: int  # Dn
    v_head_dim: int  # Dv
    q_lora_rank: int
    flashmla: bool  # FlashMLA's dense decode runs it (Dc 512 + Dr 64 only)


GEOMETRIES = {
    g.name: g
    for g in (
        Geometry("dsv3-h16", 16, 512, 64, 128, 128, 1536, flashmla=True),
        Geometry("dsv3-h128", 128, 512, 64, 128, 128, 1536, flashmla=True),
        Geometry("ms4-h32", 32, 256, 64, 64, 128, 1024, flashmla=False),
    )
}

# Per-entry standard deviation of q and k (nope and rope parts) that the weights below give: attention scores then
# have a standard deviation of about QK_STD**2 (about 3 nats), so attention is peaked and a wrong key, block or
# scale moves the output by O(1) instead of hiding in a near-uniform average.
QK_STD = 1.7
# Logits standard deviation: greedy choices are clear (top-2 gaps of about a nat on a 2-4k vocabulary).
LOGIT_STD = 4.0


@dataclass(frozen=True)
class Body:
    """The non-attention part of the tiny model."""

    hidden: int = 1024
    vocab: int = 2048
    layers: int = 2
    max_positions: int = 8192


def write_model(path: Path, geometry: Geometry, body: Body, seed: int) -> Path:
    """A DeepseekV3ForCausalLM with `geometry`'s attention, dense MLPs (first_k_dense_replace = layers) and random
    weights scaled as QK_STD/LOGIT_STD say, saved as bf16 safetensors with its config into `path`."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    g = geometry
    config = DeepseekV3Config(
        vocab_size=body.vocab,
        hidden_size=body.hidden,
        intermediate_size=2 * body.hidden,
        moe_intermediate_size=body.hidden // 2,
        num_hidden_layers=body.layers,
        num_attention_heads=g.heads,
        num_key_value_heads=g.heads,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=body.layers,
        kv_lora_rank=g.kv_lora_rank,
        q_lora_rank=g.q_lora_rank,
        qk_rope_head_dim=g.qk_rope_head_dim,
        qk_nope_head_dim=g.qk_nope_head_dim,
        v_head_dim=g.v_head_dim,
        max_position_embeddings=body.max_positions,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config)
    fan_in_gain = {
        "q_a_proj": (body.hidden, QK_STD),
        "kv_a_proj_with_mqa": (body.hidden, QK_STD),  # k_pe is not normalised: QK_STD here sets its size
        "q_b_proj": (g.q_lora_rank, QK_STD),
        "kv_b_proj": (g.kv_lora_rank, QK_STD),
        "o_proj": (g.heads * g.v_head_dim, 1.0),
        "gate_proj": (body.hidden, 1.0),
        "up_proj": (body.hidden, 1.0),
        "down_proj": (2 * body.hidden, 1.0),
        "lm_head": (body.hidden, LOGIT_STD),
    }
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
                continue
            if "embed_tokens" in name:
                std = 1.0
            else:
                key = next((k for k in fan_in_gain if k in name), None)
                if key is None:
                    raise ValueError(f"write_model: no initialisation rule for parameter {name}")
                fan_in, gain = fan_in_gain[key]
                std = gain / math.sqrt(fan_in)
            param.normal_(0.0, std, generator=generator)
    model = model.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return path


def engine_run_parser(doc: str, work: str, *, prompts: int, new_tokens: int) -> argparse.ArgumentParser:
    """A parser (described by doc's first line) with the options the engine runs share: --work, their scratch
    folder (/tmp/vllm-rig/WORK by default: models, caches), --prompts and --new-tokens (a prompt's)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/vllm-rig") / work)
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    return parser


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids 2.. vocab-1: 0 and 1 are bos/eos)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def repeating_prompts(count: int, phrase: int, repeats: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts made of one random phrase repeated: n-gram speculation finds drafts in them."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(phrase)] * repeats for _ in range(count)]


@dataclass
class EngineSpec:
    """One vLLM engine: which backend and which options (the names are LLM(...)'s)."""

    label: str
    backend: str  # TRITON_MLA | FLASHMLA | CUSTOM (mlagen)
    prefill: str | None = None  # attention_config.mla_prefill_backend (None: the backend's choice)
    block_size: int = 64
    kv_cache_dtype: str = "auto"
    graphs: str = "full_decode"  # full_decode: FULL_DECODE_ONLY without torch.compile; default: vLLM's default
    # (VLLM_COMPILE + FULL_AND_PIECEWISE); eager: enforce_eager=True
    speculative: dict[str, Any] | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 16
    max_model_len: int = 4096
    kv_cache_gib: float = 1.0
    tensor_parallel_size: int = 1
    capture_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    calculate_kv_scales: bool = False

    def llm_kwargs(self, model: Path) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            model=str(model),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            seed=0,
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            attention_config={"backend": self.backend}
            | ({"mla_prefill_backend": self.prefill} if self.prefill else {}),
            enable_prefix_caching=False,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            kv_cache_memory_bytes=int(self.kv_cache_gib * 2**30),
            tensor_parallel_size=self.tensor_parallel_size,
            disable_log_stats=False,
        )
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.speculative is not None:
            kwargs["speculative_config"] = self.speculative
        if self.calculate_kv_scales:
            kwargs["calculate_kv_scales"] = True
        if self.graphs == "eager":
            kwargs["enforce_eager"] = True
        elif self.graphs == "full_decode":
            kwargs["compilation_config"] = {
                "mode": "NONE",
                "cudagraph_mode": "FULL_DECODE_ONLY",
                "cudagraph_capture_sizes": self.capture_sizes,
            }
        elif self.graphs == "default":
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": self.capture_sizes}
        else:
            raise ValueError(f"EngineSpec.graphs: {self.graphs!r}; allowed: eager, full_decode, default")
        return kwargs


#: the name an engine's MLA layers report (backend.get_name()) for each attention_config backend
RUNS_AS = {"TRITON_MLA": "TRITON_MLA", "FLASHMLA": "FLASHMLA", "CUSTOM": "MLAGEN"}


def oracle_logprobs(model: Path, runs: dict[str, list[dict[str, Any]]], prompts: list[list[int]]) -> dict[str, Any]:
    """For each engine's outputs (runs: label -> generate()'s results), the float32 logprob of every token it
    saw or chose, teacher forced on its own sequence (prompt + its greedy tokens) by transformers'
    implementation of the same checkpoint (eager attention): label -> per prompt {"prompt": [...], "generated":
    [...]} aligned with the engine's "prompt" and "chosen" lists. An engine's own divergent tokens are scored
    on its own context, so every token counts."""
    import torch
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").cuda().eval()
    results: dict[str, Any] = {}
    with torch.no_grad():
        for label, outputs in runs.items():
            per_prompt = []
            for prompt, out in zip(prompts, outputs, strict=True):
                ids = torch.tensor([prompt + out["tokens"]], device="cuda")
                logprobs = torch.log_softmax(net(ids).logits[0].float(), dim=-1)
                chosen = [None, *logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()]
                per_prompt.append({"prompt": chosen[: len(prompt)], "generated": chosen[len(prompt) :]})
            results[label] = per_prompt
    del net
    gc.collect()
    torch.cuda.empty_cache()
    return results


def oracle_error(oracle: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """|engine logprob - float32 logprob| of the prompt tokens and of the generated tokens: mean, max, count."""
    parts: dict[str, list[float]] = {"prompt": [], "generated": []}
    for want, got in zip(oracle, outputs, strict=True):
        for part, engine in (("prompt", got["prompt"]), ("generated", got["chosen"])):
            if engine is None:
                continue
            parts[part] += [
                abs(a - b) for a, b in zip(want[part], engine, strict=True) if a is not None and b is not None
            ]
    return {
        part: {"mean": sum(d) / len(d), "max": max(d), "values": len(d)}
        if d
        else {"mean": math.nan, "max": math.nan, "values": 0}
        for part, d in parts.items()
    }


@dataclass(frozen=True)
class OracleRule:
    """An engine is as accurate as the reference engine of its run when, for prompt and generated tokens alike,
    its distance to the float32 forward is at most the reference's times a ratio plus a small slack (the slack
    keeps a reference that happens to sit very close from making the rule stricter than bf16 can meet)."""

    mean_ratio: float = 1.10
    mean_slack: float = 0.005
    max_ratio: float = 1.25
    max_slack: float = 0.05

    def problems(self, mine: dict[str, dict[str, float]], reference: dict[str, dict[str, float]]) -> list[str]:
        found = []
        for part in ("prompt", "generated"):
            m, r = mine[part], reference[part]
            if not m["values"]:
                found.append(f"no {part} logprobs to judge")
                continue
            if not m["mean"] <= self.mean_ratio * r["mean"] + self.mean_slack:
                found.append(
                    f"{part}: mean |d fp32| {m['mean']:.4f} > {self.mean_ratio} x {r['mean']:.4f} + {self.mean_slack}"
                )
            if not m["max"] <= self.max_ratio * r["max"] + self.max_slack:
                found.append(
                    f"{part}: max |d fp32| {m['max']:.4f} > {self.max_ratio} x {r['max']:.4f} + {self.max_slack}"
                )
        return found


def _attention_facts(model: Any) -> dict[str, Any]:
    """What the engine really runs, read from its first MLA layer (run inside the worker by apply_model)."""
    for module in model.modules():
        if hasattr(module, "kv_lora_rank") and hasattr(module, "impl") and hasattr(module, "attn_backend"):
            prefill = getattr(module, "prefill_backend", None)
            return {
                "backend": module.attn_backend.get_name(),
                "impl": type(module.impl).__module__ + "." + type(module.impl).__name__,
                "prefill_backend": prefill.get_name() if prefill is not None else None,
                "k_scale": float(getattr(module, "_k_scale_float", float("nan"))),
            }
    return {"backend": None}


def _metric_totals(llm: Any) -> dict[str, float]:
    totals: dict[str, float] = {}
    try:
        for metric in llm.get_metrics():
            if "spec_decode" in metric.name and hasattr(metric, "value"):
                totals[metric.name] = totals.get(metric.name, 0.0) + float(metric.value)
    except Exception as error:  # metrics are a report, never a verdict
        totals["error"] = repr(error)[:200]
    return totals


def open_engine(spec: EngineSpec, model: Path) -> tuple[Any, dict[str, Any]]:
    """Start the engine; returns it with what it runs (backend, impl, prefill backend, cudagraph mode, k_scale)."""
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(**spec.llm_kwargs(model))
    facts = llm.apply_model(_attention_facts)[0]
    facts["cudagraph_mode"] = str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
    facts["startup_s"] = round(time.perf_counter() - start, 1)
    return llm, facts


def close_engine(llm: Any) -> None:
    with contextlib.suppress(Exception):  # the in-process client may have nothing to shut down
        llm.llm_engine.engine_core.shutdown()
    del llm
    release_engine_state()


def release_engine_state() -> None:
    """Free what a closed (or failed) engine left: distributed groups, cached GPU memory."""
    import torch
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    with contextlib.suppress(Exception):
        cleanup_dist_env_and_memory()
    torch.cuda.empty_cache()


def sampling(max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def generate(llm: Any, prompts: list[list[int]], params: Any) -> list[dict[str, Any]]:
    """Greedy outputs as plain data: tokens, each token's logprob and the top-k, the prompt tokens' logprobs."""
    from vllm.inputs import TokensPrompt

    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    results = []
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        chosen, tops = None, None
        if completion.logprobs is not None:
            chosen = [step[tok].logprob for tok, step in zip(completion.token_ids, completion.logprobs, strict=True)]
            tops = [{str(t): lp.logprob for t, lp in step.items()} for step in completion.logprobs]
        prompt_lp = None
        if out.prompt_logprobs is not None:
            prompt_lp = [None] + [
                step[tok].logprob if step is not None and tok in step else None
                for tok, step in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)
            ]
        results.append({"tokens": list(completion.token_ids), "chosen": chosen, "tops": tops, "prompt": prompt_lp})
    return results


@dataclass(frozen=True)
class Tolerance:
    """Agreement of two engines on the same weights and prompts (see e2e.py's header for the reasoning)."""

    max_abs: float  # max |logprob difference| over compared tokens
    mean_abs: float  # mean |logprob difference| over compared tokens
    tie: float  # at the first differing greedy token, both tokens within this of each other in both engines
    coverage: float  # generated tokens compared (before first divergences) / generated tokens, at least


def compare(reference: list[dict[str, Any]], test: list[dict[str, Any]], tol: Tolerance) -> dict[str, Any]:
    """Teacher-forced prompt logprobs position by position; generated tokens up to each prompt's first divergence,
    which must be a near-tie in both engines. Returns the statistics and `ok`, with the reasons when not ok."""
    diffs: list[float] = []
    problems: list[str] = []
    generated = compared = divergences = 0
    logprobs_missing = False
    for i, (r, t) in enumerate(zip(reference, test, strict=True)):
        if r["prompt"] is not None and t["prompt"] is not None:
            for a, b in zip(r["prompt"], t["prompt"], strict=True):
                if a is not None and b is not None:
                    diffs.append(abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf)
        tokens_r, tokens_t = r["tokens"], t["tokens"]
        generated += len(tokens_r)
        first = next(
            (k for k, (x, y) in enumerate(zip(tokens_r, tokens_t, strict=False)) if x != y),
            min(len(tokens_r), len(tokens_t)),
        )
        compared += first
        if r["chosen"] is None or t["chosen"] is None:
            logprobs_missing = True
        else:
            for k in range(first):
                a, b = r["chosen"][k], t["chosen"][k]
                diffs.append(abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf)
        if first < min(len(tokens_r), len(tokens_t)):
            divergences += 1
            if r["tops"] is None or t["tops"] is None:
                continue
            x, y = str(tokens_r[first]), str(tokens_t[first])
            gap_r = r["chosen"][first] - r["tops"][first].get(y, -math.inf)
            gap_t = t["chosen"][first] - t["tops"][first].get(x, -math.inf)
            if not (gap_r <= tol.tie and gap_t <= tol.tie):
                problems.append(f"prompt {i}: first divergence at token {first} is no tie ({gap_r:.3f}, {gap_t:.3f})")
    coverage = compared / generated if generated else 1.0
    max_abs = max(diffs) if diffs else math.nan
    mean_abs = sum(diffs) / len(diffs) if diffs else math.nan
    if not diffs and not logprobs_missing:
        problems.append("nothing compared")
    if diffs and not max_abs <= tol.max_abs:
        problems.append(f"max |dlogprob| {max_abs:.4f} > {tol.max_abs}")
    if diffs and not mean_abs <= tol.mean_abs:
        problems.append(f"mean |dlogprob| {mean_abs:.4f} > {tol.mean_abs}")
    if coverage < tol.coverage:
        problems.append(f"coverage {coverage:.2f} < {tol.coverage}")
    return {
        "ok": not problems,
        "problems": problems[:6],
        "max_abs": max_abs,
        "mean_abs": mean_abs,
        "values": len(diffs),
        "coverage": round(coverage, 3),
        "divergences": divergences,
        "logprobs_missing": logprobs_missing,
    }


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)

    def default(value: Any) -> Any:
        if hasattr(value, "__dataclass_fields__"):
            return asdict(value)
        return str(value)

    path.write_text(json.dumps(data, indent=1, default=default, allow_nan=True))
