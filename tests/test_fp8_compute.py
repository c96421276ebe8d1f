"""The spec option cache_compute (exact | fp8) and the Gluon decode's fp8 tensor-core products it selects.

On the CPU: the option validates, reaches the plan, `mlagen show` and the hash; the products are routed to the
narrow form only (Sq * H <= 16 query rows as the MMAs' N, Dc 512), every other geometry and launch takes the exact
path and says why; the fp8 kernel renders where it applies (the source compiles to bytecode), leaves the exact
path's rendering as it was, and (offline, no GPU) compiles for sm_90a with e4m3 warpgroup MMAs. On a Hopper GPU:
the fp8 decode against the float64 reference on the dequantised cache, within a bound chosen before any run.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import DEEPSEEK_V3_TP8_SPEC, import_source

from mlagen_compiler import compile_spec, runtime
from mlagen_compiler.module_file import module_source
from mlagen_compiler.plan import lower
from mlagen_compiler.registry import registered_specs, resolve_spec
from mlagen_compiler.spec import SpecError, spec_from_dict
from mlagen_compiler.verify import (
    FP8_COMPUTE_LSE_ATOL,
    FP8_COMPUTE_REL_NORM,
    compare_decode,
    decode_reference,
    make_decode_inputs,
    poison_unused_cache,
)

FP8 = "float8_e4m3fn"
ROOT = Path(__file__).resolve().parent.parent


def fp8_spec(**fields):
    return spec_from_dict({**DEEPSEEK_V3_TP8_SPEC, "name": "fp8-compute", "cache_dtype": FP8, **fields})


def bundled_fp8_specs():
    return [name for name in sorted(registered_specs()) if resolve_spec(name).cache_format.scaled]


def takes_the_products(spec):
    """Whether cache_compute fp8 can run for this geometry: the narrow form's (H <= 16 heads, Dc 512)."""
    return spec.num_heads <= 16 and spec.kv_lora_rank == 512


def with_fp8_compute(spec):
    """A bundled spec with cache_compute fp8 (its other fields as they are)."""
    return spec_from_dict({**spec.to_flat_dict(), "name": f"{spec.name}-mma", "cache_compute": "fp8"})


# ---- the option --------------------------------------------------------------------------------------------


def test_cache_compute_defaults_to_exact_and_leaves_the_hash_as_it_was():
    spec = fp8_spec()
    assert spec.cache_compute == "exact"
    assert "cache_compute" not in spec.to_flat_dict()  # (so every existing spec's hash and module stay)
    explicit = fp8_spec(cache_compute="exact")
    assert explicit.content_hash() == spec.content_hash()
    assert fp8_spec(cache_compute="fp8").content_hash() != spec.content_hash()
    # the flat dict round-trips, the option included
    fp8 = fp8_spec(cache_compute="fp8")
    assert spec_from_dict(fp8.to_flat_dict()) == fp8


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(cache_dtype="bfloat16", cache_compute="fp8"), ["cache_compute=fp8", "cache_dtype=bfloat16", "exact"]),
        (dict(cache_dtype=None, cache_compute="fp8"), ["cache_compute=fp8", "cache_dtype=bfloat16", FP8]),
        (dict(cache_compute="int8"), ["cache_compute", "int8", "'exact'", "'fp8'"]),
        (dict(cache_compute=8), ["cache_compute", "8"]),
    ],
)
def test_cache_compute_rejects_a_bad_value_in_one_line(fields, words):
    with pytest.raises(SpecError) as info:
        fp8_spec(**fields)
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


def test_cache_compute_reaches_the_plan_and_mlagen_show():
    exact, fp8 = lower(fp8_spec()), lower(fp8_spec(cache_compute="fp8"))
    assert exact.cache_compute == "exact" and not exact.decode.gluon.fp8_compute
    assert fp8.cache_compute == "fp8" and fp8.decode.gluon.fp8_compute, fp8.decode.gluon.fp8_compute_reason
    assert fp8.decode.gluon.fp8_land_slots >= 2
    summary = fp8.summary()
    assert summary["cache_compute"] == "fp8"
    assert "e4m3 tensor-core products" in summary["decode"]["backend"]
    assert "narrow form only" in summary["decode"]["backend"]
    for words in ("where Sq * H <= 16", "docs/performance-log.md", "exact elsewhere", "portable Triton kernel keeps"):
        assert words in summary["decode"]["cache_compute"], (words, summary["decode"]["cache_compute"])
    assert "cache_compute" not in exact.summary()["decode"]
    # a geometry the Gluon decode does not take: exact everywhere, and the plan says why
    odd = lower(fp8_spec(kv_lora_rank=96, qk_rope_head_dim=16, cache_compute="fp8"))
    assert not odd.decode.gluon.fp8_compute
    assert odd.decode.gluon.fp8_compute_reason
    assert "exact everywhere" in odd.summary()["decode"]["cache_compute"]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(num_heads=128), ["H = 128 > 16", "narrow form", "docs/performance-log.md"]),
        (dict(num_heads=32, kv_lora_rank=256), ["Dc = 256", "narrow form", "docs/performance-log.md"]),
        (dict(num_heads=32), ["H = 32 > 16", "narrow form"]),
    ],
)
def test_the_wide_geometries_take_the_exact_path_and_say_why(fields, words):
    """Where no launch can be in the narrow form (more than 16 heads, or Dc other than 512) the plan takes no fp8
    products: the module holds none, and `mlagen show` says exact everywhere, and why."""
    plan = lower(fp8_spec(cache_compute="fp8", **fields))
    assert plan.cache_compute == "fp8" and not plan.decode.gluon.fp8_compute
    line = plan.summary()["decode"]["cache_compute"]
    assert line.startswith("exact everywhere") and "\n" not in line, line
    for word in words:
        assert word in line, (word, line)
    assert "_mla_decode_gluon_fp8_kernel" not in module_source(fp8_spec(cache_compute="fp8", **fields))


