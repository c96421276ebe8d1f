"""The transformers integration: tiny random DeepSeek-V3 / V2 models patched onto mlagen kernels, compared
with the same models unpatched (transformers' eager attention, float32 weights) step by step.

The patched model runs its kernels in the spec dtype (fp16 or bf16) and everything else in float32, so
logits differ from the float32 model by the rounding of the kernels' inputs. Tolerances, fixed per dtype
before any run: every logit within 8 * eps(dtype) * max|logit| of the reference, and the whole logit
tensor within 2 * eps(dtype) relative (Frobenius) error.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

from mlagen_compiler import load_spec  # noqa: E402
from mlagen_compiler.integrations import transformers as hf  # noqa: E402
from mlagen_compiler.integrations.transformers import PagedMLACache, patch_model, spec_from_config  # noqa: E402
from mlagen_compiler.options import use_options  # noqa: E402
from mlagen_compiler.plan import softmax_scale_of  # noqa: E402
from mlagen_compiler.reference import quantize_latent  # noqa: E402
from mlagen_compiler.spec import SpecError  # noqa: E402

TRANSFORMERS_VERSION = tuple(int(part) for part in re.findall(r"\d+", transformers.__version__)[:2])
EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
VOCAB = 96
PAD = 0
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    max_position_embeddings=256, initializer_range=0.2, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
)  # fmt: skip
# all layers dense: MoE routing is a discontinuous top-k that rounding could flip, hiding attention errors
V3_ONLY = dict(
    q_lora_rank=32, first_k_dense_replace=2, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
    n_group=1, topk_group=1, num_mtp_layers=0,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 64},
)  # fmt: skip


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    """load() compiles into a cache of this test session, not the user's."""
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "mlagen-cache"))


#: tests of a tiny model on CPU tensors through the generated kernels: Triton's interpreter in CI. A GPU
#: machine compiles the kernels for CUDA, where CPU tensors cannot go; the GPU path is covered there by
#: test_a_planned_model_step_captures_in_a_cuda_graph and benchmarks/bench_hf.py (teacher-forced logits).
CPU_MODEL = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-tensor model test (interpreter only)")


def tiny_v3(seed: int = 0, **overrides) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    config = DeepseekV3Config(**{**TINY, **V3_ONLY, **overrides}, attn_implementation="eager")
    return DeepseekV3ForCausalLM(config).eval()


def tiny_v2(seed: int = 0) -> DeepseekV2ForCausalLM:
    torch.manual_seed(seed)
    config = DeepseekV2Config(**TINY, q_lora_rank=None, first_k_dense_replace=2, attn_implementation="eager")
    return DeepseekV2ForCausalLM(config).eval()


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    eps = EPS[dtype]
    torch.testing.assert_close(actual, expected, rtol=0, atol=8 * eps * expected.abs().max().item())
    rel = ((actual - expected).norm() / expected.norm()).item()
    assert rel <= 2 * eps, f"relative error {rel:.2e} over 2 * eps(dtype) = {2 * eps:.2e}"


def patched(reference: torch.nn.Module, dtype: torch.dtype, page_size: int = 16) -> torch.nn.Module:
    return patch_model(copy.deepcopy(reference), page_size=page_size, dtype=dtype)


def poisoned_cache(model, **kwargs) -> PagedMLACache:
    """A cache whose every row starts as NaN: a row read before it is written spoils the logits."""
    cache = PagedMLACache(model, **kwargs)
    for layer in range(len(cache.layers)):
        cache.kv_cache(layer).fill_(float("nan"))
    return cache


def check_steps(model, reference, cache, lengths, batch, seed, dtype) -> None:
    """Feed random steps of `lengths` tokens; each step's logits match the reference over the whole sequence."""
    gen = torch.Generator().manual_seed(seed)
    seen = torch.empty(batch, 0, dtype=torch.long)
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(1, VOCAB, (batch, n), generator=gen)
            seen = torch.cat([seen, ids], dim=1)
            close(model(ids, past_key_values=cache).logits, reference(seen).logits[:, -n:], dtype)


@pytest.fixture
def modes(monkeypatch):
    """The kernel path each model step took (prefill / chunked / decode)."""
    seen = []
    plan = hf._plan_step

    def recording(*args, **kwargs):
        step = plan(*args, **kwargs)
        seen.append(step.mode)
        return step

    monkeypatch.setattr(hf, "_plan_step", recording)
    return seen


