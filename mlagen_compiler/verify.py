"""Run generated kernels against the PyTorch reference on fresh random inputs (`mlagen verify`).

On a GPU the kernels run natively; without one, in Triton's interpreter on smaller cases. Tolerances are
per dtype and fixed here, for the tests and the CLI alike.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = [
    "LSE_TOLERANCE",
    "TOLERANCES",
    "poison_unused_cache",
    "CaseResult",
    "PrefillCase",
    "compare",
    "compare_with_lse",
    "compare_fp8_compute",
    "FP8_COMPUTE_REL_NORM",
    "FP8_COMPUTE_LSE_ATOL",
    "cu_seqlens",
    "decode_cases",
    "make_decode_inputs",
    "random_cache",
    "same_bits",
    "paged_block_table",
    "random_mha",
    "prefill_cases",
    "run_decode_case",
    "run_prefill_case",
]

#: (atol, rtol) for outputs in the kernel's dtype, and the bound on ||out - ref|| / ||ref||.
#: bf16 keeps 8 mantissa bits (the probabilities are rounded to it before the PV product), fp16 keeps 11.
TOLERANCES: dict[str, dict[str, float]] = {
    "bfloat16": {"atol": 2e-2, "rtol": 2e-2, "rel_norm": 1e-2},
    "float16": {"atol": 3e-3, "rtol": 3e-3, "rel_norm": 2e-3},
}
#: the log-sum-exp is accumulated in fp32 from the same rounded inputs in both
LSE_TOLERANCE = {"atol": 1e-3, "rtol": 1e-3}


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    name: str
    seqlens: tuple[int, ...]
    seqlen_q: int = 1
    num_parts: int | None = None
    min_blocks_per_part: int | None = None


@dataclasses.dataclass(frozen=True)
class CaseResult:
    spec: str
    kernel: str
    case: str
    max_abs_error: float
    rel_norm_error: float
    passed: bool
    detail: str = ""


def decode_cases(page_size: int, on_gpu: bool) -> list[DecodeCase]:
    """Lengths around page boundaries, varlen, Sq > 1, and several split counts."""
    p = page_size
    if on_gpu:
        return [
            DecodeCase("B=1 S=1", (1,)),
            DecodeCase("B=4 page edges", (p - 1 if p > 1 else 1, p, p + 1, 3 * p)),
            DecodeCase("B=8 varlen Sq=2", (4096, 17, 1000, 2 * p + 1, 513, 7, 3000, 64), seqlen_q=2),
            DecodeCase("B=4 skewed Sq=4", (4641, 45118, 1730, 1696), seqlen_q=4),
            DecodeCase("B=32 S=2048", (2048,) * 32),
        ]
    return [
        DecodeCase("B=1 S=1", (1,)),
        DecodeCase("B=3 page edges", (max(1, p - 1), p + 1, 2 * p), num_parts=3, min_blocks_per_part=1),
        DecodeCase("B=2 varlen Sq=2", (37, 5), seqlen_q=2, num_parts=4, min_blocks_per_part=1),
    ]


def paged_block_table(
    seqlens: Sequence[int], page_size: int, generator, *, spare_pages: int = 0, align: int = 1
) -> tuple[Any, int]:
    """A shuffled page table for sequences of `seqlens` tokens: (block_table [B, width] int32 on the
    generator's device, number of pages in the pool).

    Every sequence owns max(1, ceil(length / page_size)) distinct pages, in random order over a pool with
    `spare_pages` pages nobody owns. Slots past a sequence's pages point at random pages of the pool, as a
    serving engine's stale entries would: a kernel that reads past a sequence's end reads real, wrong data,
    which the reference check catches. `align` rounds the table width and the pool up to a multiple (the
    tuner keeps warm-up and timed inputs in one Triton specialization that way).
    """
    import torch

    def round_up(value: int) -> int:
        return -(-value // align) * align

    pages_per_seq = [max(1, -(-int(s) // page_size)) for s in seqlens]
    width = round_up(max(pages_per_seq))
    num_pages = round_up(sum(pages_per_seq) + spare_pages)
    device = generator.device
    perm = torch.randperm(num_pages, generator=generator, device=device).to(torch.int32)
    table = torch.randint(
        0, num_pages, (len(pages_per_seq), width), generator=generator, dtype=torch.int32, device=device
    )
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = perm[used : used + n]
        used += n
    return table, num_pages


def cu_seqlens(lengths: Sequence[int], device) -> Any:
    """[0, l0, l0 + l1, ...] as an int32 tensor: the packed layout's sequence boundaries."""
    import torch

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + int(n))
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def random_mha(module: ModuleType, num_tokens: int, generator, device) -> tuple[Any, Any, Any, Any]:
    """Random q [T, H, Dn+Dr], k_nope [T, H, Dn], k_pe [T, Dr], v [T, H, Dv] in the module's dtype, drawn
    from `generator` on its own device and moved to `device`."""
    import torch

    heads, dn, dr, dv = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM

    def rnd(*shape):
        return torch.randn(*shape, generator=generator, device=generator.device).to(module.DTYPE).to(device)

    return rnd(num_tokens, heads, dn + dr), rnd(num_tokens, heads, dn), rnd(num_tokens, dr), rnd(num_tokens, heads, dv)