@pytest.mark.parametrize("name", bundled_fp8_specs())
def test_every_bundled_fp8_spec_renders_the_fp8_kernel_where_it_applies(name):
    spec = with_fp8_compute(resolve_spec(name))
    assert lower(spec).decode.gluon.fp8_compute == takes_the_products(spec)
    source = module_source(spec)
    has_kernel = "def _mla_decode_gluon_fp8_kernel(" in source and "DECODE_GLUON_FP8_COMPUTE = True" in source
    assert has_kernel == takes_the_products(spec)
    assert "def _mla_decode_gluon_kernel(" in source  # (the exact kernel: every other launch)
    compile(source, f"<{spec.name}>", "exec")


def _stable_lines(source, spec):
    """The module's lines but those naming the spec, its hash or the generator's (they differ by construction)."""
    spec_bits = (spec.content_hash(), spec.name, spec.module_name)
    return [
        line
        for line in source.splitlines()
        if not any(bit in line for bit in spec_bits) and not line.startswith(("OPS_NAMESPACE", "SPEC = "))
    ]


@pytest.mark.parametrize("name", bundled_fp8_specs())
def test_the_exact_path_renders_as_before(name):
    """cache_compute fp8 only adds to a module: every line of the exact module is there, in order, and nothing
    of the fp8 kernel is in the exact one (generated/ holds the exact modules: test_render checks them)."""
    spec = resolve_spec(name)
    exact = module_source(spec)
    assert "_gluon_f8_" not in exact and "FP8_COMPUTE" not in exact and "cache_compute" not in exact
    fp8_spec_ = with_fp8_compute(spec)
    a, b = _stable_lines(exact, spec), _stable_lines(module_source(fp8_spec_), fp8_spec_)
    changes = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op[0] != "equal"]
    if takes_the_products(spec):
        assert changes and all(tag == "insert" for tag, *_ in changes), changes[:3]
    else:  # (no products for this geometry: the exact module line for line, but the spec's provenance)
        provenance = next(i for i, line in enumerate(b) if line.startswith("# ---- provenance"))
        assert all(start >= provenance for _, _, _, start, _ in changes), changes[:3]


def test_the_schedule_takes_the_fp8_products_in_the_narrow_form_only(tmp_path):
    """runtime.gluon_fp8_compute routes a Gluon launch: the products where it is in the narrow form (Sq * H <= 16
    query rows as the MMAs' N), the exact path with a one-line reason where it is not (rows as the MMAs' M, where
    the products lost), where pages hold no whole block, where a tile is forced; a module without the products says
    nothing. The portable kernel's schedule takes the exact path and says why."""
    module = import_source(module_source(with_fp8_compute(resolve_spec("deepseek-v3-tp8-fp8"))), tmp_path, "mma")
    assert module.DECODE_GLUON_FP8_COMPUTE and module.NUM_HEADS == 16

    def route(seqlen_q, config_given=False, m=module):
        rows = seqlen_q * m.NUM_HEADS
        return runtime.gluon_fp8_compute(m, config_given, rows, m.gluon_narrow_rows(rows, m.DECODE_GLUON_NARROW_ROWS))

    assert route(1) == (True, "")
    taken, why = route(2)  # (32 query rows: the wide form)
    assert not taken and "\n" not in why, why
    for word in ("Sq * H = 32", "> 16", "narrow form", "docs/performance-log.md"):
        assert word in why, (word, why)
    # 32 query rows in the narrow form 32 wide (a large batch): the exact kernel, for the same reason
    assert runtime.gluon_fp8_compute(module, False, 32, 32) == (False, why)
    taken, why = route(1, config_given=True)  # (a forced tile: the exact kernel as given)
    assert not taken and "config=" in why, why
    exact = import_source(module_source(resolve_spec("deepseek-v3-tp8-fp8")), tmp_path, "exact")
    assert route(1, m=exact) == (False, "")
    # pages smaller than a block: TMA cannot box them, so the plan takes no products (it says why) and every launch
    # runs the exact kernel
    small_spec = fp8_spec(page_size=16, cache_compute="fp8")
    small_pages = import_source(module_source(small_spec), tmp_path, "pages16")
    taken, why = route(1, m=small_pages)
    assert not taken and not hasattr(small_pages, "_mla_decode_gluon_fp8_kernel"), why
    line = lower(small_spec).summary()["decode"]["cache_compute"]
    assert line.startswith("exact everywhere") and "pages of 16 positions" in line, line
    # the portable kernel (the interpreter, or a CPU device): exact, and the schedule says why
    schedule = module.get_decode_schedule(2, 1, torch.device("cpu"))
    assert schedule.backend == "triton" and not schedule.fp8_compute
    assert "portable Triton kernel" in schedule.fp8_compute_reason and "fp8_compute_reason=" in repr(schedule)