# ---- spec_from_config --------------------------------------------------------------------------------------
DEEPSEEK_V3 = {  # the MLA fields of DeepSeek-V3's public config.json
    "model_type": "deepseek_v3", "num_attention_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                     "beta_slow": 1, "original_max_position_embeddings": 4096},
}  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_deepseek_v3_config_gives_the_bundled_specs(tp):
    assert spec_from_config(DEEPSEEK_V3, tp_size=tp) == load_spec(f"specs/deepseek-v3-tp{tp}.yaml")


def test_an_fp8_cache_gives_the_bundled_fp8_spec():
    assert spec_from_config(DEEPSEEK_V3, tp_size=8, cache_dtype="float8_e4m3fn") == load_spec(
        "specs/deepseek-v3-tp8-fp8.yaml"
    )
    assert spec_from_config(DEEPSEEK_V3, tp_size=8, cache_dtype=torch.bfloat16).cache_dtype == "bfloat16"


# The MLA fields and rope_scaling blocks of the published config.json files (huggingface.co/deepseek-ai/
# DeepSeek-V2, deepseek-ai/DeepSeek-V2-Lite, moonshotai/Kimi-K2-Instruct): YaRN with mscale_all_dim, so the
# models scale scores by mscale(factor, mscale_all_dim)^2 / sqrt(Dn + Dr), not by 1 / sqrt(Dn + Dr).
_V2_YARN = {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
            "original_max_position_embeddings": 4096}  # fmt: skip
PUBLISHED = {
    "deepseek-v2": ("deepseek_v2", {**DEEPSEEK_V3, "model_type": "deepseek_v2", "rope_scaling": _V2_YARN}),
    "deepseek-v2-lite": (
        "deepseek_v2",
        {
            **DEEPSEEK_V3,
            "model_type": "deepseek_v2",
            "num_attention_heads": 16,
            "q_lora_rank": None,
            "rope_scaling": _V2_YARN,
        },
    ),  # fmt: skip
    "kimi-k2": (
        "deepseek_v3",
        {
            **DEEPSEEK_V3,
            "model_type": "kimi_k2",
            "num_attention_heads": 64,
            "rope_scaling": {
                "type": "yarn",
                "factor": 32.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 1.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 4096,
            },
        },
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_give_the_bundled_specs(name):
    """The bundled spec is what spec_from_config makes of the model's published config, and its softmax scale
    (the committed generated module's) is the one transformers' attention computes for that config."""
    code, config = PUBLISHED[name]
    bundled = load_spec(f"specs/{name}.yaml")
    assert spec_from_config(config, name=name) == bundled
    modeling = getattr(transformers.models, code)
    config_class = getattr(modeling, f"{code.title().replace('_', '')}Config")
    attention_class = getattr(getattr(modeling, f"modeling_{code}"), f"{code.title().replace('_', '')}Attention")
    fields = {k: v for k, v in config.items() if k not in ("model_type", "torch_dtype")}
    heads = config["num_attention_heads"]
    hf_config = config_class(**fields, num_key_value_heads=heads, hidden_size=heads)  # only the attention counts
    scale = attention_class(hf_config, 0).scaling
    generated = (Path(__file__).resolve().parents[1] / "generated" / f"{bundled.module_name}.py").read_text()
    generated_scale = float(re.search(r"^SOFTMAX_SCALE = (.*)$", generated, re.MULTILINE).group(1))
    assert math.isclose(generated_scale, scale, rel_tol=1e-12)  # equal up to the order of the products
    assert not math.isclose(scale, (128 + 64) ** -0.5, rel_tol=0.1)  # YaRN's mscale^2 is in it


@given(
    heads=st.sampled_from([1, 2, 4, 6, 8, 16]),
    tp=st.sampled_from([1, 2, 4]),
    dims=st.tuples(*[st.sampled_from([16, 32, 64])] * 3),
    rope=st.sampled_from(["default", "yarn"]),
    factor=st.floats(0.5, 64),
    mscale_all_dim=st.sampled_from([0.0, 0.707, 1.0]),
    interleave=st.booleans(),
)
def test_softmax_scale_is_the_models_own(heads, tp, dims, rope, factor, mscale_all_dim, interleave):
    """The spec's scale equals transformers' DeepseekV3Attention.scaling for the same config."""
    dr, dn, dv = dims
    rope_parameters = {"rope_type": rope, "rope_theta": 10000.0}
    if rope == "yarn":
        rope_parameters.update(factor=factor, mscale=1.0, mscale_all_dim=mscale_all_dim,
                               original_max_position_embeddings=64)  # fmt: skip
    config = DeepseekV3Config(
        num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=64, q_lora_rank=None,
        qk_rope_head_dim=dr, qk_nope_head_dim=dn, v_head_dim=dv, hidden_size=32, rope_parameters=rope_parameters,
        rope_interleave=interleave, max_position_embeddings=256,
    )  # fmt: skip
    attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(config, 0)
    if heads % tp:
        with pytest.raises(ValueError, match=f"tp_size={tp} does not divide num_attention_heads={heads}"):
            spec_from_config(config, tp_size=tp)
        return
    spec = spec_from_config(config, tp_size=tp)
    assert spec.num_heads == heads // tp and (spec.qk_rope_head_dim, spec.qk_nope_head_dim, spec.v_head_dim) == dims
    assert math.isclose(softmax_scale_of(spec), attention.scaling, rel_tol=1e-12)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv_lora_rank": None}, "not an MLA config: missing kv_lora_rank"),
        ({"num_attention_heads": 12}, "tp_size=8 does not divide num_attention_heads=12: choose one of 1, 2, 3, 4, 6"),
        ({"torch_dtype": "float32"}, None),  # not a kernel dtype: bfloat16 by default
    ],
)
def test_spec_from_config_errors_name_the_field(change, message):
    config = {**DEEPSEEK_V3, **change}
    if message is None:
        assert spec_from_config(config, tp_size=8).dtype == "bfloat16"
        return
    with pytest.raises(ValueError, match=message):
        spec_from_config(config, tp_size=8)