def random_cache(module: ModuleType, num_pages: int, generator, device) -> tuple[Any, Any]:
    """(kv_cache, kv_scale): a paged cache of random latent rows, N(0, 1) and never all zeros, as the module
    stores them, drawn from `generator` on its own device and moved to `device`.

    A 16-bit cache holds the rows (kv_scale None). A scaled (fp8) cache holds quantize_latent(rows, kv_scale)
    with kv_scale = max |row value| / 448, as a per-layer calibration sets it (the largest value lands on
    the format's largest), as a float32 tensor of one element on `device`.
    """
    import torch

    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    latent = torch.randn(num_pages, module.PAGE_SIZE, 1, width, generator=generator, device=generator.device)
    fmt = module.CACHE_FORMAT
    if not fmt.scaled:
        return latent.to(module.DTYPE).to(device), None
    kv_scale = (latent.abs().amax() / fmt.max_abs).reshape(1)
    return fmt.quantize(latent, kv_scale).to(device), kv_scale.to(device)


def same_bits(a, b) -> bool:
    """Bit-for-bit equality (torch.equal lacks fp8 on the CPU; NaN payloads count too)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu()))


def make_decode_inputs(module: ModuleType, seqlens, seqlen_q: int, generator, device) -> dict[str, Any]:
    """Random q and paged cache for `seqlens` (see paged_block_table), data N(0, 1), never zeros.

    A module with a scaled (fp8) cache also gets its `kv_scale` (see random_cache), as the generator picks:
    a number, a 0-d or a one-element float32 tensor (all three forms mla_decode takes).
    """
    import torch

    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    block_table, num_pages = paged_block_table(seqlens, module.PAGE_SIZE, generator, spare_pages=3)
    kv_cache, kv_scale = random_cache(module, num_pages, generator, device)
    q = torch.randn(len(seqlens), seqlen_q, module.NUM_HEADS, width, generator=generator).to(module.DTYPE)
    inputs = {
        "q": q.to(device),
        "kv_cache": kv_cache,
        "block_table": block_table.to(device),
        "cache_seqlens": torch.tensor(seqlens, dtype=torch.int32, device=device),
    }
    if kv_scale is not None:
        form = int(torch.randint(0, 3, (1,), generator=generator))
        inputs["kv_scale"] = (float(kv_scale), kv_scale.reshape(()), kv_scale)[form]
    return inputs


def _error_text(error: AssertionError) -> str:
    """torch.testing's report (what differs, where, by how much) on one line."""
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip())