@pytest.mark.parametrize(("name", "seqlen_q"), [("deepseek-v3-tp8-fp8", 1)])
def test_the_fp8_kernel_compiles_for_sm90_with_e4m3_mmas(tmp_path, name, seqlen_q):
    """Offline (Triton's front end, passes and ptxas; no GPU), in a process of its own: the fp8 kernel compiles,
    its SASS holds e4m3 warpgroup MMAs (QGMMA: P V's m64n16, the narrow form's 16 query rows as N, and Q K^T's
    m64n32, the query's two terms stacked, one chain) and no 16-bit ones,
    and (without the fused merge's stack frame) nothing goes to local memory but a few of the prologue's values
    held there for the partitions (stored once, loaded once at a partition's start, as the exact kernel's): up to
    4."""
    spec = with_fp8_compute(resolve_spec(name))
    module = import_source(module_source(spec), tmp_path, "probe")
    if module._GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon kernels are not defined under this Triton: {module._GLUON_IMPORT_ERROR}")
    path = compile_spec(spec, tmp_path / "out")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    tool = ROOT / "benchmarks" / "gluon_offline_compile.py"
    done = subprocess.run(
        [sys.executable, str(tool), str(path), "--fp8-compute", "--sq", str(seqlen_q), "--combine-kernel"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"'QGMMA\.64x16x32': \d+", done.stdout), done.stdout
    assert re.search(r"'QGMMA\.64x32x32': \d+", done.stdout), done.stdout
    assert not re.search(r"'QGMMA\.64x(?!16x|32x)\d+x32'", done.stdout), done.stdout
    assert "HGMMA" not in done.stdout, done.stdout
    stores = int(re.search(r"'STL': (\d+)", done.stdout).group(1))
    assert stores <= 4, done.stdout


def emulate_fp8_products(q, latent, kv_scale, softmax_scale, dc, terms):
    """(out, lse) of one sequence as the fp8 kernel rounds them, in float64: q [rows, Dc + Dr] (bfloat16 values),
    latent [positions, Dc + Dr] the stored e4m3 values, kv_scale; the query as `terms` e4m3 terms with a scale a
    row, P = exp(s - m) * 2**8 rounded to e4m3, l the sum of the rounded P (the accumulators exact)."""
    scale = q.abs().amax(1, keepdim=True) / 448
    q8 = (q / scale).to(torch.float8_e4m3fn).double()
    if terms == 2:
        q8 = q8 + (q / scale - q8).to(torch.float8_e4m3fn).double()
    s = (q8 @ latent.T) * scale * kv_scale * softmax_scale
    m = s.amax(1, keepdim=True)
    p8 = (torch.exp(s - m) * 256.0).to(torch.float8_e4m3fn).double()
    sums = p8.sum(1, keepdim=True)
    return (p8 @ latent[:, :dc]) * kv_scale / sums, (m + torch.log(sums) - 8 * math.log(2)).squeeze(1)


@pytest.mark.parametrize("name", ["deepseek-v3-tp8-fp8"])  # (the geometry the products run in)
def test_the_fp8_rounding_model_meets_the_bound(name):
    """The kernel's rounding (plan.FP8_QUERY_TERMS e4m3 terms of the query, P in e4m3), emulated in float64 on the
    GPU test's data (N(0, 1) query and latent, kv_scale = max / 448), within the GPU test's bound at 64 to 8192
    positions. With one query term DeepSeek-V3's geometry is not (0.048-0.059 relative, LSE 0.06-0.12 off): the
    reason the plan takes two."""
    spec = resolve_spec(name)
    terms = lower(with_fp8_compute(spec)).decode.gluon.fp8_query_terms
    assert terms == 2
    dc, width = spec.kv_lora_rank, spec.kv_lora_rank + spec.qk_rope_head_dim
    scale = spec.derived_softmax_scale()
    g = torch.Generator().manual_seed(5)
    for positions in (64, 700, 8192):
        latent = torch.randn(positions, width, generator=g, dtype=torch.float64)
        kv_scale = float(latent.abs().max()) / 448
        stored = (latent / kv_scale).to(torch.float8_e4m3fn).double()
        q = torch.randn(2 * spec.num_heads, width, generator=g).to(torch.bfloat16).double()
        scores = q @ (stored * kv_scale).T * scale
        want, want_lse = torch.softmax(scores, 1) @ (stored[:, :dc] * kv_scale), torch.logsumexp(scores, 1)
        out, lse = emulate_fp8_products(q, stored, kv_scale, scale, dc, terms)
        rel = float((out - want).norm() / want.norm())
        lse_err = float((lse - want_lse).abs().max())
        assert rel <= FP8_COMPUTE_REL_NORM / 2 and lse_err <= FP8_COMPUTE_LSE_ATOL / 2, (positions, rel, lse_err)


def fp8_mma_chain(a, b, bits=13):
    """a [R, K] @ b [P, K]^T, both e4m3 values in float64, as a model of a chain of Hopper e4m3 warpgroup MMAs:
    per K step of 32, the 32 products and the running fp32 sum aligned to the largest of them and truncated
    (toward 0) to `bits` bits below its leading bit, then summed and rounded to fp32 (DeepSeek-V3's report: about
    14 bits kept on the H800; 13 reproduces the GPU's LSE errors at DeepSeek's geometry)."""
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    for k in range(0, a.shape[1], 32):
        terms = torch.cat([acc[..., None], a[:, None, k : k + 32] * b[None, :, k : k + 32]], -1)
        top = terms.abs().amax(-1, keepdim=True)
        quantum = torch.exp2(torch.floor(torch.log2(torch.where(top > 0, top, torch.ones_like(top)))) + 1 - bits)
        acc = (torch.trunc(terms / quantum) * quantum).sum(-1).float().double()
    return acc


def test_the_fp8_accumulation_model_keeps_the_lo_term_at_its_own_scale():
    """The Q K^T of the two query terms under a model of the tensor cores' fp8 accumulation (fp8_mma_chain): chained
    with the hi term first, the lo term's small products are added to a sum 2**4 larger and mostly truncated away
    (the GPU's LSE errors at DeepSeek H16 / H128 B128 S8192, 0.035-0.057, against 0.01 for exact accumulators).
    Chained lo first, or (the kernel: lo's rows stacked under hi's, one chain of N = 2 NARROW) each term summed in
    its own accumulator columns, lo's products keep their own scale. Scores at DeepSeek-V3's scale."""
    spec = resolve_spec("deepseek-v3-tp8-fp8")
    width, scale = spec.kv_lora_rank + spec.qk_rope_head_dim, spec.derived_softmax_scale()
    g = torch.Generator().manual_seed(3)
    latent = torch.randn(512, width, generator=g, dtype=torch.float64)
    kv_scale = 6.0 / 448
    k8 = (latent / kv_scale).to(torch.float8_e4m3fn).double()
    q = torch.randn(16, width, generator=g).to(torch.bfloat16).double()
    q_scale = q.abs().amax(1, keepdim=True) / 448
    hi = (q / q_scale).to(torch.float8_e4m3fn).double()
    lo = (q / q_scale - hi).to(torch.float8_e4m3fn).double()
    exact = (hi + lo) @ k8.T

    def score_error(scores):
        return float(((scores - exact) * q_scale * kv_scale * scale).pow(2).mean().sqrt())

    def chained(first, second):
        return score_error(fp8_mma_chain(torch.cat([first, second], 1), torch.cat([k8, k8], 1)))

    hi_first, lo_first = chained(hi, lo), chained(lo, hi)
    own_columns = score_error(fp8_mma_chain(hi, k8) + fp8_mma_chain(lo, k8))
    print(
        f"fp8 accumulation model: RMS score error hi first {hi_first:.4f}, lo first {lo_first:.4f},"
        f" each term in its own columns {own_columns:.4f}"
    )
    assert lo_first < 0.5 * hi_first, (hi_first, lo_first)
    assert own_columns < 0.5 * hi_first, (hi_first, own_columns)


# ---- on a Hopper GPU ------------------------------------------------------------------------------------------


def prmt_b32(a, b, selector):
    """PTX prmt.b32 in its default mode, elementwise on uint32 arrays: result byte i is byte (nibble i & 7) of the
    pair {b, a} (a's bytes 0-3, b's 4-7), or with the nibble's bit 3 set that byte's sign bit copied 8 times."""
    pair = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=np.uint32)
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = ((pair >> np.uint64(8 * (nibble & 7))) & np.uint64(0xFF)).astype(np.uint32)
        if nibble & 8:
            byte = np.where(byte & 0x80, np.uint32(0xFF), np.uint32(0))
        out |= byte << np.uint32(8 * i)
    return out