def test_spec_from_hf_cli(tmp_path):
    import json

    from typer.testing import CliRunner

    from mlagen_compiler.cli import app

    model_dir = tmp_path / "kimi"
    model_dir.mkdir()
    kimi = {**DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64}
    (model_dir / "config.json").write_text(json.dumps(kimi))
    out = tmp_path / "kimi.yaml"
    result = CliRunner().invoke(
        app, ["spec-from-hf", str(model_dir), "--tp-size", "4", "--page-size", "32", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert load_spec(out) == spec_from_config(kimi, tp_size=4, page_size=32)
    assert load_spec(out).name == "kimi-k2-tp4" and load_spec(out).num_heads == 16
    fp8 = CliRunner().invoke(app, ["spec-from-hf", str(model_dir), "--cache-dtype", "float8_e4m3fn", "-o", str(out)])
    assert fp8.exit_code == 0, fp8.output
    assert load_spec(out) == spec_from_config(kimi, cache_dtype="float8_e4m3fn")
    assert load_spec(out).name == "kimi-k2-tp1-fp8" and load_spec(out).cache_format.scaled
    for args, fragment in [
        ([str(tmp_path / "none.json")], "no such file"),
        ([str(model_dir), "--cache-dtype", "int8"], "cache_dtype: Input should be 'bfloat16', 'float16' or"),
        ([str(model_dir), "--tp-size", "3"], "tp_size=3 does not divide num_attention_heads=64"),
        ([str(out)], "not valid JSON"),
    ]:
        result = CliRunner().invoke(app, ["spec-from-hf", *args])
        assert result.exit_code == 2 and fragment in result.output, result.output
        assert result.output.startswith("mlagen: error: ") and result.output.count("\n") == 1


# ---- the patched model, step by step ----------------------------------------------------------------------
@CPU_MODEL
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_patched_v3_matches_unpatched_step_by_step(dtype, modes):
    """Prompt, two single-token steps, a 6-token chunk and a 3-token step: logits of each step match the
    unpatched model run over the whole sequence."""
    reference = tiny_v3(seed=1)
    model = patched(reference, dtype)
    cache = poisoned_cache(model, max_batch_size=3, max_cache_len=40)
    check_steps(model, reference, cache, (7, 1, 1, 6, 3), batch=2, seed=2, dtype=dtype)
    assert modes == ["prefill", "decode", "decode", "chunked", "decode"]
    assert cache.get_seq_length() == 18 and cache.lengths[:2] == [18, 18]


@CPU_MODEL
def test_patched_v2_matches_unpatched(modes):
    """DeepSeek-V2 code: complex rope, no q LoRA."""
    reference = tiny_v2(seed=3)
    model = patched(reference, torch.float16, page_size=8)
    cache = poisoned_cache(model, max_batch_size=1, max_cache_len=20)
    check_steps(model, reference, cache, (9, 1, 5), batch=1, seed=4, dtype=torch.float16)
    assert modes == ["prefill", "decode", "chunked"]


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel() :] = prompt
        mask[row, width - prompt.numel() :] = 1
    return ids, mask


@CPU_MODEL
def test_left_padded_batch_gives_each_sequence_its_own_result(modes):
    """Prompts of 9, 4 and 1 tokens, left-padded, then a token and then 5 tokens for each: every sequence's
    logits equal those of the unpatched model run on that sequence alone."""
    dtype = torch.float16
    reference = tiny_v3(seed=5, rope_interleave=False)
    model = patched(reference, dtype)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (9, 4, 1)]
    ids, mask = left_padded(prompts)
    cache = poisoned_cache(model, max_batch_size=3, max_cache_len=32)
    alone = [p.clone() for p in prompts]
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache).logits
        for row, prompt in enumerate(prompts):
            close(logits[row, -prompt.numel() :], reference(prompt[None]).logits[0], dtype)
        for n in (1, 5):
            new = torch.randint(1, VOCAB, (3, n), generator=gen)
            mask = torch.cat([mask, torch.ones_like(new)], dim=1)
            logits = model(new, attention_mask=mask, past_key_values=cache).logits
            for row in range(3):
                alone[row] = torch.cat([alone[row], new[row]])
                close(logits[row], reference(alone[row][None]).logits[0, -n:], dtype)
    assert modes == ["prefill", "decode", "chunked"]
    assert cache.lengths[:3] == [15, 10, 7] and cache.get_seq_length() == 15


