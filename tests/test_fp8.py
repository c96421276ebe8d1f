"""The fp8 latent cache (cache_dtype float8_e4m3fn): its error against the unquantised latent, and the
kv_scale contract of every entry point that reads or writes the cache.

Kernel against reference on the dequantised cache is checked by the property tests of each kernel
(test_decode.py, test_prefill.py, test_cache_write.py) with the 16-bit tolerances; this file bounds what
quantisation itself costs, end to end: latent rows -> mla_cache_write -> mla_decode, against attention
over the unquantised rows.
"""

import math

import pytest
import torch
from helpers import SMALL_SPEC

from mlagen_compiler.reference import FP8_E4M3_MAX, decode_paged
from mlagen_compiler.verify import (
    LSE_TOLERANCE,
    TOLERANCES,
    compare_with_lse,
    cu_seqlens,
    make_decode_inputs,
    paged_block_table,
    random_cache,
    random_mha,
)

FP8 = "float8_e4m3fn"
#: e4m3 keeps 3 mantissa bits: rounding to nearest changes a normal value by at most this relative amount
E4M3_UNIT_ROUNDOFF = 2.0**-4


def fp8_error_bound(softmax_scale: float, width: int, sigma_q: float, sigma_k: float) -> tuple[float, float]:
    """(bound on ||o_fp8 - o|| / ||o||, bound on the rms LSE error) from quantising the cache alone, for
    query and latent entries of standard deviations sigma_q and sigma_k, chosen before any was measured.

    Each stored element is x (1 + d) with |d| <= u = 2^-4, the d independent and of mean 0 (rounding of
    random data; subnormals, |x| < 2^-6 kv_scale, err by at most 2^-10 kv_scale, which the calibrated scale
    makes negligible). Values: o = sum_j p_j v_j moves by sum_j p_j v_j d_j, whose rms relative to o's is
    rms(d) <= u. Scores: s q.k_j moves by s sum_c q_c k_jc d_jc, rms <= u s ||q|| sigma_k = u s sqrt(D)
    sigma_q sigma_k =: e (D = Dc + Dr); to first order p_j becomes p_j (1 + e_j - sum p e) and o moves by
    rms <= e relative, and the LSE (log sum_j exp(score_j)) by sum_j p_j e_j, rms <= e. The two output terms
    are independent: ||o_fp8 - o|| / ||o|| <= u sqrt(1 + (e / u)^2) in rms; bounding rms(d) by its maximum
    u leaves a margin of about 2.4 (rms(d) is about 0.42 u for e4m3).
    """
    u = E4M3_UNIT_ROUNDOFF
    score_error = u * softmax_scale * math.sqrt(width) * sigma_q * sigma_k
    return math.hypot(u, score_error), score_error