def run_prmt_asm(asm, inputs):
    """The rendered inline PTX of the V operand's 4 x 4 byte transpose (_GLUON_F8_VT_ASM: only prmt.b32 and .reg
    lines) run on uint32 arrays: inputs
    bind $4.. (after the 4 outputs $0..$3); returns the outputs."""
    regs = {f"${4 + i}": x for i, x in enumerate(inputs)}
    body = asm.strip().removeprefix("{").removesuffix("}")
    for line in filter(None, (part.strip() for part in body.split(";"))):
        if line.startswith(".reg"):
            continue
        op, operands = line.split(None, 1)
        assert op == "prmt.b32", line
        dst, a, b, selector = (x.strip() for x in operands.split(","))
        regs[dst] = prmt_b32(regs[a], regs[b], int(selector, 0))
    return [regs[f"${i}"] for i in range(4)]


def _linear_bases(semantic, layout, shape):
    linear = semantic.to_linear_layout(layout, shape).value
    return {"reg": linear.reg_bases, "lane": linear.lane_bases, "warp": linear.warp_bases}


def _linear_at(bases, reg, lane, warp):
    """The coordinate a linear layout gives register reg of lane lane of warp warp (XOR of the set bits' bases)."""
    at = np.zeros(len(bases["reg"][0]), dtype=np.int64)
    for kind, index in (("reg", reg), ("lane", lane), ("warp", warp)):
        for bit, basis in enumerate(bases[kind]):
            if index >> bit & 1:
                at ^= np.asarray(basis)
    return tuple(int(x) for x in at)