def robust_greedy(reference, prompt: torch.Tensor, new_tokens: int, margin: float) -> list[int] | None:
    """The reference's greedy tokens for `prompt`, or None if some step's best two logits are within `margin`."""
    result = reference.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                                return_dict_in_generate=True)  # fmt: skip
    for scores in result.scores:
        top2 = scores[0].topk(2).values
        if top2[0] - top2[1] <= margin * scores.abs().max():
            return None
    return result.sequences[0, prompt.numel() :].tolist()


@CPU_MODEL
def test_greedy_generate_is_token_identical():
    """A left-padded batch through generate() gives each prompt the tokens the unpatched model generates for
    it alone. The case is robust: the first of a fixed series of prompt pairs where, at every reference step,
    the best logit leads the next by over 4 logit tolerances (so rounding cannot swap them)."""
    dtype = torch.float16
    reference = tiny_v3(seed=7)
    model = patched(reference, dtype)
    new_tokens = 6
    with torch.no_grad():
        for seed in range(20):
            gen = torch.Generator().manual_seed(100 + seed)
            prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (6, 3)]
            expected = [robust_greedy(reference, p, new_tokens, margin=4 * 8 * EPS[dtype]) for p in prompts]
            if None not in expected:
                break
        else:
            pytest.fail("no robust case among 20 prompt pairs")
        ids, mask = left_padded(prompts)
        cache = PagedMLACache(model, max_batch_size=2, max_cache_len=16)
        out = model.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False
        )
    assert [row[ids.shape[1] :].tolist() for row in out] == expected


@CPU_MODEL
def test_reorder_cache_copies_sequences():
    """reorder_cache([1, 1]): both rows continue sequence 1, with its logits."""
    dtype = torch.float16
    reference = tiny_v3(seed=9)
    model = patched(reference, dtype)
    gen = torch.Generator().manual_seed(10)
    prompt = torch.randint(1, VOCAB, (2, 5), generator=gen)
    cache = poisoned_cache(model, max_batch_size=2, max_cache_len=16)
    with torch.no_grad():
        model(prompt, past_key_values=cache)
        cache.reorder_cache(torch.tensor([1, 1]))
        new = torch.randint(1, VOCAB, (1, 1), generator=gen).expand(2, 1)
        logits = model(new, past_key_values=cache).logits
        expected = reference(torch.cat([prompt[1:], new[:1]], dim=1)).logits[:, -1:]
    close(logits, expected.expand(2, 1, VOCAB), dtype)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.lengths == [0, 0]


def dequantised_cache_writes(model, kv_scale: float) -> None:
    """The 16-bit patched `model` writes into its cache what an fp8 cache with `kv_scale` holds, dequantised:
    latent / kv_scale saturated to +-448 and rounded to e4m3 by torch, times kv_scale (exact in 16 bits for a
    power-of-two scale)."""
    patch = model._mlagen_patch
    write = patch.ops.cache_write

    def quantised(values):
        return (quantize_latent(values, kv_scale, torch.float8_e4m3fn).float() * kv_scale).to(values.dtype)

    def cache_write(c_kv, k_pe, kv_cache, slots, kv_scale_arg=None):
        assert kv_scale_arg is None  # (a 16-bit cache)
        write(quantised(c_kv), quantised(k_pe), kv_cache, slots, None)

    patch.ops = SimpleNamespace(**{**vars(patch.ops), "cache_write": cache_write})


