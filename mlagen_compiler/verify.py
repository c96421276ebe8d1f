"""Run generated kernels against the PyTorch reference on fresh random inputs (`mlagen verify`).

On a GPU the kernels run natively; without one, in Triton's interpreter on smaller cases. Tolerances are
per dtype and fixed here, for the tests and the CLI alike.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = [
    "TOLERANCES",
    "poison_unused_cache",
    "CaseResult",
    "PrefillCase",
    "decode_cases",
    "make_decode_inputs",
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


def make_decode_inputs(module: ModuleType, seqlens, seqlen_q: int, generator, device) -> dict[str, Any]:
    """Random q and paged cache for `seqlens`, pages shuffled so neighbours are never adjacent."""
    import torch

    page_size = module.PAGE_SIZE
    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    batch = len(seqlens)
    pages_per_seq = [max(1, -(-s // page_size)) for s in seqlens]
    max_pages = max(pages_per_seq)
    num_pages = sum(pages_per_seq) + 3
    perm = torch.randperm(num_pages, generator=generator)
    block_table = torch.full((batch, max_pages), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        block_table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    dtype = module.DTYPE
    kv_cache = torch.randn(num_pages, page_size, 1, width, generator=generator).to(dtype)
    q = torch.randn(batch, seqlen_q, module.NUM_HEADS, width, generator=generator).to(dtype)
    return {
        "q": q.to(device),
        "kv_cache": kv_cache.to(device),
        "block_table": block_table.clamp_min(0).to(device),
        "cache_seqlens": torch.tensor(seqlens, dtype=torch.int32, device=device),
    }


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
        return max_err, rel, str(error).splitlines()[0]
    if not rel <= tol["rel_norm"]:
        return max_err, rel, f"relative norm error {rel:.3g} > {tol['rel_norm']}"
    return max_err, rel, ""


def decode_reference(module: ModuleType, inputs: dict[str, Any], softmax_scale: float | None = None):
    """float64 reference of `module.mla_decode(**inputs)`: (out, lse)."""
    from .reference import decode_paged

    scale = module.SOFTMAX_SCALE if softmax_scale is None else softmax_scale
    return decode_paged(
        inputs["q"].double(),
        inputs["kv_cache"].double(),
        inputs["block_table"],
        inputs["cache_seqlens"],
        module.KV_LORA_RANK,
        scale,
    )


def run_decode_case(module: ModuleType, case: DecodeCase, generator, device) -> CaseResult:
    import torch

    inputs = make_decode_inputs(module, case.seqlens, case.seqlen_q, generator, device)
    schedule = module.get_decode_schedule(
        len(case.seqlens), case.seqlen_q, device, num_parts=case.num_parts, min_blocks_per_part=case.min_blocks_per_part
    )
    out, lse = module.mla_decode(**inputs, return_lse=True, schedule=schedule)
    ref_out, ref_lse = decode_reference(module, inputs)
    max_err, rel, message = compare(out, ref_out, module.SPEC["dtype"])
    if not message:
        try:
            torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
        except AssertionError as error:
            message = "lse: " + str(error).splitlines()[0]
    # the kernel column names the backend that ran (gluon on Hopper where it applies, else triton)
    kernel = f"decode/{getattr(schedule, 'backend', 'triton')}"
    return CaseResult(module.SPEC["name"], kernel, case.name, max_err, rel, not message, message)


def verify_module(module: ModuleType, seed: int, on_gpu: bool, progress: Callable[[str], None]) -> list[CaseResult]:
    import torch

    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    results = []
    if hasattr(module, "mla_decode"):
        for i, case in enumerate(decode_cases(module.PAGE_SIZE, on_gpu)):
            progress(f"{module.SPEC['name']}: decode {case.name}")
            generator = torch.Generator().manual_seed(seed * 1000 + i)
            results.append(run_decode_case(module, case, generator, device))
    if hasattr(module, "mla_prefill"):
        for i, case in enumerate(prefill_cases(on_gpu)):
            progress(f"{module.SPEC['name']}: prefill {case.name}")
            generator = torch.Generator().manual_seed(seed * 1000 + 500 + i)
            results += run_prefill_case(module, case, generator, device)
    for i, case in enumerate(cache_write_cases(on_gpu)):
        progress(f"{module.SPEC['name']}: cache_write {case.name}")
        generator = torch.Generator().manual_seed(seed * 1000 + 800 + i)
        results.append(run_cache_write_case(module, case, generator, device))
    return results


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


def run_prefill_case(module: ModuleType, case: PrefillCase, generator, device) -> list[CaseResult]:
    """mla_prefill and mla_chunked_prefill on one set of random inputs."""
    import torch

    from .reference import chunked_prefill, prefill_varlen

    heads, dn, dr, dv = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM
    dc, dtype, name = module.KV_LORA_RANK, module.DTYPE, module.SPEC["name"]
    total = sum(case.seqlens)

    def rnd(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(device)

    q, k_nope, k_pe, v = rnd(total, heads, dn + dr), rnd(total, heads, dn), rnd(total, dr), rnd(total, heads, dv)
    bounds = [0]
    for n in case.seqlens:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)

    def judge(kernel, out, lse, ref_out, ref_lse) -> CaseResult:
        max_err, rel, message = compare(out, ref_out, module.SPEC["dtype"])
        if not message:
            try:
                torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
            except AssertionError as error:
                message = "lse: " + str(error).splitlines()[0]
        return CaseResult(name, kernel, case.name, max_err, rel, not message, message)

    results = []
    out, lse = module.mla_prefill(q, k_nope, k_pe, v, cu, max(case.seqlens), return_lse=True)
    ref = prefill_varlen(q.double(), k_nope.double(), k_pe.double(), v.double(), bounds, module.SOFTMAX_SCALE)
    results.append(judge("prefill", out, lse, *ref))

    page = module.PAGE_SIZE
    pages = [max(1, -(-n // page)) for n in case.prefix_lens]
    perm = torch.randperm(sum(pages) + 2, generator=generator)
    table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    table = table.to(device)
    cache = rnd(sum(pages) + 2, page, 1, dc + dr)
    w_uk, w_uv = rnd(heads, dn, dc) / dc**0.5, rnd(heads, dv, dc) / dc**0.5
    prefix = torch.tensor(case.prefix_lens, dtype=torch.int32, device=device)
    out, lse = module.mla_chunked_prefill(
        q, k_nope, k_pe, v, cu, max(case.seqlens), cache, table, prefix, w_uk, w_uv, return_lse=True
    )
    ref = chunked_prefill(
        q.double(), k_nope.double(), k_pe.double(), v.double(), bounds, cache.double(), table, case.prefix_lens,
        w_uk.double(), w_uv.double(), module.SOFTMAX_SCALE, expanded_dtype=dtype,
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
    """mla_cache_write against reference.cache_write, bit for bit, on a cache full of random rows."""
    import torch

    from .reference import cache_write

    dc, dr, page, dtype = module.KV_LORA_RANK, module.QK_ROPE_HEAD_DIM, module.PAGE_SIZE, module.DTYPE
    num_pages = max(case.num_pages, -(-case.num_tokens // page))
    cache = torch.randn(num_pages, page, 1, dc + dr, generator=generator).to(dtype).to(device)
    slots = torch.randperm(num_pages * page, generator=generator)[: case.num_tokens]
    slots[::5] = -1  # padding tokens are skipped
    slots = slots.to(device)
    c_kv = torch.randn(case.num_tokens, dc, generator=generator).to(dtype).to(device)
    rope = torch.randn(case.num_tokens, dr, generator=generator).to(dtype).to(device)
    want = cache_write(cache, c_kv, rope, slots)
    module.mla_cache_write(c_kv, rope, cache, slots)
    same = bool(torch.equal(cache, want))
    return CaseResult(module.SPEC["name"], "cache_write", case.name, 0.0, 0.0, same, "" if same else "cache differs")


def use_interpreter_if_no_gpu() -> bool:
    """Select Triton's interpreter before any generated module is imported; True when on a GPU."""
    import torch

    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    return on_gpu