@pytest.mark.parametrize("n_valid", [64, 37])
def test_the_narrow_pv_operand_holds_v_in_sigma_and_pi_order(tmp_path, n_valid):
    """_gluon_f8_v_operand as numpy: the half's 4 landed boxes of random bytes read as words in the read layout
    (_gluon_f8_va_read_layout), positions >= n_valid zeroed, the rendered prmt.b32 transpose on each 4 registers,
    the kernel's renames (_GLUON_F8_VA_T_PERM, _GLUON_F8_VA_SIGMA_PERM) give A[m, kappa] = V[pi(kappa),
    sigma(m)] (sigma: _gluon_f8_sigma, a bijection; pi: _GLUON_F8_PI_PERM, P's store); every thread ends up
    holding exactly the A words it loaded itself (the conversions to the dot operand move no data); the bytes
    layout is the dot operand's; the reads take no extra bank wavefronts (Triton's counter); and the output store's
    sigma undoes the rows' order: O^T[sigma(m)] = (V^T P^T)."""
    module = import_source(module_source(with_fp8_compute(resolve_spec("deepseek-v3-tp8-fp8"))), tmp_path, "va")
    if module._GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon kernels are not defined under this Triton: {module._GLUON_IMPORT_ERROR}")
    from triton._C.libtriton import gluon_ir, ir, nvidia
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._semantic import GluonSemantic

    value = lambda x: getattr(x, "value", x)  # noqa: E731
    sigma = np.asarray(module._gluon_f8_sigma.fn(np.arange(256)))
    assert sorted(sigma) == list(range(256))
    assert [int(sigma[1 << b]) for b in range(8)] == [1 << value(module._GLUON_F8_VA_SIGMA_BITS).index(b) for b in
                                                      range(8)]  # fmt: skip
    pi = np.arange(64).reshape([2] * 6).transpose(value(module._GLUON_F8_PI_PERM)[:6]).reshape(64)
    # the renames on the cols tensor's flat index [box, position, word] -> [m, K word]
    flat = np.arange(4 * 64 * 16).reshape(4, 2, 2, 2, 2, 2, 2, 16).transpose(value(module._GLUON_F8_VA_T_PERM))
    flat = flat.reshape([2] * 8 + [16]).transpose(value(module._GLUON_F8_VA_SIGMA_PERM)).reshape(256, 16)

    ctx = ir.context()
    ir.load_dialects(ctx)
    nvidia.load_dialects(ctx)
    semantic = GluonSemantic(gluon_ir.GluonOpBuilder(ctx))
    read = _linear_bases(semantic, module._gluon_f8_va_read_layout(), [4, 64, 16])
    words3 = _linear_bases(semantic, module._gluon_f8_va_bytes_layout(), [256, 16, 4])
    dot = gl.DotOperandLayout(0, module._gluon_f8_mma_layout(16), 4)
    operand = _linear_bases(semantic, dot, [256, 64])
    split = {kind: [[m, 4 * w + b] for m, w, b in bases] for kind, bases in words3.items()}
    assert split == operand, (split, operand)
    # the reads of the swizzled box: no extra wavefronts by Triton's counter (32 a box, the floor)
    words_layout = value(module._GLUON_F8_WORDS_LAYOUT)
    builder = semantic.builder
    conflicts = builder.get_shared_bank_conflicts(
        module._gluon_f8_va_read_layout()._to_ir(builder), words_layout._to_ir(builder), [4, 64, 16], 32
    )
    assert conflicts == 0, conflicts

    rng = np.random.default_rng(n_valid)
    v = rng.integers(0, 256, size=(64, 256), dtype=np.uint8)  # V [positions, the half's columns]
    v[n_valid:] = 0
    words = v.reshape(64, 4, 64).transpose(1, 0, 2).copy().view("<u4")  # [box, position, word]
    asm = value(module._GLUON_F8_VT_ASM)
    for step in module._GLUON_F8_VT_PRMT:
        for selector in step:
            assert f"{selector:#06x}" in asm  # (the selectors rendered into the PTX run here)
    cols = np.zeros_like(words)
    for warp in range(4):
        for lane in range(32):
            held = set()
            for group in range(8):  # registers 4 group.. 4 group + 3: one transpose's inputs, then its outputs
                at = [_linear_at(read, 4 * group + k, lane, warp) for k in range(4)]
                outs = run_prmt_asm(asm, [np.asarray([words[a]], dtype=np.uint32) for a in at])
                for a, out in zip(at, outs, strict=True):
                    cols[a] = out[0]
                    held.add(int(np.ravel_multi_index(a, words.shape)))
            # the A words this thread holds (the bytes layout's K bit 0 and 1 registers: one word)
            mine = set()
            for reg in range(0, 128, 4):
                m, w, _ = _linear_at(words3, reg, lane, warp)
                mine.add(int(flat[m, w]))
            assert mine == held, (warp, lane)
    a = cols.reshape(-1)[flat].astype("<u4").view(np.uint8).reshape(256, 64)
    np.testing.assert_array_equal(a, v[pi][:, sigma].T)  # A[m, kappa] = V[pi(kappa), sigma(m)]
    p = rng.standard_normal((16, 64))
    out = np.empty((256, 16))
    out[sigma] = a.astype(np.float64) @ p[:, pi].T  # row m stored to column sigma(m); P^T's row kappa: P[:, pi(kappa)]
    np.testing.assert_allclose(out, v.astype(np.float64).T @ p.T)