@CPU_MODEL
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_cache_model_reads_what_its_cache_holds(dtype, modes):
    """A model patched for an fp8 cache (kv_scale 0.25 in every layer) gives, step by step, the logits of the
    16-bit patched model whose cache holds the same values dequantised: prefill, decode and chunked prefill
    read its e4m3 rows and their scale right, to the 16-bit tolerance."""
    reference = tiny_v3(seed=31)
    fp8 = patch_model(copy.deepcopy(reference), page_size=16, dtype=dtype, cache_dtype="float8_e4m3fn")
    sixteen = patched(reference, dtype)
    dequantised_cache_writes(sixteen, 0.25)
    fp8_cache = poisoned_cache(fp8, max_batch_size=3, max_cache_len=40, kv_scale=0.25)
    cache = poisoned_cache(sixteen, max_batch_size=3, max_cache_len=40)
    assert fp8_cache.kv_cache(0).dtype == torch.float8_e4m3fn and fp8_cache.kv_scale(1).tolist() == [0.25]
    assert fp8._mlagen_patch.spec.name.endswith("-fp8") and cache.kv_scale(0) is None
    gen = torch.Generator().manual_seed(32)
    with torch.no_grad():
        for n in (7, 1, 1, 6, 3):
            ids = torch.randint(1, VOCAB, (2, n), generator=gen)
            close(fp8(ids, past_key_values=fp8_cache).logits, sixteen(ids, past_key_values=cache).logits, dtype)
    assert modes == [mode for mode in ["prefill", "decode", "decode", "chunked", "decode"] for _ in range(2)]
    # beam search moves fp8 pages too: both rows continue sequence 1
    fp8_cache.reorder_cache(torch.tensor([1, 1]))
    cache.reorder_cache(torch.tensor([1, 1]))
    token = torch.randint(1, VOCAB, (1, 1), generator=gen).expand(2, 1)
    with torch.no_grad():
        logits = fp8(token, past_key_values=fp8_cache).logits
        close(logits, sixteen(token, past_key_values=cache).logits, dtype)
    close(logits[0], logits[1], dtype)


@CPU_MODEL
def test_fp8_cache_arguments_are_checked():
    reference = tiny_v3(seed=33)
    fp8 = patch_model(copy.deepcopy(reference), page_size=16, dtype=torch.float16, cache_dtype=torch.float8_e4m3fn)
    assert all(PagedMLACache(fp8, max_batch_size=1, max_cache_len=8).kv_scale(i).item() == 1.0 for i in range(2))
    per_layer = PagedMLACache(fp8, max_batch_size=1, max_cache_len=8, kv_scale=[0.5, 2])
    assert [per_layer.kv_scale(i).item() for i in range(2)] == [0.5, 2.0]
    for bad, message in [
        (0.0, "layer 0's scale 0.0 must be a finite float > 0"),
        (float("inf"), "layer 0's scale inf must be a finite float > 0"),
        ([1.0, -1.0], "layer 1's scale -1.0 must be a finite float > 0"),
        ([1.0], "a sequence of 2 \\(one per attention layer\\)"),
        (True, "a sequence of 2"),
        ("1.0", "a sequence of 2"),
    ]:
        with pytest.raises(ValueError, match=f"kv_scale={re.escape(repr(bad))} is not allowed: .*{message}"):
            PagedMLACache(fp8, max_batch_size=1, max_cache_len=8, kv_scale=bad)
    sixteen = patched(reference, torch.float16)
    with pytest.raises(ValueError, match="kv_scale=0.5 is not allowed: the model was patched for a float16 cache"):
        PagedMLACache(sixteen, max_batch_size=1, max_cache_len=8, kv_scale=0.5)
    with pytest.raises(
        SpecError,
        match="cache_dtype=bfloat16 is not allowed with dtype=float16: must be the spec's dtype \\(float16\\)",
    ):
        patch_model(copy.deepcopy(reference), dtype=torch.float16, cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="already patched .* cache float8_e4m3fn"):
        patch_model(fp8, page_size=16, dtype=torch.float16)