def fp8_module(build_module, dtype="bfloat16", name="fp8", **fields):
    return build_module(**{**SMALL_SPEC, "name": name, "dtype": dtype, "cache_dtype": FP8, **fields})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_decode_error_against_the_unquantised_latent(build_module, device, dtype):
    """Random latent rows N(0, 1) written by mla_cache_write with the calibrated scale (largest value ->
    448), decoded from the fp8 cache, against float64 attention over the rows as given (in the spec dtype):
    within fp8_error_bound plus the 16-bit tolerance of the kernel itself. On a GPU the DeepSeek-V3
    geometry (D = 576, s = 1/sqrt(192): bound 0.125 + 0.01), in the interpreter a small one (D = 80,
    s = 1/sqrt(48): bound 0.102 + 0.01)."""
    if device.type == "cuda":
        geometry = dict(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, page_size=64)
        seqlens, seqlen_q = [2, 700, 2049, 4000], 2
    else:
        geometry, seqlens, seqlen_q = {}, [2, 37, 70], 2
    module = fp8_module(build_module, dtype, name="fp8-error", **geometry)
    g = torch.Generator().manual_seed(11)
    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    table, num_pages = paged_block_table(seqlens, module.PAGE_SIZE, g, spare_pages=1)
    latent = torch.randn(num_pages * module.PAGE_SIZE, width, generator=g).to(module.DTYPE)
    q = torch.randn(len(seqlens), seqlen_q, module.NUM_HEADS, width, generator=g).to(module.DTYPE)
    kv_scale = float(latent.abs().max()) / FP8_E4M3_MAX
    cache = torch.empty(num_pages, module.PAGE_SIZE, 1, width, dtype=torch.float8_e4m3fn, device=device)
    slots = torch.arange(num_pages * module.PAGE_SIZE, device=device)
    c_kv, k_pe = latent[:, : module.KV_LORA_RANK], latent[:, module.KV_LORA_RANK :]
    module.mla_cache_write(c_kv.to(device), k_pe.to(device), cache, slots, kv_scale=kv_scale)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=device)
    out, lse = module.mla_decode(q.to(device), cache, table.to(device), lens, kv_scale=kv_scale, return_lse=True)
    exact = latent.double().view(num_pages, module.PAGE_SIZE, 1, width)
    want, want_lse = decode_paged(q.double(), exact, table, lens.cpu(), module.KV_LORA_RANK, module.SOFTMAX_SCALE)

    out_bound, lse_bound = fp8_error_bound(module.SOFTMAX_SCALE, width, sigma_q=1.0, sigma_k=1.0)
    out_bound += TOLERANCES[dtype]["rel_norm"]
    lse_bound += LSE_TOLERANCE["atol"]
    rel = float((out.double().cpu() - want).norm() / want.norm())
    lse_rms = float((lse.double().cpu() - want_lse).pow(2).mean().sqrt())
    print(
        f"fp8 vs unquantised ({dtype}): relative error {rel:.4f} (bound {out_bound:.4f}), "
        f"rms LSE error {lse_rms:.4f} (bound {lse_bound:.4f})"
    )
    assert rel <= out_bound, f"relative error {rel:.4f} > bound {out_bound:.4f}"
    assert lse_rms <= lse_bound, f"rms LSE error {lse_rms:.4f} > bound {lse_bound:.4f}"


@pytest.mark.parametrize("magnitude", [3e4, 1e-6])
def test_fp8_decode_takes_queries_outside_float16s_range(build_module, device, magnitude):
    """The portable kernel's fp8 dots run in float16 (mma.sync row blocks): a bfloat16 query of values past
    float16's largest (65504) or deep in its subnormals is rescaled by a power of two first. q is scaled by
    `magnitude` and the softmax scale by its inverse, so the scores (and the reference's conditioning) are
    those of unit data, while the kernel sees the extreme values; 16-bit tolerances, nothing non-finite."""
    module = fp8_module(build_module, name="fp8-range", num_heads=4)
    inputs = make_decode_inputs(module, [37, 5, 70], 2, torch.Generator().manual_seed(5), device)
    inputs["q"] = (inputs["q"].float() * magnitude).to(module.DTYPE)
    scale = module.SOFTMAX_SCALE / magnitude
    out, lse = module.mla_decode(**inputs, softmax_scale=scale, return_lse=True)
    dequantised = inputs["kv_cache"].float() * float(inputs["kv_scale"])
    want, want_lse = decode_paged(inputs["q"].double().cpu(), dequantised.double().cpu(), inputs["block_table"].cpu(),
                                  inputs["cache_seqlens"].cpu(), module.KV_LORA_RANK, scale)  # fmt: skip
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    _, _, message = compare_with_lse(out, lse, want, want_lse, "bfloat16")
    assert not message, message


def small_problem(module, device, seed=0):
    """Decode inputs (with kv_scale for an fp8 module), and cache-write and chunked-prefill arguments."""
    inputs = make_decode_inputs(module, [5, 9], 1, torch.Generator().manual_seed(seed), device)
    g = torch.Generator().manual_seed(seed + 1)
    dc, dr = module.KV_LORA_RANK, module.QK_ROPE_HEAD_DIM
    write = dict(
        c_kv=torch.randn(3, dc, generator=g).to(module.DTYPE).to(device),
        k_pe=torch.randn(3, dr, generator=g).to(module.DTYPE).to(device),
        kv_cache=inputs["kv_cache"],
        slot_mapping=torch.tensor([0, 3, -1], device=device),
    )
    return inputs, write