def _require_fp8_gluon(module, device):
    if device.type != "cuda":
        pytest.skip("GPU only: the Gluon decode does not run in the interpreter")
    backend, reason = module.decode_backend(device, "auto")
    if backend != "gluon":
        pytest.skip(f"Gluon decode cannot run here: {reason}")


#: (heads, Dc, Sq, lengths): the narrow form's geometries (Sq * H <= 16, Dc 512: DeepSeek-V3 TP8 at Sq 1, and 8
#: heads at Sq 2, causal among the new tokens), lengths from one position to several thousand with last blocks
#: partly and wholly filled (pages of 64)
GPU_CASES = [
    (16, 512, 1, [1, 63, 64, 65, 700, 2049]),
    (16, 512, 1, [8192, 3, 5000, 128, 1025, 4097]),
    (8, 512, 2, [2, 129, 1000, 4097, 31, 64]),
]


@pytest.mark.parametrize("merge", ["fused", "kernel"])
@pytest.mark.parametrize(("heads", "dc", "seqlen_q", "seqlens"), GPU_CASES)
def test_fp8_compute_decode_within_its_bound(build_module, device, heads, dc, seqlen_q, seqlens, merge):
    """cache_compute fp8 on the Gluon decode against the float64 reference on the dequantised cache: random data
    (N(0, 1), never zeros), NaN in every unused cache slot (e4m3 0x7f) and in the outputs before the call. Each
    call's output within FP8_COMPUTE_REL_NORM (relative Frobenius norm), its LSE within FP8_COMPUTE_LSE_ATOL;
    no NaN or inf anywhere (so no poisoned output element survives)."""
    module = build_module(
        **{**DEEPSEEK_V3_TP8_SPEC, "name": "fp8-mma", "num_heads": heads, "kv_lora_rank": dc},
        cache_dtype=FP8,
        cache_compute="fp8",
    )
    _require_fp8_gluon(module, device)
    g = torch.Generator().manual_seed(1000 * heads + 10 * seqlen_q + len(merge))
    inputs = make_decode_inputs(module, seqlens, seqlen_q, g, device)
    poison_unused_cache(inputs)
    batch = len(seqlens)
    schedule = module.get_decode_schedule(batch, seqlen_q, device, merge=merge)
    assert schedule.backend == "gluon" and schedule.fp8_compute and schedule.narrow == 16, schedule
    out = torch.full((batch, seqlen_q, heads, dc), float("nan"), dtype=module.DTYPE, device=device)
    lse = torch.full((batch, heads, seqlen_q), float("nan"), dtype=torch.float32, device=device)
    module.mla_decode(**inputs, return_lse=True, schedule=schedule, out=out, lse=lse)
    torch.cuda.synchronize()
    want, want_lse = (t.double().cpu() for t in decode_reference(module, inputs))  # (it may run on the GPU)
    got = out.double().cpu()
    rel = float((got - want).norm() / want.norm())
    lse_err = float((lse.double().cpu() - want_lse).abs().max())
    print(f"fp8 products H{heads} Dc{dc} Sq{seqlen_q} {merge}: relative error {rel:.4f}, max LSE error {lse_err:.4f}")
    assert torch.isfinite(out).all(), "a NaN / inf (or a poisoned element) in the output"
    assert torch.isfinite(lse).all(), "a NaN / inf (or a poisoned element) in the LSE"
    assert rel <= FP8_COMPUTE_REL_NORM, f"relative error {rel:.4f} > {FP8_COMPUTE_REL_NORM}"
    assert lse_err <= FP8_COMPUTE_LSE_ATOL, f"max LSE error {lse_err:.4f} > {FP8_COMPUTE_LSE_ATOL}"