@CPU_MODEL
def test_kv_scales_from_a_prompt_store_its_largest_latent_value_as_448():
    """kv_scales_from's per-layer scales, calibrated on a left-padded prompt batch, store that prompt's largest
    latent value as e4m3's largest (448) in every layer, nothing beyond it, and only its real tokens."""
    reference = tiny_v3(seed=35)
    fp8 = patch_model(copy.deepcopy(reference), page_size=16, dtype=torch.float16, cache_dtype="float8_e4m3fn")
    gen = torch.Generator().manual_seed(36)
    ids, mask = left_padded([torch.randint(1, VOCAB, (n,), generator=gen) for n in (9, 5)])
    scales = hf.kv_scales_from(fp8, ids, attention_mask=mask)
    assert len(scales) == 2 and all(0 < scale < 1 for scale in scales), scales
    cache = poisoned_cache(fp8, max_batch_size=2, max_cache_len=16, kv_scale=scales)
    with torch.no_grad():
        fp8(ids, attention_mask=mask, past_key_values=cache)
    for layer in range(2):
        rows = cache.kv_cache(layer).float()
        written = rows[~rows.isnan()]  # (unwritten rows stay NaN)
        assert written.numel() == (9 + 5) * (64 + 16)
        assert written.abs().max().item() == 448.0
    assert hf.kv_scales_from(fp8, ids, attention_mask=mask, margin=2.0) == [2 * scale for scale in scales]
    # the cache's dtype does not matter: a 16-bit patched model measures the same rows
    sixteen = patched(reference, torch.float16)
    assert hf.kv_scales_from(sixteen, ids, attention_mask=mask) == scales
    with pytest.raises(ValueError, match="margin=0 is not allowed: must be a finite float > 0"):
        hf.kv_scales_from(fp8, ids, margin=0)
    with pytest.raises(ValueError, match="model: not patched by mlagen"):
        hf.kv_scales_from(reference, ids)


#: transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name deprecated until 5.40)
CACHE_ARGUMENTS = ["past_key_values"] + (["cache"] if TRANSFORMERS_VERSION >= (5, 24) else [])


@CPU_MODEL
@pytest.mark.parametrize("argument", CACHE_ARGUMENTS)
def test_either_name_of_the_cache_argument_feeds_the_paged_cache(argument, modes):
    """A prompt and a decode step through `cache=` (transformers >= 5.24) or `past_key_values=`: the cache
    fills (the step decodes) and the logits match the unpatched model."""
    dtype = torch.float16
    reference = tiny_v3(seed=21)
    model = patched(reference, dtype)
    cache = poisoned_cache(model, max_batch_size=2, max_cache_len=12)
    gen = torch.Generator().manual_seed(22)
    prompt = torch.randint(1, VOCAB, (2, 5), generator=gen)
    token = torch.randint(1, VOCAB, (2, 1), generator=gen)
    with torch.no_grad():
        model(prompt, **{argument: cache})
        assert cache.get_seq_length() == 5
        logits = model(token, **{argument: cache}).logits
        expected = reference(torch.cat([prompt, token], dim=1)).logits[:, -1:]
    assert modes == ["prefill", "decode"]
    close(logits, expected, dtype)
    with torch.no_grad(), pytest.raises(TypeError, match="needs a PagedMLACache, got DynamicCache"):
        model(prompt, **{argument: DynamicCache(config=model.config)})


@CPU_MODEL
def test_misuse_is_one_clear_error():
    reference = tiny_v3(seed=11)
    with pytest.raises(ValueError, match="model: not patched by mlagen: call patch_model"):
        PagedMLACache(reference, max_batch_size=1, max_cache_len=8)
    model = patched(reference, torch.float16)
    with pytest.raises(ValueError, match="page_size=32 is not allowed: the model was patched with page_size=16"):
        PagedMLACache(model, max_batch_size=1, max_cache_len=8, page_size=32)
    with pytest.raises(ValueError, match="max_cache_len=0 is not allowed"):
        PagedMLACache(model, max_batch_size=1, max_cache_len=0)
    ids = torch.randint(1, VOCAB, (2, 4))
    with torch.no_grad():
        with pytest.raises(TypeError, match="needs a PagedMLACache, got DynamicCache"):
            model(ids, past_key_values=DynamicCache(config=model.config))
        cache = PagedMLACache(model, max_batch_size=2, max_cache_len=6)
        with pytest.raises(ValueError, match=r"attention_mask row 1: .* \[1, 0, 1, 1\] is not left-padded"):
            model(ids, attention_mask=torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]]), past_key_values=cache)
        with pytest.raises(ValueError, match="batch of 3 sequences: the PagedMLACache was made for max_batch_size=2"):
            model(torch.randint(1, VOCAB, (3, 4)), past_key_values=cache)
        model(ids, past_key_values=cache)
        with pytest.raises(ValueError, match="sequence 0 would hold 7 tokens, more than max_cache_len=6"):
            model(ids[:, :3], past_key_values=cache)
    with pytest.raises(RuntimeError, match="outside a model forward"):
        model.model.layers[0].self_attn(torch.randn(1, 1, 64), None, None)


@CPU_MODEL
def test_forward_without_cache_runs_prefill(modes):
    """No past_key_values (use_cache=False): one causal prefill through the kernels, padding respected."""
    dtype = torch.float16
    reference = tiny_v3(seed=12)
    model = patched(reference, dtype)
    prompts = [torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 2)]
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, use_cache=False).logits
        for row, prompt in enumerate(prompts):
            close(logits[row, -prompt.numel() :], reference(prompt[None]).logits[0], dtype)
    assert modes == ["prefill"]