ENTRY_POINTS = ["mla_decode", "mla_cache_write"]


def call(module, entry, inputs, write, **kwargs):
    if entry == "mla_decode":
        return module.mla_decode(**{**inputs, **kwargs})
    return module.mla_cache_write(**{**write, **kwargs})


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize(
    ("kv_scale", "match"),
    [
        ("missing", "kv_scale: required: this module's cache is torch.float8_e4m3fn"),
        (0.0, "kv_scale: must be a finite number > 0"),
        (-0.5, "kv_scale: must be a finite number > 0"),
        (float("nan"), "kv_scale: must be a finite number > 0"),
        (float("inf"), "kv_scale: must be a finite number > 0"),
        (1e-45, "kv_scale: must be a finite number > 0 within float32's normal range"),
        (True, "kv_scale: must be a finite number > 0"),
        ("0.5", "kv_scale: must be a finite number > 0"),
        (torch.tensor([0.5], dtype=torch.float64), "kv_scale: expected a number or a float32 tensor of one element"),
        (torch.tensor([0.5, 0.5]), "kv_scale: expected a number or a float32 tensor of one element"),
        (torch.tensor([-1.0]), "kv_scale: must be a finite float32 > 0"),  # values are checked when validating
        (torch.tensor(float("nan")), "kv_scale: must be a finite float32 > 0"),
    ],
)
def test_fp8_kv_scale_errors_name_the_argument(build_module, device, entry, kv_scale, match):
    module = fp8_module(build_module, name="fp8-args", num_heads=4, page_size=4)
    inputs, write = small_problem(module, device)
    inputs.pop("kv_scale")
    kwargs = {} if isinstance(kv_scale, str) and kv_scale == "missing" else {"kv_scale": kv_scale}
    if isinstance(kv_scale, torch.Tensor):
        kwargs["kv_scale"] = kv_scale.to(device)
    with pytest.raises(ValueError, match=match):
        call(module, entry, inputs, write, **kwargs)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_fp8_module_checks_cache_dtype_and_scale_device(build_module, device, entry):
    module = fp8_module(build_module, name="fp8-args", num_heads=4, page_size=4)
    inputs, write = small_problem(module, device)
    wrong = torch.zeros(inputs["kv_cache"].shape, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=r"kv_cache: expected dtype torch.float8_e4m3fn \(this module's cache_dtype\)"):
        call(module, entry, {**inputs, "kv_cache": wrong}, {**write, "kv_cache": wrong})
    with pytest.raises(ValueError, match="kv_scale: expected a number or a float32 tensor of one element on"):
        call(module, entry, inputs, write, kv_scale=torch.ones(1, device="meta"))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_sixteen_bit_module_refuses_a_scale(build_module, device, entry):
    module = build_module(**{**SMALL_SPEC, "name": "bf16-args", "num_heads": 4, "page_size": 4})
    inputs, write = small_problem(module, device)
    assert "kv_scale" not in inputs
    with pytest.raises(ValueError, match="kv_scale: this module's cache is torch.float16, not scaled"):
        call(module, entry, inputs, write, kv_scale=1.0)
    with pytest.raises(ValueError, match="kv_cache: expected dtype torch.float16"):
        fp8 = inputs["kv_cache"].to(torch.float8_e4m3fn)
        call(module, entry, {**inputs, "kv_cache": fp8}, {**write, "kv_cache": fp8})