@pytest.mark.parametrize(("heads", "seqlen_q"), [(16, 2)])
def test_fp8_compute_past_the_narrow_form_runs_the_exact_path(build_module, device, heads, seqlen_q):
    """On the GPU a cache_compute fp8 module's launch with more than 16 query rows takes the exact path (its
    schedule says why), and its output is the exact fp8 path's, bit for bit."""
    fields = {**DEEPSEEK_V3_TP8_SPEC, "name": "fp8-mma-route", "num_heads": heads}
    module = build_module(**fields, cache_dtype=FP8, cache_compute="fp8")
    _require_fp8_gluon(module, device)
    exact = build_module(**{**fields, "name": "fp8-exact-route"}, cache_dtype=FP8)
    schedule = module.get_decode_schedule(4, seqlen_q, device)
    assert schedule.backend == "gluon" and not schedule.fp8_compute and schedule.narrow == 0, schedule
    assert "narrow form" in schedule.fp8_compute_reason, schedule
    g = torch.Generator().manual_seed(7 * heads + seqlen_q)
    inputs = make_decode_inputs(module, [65, 700, 3, 2049], seqlen_q, g, device)
    poison_unused_cache(inputs)
    got, got_lse = module.mla_decode(**inputs, return_lse=True, schedule=schedule)
    want, want_lse = exact.mla_decode(
        **inputs, return_lse=True, schedule=exact.get_decode_schedule(4, seqlen_q, device)
    )
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


def test_a_schedule_built_by_hand_takes_the_fp8_products_only_where_they_run(tmp_path):
    """DecodeSchedule(fp8_compute=True) outside the narrow form 16 wide, on the portable backend or for a module
    without the products is a one-line ValueError naming fp8_compute, not a launch of a kernel that is not there (or
    of one never measured nor tested: 32 wide); a narrow width that is not 16 or 32, narrower than the query rows or
    on the portable backend is one naming narrow, not a kernel computing fewer rows than the call has."""
    mma = import_source(module_source(with_fp8_compute(resolve_spec("deepseek-v3-tp8-fp8"))), tmp_path, "mma")
    exact = import_source(module_source(resolve_spec("deepseek-v3-tp8-fp8")), tmp_path, "exact")

    def schedule(module, seqlen_q, backend, narrow, fp8_compute=False):
        return module.DecodeSchedule(
            2, seqlen_q, module.DECODE_GLUON_BLOCK_M, 8, 1, module.DECODE_GLUON_DEFAULT, 132, backend=backend,
            narrow=narrow, fp8_compute=fp8_compute,
        )  # fmt: skip

    for module, seqlen_q, backend, narrow in ((mma, 1, "gluon", 0), (exact, 1, "gluon", 16), (mma, 2, "gluon", 32)):
        with pytest.raises(ValueError, match=r"^fp8_compute: ") as error:
            schedule(module, seqlen_q, backend, narrow, fp8_compute=True)
        assert "\n" not in str(error.value) and f"backend={backend!r}" in str(error.value)
    # (H16: Sq 1 is 16 query rows, Sq 2 is 32)
    for seqlen_q, backend, narrow in ((2, "gluon", 16), (1, "gluon", 24), (1, "triton", 16), (3, "gluon", 32)):
        with pytest.raises(ValueError, match=r"^narrow: ") as error:
            schedule(exact, seqlen_q, backend, narrow)
        assert "\n" not in str(error.value) and f"narrow={narrow!r}" in str(error.value)
    assert schedule(exact, 2, "gluon", 32).narrow == 32 and schedule(mma, 1, "gluon", 16, fp8_compute=True).fp8_compute