# ---- custom ops, planned steps -----------------------------------------------------------------------------
@CPU_MODEL
def test_patched_attention_runs_the_modules_custom_ops(monkeypatch):
    """The kernels run through the generated module's torch.library ops (what torch.compile traces)."""
    model = patched(tiny_v3(seed=13), torch.float16)
    ops = model._mlagen_patch.ops
    assert ops is model._mlagen_patch.module.ops and ops.namespace.startswith("mlagen_deepseek_v3_tp1_")
    called = []
    for name in ("cache_write", "prefill", "decode"):
        op = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _op=op, _name=name: called.append(_name) or _op(*a))
    cache = PagedMLACache(model, max_batch_size=1, max_cache_len=8)
    with torch.no_grad():
        model(torch.randint(1, VOCAB, (1, 3)), past_key_values=cache)
        model(torch.randint(1, VOCAB, (1, 1)), past_key_values=cache)
    assert called == ["cache_write", "prefill"] * 2 + ["cache_write", "decode"] * 2  # two layers per step
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION  # no causal mask built for it


@contextlib.contextmanager
def no_host_reads_outside_kernels(model):
    """Fail on any Python-level read of a tensor's value (item, tolist, bool, int, float) outside the kernel ops:
    on a GPU each is a synchronisation, which a CUDA graph capture cannot contain. (Inside the ops the checks of
    validation, on for CPU tensors, read values on purpose.)"""
    ops = model._mlagen_patch.ops
    inside = []
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__int__", "__float__")}

    def guard(name):
        def read(self, *args, **kwargs):
            if not inside:
                raise AssertionError(f"Tensor.{name} read a value on the host during a planned forward")
            return originals[name](self, *args, **kwargs)

        return read

    def inside_op(op):
        def call(*args, **kwargs):
            inside.append(op)
            try:
                return op(*args, **kwargs)
            finally:
                inside.pop()

        return call

    saved = dict(vars(ops))
    with pytest.MonkeyPatch.context() as patch:
        for name in originals:
            patch.setattr(torch.Tensor, name, guard(name))
        for name, op in saved.items():
            if callable(op):
                patch.setattr(ops, name, inside_op(op))
        yield


@CPU_MODEL
def test_planned_step_runs_one_step_any_number_of_times(modes):
    """Inside planned_step every forward is the same decode step (same logits, same cache rows), planned
    once; the cache counts the step once on leaving the block, and the next step follows on correctly."""
    dtype = torch.float16
    reference = tiny_v3(seed=16)
    model = patched(reference, dtype)
    gen = torch.Generator().manual_seed(17)
    prompt, token, after = (torch.randint(1, VOCAB, (2, n), generator=gen) for n in (5, 1, 1))
    cache = poisoned_cache(model, max_batch_size=2, max_cache_len=16)
    with torch.no_grad():
        model(prompt, past_key_values=cache)
        with hf.planned_step(model, cache, batch_size=2):
            first = model(token, past_key_values=cache).logits
            with no_host_reads_outside_kernels(model):  # what a CUDA graph capture could not contain
                second = model(token, past_key_values=cache).logits
            assert cache.lengths[:2] == [5, 5]
        assert cache.lengths[:2] == [6, 6] and cache.get_seq_length() == 6
        close(first, reference(torch.cat([prompt, token], 1)).logits[:, -1:], dtype)
        assert torch.equal(first, second)
        seen = torch.cat([prompt, token, after], 1)
        close(model(after, past_key_values=cache).logits, reference(seen).logits[:, -1:], dtype)
        wrong = r"input of 2 sequences x 2 tokens .* the planned step \(2 x 1 tokens"
        with pytest.raises(ValueError, match=wrong), hf.planned_step(model, cache, batch_size=2):
            model(torch.cat([token, token], 1), past_key_values=cache)
    assert modes == ["prefill", "decode", "decode", "decode"]  # planned once for two forwards
    assert cache.lengths[:2] == [7, 7]  # the failed block counted nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_planned_model_step_captures_in_a_cuda_graph():
    """A whole patched decode step (every layer) captured in a CUDA graph inside planned_step and replayed: the
    logits of the same step run eagerly."""
    model = patched(tiny_v3(seed=20).cuda(), torch.float16)
    with use_options(validate=False):  # validation synchronises: not capturable
        gen = torch.Generator().manual_seed(21)
        prompt, token = (torch.randint(1, VOCAB, (2, n), generator=gen).cuda() for n in (5, 1))
        cache = PagedMLACache(model, max_batch_size=2, max_cache_len=8)
        with torch.no_grad():
            model(prompt, past_key_values=cache)
            with hf.planned_step(model, cache, batch_size=2):
                eager = model(token, past_key_values=cache).logits.clone()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    model(token, past_key_values=cache)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static = model(token, past_key_values=cache).logits
                static.zero_()
                graph.replay()
                torch.cuda.synchronize()
        torch.testing.assert_close(static, eager, rtol=0, atol=0)