def test_chunked_prefill_takes_the_scale(build_module, device):
    """mla_chunked_prefill's kv_scale: required and checked for an fp8 cache (its results against the
    reference are checked in test_prefill.py)."""
    module = fp8_module(build_module, name="fp8-chunked", num_heads=2, kernels=["prefill"], page_size=4)
    g = torch.Generator().manual_seed(0)
    q, k_nope, k_pe, v = random_mha(module, 3, g, device)
    cache, kv_scale = random_cache(module, 2, g, device)
    args = dict(
        q=q, k_nope=k_nope, k_pe=k_pe, v=v, cu_seqlens=cu_seqlens([3], device), max_seqlen=3, kv_cache=cache,
        block_table=torch.tensor([[1, 0]], dtype=torch.int32, device=device),
        prefix_lens=torch.tensor([5], dtype=torch.int32, device=device),
        w_uk=torch.randn(2, 32, 64, generator=g).to(module.DTYPE).to(device),
        w_uv=torch.randn(2, 32, 64, generator=g).to(module.DTYPE).to(device),
    )  # fmt: skip
    with pytest.raises(ValueError, match="kv_scale: required"):
        module.mla_chunked_prefill(**args)
    with pytest.raises(ValueError, match="kv_scale: must be a finite number > 0"):
        module.mla_chunked_prefill(**args, kv_scale=-1.0)
    assert module.mla_chunked_prefill(**args, kv_scale=kv_scale).isfinite().all()


def test_number_scales_become_one_cached_tensor(build_module, device):
    """A number is turned into a float32 tensor once per (device, value), then reused: after the first step
    a model's calls make no tensor; a tensor is passed through as it is."""
    module = fp8_module(build_module, name="fp8-cache")
    device = torch.empty(0, device=device).device  # as the wrappers see it: q.device, "cuda:0" not "cuda"
    first = module._kv_scale(0.25, device)
    assert first.dtype == torch.float32 and first.shape == (1,) and float(first) == 0.25
    assert module._kv_scale(0.25, device) is first and module._kv_scale(0.5, device) is not first
    given = torch.tensor(0.75, device=device)
    assert module._kv_scale(given, device) is given


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fp8_decode_replays_in_a_cuda_graph_and_reads_the_scale_on_the_device(build_module):
    """A tensor kv_scale is read by the kernel on the device: a captured call, replayed after the tensor's
    value changed, gives the new scale's result (nothing was baked in at capture)."""
    module = fp8_module(build_module, name="fp8-graph", num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, page_size=64)  # fmt: skip
    device = torch.device("cuda")
    inputs = make_decode_inputs(module, [300, 1, 4000, 64], 1, torch.Generator().manual_seed(3), device)
    scale = torch.tensor([float(inputs.pop("kv_scale"))], device=device)
    schedule = module.get_decode_schedule(4, 1, device)
    out = torch.empty(4, 1, 16, 512, dtype=module.DTYPE, device=device)

    def run():  # validate=False: checking index values reads them on the host, which a capture forbids
        module.mla_decode(**inputs, kv_scale=scale, schedule=schedule, out=out, validate=False)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for value in (float(scale), float(scale) * 3):
        scale.fill_(value)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = module.mla_decode(**inputs, kv_scale=value)
        assert torch.equal(out, want)


def test_fp8_ops_take_the_scale(build_module, device):
    """The module's custom ops pass kv_scale through: the decode op equals mla_decode with the same scale, and a
    different scale changes the result (so the op does not ignore it); the cache-write op writes what
    mla_cache_write writes."""
    module = fp8_module(build_module, name="fp8-ops", num_heads=4, page_size=4)
    inputs, write = small_problem(module, device, seed=3)
    scale = torch.tensor([0.75], device=device)
    expected_cache = inputs["kv_cache"].clone()
    module.mla_cache_write(**{**write, "kv_cache": expected_cache}, kv_scale=scale)
    module.ops.cache_write(write["c_kv"], write["k_pe"], inputs["kv_cache"], write["slot_mapping"], scale)
    assert torch.equal(inputs["kv_cache"].view(torch.uint8), expected_cache.view(torch.uint8))
    args = (inputs["q"], inputs["kv_cache"], inputs["block_table"], inputs["cache_seqlens"])
    out, lse = module.ops.decode(*args, None, scale)
    want, want_lse = module.mla_decode(*args, kv_scale=scale, return_lse=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert not torch.equal(module.ops.decode(*args, None, scale * 2)[0], out)