def poison_unused_cache(inputs: dict[str, Any]) -> None:
    """NaN into every cache slot no sequence owns: the slots of a last page past its sequence's end and the
    pages nobody uses. Uninitialised cache memory may hold anything; no kernel may let it reach an output."""
    import torch

    kv_cache = inputs["kv_cache"]
    page_size = kv_cache.shape[1]
    table = inputs["block_table"].cpu()
    owned = torch.zeros(kv_cache.shape[0], page_size, dtype=torch.bool)
    for b, length in enumerate(inputs["cache_seqlens"].cpu().tolist()):
        for i in range(-(-length // page_size)):
            owned[int(table[b, i]), : min(page_size, length - i * page_size)] = True
    if kv_cache.element_size() == 1:
        # fp8 (no masked fill in torch): e4m3fn's NaN, 0x7f (Triton's interpreter reads it as 480, a GPU as NaN)
        kv_cache.view(torch.uint8)[~owned.to(kv_cache.device)] = 0x7F
    else:
        kv_cache[~owned.to(kv_cache.device)] = float("nan")


def compare(out, ref, dtype_name: str) -> tuple[float, float, str]:
    """Max abs error, relative norm error and a failure message ('' when within tolerance)."""
    import torch

    tol = TOLERANCES[dtype_name]
    out64, ref64 = out.double().cpu(), ref.double().cpu()  # the reference may live on the CPU
    max_err = float((out64 - ref64).abs().nan_to_num(float("inf")).max()) if out.numel() else 0.0
    denom = float(ref64.norm()) or 1.0
    rel = float((out64 - ref64).norm()) / denom
    try:
        torch.testing.assert_close(out64, ref64, atol=tol["atol"], rtol=tol["rtol"])
    except AssertionError as error:
        return max_err, rel, _error_text(error)
    if not rel <= tol["rel_norm"]:
        return max_err, rel, f"relative norm error {rel:.3g} > {tol['rel_norm']}"
    return max_err, rel, ""


def compare_with_lse(out, lse, ref_out, ref_lse, dtype_name: str) -> tuple[float, float, str]:
    """`compare` of the outputs, then the log-sum-exps within LSE_TOLERANCE: (max abs error, relative norm
    error, '' or what is wrong)."""
    import torch

    max_err, rel, message = compare(out, ref_out, dtype_name)
    if not message:
        try:
            torch.testing.assert_close(lse.double().cpu(), ref_lse.double().cpu(), **LSE_TOLERANCE)
        except AssertionError as error:
            message = "lse: " + _error_text(error)
    return max_err, rel, message


#: the fp8 products' bound (cache_compute fp8), chosen before any run: the relative Frobenius error of the whole
#: output, and the largest LSE error (natural log), against the float64 reference on the dequantised cache
FP8_COMPUTE_REL_NORM = 0.05
FP8_COMPUTE_LSE_ATOL = 0.05


def compare_fp8_compute(out, lse, ref_out, ref_lse) -> tuple[float, float, str]:
    """The fp8 products' (max abs error, relative norm error, '' or what is wrong): every element finite, the whole
    output within FP8_COMPUTE_REL_NORM and every LSE within FP8_COMPUTE_LSE_ATOL."""
    import torch

    out64, ref64 = out.double().cpu(), ref_out.double().cpu()
    lse64, ref_lse64 = lse.double().cpu(), ref_lse.double().cpu()
    max_err = float((out64 - ref64).abs().nan_to_num(float("inf")).max())
    rel = float((out64 - ref64).norm() / ref64.norm())
    lse_err = float((lse64 - ref_lse64).abs().nan_to_num(float("inf")).max())
    message = ""
    if not (torch.isfinite(out64).all() and torch.isfinite(lse64).all()):
        message = "fp8 products: a NaN / inf (or an unwritten element) in the output or LSE"
    elif not rel <= FP8_COMPUTE_REL_NORM:
        message = f"fp8 products: relative norm error {rel:.4f} > {FP8_COMPUTE_REL_NORM}"
    elif not lse_err <= FP8_COMPUTE_LSE_ATOL:
        message = f"fp8 products: max LSE error {lse_err:.4f} > {FP8_COMPUTE_LSE_ATOL}"
    return max_err, rel, message


def compare_decode(out, lse, ref_out, ref_lse, dtype_name: str, fp8_products: bool) -> tuple[float, float, str]:
    """A decode call's outputs against the reference: by the fp8 products' bound (compare_fp8_compute) where the
    launch multiplied e4m3 operands (its schedule's fp8_compute), else by its dtype's tolerances
    (compare_with_lse)."""
    if fp8_products:
        return compare_fp8_compute(out, lse, ref_out, ref_lse)
    return compare_with_lse(out, lse, ref_out, ref_lse, dtype_name)


def decode_reference(
    module: ModuleType, inputs: dict[str, Any], softmax_scale: float | None = None, causal: bool = True
):
    """float64 reference of `module.mla_decode(**inputs, causal=causal)`: (out, lse), over the dequantised cache."""
    from .reference import decode_paged, dequantize_cache

    scale = module.SOFTMAX_SCALE if softmax_scale is None else softmax_scale
    return decode_paged(
        inputs["q"].double(),
        dequantize_cache(inputs["kv_cache"], inputs.get("kv_scale")),
        inputs["block_table"],
        inputs["cache_seqlens"],
        module.KV_LORA_RANK,
        scale,
        causal,
    )


def run_decode_case(module: ModuleType, case: DecodeCase, generator, device) -> CaseResult:
    inputs = make_decode_inputs(module, case.seqlens, case.seqlen_q, generator, device)
    schedule = module.get_decode_schedule(
        len(case.seqlens), case.seqlen_q, device, num_parts=case.num_parts, min_blocks_per_part=case.min_blocks_per_part
    )
    out, lse = module.mla_decode(**inputs, return_lse=True, schedule=schedule)
    max_err, rel, message = compare_decode(
        out, lse, *decode_reference(module, inputs), module.SPEC["dtype"], getattr(schedule, "fp8_compute", False)
    )
    # the kernel column names the backend that ran (gluon on Hopper where it applies, else triton)
    kernel = f"decode/{getattr(schedule, 'backend', 'triton')}"
    return CaseResult(module.SPEC["name"], kernel, case.name, max_err, rel, not message, message)


def verify_module(module: ModuleType, seed: int, on_gpu: bool, progress: Callable[[str], None]) -> list[CaseResult]:
    """Every kind of kernel the module holds (plan.KERNEL_KINDS), each kind's cases on fresh random inputs."""
    from .plan import KERNEL_KINDS

    results = []
    for number, kind in enumerate(KERNEL_KINDS):
        if not kind.on_request or kind.name in module.SPEC["kernels"]:
            results += globals()[kind.verify](module, seed * 1000 + 100 * number, on_gpu, progress)
    return results


def _cases(name, cases, run, module, seed, on_gpu, progress) -> list[CaseResult]:
    import torch

    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    results = []
    for i, case in enumerate(cases):
        progress(f"{module.SPEC['name']}: {name} {case.name}")
        result = run(module, case, torch.Generator().manual_seed(seed + i), device)
        results += result if isinstance(result, list) else [result]
    return results


def verify_decode(module: ModuleType, seed: int, on_gpu: bool, progress: Callable[[str], None]) -> list[CaseResult]:
    return _cases("decode", decode_cases(module.PAGE_SIZE, on_gpu), run_decode_case, module, seed, on_gpu, progress)


def verify_prefill(module: ModuleType, seed: int, on_gpu: bool, progress: Callable[[str], None]) -> list[CaseResult]:
    """mla_prefill and mla_chunked_prefill (with merge_attn_states inside it)."""
    return _cases("prefill", prefill_cases(on_gpu), run_prefill_case, module, seed, on_gpu, progress)


def verify_cache_write(
    module: ModuleType, seed: int, on_gpu: bool, progress: Callable[[str], None]
) -> list[CaseResult]:
    return _cases("cache_write", cache_write_cases(on_gpu), run_cache_write_case, module, seed, on_gpu, progress)


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    name: str
    seqlens: tuple[int, ...]  # new tokens per sequence
    prefix_lens: tuple[int, ...]  # cached prefix per sequence (chunked prefill)


def prefill_cases(on_gpu: bool) -> list[PrefillCase]:
    """Lengths around the tile sizes (GPU: 64/128, interpreter: 16), uneven batches, empty prefixes."""
    if on_gpu:
        return [
            PrefillCase("B=1 S=1", (1,), (0,)),
            PrefillCase("B=6 tile edges", (1, 127, 128, 129, 700, 1500), (0, 64, 1, 2000, 129, 900)),
        ]
    return [PrefillCase("B=3 varlen", (1, 17, 33), (0, 5, 20))]


def run_prefill_case(
    module: ModuleType, case: PrefillCase, generator, device, config: tuple[int, ...] | None = None
) -> list[CaseResult]:
    """mla_prefill and mla_chunked_prefill on one set of random inputs.

    config: a prefill tile configuration to force (the tuner checks each one), of the backend in force's kind
    (mla_prefill's config); default: the module's choice.
    """
    import torch

    from .reference import chunked_prefill, dequantize_cache, prefill_varlen

    heads, dn, dv = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.V_HEAD_DIM
    dc, dtype, name = module.KV_LORA_RANK, module.DTYPE, module.SPEC["name"]
    total = sum(case.seqlens)

    def rnd(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(device)

    q, k_nope, k_pe, v = random_mha(module, total, generator, device)
    cu = cu_seqlens(case.seqlens, device)

    def judge(kernel, out, lse, ref_out, ref_lse) -> CaseResult:
        max_err, rel, message = compare_with_lse(out, lse, ref_out, ref_lse, module.SPEC["dtype"])
        return CaseResult(name, kernel, case.name, max_err, rel, not message, message)

    results = []
    out, lse = module.mla_prefill(q, k_nope, k_pe, v, cu, max(case.seqlens), return_lse=True, config=config)
    ref = prefill_varlen(q.double(), k_nope.double(), k_pe.double(), v.double(), cu.cpu(), module.SOFTMAX_SCALE)
    results.append(judge("prefill", out, lse, *ref))

    page = module.PAGE_SIZE
    table, num_pages = paged_block_table(case.prefix_lens, page, generator, spare_pages=2)
    table = table.to(device)
    cache, kv_scale = random_cache(module, num_pages, generator, device)
    w_uk, w_uv = rnd(heads, dn, dc) / dc**0.5, rnd(heads, dv, dc) / dc**0.5
    prefix = torch.tensor(case.prefix_lens, dtype=torch.int32, device=device)
    out, lse = module.mla_chunked_prefill(
        q, k_nope, k_pe, v, cu, max(case.seqlens), cache, table, prefix, w_uk, w_uv, kv_scale=kv_scale,
        return_lse=True, config=config,
    )  # fmt: skip
    ref = chunked_prefill(
        q.double(), k_nope.double(), k_pe.double(), v.double(), cu.cpu(), dequantize_cache(cache, kv_scale), table,
        case.prefix_lens, w_uk.double(), w_uv.double(), module.SOFTMAX_SCALE, expanded_dtype=dtype,
    )  # fmt: skip
    results.append(judge("chunked", out, lse, *ref))
    return results


@dataclasses.dataclass(frozen=True)
class CacheWriteCase:
    name: str
    num_tokens: int
    num_pages: int


def cache_write_cases(on_gpu: bool) -> list[CacheWriteCase]:
    """One token; many tokens over pages in random order (every fifth a padding token, slot -1)."""
    if on_gpu:
        return [CacheWriteCase("T=1", 1, 2), CacheWriteCase("T=2500 shuffled", 2500, 64)]
    return [CacheWriteCase("T=1", 1, 2), CacheWriteCase("T=37 shuffled", 37, 5)]


def run_cache_write_case(module: ModuleType, case: CacheWriteCase, generator, device) -> CaseResult:
    """mla_cache_write against reference.cache_write, bit for bit, on a cache full of random rows (an fp8
    cache: quantised with its kv_scale, bit for bit torch's conversion)."""
    import torch

    from .reference import cache_write

    dc, dr, page, dtype = module.KV_LORA_RANK, module.QK_ROPE_HEAD_DIM, module.PAGE_SIZE, module.DTYPE
    num_pages = max(case.num_pages, -(-case.num_tokens // page))
    cache, kv_scale = random_cache(module, num_pages, generator, device)
    slots = torch.randperm(num_pages * page, generator=generator)[: case.num_tokens]
    slots[::5] = -1  # padding tokens are skipped
    slots = slots.to(device)
    c_kv = torch.randn(case.num_tokens, dc, generator=generator).to(dtype).to(device)
    rope = torch.randn(case.num_tokens, dr, generator=generator).to(dtype).to(device)
    want = cache_write(cache, c_kv, rope, slots, kv_scale)
    module.mla_cache_write(c_kv, rope, cache, slots, kv_scale=kv_scale)
    same = same_bits(cache, want)
    return CaseResult(module.SPEC["name"], "cache_write", case.name, 0.0, 0.0, same, "" if same else "cache differs")


def use_interpreter_if_no_gpu() -> bool:
    """Select Triton's interpreter before any generated module is imported; True when on a GPU."""
    import torch

    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    return on_gpu