def test_mlagen_verify_judges_a_decode_by_the_products_bound_where_the_launch_ran_them():
    """compare_decode (what `mlagen verify` judges a decode call by): a launch that ran the fp8 products by their
    bound (FP8_COMPUTE_REL_NORM, FP8_COMPUTE_LSE_ATOL), any other by its dtype's tolerances. An output 3% off passes
    the first and fails the second; 10% off fails both."""
    g = torch.Generator().manual_seed(3)
    ref, ref_lse = torch.randn(4, 1, 16, 512, generator=g).double(), torch.randn(4, 16, 1, generator=g).double()
    noise = torch.randn(ref.shape, generator=g).double()
    near = ref + 0.03 * noise * ref.norm() / noise.norm()
    far = ref + 0.10 * noise * ref.norm() / noise.norm()
    assert compare_decode(near, ref_lse, ref, ref_lse, "bfloat16", True)[2] == ""
    assert compare_decode(near, ref_lse, ref, ref_lse, "bfloat16", False)[2] != ""
    assert "relative norm error" in compare_decode(far, ref_lse, ref, ref_lse, "bfloat16", True)[2]
    assert compare_decode(far, ref_lse, ref, ref_lse, "bfloat16", False)[2] != ""


def _launch_for(module, kv_cache, seqlen_q=1, narrow=16):
    """The Gluon launch decode_gluon_split prepares for a cache_compute fp8 schedule (built, not launched: CPU
    tensors; the kernel's arguments bound by name)."""
    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    batch = 3
    schedule = module.DecodeSchedule(
        batch, seqlen_q, module.DECODE_GLUON_BLOCK_M, 8, 1,
        (module.DECODE_GLUON_BLOCK_N, module.DECODE_GLUON_CONSUMER_REGS, module.DECODE_GLUON_STAGES), 132,
        backend="gluon", merge="fused", land_slots=module.DECODE_GLUON_FP8_LAND_SLOTS, fp8_compute=True,
        narrow=narrow,
    )  # fmt: skip
    q = torch.zeros(batch, seqlen_q, module.NUM_HEADS, width, dtype=module.DTYPE)
    table = torch.zeros(batch, 4, dtype=torch.int32)
    lens = torch.full((batch,), 100, dtype=torch.int32)
    out = torch.empty(batch, seqlen_q, module.NUM_HEADS, module.KV_LORA_RANK, dtype=module.DTYPE)
    lse = torch.empty(batch, module.NUM_HEADS, seqlen_q, dtype=torch.float32)
    inputs = (q, kv_cache, table, lens, out, lse, torch.ones(1))
    return runtime.decode_gluon_split(module, inputs, schedule.workspace("cpu"), 0.1, schedule, True, float("-inf"))


def test_the_fp8_launch_binds_every_kernel_argument(tmp_path):
    """decode_gluon_split gives the fp8 kernel exactly its arguments where TMA boxes the cache, and the exact
    kernel (the plan's ring, one block landing at a time) where it cannot."""
    module = import_source(module_source(with_fp8_compute(resolve_spec("deepseek-v3-tp8-fp8"))), tmp_path, "bind")
    if module._GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon kernels are not defined under this Triton: {module._GLUON_IMPORT_ERROR}")
    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    cache = torch.zeros(8, module.PAGE_SIZE, 1, width, dtype=torch.float8_e4m3fn)
    launch = _launch_for(module, cache)
    assert launch.kernel is module._mla_decode_gluon_fp8_kernel
    assert len(launch.values) == len(module._mla_decode_gluon_fp8_kernel.arg_names)
    names = module._mla_decode_gluon_fp8_kernel.arg_names
    assert "STAGES" not in names  # (no V^T stages: V is read from the landed blocks)
    assert launch.values[names.index("SLOTS")] == module.DECODE_GLUON_FP8_LAND_SLOTS
    assert launch.values[names.index("Q_TERMS")] == module.DECODE_GLUON_FP8_QUERY_TERMS == 2
    assert launch.values[names.index("NARROW")] == 16
    assert launch.values[names.index("CONVERT_WARPS")] == module.DECODE_GLUON_NARROW_LAND_WARPS
    # rows off the [pages * page_size, Dc + Dr] matrix TMA boxes: the exact kernel, rows loaded by its converters
    wide = torch.zeros(8, module.PAGE_SIZE, 1, width + 16, dtype=torch.float8_e4m3fn)[..., :width]
    fallback = _launch_for(module, wide)
    exact_names = module._mla_decode_gluon_kernel.arg_names
    assert fallback.kernel is module._mla_decode_gluon_kernel
    assert fallback.values[exact_names.index("STAGES")] == module.DECODE_GLUON_STAGES
    assert fallback.values[exact_names.index("LAND_SLOTS")] == 1
    assert fallback.values[exact_names.index("PRODUCER")] in ("convert", "convert_bytes")