@CPU_MODEL
def test_torch_compile_fullgraph_traces_a_whole_planned_model_step():
    """A whole model forward (every layer, the cache writes and decode) compiled with fullgraph=True inside
    planned_step: no graph breaks, the eager logits."""
    torch._dynamo.reset()
    dtype = torch.float16
    model = patched(tiny_v3(seed=18), dtype)
    gen = torch.Generator().manual_seed(19)
    prompt, token = torch.randint(1, VOCAB, (2, 4), generator=gen), torch.randint(1, VOCAB, (2, 1), generator=gen)
    caches = [PagedMLACache(model, max_batch_size=2, max_cache_len=8) for _ in range(2)]
    for cache in caches:  # rows nobody writes compare equal
        for layer in range(len(cache.layers)):
            cache.kv_cache(layer).zero_()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    logits = []
    with torch.no_grad():
        for cache, run in zip(caches, (model, compiled), strict=True):
            model(prompt, past_key_values=cache)
            with hf.planned_step(model, cache, batch_size=2):
                logits.append(run(token, past_key_values=cache).logits)
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(caches[0].kv_cache(1), caches[1].kv_cache(1))


@CPU_MODEL
def test_a_compiled_planned_step_does_not_recompile_on_every_call():
    """Running one planned step again and again through torch.compile compiles it at most twice (the first
    call's state, then the steady one): state the patch mutates per call must not be guarded by value."""
    torch._dynamo.reset()
    model = patched(tiny_v3(seed=21), torch.float16)
    gen = torch.Generator().manual_seed(22)
    prompt, token = torch.randint(1, VOCAB, (2, 4), generator=gen), torch.randint(1, VOCAB, (2, 1), generator=gen)
    cache = PagedMLACache(model, max_batch_size=2, max_cache_len=8)
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(model, fullgraph=True, backend=counting_backend)
    with torch.no_grad():
        model(prompt, past_key_values=cache)
        with hf.planned_step(model, cache, batch_size=2):
            for _ in range(5):
                compiled(token, past_key_values=cache)
    assert 1 <= len(graphs) <= 2, f"{len(graphs)} compilations for 5 calls of one step"


@CPU_MODEL
def test_torch_compile_traces_patched_attention_without_graph_breaks(modes):
    """Each layer's patched attention compiled with fullgraph=True (a graph break would raise): the prompt,
    a decode step and a chunk give the eager model's logits."""
    torch._dynamo.reset()
    dtype = torch.float16
    reference = tiny_v3(seed=14)
    model = patched(reference, dtype)
    for layer in model.model.layers:
        layer.self_attn.forward = torch.compile(layer.self_attn.forward, fullgraph=True, backend="aot_eager")
    cache = PagedMLACache(model, max_batch_size=2, max_cache_len=24)
    check_steps(model, reference, cache, (6, 1, 5), batch=2, seed=15, dtype=dtype)
    assert modes == ["prefill", "decode", "chunked"]


def test_a_cache_of_another_patched_model_is_one_clear_error():
    """A PagedMLACache made for a model of fewer layers (or another spec) is refused by name, before any layer
    indexes past its caches."""
    model = patched(tiny_v3(seed=12), torch.float16)
    smaller = patched(tiny_v3(seed=12, num_hidden_layers=1), torch.float16)
    other_page = patched(tiny_v3(seed=12), torch.float16, page_size=32)
    ids = torch.randint(1, VOCAB, (1, 4))
    with torch.no_grad():
        cache = PagedMLACache(smaller, max_batch_size=1, max_cache_len=8)
        layers = len(model.model.layers)
        with pytest.raises(
            ValueError,
            match=rf"^cache \(past_key_values\): a PagedMLACache of 1 layer\(s\), the "
            rf"patched model has {layers} attention layers: make it with PagedMLACache\(model",
        ):
            model(ids, past_key_values=cache)
        with pytest.raises(ValueError, match="a PagedMLACache of 1 layer"), hf.planned_step(model, cache, batch_size=1):
            pass
        cache = PagedMLACache(other_page, max_batch_size=1, max_cache_len=8)
        with pytest.raises(
            ValueError,
            match=r"^cache \(past_key_values\): a PagedMLACache for spec '.*', the model is "
            r"patched with '.*'",
        ):
            model(ids, past_key_values=cache)
